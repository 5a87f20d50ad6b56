"""The device's copy bandwidth through JAX (bytes read + written per second), the ceiling
`jaxserve bench latency` divides by. Rotates over several 2 GiB buffers so the L2 never helps.

    python benchmarks/hbm_bandwidth.py        # prints one JSON line
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp


def main(num_bytes: int = 2 << 30, buffers: int = 4, iters: int = 20) -> None:
    n = num_bytes // 4
    keys = jax.random.split(jax.random.key(0), buffers)
    xs = [jax.random.normal(k, (n,), jnp.float32) for k in keys]
    copy = jax.jit(lambda x: x * 1.0001)      # not an identity: XLA must read and write it all
    for x in xs:
        jax.block_until_ready(copy(x))
    t0 = time.perf_counter()
    out = None
    for i in range(iters):
        out = copy(xs[i % buffers])
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - t0) / iters
    print(json.dumps({"benchmark": "hbm_copy", "device": jax.devices()[0].device_kind,
                      "bytes_per_iter": 2 * n * 4, "seconds_per_iter": seconds,
                      "bytes_per_s": 2 * n * 4 / seconds}))


if __name__ == "__main__":
    main()
