"""DeepSeek V4's released quantized tensors (loaders/quantized.py): UE8M0-scaled FP8 and packed
FP4 experts, each dequantizer against a plain reference written here from the format's bits,
then a tiny V4 checkpoint quantized here loading to the same parameters and logits as its
dequantized values stored directly."""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.models import deepseek_v4 as v4
from jaxserve.models.loader import load_model
from jaxserve.models.loaders.deepseek import SafetensorsDir
from jaxserve.models.loaders.quantized import QuantizedSafetensorsDir, dequantize_fp4, dequantize_fp8
from model_step_builder import Chunk, build_step, scattered_block_tables

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "ckpt", "deepseek_v4")
E8M0, E4M3 = ml_dtypes.float8_e8m0fnu, ml_dtypes.float8_e4m3fn


# --- plain references, from the bits -------------------------------------------------------

def ref_e8m0(byte: np.ndarray) -> np.ndarray:
    e = np.asarray(byte).view(np.uint8).astype(np.int64)
    return np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))


def ref_e2m1(code: np.ndarray) -> np.ndarray:
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = np.where(exp == 0, 0.5 * man, (1 + 0.5 * man) * np.ldexp(1.0, exp - 1))
    return np.where(sign == 1, -mag, mag)


def ref_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Element k of a row is byte k // 2's low nibble (k even) or high nibble (k odd), times
    the scale of inputs [32 * (k // 32), 32 * (k // 32 + 1))."""
    b = np.asarray(packed).view(np.uint8).astype(np.int64)
    o, i = b.shape[0], 2 * b.shape[1]
    out = np.zeros((o, i))
    for k in range(i):
        nib = b[:, k // 2] & 15 if k % 2 == 0 else b[:, k // 2] >> 4
        out[:, k] = ref_e2m1(nib) * ref_e8m0(scale[:, k // 32])
    return out


def ref_fp8(w: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    o, i = w.shape
    rows, cols = np.arange(o)[:, None] // block[0], np.arange(i)[None, :] // block[1]
    return w.astype(np.float64) * ref_e8m0(scale)[rows, cols]


# --- quantizers for the test checkpoint ----------------------------------------------------

def _exponent(amax: np.ndarray, top: float) -> np.ndarray:
    """The smallest power-of-two scale putting the block's max at or under `top`."""
    return np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / top)), -127, 127).astype(np.int64)


def quantize_fp4(w: np.ndarray):
    """(int8 [O, I/2] low nibble first, e8m0 [O, I/32]): nearest e2m1 code per value."""
    o, i = w.shape
    e = _exponent(np.abs(w.reshape(o, i // 32, 32)).max(-1), 6.0)
    q = w.reshape(o, i // 32, 32) / np.ldexp(1.0, e)[..., None]
    mags = ref_e2m1(np.arange(8))
    code = np.abs(np.abs(q)[..., None] - mags).argmin(-1) | ((q < 0) << 3)
    code = code.reshape(o, i).astype(np.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).view(np.int8), (e + 127).astype(np.uint8).view(E8M0)


def quantize_fp8(w: np.ndarray, block):
    """(e4m3 [O, I], e8m0 [ceil(O/bo), ceil(I/bi)]) with partial last blocks."""
    o, i = w.shape
    bo, bi = block
    amax = np.zeros((-(-o // bo), -(-i // bi)))
    for a in range(amax.shape[0]):
        for b in range(amax.shape[1]):
            amax[a, b] = np.abs(w[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi]).max()
    e = _exponent(amax, 448.0)
    full = np.ldexp(1.0, e)[np.arange(o)[:, None] // bo, np.arange(i)[None, :] // bi]
    return (w / full).astype(E4M3), (e + 127).astype(np.uint8).view(E8M0)


# --- the dequantizers ----------------------------------------------------------------------

def test_e8m0_every_byte():
    # FP8 weights of ones: the dequantized value is the scale itself
    scale = np.arange(256, dtype=np.uint8).reshape(16, 16).view(E8M0)
    got = dequantize_fp8(np.ones((16, 16), E4M3), scale, (1, 1))
    np.testing.assert_array_equal(got, ref_e8m0(scale).astype(np.float32))
    assert np.isnan(got[15, 15]) and got[0, 0] == np.float32(2.0 ** -127) and got[7, 15] == 1.0


@pytest.mark.parametrize("shape", [(3, 32), (5, 96), (2, 64)])
def test_fp4_against_the_bits(shape):
    rng = np.random.default_rng(shape[1])
    packed = rng.integers(0, 256, (shape[0], shape[1] // 2), dtype=np.uint8)
    scale = rng.integers(100, 150, (shape[0], shape[1] // 32), dtype=np.uint8).view(E8M0)
    want = ref_fp4(packed, scale)
    np.testing.assert_array_equal(dequantize_fp4(packed, scale), want.astype(np.float32))
    # the files' I8 is the same bytes
    np.testing.assert_array_equal(dequantize_fp4(packed.view(np.int8), scale), want.astype(np.float32))


def test_fp4_nibble_order_and_block_edge():
    # byte 0x71: low nibble 1 (0.5) first, high nibble 7 (6.0) second; the scale changes at 32
    packed = np.full((1, 32), 0x71, np.uint8)
    scale = np.array([[127, 128]], np.uint8).view(E8M0)
    got = dequantize_fp4(packed, scale)
    np.testing.assert_array_equal(got[0, :4], [0.5, 6.0, 0.5, 6.0])
    np.testing.assert_array_equal(got[0, 30:34], [0.5, 6.0, 1.0, 12.0])


def test_fp4_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="input dim 48 is not a multiple of the scale block 32"):
        dequantize_fp4(np.zeros((2, 24), np.uint8), np.zeros((2, 1), np.uint8).view(E8M0))
    with pytest.raises(ValueError, match=r"scale shape \(2, 1\) does not match"):
        dequantize_fp4(np.zeros((2, 32), np.uint8), np.zeros((2, 1), np.uint8).view(E8M0))
    with pytest.raises(ValueError, match="int8/uint8"):
        dequantize_fp4(np.zeros((2, 32), np.float32), np.zeros((2, 2), np.uint8).view(E8M0))


@pytest.mark.parametrize("block", [(32, 32), (16, 48)])
def test_fp8_ue8m0_against_the_bits(block):
    rng = np.random.default_rng(7)
    w = rng.normal(size=(70, 45)).astype(E4M3)       # partial last blocks on both sides
    scale = rng.integers(110, 140, (-(-70 // block[0]), -(-45 // block[1])), dtype=np.uint8).view(E8M0)
    np.testing.assert_array_equal(dequantize_fp8(w, scale, block), ref_fp8(w, scale, block).astype(np.float32))
    with pytest.raises(ValueError, match="does not match weight"):
        dequantize_fp8(w, scale[:-1], block)


def test_the_checkpoint_reader_names_bad_tensors(tmp_path):
    save_file({"a.weight": np.zeros((2, 16), np.int8), "a.scale": np.zeros((2, 1), np.int32),
               "b.weight": np.zeros((2, 24), np.int8), "b.scale": np.zeros((2, 1), np.uint8).view(E8M0),
               "c.weight": np.zeros((2, 32), np.float32), "c.scale": np.zeros((1, 1), np.uint8).view(E8M0)},
              str(tmp_path / "model.safetensors"))
    ck = QuantizedSafetensorsDir(str(tmp_path))
    assert ck.shape("b.weight") == (2, 48) and ck.shape("c.weight") == (2, 32)
    with pytest.raises(ValueError, match="a.scale has dtype int32"):
        ck.weight("a.weight")
    with pytest.raises(ValueError, match="b.weight: FP4 weight's input dim 48"):
        ck.weight("b.weight")
    with pytest.raises(ValueError, match="'c.weight' has a 'c.scale' beside it but dtype float32"):
        ck.weight("c.weight")


# --- a tiny V4 checkpoint, quantized -------------------------------------------------------

FP8_BLOCK = (32, 48)        # 64- and 32-wide sides leave partial blocks
_FP8_E8M0 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
             "attn.indexer.wq_b.weight")
_FP8_F32 = ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")


def _write_pair(tmp_path) -> tuple[str, str]:
    """The golden checkpoint as released-style quantized tensors (routed experts FP4 + e8m0,
    attention projections FP8 + e8m0 `.scale`, shared experts FP8 + f32 `weight_scale_inv`),
    and the same values dequantized here by the references, stored in f32."""
    ck = SafetensorsDir(GOLDEN)
    quant, plain = {}, {}
    for name in ck.entries:
        w = np.asarray(ck.raw(name), np.float32)
        if ".ffn.experts." in name:
            q, s = quantize_fp4(w)
            quant[name], quant[name[:-len("weight")] + "scale"] = q, s
            plain[name] = ref_fp4(q, s).astype(np.float32)
        elif name.endswith(_FP8_E8M0):
            q, s = quantize_fp8(w, FP8_BLOCK)
            quant[name], quant[name[:-len("weight")] + "scale"] = q, s
            plain[name] = ref_fp8(q, s, FP8_BLOCK).astype(np.float32)
        elif name.endswith(_FP8_F32):
            q, s = quantize_fp8(w, FP8_BLOCK)
            quant[name], quant[name + "_scale_inv"] = q, ref_e8m0(s).astype(np.float32)
            plain[name] = ref_fp8(q, s, FP8_BLOCK).astype(np.float32)
        else:
            quant[name] = plain[name] = np.asarray(ck.raw(name))
    with open(os.path.join(GOLDEN, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "weight_block_size": list(FP8_BLOCK)}
    dirs = []
    for label, tensors in (("quant", quant), ("plain", plain)):
        d = tmp_path / label
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(hf))
        shutil.copy(os.path.join(GOLDEN, "generation_config.json"), d)
        dirs.append(str(d))
    return dirs[0], dirs[1]


def test_quantized_checkpoint_loads_as_its_dequantized_values(tmp_path):
    quant_dir, plain_dir = _write_pair(tmp_path)
    header = QuantizedSafetensorsDir(quant_dir).entries
    assert header["model.layers.2.ffn.experts.1.w2.weight"][2]["dtype"] == "I8"
    assert header["model.layers.2.ffn.experts.1.w2.scale"][2]["dtype"] == "F8_E8M0"
    assert header["model.layers.1.attn.wq_b.scale"][2]["dtype"] == "F8_E8M0"
    cfg, p_quant, _ = load_model(quant_dir, dtype="float32")
    _, p_plain, _ = load_model(plain_dir, dtype="float32")
    _, p_golden, _ = load_model(GOLDEN, dtype="float32")
    flat_q, tree_q = jax.tree_util.tree_flatten_with_path(p_quant)
    flat_p, tree_p = jax.tree_util.tree_flatten_with_path(p_plain)
    assert tree_q == tree_p
    for (path, a), (_, b) in zip(flat_q, flat_p):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    # the quantization did change the weights (the test sees the dequantized ones)
    for name in ("w_gate", "w_down", "wq_b", "ws_up"):
        assert not np.array_equal(np.asarray(p_quant["layers"][2][name]), np.asarray(p_golden["layers"][2][name]))

    tables = scattered_block_tables(1, 8, 16, seed=1)
    x = build_step([Chunk(0, list(range(3, 23)), 0)], tables, 4, 24, 1)
    caches = [{n: jax.numpy.zeros((16, spec.rows(n, 4), *shape)) for n, shape in spec.arrays}
              for spec in v4.cache_specs(cfg)]

    @jax.jit
    def logits(params):
        with jax.default_matmul_precision("highest"):
            _, hidden, _ = v4.forward(cfg, params, caches, x, "xla")
            return v4.compute_logits(cfg, params, hidden)

    got = np.asarray(logits(p_quant))
    np.testing.assert_array_equal(got, np.asarray(logits(p_plain)))
    assert np.isfinite(got).all() and not np.array_equal(got, np.asarray(logits(p_golden)))
