"""The step contract: what the scheduler tells the runner, and what the runner answers.

    scheduler.schedule() -> SchedulerOutput -> runner.execute() -> RunnerOutput
                         -> scheduler.update() -> [RequestUpdate] -> output processing

Both messages are plain, picklable data (ids, ints, lists, numpy arrays, frozen parameter
objects), never a live `Request`: exactly what a second host would receive. The runner keeps
its own copy of each running request (its persistent batch), built from `NewRequestData`
once and patched from each step's `ScheduledRequest` diffs; the tokens it samples it appends
itself, so running requests need no token ids in the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner does not hold: sent when it starts or resumes after preemption."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]     # tokens generated before a preemption (empty when new)
    sampling_params: SamplingParams
    seed: int                       # sampling seed (the engine picks one if the user gave none)
    eos_token_ids: tuple[int, ...]  # banned until min_tokens are generated
    lora_slot: int = 0              # the device slot of its LoRA adapter (0: none; lora/slots.py)


# A draft id standing for one a proposer made on the device after the step before, which the
# host has not read (spec_decode/hidden_steps.py): the step takes it there, as it takes that
# step's sampled token.
DRAFT_ON_DEVICE = -1


# NOTE: slots, not frozen, for the per-request messages: a frozen dataclass's __init__ took
# ~4x as long, and the scheduler makes one per running request per step.
@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the step, in step order (not changed once sent)."""
    req_id: str
    start_position: int             # num_computed_tokens before this step
    num_tokens: int                 # tokens computed this step, draft tokens included
    new_block_ids: list[list[int]]  # per cache group: appended to the request's table/slots
    sample: bool                    # the chunk reaches the request's last token: sample after it
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify: the last tokens
                                    # (DRAFT_ON_DEVICE each: the proposer's, still on the device)
    save_state_slot: int = 0        # hybrid prefix caching: the saved-state slot this chunk's
                                    # final state is copied to (0: none; also in state_saves)
    num_steps: int = 1              # multi-step decode: the one-token chunk is computed, sampled
                                    # and fed back this many times on the device, so positions
                                    # start .. start + num_steps - 1 are computed and as many
                                    # tokens sampled (the same for every request of a step)

    @property
    def num_positions(self) -> int:
        """Positions whose K/V this step computes."""
        return self.num_tokens + self.num_steps - 1


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]   # requests the runner must add before this step
    scheduled: list[ScheduledRequest]    # the step's requests, running ones first
    finished_req_ids: list[str]          # ended or preempted since the last step: drop them
    num_tokens: int                      # tokens computed this step
    preempted_ids: list[str]             # requests preempted while building this step
    num_cached_tokens: int               # prompt tokens this step's new requests found cached
    # Hybrid prefix caching (kv_cache/state_cache.py), state slot pairs (source, destination):
    # saved states copied into new requests' slots before the step (their prefix hits), and
    # live slots copied into saved-state slots after it (chunks ending on a block boundary).
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # LoRA slots to write before the step: (slot, adapter int id) (lora/slots.py)
    lora_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduled]

    @property
    def num_steps(self) -> int:
        """Decode steps the device runs for this step (multi-step decode; else 1)."""
        return self.scheduled[0].num_steps if self.scheduled else 1


@dataclass(frozen=True)
class GrammarMasks:
    """A step's grammar masks (structured output), made on the engine's side
    (structured/manager.py) once the step is built; the runner ANDs them into its sampling
    rows' allowed-token masks."""
    req_ids: list[str]      # the constrained requests that sample this step, in step order
    bits: np.ndarray        # u8[R, W] packed allowed tokens (token t: bit t % 8 of byte t // 8),
                            # request by request: a row per draft it verifies (the mask after
                            # the drafts before it), then its own row (after all of them)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of the tokens sampled for one request this step (one row per token)."""
    chosen: np.ndarray              # f32[n] the sampled token's logprob
    ranks: np.ndarray               # i32[n] its rank under the model's distribution (1 = top)
    top_ids: np.ndarray             # i32[n, N] the N most likely tokens
    top_logprobs: np.ndarray        # f32[n, N]


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens a chunk's positions predict."""
    start: int                      # position of the chunk's first token
    chosen: np.ndarray              # f32[n] logprob of prompt token start + 1 + j
    top_ids: np.ndarray             # i32[n, N]
    top_logprobs: np.ndarray        # f32[n, N]


@dataclass(frozen=True)
class RunnerOutput:
    req_ids: list[str]                          # the step's requests, in step order
    sampled_token_ids: list[list[int]]          # per request: tokens kept (empty: no sample)
    logprobs: list[TokenLogprobs | None]        # per request, when asked
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    hidden_states: dict[int, np.ndarray] | None = None   # layer -> f[T, D], for proposers
