"""Tokenizers, chat templates and incremental detokenization.

A HF directory's tokenizer is loaded with `transformers` (local files only). A GGUF file's
tokenizer is rebuilt from its metadata with the `tokenizers` library (byte-level BPE, as
llama.cpp's `gpt2`-model files carry) and wrapped the same way, so both give the same API,
including the chat template (rendered by transformers with jinja2).
"""

from __future__ import annotations

import os
from typing import Any

# llama.cpp `tokenizer.ggml.pre` -> the pre-tokenizer split regex HF uses for that family.
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact"):
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pt.Sequence([pt.Split(Regex(_LLAMA3_REGEX), "isolated"), byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pt.Sequence([pt.Split(Regex(_QWEN2_REGEX), "isolated"), byte_level])
    return pt.Sequence([pt.Split(Regex(_GPT2_REGEX), "isolated"), byte_level])


def tokenizer_from_gguf_metadata(meta: dict[str, Any]):
    """A transformers fast tokenizer rebuilt from GGUF `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole, before BPE.
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t in (3, 4)])

    def tok_name(key):
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and idx < len(tokens) else None

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=tok_name("bos"), eos_token=tok_name("eos"),
        unk_token=tok_name("unknown"), pad_token=tok_name("padding"),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)
    hf_tok.add_bos_token = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    return hf_tok


class Tokenizer:
    """The engine's view of a tokenizer: encode, decode, chat template, special ids."""

    def __init__(self, hf_tokenizer, add_bos: bool = False, eos_token_ids: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        self.add_bos = add_bos
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], eos_token_ids=()) -> "Tokenizer":
        tok = tokenizer_from_gguf_metadata(meta)
        return cls(tok, add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   eos_token_ids=eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: str, eos_token_ids=()) -> "Tokenizer":
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(tok, add_bos=False, eos_token_ids=eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special_token(self, text: str) -> bool:
        """Whether `text` is one special token (one that decoding with skip_special_tokens
        drops: a parser that reads it as text needs the request to keep special tokens)."""
        return any(t.content == text and t.special for t in self.hf.added_tokens_decoder.values())

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        if chat_template is None and not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass one or use completions")
        return self.hf.apply_chat_template(messages, tokenize=False, chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt, **kwargs)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    A byte-level BPE token may end mid-character; text is only released once the decoded
    tail no longer ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # Decode a few prompt tokens as context so that leading spaces come out right.
        self.ids = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns the newly released text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
