"""The chunked gated-delta kernel (pallas_kernels/gated_delta_chunked.py), interpreted on the
CPU, against its jnp reference and the per-sequence token recurrence, on ragged batches:
decode rows, prefill chunks crossing chunk boundaries, mixed, fresh and continuing sequences,
padding sequences and tokens, scattered state slots."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_batches import gdn_batch
from jaxserve.models.layers import deltanet as gdn
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from jaxserve.pallas_kernels.gated_delta_chunked import (gated_delta_chunked, ref_gated_delta_chunked,
                                                      unit_lower_inverse)

G, H, K, V = 2, 4, 16, 32
NUM_SLOTS = 8
L = 16


def _batch(qlens, starts, slots, pad_tokens=3, seed=0):
    return gdn_batch(qlens, starts, slots, g=G, h=H, k=K, v=V, num_slots=NUM_SLOTS,
                     pad_tokens=pad_tokens, max_decay=0.6, state_scale=0.3, seed=seed)


CASES = [  # (qlens, tokens already computed, state slots); padding sequences at slot 0
    ([1, 1, 1], [3, 0, 8], [2, 5, 7]),                      # decode only
    ([40], [0], [4]),                                       # one prefill over 3 chunks
    ([5, 1, 17, 0], [0, 9, 16, 0], [1, 3, 6, 0]),           # mixed: fresh, decode, continuing
    ([16, 2, 0, 0], [32, 0, 0, 0], [7, 2, 0, 0]),
    ([23, 7, 33, 16, 1], [0, 5, 40, 0, 2], [3, 1, 6, 2, 5]),   # unaligned partial chunks
]
# The CPU suite runs one or two cases of each sweep below (each case compiles its own
# interpreted kernel, seconds on 2 cores); the *_GPU cases run in
# tests/gpu/test_gpu_interpret_sweeps.py under `-m gpu`.
# On CPU: the mixed batch and the unaligned one (decode rows, fresh and continuing prefills,
# padding); decode only, one long prefill and the aligned continuation on the GPU.
CASES_CPU, CASES_GPU = [CASES[2], CASES[4]], [CASES[0], CASES[1], CASES[3]]


def _correlated_keys(k, seed):
    """Every key of a key head nearly the same direction (with write strengths near 1: the case
    where a Neumann series for (I + A)^-1 cancels catastrophically in f32)."""
    rng = np.random.default_rng(seed)
    t, g, kd = k.shape
    base = rng.standard_normal((1, g, kd))
    return gdn.l2norm(jnp.asarray(base + 0.01 * rng.standard_normal((t, g, kd)), jnp.float32))


@pytest.mark.parametrize("qlens, starts, slots", CASES_CPU)
def test_chunked_kernel_matches_recurrence(qlens, starts, slots, chunk=L, correlated=False):
    q, k, v, g, beta, qsl, seq_lens, slots_S, state = _batch(qlens, starts, slots, seed=sum(qlens))
    if correlated:
        k = _correlated_keys(k, seed=sum(qlens))
        beta = 0.95 + 0.05 * beta
    want_o, want_state = ref_gated_delta_chunked(q, k, v, g, beta, qsl, seq_lens, slots_S, state,
                                                 chunk=chunk)
    got_o, got_state = gated_delta_chunked(q, k, v, g, beta, qsl, seq_lens, slots_S, jnp.array(state),
                                           impl="pallas", interpret=True, chunk=chunk, block_v=16)
    np.testing.assert_allclose(got_o, want_o, atol=2e-5, rtol=0)
    np.testing.assert_allclose(got_state, want_state, atol=2e-5, rtol=0)
    used = {slots[i] for i, n in enumerate(qlens) if n}
    others = np.array([i for i in range(NUM_SLOTS) if i not in used])
    np.testing.assert_array_equal(got_state[others], state[others])
    np.testing.assert_array_equal(got_o[int(qsl[-1]):], 0.0)
    for s, n in enumerate(qlens):          # the reference against the token recurrence
        if not n:
            continue
        a = int(qsl[s])
        init = jnp.zeros((H, V, K)) if starts[s] == 0 else state[slots[s]]
        o, st = gdn.naive_gated_delta(gdn.expand_heads(q[a:a + n], H), gdn.expand_heads(k[a:a + n], H),
                                      v[a:a + n], g[a:a + n], beta[a:a + n], init)
        np.testing.assert_allclose(got_o[a:a + n], o, atol=2e-5, rtol=0)
        np.testing.assert_allclose(got_state[slots[s]], st, atol=2e-5, rtol=0)


def test_chunked_kernel_chunk_64_correlated_keys():
    """The model's chunk length over a 150-token prompt (two whole chunks and a partial one)
    beside a continuing sequence, with nearly parallel keys and beta near 1."""
    test_chunked_kernel_matches_recurrence([150, 20], [0, 10], [3, 6], chunk=64, correlated=True)


@pytest.mark.parametrize("chunk", [16, 64, 128])
def test_unit_lower_inverse_is_stable(chunk):
    """(I + A)^-1 of the kernel against jnp.linalg.inv where keys are nearly parallel and
    beta near 1 (A close to all ones below the diagonal: the inverse is ~bidiagonal, entries
    O(1), while the powers of A grow like binomial coefficients)."""
    rng = np.random.default_rng(chunk)
    k = rng.standard_normal((1, 128)) + 0.01 * rng.standard_normal((chunk, 128))
    k = np.asarray(gdn.l2norm(jnp.asarray(k, jnp.float32)))
    beta = rng.uniform(0.95, 1.0, chunk).astype(np.float32)
    gam = np.cumsum(-rng.uniform(0.0, 0.01, chunk)).astype(np.float32)
    a = np.tril(beta[:, None] * (k @ k.T) * np.exp(gam[:, None] - gam[None, :]), -1).astype(np.float32)
    got = np.asarray(jax.jit(unit_lower_inverse)(jnp.asarray(a)))
    want = np.asarray(jnp.linalg.inv(jnp.eye(chunk) + a))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    neumann, power = np.eye(chunk, dtype=np.float32), -a      # what the blocked inverse avoids
    for _ in range(int(np.log2(chunk))):
        neumann, power = neumann + power @ neumann, power @ power
    if chunk >= 64:
        assert np.abs(neumann - want).max() > 1.0


def test_chunked_kernel_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    t, s, g, h, kd, vd = 256, 4, 16, 64, 128, 128        # Qwen3.5-397B's linear-attention heads
    args = (sds((t, g, kd), jnp.float32), sds((t, g, kd), jnp.float32), sds((t, h, vd), jnp.bfloat16),
            sds((t, h), jnp.float32), sds((t, h), jnp.float32), sds((s + 1,), jnp.int32),
            sds((s,), jnp.int32), sds((s,), jnp.int32), sds((8, h, vd, kd), jnp.float32))
    exported = export_for_cuda(lambda *a: gated_delta_chunked(*a, impl="pallas", interpret=False), *args)
    assert triton_kernel_names(exported) == ["gated_delta_chunked_prep_l64",
                                             "gated_delta_chunked_state_l64_bv32"]


@pytest.mark.parametrize("v_dtype, want", [(jnp.float32, None), (jnp.bfloat16, "tf32")])
def test_chunked_kernel_dots_full_precision_in_float32(v_dtype, want):
    """A float32 model's kernels dot in full f32 (Triton's "ieee"); only a bf16 model's take
    TF32 (issue 70: TF32 here gave a float32 Qwen3.5 0.1-nat logprob errors on the GPU). The
    interpreter computes in f32 whatever the precision: this reads the Triton IR instead, where
    a dot's precision is printed unless it is Triton's default, "ieee" (None here)."""
    sds = jax.ShapeDtypeStruct
    t, s = 64, 2
    args = (sds((t, G, K), jnp.float32), sds((t, G, K), jnp.float32), sds((t, H, V), v_dtype),
            sds((t, H), jnp.float32), sds((t, H), jnp.float32), sds((s + 1,), jnp.int32),
            sds((s,), jnp.int32), sds((s,), jnp.int32), sds((NUM_SLOTS, H, V, K), jnp.float32))
    ir: list[str] = []
    export_for_cuda(lambda *a: gated_delta_chunked(*a, impl="pallas", interpret=False, chunk=L), *args,
                    triton_ir=ir)
    dots = [line for module in ir for line in module.splitlines() if "tt.dot " in line]
    precisions = {(re.findall(r"inputPrecision = (\w+)", line) or [None])[0] for line in dots}
    assert len(dots) >= 8 and precisions == {want}, dots
