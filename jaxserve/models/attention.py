"""Attention backends: which paged attention a step runs, and the static plan of each step.

A backend is chosen once per runner (`attention_backend`). Each step it turns the host's view
of the step (bucket shape, busy sequences, their context lengths) into an `AttentionPlan`: a
small hashable value that is part of the compiled program's key. The runner passes the plan
through untouched and the model hands it to `attention()`: neither knows what is in it.

- "xla": the plain-XLA paged attention (layers.paged_attention_xla), the reference every
  kernel matches; its plan is always empty.
- "pallas": the ragged paged attention kernel (pallas_kernels/ragged_paged_attention/; on
  a CPU interpreted: slow, for tests). Its plan carries the kernel's tiling inputs
  `busy_seqs` and `skewed`, which the kernel's own rules map to a tiling.

Legend: T tokens, N query heads, K kv heads, E head dim, S sequences.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import layers
from jaxserve.core.step_input import StepInput
from jaxserve.pallas_kernels.ragged_paged_attention.tiling import (
    BucketHints, bucket_hints, skewed_contexts)
from jaxserve.pallas_kernels.ragged_paged_attention.wrapper import ragged_paged_attention


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The static part of one step's attention (a compiled program each)."""
    # At least this many sequence slots hold a chunk (0: not said): a padded bucket with few
    # chunks must not be tiled as a full one (ragged_paged_attention/tiling.py tiling_busy_floor).
    busy_seqs: int = 0
    # The step's contexts are skewed and the bucket tiles such steps apart.
    skewed: bool = False


def _pow2(n: int, least: int) -> bool:
    return n >= least and n & (n - 1) == 0


def kernel_impl(cfg: ModelConfig, impl: str) -> str:
    """Resolve "auto": the Pallas kernels on a GPU when the head dim is a power of two."""
    if impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"attention_impl must be 'xla', 'pallas' or 'auto'; got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and _pow2(cfg.head_dim, 16) else "xla"
    return impl


class AttentionBackend:
    def __init__(self, cfg: ModelConfig, impl: str, *, context: int, itemsize: int):
        """context: the longest context a sequence may have (max_model_len rounded up to
        blocks); itemsize: bytes per cached K/V element."""
        self.cfg = cfg
        self.requested = impl           # as asked: a family with its own kernels resolves it
        self.impl = kernel_impl(cfg, impl)
        self.scale = cfg.head_dim ** -0.5
        self._tiling_kw = dict(context=context, head_dim=cfg.head_dim, itemsize=itemsize)
        # Only a GPU tiles: the interpreted kernel on a CPU takes the default tiling.
        self._tiles = self.impl == "pallas" and jax.default_backend() == "gpu"
        self._buckets: dict[tuple[int, int], BucketHints] = {}

    # -- plans (host side) -----------------------------------------------------------------
    def _bucket(self, num_tokens: int, num_seqs: int) -> BucketHints:
        """The kernel's hints for a bucket (ragged_paged_attention/tiling.py bucket_hints);
        found once per bucket."""
        key = (num_tokens, num_seqs)
        if key not in self._buckets:
            self._buckets[key] = BucketHints(0, False, False)
            if self._tiles:
                self._buckets[key] = bucket_hints(num_tokens, num_seqs, self.cfg.num_heads,
                                                  self.cfg.num_kv_heads, **self._tiling_kw)
        return self._buckets[key]

    def plan(self, num_tokens: int, num_seqs: int, busy: int,
             contexts: np.ndarray | None = None) -> AttentionPlan:
        """The plan of a step of `busy` chunks with these contexts in a (num_tokens, num_seqs)
        bucket. A step of skewed contexts where the bucket takes fill_splits for them (each
        sequence split by its own keys) gets busy_seqs 0, and `skewed` only where that tiling
        differs from the one without a busy count."""
        floor, fills, apart = self._bucket(num_tokens, num_seqs)
        if fills and contexts is not None and skewed_contexts(contexts):
            return AttentionPlan(0, apart)
        return AttentionPlan(floor if floor and busy >= floor else 0, False)

    def warmup_plans(self, num_tokens: int, num_seqs: int) -> list[AttentionPlan]:
        """The plans warm-up compiles for a bucket: the default, a full bucket's, a skewed
        step's (the last ones may compile in the background)."""
        floor, _, apart = self._bucket(num_tokens, num_seqs)
        plans = [AttentionPlan()]
        if floor:
            plans.append(AttentionPlan(busy_seqs=floor))
        if apart:
            plans.append(AttentionPlan(skewed=True))
        return plans

    # -- the computation (traced) ----------------------------------------------------------
    def attention(self, q_TNE, k_cache, v_cache, x: StepInput, plan: AttentionPlan):
        if self.impl == "xla":
            return layers.paged_attention_xla(
                q_TNE, k_cache, v_cache, x.block_tables, x.token_seq_ids, x.positions,
                sm_scale=self.scale, sliding_window=self.cfg.sliding_window)
        from jaxserve.sharding import kernels as sharded
        kernel = functools.partial(
            ragged_paged_attention, sm_scale=self.scale,
            sliding_window=self.cfg.sliding_window, impl="pallas",
            busy_seqs=plan.busy_seqs, skewed=plan.skewed)
        # Under a mesh with a `model` axis the kernel runs per head shard (sharding/kernels.py).
        return sharded.paged_attention(kernel, q_TNE, k_cache, v_cache,
                                       x.query_start_loc, x.seq_lens, x.block_tables)
