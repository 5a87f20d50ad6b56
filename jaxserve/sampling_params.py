"""SamplingParams: vLLM's sampling options, with their meanings and defaults, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16         # None = up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None         # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind_delta: bool = False     # internal: stream deltas instead of cumulative outputs
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, max_logprobs: int | None = None) -> None:
        def bad(name, allowed):
            raise ValueError(f"{name} must be {allowed}; got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "an integer >= 1")
        if self.temperature < 0:
            bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "-1 (off), 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "an integer >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                bad(name, ">= 0")
            if v is not None and max_logprobs is not None and v > max_logprobs:
                bad(name, f"<= {max_logprobs} (the server's max_logprobs)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
