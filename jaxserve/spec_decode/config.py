"""`speculative_config`: vLLM's keys, checked once (a ValueError names the key and what it
may be)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model", "mtp", "eagle3")
NOT_BUILT = ("eagle", "medusa")           # vLLM's methods this engine does not have
MAX_SPEC_TOKENS = 8
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
DEFAULT_LOOKUP = 5                              # vLLM's n-gram size when neither bound is given


def _check(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"speculative_config[{name!r}] must be {allowed}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP    # ngram: shortest suffix matched
    prompt_lookup_max: int = DEFAULT_LOOKUP    # ngram: longest suffix matched
    model: str | None = None                   # draft_model: the draft's checkpoint

    def __post_init__(self):
        _check(self.method in METHODS, "method",
               f"one of {', '.join(METHODS)} ({', '.join(NOT_BUILT)} are not built in jaxserve yet)",
               self.method)
        _check(isinstance(self.num_speculative_tokens, int) and
               1 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS,
               "num_speculative_tokens", f"an integer from 1 to {MAX_SPEC_TOKENS}",
               self.num_speculative_tokens)
        _check(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
               "prompt_lookup_min", "an integer >= 1", self.prompt_lookup_min)
        _check(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "prompt_lookup_max", f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})",
               self.prompt_lookup_max)
        _check(self.method not in ("draft_model", "eagle3") or bool(self.model), "model",
               "the draft model's checkpoint (a HF directory or .gguf; for eagle3 the HF head's "
               "directory) with method 'draft_model' or 'eagle3'", self.model)

    @classmethod
    def from_dict(cls, d: dict | str | None) -> "SpeculativeConfig | None":
        """From vLLM's dict (or its JSON text, as on the command line); None stays None."""
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            return d
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object; {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict; got {type(d).__name__}")
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r}; the keys are "
                             f"{', '.join(KEYS)}")
        method = d.get("method") or ("draft_model" if d.get("model") else None)
        if method is None:
            raise ValueError(f"speculative_config['method'] must be one of {', '.join(METHODS)}; "
                             f"got none")
        if "num_speculative_tokens" not in d:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an integer from "
                             f"1 to {MAX_SPEC_TOKENS}; got none")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi or DEFAULT_LOOKUP), (hi if hi is not None else lo or DEFAULT_LOOKUP)
        return cls(method=method, num_speculative_tokens=d["num_speculative_tokens"],
                   prompt_lookup_min=lo, prompt_lookup_max=hi, model=d.get("model"))
