"""DeepSeek loading: FP8 block dequantization, the MTP layer's subtree, dummy weights, configs."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from fp8_checkpoint import F8, fp8_copy, quantize_blocks
from jaxserve.models import deepseek, loader
from jaxserve.models.loaders import deepseek as deepseek_loader
from jaxserve.models.loaders import dummy

CKPT = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "ckpt", "deepseek_v3")


def test_dequantize_blocks_partial_blocks():
    rng = np.random.default_rng(0)
    # magnitudes that differ per block, and sides that are not multiples of 128
    w = rng.normal(size=(200, 300)).astype(np.float32) * np.repeat(
        np.repeat(np.array([[1.0, 10.0, 0.01], [100.0, 0.1, 3.0]]), 128, 0), 128, 1)[:200, :300]
    q, s = quantize_blocks(w, 128)
    got = deepseek_loader.dequantize_blocks(q, s, (128, 128))
    # exact: value times its block's scale
    assert got[150, 290] == np.float32(q[150, 290]) * s[1, 2]
    assert got[0, 0] == np.float32(q[0, 0]) * s[0, 0]
    np.testing.assert_allclose(got, w, rtol=0.07, atol=1e-6 * np.abs(w).max())
    with pytest.raises(ValueError, match="does not match"):
        deepseek_loader.dequantize_blocks(q, s[:, :2], (128, 128))


def _fp8_copy(tmp_path, block: int) -> str:
    """The tiny checkpoint with every 2-D projection stored as FP8 + block scales."""
    return fp8_copy(CKPT, str(tmp_path / "fp8"), block)


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    cfg, ref = loader.load_hf(CKPT)
    cfg8, got = loader.load_hf(_fp8_copy(tmp_path, block=16))
    assert cfg8 == cfg
    raw = deepseek_loader.SafetensorsDir(str(tmp_path / "fp8")).raw("model.layers.1.self_attn.o_proj.weight")
    assert raw.dtype == F8
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0.07, atol=2e-3)
    # the dense layer's MLP and the experts changed (they were quantized), norms did not
    assert not np.array_equal(np.asarray(ref["layers"][1]["w_up"]), np.asarray(got["layers"][1]["w_up"]))
    np.testing.assert_array_equal(np.asarray(ref["layers"][1]["mlp_norm"]), np.asarray(got["layers"][1]["mlp_norm"]))


def test_fp8_checkpoint_keeps_its_experts_in_fp8(tmp_path):
    """quantization="fp8": the routed experts stay e4m3 with their block scales (the values the
    dequantizing load computes, exactly), everything else loads as before."""
    from jaxserve.pallas_kernels import grouped_matmul as gm

    path = _fp8_copy(tmp_path, block=16)
    _, deq = loader.load_hf(path)
    _, kept = loader.load_hf(path, quantization="fp8")
    moe = [i for i, lp in enumerate(kept["layers"]) if "router" in lp]
    assert moe
    for i in moe:
        for name in ("w_gate", "w_up", "w_down"):
            w = kept["layers"][i][name]
            assert isinstance(w, gm.BlockScaledFp8) and w.values.dtype == jax.numpy.float8_e4m3fn
            assert w.block == 16 and w.shape == deq["layers"][i][name].shape
            np.testing.assert_array_equal(np.asarray(gm.dequantize(w)), np.asarray(deq["layers"][i][name]))
    flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(t)}  # noqa: E731
    got, want = flat(kept), flat(deq)
    for key, value in want.items():
        if not any(f"['{n}']" in key for n in ("w_gate", "w_up", "w_down")) or "layers'][0]" in key:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=key)


def test_fp8_kept_experts_give_the_dequantized_engines_tokens(tmp_path):
    """The engine on kept FP8 experts (the grouped matmul reads the FP8 weights and scales)
    samples the greedy tokens of the engine on the dequantized load, with close logprobs."""
    from jaxserve import LLM, SamplingParams

    path = _fp8_copy(tmp_path, block=16)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = {}
    for q in (None, "fp8"):
        llm = LLM(path, dtype="float32", quantization=q, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=64, warmup=False)
        outs[q] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs[None], outs["fp8"]):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        lp = lambda o: [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]  # noqa: E731
        np.testing.assert_allclose(lp(b), lp(a), atol=1e-4)


def test_fp8_quantization_is_refused_where_it_cannot_keep(tmp_path):
    with pytest.raises(ValueError, match="is not one"):
        loader.load_hf(CKPT, quantization="fp8")                 # a bf16 checkpoint
    with pytest.raises(ValueError, match="quantization must be"):
        loader.load_hf(_fp8_copy(tmp_path, block=16), quantization="int4")
    llama = os.path.join(os.path.dirname(CKPT), "llama")
    with pytest.raises(ValueError, match="is built for DeepseekV3ForCausalLM"):
        loader.load_hf(llama, quantization="fp8")


def test_mtp_layer_loads_into_its_own_subtree(tmp_path):
    path = tmp_path / "mtp"
    shutil.copytree(CKPT, path)
    src = deepseek_loader.SafetensorsDir(CKPT)
    rng = np.random.default_rng(1)
    d, v = 64, 256
    extra = {name.replace("model.layers.2.", "model.layers.3."): np.asarray(src.raw(name))
             for name in src.entries if name.startswith("model.layers.2.")}   # a MoE decoder layer
    for name, shape in (("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("eh_proj.weight", (d, 2 * d)),
                        ("shared_head.norm.weight", (d,)), ("shared_head.head.weight", (v, d))):
        extra["model.layers.3." + name] = rng.normal(size=shape).astype(np.float32)
    save_file(extra, str(path / "model-mtp.safetensors"))
    cfg, params = loader.load_hf(str(path))
    assert cfg.num_mtp_layers == 1 and cfg.num_layers == 3 and len(params["layers"]) == 3
    (mtp,) = params["mtp"]
    want = deepseek.mtp_param_shapes(cfg)[0]
    assert {k: v.shape for k, v in mtp.items()} == want
    np.testing.assert_array_equal(np.asarray(mtp["eh_proj"]), extra["model.layers.3.eh_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(mtp["head"]), extra["model.layers.3.shared_head.head.weight"].T)
    for k in ("w_uk", "router", "router_bias", "w_down", "ws_up"):
        np.testing.assert_array_equal(np.asarray(mtp[k]), np.asarray(params["layers"][2][k]))
    # without the MTP tensors (as transformers saves them) there is no subtree
    assert "mtp" not in loader.load_hf(CKPT)[1]


def test_dummy_weights_follow_param_shapes():
    hf = json.load(open(os.path.join(CKPT, "config.json")))
    cfg, params = loader.load_dummy(hf)
    shapes = deepseek.param_shapes(cfg)
    assert jax.tree.map(lambda a: a.shape, params) == jax.tree.map(
        tuple, shapes, is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.parametrize("name", ["DeepSeek-V3-4L", "DeepSeek-V3.2-4L"])
def test_reduced_depth_configs(name):
    cfg = loader.model_config_from_hf(dummy.read_config(name))
    assert (cfg.hidden_size, cfg.num_heads, cfg.latent_dim, cfg.num_experts) == (7168, 128, 576, 256)
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [False, True, True, True]
    assert deepseek.make_rope(cfg).sm_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)


def test_unsupported_routing_is_refused():
    hf = json.load(open(os.path.join(CKPT, "config.json")))
    with pytest.raises(ValueError, match="topk_method"):
        loader.model_config_from_hf(dict(hf, topk_method="group_limited_greedy"))
    with pytest.raises(ValueError, match="n_group"):
        loader.model_config_from_hf(dict(hf, n_group=3))


def test_dummy_draws_a_big_group_array_by_array(monkeypatch):
    """Past BIG_GROUP_ELEMENTS a layer is drawn one array at a time (same shapes, norms ones)."""
    hf = json.load(open(os.path.join(CKPT, "config.json")))
    monkeypatch.setattr(dummy, "BIG_GROUP_ELEMENTS", 1000)
    cfg, params = loader.load_dummy(hf)
    lp = params["layers"][1]
    assert lp["w_gate"].shape == (8, 64, 16) and float(lp["attn_norm"].min()) == 1.0
    assert 0.015 < float(lp["w_gate"].std()) < 0.025
    assert not np.array_equal(np.asarray(lp["w_gate"]), np.asarray(lp["w_up"]))


def test_dummy_fp8_experts_are_quantized_like_a_checkpoint():
    """--load-format dummy --quantization fp8 (the H200 benchmarks' FP8 path): every MoE
    layer's experts are block-scaled FP8 within e4m3's rounding of the drawn weights."""
    from jaxserve.pallas_kernels import grouped_matmul as gm

    _, plain, _ = loader.load_model(CKPT, load_format="dummy", seed=3)
    _, kept, _ = loader.load_model(CKPT, load_format="dummy", seed=3, quantization="fp8")
    for lp, ref in zip(kept["layers"], plain["layers"]):
        for name in ("w_gate", "w_up", "w_down"):
            if "router" in lp:
                w, want = lp[name], np.asarray(ref[name])
                assert isinstance(w, gm.BlockScaledFp8) and w.block == 128
                np.testing.assert_allclose(np.asarray(gm.dequantize(w)), want, rtol=0.07,
                                           atol=0.07 * np.abs(want).max() / 16)
            else:
                assert not isinstance(lp[name], gm.BlockScaledFp8)
    with pytest.raises(ValueError, match="is built for"):
        loader.load_model(os.path.join(os.path.dirname(CKPT), "llama"), load_format="dummy",
                          quantization="fp8")
