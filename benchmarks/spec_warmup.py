"""Start-up of a speculating engine: how long until it serves, how long until every program
is compiled, and whether a mixed workload afterwards compiles anything (it must not).

One engine (dummy weights of the Llama-3.1-8B shape; --tiny: the tests' tiny Llama on the
CPU) with a proposer: "eagle3" (a random-weight head of Llama-3.1-8B's EAGLE3 head's shape,
as benchmarks/spec_decode.py writes it; --tiny: the tests' tiny head) or "ngram". It prints
the seconds to a ready engine (warm-up returns with the plain lean programs) and to every
program compiled (LLMEngine.wait_for_warmup: the full, verifying and proposer programs
compile in the background), the number of programs, then the XLA compiles of a workload of
prefills beside decodes at batch 1, 8 and max_num_seqs (greedy and random requests: some
drafts accepted, some not).

    # H200
    python benchmarks/spec_warmup.py --output-json benchmarks/results/spec_warmup_h200.json
    # CPU check
    JAX_PLATFORMS=cpu python benchmarks/spec_warmup.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def build(args):
    """(LLM, seconds to a ready engine, seconds until every program is compiled)."""
    from jaxserve.config import EngineConfig, SchedulerConfig
    from jaxserve.engine.builder import build_engine
    from jaxserve.engine.llm import LLM
    from jaxserve.models import registry
    from jaxserve.spec_decode.config import SpeculativeConfig

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from spec_decode import load_target, write_head

    cfg, params, dtype = load_target(args.tiny, args.dtype)
    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "eagle3":
        spec["model"] = write_head(args.eagle3_dir + ("_tiny" if args.tiny else ""), cfg, args.tiny)
    config = EngineConfig(
        model=cfg, scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                             max_num_batched_tokens=args.max_num_batched_tokens,
                                             max_model_len=args.max_model_len),
        dtype=dtype, speculative=SpeculativeConfig.from_dict(spec))
    t = time.perf_counter()
    engine = build_engine(config, params, None, registry.get_family(cfg.architecture))
    ready = time.perf_counter() - t
    engine.wait_for_warmup()
    return LLM.from_engine(engine), ready, time.perf_counter() - t


def workload(llm, max_num_seqs: int, rng) -> None:
    from jaxserve import SamplingParams

    vocab = llm.engine.config.model.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    random = SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
    for batch in sorted({1, 8, max_num_seqs}):
        lens = rng.integers(4, 200, size=batch)
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, size=n).tolist()} for n in lens]
        llm.generate(prompts, [greedy if i % 2 else random for i in range(batch)], use_tqdm=False)


def main() -> None:
    import jax

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny Llama (a CPU check)")
    p.add_argument("--method", choices=("eagle3", "ngram"), default="eagle3")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", help="the 8B shape's dtype (not --tiny)")
    p.add_argument("--eagle3-dir", default="/tmp/jaxserve_bench_eagle3_head")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    args.max_num_seqs = args.max_num_seqs or (8 if args.tiny else 64)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (32 if args.tiny else 512)
    if args.tiny:
        args.max_model_len = min(args.max_model_len, 256)

    llm, ready, all_compiled = build(args)
    runner, proposer = llm.engine.runner, llm.engine.core.proposer
    from jaxserve.worker.verify_rows import warmup_draft_rows

    buckets = runner.buckets
    programs = {"target": len(runner._executables),
                "draft_row_counts": sum(len(warmup_draft_rows(t0, t, args.k, args.max_num_seqs))
                                        for t0, t in zip([0] + buckets, buckets)),
                "proposer": len(proposer._pending) if args.method == "eagle3" else 0}
    print(f"ready in {ready:.1f} s, every program compiled in {all_compiled:.1f} s; programs {programs}",
          flush=True)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(secs)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    t = time.perf_counter()
    workload(llm, args.max_num_seqs, np.random.default_rng(0))
    counts = {k: v for k, v in llm.get_metrics().items() if k.startswith("spec_decode_num_")
              and "per_pos" not in k}
    print(f"workload: {time.perf_counter() - t:.1f} s, {len(compiles)} compiles "
          f"({sum(compiles):.1f} s); {counts}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "ready_s": ready, "all_compiled_s": all_compiled,
                       "programs": programs, "workload_compiles": len(compiles),
                       "workload_compile_s": sum(compiles), "spec": counts}, f, indent=1)
    if compiles:
        sys.exit("the workload compiled programs after warm-up")


if __name__ == "__main__":
    main()
