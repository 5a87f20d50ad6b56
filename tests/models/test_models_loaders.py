"""HF safetensors loader (sharded index, errors that name the problem, tokenizer files) and the
dummy loader (shapes of the ready 8B / 30B-A3B configs, random weights that run)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.loaders import dummy
from jaxserve.models.loader import load_model


def _tensors(ckpt: str) -> dict:
    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _copy_config(ckpt: str, dst, **changes) -> dict:
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    return cfg


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2"])
def test_sharded_index_loads_like_one_file(name, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(name)
    tensors = _tensors(src)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in halves.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _copy_config(src, tmp_path)
    _, want, _ = load_model(src)
    _, got, _ = load_model(str(tmp_path), load_format="safetensors")
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_bfloat16_params(tiny_checkpoint):
    _, params, _ = load_model(tiny_checkpoint("mixtral"), dtype="bfloat16")
    assert {a.dtype.name for a in jax.tree.leaves(params)} == {"bfloat16"}


def test_unsupported_architecture_is_named(tiny_checkpoint, tmp_path):
    shutil.copy(os.path.join(tiny_checkpoint("llama"), "model.safetensors"), tmp_path)
    _copy_config(tiny_checkpoint("llama"), tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    tensors = _tensors(tiny_checkpoint("mixtral"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _copy_config(tiny_checkpoint("mixtral"), tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        load_model(str(tmp_path))


def test_shape_mismatch_is_named(tiny_checkpoint, tmp_path):
    shutil.copy(os.path.join(tiny_checkpoint("qwen3"), "model.safetensors"), tmp_path)
    _copy_config(tiny_checkpoint("qwen3"), tmp_path, intermediate_size=100)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(64, 100\)"):
        load_model(str(tmp_path))


def test_not_a_model_dir(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_tokenizer_files_give_a_tokenizer(tiny_checkpoint, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    src = tiny_checkpoint("llama")
    shutil.copy(os.path.join(src, "model.safetensors"), tmp_path)
    _copy_config(src, tmp_path)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(str(tmp_path))
    _, _, tok = load_model(str(tmp_path))
    ids = tok.encode("hi!")
    assert len(ids) == 3 and tok.decode(ids) == "hi!"


# Parameter counts from the public model cards (embeddings included).
@pytest.mark.parametrize("name,billions", [("Llama-3.1-8B", 8.03), ("Qwen3-8B", 8.19),
                                           ("Qwen3-30B-A3B", 30.5)])
def test_ready_dummy_configs(name, billions):
    cfg = ModelConfig.from_hf(dummy.read_config(name))
    count = sum(int(np.prod(s)) for s in jax.tree.leaves(llama.param_shapes(cfg),
                                                         is_leaf=lambda x: isinstance(x, tuple)))
    assert abs(count / 1e9 - billions) < 0.05 * billions, count


def test_dummy_weights_run(tiny_checkpoint):
    from model_step_builder import Chunk, build_step, empty_kv_cache, scattered_block_tables

    cfg, params, tok = load_model(tiny_checkpoint("qwen3_moe"), load_format="dummy", seed=3)
    assert tok is None
    shapes = jax.tree.map(lambda a: a.shape, params)
    assert shapes == jax.tree.map(tuple, llama.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    np.testing.assert_array_equal(params["layers"][0]["attn_norm"], 1.0)
    assert 0.015 < float(np.std(params["layers"][1]["w_up"])) < 0.025
    tables = scattered_block_tables(1, 2, 4)
    x = build_step([Chunk(0, [5, 6, 7], 0)], tables, 8, 4, 1)
    _, hidden, _ = jax.jit(llama.forward, static_argnums=0)(cfg, params, empty_kv_cache(cfg, 4, 8), x)
    assert np.isfinite(np.asarray(llama.compute_logits(cfg, params, hidden))).all()


def test_dummy_without_a_model_takes_the_default_models_shape():
    """(and its tokenizer where its GGUF is at hand: nothing is fetched for dummy weights)"""
    from jaxserve.models.loaders.default_model import default_model_path

    cfg, _, tokenizer = load_model(None, load_format="dummy")
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (576, 30, 49152)
    assert (tokenizer is not None) == os.path.isfile(default_model_path())


def test_dummy_of_an_unknown_config_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="Qwen3-30B-A3B"):
        load_model("no-such-config", load_format="dummy")


def test_unsupported_rope_scaling_is_named(tiny_checkpoint, tmp_path):
    shutil.copy(os.path.join(tiny_checkpoint("qwen2"), "model.safetensors"), tmp_path)
    _copy_config(tiny_checkpoint("qwen2"), tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn'"):
        load_model(str(tmp_path))
