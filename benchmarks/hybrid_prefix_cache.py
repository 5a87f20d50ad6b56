"""Hybrid prefix caching (kv_cache/state_cache.py) on Qwen3.5-397B's reduced-depth shape
(jaxserve/models/configs/Qwen3.5-397B-A17B-4L.json, dummy bf16 weights): what a hit saves and what the
state saves cost.

    # H200 (one device call; ~6 minutes with compiles, ~2.5 of them each engine's warm-up;
    # near a call's limit, run --caching off and --caching on in two calls)
    python benchmarks/hybrid_prefix_cache.py --json $OUT/hybrid_prefix_cache.json
    # CPU check (the tests' tiny Qwen3.5-MoE)
    JAX_PLATFORMS=cpu python benchmarks/hybrid_prefix_cache.py --smoke

Figures:
- ttft_cold_s / ttft_hit_s: time to first token of a prompt of --prompt-len tokens with
  caching off, and with caching on after another prompt sharing all but its last --suffix
  tokens ran (the hit resumes at the last saved block boundary inside the shared part);
  hit_tokens: what the hit skipped (from the engine's counter).
- decode_tok_s_off / _on: decode tokens/s of --batch requests with caching off and on (on:
  each request saves its state every block_size tokens: a copy program after those steps).
- copy_ms_{n}: one state-copy program moving n slots (wall clock, median).
The engine is warmed up (warmup_all=True: every program compiled before the first timing)
and each figure is the median of --rounds runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxserve import LLM, SamplingParams  # noqa: E402


def engine(args, caching: bool) -> LLM:
    if args.smoke:
        return LLM(os.path.join(ROOT, "tests", "golden", "ckpt", "qwen3_5_moe"), dtype="float32",
                   max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=4,
                   num_kv_blocks=512, enable_prefix_caching=caching, warmup=False)
    return LLM(os.path.join(ROOT, "models", "configs", "Qwen3.5-397B-A17B-4L.json"),
               load_format="dummy", dtype="bfloat16", max_num_seqs=args.batch,
               max_num_batched_tokens=args.budget, max_model_len=args.prompt_len + 1024,
               enable_prefix_caching=caching, warmup=True,
               warmup_all=True)   # every program before the first timing: none compiles inside one


def prompts(rng, vocab: int, n: int, length: int) -> list[list[int]]:
    return [rng.integers(10, vocab - 10, length).tolist() for _ in range(n)]


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - t0


def decode_tok_s(llm: LLM, batch: list[list[int]], new_tokens: int) -> float:
    """batch * (N - 1) / (time of N new tokens - time of 1): the prefill drops out."""
    def run(n):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0
    return len(batch) * (new_tokens - 1) / (run(new_tokens) - run(1))


def copy_ms(llm: LLM, n: int, rounds: int) -> float:
    """(Overwrites saved states with live slots' contents: run it last on an engine.)"""
    runner = llm.engine.runner
    live = llm.engine.scheduler.kv.num_live_slots
    pairs = [(1 + i % (live - 1), live + i % runner.num_cached_states) for i in range(n)]
    runner.kv_cache = runner.state_copier(runner.kv_cache, pairs)     # compiled already
    samples = []
    for _ in range(rounds):
        jax.block_until_ready(runner.kv_cache)
        t0 = time.perf_counter()
        runner.kv_cache = runner.state_copier(runner.kv_cache, pairs)
        jax.block_until_ready(runner.kv_cache)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=10_000)
    ap.add_argument("--suffix", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=129)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--caching", choices=("off", "on", "both"), default="both",
                    help="both: each engine in a process of its own, one after the other")
    args = ap.parse_args()
    if args.caching == "both":
        return run_both(args)
    if args.smoke:
        args.prompt_len, args.suffix, args.batch, args.new_tokens, args.rounds = 100, 10, 4, 9, 1
        args.decode_prompt_len = 12
    rng = np.random.default_rng(0)
    out = {"prompt_len": args.prompt_len, "suffix": args.suffix, "batch": args.batch,
           "budget": args.budget}
    key, caching = args.caching, args.caching == "on"
    llm = engine(args, caching)
    vocab = llm.engine.config.model.vocab_size
    times, hits = [], []
    for _ in range(args.rounds):
        # a fresh shared part each round: the first prompt computes it (and saves its
        # states), the second finds it; with caching off both compute everything
        shared = prompts(rng, vocab, 1, args.prompt_len - args.suffix)[0]
        first, second = (shared + p for p in prompts(rng, vocab, 2, args.suffix))
        ttft(llm, first)
        before = llm.get_metrics()["prefix_cache_hits_total"]
        times.append(ttft(llm, second))
        hits.append(llm.get_metrics()["prefix_cache_hits_total"] - before)
    out["ttft_hit_s" if caching else "ttft_cold_s"] = statistics.median(times)
    if caching:
        out["hit_tokens"] = statistics.median(hits)
    batch = prompts(rng, vocab, args.batch, args.decode_prompt_len)
    decode_tok_s(llm, batch, 3)           # untimed: a first pass over these shapes
    out[f"decode_tok_s_{key}"] = statistics.median(
        decode_tok_s(llm, batch, args.new_tokens) for _ in range(args.rounds))
    if caching:
        out["num_cached_states"] = llm.engine.runner.num_cached_states
        most = min(args.batch, llm.engine.runner.num_cached_states)
        for n in sorted({1, min(16, most), most}):
            out[f"copy_ms_{n}"] = copy_ms(llm, n, max(args.rounds, 5))
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def run_both(args) -> None:
    """Caching off, then on, each in a fresh process (the same prompts: the same seed).
    NOTE: in one process the second engine of the H200 runs failed to allocate 8 GiB in its
    first step (BENCHMARKS.md); a process of its own starts each with the whole device."""
    out = {}
    for caching in ("off", "on"):
        with tempfile.TemporaryDirectory() as tmp:
            part = os.path.join(tmp, "part.json")
            # (argparse keeps the last --caching and --json: these override the caller's)
            subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                            "--caching", caching, "--json", part], check=True)
            with open(part) as f:
                out.update(json.load(f))
        if args.json:     # after each engine: a run cut short keeps the first one's figures
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
