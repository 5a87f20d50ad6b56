"""Command-line flags for the engine, shared by `serve`, `generate`, `run-batch`, `chat` and
`bench` (vLLM's names, and vLLM's spellings of values where they differ from ours)."""

from __future__ import annotations

import argparse
import json

from jaxserve.engine.arg_types import fraction, human_bytes, human_int, int_at_least

# vLLM's --dtype values -> ours (None: bfloat16 on GPU, float32 on CPU).
DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
          "float": "float32", "float32": "float32"}


class _ChunkedPrefill(argparse.Action):
    """--enable-chunked-prefill is accepted (it is how this engine always runs); turning it
    off is refused, as there is no other prefill path."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-"):
            parser.error("--no-enable-chunked-prefill: chunked prefill is always on in jaxserve "
                         "(prompts are cut into --max-num-batched-tokens chunks); leave the flag out")
        setattr(namespace, self.dest, True)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a .gguf file or HF model directory (default: the embedded SmolLM2-135M-Instruct); "
                             "nothing is downloaded from a model hub")
    g = parser.add_argument_group("engine")
    g.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the model, as the positional argument (vLLM's spelling)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a HF tokenizer directory to use instead of the model's own (vLLM's flag; "
                        "nothing is downloaded)")
    g.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="weights and activations (auto: bfloat16 on GPU, float32 on CPU; "
                        "half = float16, float = float32)")
    g.add_argument("--load-format", choices=["auto", "gguf", "safetensors", "dummy"], default="auto")
    g.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                   help="fp8: keep an FP8 checkpoint's routed experts in FP8 (DeepSeek V3 / V3.2; "
                        "half their memory, faster from ~16 rows, slower at batch 1); by default "
                        "FP8 weights are dequantized to --dtype at load")
    g.add_argument("--max-model-len", type=human_int, default=None,
                   help="prompt + output tokens of one request; 4k = 4000, 4K = 4096 (as vLLM)")
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=None, help="sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=human_int, default=None, help="token budget of one step")
    g.add_argument("--block-size", type=int_at_least(1), default=16, help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="the share of the GPU's whole memory this engine may use: weights, the "
                        "step programs' peak and the KV cache together (vLLM's meaning; default "
                        "0.9). The cache gets what is left once the weights are loaded and the "
                        "largest step program is measured; JAX's allocator is given this share "
                        "unless XLA_PYTHON_CLIENT_MEM_FRACTION is set")
    g.add_argument("--kv-cache-memory-bytes", type=human_bytes, default=None, metavar="BYTES",
                   help="the KV cache's size per device in bytes, exactly (vLLM's flag; 8G = 8 GiB, "
                        "8g = 8e9); overrides --gpu-memory-utilization's sizing, on the CPU too")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int_at_least(2), default=None,
                   dest="num_kv_blocks",
                   help="KV blocks (overrides the memory fraction); block 0 is reserved, so a request "
                        "of max_model_len tokens needs ceil(max_model_len / block_size) + 1 blocks "
                        "(--num-gpu-blocks-override is vLLM's name)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompts' shared prefixes (default: on)")
    g.add_argument("--num-cached-states", type=int_at_least(0), default=None,
                   help="hybrid models (Qwen3-Next, Qwen3.5): linear-attention states saved at "
                        "block boundaries for prefix-cache hits (default: max-num-seqs, at most a "
                        "quarter of the KV-cache memory; 0: no prefix hits for these models)")
    g.add_argument("--enable-chunked-prefill", "--no-enable-chunked-prefill", action=_ChunkedPrefill,
                   nargs=0, default=True,
                   help="accepted for vLLM's command lines: chunked prefill is always on here "
                        "(long prompts are split into --max-num-batched-tokens chunks, mixed with "
                        "the running decodes); it cannot be turned off")
    g.add_argument("--tensor-parallel-size", "-tp", type=int_at_least(1), default=1)
    add_expert_parallel_arguments(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-logprobs", type=int_at_least(0), default=20)
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; jaxserve never runs a model's own code")
    g.add_argument("--max-waiting-requests", type=int_at_least(0), default=4096,
                   help="requests queued beyond the running ones; more are refused (HTTP 503)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cut each request's prefill chunks to this many tokens (0: off); "
                        "lowers the inter-token latency of running requests when prompts arrive")
    g.add_argument("--num-scheduler-steps", type=int_at_least(1), default=None,
                   help="decode steps run on the device per host step while every running "
                        "request decodes (vLLM's multi-step scheduling; 1: off); outputs then "
                        "stream this many tokens at a time (default without speculation: 8 on "
                        "one GPU for a model the fused stack covers and for DeepSeek V3 / V3.2, "
                        "MiniMax-M2 and Qwen3-Next / Qwen3.5, whose small-batch steps the "
                        "host's launch bounds; else 1)")
    g.add_argument("--attention-impl", choices=["auto", "xla", "pallas"], default="auto")
    g.add_argument("--fused-kernels", type=fused_kernels, default="auto", metavar="auto|none|NAME[,NAME]",
                   help="fused Pallas kernels of the step (with the Pallas attention): 'linear' "
                        "(each projection with its norm, gate or residual add: small dense "
                        "models), 'norm', 'rope', 'moe' (the routed experts of 1-4 token "
                        "steps in two kernels: MoE models); 'auto' picks by model (pallas_kernels/"
                        "policy.py auto_fused_kernels)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="compile step buckets lazily instead of at start-up")
    g.add_argument("--warmup-all", action=argparse.BooleanOptionalAction, default=False,
                   help="at start-up wait for every step program, also those for logprobs, "
                        "top-k/top-p, penalties, grammar masks and speculation (on for `serve`, "
                        "so that 'ready' means nothing is left to compile; elsewhere off: they "
                        "compile in the background and the first request needing one waits)")
    g.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help="speculative decoding, with vLLM's keys: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                        "\"prompt_lookup_max\": 4}' or '{\"method\": \"draft_model\", "
                        "\"model\": DIR, \"num_speculative_tokens\": 3}' or '{\"method\": \"mtp\", "
                        "\"num_speculative_tokens\": 3}' (DeepSeek V3's MTP layer, chained), or \"eagle3\" with "
                        "\"model\": an HF EAGLE3 head (default: off)")
    g.add_argument("--no-program-cache", dest="program_cache", action="store_false",
                   help="do not keep compiled step programs across runs (by default they are "
                        "kept under $JAXSERVE_CACHE/steps, default ~/.cache/jaxserve/steps, "
                        "and a restart with the same code, model and settings loads them "
                        "instead of tracing the model again)")

    add_parallel_arguments(parser)
    add_lora_arguments(parser)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """Multi-LoRA (jaxserve/lora/), vLLM's flags; the adapters to serve: --lora-modules
    (server/args.py) or POST /v1/load_lora_adapter."""
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters beside the base model, mixed in one batch "
                        "(dense llama-family models, one device, no speculative decoding)")
    g.add_argument("--max-loras", type=int_at_least(1), default=1,
                   help="adapters on the device at once: the distinct adapters of one step")
    g.add_argument("--max-lora-rank", type=int_at_least(1), default=16,
                   help="the largest rank an adapter's module may have (slots are this wide)")
    g.add_argument("--max-cpu-loras", type=int_at_least(1), default=None,
                   help="adapters kept loaded in host memory (default: --max-loras)")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Several hosts (jaxserve/distributed.py) and data parallelism (engine/data_parallel.py)."""
    g = parser.add_argument_group("several hosts and data parallelism")
    g.add_argument("--data-parallel-size", "-dp", type=int_at_least(1), default=1,
                   help="whole engines, each on its own tensor-parallel-size * expert-parallel-size "
                        "devices, behind one server; requests go to the least busy one")
    g.add_argument("--nnodes", type=int_at_least(1), default=None,
                   help="hosts in one engine (default: $JAX_NUM_PROCESSES, else 1); every host runs "
                        "the same command with its own --node-rank; rank 0 serves")
    g.add_argument("--node-rank", type=int_at_least(0), default=None,
                   help="this host's rank, 0 to nnodes - 1 (default: $JAX_PROCESS_ID, else 0)")
    g.add_argument("--master-addr", default=None,
                   help="rank 0's address, for jax.distributed's coordinator and the step channel "
                        "(default: the host of $JAX_COORDINATOR_ADDRESS, else 127.0.0.1)")
    g.add_argument("--master-port", type=int_at_least(1), default=None,
                   help="the coordinator's port on rank 0 (default: the port of "
                        "$JAX_COORDINATOR_ADDRESS, else 29500)")


