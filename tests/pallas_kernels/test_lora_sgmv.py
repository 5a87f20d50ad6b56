"""The batched LoRA kernel (pallas_kernels/lora_sgmv.py) in interpret mode against its
plain-jnp reference and a per-token loop, on decode, prefill and mixed batches."""

import numpy as np
import pytest
import jax.numpy as jnp

from jaxserve.pallas_kernels.lora_sgmv import lora_delta, ref_lora_delta

K, R, N, L = 64, 16, 48, 4     # L slots: 0 = no adapter, 1..3 adapters


def _operands(slots, seed=0):
    rng = np.random.default_rng(seed)
    t = len(slots)
    x = rng.standard_normal((t, K)).astype(np.float32)
    a = rng.standard_normal((L, K, R)).astype(np.float32) * 0.2
    b = rng.standard_normal((L, R, N)).astype(np.float32) * 0.2
    a[0] = 0
    b[0] = 0
    return x, a, b, np.asarray(slots, np.int32)


def _per_token(x, a, b, slots):
    return np.stack([(x[t] @ a[s]) @ b[s] for t, s in enumerate(slots)])


BATCHES = {
    "decode": [2, 0, 1, 2, 3, 0, 0, 1],                       # one token per sequence
    "prefill": [3] * 37,                                      # one adapter's long chunk
    "mixed": [0] * 5 + [1] * 20 + [2] + [0] * 3 + [3] * 17 + [1, 2, 0],   # chunks + decodes
    "base_only": [0] * 16,
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_kernel_matches_reference(name):
    x, a, b, slots = _operands(BATCHES[name])
    want = _per_token(x, a, b, slots)
    ref = np.asarray(ref_lora_delta(jnp.asarray(x), a, b, slots))
    got = np.asarray(lora_delta(jnp.asarray(x), a, b, slots, impl="pallas", interpret=True))
    np.testing.assert_allclose(ref, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if name == "base_only":
        assert not got.any()


def test_a_token_gets_its_own_adapter_only():
    """Swapping two tokens' slots swaps their updates (a kernel that mixed groups fails)."""
    x, a, b, slots = _operands([1, 2, 1, 2])
    got = np.asarray(lora_delta(jnp.asarray(x), a, b, slots, impl="pallas", interpret=True))
    other = np.asarray(lora_delta(jnp.asarray(x), a, b, slots[::-1].copy(), impl="pallas", interpret=True))
    assert not np.allclose(got, other, atol=1e-3)
    np.testing.assert_allclose(got[0], x[0] @ a[1] @ b[1], rtol=1e-4, atol=1e-4)


def test_bad_shapes_name_the_operand():
    x, a, b, slots = _operands([1, 2])
    with pytest.raises(ValueError, match="slots_T"):
        lora_delta(jnp.asarray(x), a, b, slots[:1], impl="xla")
    with pytest.raises(ValueError, match="a_LKR"):
        lora_delta(jnp.asarray(x), a[:, :8], b, slots, impl="xla")


def test_widths_the_kernel_cannot_tile_take_the_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    a = rng.standard_normal((3, 24, 16)).astype(np.float32)
    b = rng.standard_normal((3, 16, 40)).astype(np.float32)
    slots = np.array([0, 1, 2, 1, 0], np.int32)
    got = np.asarray(lora_delta(jnp.asarray(x), a, b, slots, impl="pallas", interpret=True))
    np.testing.assert_allclose(got, _per_token(x, a * (np.arange(3) > 0)[:, None, None], b, slots),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_dense_path_matches_per_token_products(name):
    """The "dense" path (every slot's a and b in two dot products, each token keeping its own
    slot's columns) equals the per-token products; slot 0 gets nothing."""
    x, a, b, slots = _operands(BATCHES[name], seed=3)
    a[0], b[0] = 1.0, 1.0                      # a slot 0 with weights must still add nothing
    got = np.asarray(lora_delta(jnp.asarray(x), a, b, slots, impl="dense"))
    want = _per_token(x, a, b, slots) * (np.asarray(slots) > 0)[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
