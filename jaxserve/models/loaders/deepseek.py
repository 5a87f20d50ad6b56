"""Load DeepSeek V3 / V3.2 from a HF directory (sharded safetensors), FP8 checkpoints included.

Name mapping to models/deepseek.py's tree, with three reshapes done once here:
- kv_b_proj [N*(E+O), C] is split per head into w_uk f[N, E, C] and w_uv f[N, C, O], the
  factors the absorbed attention applies (W_UK into q, W_UV after);
- rope_interleave checkpoints: the rope output columns of q (per head) and of the shared key
  are permuted to the half-split layout (evens then odds), so the forward has one rotary;
- FP8 (e4m3) weights with `weight_scale_inv` (one f32 per 128 x 128 block, DeepSeek's
  format) are dequantized to the load dtype (each block times its scale); with
  quantization="fp8" (`--quantization fp8`) the routed experts, nearly all of the bytes, are
  kept as they are (grouped_matmul.BlockScaledFp8: half the bytes a decode step reads of
  bf16); under a mesh values and scales split alike (a tensor-parallel split of F must be whole
  scale blocks: sharding/expert_parallel.fp8_split_problem).
Tensors are read from the files directly (header + memory map), because safetensors' numpy
reader has no FP8 type; ml_dtypes gives numpy the float8 and bfloat16 types.
With a mesh each parameter is placed by sharding/rules.py (models/families.py: heads over
`model`, experts over `expert`, the latent path replicated). The routed experts are read per
device, only the experts of its slice (jax.make_array_from_callback); the attention and dense
tensors are assembled whole on the host (the kv_b_proj split and the rope permutation work on
whole tensors), then device_put, which sends each device only its slice.

Legend: N heads, E qk_nope_head_dim, R qk_rope_head_dim, O v_head_dim, C kv_lora_rank,
D model dim, X experts.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.models import deepseek
from jaxserve.models.loaders.progress import LayerProgress
from jaxserve.pallas_kernels.grouped_matmul import BlockScaledFp8
from jaxserve.sharding import expert_parallel, rules

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "F8_E8M0": ml_dtypes.float8_e8m0fnu,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


class SafetensorsDir:
    """Every tensor of a directory's *.safetensors files, read lazily by name."""

    def __init__(self, path: str):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path!r}")
        self.entries: dict[str, tuple[str, int, dict]] = {}
        for file in files:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for name, info in header.items():
                self.entries[name] = (file, 8 + n, info)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as `weight` returns it (the stored one here; a packed format's
        reader widens it: loaders/quantized.py)."""
        return tuple(self.entries[name][2]["shape"])

    def raw(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        file, base, info = self.entries[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {info['dtype']}; supported: {', '.join(_DTYPES)}")
        start, end = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]])
        count = (end - start) // dt.itemsize
        if count == 0:
            return np.zeros(info["shape"], dt)
        return np.memmap(file, dtype=dt, mode="r", offset=base + start, shape=(count,)).reshape(info["shape"])

    def weight(self, name: str, block: tuple[int, int] = (128, 128)) -> np.ndarray:
        """A tensor as f32, dequantized when it is FP8 with a `<name>_scale_inv` beside it."""
        w = self.raw(name)
        scale_name = name + "_scale_inv"
        if scale_name in self:
            return dequantize_blocks(w, self.raw(scale_name), block)
        if "float8" in w.dtype.name:
            raise ValueError(f"tensor {name!r} is {w.dtype.name} but has no {scale_name!r}")
        return np.asarray(w, dtype=np.float32)


def dequantize_blocks(w_OI: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """f32 weight from FP8 values and per-block scales: w[o, i] * scale_inv[o // bo, i // bi]
    (DeepSeek's `weight_scale_inv` is the factor that multiplies back; the last blocks of a
    side that is not a multiple of the block size are partial)."""
    bo, bi = block
    o, i = w_OI.shape
    if scale_inv.shape != (-(-o // bo), -(-i // bi)):
        raise ValueError(f"scale shape {scale_inv.shape} does not match weight {w_OI.shape} in "
                         f"{bo}x{bi} blocks (expected {(-(-o // bo), -(-i // bi))})")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return np.asarray(w_OI, dtype=np.float32) * s


def _deinterleave(r: int) -> np.ndarray:
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def _layer_tensors(cfg, ck: SafetensorsDir, prefix: str, shapes: dict, block) -> dict:
    n, e, r, o, c = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    w = lambda name: ck.weight(prefix + name, block)          # noqa: E731  [out, in] f32
    t = lambda name: w(name).T                                # noqa: E731  [in, out]
    perm = _deinterleave(r) if cfg.rope_interleave else np.arange(r)
    a = "self_attn."
    out = {"attn_norm": w("input_layernorm.weight"), "mlp_norm": w("post_attention_layernorm.weight"),
           "kv_a_norm": w(a + "kv_a_layernorm.weight"), "wo": t(a + "o_proj.weight")}
    wkv_a = t(a + "kv_a_proj_with_mqa.weight")
    out["wkv_a"] = np.concatenate([wkv_a[:, :c], wkv_a[:, c:][:, perm]], axis=1)
    q_name = "wq_b" if "wq_b" in shapes else "wq"
    wq = t(a + ("q_b_proj.weight" if q_name == "wq_b" else "q_proj.weight"))
    wq = wq.reshape(wq.shape[0], n, e + r)
    out[q_name] = np.concatenate([wq[..., :e], wq[..., e:][..., perm]], -1).reshape(wq.shape[0], -1)
    if q_name == "wq_b":
        out["wq_a"], out["q_a_norm"] = t(a + "q_a_proj.weight"), w(a + "q_a_layernorm.weight")
    kv_b = w(a + "kv_b_proj.weight").reshape(n, e + o, c)
    out["w_uk"], out["w_uv"] = kv_b[:, :e], kv_b[:, e:].transpose(0, 2, 1)
    if "wq_idx" in shapes:
        ix = a + "indexer."
        out.update(wq_idx=t(ix + "wq_b.weight"), wk_idx=t(ix + "wk.weight"),
                   k_idx_norm=w(ix + "k_norm.weight"), k_idx_bias=w(ix + "k_norm.bias"),
                   w_idx=t(ix + "weights_proj.weight"))
    if "router" in shapes:
        out["router"] = t("mlp.gate.weight")
        out["router_bias"] = w("mlp.gate.e_score_correction_bias")
        for ours, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[ours] = _ExpertStack(ck, [prefix + f"mlp.experts.{j}.{hf}.weight"
                                          for j in range(cfg.num_experts)], block)
        if "ws_gate" in shapes:
            for ours, hf in (("ws_gate", "gate_proj"), ("ws_up", "up_proj"), ("ws_down", "down_proj")):
                out[ours] = t(f"mlp.shared_experts.{hf}.weight")
    else:
        for ours, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[ours] = t(f"mlp.{hf}.weight")
    return out


class _ExpertStack:
    """The routed experts of one projection as [X, in, out], read lazily: a device asks for its
    slice and only its experts' tensors are read (and dequantized), so host memory holds one
    device's experts at a time, not the layer's (45 GB in f32 for a DeepSeek-V3 layer)."""

    def __init__(self, ck: SafetensorsDir, names: list[str], block):
        self.ck, self.names, self.block = ck, names, block
        for name in names:
            if name not in ck:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
        per_expert = {ck.shape(n) for n in names}
        if len(per_expert) != 1:
            raise ValueError(f"experts {names[0]!r} ... have different shapes {sorted(per_expert)}")
        out_dim, in_dim = per_expert.pop()
        self.shape = (len(names), in_dim, out_dim)

    def __getitem__(self, index: tuple) -> np.ndarray:
        chosen = range(len(self.names))[index[0]]
        return np.stack([self.ck.weight(self.names[j], self.block).T[index[1:]] for j in chosen])

    @property
    def is_fp8(self) -> bool:
        return all(n + "_scale_inv" in self.ck for n in self.names) and \
            self.ck.raw(self.names[0]).dtype == ml_dtypes.float8_e4m3fn

    def kept_fp8(self, sharding) -> BlockScaledFp8:
        """The experts as they are stored: e4m3 [X, in, out] and their block scales [X, in
        blocks, out blocks] (both transposed from the files' [out, in]), each placed by
        `sharding` (under a mesh a device reads only its experts' values and scales)."""
        if self.block[0] != self.block[1]:
            raise ValueError(f"--quantization fp8 keeps square scale blocks only; the checkpoint's "
                             f"weight_block_size is {list(self.block)}")

        b = self.block[0]
        expert_parallel.check_fp8_placement(self.names[0], self.shape, sharding, b)
        x, i, o = self.shape

        def read(suffix, dtype, index):
            return np.stack([np.asarray(self.ck.raw(self.names[j] + suffix), dtype).T[index[1:]]
                             for j in range(x)[index[0]]])

        values = jax.make_array_from_callback(self.shape, sharding,
                                              lambda index: read("", ml_dtypes.float8_e4m3fn, index))
        scales = jax.make_array_from_callback((x, -(-i // b), -(-o // b)), sharding,
                                              lambda index: read("_scale_inv", np.float32, index))
        return BlockScaledFp8(values, scales, b)


def _checked(tree: dict, shapes: dict, where: str, jdtype, placement: dict, keep_fp8: bool = False) -> dict:
    if set(tree) != set(shapes):
        raise ValueError(f"{where}: parameters {sorted(set(tree) ^ set(shapes))} do not match the config")
    out = {}
    for name, arr in tree.items():
        if tuple(arr.shape) != tuple(shapes[name]):
            raise ValueError(f"{where}{name}: checkpoint gives shape {arr.shape}; the config.json "
                             f"expects {tuple(shapes[name])}")
        # the router bias only ranks experts: keep it f32 whatever the load dtype (as HF does)
        dt = jnp.float32 if name == "router_bias" else jdtype
        if keep_fp8 and isinstance(arr, _ExpertStack) and arr.is_fp8:
            out[name] = arr.kept_fp8(placement[name])
        elif isinstance(arr, _ExpertStack):
            out[name] = jax.make_array_from_callback(arr.shape, placement[name],
                                                     lambda index, a=arr, dt=dt: a[index].astype(dt))
        else:
            out[name] = jax.device_put(np.asarray(arr, dt), placement[name])
    return out


def load_hf(family, path: str, cfg, dtype: str = "float32", mesh=None, quantization: str | None = None):
    """(cfg, params) of the `family` object (models/families.py): the decoder, and params["mtp"] when the checkpoint has the MTP layers;
    placed by the sharding rules over `mesh` (or on the first device). quantization "fp8":
    an FP8 checkpoint's routed experts stay FP8 (module doc)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    quant = hf.get("quantization_config") or {}
    keep_fp8 = quantization == "fp8"
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be 'fp8' or None; got {quantization!r}")
    if keep_fp8 and quant.get("quant_method") != "fp8":
        raise ValueError(f"quantization 'fp8' keeps an FP8 checkpoint's experts as they are; "
                         f"{path!r} is not one (its config.json has no quantization_config with "
                         f"quant_method 'fp8'), and quantizing at load is not built")
    block = tuple(quant.get("weight_block_size") or (128, 128))
    ck = SafetensorsDir(path)
    jdtype = jnp.dtype(dtype)
    shapes = deepseek.param_shapes(cfg)
    # the MTP layers up to the first one missing (an HF-saved checkpoint has none)
    mtp_shapes = list(itertools.takewhile(
        lambda m_ms: f"model.layers.{cfg.num_layers + m_ms[0]}.eh_proj.weight" in ck,
        enumerate(deepseek.mtp_param_shapes(cfg))))
    mtp_shapes = [ms for _, ms in mtp_shapes]
    place = rules.param_placements(family, cfg, mesh, {**shapes, **({"mtp": mtp_shapes} if mtp_shapes else {})})
    top = lambda name, w: jax.device_put(np.asarray(w, jdtype), place[name])  # noqa: E731
    params = {"embed": top("embed", ck.weight("model.embed_tokens.weight")),
              "final_norm": top("final_norm", ck.weight("model.norm.weight")), "layers": []}
    if "lm_head" in shapes:
        params["lm_head"] = top("lm_head", ck.weight("lm_head.weight", block).T)
    progress = LayerProgress(f"loading {os.path.basename(os.path.normpath(path))}", len(shapes["layers"]))
    progress.done(params, layer=False)
    for i, ls in enumerate(shapes["layers"]):
        prefix = f"model.layers.{i}."
        params["layers"].append(_checked(_layer_tensors(cfg, ck, prefix, ls, block), ls, prefix, jdtype,
                                         place["layers"][i], keep_fp8))
        progress.done(params["layers"][-1])
    mtp = []
    for m, ms in enumerate(mtp_shapes):
        prefix = f"model.layers.{cfg.num_layers + m}."
        layer_shapes = {k: v for k, v in ms.items() if k not in ("enorm", "hnorm", "eh_proj", "head_norm", "head")}
        tree = _layer_tensors(cfg, ck, prefix, layer_shapes, block)
        tree.update(enorm=ck.weight(prefix + "enorm.weight"), hnorm=ck.weight(prefix + "hnorm.weight"),
                    eh_proj=ck.weight(prefix + "eh_proj.weight", block).T,
                    head_norm=ck.weight(prefix + "shared_head.norm.weight"),
                    head=ck.weight(prefix + "shared_head.head.weight", block).T)
        mtp.append(_checked(tree, ms, prefix, jdtype, place["mtp"][m], keep_fp8))
    if mtp:
        params["mtp"] = mtp
    return cfg, params
