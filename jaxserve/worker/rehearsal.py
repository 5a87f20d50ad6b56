"""Rehearsal: every bucket's lean step program run once, on an empty step, before the engine
says it is ready (serve's --warmup-all).

Why: a compiled program's first run still costs once what later runs do not (JAX builds its
call fast path on the first call; XLA's CPU runtime sets up its thunks on the first execution):
measured through the app on the 2-core CPU, the README's first chat request took 0.89 s of CPU
against 0.48 s from the third on (issue 69: "the first answer after ready takes no longer than
the tenth"). The lean programs are the ones a plain request runs (its prefill's bucket, then
decode); with multi-step decode, the decode buckets' K-step programs too. The other variants
(logprobs, grammar masks, drafts) are left: a rehearsal of each would cost start-up time for
requests that may never come.

An empty step is harmless: its padding tokens write the null block's slot 0 and sample rows
nobody reads (worker/input_batch.py), as a data-parallel rank's idle step does.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from jaxserve.core.step_messages import SchedulerOutput
from jaxserve.worker import packing


def rehearse(runner) -> tuple[int, float]:
    """Run `runner`'s compiled lean programs once each on an empty step of their bucket;
    (programs run, seconds)."""
    t0 = time.perf_counter()
    empty = SchedulerOutput(new_requests=[], scheduled=[], finished_req_ids=[], num_tokens=0,
                            preempted_ids=[], num_cached_tokens=0)
    steps = runner.config.scheduler.num_scheduler_steps
    ran, first = 0, None
    for t in runner.buckets:
        x, _, _ = runner._build(dataclasses.replace(empty, num_tokens=t))
        packed, layout = packing.pack(x)
        key = runner._lean_keys.get(t)
        if key is None or key[0] != layout:
            continue
        variants = [key[1]] + ([dataclasses.replace(key[1], steps=steps)] if steps > 1 else [])
        for variant in variants:
            exe = runner._executables.get((layout, variant))
            if exe is not None:
                runner.launch(exe, packed)
                first, ran = first or (exe, packed), ran + 1
    if first is not None:
        # NOTE: again: its first run took the caches and last ids as allocated, and JAX's call
        # fast path, keyed by its arguments, missed on the steps' own outputs after (~50 ms)
        runner.launch(*first)
    jax.block_until_ready(runner.kv_cache)
    return ran, time.perf_counter() - t0
