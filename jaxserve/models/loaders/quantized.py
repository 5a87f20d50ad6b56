"""DeepSeek V4's released quantized tensors, dequantized on the host one tensor at a time.

The format, as DeepSeek's V4 reference (`inference/model.py` Linear, `inference/convert.py`)
writes it, and as transformers' finegrained_fp8 reads it (its quantizer renames `.scale` to
`weight_scale_inv`; Fp8Dequantize unpacks FP4 low nibble first):
- a quantized `<module>.weight` has its scales in `<module>.scale` (not `weight_scale_inv`);
- FP8: e4m3 values [O, I], one scale per weight_block_size block (128 x 128)
  [ceil(O/128), ceil(I/128)]; the last blocks of a side may be partial;
- FP4 (the routed experts when config.json's `expert_dtype` is "fp4"): e2m1 codes packed two
  per byte along the input dim, stored as safetensors I8 [O, I/2] (the bytes, not numbers);
  logical column 2j is byte j's low nibble, 2j+1 its high nibble; one scale per 32 inputs
  [O, I/32] (as MXFP4); I must be a multiple of 32 (the reference asserts it);
- the scales are UE8M0 (safetensors F8_E8M0: a byte e meaning 2**(e - 127), 0xFF NaN) in the
  FP4 / V4-Flash release, float32 in the FP8-expert one; both are read.
Each value is code value x its block's scale, exactly (powers of two times e2m1 / e4m3 values).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxserve.models.loaders.deepseek import SafetensorsDir, dequantize_blocks

# e2m1 by code: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; no inf or NaN
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
FP4_BLOCK = 32          # inputs per scale (DeepSeek's fp4_block_size)
_PACKED = (np.dtype(np.int8), np.dtype(np.uint8))


_SCALE_DTYPES = (np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.float32))


def _check_scale(scale: np.ndarray, name: str) -> None:
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name} has dtype {scale.dtype}; block scales must be float8_e8m0fnu "
                         f"(safetensors F8_E8M0) or float32")


def scale_values(scale: np.ndarray, name: str = "scale") -> np.ndarray:
    """Block scales as f32 multipliers: UE8M0 bytes are 2**(e - 127) (0xFF NaN), as ml_dtypes
    converts them; float32 scales as they are."""
    scale = np.asarray(scale)
    _check_scale(scale, name)
    return scale.astype(np.float32)


def dequantize_fp8(w_OI: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """f32 [O, I] from e4m3 values and one UE8M0 (or f32) scale per block (partial last blocks)."""
    return dequantize_blocks(w_OI, scale_values(scale), block)


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray, block: int = FP4_BLOCK) -> np.ndarray:
    """f32 [O, I] from e2m1 codes packed [O, I/2] (low nibble first) and one scale per `block`
    inputs [O, I/block]."""
    packed = np.asarray(packed)
    if packed.dtype not in _PACKED or packed.ndim != 2:
        raise ValueError(f"packed FP4 weights are 2-D int8/uint8 [out, in/2]; got {packed.dtype} "
                         f"{packed.shape}")
    codes = packed.view(np.uint8)
    o, i = codes.shape[0], 2 * codes.shape[1]
    if i % block:
        raise ValueError(f"FP4 weight's input dim {i} is not a multiple of the scale block {block}")
    if tuple(scale.shape) != (o, i // block):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match weight [{o}, {i}] in "
                         f"blocks of {block} inputs (expected {(o, i // block)})")
    out = np.empty((o, i), np.float32)
    out[:, 0::2] = E2M1_VALUES[codes & 0x0F]
    out[:, 1::2] = E2M1_VALUES[codes >> 4]
    out.reshape(o, i // block, block)[...] *= scale_values(scale)[:, :, None]
    return out


class QuantizedSafetensorsDir(SafetensorsDir):
    """SafetensorsDir that also reads DeepSeek V4's `<module>.scale` tensors (module doc):
    `weight` dequantizes by the stored dtype (e4m3: FP8, int8/uint8: packed FP4), `shape` is
    the logical [O, I] of a packed FP4 weight. `weight_scale_inv` checkpoints read as before."""

    def _scale_name(self, name: str) -> str | None:
        if name + "_scale_inv" in self or not name.endswith(".weight"):
            return None
        s = name[: -len("weight")] + "scale"
        return s if s in self else None

    def _is_fp4(self, name: str) -> bool:
        return self._scale_name(name) is not None and self.entries[name][2]["dtype"] in ("I8", "U8")

    def shape(self, name: str) -> tuple[int, ...]:
        shape = super().shape(name)
        return (*shape[:-1], 2 * shape[-1]) if self._is_fp4(name) else shape

    def weight(self, name: str, block: tuple[int, int] = (128, 128)) -> np.ndarray:
        scale_name = self._scale_name(name)
        if scale_name is None:
            return super().weight(name, block)
        w, scale = self.raw(name), self.raw(scale_name)
        _check_scale(scale, scale_name)
        if w.dtype not in (*_PACKED, np.dtype(ml_dtypes.float8_e4m3fn)):
            raise ValueError(f"tensor {name!r} has a {scale_name!r} beside it but dtype {w.dtype}; "
                             f"quantized weights are float8_e4m3fn (FP8) or int8 (packed FP4)")
        try:
            return dequantize_fp4(w, scale) if w.dtype in _PACKED else dequantize_fp8(w, scale, block)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
