"""A PEFT LoRA adapter, as `save_pretrained` writes it, laid out on the engine's projections.

The engine multiplies by fused projections (models/llama.py fuse_projections): q|k|v as one
`wqkv` [D, (N+2K)*E] and gate|up as one `w_gate_up` [D, 2F], beside `wo` and `w_down`. An
adapter's modules become, per layer and fused projection, one pair

    a [in, P*R]  (the parts' A matrices side by side, each zero-padded from its rank to R)
    b [P*R, out] (block-diagonal: part p's rows p*R.. hold its B, scaled, over its columns)

so x @ a @ b is the sum of each targeted part's low-rank update in its own columns, and an
untargeted part (or a rank below R) adds zeros. P: the projection's parts (3, 1, 2, 1); R:
the slot rank, max_lora_rank rounded up to 16 (the Pallas kernel's smallest dot tile).

The scale folded into b: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (use_rslora),
r being the module's own rank (rank_pattern) and alpha its alpha_pattern entry if any.
Refused, with the option named: DoRA, bias training, embedding / LM-head targets,
modules_to_save, trainable tokens, other PEFT types, ranks past max_lora_rank, shapes of
another model.

Legend: D model dim, N query heads, K kv heads, E head dim, F MLP dim, R slot rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxserve.config import ModelConfig

# fused projection -> the PEFT module names of its parts, in output-column order
FUSED_PARTS = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
               "w_gate_up": ("gate_proj", "up_proj"), "w_down": ("down_proj",)}
SUPPORTED_MODULES = tuple(m for parts in FUSED_PARTS.values() for m in parts)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def slot_rank(max_lora_rank: int) -> int:
    """R: max_lora_rank rounded up to a multiple of 16."""
    return -(-max_lora_rank // 16) * 16


def projection_dims(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """fused projection -> (input width, output width of each part)."""
    d, n, k, e, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {"wqkv": (d, (n * e, k * e, k * e)), "wo": (n * e, (d,)),
            "w_gate_up": (d, (f, f)), "w_down": (f, (d,))}


class LoRAError(ValueError):
    """An adapter the engine cannot serve (the message says why and what is allowed)."""


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's host arrays: layers[i][fused name] = (a f32[in, P*R], b f32[P*R, out])."""
    name: str
    int_id: int
    max_rank: int                      # its largest module rank
    targets: tuple[str, ...]           # the PEFT modules it adapts
    layers: tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for lp in self.layers for a, b in lp.values())


def _refuse(path: str, what: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {path}: {what}")


def read_config(path: str) -> dict:
    """adapter_config.json, checked for the options this engine serves."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path) or not os.path.isfile(file):
        raise _refuse(path, f"no {CONFIG_FILE} there (a PEFT adapter directory holds "
                            f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(file) as f:
        conf = json.load(f)
    if conf.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {conf.get('peft_type')!r} is not supported; only LORA")
    if conf.get("use_dora"):
        raise _refuse(path, "use_dora (DoRA) is not supported; merge it or train plain LoRA")
    if conf.get("bias", "none") != "none" or conf.get("lora_bias"):
        raise _refuse(path, f"bias={conf.get('bias')!r} / lora_bias: trained biases are not "
                            "supported; only bias='none'")
    for option in ("modules_to_save", "trainable_token_indices", "layer_replication"):
        if conf.get(option):
            raise _refuse(path, f"{option} is not supported (only low-rank updates of "
                                f"{', '.join(SUPPORTED_MODULES)})")
    targets = conf.get("target_modules") or []
    if isinstance(targets, str):
        raise _refuse(path, f"target_modules as a pattern ({targets!r}) is not supported; "
                            f"list module names among {', '.join(SUPPORTED_MODULES)}")
    bad = sorted(set(targets) - set(SUPPORTED_MODULES))
    if bad:
        kind = "embeddings / the LM head" if {"embed_tokens", "lm_head"} & set(bad) else "modules"
        raise _refuse(path, f"target_modules {bad} ({kind}) are not supported; allowed: "
                            f"{', '.join(SUPPORTED_MODULES)}")
    return conf


def _pattern_value(patterns: dict, module_key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key naming the module (or a suffix of
    its dotted path) wins."""
    for pattern, value in (patterns or {}).items():
        if module_key == pattern or module_key.endswith("." + pattern) or re.fullmatch(
                rf"(.*\.)?{pattern}", module_key):
            return value
    return default


def load_adapter(name: str, int_id: int, path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read a PEFT adapter directory into the fused layout (module doc)."""
    from safetensors.numpy import load_file
    conf = read_config(path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise _refuse(path, f"no {WEIGHTS_FILE} (adapter_model.bin is not read; save with "
                            "safe_serialization=True)")
    tensors = load_file(weights_path)
    r_slot = slot_rank(max_lora_rank)
    dims = projection_dims(cfg)
    part_of = {m: (fused, i) for fused, parts in FUSED_PARTS.items() for i, m in enumerate(parts)}
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in part_of:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A/B weight of "
                                f"{', '.join(SUPPORTED_MODULES)} (DoRA magnitudes, embeddings "
                                "and biases are not supported)")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    layers = [{f: (np.zeros((din, len(outs) * r_slot), np.float32),
                   np.zeros((len(outs) * r_slot, sum(outs)), np.float32))
               for f, (din, outs) in dims.items()} for _ in range(cfg.num_layers)]
    max_rank = 0
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {module}: lora_A and lora_B must both be there")
        if layer >= cfg.num_layers:
            raise _refuse(path, f"layer {layer} {module}: the model has {cfg.num_layers} layers")
        fused, part = part_of[module]
        din, outs = dims[fused]
        a_RI, b_OR = ab["A"].astype(np.float32), ab["B"].astype(np.float32)
        r = a_RI.shape[0]
        if a_RI.shape != (r, din) or b_OR.shape != (outs[part], r):
            raise _refuse(path, f"layer {layer} {module}: A {a_RI.shape} and B {b_OR.shape} do not "
                                f"fit this model ({din} in, {outs[part]} out): an adapter of "
                                "another base model?")
        if r > max_lora_rank:
            raise _refuse(path, f"layer {layer} {module} has rank {r}; max_lora_rank is "
                                f"{max_lora_rank} (raise --max-lora-rank)")
        module_key = f"model.layers.{layer}.{module}"
        alpha = _pattern_value(conf.get("alpha_pattern"), module_key, conf.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        a, b = layers[layer][fused]
        col = sum(outs[:part])
        a[:, part * r_slot:part * r_slot + r] = a_RI.T
        b[part * r_slot:part * r_slot + r, col:col + outs[part]] = scale * b_OR.T
        max_rank = max(max_rank, r)
    if not found:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(name, int_id, max_rank, tuple(sorted({m for _, m in found})), tuple(layers))
