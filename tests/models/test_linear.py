"""layers.linear: the one-token projection XLA would otherwise turn into multiply + reduce."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers


@pytest.mark.parametrize("t,d,f", [(1, 2048, 1024), (3, 2048, 1024), (1, 64, 32), (1, 2048, 6144)])
def test_linear_equals_the_matmul(t, d, f):
    rng = np.random.default_rng(t + d + f)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, f)), jnp.float32)
    out = jax.jit(layers.linear)(x, w)
    assert out.shape == (t, f)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x @ w), rtol=1e-4, atol=1e-3)


def _dot_lhs_rows(t, d, f):
    """Rows of the left operand of every dot in linear's HLO (before XLA's own passes)."""
    sds = jax.ShapeDtypeStruct
    text = jax.jit(layers.linear).lower(sds((t, d), jnp.bfloat16), sds((d, f), jnp.bfloat16)).as_text()
    return [int(r) for r in re.findall(r"dot_general[^\n]*?\(tensor<(\d+)x", text)]


def test_one_row_of_a_mid_sized_weight_becomes_two():
    # Qwen3-30B-A3B's o-projection: 4096 x 2048 = 8.4M weight elements, under XLA's 10M
    assert _dot_lhs_rows(1, 4096, 2048) == [2]
    # large weights (cuBLAS takes them already), small ones (not worth a pad), many rows: as is
    assert _dot_lhs_rows(1, 4096, 4096) == [1]
    assert _dot_lhs_rows(1, 576, 576) == [1]
    assert _dot_lhs_rows(16, 4096, 2048) == [16]