def distributed_config(args: argparse.Namespace):
    """The hosts the flags (or JAX's environment variables) describe."""
    from jaxserve.engine.distributed import DistributedConfig
    from jaxserve.engine.checks import StartupError

    try:
        return DistributedConfig.resolve(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    except ValueError as e:
        raise StartupError(str(e)) from None


def speculative_config(text: str) -> dict:
    """--speculative-config's JSON, checked now (a usage error names the key)."""
    from jaxserve.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.from_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


def fused_kernels(text: str) -> str:
    """--fused-kernels, checked now (a usage error names the allowed values)."""
    from jaxserve.pallas_kernels.policy import fused_kernel_names

    try:
        fused_kernel_names(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def model_argument(args: argparse.Namespace) -> str | None:
    """The model, given positionally or as --model (vLLM takes both); also stored in args.model."""
    option = getattr(args, "model_option", None)
    if args.model is not None and option is not None and args.model != option:
        from jaxserve.engine.checks import StartupError
        raise StartupError(f"two models given: {args.model!r} and --model {option!r}; give one")
    args.model = args.model if args.model is not None else option
    return args.model


def served_model_names(args: argparse.Namespace) -> tuple[str, ...]:
    names = getattr(args, "served_model_name", None)
    if isinstance(names, str):
        return (names,)
    return tuple(names or ())


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of builder.from_engine_args / AsyncEngine.from_engine_args."""
    names = served_model_names(args)
    return dict(
        model=model_argument(args), dtype=DTYPES[args.dtype],
        load_format=args.load_format, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
        num_cached_states=args.num_cached_states,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
        expert_parallel_size=expert_parallel_size(args),
        max_logprobs=args.max_logprobs, max_waiting_requests=args.max_waiting_requests,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_scheduler_steps=args.num_scheduler_steps,
        attention_impl=args.attention_impl, fused_kernels=args.fused_kernels, warmup=args.warmup,
        warmup_all=args.warmup_all, program_cache=args.program_cache,
        speculative_config=getattr(args, "speculative_config", None),
        quantization=getattr(args, "quantization", None),
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        tokenizer=getattr(args, "tokenizer", None),
        enable_lora=getattr(args, "enable_lora", False), max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        # The engine carries one name; the server lists and accepts all of them.
        served_model_name=names[0] if names else None)


# --- expert parallelism (sharding/expert_parallel.py) ---------------------------------------


def add_expert_parallel_arguments(g) -> None:
    g.add_argument("--expert-parallel-size", type=int_at_least(1), default=1,
                   help="split MoE experts over this many device groups: the mesh is "
                        "expert-parallel x tensor-parallel devices (attention split over the "
                        "tensor-parallel ones, each expert's MLP too); default 1")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM's flag (experts over the tensor-parallel ranks): accepted where it "
                        "maps onto jaxserve's expert x model mesh (with --expert-parallel-size, or "
                        "on one device); otherwise an error says what to pass")


def expert_parallel_size(args: argparse.Namespace) -> int:
    """--expert-parallel-size, after checking --enable-expert-parallel maps onto our mesh.

    vLLM's --enable-expert-parallel makes the experts' ranks the attention's TP (x DP) ranks:
    one device group, heads split over it for attention and whole experts for the MoE. Our
    mesh has two axes, `expert` x `model`, attention replicated over `expert`, so the same
    devices cannot be both; the flag is accepted when it changes nothing (one TP rank) or when
    --expert-parallel-size already says how to split."""
    size = getattr(args, "expert_parallel_size", 1)
    tp = getattr(args, "tensor_parallel_size", 1)
    if getattr(args, "enable_expert_parallel", False) and size == 1 and tp > 1:
        from jaxserve.engine.checks import StartupError
        raise StartupError(
            f"--enable-expert-parallel with --tensor-parallel-size {tp}: vLLM would put the experts "
            f"on the {tp} tensor-parallel ranks, but jaxserve's mesh is expert x model (attention "
            f"replicated over the expert axis). Pass --expert-parallel-size E with "
            f"--tensor-parallel-size T (E * T devices: experts split E ways, attention and each "
            f"expert's MLP T ways), e.g. --expert-parallel-size {tp} --tensor-parallel-size 1 to "
            f"use {tp} devices as expert ranks, and leave --enable-expert-parallel out")
    return size
