"""V4's sparse sink attention kernel (interpret mode) against its jnp reference: window rows
and chosen compressed entries gathered from scattered slots, masked rows (a chunk wholly
masked included), odd head counts and widths, the window alone (sliding layers), bf16, bad
arguments, and the CUDA lowering at V4-Flash's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import sparse_sink_attention as ssa
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def operands(rng, *, t=5, h=4, e=32, nb=12, p=4, w=8, k=6, dtype=jnp.float32, comp=True):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    slots = lambda n: jnp.asarray(rng.integers(0, nb * p, (t, n)), jnp.int32)  # noqa: E731
    ok = lambda n: jnp.asarray(rng.random((t, n)) < 0.7)  # noqa: E731
    win_ok = ok(w).at[0].set(False).at[1, 0].set(True)      # token 0: nothing in its window
    comp_slots = jnp.asarray(rng.integers(0, nb, (t, k)), jnp.int32)     # one entry row a block
    return (f(t, h, e), f(nb, p, e), f(nb, 1, e) if comp else None, slots(w), win_ok, comp_slots,
            ok(k).at[2].set(False), jnp.asarray(rng.standard_normal(h), jnp.float32))


@pytest.mark.parametrize("h,e,w,k,bh,bl", [(4, 32, 8, 6, 16, 16), (5, 24, 40, 3, 16, 32),
                                           (20, 64, 16, 37, 16, 16)])
def test_matches_the_reference(h, e, w, k, bh, bl):
    args = operands(np.random.default_rng(h + k), h=h, e=e, w=w, k=k)
    got = ssa.sparse_sink_attention(*args, sm_scale=e ** -0.5, impl="pallas", heads_per_program=bh,
                                    rows_per_step=bl)
    want = ssa.ref_sparse_sink_attention(*args, sm_scale=e ** -0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_window_alone_and_bf16():
    args = operands(np.random.default_rng(3), comp=False)
    got = ssa.sparse_sink_attention(*args, sm_scale=0.2, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ssa.ref_sparse_sink_attention(*args, sm_scale=0.2)),
                               rtol=1e-5, atol=1e-5)
    args = operands(np.random.default_rng(4), dtype=jnp.bfloat16)
    got = ssa.sparse_sink_attention(*args, sm_scale=0.2, impl="pallas")
    want = ssa.ref_sparse_sink_attention(*args, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_bad_arguments_name_the_field():
    q, kv, comp, ws, wok, cs, cok, sinks = operands(np.random.default_rng(1))
    with pytest.raises(ValueError, match="sinks_H"):
        ssa.sparse_sink_attention(q, kv, comp, ws, wok, cs, cok, sinks[:2], sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_NPE"):
        ssa.sparse_sink_attention(q, kv[..., :8], comp, ws, wok, cs, cok, sinks, sm_scale=1.0)
    with pytest.raises(ValueError, match="rows_per_step"):
        ssa.sparse_sink_attention(q, kv, comp, ws, wok, cs, cok, sinks, sm_scale=1.0, impl="pallas",
                                  rows_per_step=24)


def test_lowers_for_cuda_at_v4_flash_shapes():
    """64 heads of 512, a 128-row window and 512 chosen entries, 64-token blocks (16 CSA entry
    rows each), bf16."""
    sds, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    exported = export_for_cuda(
        lambda *a: ssa.sparse_sink_attention(*a, sm_scale=512 ** -0.5, impl="pallas", interpret=False),
        sds((4, 64, 512), bf), sds((300, 64, 512), bf), sds((300, 16, 512), bf), sds((4, 128), i32),
        sds((4, 128), jnp.bool_), sds((4, 512), i32), sds((4, 512), jnp.bool_), sds((64,), jnp.float32))
    assert triton_kernel_names(exported) == ["sparse_sink_attention"]


def test_rows_past_comp_len_are_not_visited():
    """With comp_len_T the kernel stops after each token's last visitable row's chunk (here
    lengths on chunk boundaries): rows past it, even unmasked, add nothing, as if masked; and
    masked rows that are not finite add nothing either."""
    q, kv, comp, ws, wok, cs, cok, sinks = operands(np.random.default_rng(6), k=40)
    lens = jnp.asarray([0, 16, 32, 40, 16], jnp.int32)
    visible = jnp.arange(40)[None, :] < lens[:, None]
    got = ssa.sparse_sink_attention(q, kv, comp, ws, wok, cs, cok, sinks, lens, sm_scale=0.2,
                                    impl="pallas", rows_per_step=16)
    want = ssa.ref_sparse_sink_attention(q, kv, comp, ws, wok, cs, cok & visible, sinks, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    bad = comp.at[0].set(jnp.nan)
    cs = jnp.where(cok, jnp.maximum(cs, 1), 0)         # only masked rows read block 0
    got = ssa.sparse_sink_attention(q, kv, bad, ws, wok, cs, cok, sinks, sm_scale=0.2, impl="pallas")
    want = ssa.ref_sparse_sink_attention(q, kv, comp, ws, wok, cs, cok, sinks, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
