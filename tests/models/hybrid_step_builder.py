"""model_step_builder for hybrid models: StepInputs that also carry state slots, and caches
allocated from a family's cache_specs (jaxserve/kv_cache/specs.py): one dict per layer."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_cache.specs import PagedSpec, StateSpec
from model_step_builder import Chunk, build_step, scattered_block_tables  # noqa: F401


def build_hybrid_step(chunks: list[Chunk], tables: np.ndarray, slots: np.ndarray, block_size: int,
                      num_tokens: int, num_seqs: int):
    """build_step plus state_slots: sequence s of the step uses slots[chunk.seq]; padding
    sequences point at the null slot 0."""
    x = build_step(chunks, tables, block_size, num_tokens, num_seqs)
    state_slots = np.zeros(num_seqs, np.int32)
    for s, c in enumerate(chunks):
        state_slots[s] = slots[c.seq]
    return dataclasses.replace(x, state_slots=jnp.asarray(state_slots))


def empty_caches(specs, num_blocks: int, block_size: int, num_slots: int, dtype=jnp.float32,
                 state_dtype=jnp.float32) -> list[dict]:
    """Zeroed caches: paged arrays [num_blocks, P, *shape]; state arrays [num_slots, *shape]
    (the recurrent state "ssm" in state_dtype, f32 by default)."""
    out = []
    for spec in specs:
        if isinstance(spec, PagedSpec):
            out.append({n: jnp.zeros((num_blocks, spec.rows(n, block_size)) + s, dtype) for n, s in spec.arrays})
        elif isinstance(spec, StateSpec):
            out.append({n: jnp.zeros((num_slots,) + s, state_dtype if n == "ssm" else dtype)
                        for n, s in spec.arrays})
        else:
            raise TypeError(f"unknown cache spec {spec!r}")
    return out
