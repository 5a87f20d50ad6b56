"""The public ragged paged attention: one jitted wrapper that picks the implementation (the
Triton kernel, the Mosaic GPU kernel for prefill-heavy steps, or plain XLA) and, for the Triton
kernel, its whole tiling (tiling.choose_tiling: the rules and the device's tuning entry, with
whatever the caller's `Tiling` sets). Problem and layouts: the package's docstring."""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels.dispatch import resolve_impl
from jaxserve.pallas_kernels.ragged_paged_attention import mgpu
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    validate, xla_ragged_paged_attention)
from jaxserve.pallas_kernels.ragged_paged_attention.tiling import choose_tiling, prefill_heavy
from jaxserve.pallas_kernels.ragged_paged_attention.triton_kernel import (
    triton_ragged_paged_attention)
from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "impl", "tiling", "interpret", "busy_seqs",
    "skewed"))
def ragged_paged_attention(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S,
                           block_tables_SB, *, sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, impl: str = "auto",
                           tiling: Tiling = Tiling(), interpret: bool | None = None,
                           busy_seqs: int | None = None, skewed: bool = False) -> jax.Array:
    """Attention of a mixed prefill/decode batch over a paged KV cache -> o f[T, N, E].

    impl: "pallas" (our kernels: on a GPU, prefill-heavy batches (T > 2 S) that the Mosaic GPU
    kernel supports go to it (mgpu.py: ~1.45x the Triton kernel's speed on prefill),
    everything else to the Triton kernel; on CPU the Triton kernel, interpreted), "triton" or
    "mgpu" (that kernel only), "xla" (plain XLA, memory-bounded) or "auto" (pallas on GPU, xla
    elsewhere). `tiling`: the Triton kernel's tiling; its None fields are picked from the
    shapes as below.
    mask_all_steps: one key loop that applies the causal/window mask on every step, instead of
    three (window edge, unmasked middle, causal edge; same result). Default True in interpret
    mode (3x faster to compile) and for decode buckets (T <= S) of 16-row tiles, where the
    mask is cheap and Triton then pipelines one loop rather than draining between three
    (0.5-5 % faster on 21 of 24 decode cases, H200, E = 128 in bf16; other head dims and dtypes
    not timed). Other batches keep three loops: larger tiles' masked steps cost more.
    heavy_first: launch the query tiles in reverse, the longest causal ranges first;
    prefetch_slots: look up the next key step's cache slots one step early. Both default to on
    for prefill-heavy batches (a few % off a 2K-token prefill, H200).
    busy_seqs: at least this many of the S sequence slots have query tokens (None: all of
    them). A caller that pads its batch to fixed sizes says how full it is, so that a decode
    grid of up to two programs per SM is pipelined only when most SMs get work
    (pipelined_decode), one of several waves takes 64-key 3-stage steps only where its busy
    programs fill their waves (many_wave_decode), and one of fewer programs than SMs splits
    by its own size only when it is full (split_decode_tiling); 0: not said (none of these;
    fill_splits for grids of up to two programs an SM).
    fill_splits: split each busy (query tile, kv head) item of the step into parts (at most
    num_splits) that fill a grid of fill_programs programs (default_fill_programs), in
    proportion to each item's key steps, the counts found in the kernel from query_start_loc
    and seq_lens (fill_split_counts); the default for decode buckets of up to two programs an
    SM whose busy count is not said (split_decode_tiling), which is how the engine runs padded
    buckets, and skewed steps of such buckets (skewed_contexts; larger ones: `skewed`).
    skewed: the caller says this step's contexts are skewed (skewed_contexts): decode grids of
    up to SKEWED_FILL_MAX_WAVES x num_sms() programs take fill_splits whatever busy_seqs says.
    heads_inner: launch a query tile's kv heads side by side (grid (K, J, X)) rather than a kv
    head's tiles (J, K, X). Default on for unsplit decode grids (T <= S, one split): the busy
    programs of a padded bucket, the first in launch order, then go to separate SMs (half-busy
    32-slot buckets 16-27 % faster on an H200, full ones level or up to 2 % faster). Split
    grids keep (J, K, X): with kv heads inner a padded bucket's busy programs bunched. It
    applies to tuned calls too.
    Any tiling field (block_q ... prefetch_slots, fill_splits, fill_programs) turns off the
    shape rules above: the rest of the tiling is then the plain default.
    """
    validate(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S, block_tables_SB)
    impl, on_gpu = resolve_impl(impl, ("pallas", "triton", "mgpu", "xla"))
    if impl == "pallas":
        impl = _pallas_kernel_for(q_TNE, k_cache_NPKE, seq_lens_S, on_gpu=on_gpu,
                                  interpret=interpret, sliding_window=sliding_window,
                                  soft_cap=soft_cap)
    if impl == "mgpu":
        return mgpu.ragged_paged_attention_mgpu(
            q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S, block_tables_SB,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            interpret=interpret)
    if impl == "xla":
        return xla_ragged_paged_attention(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1,
                                          seq_lens_S, block_tables_SB, sm_scale=sm_scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap)
    t, n, e = q_TNE.shape
    _, p, kh, _ = k_cache_NPKE.shape
    s, b = block_tables_SB.shape
    if e != pl.next_power_of_2(e) or e < 16:
        raise ValueError(f"the pallas kernel needs a power-of-two head dim >= 16; got E={e}; "
                         f"use impl='xla'")
    interpret = (not on_gpu) if interpret is None else interpret
    whole = choose_tiling(t, s, n, kh, context=b * p, head_dim=e,
                          itemsize=k_cache_NPKE.dtype.itemsize, busy_seqs=busy_seqs,
                          skewed=skewed, interpret=interpret, asked=tiling)
    return triton_ragged_paged_attention(
        q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S, block_tables_SB,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, tiling=whole,
        interpret=interpret)


def _pallas_kernel_for(q_TNE, k_cache_NPKE, seq_lens_S, *, on_gpu: bool, interpret: bool | None,
                       sliding_window, soft_cap) -> str:
    """"mgpu" for prefill-heavy batches (T > 2 S, a static test on the step's bucket) on a GPU
    when the Mosaic GPU kernel supports them; "triton" otherwise (decode-heavy batches need the
    Triton kernel's key-range splits; CPU runs it interpreted)."""
    if not on_gpu or interpret or not prefill_heavy(q_TNE.shape[0], seq_lens_S.shape[0]):
        return "triton"
    supported = mgpu.supports(q_TNE, k_cache_NPKE, sliding_window=sliding_window,
                              soft_cap=soft_cap)
    return "mgpu" if supported else "triton"

