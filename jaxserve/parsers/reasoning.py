"""Reasoning parsers (vLLM's `--reasoning-parser NAME`): a thinking model's output -> its
thinking (`reasoning`) and its answer (`content`).

Every family served here thinks between `<think>` and `</think>` (single tokens in their
vocabularies, but text deltas may still split them: the output processor holds text back for
stop strings, and a partial tag is held back here until the next delta decides it). What
differs is where the thinking starts:

- `deepseek_r1`: the output starts inside the thinking (R1's template opens it); a `<think>`
  the model writes again is dropped; no `</think>` at all means it all was thinking.
- `qwen3`: the output thinks only from a `<think>` it writes (the hybrid models), or from the
  start when the prompt left a `<think>` open (the -Thinking models' templates).
- `deepseek_v3`: V3.1 / V3.2 think only when asked (`chat_template_kwargs` `thinking` or
  `enable_thinking`, as vLLM reads them); then as deepseek_r1, else all is content.
- `minimax_m2`: MiniMax-M2 never writes the opening tag: the output starts inside it.
- `minimax_m2_append_think`: no split; the content is the raw output with the opening
  `<think>` put back in front (for clients that keep M2's thinking in the history).

For all: a prompt that ends in a closed thinking block (`enable_thinking: false` renders
`<think>\\n\\n</think>\\n\\n` into Qwen3's prompt; V3.1's non-thinking prompt ends in `</think>`)
starts in the content. The one state machine (`ReasoningStream`) serves both the streamed and
the whole response (`split` feeds it the whole text), so the two always agree.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import ClassVar

from jaxserve.parsers import by_name, held_prefix


class Phase(enum.Enum):
    BEFORE = "before"          # not thinking yet; a `<think>` opens it
    REASONING = "reasoning"
    CONTENT = "content"        # thinking is over (or never comes): the rest is content


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One output's split, fed text deltas in order (`final` on the last)."""

    def __init__(self, parser: "ReasoningParser", phase: Phase):
        self.parser = parser
        self.phase = phase
        self.held = ""
        self.saw_reasoning = phase is Phase.REASONING

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        start, end = self.parser.start_tag, self.parser.end_tag
        buf, reasoning, content = self.held + text, [], []
        self.held = ""
        while buf:
            if self.phase is Phase.CONTENT:
                content.append(buf)
                break
            tags = (start, end) if self.phase is Phase.REASONING else (start,)
            hits = [(buf.find(t), t) for t in tags if t in buf]
            if hits:
                i, tag = min(hits)
                (reasoning if self.phase is Phase.REASONING else content).append(buf[:i])
                buf = buf[i + len(tag):]
                if tag == end:
                    self.phase = Phase.CONTENT
                elif self.phase is Phase.BEFORE:     # (a `<think>` inside the thinking is dropped)
                    self.phase, self.saw_reasoning = Phase.REASONING, True
                continue
            keep = 0 if final else held_prefix(buf, tags)
            (reasoning if self.phase is Phase.REASONING else content).append(buf[:len(buf) - keep])
            self.held = buf[len(buf) - keep:]
            break
        return ReasoningDelta("".join(reasoning), "".join(content))


class ReasoningParser:
    """A family's thinking format; `stream` makes the state machine of one output."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # where an output starts when the prompt does not say (it neither leaves a `<think>`
    # open nor ends in a closed block)
    default_phase: ClassVar[Phase] = Phase.REASONING

    def initial_phase(self, prompt_text: str | None, template_kwargs: dict) -> Phase:
        tail = (prompt_text or "").rstrip()
        last_start, last_end = tail.rfind(self.start_tag), tail.rfind(self.end_tag)
        if tail.endswith(self.end_tag):
            return Phase.CONTENT
        if last_start > last_end:
            return Phase.REASONING
        return self.default_phase

    def stream(self, prompt_text: str | None, template_kwargs: dict | None = None) -> ReasoningStream:
        return ReasoningStream(self, self.initial_phase(prompt_text, template_kwargs or {}))

    def thinks_first(self, prompt_text: str | None, template_kwargs: dict | None = None) -> bool:
        """Whether the output may think before its answer: a grammar then waits for the
        end-of-thinking token (vLLM's structured output with a reasoning parser)."""
        return self.initial_phase(prompt_text, template_kwargs or {}) is not Phase.CONTENT

    def needs_special_tokens(self, is_special) -> bool:
        """Whether the tags are special tokens of this vocabulary (`is_special`: text -> bool):
        decoding would then drop them, so the request must keep special tokens."""
        return is_special(self.start_tag) or is_special(self.end_tag)

    def end_token_id(self, encode) -> int | None:
        """The end-of-thinking token's id (`encode`: text -> token ids), for the grammar to
        wait on; None if the vocabulary does not hold the tag as one token."""
        ids = encode(self.end_tag)
        return ids[0] if len(ids) == 1 else None

    def grammar_after_thinking(self, structured, encode, prompt_text: str | None,
                               template_kwargs: dict | None = None):
        """`structured` (a StructuredOutputsParams, or None) with the end-of-thinking token as
        its `reasoning_end_token_id` when the output thinks first: the grammar then constrains
        only the answer. Unchanged when it does not think (or the tag is no single token)."""
        if structured is None or not self.thinks_first(prompt_text, template_kwargs):
            return structured
        end = self.end_token_id(encode)
        return structured if end is None else dataclasses.replace(structured, reasoning_end_token_id=end)

    def split(self, text: str, prompt_text: str | None,
              template_kwargs: dict | None = None) -> tuple[str | None, str | None]:
        """A whole output's (reasoning, content): None where there is none (the reasoning is
        None only when the output never thought)."""
        s = self.stream(prompt_text, template_kwargs)
        d = s.feed(text, final=True)
        return (d.reasoning if s.saw_reasoning else None), (d.content or None)


class DeepSeekR1(ReasoningParser):
    name = "deepseek_r1"


class Qwen3(ReasoningParser):
    name = "qwen3"
    default_phase = Phase.BEFORE


class DeepSeekV3(ReasoningParser):
    name = "deepseek_v3"

    def initial_phase(self, prompt_text, template_kwargs) -> Phase:
        if not (template_kwargs.get("thinking") or template_kwargs.get("enable_thinking")):
            return Phase.CONTENT
        return super().initial_phase(prompt_text, template_kwargs)


class MiniMaxM2(ReasoningParser):
    name = "minimax_m2"


class _AppendThinkStream(ReasoningStream):
    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        first, self.phase = self.phase is not Phase.CONTENT, Phase.CONTENT
        return ReasoningDelta("", (self.parser.start_tag if first else "") + text)


class MiniMaxM2AppendThink(ReasoningParser):
    name = "minimax_m2_append_think"

    def stream(self, prompt_text, template_kwargs=None) -> ReasoningStream:
        return _AppendThinkStream(self, Phase.BEFORE)    # (its grammar still waits for </think>)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1, DeepSeekV3, Qwen3, MiniMaxM2, MiniMaxM2AppendThink)}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name`; an unknown name is refused, listing the known ones."""
    return by_name(REASONING_PARSERS, "--reasoning-parser", name)
