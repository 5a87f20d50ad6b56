"""Where a decode step's time goes, from a jax.profiler trace: device kernels (by kind),
the gaps between them, and the step's wall time on the host.

The trace is written with `create_perfetto_trace=True` (Chrome trace JSON, gzipped), so it
needs no TensorBoard plugin to read. Host-side `TraceAnnotation`s mark each engine step and
the device-only replay; device events inside a marked window are that window's device work.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import time

import jax

_KINDS = (("gemm", re.compile(r"gemm|nvjet|cutlass|matmul|cublas|xmma|dot", re.I)),
          ("attention", re.compile(r"attention|paged|flash|rpa", re.I)),
          ("copy", re.compile(r"memcpy|memset|copy", re.I)))
STEP_MARK = "jaxserve_bench_engine_step"
REPLAY_MARK = "jaxserve_bench_device_only"


def kernel_kind(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def load_trace_events(trace_dir: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no trace JSON under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _trace_parts(events: list[dict], mark: str):
    """(process names by pid, the device processes' pids, the complete events, the windows
    (start, end) of the events named `mark`)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if re.search(r"gpu|device:|cuda|stream", n, re.I)
                   and not re.search(r"host|cpu", n, re.I)}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("name") == mark]
    return names, device_pids, spans, windows


def host_time_by_name(events: list[dict], mark: str, top: int = 25) -> dict[str, float]:
    """ms per window of the host's events inside the windows marked `mark`, by name (nested
    events each count: a caller's time includes its callees'), the `top` largest: where the
    host's part of a step goes (Python frames when the trace has the Python tracer's, XLA's
    runtime: the executable's call, command-buffer update and launch, transfers)."""
    _, device, spans, windows = _trace_parts(events, mark)
    totals: dict[str, float] = {}
    for a, b in windows:
        for e in spans:
            if e["pid"] not in device and a <= e["ts"] < b and e.get("name") != mark:
                totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
    best = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {n[:80]: v / len(windows) / 1e3 for n, v in best} if windows else {}


def summarize_events(events: list[dict], mark: str) -> dict:
    """Per window marked `mark`: wall, device busy (union of device events), kernel count,
    device time by kernel kind, and the 40 longest kernels' time and launches by name;
    averaged over the windows."""
    names, device_pids, spans, windows = _trace_parts(events, mark)
    device = [(e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in spans if e["pid"] in device_pids]
    if not windows:
        return {"windows": 0, "device_processes": sorted(names[p] for p in device_pids)}
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    launches: dict[str, int] = {}
    wall = busy = count = 0.0
    for a, b in windows:
        inside = [(s, e, n) for s, e, n in device if s >= a and s < b]
        wall += b - a
        busy += _union_length([(s, min(e, b)) for s, e, _ in inside])
        count += len(inside)
        for s, e, n in inside:
            by_kind[kernel_kind(n)] = by_kind.get(kernel_kind(n), 0.0) + (e - s)
            by_name[n] = by_name.get(n, 0.0) + (e - s)
            launches[n] = launches.get(n, 0) + 1
    k = len(windows)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:40]
    return {"windows": k, "wall_ms": wall / k / 1e3, "device_busy_ms": busy / k / 1e3,
            "device_idle_ms": (wall - busy) / k / 1e3, "kernels_per_window": count / k,
            "device_ms_by_kind": {n: v / k / 1e3 for n, v in sorted(by_kind.items())},
            "top_kernels_ms": {n[:80]: v / k / 1e3 for n, v in top},
            "top_kernels_launches": {n[:80]: launches[n] / k for n, _ in top}}


def profile_decode_steps(engine, batch: int, args, params: dict, num_tokens: int = 8,
                         replays: int = 8) -> dict:
    """Trace `batch` short requests through the engine, then `replays` device-only replays
    of one of their decode steps; summarise both."""
    from jaxserve.bench.datasets import random_requests
    from jaxserve.bench.step_timer import StepTimer
    from jaxserve.sampling_params import SamplingParams

    trace_dir = os.path.join(args.profile_dir, f"batch{batch}-{int(time.time())}")
    reqs = random_requests(batch, args.input_len, num_tokens, engine.config.model.vocab_size, seed=7)
    timer = StepTimer(engine, trace_mark=STEP_MARK)
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for i, r in enumerate(reqs):
                engine.add_request(f"profile-{time.time_ns()}-{i}", r.prompt_token_ids,
                                   SamplingParams(**{**params, "max_tokens": r.output_len}))
            while engine.has_unfinished_requests():
                engine.step()
            captured = timer.decode_inputs.get(batch)
            if captured is not None:
                run = type(engine.runner).run
                jax.block_until_ready(run(engine.runner, *captured))
                with jax.profiler.TraceAnnotation(REPLAY_MARK):
                    out = None
                    for _ in range(replays):
                        out = run(engine.runner, *captured)
                    jax.block_until_ready(out)
    finally:
        timer.detach()
    result = {"trace_dir": trace_dir, "host_timer_decode_steps": timer.summary(decode_only=True)}
    try:
        events = load_trace_events(trace_dir)
        steps = summarize_events(events, STEP_MARK)
        replay = summarize_events(events, REPLAY_MARK)
        # one window held `replays` programs of `multi` decode steps each (multi-step decode)
        multi = captured[1].steps if captured is not None else 1
        if replay.get("windows"):
            per_step = lambda v: (v / replays / multi if isinstance(v, float) else  # noqa: E731
                                  {n: x / replays / multi for n, x in v.items()} if isinstance(v, dict) else v)
            replay = {k: per_step(v) for k, v in replay.items() if k != "windows"}
        result.update(engine_steps=steps, device_only_replay_per_step=replay,
                      host_ms_by_name=host_time_by_name(events, STEP_MARK))
        result["summary"] = {"engine_step_wall_ms": steps.get("wall_ms"),
                             "engine_step_device_busy_ms": steps.get("device_busy_ms"),
                             "engine_step_kernels": steps.get("kernels_per_window"),
                             # (the embedding, LM head and sampler's kernels spread over the layers)
                             # per decode step: an engine step of a multi-step decode runs several
                             "kernels_per_layer": (steps["kernels_per_window"] / engine.config.model.num_layers
                                                   / result["host_timer_decode_steps"].get("steps", 1)
                                                   if steps.get("kernels_per_window") else None),
                             "replay_step_wall_ms": replay.get("wall_ms"),
                             "replay_step_device_busy_ms": replay.get("device_busy_ms")}
    except Exception as e:  # the trace is still on disk for a closer look
        result["summary"] = {"error": f"{type(e).__name__}: {e}"}
    return result
