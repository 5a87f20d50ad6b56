"""The fused MoE decode kernels (interpret mode) against their jnp reference and against the
grouped path the models take otherwise (models/moe.py), with separate and fused gate|up,
expert chunks, bf16, block-scaled FP8 weights, and the CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import moe
from jaxserve.pallas_kernels import moe_decode as md
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from jaxserve.pallas_kernels.grouped_matmul import BlockScaledFp8, quantize, split_experts


def make(rng, *, t, k, x, d, f, dtype=jnp.float32):
    r = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
    experts = np.stack([rng.choice(x, k, replace=False) for _ in range(t)]).astype(np.int32)
    experts[0, :2] = [x - 1, 0]          # the first and last experts (chunk edges) are read
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    return (r(t, d), weights, jnp.asarray(experts), r(x, d, f, sc=d ** -0.5), r(x, d, f, sc=d ** -0.5),
            r(x, f, d, sc=f ** -0.5))


# The CPU suite runs one or two cases of each sweep below (each case compiles its own
# interpreted kernel, seconds on 2 cores); the *_GPU cases run in
# tests/gpu/test_gpu_interpret_sweeps.py under `-m gpu`.
SHAPES, SHAPES_GPU = [(3, 2, 8, 48, 80)], [(1, 8, 16, 64, 32), (5, 4, 12, 128, 64)]


@pytest.mark.parametrize("t,k,x,d,f", SHAPES)
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
    assert "FP8" in md.problem(h, quantize(gate, 16), up, down)     # all three FP8, or none
    assert "dtype" in md.problem(h.astype(jnp.bfloat16), gate, up, down)
    q = {name: quantize(a, 16) for name, a in (("gate", gate), ("up", up), ("down", down))}
    assert md.problem(h, q["gate"], q["up"], q["down"]) is None
    assert "one scale block" in md.problem(h, quantize(gate, 32), q["up"], q["down"])
    bad = BlockScaledFp8(q["down"].values, q["down"].scales[:, :1], 16)
    with pytest.raises(ValueError, match=r"f32\[4, 2, 2\] scales"):
        md.moe_decode(h, w, e, q["gate"], q["up"], bad)


def test_lowers_for_cuda_at_qwen3_moe_shapes():
    """Qwen3-30B-A3B's experts (128 x 2048 x 768, top-8, gate|up fused), one token, bf16."""
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    exported = export_for_cuda(
        lambda h, w, e, gu, dn: md.moe_decode(h, w, e, gu, None, dn, impl="pallas", interpret=False),
        sds((1, 2048), bf), sds((1, 8), jnp.float32), sds((1, 8), jnp.int32),
        sds((128, 2048, 1536), bf), sds((128, 768, 2048), bf))
    assert triton_kernel_names(exported) == ["moe_decode_act_bk128_bf64", "moe_decode_down_bf64_bd128"]


# -- block-scaled FP8 weights (DeepSeek-V3's experts, --quantization fp8) ------------------------


