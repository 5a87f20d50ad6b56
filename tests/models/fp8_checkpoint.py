"""Tiny FP8 checkpoints for tests: a golden checkpoint with every 2-D projection stored as e4m3
values plus one f32 `weight_scale_inv` per block, DeepSeek's format."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxserve.models.loaders import deepseek as deepseek_loader

F8 = ml_dtypes.float8_e4m3fn


def quantize_blocks(w_OI: np.ndarray, block: int):
    """(fp8 values, scale_inv f32[ceil(O/b), ceil(I/b)]) with each block's max at 448."""
    o, i = w_OI.shape
    s = np.zeros((-(-o // block), -(-i // block)), np.float32)
    for a in range(s.shape[0]):
        for b in range(s.shape[1]):
            s[a, b] = np.abs(w_OI[a * block:(a + 1) * block, b * block:(b + 1) * block]).max() / 448.0
    full = np.repeat(np.repeat(s, block, 0), block, 1)[:o, :i]
    return (w_OI / full).astype(F8), s


def fp8_copy(src: str, dst: str, block: int) -> str:
    """The checkpoint at `src` written to the new directory `dst` with every 2-D projection
    stored as FP8 + block scales, and a quantization_config saying so; returns `dst`."""
    ck = deepseek_loader.SafetensorsDir(src)
    out = {}
    for name in ck.entries:
        w = np.asarray(ck.raw(name), np.float32)
        if name.endswith("proj.weight") and w.ndim == 2:
            out[name], out[name + "_scale_inv"] = quantize_blocks(w, block)
        else:
            out[name] = np.asarray(ck.raw(name))
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    return dst
