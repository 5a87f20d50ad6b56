"""The Proposer contract: what the engine asks of a drafting method, and nothing else.

A proposer is built in two stages (engine/builder.py). Constructed, it states what it asks
of the target's runner (`target_needs`: its caches on the target's block tables and the
bytes of its weights, which the runner's cache sizing pays for; the drafts it leaves on the
device; whether the target's steps return hidden states, and of which layers). Then the
runner is built and the proposer is bound to a read-only view of it (`bind`, a
worker/target_view.py TargetView): it allocates its caches there, loads what loads after
the sizing, builds its own runner (a draft model). It never writes the runner's state: the
last ids its pass writes drafts into are an input and an output of `after_dispatch`.

Each step, the engine core calls, in order: `after_dispatch` right after a step is launched
(a proposer running on the device behind the step queues its pass there), `observe` once
the step's tokens are read, then `retain` and `propose` (spec_decode/drafting.py: which
requests draft, and how many tokens at most). A proposer that `pipelines` also proposes
ahead, for requests whose step is still on the device (drafting.propose_ahead).

The base class holds the defaults (no needs, nothing after dispatch, nothing to observe,
nothing to compile); each method overrides what differs.
"""

from __future__ import annotations

from jaxserve.worker.target_view import TargetNeeds, TargetView


class Proposer:
    method: str = ""                # what drafts: one of spec_decode/config.py METHODS
    k: int = 0                      # drafts per request at most (num_speculative_tokens)
    pipelines: bool = False         # proposes ahead of a step still on the device (drafting.py)
    num_lookahead_tokens: int = 0   # positions past a scheduled chunk whose blocks it writes
    # Positions its drafts may reach when fewer than the target's max_model_len (a draft
    # model shorter than the target); None: the target's. Past it a request goes on undrafted
    max_positions: int | None = None
    # What it asks of the target's runner (TargetNeeds' fields say what each is)
    target_cache_specs: tuple = ()
    target_weight_bytes: int = 0
    device_draft_columns: int = 0
    needs_hidden_states: bool = False
    aux_layers: tuple[int, ...] = ()

    def target_needs(self) -> TargetNeeds:
        """What the target's runner is built with for this proposer."""
        return TargetNeeds(cache_specs=tuple(self.target_cache_specs),
                           weight_bytes=self.target_weight_bytes,
                           draft_columns=self.device_draft_columns,
                           hidden_states=self.needs_hidden_states, aux_layers=tuple(self.aux_layers))

    def bind(self, target: TargetView) -> None:
        """The target's runner exists: take what the proposer reads of it."""

    def propose(self, requests, limits: list[int], tails=None) -> list[list[int]]:
        """Drafts per request (scheduler Requests in decode), each at most its limit; with
        `tails`, ahead of a step still on the device (drafting.py)."""
        raise NotImplementedError

    def retain(self, running_ids) -> None:
        """Forget every request but these (ended or preempted): per-request state is freed."""

    def after_dispatch(self, step, prev_ids):
        """A target step (worker/runner.py InFlightStep) was just launched: queue whatever runs
        behind it on the device. Takes the runner's last ids and returns those the next step
        reads (with drafts in their columns, for a proposer that leaves them there)."""
        return prev_ids

    def observe(self, out, step, result) -> None:
        """The step's tokens were read (its SchedulerOutput, InFlightStep and RunnerOutput)."""

    def warmup(self) -> None:
        """Start compiling the proposer's programs (after the target's warm-up); returns at once."""

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        """Wait until every program `warmup` started is compiled."""
