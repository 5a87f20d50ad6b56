"""Load a model by name or path: (ModelConfig, params on the device, Tokenizer).

`model` may be None (the embedded default model), a `.gguf` file, or a HF directory
(config.json + safetensors). `load_format` is "auto", "gguf", "safetensors" or "dummy".
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.tokenizer import Tokenizer


def resolve_model_path(model: str | None) -> str:
    from jaxserve import default_model

    if model is None or model in ("default", default_model.DEFAULT_MODEL_NAME):
        return default_model.ensure_default_model()
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model {model!r} not found: pass a .gguf file, a HF model directory, or nothing "
            f"for the default model (jaxserve never downloads from a model hub)")
    return model


def load_model(model: str | None, load_format: str = "auto", dtype: str = "float32"
               ) -> tuple[ModelConfig, dict, Tokenizer]:
    from jaxserve.models import gguf_loader

    path = resolve_model_path(model)
    if load_format not in ("auto", "gguf", "safetensors", "dummy"):
        raise ValueError(f"load_format must be one of auto, gguf, safetensors, dummy; got {load_format!r}")
    jdtype = jnp.dtype(dtype)
    if load_format == "gguf" or (load_format == "auto" and path.endswith(".gguf")):
        cfg, params, meta = gguf_loader.load_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(meta, cfg.eos_token_ids)
        return cfg, to_device(params, jdtype), tokenizer
    raise ValueError(f"cannot load {path!r} with load_format={load_format!r}")


def to_device(params: dict, dtype) -> dict:
    """Move a numpy parameter tree onto the default device in `dtype` (norm weights too)."""
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), dtype=dtype), params)
