"""Where an engine step's wall time goes: host work (schedule, prepare, dispatch, update,
outputs) against waiting for the device.

With a pipelined engine (the runner has `dispatch`/`collect`), one `engine.step()` schedules
and dispatches step N+1, then waits for step N's results: "device" is that wait alone, the
time the host had nothing to do, and the phases of one record belong to two device steps.

`StepTimer(engine)` wraps the engine's own objects' methods (instance attributes, nothing
global) and records one `StepRecord` per step. `device_only_step_seconds` replays one
prepared step back to back with no host work between, which is the step time the engine
would see if host work overlapped the device completely.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import jax

PHASES = ("schedule", "prepare", "dispatch", "device", "to_host", "update", "outputs")


@dataclass
class StepRecord:
    num_seqs: int               # sequences in the step
    num_tokens: int             # tokens computed in the step
    decode: bool                # every sequence computed exactly one token
    steps: int = 1              # decode steps of the step it read (multi-step decode): tokens a sequence
    total: float = 0.0          # engine.step() wall time, seconds
    schedule: float = 0.0       # scheduler.schedule()
    prepare: float = 0.0        # runner.prepare(): numpy StepInput + sampling tensors
    dispatch: float = 0.0       # runner.run() until it returns (device_put + jit dispatch)
    device: float = 0.0         # waiting for a step's results to be ready (the device working)
    to_host: float = 0.0        # then reading them: device_get of sampled ids, tolist
    update: float = 0.0         # scheduler.update()
    outputs: float = 0.0        # the rest of step(): detokenize, stop strings, RequestOutputs

    @property
    def host(self) -> float:
        return self.total - self.device


class StepTimer:
    """Times every step of `engine` (an LLMEngine) until `detach()`."""

    def __init__(self, engine, capture_decode_inputs: bool = True, trace_mark: str | None = None):
        self.engine = engine
        self._mark = trace_mark             # name a profiler annotation around each step
        self.records: list[StepRecord] = []
        self.decode_inputs: dict[int, tuple] = {}   # num_seqs -> (StepInput, StepVariant) of a decode step
        self._capture = capture_decode_inputs
        self._current: StepRecord | None = None
        self._originals = []
        sched, runner = engine.scheduler, engine.runner
        self._wrap(engine, "step", self._timed_step)
        self._wrap(sched, "schedule", self._timed("schedule", self._on_schedule))
        self._wrap(sched, "update", self._timed("update"))
        self._wrap(runner, "prepare", self._timed("prepare", self._on_prepare))
        self._wrap(runner, "run", self._timed_run)
        if hasattr(runner, "collect"):       # dispatch now, collect a step later (pipelined)
            self._wrap(runner, "collect", self._timed_collect)
        else:
            self._wrap(runner, "execute", self._timed_execute)

    def _wrap(self, obj, name: str, make):
        original = getattr(obj, name)
        self._originals.append((obj, name, name in vars(obj)))
        setattr(obj, name, make(original))

    def detach(self) -> None:
        for obj, name, had_own in reversed(self._originals):
            if had_own:
                continue       # never replaced something we did not make; leave it be
            delattr(obj, name)
        self._originals.clear()

    def reset(self) -> None:
        self.records.clear()

    # -- wrappers ------------------------------------------------------------------------
    def _timed(self, phase: str, after=None):
        def make(fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                result = fn(*args, **kwargs)
                if self._current is not None:
                    setattr(self._current, phase, getattr(self._current, phase) + time.perf_counter() - t0)
                if after is not None:
                    after(args, result)
                return result
            return wrapper
        return make

    def _on_schedule(self, args, out) -> None:
        if self._current is not None and out.scheduled:
            self._current.num_seqs = len(out.scheduled)
            self._current.num_tokens = out.num_tokens
            self._current.decode = all(r.num_tokens == 1 for r in out.scheduled)

    def _on_prepare(self, args, result) -> None:
        rec = self._current
        if self._capture and rec is not None and rec.decode:
            x, _, variant = result            # what runner.run() takes
            held = self.decode_inputs.get(rec.num_seqs)
            if held is None or held[1].steps < variant.steps:   # a multi-step one if any
                self.decode_inputs[rec.num_seqs] = (x, variant)

    def _timed_run(self, fn):
        # A pipelined runner (one with `collect`) must not be waited on here: that would
        # serialise the very overlap being measured. Its wait is timed in `collect`.
        blocking = not hasattr(self.engine.runner, "collect")

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            t1 = time.perf_counter()
            if blocking:
                jax.block_until_ready(result)
            t2 = time.perf_counter()
            if self._current is not None:
                self._current.dispatch += t1 - t0
                self._current.device += t2 - t1
            return result
        return wrapper

    def _timed_collect(self, fn):
        def wrapper(step, *args, **kwargs):
            t0 = time.perf_counter()
            jax.block_until_ready((step.result, step.prompt))
            t1 = time.perf_counter()
            result = fn(step, *args, **kwargs)
            if self._current is not None:
                # the step this record waits for (pipelined: not the one it scheduled)
                self._current.steps = step.variant.steps
                self._current.device += t1 - t0
                self._current.to_host += time.perf_counter() - t1
            return result
        return wrapper

    def _timed_execute(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            rec = self._current
            if rec is not None:
                rec.to_host += time.perf_counter() - t0 - rec.prepare - rec.dispatch - rec.device
            return result
        return wrapper

    def _timed_step(self, fn):
        def wrapper(*args, **kwargs):
            rec = StepRecord(num_seqs=0, num_tokens=0, decode=False)
            self._current = rec
            t0 = time.perf_counter()
            try:
                if self._mark is None:
                    return fn(*args, **kwargs)
                with jax.profiler.TraceAnnotation(self._mark):
                    return fn(*args, **kwargs)
            finally:
                rec.total = time.perf_counter() - t0
                rec.outputs = rec.total - sum(getattr(rec, p) for p in PHASES if p != "outputs")
                self._current = None
                if rec.num_seqs:          # an idle step (nothing scheduled) is not a step
                    self.records.append(rec)
        return wrapper

    # -- summaries -----------------------------------------------------------------------
    def summary(self, decode_only: bool = True) -> dict:
        """Median seconds of each phase over the recorded (decode) steps, and per token of a
        sequence ("per_token": a multi-step decode's step makes several)."""
        recs = [r for r in self.records if r.decode or not decode_only]
        if not recs:
            return {"num_steps": 0}
        out = {"num_steps": len(recs)}
        for field in ("total",) + PHASES:
            out[field] = statistics.median(getattr(r, field) for r in recs)
        out["host"] = statistics.median(r.host for r in recs)
        out["per_token"] = statistics.median(r.total / r.steps for r in recs)
        out["steps"] = statistics.median(r.steps for r in recs)
        return out

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]


def device_only_step_seconds(runner, x, variant, iters: int = 20) -> float:
    """Mean wall time of `iters` back-to-back runs of one prepared step, no host work between,
    per decode step it runs (a multi-step decode's program runs variant.steps).

    NOTE: this writes the step's KV into the same slots again; use it only between
    benchmark requests, never while a request whose blocks those are is still running.
    """
    run = type(runner).run          # the class's method: past any StepTimer wrapper
    jax.block_until_ready(run(runner, x, variant))      # input transfer and any compile
    t0 = time.perf_counter()
    result = None
    for _ in range(iters):
        result = run(runner, x, variant)
    jax.block_until_ready(result)
    return (time.perf_counter() - t0) / iters / variant.steps
