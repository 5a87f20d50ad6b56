r"""`jaxserve bench latency`: time a batch of requests end to end and per decode step.

For each batch size, `--num-iters` times: submit `batch` requests of `--input-len` random
tokens and generate exactly `--output-len` tokens each (ignore_eos). Reports the end-to-end
latency, the median decode step (= ms per output token of every sequence), tokens/s, the
fraction of the HBM roofline (weights + KV context read per step over the bandwidth), the
split of a step into host and device time, and the step replayed on the device alone.

The first request's first token after process start is the cold start-up time.

`--baseline hf` also runs each batch's first timed prompts through Hugging Face transformers
(greedy, f32, the same model file; benchmarks/hf_cpu_baseline.py under `--baseline-python`,
an interpreter with torch and transformers) and reports its ms per output token beside ours. On the CPU:

    jaxserve bench latency --engine-defaults --batch-size 1 --input-len 32 --output-len 64 \
        --temperature 0 --baseline hf --baseline-python PYTHON_WITH_TORCH
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

from jaxserve.bench import report, roofline
from jaxserve.bench.datasets import random_requests
from jaxserve.bench.engine_setup import (add_bench_engine_arguments, build_llm, memory_fields,
                                         seconds_since_process_start)
from jaxserve.bench.hf_baseline import run_hf_baseline
from jaxserve.bench.step_timer import StepTimer, device_only_step_seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_engine_arguments(p)
    g = p.add_argument_group("latency")
    g.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-iters", type=int, default=3, help="timed iterations per batch size")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations per batch size")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling for every request (1: off); with --top-k, the "
                        "sampler's truncation is in the timed steps")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="every request's temperature (0: greedy, as the hf baseline decodes)")
    g.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="with --enable-lora: N random adapters of rank --max-lora-rank on every "
                        "projection, the requests spread over them in turn (0: the base model)")
    g.add_argument("--device-only-iters", type=int, default=20,
                   help="back-to-back replays of one decode step (0: skip)")
    g.add_argument("--engine-defaults", action="store_true",
                   help="leave max_model_len and max_num_seqs at the engine's defaults (LLM()'s) "
                        "instead of fitting them to the lengths and batch sizes")
    g.add_argument("--baseline", choices=["hf"], default=None,
                   help="hf: time the same prompts with Hugging Face transformers too, one "
                        "of its runs after each timed iteration (interleaved: a busy machine "
                        "slows both alike)")
    g.add_argument("--baseline-python", default=sys.executable,
                   help="the interpreter (with torch and transformers) that runs the baseline")
    g.add_argument("--profile-dir", default=None,
                   help="also trace a few decode steps with jax.profiler into this folder and "
                        "summarise device kernels against the step's wall time")
    return p


_ids = itertools.count()


def generate_once(engine, requests, params, loras=()) -> tuple[float, float | None]:
    """Run `requests` to completion on the engine's own step loop (request i on adapter
    loras[i % len(loras)], if any). Returns (seconds, seconds until the first token of any
    request)."""
    from jaxserve.sampling_params import SamplingParams

    rids = []
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        rid = f"bench-{next(_ids)}"
        engine.add_request(rid, r.prompt_token_ids,
                           SamplingParams(**{**params, "max_tokens": r.output_len}),
                           lora_request=loras[i % len(loras)] if loras else None)
        rids.append(rid)
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
            first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


def bench_batch(llm, batch: int, args, bar=None, loras=()) -> dict:
    engine = llm.engine
    cfg = engine.config.model
    vocab = cfg.vocab_size
    params = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=True)
    reqs = lambda seed: random_requests(batch, args.input_len, args.output_len, vocab, seed=seed)  # noqa: E731
    firsts = []     # NOTE: first tokens of the untimed iterations: the step timer waits on every step
    for i in range(args.num_iters_warmup):
        firsts.append(generate_once(engine, reqs(1000 + i), params, loras)[1])
        if bar is not None:
            bar.update(1)
    timer = StepTimer(engine)
    latencies, hf_rows = [], []
    baseline = getattr(args, "baseline", None) == "hf"   # (callers building args by hand may omit it)
    try:
        for i in range(args.num_iters):
            latencies.append(generate_once(engine, reqs(i), params, loras)[0])
            if baseline:     # (in a subprocess: no engine step runs meanwhile)
                hf_rows.append(run_hf_baseline(args.baseline_python, args.model,
                                               [r.prompt_token_ids for r in reqs(i)],
                                               args.output_len, 1))
            if bar is not None:
                bar.update(1)
    finally:
        timer.detach()
    steps = timer.summary(decode_only=True)
    row = {"batch_size": batch, "input_len": args.input_len, "output_len": args.output_len,
           "latency_mean_s": statistics.mean(latencies), "latency_p50_s": report.percentile(latencies, 50),
           "latency_p99_s": report.percentile(latencies, 99),
           "output_tok_per_s_e2e": batch * args.output_len / statistics.mean(latencies)}
    if firsts:
        row["ttft_ms"] = 1e3 * statistics.median(firsts)    # of the warm-up iterations
    if steps["num_steps"]:
        step_s = steps["per_token"]     # a multi-step decode's step makes `steps` tokens a sequence
        row.update(ms_per_output_token=1e3 * step_s, decode_tok_per_s=batch / step_s,
                   step_host_ms=1e3 * steps["host"], num_decode_steps=steps["num_steps"],
                   decode_steps_per_step=steps["steps"],
                   **{f"step_{k}_ms": 1e3 * steps[k] for k in ("schedule", "prepare", "dispatch", "device",
                                                              "to_host", "update", "outputs")})
        # Roofline at the mean context of the decode steps (prompt + half the outputs).
        weight_bytes = roofline.decode_weight_bytes(engine.runner.params, cfg.num_experts or 0,
                                                    cfg.num_experts_per_tok or 0, batch)
        kv_tok = roofline.kv_bytes_per_token(cfg, engine.runner.dtype.itemsize)
        mean_ctx = args.input_len + args.output_len / 2
        step_bytes = roofline.decode_step_bytes(weight_bytes, kv_tok, [mean_ctx] * batch)
        bw = args.hbm_bandwidth or roofline.device_hbm_bytes_per_s()
        floor_s = roofline.roofline_seconds(step_bytes, bw)
        row.update(weight_gb=weight_bytes / 1e9, step_bytes_gb=step_bytes / 1e9, roofline_ms=1e3 * floor_s,
                   roofline_fraction=floor_s / step_s)
        captured = timer.decode_inputs.get(batch)
        if args.device_only_iters and captured is None:
            # e.g. short outputs behind chunked prompts: the first requests finish before the
            # last ones leave prefill, so no step decodes the whole batch
            print(f"# batch {batch}: no decode step held all {batch} requests at once, so no "
                  f"device-only timing; a longer --output-len overlaps them", file=sys.stderr)
        if args.device_only_iters and captured is not None:
            dev_s = device_only_step_seconds(engine.runner, *captured, iters=args.device_only_iters)
            row.update(device_only_step_ms=1e3 * dev_s, device_only_roofline_fraction=floor_s / dev_s,
                       host_overhead_fraction=1 - dev_s / step_s)
    if hf_rows:
        hf_ms = statistics.median(r["ms_per_output_token"] for r in hf_rows)
        row.update(hf_ms_per_output_token=hf_ms, hf_torch_threads=hf_rows[0]["torch_threads"],
                   hf_ttft_ms=1e3 * statistics.median(r["prefill_s"] for r in hf_rows))
        if "ms_per_output_token" in row:
            row["ratio_to_hf"] = row["ms_per_output_token"] / hf_ms
    if args.profile_dir:
        from jaxserve.bench.profile import profile_decode_steps
        row["profile"] = profile_decode_steps(engine, batch, args, params)
    return row


def startup_row(build_s: float, before_build: float | None, first_token_s: float | None,
                after_build: float | None, engine=None) -> dict:
    row = {"process_to_engine_ready_s": after_build, "engine_build_s": build_s,
           "process_start_to_build_s": before_build,
           "process_to_first_token_s": None if after_build is None or first_token_s is None
           else after_build + first_token_s}
    if engine is not None:   # the build's parts; lower/compile are summed over the programs
        row.update({f"{k}_s": v for k, v in engine.startup_seconds.items()})
        row.update({f"{k}_sum_s": v for k, v in engine.runner.compile_seconds.items()})
    return row


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.lora_adapters and (not args.enable_lora or args.lora_adapters > args.max_loras):
        parser.error(f"--lora-adapters {args.lora_adapters} needs --enable-lora and --max-loras >= "
                     f"{args.lora_adapters} (all of them in one step)")
    before_build = seconds_since_process_start()
    block = args.block_size
    max_len = -(-(args.input_len + args.output_len) // block) * block
    fitted = {} if args.engine_defaults else dict(max_num_seqs=max(args.batch_size), max_model_len=max_len)
    llm, build_s = build_llm(args, **fitted)
    after_build = seconds_since_process_start()
    # Cold start: the first token of the very first request this process serves.
    vocab = llm.engine.config.model.vocab_size
    _, first_s = generate_once(llm.engine, random_requests(1, args.input_len, 1, vocab),
                               dict(temperature=1.0, ignore_eos=True))
    # Time nothing while step programs still compile in the background (warm-up returns with
    # the lean ones ready): their lowering takes host time from the steps.
    llm.engine.wait_for_warmup()
    all_ready = seconds_since_process_start()
    startup = startup_row(build_s, before_build, first_s, after_build, llm.engine)
    startup["process_to_all_programs_ready_s"] = all_ready
    bar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(args.batch_size) * (args.num_iters + args.num_iters_warmup),
                   desc="latency iterations", dynamic_ncols=True)
    loras = []
    if args.lora_adapters:
        import tempfile
        from jaxserve.lora.synthetic import random_adapters
        loras = random_adapters(tempfile.mkdtemp(prefix="jaxserve-lora-"), llm.engine.config.model,
                                args.lora_adapters, args.max_lora_rank)
    try:
        rows = [bench_batch(llm, b, args, bar, loras) for b in args.batch_size]
    finally:
        if bar is not None:
            bar.close()
    result = {"benchmark": "latency", "environment": report.environment(),
              "engine": {"model": args.model, "dtype": llm.engine.config.dtype,
                         "attention_impl": llm.engine.runner.attention_impl,
                         "max_model_len": llm.engine.config.scheduler.max_model_len,
                         "max_num_seqs": llm.engine.config.scheduler.max_num_seqs,
                         "num_kv_blocks": llm.engine.runner.num_blocks,
                         "memory": memory_fields(llm.engine.runner),
                         "lora_adapters": args.lora_adapters},
              "startup": startup, "results": rows}
    report.print_table("start-up", [startup])
    if result["engine"]["memory"] is not None:
        report.print_table("memory", [{k: v for k, v in result["engine"]["memory"].items()
                                       if k != "allocator"}])     # a sentence: the JSON keeps it
    report.print_table("latency", [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows],
                       ["batch_size", "latency_mean_s", "ms_per_output_token", "decode_tok_per_s",
                        "roofline_ms", "roofline_fraction", "step_host_ms", "step_device_ms",
                        "device_only_step_ms", "device_only_roofline_fraction"]
                       + (["hf_ms_per_output_token", "ratio_to_hf"] if args.baseline else []))
    for r in rows:
        if "profile" in r:
            report.print_table(f"profile, batch {r['batch_size']}", [r["profile"]["summary"]])
            host = r["profile"].get("host_ms_by_name") or {}
            if host:
                report.print_table(f"host ms per engine step by event, batch {r['batch_size']}",
                                   [{"event": n, "ms": round(v, 4)} for n, v in host.items()])
    report.write_json(args.output_json, result)
    return 0
