"""A request's state inside the scheduler: WAITING -> RUNNING -> (PREEMPTED -> RUNNING ->) FINISHED.

Only the scheduler holds `Request`s; the runner and output processing get data
(jaxserve/step_messages.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"        # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"       # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"       # cancelled by the caller (or a disconnect)
    FINISHED_ERROR = "error"         # failed alone (e.g. an exception while handling it)

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0             # tokens whose KV is in the cache (or being computed)
    num_output_placeholders: int = 0         # tokens sampled on the device, not yet seen here
                                             # (0 or 1; up to num_scheduler_steps with multi-step)
    spec_token_ids: list[int] = field(default_factory=list)   # draft tokens for the next step
    # The drafts of its newest step still on the device: computed, assumed right until the
    # step is read (a step after it may already be scheduled on that assumption)
    inflight_drafts: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0               # of the prompt, found in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None     # the stop token id or stop string that ended it
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0                            # sampling seed (random when the user gave none)
    first_token_time: float | None = None
    error: str | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens so far, counting those still on their way back from the device."""
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (the decode hot path)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
