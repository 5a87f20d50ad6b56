"""Load a model by name or path: (ModelConfig, params on the device, Tokenizer).

`model` may be None (the embedded default model), a `.gguf` file, or a HF directory
(config.json + safetensors). `load_format` is "auto", "gguf", "safetensors" or "dummy".
With a `mesh` (jaxserve.sharding.mesh.make_mesh), parameters are placed sharded as they load.
The tokenizer is None when the source has no tokenizer (see `load_model`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import registry
from jaxserve.models.loaders import default_model, dummy, gguf as gguf_loader, hf as hf_loader
from jaxserve.sharding import rules
from jaxserve.tokenizer import Tokenizer


def resolve_model_path(model: str | None) -> str:
    from jaxserve.models.loaders import default_model

    if model is None or model in ("default", default_model.DEFAULT_MODEL_NAME):
        return default_model.ensure_default_model()
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model {model!r} not found: pass a .gguf file, a HF model directory, or nothing "
            f"for the default model (jaxserve never downloads from a model hub)")
    return model


def load_model(model: str | None, load_format: str = "auto", dtype: str = "float32", *,
               mesh=None, seed: int = 0,
               quantization: str | None = None,
               tokenizer: str | None = None) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """(config, params on the device or sharded over `mesh`, tokenizer).

    The tokenizer is None when there is nothing to build it from (a HF directory without
    tokenizer files, or dummy weights from a bare config): the engine then accepts only
    `prompt_token_ids`, and anything that needs text must say so.
    For `load_format="dummy"`, `model` may also be a config.json path or the name of a ready
    config in models/configs/ (e.g. "Qwen3-30B-A3B"). quantization "fp8": an FP8 HF
    checkpoint's experts stay FP8 (a family that keeps_fp8_experts). tokenizer: a HF
    directory to take the tokenizer from instead of the model's (vLLM's --tokenizer).
    """
    cfg, params, own = _load_model(model, load_format, dtype, mesh=mesh, seed=seed,
                                   quantization=quantization)
    if tokenizer is None:
        return cfg, params, own
    if not (os.path.isdir(tokenizer) and hf_loader.has_tokenizer_files(tokenizer)):
        raise ValueError(f"tokenizer {tokenizer!r}: not a directory with tokenizer files "
                         f"(tokenizer.json, tokenizer.model or tokenizer_config.json); nothing is downloaded")
    return cfg, params, Tokenizer.from_pretrained(tokenizer, cfg.eos_token_ids)


def _load_model(model, load_format, dtype, *, mesh, seed, quantization):
    if load_format not in ("auto", "gguf", "safetensors", "dummy"):
        raise ValueError(f"load_format must be one of auto, gguf, safetensors, dummy; got {load_format!r}")
    if load_format == "dummy":
        # no model: the default model's shape, with its tokenizer if its GGUF is at hand
        default_gguf = default_model.default_model_path() if model is None else None
        cfg, params = load_dummy(model or default_model.DEFAULT_MODEL_NAME, dtype, mesh, seed)
        if quantization is not None:     # as an FP8 checkpoint of this shape would load
            if not registry.get_family(cfg.architecture).keeps_fp8_experts:
                raise ValueError(f"quantization {quantization!r} is built for "
                                 f"{', '.join(fp8_architectures())}; got {cfg.architecture}")
            from jaxserve.models.moe import quantize_experts_fp8
            params = quantize_experts_fp8(params)
        tokenizer = None
        if isinstance(model, str) and hf_loader.is_hf_dir(model) and hf_loader.has_tokenizer_files(model):
            tokenizer = Tokenizer.from_pretrained(model, cfg.eos_token_ids)
        elif default_gguf is not None and os.path.isfile(default_gguf):
            meta = gguf_loader.read_metadata(gguf_loader.open_gguf(default_gguf))
            tokenizer = Tokenizer.from_gguf_metadata(meta, cfg.eos_token_ids)
        return cfg, params, tokenizer
    path = resolve_model_path(model)
    jdtype = jnp.dtype(dtype)
    if quantization is not None and not (load_format in ("auto", "safetensors") and hf_loader.is_hf_dir(path)):
        raise ValueError(f"quantization {quantization!r} keeps an FP8 HF checkpoint's weights as they "
                         f"are; {path!r} is not a HF directory")
    if load_format == "gguf" or (load_format == "auto" and path.endswith(".gguf")):
        cfg, params, meta = gguf_loader.load_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(meta, cfg.eos_token_ids)
        if mesh is not None:
            family = registry.get_family(cfg.architecture)
            return cfg, rules.shard_params(family, params, cfg, mesh, jdtype), tokenizer
        return cfg, to_device(params, jdtype), tokenizer
    if load_format == "safetensors" or (load_format == "auto" and hf_loader.is_hf_dir(path)):
        cfg, params = load_hf(path, dtype, mesh, quantization)
        tokenizer = (Tokenizer.from_pretrained(path, cfg.eos_token_ids)
                     if hf_loader.has_tokenizer_files(path) else None)
        return cfg, params, tokenizer
    raise ValueError(f"cannot load {path!r} with load_format={load_format!r}: expected a .gguf file "
                     f"or a directory with config.json and *.safetensors")


def to_device(params: dict, dtype) -> dict:
    """Move a numpy parameter tree onto the default device in `dtype` (norm weights too)."""
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), dtype=dtype), params)


def model_config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig of a supported architecture (its family's config_from_hf); unsupported
    architectures and variants are refused by name."""
    arch = (hf.get("architectures") or ["?"])[0]
    return registry.get_family(arch).config_from_hf(hf)   # raises, listing the supported ones


def fp8_architectures() -> list[str]:
    """The architectures whose loader can keep an FP8 checkpoint's experts in FP8."""
    return [arch for arch, family in registry.ARCHITECTURES.items() if family.keeps_fp8_experts]


def load_hf(path: str, dtype: str = "float32", mesh=None,
            quantization: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, params as jax arrays in `dtype`) of a HF directory, sharded over `mesh` if
    given. quantization "fp8": an FP8 checkpoint's experts kept in FP8 (fp8_architectures)."""
    cfg = model_config_from_hf(hf_loader.read_hf_config(path))
    family = registry.get_family(cfg.architecture)
    if quantization is not None and not family.keeps_fp8_experts:
        raise ValueError(f"quantization {quantization!r} is built for "
                         f"{', '.join(fp8_architectures())} checkpoints; {path!r} is "
                         f"{cfg.architecture}")
    return family.load_hf(path, cfg, dtype, mesh, quantization)


def dummy_params(cfg: ModelConfig, dtype: str = "float32", mesh=None, seed: int = 0) -> dict:
    """Random parameters for `cfg` (its family's dummy_params: norm weights ones, the rest
    N(0, INIT_STD^2) unless the family says otherwise)."""
    return registry.get_family(cfg.architecture).dummy_params(cfg, dtype, mesh, seed)


def load_dummy(source: str | dict, dtype: str = "float32", mesh=None,
               seed: int = 0) -> tuple[ModelConfig, dict]:
    """(config, random parameters) of a config dict, config.json, HF directory or ready config
    name (loaders/dummy.py read_config)."""
    cfg = model_config_from_hf(dummy.read_config(source))
    return cfg, dummy_params(cfg, dtype, mesh, seed)
