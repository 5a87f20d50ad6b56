"""Build StepInputs for given sequences, following jaxserve/step_input.py's conventions.

Tests use this instead of the engine's runner: it places each sequence's tokens in a paged
cache through an explicit block table, and pads tokens and sequences the way the runner does
(padding tokens write slot 0 of the null block; padding sequences have zero length).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.core.step_input import StepInput


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence computed in this step, after `start` already-cached ones."""
    seq: int            # which block table (row of `tables`) the sequence uses
    token_ids: list[int]
    start: int          # number of the sequence's tokens already in the cache


def scattered_block_tables(num_seqs: int, blocks_per_seq: int, num_blocks: int, seed: int = 0
                           ) -> np.ndarray:
    """i32[S, B] tables of distinct, shuffled physical blocks (never block 0, the null block)."""
    need = num_seqs * blocks_per_seq
    if need > num_blocks - 1:
        raise ValueError(f"{need} blocks needed but only {num_blocks - 1} usable")
    ids = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))[:need]
    return ids.reshape(num_seqs, blocks_per_seq).astype(np.int32)


def build_step(chunks: list[Chunk], tables: np.ndarray, block_size: int, num_tokens: int,
               num_seqs: int) -> StepInput:
    """One StepInput of exactly `num_tokens` tokens and `num_seqs` sequences (padded)."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{total} tokens / {len(chunks)} seqs do not fit {num_tokens} / {num_seqs}")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)
    seq_ids = np.zeros(num_tokens, np.int32)
    qsl = np.full(num_seqs + 1, total, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    step_tables = np.zeros((num_seqs, tables.shape[1]), np.int32)
    logits_idx = np.zeros(num_seqs, np.int32)
    t = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        pos = np.arange(c.start, c.start + n)
        qsl[s] = t
        token_ids[t:t + n] = c.token_ids
        positions[t:t + n] = pos
        slots[t:t + n] = tables[c.seq][pos // block_size] * block_size + pos % block_size
        seq_ids[t:t + n] = s
        seq_lens[s] = c.start + n
        step_tables[s] = tables[c.seq]
        logits_idx[s] = t + n - 1
        t += n
    arr = lambda a: jnp.asarray(a)  # noqa: E731
    return StepInput(token_ids=arr(token_ids), positions=arr(positions), slot_mapping=arr(slots),
                     token_seq_ids=arr(seq_ids), query_start_loc=arr(qsl), seq_lens=arr(seq_lens),
                     block_tables=arr(step_tables), logits_indices=arr(logits_idx), sampling=None)


def empty_kv_cache(cfg, num_blocks: int, block_size: int, dtype=jnp.float32, sharding=None) -> list:
    """Zeroed cache: one {"k", "v"} dict per layer, each f[num_blocks, P, K, E]."""
    import jax

    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    make = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    if sharding is not None:
        make = jax.jit(make, out_shardings=sharding)
    return [{"k": make(), "v": make()} for _ in range(cfg.num_layers)]


def moe_regions(params, tp: int, ep: int) -> int:
    """shard_maps the MoE layers add to a step on a (tp, ep) mesh: one per layer holding
    routed experts (sharding/expert_parallel.py) whenever the mesh has more than one device."""
    if tp * ep == 1:
        return 0
    return sum(getattr(lp.get("w_down"), "ndim", 0) == 3 for lp in params["layers"])
