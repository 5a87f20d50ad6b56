"""Copies between state slots on the device, for hybrid models' prefix caching.

The scheduler names (source, destination) slot pairs (SchedulerOutput.state_loads / _saves:
kv_cache/manager.py says why); the runner runs them in their own small program, before or
after the step program. Device order is dispatch order, so a save is written before any later
step reads it, and a load before the step that needs it. Steps without copies run no extra
program; a copy moves only the named slots of the state layers, never the paged caches.

The pairs are padded to a power of two with (0, 0), the null slot copied onto itself: one
compiled program per pair-count bucket, all compiled by warm-up.
"""

from __future__ import annotations

import jax
import numpy as np


def copy_slots(states: list[dict[str, jax.Array]], src_K, dst_K) -> list[dict[str, jax.Array]]:
    """Every array of every state layer with rows dst_K[i] set to rows src_K[i] (all reads
    before all writes; destinations are distinct but for padding's slot 0)."""
    return [{name: a.at[dst_K].set(a[src_K]) for name, a in layer.items()} for layer in states]


def pair_buckets(max_pairs: int) -> list[int]:
    """Pair counts that get a program: powers of two up to max_pairs, and max_pairs."""
    out, b = [], 1
    while b < max_pairs:
        out.append(b)
        b *= 2
    return out + [max_pairs]


class StateCopier:
    def __init__(self, state_layers: list[int], max_pairs: int):
        """state_layers: indices of the layers whose cache is a state (conv, ssm); max_pairs:
        the most copies of one kind a step asks for (one per sequence of a step)."""
        self.state_layers = state_layers
        self.buckets = pair_buckets(max_pairs)
        self._programs: dict[int, object] = {}     # bucket -> compiled program

    def _program(self, states, bucket: int):
        if bucket not in self._programs:
            # The states keep their placement (on a mesh: the step program expects it)
            shardings = jax.tree.map(lambda a: a.sharding, states)
            copy = jax.jit(copy_slots, donate_argnums=(0,), out_shardings=shardings)
            idx = jax.ShapeDtypeStruct((bucket,), np.int32)
            self._programs[bucket] = copy.lower(states, idx, idx).compile()
        return self._programs[bucket]

    def warmup(self, caches: list[dict[str, jax.Array]]) -> None:
        states = [caches[i] for i in self.state_layers]
        for bucket in self.buckets:
            self._program(states, bucket)

    def __call__(self, caches: list[dict[str, jax.Array]], pairs: list[tuple[int, int]]):
        """`caches` with the pairs copied (the state layers' arrays are donated)."""
        if len(pairs) > self.buckets[-1]:
            raise ValueError(f"{len(pairs)} state copies in one step; at most {self.buckets[-1]}")
        bucket = next(b for b in self.buckets if b >= len(pairs))
        idx = np.zeros((2, bucket), np.int32)
        idx[:, :len(pairs)] = np.asarray(pairs, np.int32).T
        states = [caches[i] for i in self.state_layers]
        states = self._program(states, bucket)(states, idx[0], idx[1])
        caches = list(caches)
        for i, layer in zip(self.state_layers, states):
            caches[i] = layer
        return caches
