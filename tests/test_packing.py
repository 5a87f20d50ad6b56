"""Step inputs travel as one buffer: pack on the host, unpack inside jit, nothing changes."""

import jax
import numpy as np

from jaxserve.worker import packing


def test_round_trip_mixed_dtypes_and_odd_sizes():
    rng = np.random.default_rng(0)
    tree = {"ids": rng.integers(-5, 100, size=(7,), dtype=np.int32),
            "table": rng.integers(0, 9, size=(3, 5), dtype=np.int32),
            "temp": rng.random(3, dtype=np.float32),
            "seeds": rng.integers(0, 2**32, size=(3, 2), dtype=np.uint32),
            "mask": rng.integers(0, 256, size=(3, 7), dtype=np.uint8),     # 21 bytes: padded
            "empty": np.zeros((3, 0), np.int32)}
    buf, layout = packing.pack(tree)
    assert buf.dtype == np.uint32 and buf.ndim == 1
    out = jax.jit(packing.unpack, static_argnums=1)(jax.device_put(buf), layout)
    for k, v in tree.items():
        got = np.asarray(out[k])
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)


def test_layout_is_hashable_and_stable():
    a = {"x": np.arange(4, dtype=np.int32)}
    _, l1 = packing.pack(a)
    _, l2 = packing.pack({"x": np.arange(10, 14, dtype=np.int32)})
    assert hash(l1) == hash(l2) and l1 == l2
