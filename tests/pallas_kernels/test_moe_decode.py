"""The fused MoE decode kernels (interpret mode) against their jnp reference and against the
grouped path the models take otherwise (models/moe.py), with separate and fused gate|up,
expert chunks, bf16, and the CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import moe
from jaxserve.pallas_kernels import moe_decode as md
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from jaxserve.pallas_kernels.grouped_matmul import quantize, split_experts


def make(rng, *, t, k, x, d, f, dtype=jnp.float32):
    r = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
    experts = np.stack([rng.choice(x, k, replace=False) for _ in range(t)]).astype(np.int32)
    experts[0, :2] = [x - 1, 0]          # the first and last experts (chunk edges) are read
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    return (r(t, d), weights, jnp.asarray(experts), r(x, d, f, sc=d ** -0.5), r(x, d, f, sc=d ** -0.5),
            r(x, f, d, sc=f ** -0.5))


@pytest.mark.parametrize("t,k,x,d,f", [(1, 8, 16, 64, 32), (3, 2, 8, 48, 80), (5, 4, 12, 128, 64)])
def test_matches_reference_and_the_grouped_path(t, k, x, d, f):
    rng = np.random.default_rng(t * 100 + k)
    h, w, e, gate, up, down = make(rng, t=t, k=k, x=x, d=d, f=f)
    got = md.moe_decode(h, w, e, gate, up, down, impl="pallas", block_k=16, block_f=16, block_d=16)
    want = md.ref_moe_decode(h, w, e, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    grouped = moe.expert_rows_sum({"w_gate": gate, "w_up": up, "w_down": down}, h, w, e, x, "xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(grouped), rtol=2e-5, atol=2e-5)


def test_fused_gate_up_and_expert_chunks():
    """gate|up as one [X, D, 2F] array and every array in chunks of experts (as DeepSeek-V3's
    are held): the same result as whole, separate arrays."""
    rng = np.random.default_rng(3)
    h, w, e, gate, up, down = make(rng, t=2, k=3, x=12, d=32, f=32)
    want = md.moe_decode(h, w, e, gate, up, down, impl="pallas")
    gate_up = jnp.concatenate([gate, up], axis=-1)
    chunks = lambda a, n: split_experts(a, limit=a.size // n)  # noqa: E731
    got = md.moe_decode(h, w, e, chunks(gate_up, 4), None, chunks(down, 3), impl="pallas")
    assert isinstance(chunks(down, 3), tuple) and len(chunks(down, 3)) == 3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    got = md.moe_decode(h, w, e, chunks(gate, 2), chunks(up, 6), down, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_bf16_against_the_reference():
    rng = np.random.default_rng(4)
    args = make(rng, t=2, k=4, x=8, d=64, f=64, dtype=jnp.bfloat16)
    got = md.moe_decode(*args, impl="pallas")
    want = md.ref_moe_decode(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_what_it_refuses_names_the_field():
    rng = np.random.default_rng(5)
    h, w, e, gate, up, down = make(rng, t=1, k=2, x=4, d=32, f=32)
    with pytest.raises(ValueError, match="down"):
        md.moe_decode(h, w, e, gate, up, down[:, :, :16])
    with pytest.raises(ValueError, match="weights_Tk"):
        md.moe_decode(h, w[:, :1], e, gate, up, down)
    assert "FP8" in md.problem(h, quantize(gate, 16), up, down)
    assert "dtype" in md.problem(h.astype(jnp.bfloat16), gate, up, down)


def test_lowers_for_cuda_at_qwen3_moe_shapes():
    """Qwen3-30B-A3B's experts (128 x 2048 x 768, top-8, gate|up fused), one token, bf16."""
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    exported = export_for_cuda(
        lambda h, w, e, gu, dn: md.moe_decode(h, w, e, gu, None, dn, impl="pallas", interpret=False),
        sds((1, 2048), bf), sds((1, 8), jnp.float32), sds((1, 8), jnp.int32),
        sds((128, 2048, 1536), bf), sds((128, 768, 2048), bf))
    assert triton_kernel_names(exported) == ["moe_decode_act_bk128_bf64", "moe_decode_down_bf64_bd128"]


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v32", "minimax_m2", "qwen3_5_moe"])
def test_engine_with_fused_moe_matches_transformers(name, monkeypatch):
    """fused_kernels="moe" (Pallas, interpreted): each request alone decodes in one-token steps,
    whose routed experts take moe_decode; greedy tokens equal the transformers goldens."""
    import os

    from jaxserve import LLM, SamplingParams

    calls = []
    real = md.moe_decode
    monkeypatch.setattr(md, "moe_decode", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    golden = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
    g = np.load(os.path.join(golden, f"{name}.npz"))
    llm = LLM(os.path.join(golden, "ckpt", name), dtype="float32", attention_impl="pallas", fused_kernels="moe",
              max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, block_size=4,
              num_kv_blocks=64, warmup=False)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        out = llm.generate([{"prompt_token_ids": g[f"prompt_{i}"].tolist()}], greedy, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == g[f"greedy_{i}"].tolist()[:4]
    assert calls and all(shape[0] == 1 for shape in calls)     # traced for the one-token steps
