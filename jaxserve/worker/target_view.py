"""What a proposer (spec_decode/) and the target's runner know of each other.

Built in this order (engine/builder.py): the proposer's static needs first (`TargetNeeds`:
its caches on the target's block tables are sized with the target's, the hidden states it
reads shape the target's programs), then the runner, then the proposer is bound to a
`TargetView` of it. The view is read-only: a proposer never writes the runner's state, and
the last ids it writes drafts into are an explicit input and output of its pass
(Proposer.after_dispatch), handed over by the engine core.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxserve.config import ModelConfig
from jaxserve.core.step_input import StepInput


@dataclasses.dataclass(frozen=True)
class TargetNeeds:
    """What a proposer asks of the target's runner, known before the runner is built."""
    cache_specs: tuple = ()          # paged caches on the target's block tables (sized with them)
    weight_bytes: int = 0            # its weights, loaded after the caches are sized: paid first
    draft_columns: int = 0           # drafts per sequence it leaves on the device after each token
    hidden_states: bool = False      # every step also returns hidden states (StepVariant.hidden) ...
    aux_layers: tuple[int, ...] = ()  # ... the residual streams after these layers (else the final)


@dataclasses.dataclass(frozen=True)
class TargetView:
    """What a bound proposer may read of the target's runner."""
    cfg: ModelConfig
    family: Any                      # models/interface.py ModelFamily
    params: Any                      # the weights as the target's steps read them (MTP layers, embed)
    block_size: int
    num_blocks: int
    buckets: tuple[int, ...]         # the target's step sizes: a pass after a step of T is one of T
    dtype: Any
    attention_impl: str
    last_ids: jax.ShapeDtypeStruct   # the runner's last ids i32[M, 1 + draft columns] (abstract)
    # the hidden states a step of this bucket returns, once its program is compiled (else None)
    hidden_spec: Callable[[int], jax.ShapeDtypeStruct | None]
    # (StepInput, StepPlan) of an empty step of this bucket: the shapes a pass compiles for
    empty_step: Callable[[int], tuple[StepInput, Any]]
    num_window_blocks: int = 0       # its sliding-window group's blocks (kv_cache/manager.py)
