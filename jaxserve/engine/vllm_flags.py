"""vLLM's `vllm serve` flags that jaxserve has no flag of its own for, and what it does with each.

A vLLM user's command line must start here, or say in one line why not. Every vLLM flag is
one of:
- ours: jaxserve defines it itself (engine/args.py, server/args.py), with vLLM's meaning;
- a no-op: accepted, changing nothing here; start-up logs one line per flag given, and why;
- refused: a usage error (one line under the usage) saying why and what to use instead;
- a no-op for some values, refused for the others (`--kv-cache-dtype auto` vs `fp8`).
VLLM_FLAGS below is the one table: `add_vllm_arguments` builds the parser's arguments from it,
`noop_notes` gives the log lines, and tests/test_vllm_flags.py reads it against vLLM's list.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# vLLM's flags that are jaxserve flags too (engine/args.py, server/args.py), same meaning.
OURS = (
    "--model", "--served-model-name", "--dtype", "--load-format", "--quantization", "-q",
    "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
    "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--num-gpu-blocks-override",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--enable-expert-parallel",
    "--seed", "--max-logprobs", "--trust-remote-code", "--long-prefill-token-threshold",
    "--num-scheduler-steps", "--speculative-config", "--generation-config", "--tokenizer",
    "--chat-template", "--enable-auto-tool-choice", "--tool-call-parser", "--host", "--port",
    "--api-key", "--uvicorn-log-level", "--disable-uvicorn-access-log", "--disable-log-requests",
    "--enable-log-requests", "--max-log-len", "--disable-log-stats", "--return-tokens-as-token-ids",
    "--nnodes", "--node-rank", "--master-addr", "--master-port", "--reasoning-parser",
    "--default-chat-template-kwargs",
    "--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
)


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag jaxserve does not define itself. value: its metavar (None: a switch).
    noop: why it changes nothing here ("" if it never is a no-op). refused: why it is refused
    and what to use instead ("" if never). noop_values: with both, the values that are no-ops
    (compared as strings); any other value is refused."""
    name: str
    value: str | None = None
    noop: str = ""
    refused: str = ""
    noop_values: tuple[str, ...] = ()

    def __post_init__(self):
        if not (self.noop or self.refused):
            raise ValueError(f"{self.name}: give a no-op or a refusal reason")
        if self.noop and self.refused and not self.noop_values:
            raise ValueError(f"{self.name}: a flag both no-op and refused needs noop_values")

    def handling(self, value: str | None) -> tuple[str, str]:
        """("no-op" | "refused", the reason) for this flag given with `value`."""
        if self.noop and (not self.refused or value in self.noop_values):
            return "no-op", self.noop
        return "refused", self.refused


def _noop(name, reason, value=None):
    return VllmFlag(name, value, noop=reason)


def _refused(name, reason, value=None):
    return VllmFlag(name, value, refused=reason)


def _by_value(name, value, noop_values, noop, refused):
    return VllmFlag(name, value, noop=noop, refused=refused, noop_values=tuple(noop_values))


_LOCAL = "models load from a local path (nothing is downloaded from a hub), as they are on disk"
_LORA = ("not supported: jaxserve's LoRA runs adapters on one device in the model's dtype over "
         "the base vocabulary (--enable-lora, --lora-modules, --max-loras, --max-lora-rank and "
         "--max-cpu-loras are supported)")
_MM = "multimodal inputs are not implemented (text models only)"
_CORS = "CORS headers are not implemented; put a proxy that adds them in front of jaxserve"
_TLS = "TLS is not implemented; put a TLS-terminating proxy in front of jaxserve"
_NO_GRAPHS = ("jaxserve has no CUDA graphs or eager mode: every step runs a compiled XLA "
              "program (--no-warmup compiles them lazily)")
_TOKENIZER_POOL = "the tokenizer runs on the server's own thread"