def fp8_experts(rng, *, x, d, f, block, fused):
    """(gate, up, down) as BlockScaledFp8 (gate|up as one [X, D, 2F] and up None if fused),
    from weights whose magnitude differs block to block, so that a tile scaled by the wrong
    block's scale shows."""
    def weight(k, n):
        w = rng.standard_normal((x, k, n)) * k ** -0.5
        w *= np.repeat(np.repeat(rng.uniform(0.25, 4.0, (x, -(-k // block), -(-n // block))), block, 1),
                       block, 2)[:, :k, :n]
        return jnp.asarray(w, jnp.float32)
    gate, up, down = weight(d, f), weight(d, f), weight(f, d)
    if fused:
        return quantize(jnp.concatenate([gate, up], axis=-1), block), None, quantize(down, block)
    return quantize(gate, block), quantize(up, block), quantize(down, block)


FP8_CASES = {   # t, x, d, f, scale block, fused gate|up, expert chunks (gate|up, down), tiles
    "one_token_fused": (1, 4, 256, 128, 128, True, (1, 1), {}),
    "3_tokens_separate_chunks": (3, 4, 128, 256, 128, False, (2, 4), {}),
    "3_tokens_fused_chunks": (3, 4, 256, 128, 128, True, (4, 2), {}),
    # scale blocks of 32 over 16-wide tiles: several tiles a block, several blocks a dim, and
    # gate|up's block 1 across its two halves (F = 48)
    "small_blocks_fused": (3, 4, 96, 48, 32, True, (2, 1), dict(block_k=16, block_f=16, block_d=16)),
}


# separate gate and up in chunks; small scale blocks (fused gate|up, tiles within blocks)
FP8_CPU, FP8_GPU = ["3_tokens_separate_chunks", "small_blocks_fused"], ["one_token_fused", "3_tokens_fused_chunks"]


@pytest.mark.parametrize("case", FP8_CPU)
def test_fp8_matches_reference_and_the_grouped_path(case):
    t, x, d, f, block, fused, (n_gu, n_down), tiles = FP8_CASES[case]
    rng = np.random.default_rng(list(FP8_CASES).index(case))
    h, w, e = make(rng, t=t, k=2, x=x, d=d, f=16)[:3]
    gate, up, down = fp8_experts(rng, x=x, d=d, f=f, block=block, fused=fused)
    chunks = lambda a, n: a if n == 1 else split_experts(a, limit=a.size // n)  # noqa: E731
    gate_c, down_c = chunks(gate, n_gu), chunks(down, n_down)
    up_c = None if up is None else chunks(up, n_gu)
    assert md.problem(h, gate_c, up_c, down_c) is None
    # bf16 activations as the models run them; f32 too for the small blocks (a tighter check)
    for dtype, tol in [(jnp.bfloat16, 2e-2)] + [(jnp.float32, 2e-5)] * (block < 128):
        hd = h.astype(dtype)
        got = md.moe_decode(hd, w, e, gate_c, up_c, down_c, impl="pallas", **tiles)
        want = md.ref_moe_decode(hd, w, e, gate, up, down)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
    lp = {"w_gate_up": gate, "w_down": down} if fused else {"w_gate": gate, "w_up": up, "w_down": down}
    grouped = np.asarray(moe.expert_rows_sum(lp, h.astype(jnp.bfloat16), w, e, x, "xla"))
    # (its "xla" matmuls round the dequantized weights to bf16: some 0.5 % of the outputs' scale)
    np.testing.assert_allclose(np.asarray(got), grouped, rtol=2e-2, atol=1e-2 * np.abs(grouped).max())


def test_fp8_routed_experts_take_moe_decode(monkeypatch):
    """models/moe.py routed_experts with impl "fused": a one-token step over FP8 expert chunks
    (as the engine holds DeepSeek-V3's) goes through moe_decode, to the grouped path's result."""
    rng = np.random.default_rng(6)
    h, w, e = make(rng, t=1, k=2, x=4, d=128, f=16, dtype=jnp.bfloat16)[:3]
    gate, up, down = fp8_experts(rng, x=4, d=128, f=128, block=128, fused=False)
    lp = {"w_gate": split_experts(gate, gate.size // 2), "w_up": split_experts(up, up.size // 2),
          "w_down": split_experts(down, down.size // 2)}
    calls = []
    real = md.moe_decode
    monkeypatch.setattr(md, "moe_decode", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    got = moe.routed_experts(lambda p, x: (w, e), lp, h, 4, "fused")
    assert calls == [(1, 128)]
    want = np.asarray(moe.expert_rows_sum(lp, h, w, e, 4, "xla").astype(jnp.bfloat16), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=1e-2 * np.abs(want).max())


def test_fp8_lowers_for_cuda_at_deepseek_v3_shapes():
    """DeepSeek-V3's experts (256 x 7168 x 2048, top-8, block-scaled FP8, separate gate and up
    as its checkpoints hold them, each in two chunks of 128 experts), one token, bf16."""
    sds, bf, f8, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32

    def fn(h, w, e, gv, gs, uv, us, dv, ds):
        q = lambda v, s: BlockScaledFp8(v, s).split(2)  # noqa: E731
        return md.moe_decode(h, w, e, q(gv, gs), q(uv, us), q(dv, ds), impl="pallas", interpret=False)

    exported = export_for_cuda(
        fn, sds((1, 7168), bf), sds((1, 8), jnp.float32), sds((1, 8), jnp.int32),
        sds((256, 7168, 2048), f8), sds((256, 56, 16), f32), sds((256, 7168, 2048), f8),
        sds((256, 56, 16), f32), sds((256, 2048, 7168), f8), sds((256, 16, 56), f32))
    assert triton_kernel_names(exported) == ["moe_decode_act_fp8_bk128_bf64",
                                             "moe_decode_down_fp8_bf64_bd128"]


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v32", "minimax_m2", "qwen3_5_moe"])
def test_engine_with_fused_moe_matches_transformers(name, monkeypatch):
    """fused_kernels="moe" (Pallas, interpreted): each request alone decodes in one-token steps,
    whose routed experts take moe_decode; greedy tokens equal the transformers goldens. (With
    "linear" too, the fused stack's MoE layers: tests/pallas_kernels/test_fused_linear.py.)"""
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
