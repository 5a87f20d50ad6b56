"""Command-line flags for the engine, shared by `serve`, `generate` and `bench` (vLLM's names)."""

from __future__ import annotations

import argparse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a .gguf file or HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights and activations (auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--load-format", choices=["auto", "gguf", "safetensors", "dummy"], default="auto")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens of one request")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                   help="fraction of free device memory for the KV cache")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides the memory fraction)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="requests queued beyond the running ones; more are refused (HTTP 503)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cut each request's prefill chunks to this many tokens (0: off); "
                        "lowers the inter-token latency of running requests when prompts arrive")
    g.add_argument("--attention-impl", choices=["auto", "xla", "pallas"], default="auto")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="compile step buckets lazily instead of at start-up")
    g.add_argument("--warmup-all", action="store_true",
                   help="at start-up wait for every step program, also those for logprobs, "
                        "top-k/top-p and penalties (by default they compile in the background "
                        "and the first request needing one waits for it)")
    g.add_argument("--no-program-cache", dest="program_cache", action="store_false",
                   help="do not keep compiled step programs across runs (by default they are "
                        "kept under $JAXSERVE_CACHE/steps, default ~/.cache/jaxserve/steps, "
                        "and a restart with the same code, model and settings loads them "
                        "instead of tracing the model again)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of LLMEngine.from_engine_args / AsyncEngine.from_engine_args."""
    return dict(
        model=args.model, dtype=None if args.dtype == "auto" else args.dtype,
        load_format=args.load_format, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
        max_logprobs=args.max_logprobs, max_waiting_requests=args.max_waiting_requests,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        attention_impl=args.attention_impl, warmup=args.warmup,
        warmup_all=args.warmup_all, program_cache=args.program_cache,
        served_model_name=getattr(args, "served_model_name", None))
