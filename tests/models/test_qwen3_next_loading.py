"""Qwen3.5 checkpoint layouts other than save_pretrained's (models/qwen3_next_loader.py): the
ForConditionalGeneration prefix (model.language_model.), fused 3-D experts, mtp.* tensors; and
dummy weights of a Qwen3.5 config running a step."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve.models import qwen3_next
from jaxserve.models.loader import load_model
from hybrid_step_builder import Chunk, build_hybrid_step, empty_caches, scattered_block_tables

CKPT = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "ckpt", "qwen3_5_moe")


def _rewrite_as_vlm(dst: str) -> dict:
    """The tiny Qwen3.5 checkpoint as a ForConditionalGeneration one with fused experts and two
    mtp tensors; returns the mtp tensors written."""
    with safe_open(os.path.join(CKPT, "model.safetensors"), framework="numpy") as f:
        src = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}
    cfg = json.load(open(os.path.join(CKPT, "config.json")))
    out = {}
    for name, t in src.items():
        if ".experts." in name:
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        x = cfg["num_experts"]
        gate_up = [np.concatenate([src[p + f"{j}.gate_proj.weight"], src[p + f"{j}.up_proj.weight"]]) for j in range(x)]
        q = f"model.language_model.layers.{i}.mlp.experts."
        out[q + "gate_up_proj"] = np.stack(gate_up)
        out[q + "down_proj"] = np.stack([src[p + f"{j}.down_proj.weight"] for j in range(x)])
    # an mtp head: fc [D, 2D] as HF stores it, norms, and a copy of layer 1 (full attention)
    rng = np.random.default_rng(0)
    mtp = {"mtp.fc.weight": rng.standard_normal((64, 128)).astype(np.float32)}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = rng.standard_normal(64).astype(np.float32)
    for name, t in out.items():
        if name.startswith("model.language_model.layers.1."):
            mtp[name.replace("model.language_model.layers.1.", "mtp.layers.0.")] = t
    out.update(mtp)
    save_file(out, os.path.join(dst, "model.safetensors"))
    vlm = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": False, "text_config": {k: v for k, v in cfg.items() if k != "architectures"}}
    json.dump(vlm, open(os.path.join(dst, "config.json"), "w"))
    return mtp


def test_conditional_generation_fused_experts_and_mtp(tmp_path):
    mtp = _rewrite_as_vlm(str(tmp_path))
    cfg_a, params_a, _ = load_model(CKPT)
    cfg_b, params_b, _ = load_model(str(tmp_path))
    assert cfg_b.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert cfg_b.layer_types == cfg_a.layer_types and cfg_b.split_projections
    mtp_b = params_b.pop("mtp")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_a, params_b)
    assert "mtp" not in params_a                         # save_pretrained drops the mtp head
    np.testing.assert_array_equal(np.asarray(mtp_b["fc"]), mtp["mtp.fc.weight"].T)     # [in, out]
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        np.testing.assert_array_equal(np.asarray(mtp_b[n]), mtp[f"mtp.{n}.weight"])
    assert len(mtp_b["layers"]) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params_a["layers"][1], mtp_b["layers"][0])


def test_missing_tensor_is_named(tmp_path):
    shutil.copy(os.path.join(CKPT, "config.json"), tmp_path / "config.json")
    with safe_open(os.path.join(CKPT, "model.safetensors"), framework="numpy") as f:
        kept = {k: f.get_tensor(k).astype(np.float32) for k in f.keys() if "layers.2.linear_attn.A_log" not in k}
    save_file(kept, str(tmp_path / "model.safetensors"))
    try:
        load_model(str(tmp_path))
    except ValueError as e:
        assert "model.layers.2.linear_attn.A_log" in str(e)
    else:
        raise AssertionError("a missing tensor must be refused")


def test_dummy_weights_run_a_step():
    hf = json.load(open(os.path.join(CKPT, "config.json")))
    cfg, params, _ = load_model(hf, load_format="dummy")
    assert isinstance(cfg, qwen3_next.Qwen3NextConfig)
    assert float(np.abs(np.asarray(params["layers"][0]["attn_norm"])).max()) == 0.0   # zero-centred
    tables = scattered_block_tables(2, 4, 16)
    caches = empty_caches(qwen3_next.cache_specs(cfg), 16, 8, 3)
    x = build_hybrid_step([Chunk(0, [5, 6, 7], 0), Chunk(1, [9], 0)], tables, np.array([1, 2]), 8, 8, 2)
    caches, hidden, _ = qwen3_next.forward(cfg, params, caches, x)
    assert np.isfinite(np.asarray(qwen3_next.compute_logits(cfg, params, hidden))).all()
    assert float(np.abs(np.asarray(caches[0]["ssm"][1])).max()) > 0          # slot 1 written
    assert float(np.abs(np.asarray(caches[0]["ssm"][0])).max()) == 0         # null slot untouched
