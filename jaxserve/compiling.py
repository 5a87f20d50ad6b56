"""Ahead-of-time compilation of the runner's step programs, on background threads.

A `StepCompiler` lowers and compiles the jitted step for one (input layout, variant) from
abstract arguments (shapes, dtypes and shardings only), so neither it nor its worker threads
keep the parameters or the KV cache alive: an engine that is dropped while programs are still
compiling frees its memory at once. The workers are daemon threads, so a process never waits
at exit for programs it will not use (a ThreadPoolExecutor's workers are joined at exit).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

import jax


def abstract(tree):
    """ShapeDtypeStructs (with shardings) of a tree of arrays: what lowering needs of them."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


class StepCompiler:
    def __init__(self, step_fn, params, kv_cache, prev_ids, input_sharding):
        self._step = step_fn                   # jax.jit(...) with static variant and layout
        self._args = (abstract(params), abstract(kv_cache), abstract(prev_ids))
        self._input_sharding = input_sharding
        self.executables: dict[tuple, object] = {}    # (layout, variant) -> compiled program
        # Seconds spent tracing + lowering and compiling, summed over programs (threads run
        # them side by side, so the sums can exceed the wall time).
        self.seconds = {"lower": 0.0, "compile": 0.0}
        self._lock = threading.Lock()

    def compile(self, layout, variant, num_words: int):
        params, kv_cache, prev_ids = self._args
        packed = jax.ShapeDtypeStruct((num_words,), jax.numpy.uint32, sharding=self._input_sharding)
        t0 = time.perf_counter()
        lowered = self._step.lower(params, kv_cache, packed, prev_ids, variant=variant, layout=layout)
        t1 = time.perf_counter()
        compiled = lowered.compile()      # a persistent-cache hit only loads the executable
        t2 = time.perf_counter()
        with self._lock:
            self.seconds["lower"] += t1 - t0
            self.seconds["compile"] += t2 - t1
        self.executables[(layout, variant)] = compiled
        return compiled

    def start(self, jobs: list[tuple], num_threads: int) -> dict[tuple, concurrent.futures.Future]:
        """Compile `jobs` ((layout, variant, num_words) each) on `num_threads` daemon threads;
        returns a future per (layout, variant). Raises if no thread can be started."""
        futures = {(layout, variant): concurrent.futures.Future() for layout, variant, _ in jobs}
        work: queue.SimpleQueue = queue.SimpleQueue()
        for job in jobs:
            work.put(job)

        def worker():
            while True:
                try:
                    layout, variant, num_words = work.get_nowait()
                except queue.Empty:
                    return
                future = futures[(layout, variant)]
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    self.compile(layout, variant, num_words)
                    future.set_result(None)
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                    future.set_exception(e)

        for _ in range(max(1, min(num_threads, len(jobs)))):
            threading.Thread(target=worker, name="jaxserve-compile", daemon=True).start()
        return futures
