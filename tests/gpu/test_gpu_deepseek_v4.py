"""DeepSeek V4 on the GPU: the sparse sink attention and compressor kernels compiled (Triton,
interpret=False) against their jnp references at V4-Flash's shapes (64 heads of 512, a 128-row
window, 512 chosen entries; CSA's windows; bf16 and f32), and the tiny checkpoint's goldens through the model with the kernel
(tests/models/test_deepseek_v4_golden.py's Pallas case, run on the device)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from jaxserve.pallas_kernels import sparse_sink_attention as ssa  # noqa: E402
from jaxserve.pallas_kernels import window_compress as wc  # noqa: E402
from test_sparse_sink_attention import operands  # noqa: E402
from test_window_compress import operands as compress_operands  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_kernel_at_v4_flash_shapes(dtype, tol, t):
    args = operands(np.random.default_rng(t), t=t, h=64, e=512, nb=600, p=64, w=128, k=512, dtype=dtype)
    got = ssa.sparse_sink_attention(*args, sm_scale=512 ** -0.5, impl="pallas")
    with jax.default_matmul_precision("highest"):
        want = ssa.ref_sparse_sink_attention(*args, sm_scale=512 ** -0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_compressor_kernel_at_v4_flash_csa_shapes(dtype, tol):
    """CSA's compressor (2 x 4 rows of 2 x 512) and the indexer's (of 2 x 128), 16 entries."""
    for e in (512, 128):
        args = compress_operands(np.random.default_rng(e), k=16, m=4, e=e, r=64, rows=4096, dtype=dtype)
        got = wc.window_compress(*args, overlap=True, eps=1e-6, impl="pallas")
        want = wc.ref_window_compress(*args, overlap=True, eps=1e-6)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


def test_goldens_with_the_kernel_on_the_gpu():
    import test_deepseek_v4_golden as golden_tests
    golden_tests.test_pallas_attention_in_the_model()
    golden_tests.test_matches_transformers_batched_then_decode()
