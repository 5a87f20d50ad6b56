"""DeepSeek's fused MLA kernels ("mla" in the kernel plan, issue 71) compiled for the GPU
(Triton lowering, interpret=False) against their references at DeepSeek-V3.2's shapes (Q 1536,
C 512, R 64, E 128, 128 heads, indexer 64 x 128, O 128) on decode, batched-decode and prefill
token counts, bf16 and f32; and the engine on the tiny V3 / V3.2 checkpoints in f32 with
"mla,moe" on: greedy tokens equal transformers' (the goldens) and the engine's without them.
The CPU tests (tests/pallas_kernels/test_mla_*.py) run the same kernels interpreted."""

from __future__ import annotations

import gc
import os

import jax.numpy as jnp
import numpy as np
import pytest

import test_mla_input_prep as prep_cpu
import test_mla_latent_write as lw_cpu
import test_mla_q_absorb as absorb_cpu
from jaxserve import LLM, SamplingParams
from jaxserve.models.layers import mla
from jaxserve.pallas_kernels import mla_attention as mk
from jaxserve.pallas_kernels import mla_input_prep as mip
from jaxserve.pallas_kernels import mla_output as mo
from jaxserve.pallas_kernels import mla_q_absorb as mqa
from test_gpu_new_kernels import MLA_SCALE, close, highest, mla_batch
from test_split_merge import partials
from tests.conftest import GOLDEN_DIR

pytestmark = pytest.mark.gpu

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("tokens,index,dtype", [(1, True, BF16), (16, True, BF16), (37, False, BF16),
                                                (5, True, F32)])
def test_mla_input_prep(tokens, index, dtype):
    rng = np.random.default_rng(tokens)
    args, slots, _, _ = prep_cpu.packed(rng, t=tokens + 2, q=1536, c=512, r=64, j=128, heads=64,
                                        index=index, dtype=dtype, nb=40)
    inv, factor = mla.rope_tables(64, 10000.0, lw_cpu.YARN, 163840)
    kw = dict(inv_freq_H=inv, factor=factor, q_width=1536)
    got = mip.mla_input_prep(impl="pallas", interpret=False, **kw, **args)
    want = highest(mip.ref_mla_input_prep, **kw, **args)
    tol = 2e-2 if dtype == BF16 else 1e-5
    lw_cpu.compare(got[1:3], want[1:3], slots, tol)
    close(got[0], want[0], tol)
    if index:
        close(got[3], want[3], 1e-6)


@pytest.mark.parametrize("tokens,index,dtype", [(1, True, BF16), (16, True, BF16), (37, True, BF16),
                                                (3, False, BF16), (4, True, F32)])
def test_mla_q_absorb(tokens, index, dtype):
    args, factor = absorb_cpu.make(np.random.default_rng(tokens), t=tokens, n=128, e=128, r=64,
                                   c=512, i=64 if index else 0, j=128 if index else 0, dtype=dtype)
    kw = dict(num_heads=128, index_heads=64 if index else 0, factor=factor)
    got = mqa.mla_q_absorb(**args, **kw, impl="pallas", interpret=False)
    want = highest(mqa.ref_mla_q_absorb, **args, **kw)
    # bf16: the product (sums of 128 terms of ~0.3, f32 accumulation both sides) an ulp apart
    tol = 5e-2 if dtype == BF16 else 1e-4
    close(got[0], want[0], tol, rtol=2e-2 if dtype == BF16 else 1e-5)
    if index:
        close(got[1], want[1], tol, rtol=2e-2 if dtype == BF16 else 1e-5)


@pytest.mark.parametrize("x,tokens,dtype", [(16, 1, BF16), (8, 4, BF16), (1, 37, BF16), (4, 3, F32)])
def test_mla_merge_uv(x, tokens, dtype):
    """Random partials (empty splits holding NaN) of 128 heads, C 512, into W_UV (O 128)."""
    o_part, lse = partials(x, tokens, 128, 512, seed=x)
    w_uv = jnp.asarray(np.random.default_rng(x).standard_normal((128, 512, 128)) * 0.05, dtype)
    got = mo.mla_merge_uv(o_part, lse, w_uv, out_dtype=dtype, impl="pallas", interpret=False)
    want = highest(mo.ref_mla_merge_uv, o_part, lse, w_uv.astype(F32), out_dtype=F32)
    if dtype == BF16:   # the reference's merged latent rounded to bf16, as the kernel's is
        from jaxserve.pallas_kernels.split_merge import ref_merge_splits
        merged = ref_merge_splits(o_part, lse).astype(BF16).astype(F32)
        want = highest(lambda m, w: jnp.einsum("tnc,nco->tno", m, w).reshape(tokens, -1), merged,
                       w_uv.astype(F32))
    close(got, want, 3e-2 if dtype == BF16 else 1e-4, rtol=2e-2 if dtype == BF16 else 1e-5)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("sparse", [False, True])
def test_attention_partials_then_merge_uv(kind, sparse):
    """After the attention kernel at DeepSeek's shapes: its unmerged splits through
    mla_merge_uv equal mla_attention (merged by split_merge) then the einsum."""
    q, lat, bt, seq, pos, sel, real = mla_batch(kind, n=128, k=2048, dtype=BF16, seed=3)
    q, seq, pos, sel = q[:32], seq[:32], pos[:32], (sel[:32] if sparse else None)   # a small step
    w_uv = jnp.asarray(np.random.default_rng(0).standard_normal((128, 512, 128)) * 0.05, BF16)
    kw = dict(sm_scale=MLA_SCALE, value_dim=512)
    o = mk.mla_attention(q, lat, bt, seq, pos, sel, impl="pallas", interpret=False, **kw)
    want = highest(lambda o_, w: jnp.einsum("tnc,nco->tno", o_.astype(F32), w.astype(F32)), o, w_uv)
    o_part, lse = mk.mla_attention_partials(q, lat, bt, seq, pos, sel, interpret=False, **kw)
    got = mo.mla_merge_uv(o_part, lse, w_uv, out_dtype=BF16, impl="pallas", interpret=False)
    n = min(real, 32)
    close(np.asarray(got, np.float32)[:n], np.asarray(want).reshape(32, -1)[:n], 5e-2, rtol=3e-2)


def _generate(name, fused_kernels):
    llm = LLM(os.path.join(GOLDEN_DIR, "ckpt", name), dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, block_size=16, num_kv_blocks=64,
              warmup=False, fused_kernels=fused_kernels)
    g = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    prompts = [g[f"prompt_{i}"].tolist() for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], [g[f"greedy_{i}"].tolist()[:16] for i in range(3)]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_engine_greedy_with_fused_mla(name):
    fused, want = _generate(name, "mla,moe")
    plain, _ = _generate(name, "none")
    assert fused == plain
    assert fused == want
