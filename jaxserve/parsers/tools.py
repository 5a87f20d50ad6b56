"""Tool-call parsers by vLLM's `--tool-call-parser` names (the formats: json_calls.py,
xml_calls.py; the streaming machinery: calls.py)."""

from __future__ import annotations

from jaxserve.parsers import by_name

from jaxserve.parsers.calls import ToolParser
from jaxserve.parsers.json_calls import (DeepSeekV3, DeepSeekV31, Hermes, Llama3Json, Mistral,
                                         Pythonic)
from jaxserve.parsers.xml_calls import DeepSeekV32, MiniMaxM2, Qwen3Coder, Qwen3Xml

TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (
    Hermes, Llama3Json, Mistral, DeepSeekV3, DeepSeekV31, DeepSeekV32, Qwen3Coder, Qwen3Xml,
    MiniMaxM2, Pythonic)}


def tool_parser(name: str) -> ToolParser:
    """The parser named `name`; an unknown name is refused, listing the known ones."""
    return by_name(TOOL_PARSERS, "--tool-call-parser", name)
