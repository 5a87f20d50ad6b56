"""MiniMax-M2 loading: a sharded FP8 block-scaled copy of the tiny checkpoint, refused configs
and tensors, dummy weights, the reduced-depth full-width config, the whole engine."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from fp8_checkpoint import F8, quantize_blocks
from jaxserve import LLM, SamplingParams
from jaxserve.models import loader, minimax_m2
from jaxserve.models.loaders import deepseek as deepseek_loader
from jaxserve.models.loaders import dummy

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
CKPT = os.path.join(GOLDEN, "ckpt", "minimax_m2")


def _hf() -> dict:
    with open(os.path.join(CKPT, "config.json")) as f:
        return json.load(f)


def _fp8_sharded_copy(tmp_path, block: int) -> str:
    """The tiny checkpoint with every Linear but the router in FP8 + block scales (as MiniMax
    publishes it: the gate stays unquantized), split over two files by layer."""
    src = deepseek_loader.SafetensorsDir(CKPT)
    files: list[dict] = [{}, {}]
    for name in src.entries:
        w = np.asarray(src.raw(name), np.float32)
        part = files[1 if "layers.1." in name else 0]
        if w.ndim == 2 and "embed" not in name and "gate." not in name and name != "lm_head.weight":
            part[name], part[name + "_scale_inv"] = quantize_blocks(w, block)
        else:
            part[name] = np.asarray(src.raw(name))
    path = tmp_path / "fp8"
    path.mkdir()
    for i, part in enumerate(files):
        save_file(part, str(path / f"model-{i + 1:05d}-of-00002.safetensors"))
    hf = dict(_hf(), quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                          "weight_block_size": [block, block]})
    with open(path / "config.json", "w") as f:
        json.dump(hf, f)
    return str(path)


def test_fp8_sharded_checkpoint_loads_dequantized(tmp_path):
    cfg, ref = loader.load_hf(CKPT)
    path = _fp8_sharded_copy(tmp_path, block=16)
    cfg8, got = loader.load_hf(path)
    assert cfg8 == cfg
    ck = deepseek_loader.SafetensorsDir(path)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert ck.raw(name).dtype == F8
    # exactly the stored values times their block's scale, transposed to [in, out]
    want = deepseek_loader.dequantize_blocks(ck.raw(name), ck.raw(name + "_scale_inv"), (16, 16)).T
    np.testing.assert_array_equal(np.asarray(got["layers"][1]["w_down"][3]), want)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0.07, atol=2e-3)
    assert not np.array_equal(np.asarray(ref["layers"][0]["wq"]), np.asarray(got["layers"][0]["wq"]))
    np.testing.assert_array_equal(np.asarray(ref["layers"][0]["router"]), np.asarray(got["layers"][0]["router"]))


def test_bfloat16_load_keeps_the_router_bias_f32():
    _, params = loader.load_hf(CKPT, "bfloat16")
    assert params["layers"][0]["router_bias"].dtype == np.float32
    assert params["layers"][0]["wq"].dtype == jax.numpy.bfloat16


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    src = deepseek_loader.SafetensorsDir(CKPT)
    tensors = {n: np.asarray(src.raw(n)) for n in src.entries}
    path = tmp_path / "bad"
    path.mkdir()
    shutil.copy(os.path.join(CKPT, "config.json"), path)
    gone = "model.layers.1.block_sparse_moe.e_score_correction_bias"
    save_file({n: t for n, t in tensors.items() if n != gone}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        loader.load_hf(str(path))
    tensors["model.layers.0.self_attn.k_norm.weight"] = np.ones(32, np.float32)   # a per-head norm
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"k_norm.*\(32,\).*\(64,\)"):
        loader.load_hf(str(path))


@pytest.mark.parametrize("change, field", [
    (dict(rotary_dim=7), "rotary_dim"), (dict(rotary_dim=64), "rotary_dim"),
    (dict(shared_intermediate_size=64), "shared_intermediate_size"),
    (dict(attn_type_list=[0, 1]), "attn_type_list"), (dict(qk_norm_type="per_head"), "qk_norm_type"),
    (dict(scoring_func="softmax"), "scoring_func"), (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling"),
])
def test_unsupported_configs_are_refused(change, field):
    with pytest.raises(ValueError, match=field):
        loader.model_config_from_hf(dict(_hf(), **change))


def test_partial_rotary_factor_is_read_when_rotary_dim_is_absent():
    hf = {k: v for k, v in _hf().items() if k not in ("rotary_dim", "rope_theta")}
    for rope in ({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                 {"rope_theta": 1e6, "partial_rotary_factor": 0.25}):         # no rope_type
        cfg = loader.model_config_from_hf(dict(hf, rope_parameters=rope))
        assert (cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling) == (8, 1e6, None)


def test_dummy_weights_follow_param_shapes():
    cfg, params = loader.load_dummy(_hf())
    assert jax.tree.map(lambda a: a.shape, params) == jax.tree.map(
        tuple, minimax_m2.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert params["layers"][0]["router_bias"].dtype == np.float32
    assert float(params["layers"][0]["q_norm"].min()) == 1.0


def test_reduced_depth_full_width_config():
    """MiniMax-M2's published dims (transformers' MiniMaxM2Config defaults), 4 layers."""
    cfg = loader.model_config_from_hf(dummy.read_config("MiniMax-M2-4L"))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3072, 4, 48, 8, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 1536)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.vocab_size) == (64, 5e6, 200064)
    lp = minimax_m2.param_shapes(cfg)["layers"][0]
    assert lp["q_norm"] == (48 * 128,) and lp["k_norm"] == (8 * 128,)


def test_engine_matches_transformers_batched_chunked_and_on_prefix_hits():
    """Through the whole engine (cache manager, runner, fused projections): greedy tokens
    equal transformers' with 8-token steps (the long prompt chunked beside the others'
    decodes); a second pass hits the prefix cache; every block is free afterwards."""
    g = np.load(os.path.join(GOLDEN, "minimax_m2.npz"))
    prompts = [g[f"prompt_{i}"].tolist() for i in range(3)]
    steps = 8
    want = [g[f"greedy_{i}"].tolist()[:steps] for i in range(3)]
    llm = LLM(CKPT, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
              block_size=4, num_kv_blocks=64, warmup=False)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert run() == want
    hits = llm.get_metrics()["prefix_cache_hits_total"]
    assert run() == want
    assert llm.get_metrics()["prefix_cache_hits_total"] > hits
    s = llm.engine.scheduler
    assert not s.requests and s.pool.num_used == 0


def _write_gguf(path: str) -> None:
    """The tiny checkpoint as llama.cpp's convert_hf_to_gguf.py writes MiniMax-M2 (its tensor
    and metadata names, from the gguf package): q/k rows as in HF (no permutation), experts
    stacked [X, out, in], the correction bias as exp_probs_b.bias; f32 tensors."""
    import gguf

    hf, src = _hf(), deepseek_loader.SafetensorsDir(CKPT)
    f32 = lambda name: np.asarray(src.raw(name), np.float32)  # noqa: E731
    w = gguf.GGUFWriter(path, "minimax-m2")
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_expert_count(hf["num_local_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf["intermediate_size"])
    w.add_rope_dimension_count(hf["rotary_dim"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(hf["vocab_size"])
    w.add_tensor("token_embd.weight", f32("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", f32("model.norm.weight"))
    w.add_tensor("output.weight", f32("lm_head.weight"))
    names = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
             "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
             "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
             "exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias"}
    for i in range(hf["num_hidden_layers"]):
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}", f32(f"model.layers.{i}.{theirs}"))
        for ours, theirs in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            w.add_tensor(f"blk.{i}.{ours}.weight", np.stack([
                f32(f"model.layers.{i}.block_sparse_moe.experts.{j}.{theirs}.weight")
                for j in range(hf["num_local_experts"])]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_like_the_hf_checkpoint(tmp_path):
    from jaxserve.models.loaders import gguf as gguf_loader

    path = str(tmp_path / "tiny-minimax-m2.gguf")
    _write_gguf(path)
    cfg, host, _ = gguf_loader.load_gguf(path)
    hf_cfg, ref = loader.load_hf(CKPT)
    # eps passes through f32 metadata; bos / eos come from tokenizer metadata, absent here
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps, bos_token_id=1, eos_token_ids=(2,)) == hf_cfg
    assert jax.tree.structure(host) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(a), b)
