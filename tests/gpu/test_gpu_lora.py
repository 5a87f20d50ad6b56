"""The batched LoRA kernel (pallas_kernels/lora_sgmv.py) compiled for the GPU (Triton lowering,
interpret=False) against its plain-jnp reference, at Llama-3.1-8B's projection shapes with
rank-16 slots: decode (16 tokens over 4 adapters and the base model), a prefill chunk, and a
mixed batch; bf16 operands, so the tolerance is bf16's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.lora_sgmv import lora_delta, ref_lora_delta

pytestmark = pytest.mark.gpu

# fused projection -> (in, out) at the 8B shape; parts x rank 16 as lora/adapter.py lays them
SHAPES = {"wqkv": (4096, 6144, 3), "wo": (4096, 4096, 1), "w_gate_up": (4096, 28672, 2),
          "w_down": (14336, 4096, 1)}
SLOTS = 5          # max_loras 4 + the null slot


def _slots(kind: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "decode":
        return rng.integers(0, SLOTS, 16).astype(np.int32)
    if kind == "prefill":
        return np.full(512, 3, np.int32)
    return np.concatenate([np.full(200, 1), np.zeros(100), np.full(190, 2), rng.integers(0, SLOTS, 22)]).astype(np.int32)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("proj", sorted(SHAPES))
def test_lora_kernel_matches_reference_on_gpu(proj, kind):
    din, dout, parts = SHAPES[proj]
    r = 16 * parts
    slots = jnp.asarray(_slots(kind))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (slots.shape[0], din), jnp.bfloat16)
    a = (0.02 * jax.random.normal(k2, (SLOTS, din, r))).astype(jnp.bfloat16).at[0].set(0)
    b = (0.02 * jax.random.normal(k3, (SLOTS, r, dout))).astype(jnp.bfloat16).at[0].set(0)
    got = lora_delta(x, a, b, slots, impl="pallas", interpret=False)
    with jax.default_matmul_precision("highest"):
        want = ref_lora_delta(x.astype(jnp.float32), a, b, slots)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)
    base = np.asarray(slots) == 0
    assert not np.asarray(got, np.float32)[base].any()       # base tokens get exactly nothing
