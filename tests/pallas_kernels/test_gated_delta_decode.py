"""The recurrent decode kernel (pallas_kernels/gated_delta_decode.py), interpreted on the CPU,
against its jnp reference and the per-sequence token recurrence, on decode batches with
padding sequences, fresh sequences (zero state) and scattered state slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_batches import gdn_batch
from jaxserve.models.layers import deltanet as gdn
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from jaxserve.pallas_kernels.gated_delta_decode import gated_delta_decode, ref_gated_delta_decode

G, H, K, V = 2, 4, 16, 8
NUM_SLOTS = 8


def _batch(qlens, starts, slots, pad_tokens=2, seed=0):
    return gdn_batch(qlens, starts, slots, g=G, h=H, k=K, v=V, num_slots=NUM_SLOTS,
                     pad_tokens=pad_tokens, seed=seed)


CASES = [  # (qlens, tokens already computed, state slots): padding seqs point at slot 0
    ([1, 1, 1], [4, 0, 9], [3, 6, 1]),
    ([1, 0, 1, 0], [2, 0, 7, 0], [5, 0, 2, 0]),
    ([1], [0], [7]),
]


@pytest.mark.parametrize("qlens, starts, slots", CASES)
def test_decode_kernel_matches_recurrence(qlens, starts, slots):
    q, k, v, g, beta, qsl, seq_lens, slots_S, state = _batch(qlens, starts, slots, seed=len(qlens))
    want_o, want_state = ref_gated_delta_decode(q, k, v, g, beta, qsl, seq_lens, slots_S, state)
    got_o, got_state = gated_delta_decode(q, k, v, g, beta, qsl, seq_lens, slots_S, jnp.array(state),
                                          impl="pallas", interpret=True, block_v=4)
    np.testing.assert_allclose(got_o, want_o, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_state, want_state, atol=1e-5, rtol=0)
    # the reference against the token recurrence, sequence by sequence
    for s, n in enumerate(qlens):
        untouched = [i for i in range(NUM_SLOTS) if i not in [slots[j] for j in range(len(qlens)) if qlens[j]]]
        np.testing.assert_array_equal(got_state[np.array(untouched)], state[np.array(untouched)])
        if not n:
            np.testing.assert_array_equal(got_o[s], 0.0)
            continue
        t0 = int(qsl[s])
        init = jnp.zeros((H, V, K)) if starts[s] == 0 else state[slots[s]]
        o, st = gdn.naive_gated_delta(gdn.expand_heads(q[t0:t0 + 1], H), gdn.expand_heads(k[t0:t0 + 1], H),
                                      v[t0:t0 + 1], g[t0:t0 + 1], beta[t0:t0 + 1], init)
        np.testing.assert_allclose(got_o[s], o[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(got_state[slots[s]], st, atol=1e-5, rtol=0)


def test_decode_kernel_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    t, s, g, h, kd, vd = 16, 16, 16, 64, 128, 128      # Qwen3.5-397B's linear-attention heads
    args = (sds((t, g, kd), jnp.float32), sds((t, g, kd), jnp.float32), sds((t, h, vd), jnp.bfloat16),
            sds((t, h), jnp.float32), sds((t, h), jnp.float32), sds((s + 1,), jnp.int32),
            sds((s,), jnp.int32), sds((s,), jnp.int32), sds((32, h, vd, kd), jnp.float32))
    exported = export_for_cuda(lambda *a: gated_delta_decode(*a, impl="pallas", interpret=False), *args)
    assert triton_kernel_names(exported) == ["gated_delta_decode_bv32"]
