"""What one layer keeps between steps: its cache spec (DESIGN.md §3)."""
from __future__ import annotations
import math
from dataclasses import dataclass

@dataclass(frozen=True)
class PagedSpec:
    """Per-token arrays in the paged cache: name -> per-token shape; each array is
    [num_blocks, P, *shape] and token t is written at slot_mapping[t].
    An array named in `tokens_per_row` holds one row per m tokens instead (DeepSeek V4's
    compressed entries): [num_blocks, max(1, P // m), *shape], where the model places rows.
    Arrays named in `window_arrays` live in the sliding-window group (kv_cache/manager.py): their
    own blocks and block table (StepInput.window_block_tables), a token at position p reading
    only positions p - sliding_window + 1 .. p of them, so blocks wholly older than that are
    freed as the request advances. The other arrays stay on the full group's block table."""
    arrays: tuple[tuple[str, tuple[int, ...]], ...]   # e.g. (("k", (K, E)), ("v", (K, E)))
    sliding_window: int | None = None   # tokens a position reads back, itself included
    tokens_per_row: tuple[tuple[str, int], ...] = ()   # e.g. (("comp", 4),)
    window_arrays: tuple[str, ...] = ()   # e.g. ("kv",): on the sliding-window group

    def __post_init__(self):
        names = {name for name, _ in self.arrays}
        if self.window_arrays and (not self.sliding_window or self.sliding_window < 1):
            raise ValueError(f"PagedSpec.window_arrays {self.window_arrays} need sliding_window >= 1; "
                             f"got {self.sliding_window}")
        if not set(self.window_arrays) <= names - {n for n, _ in self.tokens_per_row}:
            raise ValueError(f"PagedSpec.window_arrays {self.window_arrays} must name per-token "
                             f"arrays of the spec: {sorted(names)}")

    def rows(self, name: str, block_size: int) -> int:
        """Rows of array `name` in one block of block_size tokens."""
        m = dict(self.tokens_per_row).get(name, 1)
        return max(1, block_size // m)

    def elements_per_block(self, block_size: int, window: bool = False) -> int:
        """Elements of one block of the full group's arrays (window: the window group's)."""
        return sum(self.rows(name, block_size) * math.prod(shape) for name, shape in self.arrays
                   if (name in self.window_arrays) == window)

@dataclass(frozen=True)
class StateSpec:
    """Fixed-size per-request state (linear attention): name -> per-sequence shape; each array is
    [num_slots, *shape], slot 0 is the null slot; a sequence reads and writes its state at
    StepInput.state_slots[s]."""
    arrays: tuple[tuple[str, tuple[int, ...]], ...]   # e.g. (("conv", (C, W-1)), ("ssm", (H, V, K)))
    # Arrays kept in f32 whatever the cache dtype: a recurrent state accumulates over the
    # whole sequence, so bf16 rounding would compound.
    float32: tuple[str, ...] = ()
