"""SamplingParams: vLLM's sampling options, with their meanings and defaults, validated once.

`SamplingParams(...)` checks everything that needs no model knowledge; the engine then calls
`validate(max_logprobs=..., vocab_size=...)` with the model's limits. Every error names the
field, the allowed range and the value it got.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from jaxserve.structured.params import StructuredOutputsParams

DEFAULT_MAX_LOGPROBS = 20      # engine default for logprobs / prompt_logprobs (vLLM's)
MAX_LOGIT_BIAS_ENTRIES = 300   # logit_bias entries per request: a fixed-size device array
LOGIT_BIAS_RANGE = 100.0       # |bias| allowed, as in the OpenAI API
MAX_FLOAT32 = 3.4e38            # the device works in float32: larger values would become inf
GREEDY_TEMPERATURE = 1e-5      # temperatures below this sample greedily (vLLM's epsilon)


@dataclass
class SamplingParams:
    n: int = 1                          # completions per prompt
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0                  # nucleus mass kept, (0, 1]; 1 = off
    top_k: int = 0                      # tokens kept; 0 or -1 = off (stored as 0)
    min_p: float = 0.0                  # drop tokens with p < min_p * p_max; 0 = off
    presence_penalty: float = 0.0       # subtracted once from tokens already generated
    frequency_penalty: float = 0.0      # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0     # divides (>0) / multiplies (<0) logits of tokens seen in prompt or output
    seed: int | None = None             # None = the engine picks one
    max_tokens: int | None = 16         # None = up to max_model_len
    min_tokens: int = 0                 # EOS and stop_token_ids are banned until this many tokens
    stop: str | list[str] | None = None          # stop strings (normalized to a list)
    stop_token_ids: list[int] | None = None      # extra token ids that end generation
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False            # keep going past EOS (min/max_tokens still apply)
    logprobs: int | None = None         # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None   # if set, only these tokens can be sampled
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # False: no text, token ids only (vLLM's offline option: detokenizing every token of 256
    # requests was ~30 % of the engine's host time per step, cProfile on the CPU machine)
    detokenize: bool = True
    # "cumulative": a RequestOutput every step the request advances (streaming); "final_only":
    # only when it finishes (LLM.generate: building per-step outputs of 256 requests was
    # ~15 % of the engine's host time per step, cProfile on the CPU machine).
    output_kind: str = "cumulative"
    # The output must match a JSON schema, regex, choice or grammar (jaxserve/structured/).
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            # JSON object keys arrive as strings ("50256": -100).
            self.logit_bias = {_token_id("logit_bias", k): v for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    def validate(self, max_logprobs: int | None = None, vocab_size: int | None = None) -> None:
        """Raise ValueError on the first invalid field; limits are checked when given."""
        _check_int(self, "n", lo=1)
        _check_float(self, "temperature", ">= 0 that float32 holds (0 = greedy)",
                     lambda v: 0 <= v <= MAX_FLOAT32)
        _check_float(self, "top_p", "in (0, 1]", lambda v: 0 < v <= 1)
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            _bad("top_k", "-1 (off), 0 (off) or a positive integer below 2**31", self.top_k)
        _check_float(self, "min_p", "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_float(self, "presence_penalty", "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float(self, "frequency_penalty", "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float(self, "repetition_penalty", "> 0 that float32 holds (1 = off)",
                     lambda v: 0 < v <= MAX_FLOAT32)
        if self.seed is not None and not _is_int(self.seed):
            _bad("seed", "an integer or None", self.seed)
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", lo=1)
        _check_int(self, "min_tokens", lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(self, name, lo=0, hi=max_logprobs,
                           hint=" (the engine's max_logprobs)" if max_logprobs is not None else "")
        if any(not isinstance(s, str) or not s for s in self.stop):
            _bad("stop", "a string or a list of non-empty strings", self.stop)
        if self.stop and not self.detokenize:
            _bad("stop", "empty when detokenize=False (stop strings are matched in the text)", self.stop)
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                _bad("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries (use allowed_token_ids "
                     "to restrict sampling to a larger set)", f"{len(self.logit_bias)} entries")
            _check_token_ids("logit_bias", list(self.logit_bias), vocab_size)
            for tok, bias in self.logit_bias.items():
                if not _is_real(bias) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                    _bad("logit_bias", f"values in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
                         f"{bias!r} for token {tok}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                _bad("allowed_token_ids", "None or a non-empty list of token ids", [])
            _check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            _bad("structured_outputs", "None, a StructuredOutputsParams or a dict of its fields",
                 self.structured_outputs)
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            _bad("output_kind", "'cumulative', 'delta' or 'final_only'", self.output_kind)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def uses_truncation(self) -> bool:
        """Whether min_p, top_k or top_p cut the distribution (a sort over the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def _bad(name: str, allowed: str, got) -> None:
    raise ValueError(f"{name} must be {allowed}; got {got!r}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _check_int(p: SamplingParams, name: str, lo: int, hi: int | None = None, hint: str = "") -> None:
    v = getattr(p, name)
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        allowed = f"an integer in [{lo}, {hi}]{hint}" if hi is not None else f"an integer >= {lo}"
        _bad(name, allowed, v)


def _check_float(p: SamplingParams, name: str, allowed: str, ok) -> None:
    v = getattr(p, name)
    if not _is_real(v) or not ok(v):
        _bad(name, f"a finite number {allowed}", v)


def _token_id(name: str, key) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise ValueError(f"{name} keys must be token ids (integers); got {key!r}") from None


def _check_token_ids(name: str, ids: list, vocab_size: int | None) -> None:
    hi = None if vocab_size is None else vocab_size - 1
    for tok in ids:
        if not _is_int(tok) or tok < 0 or (hi is not None and tok > hi):
            allowed = f"token ids in [0, {hi}] (the vocabulary)" if hi is not None else "token ids >= 0"
            _bad(name, allowed, tok)
