"""Random PEFT adapters for a model's shapes, written as peft saves them (benchmarks, tests):
adapter_config.json + adapter_model.safetensors, every layer's q/k/v/o and gate/up/down."""

from __future__ import annotations

import json
import os

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.lora.adapter import CONFIG_FILE, FUSED_PARTS, WEIGHTS_FILE, projection_dims
from jaxserve.lora.request import LoRARequest


def write_random_adapter(path: str, cfg: ModelConfig, rank: int, seed: int = 0,
                         scale: float = 0.02) -> str:
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    dims = projection_dims(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for fused, parts in FUSED_PARTS.items():
            din, outs = dims[fused]
            for module, dout in zip(parts, outs):
                where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{where}.{module}"
                tensors[f"{key}.lora_A.weight"] = (scale * rng.standard_normal((rank, din))).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (scale * rng.standard_normal((dout, rank))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": [m for parts in FUSED_PARTS.values() for m in parts]}, f)
    return path


def random_adapters(directory: str, cfg: ModelConfig, count: int, rank: int,
                    first_id: int = 1) -> list[LoRARequest]:
    """`count` random adapters under `directory`, as LoRARequests (ids first_id, ...)."""
    return [LoRARequest(f"random-{i}", i, write_random_adapter(os.path.join(directory, f"random-{i}"),
                                                               cfg, rank, seed=i))
            for i in range(first_id, first_id + count)]
