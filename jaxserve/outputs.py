"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput objects."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None              # 1 = most likely; None when unknown
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int                           # which of the request's n samples
    text: str                            # generated text so far (stop string removed)
    token_ids: list[int]                 # generated token ids so far
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None   # one entry per generated token, if asked
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop token id / stop string that ended it
    # LLM.chat with a reasoning parser: `text` split into the thinking and the answer
    reasoning: str | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None   # first entry None, as in vLLM
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None             # set when the request failed alone (finish_reason "error")
    extra: dict = field(default_factory=dict)
