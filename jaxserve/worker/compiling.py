"""Ahead-of-time compilation of the runner's step programs, on background threads.

A `StepCompiler` lowers and compiles the jitted step for one (input layout, variant) from
abstract arguments (shapes, dtypes and shardings only), so neither it nor its worker threads
keep the parameters or the KV cache alive: an engine that is dropped while programs are still
compiling frees its memory at once. The workers are daemon threads that stop at exit after
the program in hand (`stop_all`, run by atexit), not the queued ones: a process never waits
for programs it will not use, and never exits under a compile in flight (which crashed it:
a segfault or abort on every exit of a short script while the full programs compiled in the
background, session 16).

Given a `store` directory it also keeps each compiled program there (ProgramStore) and loads it
on the next start instead of tracing the step again. Why: JAX's persistent compilation cache
skips XLA's compile but not the tracing and lowering that compute its key, and those hold the
GIL: a warm start of the 8B engine on the H200 took 18.3 s to the first token, 10.5 s of it in
warm-up, nearly all tracing and lowering programs whose executables were already cached
(session 16, run 5); with the store, 8.6 s (run 6), and 5.7-6.8 s once the programs that call
Mosaic GPU kernels were stored too (session 17, runs 2 and 4).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import hashlib
import logging
import os
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable

import jax

from jaxserve.worker.memory_plan import program_peak_bytes

logger = logging.getLogger(__name__)


def abstract(tree):
    """ShapeDtypeStructs (with shardings; none for numpy arrays) of a tree of arrays: what
    lowering needs of them."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                        tree)


# The packages whose code a step program can run (not the server's, the bench's or the tests')
TRACED_PACKAGES = ("jaxserve", "jaxserve.core", "jaxserve.core.kv_cache", "jaxserve.worker",
                   "jaxserve.sample", "jaxserve.spec_decode", "jaxserve.models", "jaxserve.models.layers",
                   "jaxserve.pallas_kernels", "jaxserve.sharding")


