"""Building the engine for the in-process benchmarks (latency, throughput), and timing its
start-up from the moment the process began."""

from __future__ import annotations

import argparse
import os
import time

from jaxserve.engine.args import add_engine_arguments, engine_kwargs


def add_bench_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--hbm-bandwidth", type=float, default=None,
                        help="bytes/s for the roofline (default: the measured copy rate of the "
                             "device's kind: H200 4.24e12, H100 3.0e12)")
    parser.add_argument("--output-json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--disable-tqdm", action="store_true")


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process was created (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])        # field 22 (starttime), counted after the ")"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def build_llm(args: argparse.Namespace, **overrides):
    """An LLM from the parsed engine flags; `overrides` fill flags the user left unset.
    Returns (llm, seconds the constructor took: load + KV allocation + warm-up compile)."""
    from jaxserve import LLM

    kwargs = engine_kwargs(args)
    for key, value in overrides.items():
        if kwargs.get(key) is None:
            kwargs[key] = value
    model = kwargs.pop("model")
    from jaxserve.engine.checks import StartupError

    t0 = time.perf_counter()
    try:
        llm = LLM(model, **kwargs)
    except (ValueError, OSError) as e:   # a bad file or a limit the model cannot take
        raise StartupError(str(e)) from e
    return llm, time.perf_counter() - t0


def memory_fields(runner) -> dict | None:
    """The engine's memory plan (worker/memory_plan.py MemoryReport) for the JSON and the
    "memory" table: device total, weights, step programs' peak, headroom, KV cache bytes,
    blocks, tokens and concurrency at max_model_len."""
    return runner.memory.as_dict() if runner.memory is not None else None
