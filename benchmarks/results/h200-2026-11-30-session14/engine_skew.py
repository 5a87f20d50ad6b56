"""Engine-level check of the skew rule (runner.ModelRunner.attention_hint with
skewed_contexts), in one process: 16 (--batch) requests at once whose prompts are one long and
fifteen of 1K tokens (or sixteen of 1K), 64 output tokens each (ignore_eos); the median decode
step (host and device) and one decode step replayed on the device alone (100 times), with the
rule (max context over 1.8 x the mean: fill_splits) and without it (SKEWED_CONTEXT_RATIO =
inf: the thirteenth session's choice, the bucket's floor variant).

    python3 benchmarks/results/h200-2026-11-30-session14/engine_skew.py Llama-3.1-8B \\
        --load-format dummy --dtype bfloat16 --max-model-len 9216 --max-num-seqs 16
"""
import argparse
import math
import random

from jaxserve.bench.datasets import BenchRequest
from jaxserve.bench.engine_setup import add_bench_engine_arguments, build_llm
from jaxserve.bench.latency import generate_once
from jaxserve.bench.step_timer import StepTimer, device_only_step_seconds
from jaxserve.pallas_kernels import ragged_paged_attention as rpa


def requests(lens, out, vocab, seed):
    rng = random.Random(seed)
    low = min(1000, vocab // 2)
    return [BenchRequest([rng.randrange(low, vocab) for _ in range(n)], out) for n in lens]


def main():
    p = argparse.ArgumentParser()
    add_bench_engine_arguments(p)
    p.add_argument("--long", type=int, nargs="+", default=[8000, 4000])
    p.add_argument("--short", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16, help="requests at once")
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    llm, build_s = build_llm(args)
    engine = llm.engine
    engine.runner.wait_for_warmup()    # no compile threads beside the timed steps
    vocab = engine.config.model.vocab_size
    params = dict(temperature=1.0, ignore_eos=True)
    print(f"# engine built in {build_s:.1f} s", flush=True)
    short, b = args.short, args.batch
    cases = [(f"one {n} + {b - 1} x {short}", [n] + [short] * (b - 1)) for n in args.long]
    cases.append((f"{b} x {short}", [short] * b))
    rules = (("skew rule", 1.8), ("no skew rule", math.inf))
    for label, lens in cases + cases:             # twice, the second time in the other order
        for rule, ratio in rules:
            rpa.SKEWED_CONTEXT_RATIO = ratio
            generate_once(engine, requests(lens, 4, vocab, 99), params)    # warm
            timer = StepTimer(engine)
            try:
                generate_once(engine, requests(lens, args.output_len, vocab, 1), params)
            finally:
                timer.detach()
            s = timer.summary(decode_only=True)
            captured = timer.decode_inputs.get(len(lens))
            dev = (device_only_step_seconds(engine.runner, *captured, iters=100)
                   if captured else float("nan"))
            busy = (f"{captured[1].busy_seqs}" + (" skewed" if captured[1].skewed else "")
                    if captured and hasattr(captured[1], "busy_seqs") else "?")
            print(f"{label:22s} {rule:13s} decode steps {s['num_steps']:3d}  median step "
                  f"{1e3 * s['total']:6.2f} ms (device wait {1e3 * s['device']:5.2f})  "
                  f"device only {1e3 * dev:6.2f} ms  busy_seqs {busy}", flush=True)
        if (label, lens) == cases[-1]:
            rules = rules[::-1]
    rpa.SKEWED_CONTEXT_RATIO = 1.8


if __name__ == "__main__":
    main()
