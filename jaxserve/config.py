"""Engine configuration: frozen dataclasses, validated once when built, never mutated.

`ModelConfig` describes the network (built from a HF config.json dict or GGUF metadata);
the others describe how the engine runs it. `EngineConfig` bundles them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxserve.pallas_kernels.policy import KernelPlan


def _check(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                    # HF `architectures[0]`, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int                     # D
    intermediate_size: int               # F (dense MLP)
    num_layers: int
    num_heads: int                       # H (query heads)
    num_kv_heads: int                    # K
    head_dim: int                        # E
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None   # HF rope_scaling as sorted items
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # Qwen2: bias on q/k/v projections
    qk_norm: bool = False                # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None = None    # Mistral: attend to at most this many past tokens
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts == 0 means a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"        # router scores: "softmax" (Mixtral, Qwen3) or "sigmoid"
    routed_scaling_factor: float = 1.0   # multiplies the chosen experts' weights
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _check(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        _check(self.num_heads % self.num_kv_heads == 0, "num_heads", "a multiple of num_kv_heads",
               (self.num_heads, self.num_kv_heads))
        _check(self.scoring_func in ("softmax", "sigmoid"), "scoring_func",
               "one of softmax, sigmoid", self.scoring_func)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a HF config.json dict (any supported architecture)."""
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers >= 5 writes `rope_parameters` (theta and scaling together) instead.
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta = hf.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        rs = hf.get("rope_scaling") or rope_params or None
        if rs and rs.get("rope_type", rs.get("type")) == "default":
            rs = None
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0),
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted(rs.items())) if rs else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=sliding if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None,
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or hf.get("intermediate_size", 0),
            norm_topk_prob=hf.get("norm_topk_prob", arch == "MixtralForCausalLM"),
            scoring_func=hf.get("scoring_func", "softmax"),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16                 # P: tokens per KV block
    num_kv_blocks: int | None = None     # explicit block count; None = size from memory budget
    # vLLM's meaning: the share of the device's TOTAL memory the engine may use (weights, the
    # step programs' peak and the caches together; worker/memory_plan.py)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None   # the cache's size per device, exactly (vLLM's flag)
    kv_cache_cpu_bytes: int = 1 << 30    # budget on CPU, where free memory is not reported
    enable_prefix_caching: bool = True
    # Hybrid models (linear attention): states saved at block boundaries for prefix hits
    # (kv_cache/state_cache.py); None: max_num_seqs, at most a quarter of the cache budget.
    num_cached_states: int | None = None

    def __post_init__(self):
        _check(self.num_cached_states is None or self.num_cached_states >= 0, "num_cached_states",
               ">= 0", self.num_cached_states)
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
               "a power of two from 1 to 128", self.block_size)
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks", ">= 2",
               self.num_kv_blocks)
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1,
               "kv_cache_memory_bytes", ">= 1", self.kv_cache_memory_bytes)


MAX_SCHEDULER_STEPS = 64


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64               # sequences in one step
    max_num_batched_tokens: int = 512    # token budget of one step
    max_model_len: int = 2048            # prompt + output tokens of one request
    max_waiting_requests: int = 4096     # beyond this, new requests are refused (HTTP 503)
    # Prefill chunks of one request are cut to this many tokens (0: only the step budget cuts
    # them). Smaller chunks keep the steps that carry a prefill close to a decode step's time,
    # which bounds the inter-token latency of the running requests (vLLM's name and meaning).
    long_prefill_token_threshold: int = 0
    # Decode steps a step runs on the device when every running request is decoding and no
    # waiting one could start (vLLM's multi-step scheduling): the host schedules, launches and
    # reads back once per this many tokens. 1: off. See scheduler.py, "Multi-step decode".
    num_scheduler_steps: int = 1

    def __post_init__(self):
        _check(1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS, "num_scheduler_steps",
               f"in [1, {MAX_SCHEDULER_STEPS}]", self.num_scheduler_steps)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting_requests"):
            _check(getattr(self, name) >= 1, name, ">= 1", getattr(self, name))
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", ">= 0",
               self.long_prefill_token_threshold)
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               f">= max_num_seqs ({self.max_num_seqs})", self.max_num_batched_tokens)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (jaxserve/lora/): vLLM's --max-loras, --max-lora-rank, --max-cpu-loras."""
    max_loras: int = 1          # adapters resident on the device at once (distinct in one step)
    max_lora_rank: int = 16     # the largest rank an adapter's module may have
    max_cpu_loras: int | None = None   # adapters kept loaded on the host (None: max_loras)

    def __post_init__(self):
        _check(self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        _check(1 <= self.max_lora_rank <= 512, "max_lora_rank", "in [1, 512]", self.max_lora_rank)
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
               f">= max_loras ({self.max_loras})", self.max_cpu_loras)

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self):
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        _check(self.expert_parallel_size >= 1, "expert_parallel_size", ">= 1", self.expert_parallel_size)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"               # parameter / activation dtype
    seed: int = 0
    max_logprobs: int = 20               # largest `logprobs` / `prompt_logprobs` a request may ask
    attention_impl: str = "auto"         # "auto" | "xla" | "pallas"
    warmup: bool = True                  # compile every bucket at start-up
    warmup_all: bool = False             # ... and wait for the full programs too (else they
                                         # compile in the background)
    program_cache_dir: str | None = None  # keep compiled step programs here across runs
                                         # (compiling.ProgramStore; None: not kept)
    kernel_plan: KernelPlan = KernelPlan()  # the kernels to run (pallas_kernels/policy.py)
    speculative: Any = None              # spec_decode.config.SpeculativeConfig, or None: off
    lora: LoRAConfig | None = None       # multi-LoRA (jaxserve/lora/); None: off

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    def __post_init__(self):
        _check(self.dtype in ("float32", "bfloat16", "float16"), "dtype",
               "one of float32, bfloat16, float16", self.dtype)
        _check(self.attention_impl in ("auto", "xla", "pallas"), "attention_impl",
               "one of auto, xla, pallas", self.attention_impl)
        _check(0 <= self.max_logprobs <= 1024, "max_logprobs", "in [0, 1024]", self.max_logprobs)
        if self.speculative is not None and self.scheduler.num_scheduler_steps > 1:
            raise ValueError("num_scheduler_steps must be 1 with speculative decoding (a "
                             f"verifying step is one step); got {self.scheduler.num_scheduler_steps}")
        if self.lora is not None and self.speculative is not None:
            raise ValueError("enable_lora with speculative decoding is not supported yet: the "
                             "draft would propose without the request's adapter; turn one off")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
