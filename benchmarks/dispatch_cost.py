"""What one decode step costs the host before the device can start: the StepInput transfer
(one device_put per leaf) against one packed transfer, the jitted call itself, and reading
the sampler's results back. Small model (the default model's shape, dummy weights), so the
device is never the bottleneck and every figure is host time.

    python benchmarks/dispatch_cost.py [--config benchmarks/configs/SmolLM2-135M.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np


def median_ms(fn, iters: int = 50) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    from jaxserve import LLM
    from jaxserve.bench.datasets import random_requests
    from jaxserve.bench.latency import generate_once
    from jaxserve.bench.step_timer import StepTimer

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="benchmarks/configs/SmolLM2-135M.json")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    args = p.parse_args()
    llm = LLM(args.config, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batch_size),
              max_num_batched_tokens=8 * max(args.batch_size), max_model_len=64, max_logprobs=0,
              warmup=False)   # compile only the buckets used
    engine, runner = llm.engine, llm.engine.runner
    timer = StepTimer(engine)
    for b in args.batch_size:
        reqs = random_requests(b, 8, 8, engine.config.model.vocab_size)
        generate_once(engine, reqs, dict(temperature=1.0, ignore_eos=True))
    timer.detach()
    rows = []
    for b in args.batch_size:
        x, variant = timer.decode_inputs[b]
        leaves = jax.tree.leaves(x)
        x_dev = jax.device_put(x)
        run = type(runner).run            # the class's method: past any StepTimer wrapper
        state = {}

        def call_only():          # dispatch with the input already on the device (device_put: no-op)
            state["out"] = run(runner, x_dev, variant)

        def call_and_wait():
            call_only()
            jax.block_until_ready(state["out"])

        packed = np.concatenate([np.asarray(a).view(np.uint8).ravel() for a in leaves])
        row = {"batch_size": b, "step_input_leaves": len(leaves), "step_input_bytes": int(packed.nbytes),
               "param_leaves": len(jax.tree.leaves(runner.params)),
               "kv_leaves": len(jax.tree.leaves(runner.kv_cache)),
               "device_put_per_leaf_ms": median_ms(lambda: jax.block_until_ready(jax.device_put(x))),
               "device_put_packed_ms": median_ms(lambda: jax.block_until_ready(jax.device_put(packed))),
               "jit_call_dispatch_ms": median_ms(call_only),
               "jit_call_and_wait_ms": median_ms(call_and_wait),
               # A fresh result each time: a jax.Array caches its host copy once read.
               "call_wait_get_all_ms": median_ms(lambda: (call_and_wait(), jax.device_get(state["out"]))),
               "call_wait_get_ids_ms": median_ms(lambda: (call_and_wait(), np.asarray(state["out"][0].token_ids)))}
        rows.append(row)
    print(json.dumps({"benchmark": "dispatch_cost", "device": jax.devices()[0].device_kind,
                      "config": args.config, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