def source_digest() -> str:
    """sha256 of the Python files of TRACED_PACKAGES, read from disk: a stored program is only
    valid for the code that traced it. (A module patched in memory, or a file edited after
    its module was imported, is not seen: hence the store is off outside the CLI unless
    asked for.)"""
    import importlib.util

    h = hashlib.sha256()
    for package in TRACED_PACKAGES:
        spec = importlib.util.find_spec(package)
        folder = os.path.dirname(spec.origin)     # the package's own folder (__init__.py)
        for name in sorted(f for f in os.listdir(folder) if f.endswith(".py")):
            h.update(f"{package}/{name}".encode())
            with open(os.path.join(folder, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


# Platforms whose programs a ProgramStore keeps. Not the CPU: an XLA:CPU executable serialized
# in a process that had compiled the same fusions before (another engine, or JAX's persistent
# cache) lacked them, and failed when run ("Function negate_power_fusion not found"; jax
# 0.11.2). On the H200 (session 16, run 6) programs stored after JAX's cache had served them,
# and stored fresh, loaded and gave the same tokens as traced ones.
STORE_PLATFORMS = ("gpu",)

# JAX flags that change what is logged, not what is compiled (the cache flags are left out too)
_LOGGING_FLAGS = frozenset({"jax_log_compiles", "jax_explain_cache_misses", "jax_logging_level",
                            "jax_log_checkpoint_residuals", "jax_debug_log_modules"})


class ProgramStore:
    """Compiled step programs on disk, one file each, named by a digest of everything that
    shapes the program: the step's identity (model, config, kernels: given by the caller),
    the abstract arguments, the input layout and variant, jaxserve's sources, jax's and
    jaxlib's versions, JAX's configuration and XLA_FLAGS, and the devices. Anything else
    changed gives other names, so a program is never loaded for code or settings it was not
    built with; an unreadable file is compiled again (and replaced). The files are pickles:
    whoever can write the directory can run code in the engine, so it must be private (as
    ~/.cache is). Nothing is evicted: programs of older code stay until deleted. A program
    that loads but fails when run is not caught here: `--no-program-cache`, or deleting the
    directory, is the way out (seen only on the CPU, which keeps none: STORE_PLATFORMS)."""

    def __init__(self, directory: str, identity: str, args):
        import jaxlib

        self.directory = directory
        devices = [(d.platform, d.device_kind, d.id, d.client.platform_version)
                   for d in jax.devices()]
        config = sorted((k, repr(v)) for k, v in jax.config.values.items()
                        if not ("_cache" in k or k in _LOGGING_FLAGS))
        self._base = repr((identity, abstract_repr(args), source_digest(), jax.__version__,
                           jaxlib.__version__, config, os.environ.get("XLA_FLAGS", ""),
                           devices, jax.process_count()))
        # NOTE: here, on the caller's thread before any compile worker starts, not when a
        # program loads: the import sets an environment variable, which must not change while
        # workers' C++ code may be reading the environment
        prepare_mosaic_gpu_runtime()

    def path(self, layout, variant, num_words: int) -> str:
        key = hashlib.sha256(repr((self._base, layout, variant, num_words)).encode()).hexdigest()
        return os.path.join(self.directory, key[:40] + ".jaxprog")

    def load(self, path: str):
        from jax.experimental import serialize_executable

        with open(path, "rb") as f:
            blob, in_tree, out_tree = pickle.load(f)
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree)

    def save(self, path: str, compiled) -> None:
        """Write `compiled` to `path`."""
        from jax.experimental import serialize_executable

        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                pickle.dump((blob, in_tree, out_tree), f)
            os.replace(tmp, path)   # atomic: a concurrent reader sees the old file or the new
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def prepare_mosaic_gpu_runtime() -> None:
    """Make stored programs' Mosaic GPU kernels (the prefill buckets' attention on a GPU)
    linkable in this process: a ProgramStore does this when it opens. A kernel's
    host-side launch code is an object file that the custom call links on load against jax's
    Mosaic GPU runtime library, which it finds through MOSAIC_GPU_RUNTIME_LIB_PATH; importing
    jax.experimental.mosaic.gpu sets that variable. A process that loads programs without
    lowering any Mosaic kernel had not imported it, and every such program failed to load
    ("Failed to lookup host symbol ..._mosaic_gpu" after "Symbols not found: [
    mosaic_gpu_init_tma_desc, mosaic_gpu_launch_kernel ]"; H200, sessions 16-17), so until
    session 17 they were not stored and each start compiled them again: 17.0 s to the first
    token of the 8B engine, 5.7-6.8 s with them loaded (session 17, runs 1, 2 and 4)."""
    import jax.experimental.mosaic.gpu  # noqa: F401 - imported for its side effect


def wait_all(futures, raise_errors: bool = True, log_every: float | None = None) -> None:
    """Wait for every compile future (a warm-up's); raise the first failure if asked.
    log_every: seconds between progress lines while it waits (None: silent)."""
    futures = list(futures)
    pending = set(futures)
    while log_every is not None and pending:
        pending = concurrent.futures.wait(pending, timeout=log_every).not_done
        if pending:
            logger.info("compiling: %d of %d step programs done", len(futures) - len(pending),
                        len(futures))
    for future in futures:
        try:
            future.result()
        except Exception:
            if raise_errors:
                raise


def abstract_repr(tree) -> str:
    """The abstract arguments' tree, shapes, dtypes and shardings, as text."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr((treedef, [(a.shape, str(a.dtype), repr(a.sharding)) for a in leaves]))


class StepCompiler:
    def __init__(self, step_fn, params, kv_cache, prev_ids, input_sharding, *,
                 store: str | None = None, identity: str = ""):
        """store: a directory to keep compiled programs in across runs (ProgramStore; None:
        not kept); identity: what else the jitted step_fn depends on (its model, config and
        kernels), as text."""
        self._step = step_fn                   # jax.jit(...) with static variant and layout
        self._args = (abstract(params), abstract(kv_cache), abstract(prev_ids))
        self._input_sharding = input_sharding
        self.executables: dict[tuple, object] = {}    # (layout, variant) -> compiled program
        # Seconds spent tracing + lowering, compiling and loading stored programs, summed over
        # programs (threads run them side by side, so the sums can exceed the wall time).
        self.seconds = {"lower": 0.0, "compile": 0.0, "stored": 0.0}
        self._lock = threading.Lock()
        self.store = None
        if store and jax.default_backend() in STORE_PLATFORMS:
            try:
                self.store = ProgramStore(store, identity, self._args)
            except Exception:  # noqa: BLE001 - the store only saves start-up time
                logger.warning("not keeping step programs in %s", store, exc_info=True)
        self._background = BackgroundCompiler()

    def compile(self, layout, variant, num_words: int):
        store = self.store
        path = store.path(layout, variant, num_words) if store else None
        if path and os.path.exists(path):
            t0 = time.perf_counter()
            try:
                compiled = store.load(path)
            except Exception:  # noqa: BLE001 - a damaged or foreign file: compile instead
                logger.warning("could not load the stored step program %s; compiling it",
                               path, exc_info=True)
            else:
                with self._lock:
                    self.seconds["stored"] += time.perf_counter() - t0
                self.executables[(layout, variant)] = compiled
                return compiled
        compiled = self._compile_fresh(layout, variant, num_words)
        if path:
            try:
                store.save(path, compiled)
            except Exception:  # noqa: BLE001 - keeping it only saves the next start time
                # NOTE: once: an unwritable directory would warn for every program
                self.store = None
                logger.warning("could not store the step program %s; not keeping step "
                               "programs from now on", path, exc_info=True)
        self.executables[(layout, variant)] = compiled
        return compiled

    def _compile_fresh(self, layout, variant, num_words: int):
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
        return compiled

    def peak_bytes(self, layout, variant, num_words: int) -> int | None:
        """memory_plan.program_peak_bytes of this program (None: XLA gave no analysis). With a
        store, the number an earlier run noted there beside the programs (a file of its own:
        the program itself is not kept, and a stored executable need not carry XLA's memory
        analysis); else compiled now (and noted)."""
        note = self.store.path(layout, variant, num_words)[:-len(".jaxprog")] + ".peak" if self.store else None
        if note and os.path.exists(note):
            try:
                with open(note) as f:
                    return int(f.read())
            except (OSError, ValueError):
                logger.warning("could not read %s; measuring the program again", note)
        peak = program_peak_bytes(self._compile_fresh(layout, variant, num_words))
        if note and peak is not None:
            try:
                os.makedirs(os.path.dirname(note), exist_ok=True)
                tmp = f"{note}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(str(peak))
                os.replace(tmp, note)
            except OSError:
                logger.warning("could not note the step program's peak in %s", note)
        return peak

    def start(self, jobs: list[tuple], num_threads: int) -> dict[tuple, concurrent.futures.Future]:
        """Compile `jobs` ((layout, variant, num_words) each) on `num_threads` daemon threads;
        returns a future per (layout, variant). Raises if no thread can be started."""
        return self._background.start(
            [((layout, variant), functools.partial(self.compile, layout, variant, num_words))
             for layout, variant, num_words in jobs], num_threads)

    def stop(self, timeout: float = 60.0) -> None:
        self._background.stop(timeout)


class BackgroundCompiler:
    """Compile jobs on daemon threads that stop at exit after the job in hand (module doc).
    A job's callable must hold no device arrays (abstract arguments only), so that an engine
    dropped while its programs compile is freed at once."""

    def __init__(self):
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        _COMPILERS.add(self)

    def start(self, jobs: list[tuple[Hashable, Callable[[], object]]],
              num_threads: int) -> dict[Hashable, concurrent.futures.Future]:
        """Run `jobs` ((key, compile callable) each, in order) on `num_threads` daemon
        threads; returns a future per key, of what its callable returns. Raises if no thread
        can be started."""
        futures = {key: concurrent.futures.Future() for key, _ in jobs}
        work: queue.SimpleQueue = queue.SimpleQueue()
        for job in jobs:
            work.put(job)

        def worker():
            while not self._stopping.is_set():
                try:
                    key, job = work.get_nowait()
                except queue.Empty:
                    return
                future = futures[key]
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(job())
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                    future.set_exception(e)

        for _ in range(max(1, min(num_threads, len(jobs)))):
            thread = threading.Thread(target=worker, name="jaxserve-compile", daemon=True)
            thread.start()
            self._threads.append(thread)
        return futures

    def stop(self, timeout: float = 60.0) -> None:
        """Compile nothing more from the queues; wait for the programs in hand (each at most
        `timeout` seconds: an 8B step program compiles in seconds; a worker stuck longer is
        left behind rather than hanging the exit)."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout)


_COMPILERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def stop_all() -> None:
    """Stop every live compiler's workers before the interpreter finalises (see the module
    docstring); their queued programs are never compiled."""
    for compiler in list(_COMPILERS):
        compiler.stop()