VLLM_FLAGS: tuple[VllmFlag, ...] = (
    # the model and its files
    _noop("--revision", _LOCAL, "REVISION"),
    _noop("--code-revision", _LOCAL, "REVISION"),
    _noop("--tokenizer-revision", _LOCAL, "REVISION"),
    _noop("--download-dir", _LOCAL, "DIR"),
    _noop("--hf-token", _LOCAL, "TOKEN"),
    _noop("--ignore-patterns", _LOCAL, "PATTERN"),
    _noop("--use-tqdm-on-load", "loading logs its own progress"),
    _noop("--max-parallel-loading-workers", "weights load in one process", "N"),
    _by_value("--task", "TASK", ("auto", "generate"), "jaxserve serves text generation only",
              "only text generation is implemented (--task generate)"),
    _by_value("--runner", "RUNNER", ("auto", "generate"), "jaxserve serves text generation only",
              "only text generation is implemented (--runner generate)"),
    _by_value("--tokenizer-mode", "MODE", ("auto", "hf"), "the model's HF (fast) tokenizer is used",
              "only the HF tokenizer is implemented (--tokenizer-mode auto)"),
    _by_value("--config-format", "FORMAT", ("auto", "hf"), "config.json is read as HF's",
              "only HF config.json is implemented (--config-format auto)"),
    _by_value("--model-impl", "IMPL", ("auto", "vllm"), "jaxserve runs its own JAX models",
              "jaxserve runs only its own JAX models (--model-impl auto)"),
    _refused("--skip-tokenizer-init", "a server without a tokenizer is not implemented; "
             "a model folder without tokenizer files already serves token ids only"),
    _refused("--hf-config-path", "give a model folder whose config.json is the one to use", "PATH"),
    _refused("--hf-overrides", "config overrides are not implemented; edit the model's config.json",
             "JSON"),
    _refused("--rope-scaling", "RoPE overrides are not implemented; set rope_scaling in config.json",
             "JSON"),
    _refused("--rope-theta", "RoPE overrides are not implemented; set rope_theta in config.json",
             "THETA"),
    _refused("--model-loader-extra-config", "loader options are not implemented", "JSON"),
    _refused("--override-generation-config", "not implemented; use --generation-config FOLDER with "
             "a generation_config.json holding the values", "JSON"),
    _refused("--disable-sliding-window", "turning a model's sliding window off is not implemented"),
    _refused("--config", "YAML config files are not implemented; give the flags on the command line",
             "FILE"),
    # cache, memory, scheduling
    _by_value("--kv-cache-dtype", "DTYPE", ("auto",), "the KV cache takes --dtype",
              "an FP8 KV cache is not implemented; leave --kv-cache-dtype out (the cache takes "
              "--dtype)"),
    _noop("--calculate-kv-scales", "there is no FP8 KV cache to scale"),
    _noop("--swap-space", "a preempted request is recomputed, never swapped to CPU memory", "GiB"),
    _by_value("--cpu-offload-gb", "GiB", ("0",), "no weights are offloaded",
              "CPU offloading of weights is not implemented (--cpu-offload-gb 0)"),
    _by_value("--preemption-mode", "MODE", ("recompute",), "preemption always recomputes",
              "only recompute preemption is implemented (--preemption-mode recompute)"),
    _by_value("--scheduling-policy", "POLICY", ("fcfs",), "requests run first come, first served",
              "priority scheduling is not implemented (--scheduling-policy fcfs)"),
    _noop("--prefix-caching-hash-algo", "prefix blocks are keyed by jaxserve's own hash", "ALGO"),
    _noop("--max-num-partial-prefills", "the scheduler chunks prefills by its token budget "
          "(--long-prefill-token-threshold caps one request's chunk)", "N"),
    _noop("--max-long-partial-prefills", "the scheduler chunks prefills by its token budget "
          "(--long-prefill-token-threshold caps one request's chunk)", "N"),
    _noop("--async-scheduling", "the engine always schedules the next step while the device runs "
          "this one"),
    _noop("--num-lookahead-slots", "speculative decoding reserves its own slots", "N"),
    _noop("--use-v2-block-manager", "there is one block manager"),
    _noop("--scheduler-delay-factor", "the scheduler never holds a prompt back", "FACTOR"),
    _noop("--show-hidden-metrics-for-version", "no metrics are hidden", "VERSION"),
    _noop("--disable-async-output-proc", "outputs are processed on the engine's thread"),
    _noop("--multi-step-stream-outputs", "multi-step outputs always stream per host step"),
    _refused("--enable-sleep-mode", "sleep mode is not implemented"),
    _refused("--kv-transfer-config", "KV transfer between instances is not implemented", "JSON"),
    _refused("--kv-events-config", "KV cache events are not implemented", "JSON"),
    # compilation and kernels
    _noop("--enforce-eager", _NO_GRAPHS),
    _noop("--max-seq-len-to-capture", _NO_GRAPHS, "N"),
    _noop("--compilation-config", "it configures torch.compile; jaxserve compiles with XLA", "JSON"),
    _noop("-O", "it configures torch.compile; jaxserve compiles with XLA", "LEVEL"),
    _noop("--disable-cascade-attn", "there is no cascade attention"),
    _noop("--guided-decoding-backend", "structured output always uses llguidance", "BACKEND"),
    # devices and parallelism
    _noop("--distributed-executor-backend", "jaxserve runs one process per host (several hosts: "
          "--nnodes)", "BACKEND"),
    _by_value("--pipeline-parallel-size", "N", ("1",), "one pipeline stage is how jaxserve runs",
              "pipeline parallelism is not implemented; use --tensor-parallel-size and "
              "--expert-parallel-size (several hosts: --nnodes)"),
    _by_value("-pp", "N", ("1",), "one pipeline stage is how jaxserve runs",
              "pipeline parallelism is not implemented; use --tensor-parallel-size and "
              "--expert-parallel-size (several hosts: --nnodes)"),
    _noop("--disable-custom-all-reduce", "collectives are XLA's"),
    _noop("--ray-workers-use-nsight", "there are no Ray workers"),
    _noop("--worker-use-ray", "there are no Ray workers"),
    _by_value("--device", "DEVICE", ("auto", "cuda", "gpu"), "JAX picks the device (JAX_PLATFORMS)",
              "JAX picks the device; set JAX_PLATFORMS (cpu, cuda) instead"),
    _refused("--data-parallel-size-local", "data parallelism is within one host here "
             "(--data-parallel-size); several hosts form one engine with --nnodes", "N"),
    _refused("--data-parallel-address", "several hosts: --nnodes, --node-rank, --master-addr",
             "ADDR"),
    _refused("--data-parallel-rpc-port", "several hosts: --master-port", "PORT"),
    _refused("--headless", "every host runs `jaxserve serve` with --nnodes and --node-rank; "
             "rank 0 serves"),
    _refused("--worker-cls", "custom workers are not implemented", "CLS"),
    _refused("--worker-extension-cls", "custom workers are not implemented", "CLS"),
    _refused("--scheduler-cls", "custom schedulers are not implemented", "CLS"),
    _refused("--additional-config", "platform plugins are not implemented", "JSON"),
    _refused("--override-neuron-config", "Neuron devices are not supported", "JSON"),
    _refused("--override-pooler-config", "pooling models are not implemented", "JSON"),
    # tokenizer pool (older vLLM)
    _noop("--tokenizer-pool-size", _TOKENIZER_POOL, "N"),
    _noop("--tokenizer-pool-type", _TOKENIZER_POOL, "TYPE"),
    _noop("--tokenizer-pool-extra-config", _TOKENIZER_POOL, "JSON"),
    # LoRA, prompt adapters, multimodal
    _refused("--lora-extra-vocab-size", _LORA, "N"),
    _refused("--lora-dtype", _LORA, "DTYPE"),
    _refused("--long-lora-scaling-factors", _LORA, "FACTORS"),
    _refused("--fully-sharded-loras", _LORA),
    _refused("--enable-lora-bias", _LORA),
    _refused("--qlora-adapter-name-or-path", _LORA, "PATH"),
    _refused("--enable-prompt-adapter", "prompt adapters are not implemented"),
    _refused("--prompt-adapters", "prompt adapters are not implemented", "NAME=PATH"),
    _refused("--max-prompt-adapters", "prompt adapters are not implemented", "N"),
    _refused("--max-prompt-adapter-token", "prompt adapters are not implemented", "N"),
    _refused("--limit-mm-per-prompt", _MM, "JSON"),
    _refused("--mm-processor-kwargs", _MM, "JSON"),
    _refused("--disable-mm-preprocessor-cache", _MM),
    _refused("--allowed-local-media-path", _MM, "PATH"),
    _noop("--disable-chunked-mm-input", "there are no multimodal inputs to chunk"),
    # reasoning, tools, logits processors
    _noop("--enable-reasoning", "reasoning is split off whenever --reasoning-parser names a "
          "parser (vLLM dropped this switch too)"),
    _refused("--tool-parser-plugin", "tool parser plugins are not implemented; --tool-call-parser "
             "takes the built-in parsers' names", "FILE"),
    _refused("--logits-processor-pattern", "custom logits processors are not implemented",
             "PATTERN"),
    _refused("--logits-processors", "custom logits processors are not implemented", "CLS"),
    # the HTTP server
    _refused("--allow-credentials", _CORS),
    _refused("--allowed-origins", _CORS, "JSON"),
    _refused("--allowed-methods", _CORS, "JSON"),
    _refused("--allowed-headers", _CORS, "JSON"),
    _refused("--ssl-keyfile", _TLS, "FILE"),
    _refused("--ssl-certfile", _TLS, "FILE"),
    _refused("--ssl-ca-certs", _TLS, "FILE"),
    _refused("--ssl-cert-reqs", _TLS, "N"),
    _refused("--enable-ssl-refresh", _TLS),
    _refused("--root-path", "serving under a path prefix is not implemented; let the proxy strip "
             "it", "PATH"),
    _refused("--middleware", "ASGI middleware plugins are not implemented", "CLS"),
    _refused("--enable-request-id-headers", "X-Request-Id response headers are not implemented"),
    _refused("--disable-fastapi-docs", "/docs and /openapi.json are always served"),
    _refused("--enable-server-load-tracking", "server load tracking is not implemented"),
    _refused("--otlp-traces-endpoint", "OpenTelemetry tracing is not implemented; metrics are on "
             "/metrics", "URL"),
    _refused("--collect-detailed-traces", "OpenTelemetry tracing is not implemented", "MODULES"),
    _by_value("--response-role", "ROLE", ("assistant",), "replies carry the role assistant",
              "only the role assistant is implemented (--response-role assistant)"),
    _by_value("--chat-template-content-format", "FORMAT", ("auto", "string", "openai"),
              "message content is given to the template as a string (text parts joined)",
              "give auto, string or openai"),
    _noop("--disable-frontend-multiprocessing", "the server and the engine share one process "
          "(the engine on its own thread)"),
    _noop("--enable-prompt-tokens-details", "usage.prompt_tokens_details is not reported"),
)

