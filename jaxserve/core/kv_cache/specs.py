"""What one layer keeps between steps: its cache spec (DESIGN.md §3)."""
from __future__ import annotations
from dataclasses import dataclass

@dataclass(frozen=True)
class PagedSpec:
    """Per-token arrays in the paged cache, all on the request's block table: name -> per-token
    shape; each array is [num_blocks, P, *shape] and token t is written at slot_mapping[t]."""
    arrays: tuple[tuple[str, tuple[int, ...]], ...]   # e.g. (("k", (K, E)), ("v", (K, E)))
    sliding_window: int | None = None

@dataclass(frozen=True)
class StateSpec:
    """Fixed-size per-request state (linear attention): name -> per-sequence shape; each array is
    [num_slots, *shape], slot 0 is the null slot; a sequence reads and writes its state at
    StepInput.state_slots[s]."""
    arrays: tuple[tuple[str, tuple[int, ...]], ...]   # e.g. (("conv", (C, W-1)), ("ssm", (H, V, K)))
    # Arrays kept in f32 whatever the cache dtype: a recurrent state accumulates over the
    # whole sequence, so bf16 rounding would compound.
    float32: tuple[str, ...] = ()
