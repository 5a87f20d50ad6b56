"""Run by test_kernel_sharding.py in a subprocess (8 fake CPU devices, set before jax loads):
the paged-attention kernel run per head shard (sharding/kernels.py, under jax.set_mesh) on TP
2 and TP 4 equals the unsharded kernel and the reference, on a decode, a prefill and a mixed
batch. Prints one "ok" line per case."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxserve.pallas_kernels.ragged_paged_attention import reference, wrapper  # noqa: E402
from jaxserve.sharding import kernels as sharded  # noqa: E402
from jaxserve.sharding.mesh import make_mesh  # noqa: E402

N, K, E, P_, BLOCKS, PER_SEQ = 8, 4, 16, 4, 20, 4
SCALE = E ** -0.5


def batch(qlens, seq_lens, seed):
    rng = np.random.default_rng(seed)
    t = sum(qlens)
    q = rng.standard_normal((t, N, E), np.float32)
    kc = rng.standard_normal((BLOCKS, P_, K, E), np.float32)
    vc = rng.standard_normal((BLOCKS, P_, K, E), np.float32)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    tables = (1 + np.arange(len(qlens) * PER_SEQ).reshape(len(qlens), PER_SEQ)).astype(np.int32)
    return [jnp.asarray(a) for a in (q, kc, vc, qsl, np.asarray(seq_lens, np.int32), tables)]


def kernel(q, kc, vc, qsl, lens, tables):
    return wrapper.ragged_paged_attention(q, kc, vc, qsl, lens, tables, sm_scale=SCALE, impl="pallas")


def sharded_run(mesh, args):
    q, kc, vc, *meta = args
    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    q, kc, vc = place(q, sharded.HEADS_TNE), place(kc, sharded.CACHE_NPKE), place(vc, sharded.CACHE_NPKE)
    meta = [place(m, sharded.REPLICATED) for m in meta]
    with jax.set_mesh(mesh):
        step = jax.jit(functools.partial(sharded.paged_attention, kernel))
        text = step.lower(q, kc, vc, *meta).as_text()
        assert "manual_computation" in text, "the kernel was not wrapped in shard_map"
        return step(q, kc, vc, *meta)


CASES = {"decode": ([1, 1, 1, 1], [5, 9, 13, 16]),
         "prefill": ([6, 3], [6, 3]),
         "mixed": ([5, 1, 1], [12, 7, 16])}

for name, (qlens, lens) in CASES.items():
    args = batch(qlens, lens, seed=len(name))
    one = jax.jit(kernel)(*args)
    ref = reference.ref_ragged_paged_attention(*args, sm_scale=SCALE)
    np.testing.assert_allclose(np.asarray(one), np.asarray(ref), atol=1e-5, rtol=1e-5)
    for tp in (2, 4):
        mesh = make_mesh(tensor_parallel_size=tp)
        with jax.set_mesh(mesh):
            assert sharded.model_axis_size() == tp
        out = sharded_run(mesh, args)
        assert out.sharding.spec == sharded.HEADS_TNE or tp == 1, out.sharding
        np.testing.assert_allclose(np.asarray(out), np.asarray(one), atol=1e-5, rtol=1e-5)
        print(f"ok {name} tp{tp}")

assert sharded.model_axis_size() == 1
try:
    with jax.set_mesh(make_mesh(tensor_parallel_size=8)):
        sharded.paged_attention(kernel, *batch([1], [4], 0))
except ValueError as e:
    assert "kv heads (4)" in str(e), e
    print("ok indivisible heads refused")
else:
    raise AssertionError("TP 8 over 4 kv heads was not refused")

# The sampler's threshold kernels (run only on a GPU, so forced here) on vocab-split logits
# through sharding/kernels.replicated, as sampler._truncate calls them: equal the unsharded.
from jaxserve.pallas_kernels.topk_threshold import topk_threshold, topp_threshold  # noqa: E402

rng = np.random.default_rng(7)
logits = jnp.asarray(rng.standard_normal((4, 256), np.float32))
top_k, top_p = jnp.asarray([0, 5, 40, 3], jnp.int32), jnp.asarray([1.0, 0.9, 0.5, 0.2], jnp.float32)


def thresholds(x, k, p):
    kth = sharded.replicated(functools.partial(topk_threshold, impl="pallas"), 2)(x, k)
    return kth, sharded.replicated(functools.partial(topp_threshold, impl="pallas"), 3)(x, p, kth)


want = jax.jit(thresholds)(logits, top_k, top_p)
mesh = make_mesh(tensor_parallel_size=4)
split = jax.device_put(logits, NamedSharding(mesh, sharded.COLUMNS_TC))
with jax.set_mesh(mesh):
    got = jax.jit(thresholds)(split, top_k, top_p)
for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
print("ok sampler thresholds on vocab-split logits tp4")