class _VllmFlagAction(argparse.Action):
    """Records a no-op flag in namespace.vllm_noops (logged at start-up); a refused one is a
    usage error naming the flag, why, and what to use instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        flag: VllmFlag = self.const
        value = None if values is None or values == [] else str(values)
        handling, reason = flag.handling(value)
        given = flag.name if value is None else f"{flag.name} {value}"
        if handling == "refused":
            parser.error(f"{given}: {reason}")
        notes = dict(getattr(namespace, "vllm_noops", None) or {})
        notes[flag.name] = f"{given}: accepted for vLLM's command lines and ignored: {reason}"
        namespace.vllm_noops = notes


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags from VLLM_FLAGS (not shown in --help: they do nothing here, or are refused)."""
    for flag in VLLM_FLAGS:
        nargs = 0 if flag.value is None else None
        parser.add_argument(flag.name, action=_VllmFlagAction, nargs=nargs, const=flag, default=None,
                            metavar=flag.value, dest="vllm_flag_" + flag.name.strip("-"),
                            help=argparse.SUPPRESS)
    parser.set_defaults(vllm_noops=None)


def noop_notes(args: argparse.Namespace) -> list[str]:
    """One log line per no-op vLLM flag the command line gave, saying why it changes nothing."""
    return list((getattr(args, "vllm_noops", None) or {}).values())


def check_vllm_combinations(args: argparse.Namespace) -> None:
    """vLLM's refusals of flag combinations: StartupError (one line), before anything loads."""
    if getattr(args, "enable_auto_tool_choice", False) and getattr(args, "tool_call_parser", None) is None:
        from jaxserve.engine.checks import StartupError
        from jaxserve.parsers.tools import TOOL_PARSERS
        raise StartupError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))}), "
                           "as in vLLM: the server must know how to read the model's tool calls")
