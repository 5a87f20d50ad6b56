"""The engine builder: assembles an engine's parts and hands them to LLMEngine.

`build_engine` takes loaded weights: the proposer first (its static needs: the caches it
keeps on the target's block tables, the hidden states it reads), then the target's runner
built with them, then the proposer bound to a view of the runner (spec_decode/proposer.py),
then the scheduler over the runner's blocks and slots. `from_engine_args` takes the options
(the CLI's, LLM's): it loads the model, builds the mesh, and for data_parallel_size > 1 a
DataParallelEngine of such engines (engine/data_parallel.py); on several hosts rank 0's
engine connects its workers (engine/distributed.py).

It sits above llm_engine, data_parallel and distributed, none of which imports it: LLM,
AsyncEngine and the CLI build engines here.
"""

from __future__ import annotations

import contextlib
import os
import time

import jax

from jaxserve.config import CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, SchedulerConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine import cpu_defaults, distributed
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine.llm_engine import LLMEngine, enable_compilation_cache
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.spec_decode import drafting
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.worker import memory_plan
from jaxserve.worker.runner import ModelRunner
from jaxserve.worker.target_view import TargetNeeds


def build_engine(config: EngineConfig, params, tokenizer, family, model_name: str = "default",
                 mesh=None, device=None) -> LLMEngine:
    """The engine of `config` over loaded weights (`family`: models/interface.py ModelFamily)."""
    proposer = drafting.make_proposer(config.speculative, config, family, params)
    t0 = time.perf_counter()
    runner = ModelRunner(config, params, family, mesh=mesh, device=device,
                         proposer=proposer.target_needs() if proposer is not None else TargetNeeds())
    # Where start-up went, in seconds (from_engine_args adds "load"): a bench reports it.
    startup_seconds = {"runner_init": time.perf_counter() - t0}
    if proposer is not None:
        proposer.bind(runner.target_view())
    scheduler = Scheduler(config.scheduler, config.cache, runner.num_blocks,
                          step_sizes=tuple(runner.buckets), cache_specs=runner.cache_specs,
                          num_slots=runner.num_slots, num_cached_states=runner.num_cached_states,
                          state_snapshots=runner.num_state_snapshots > 0,
                          num_lookahead_tokens=proposer.num_lookahead_tokens if proposer is not None else 0,
                          max_loras=config.lora.max_loras if config.lora is not None else 0,
                          num_window_blocks=runner.num_window_blocks)
    return LLMEngine(config, tokenizer, runner, scheduler, proposer, model_name, startup_seconds)


def from_engine_args(model: str | None = None, *, dtype: str | None = None,
                     load_format: str = "auto", served_model_name: str | None = None,
                     block_size: int = 16, num_kv_blocks: int | None = None,
                     gpu_memory_utilization: float = 0.9,
                     kv_cache_memory_bytes: int | None = None,
                     kv_cache_cpu_bytes: int = cpu_defaults.KV_CACHE_BYTES,
                     enable_prefix_caching: bool = True, num_cached_states: int | None = None,
                     max_num_seqs: int | None = None,
                     max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                     max_waiting_requests: int = 4096, long_prefill_token_threshold: int = 0,
                     num_scheduler_steps: int | None = None,
                     tensor_parallel_size: int = 1,
                     expert_parallel_size: int = 1, seed: int = 0, max_logprobs: int = 20,
                     attention_impl: str = "auto", fused_kernels: str | tuple = "auto",
                     warmup: bool = True,
                     warmup_all: bool = False, program_cache: bool = False,
                     speculative_config: dict | str | None = None, quantization: str | None = None,
                     data_parallel_size: int = 1, devices: list | None = None,
                     tokenizer: str | None = None, enable_lora: bool = False,
                     max_loras: int = 1, max_lora_rank: int = 16,
                     max_cpu_loras: int | None = None) -> LLMEngine | DataParallelEngine:
    """The engine for these options. data_parallel_size > 1: a DataParallelEngine of that
    many (engine/data_parallel.py). devices: the ones this engine runs on (default: the
    first tensor_parallel_size * expert_parallel_size)."""
    # every option but these, as given (first: before this function has locals of its own)
    options = {k: v for k, v in locals().items() if k not in ("model", "data_parallel_size", "devices")}
    # before anything here starts JAX's backend (jax.devices() below, the defaults' backend)
    memory_plan.configure_allocator(gpu_memory_utilization)
    if data_parallel_size > 1:
        return _data_parallel(model, data_parallel_size, options)
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1; got {data_parallel_size}")
    device, place = None, contextlib.nullcontext()
    if devices is not None and tensor_parallel_size * expert_parallel_size == 1:
        # One device, maybe not the default one: all this engine makes lands there
        device = devices[0]
        place = jax.default_device(device)
    with place:
        return _build(model, devices=devices, device=device, **options)


def _data_parallel(model, data_parallel_size: int, options: dict) -> DataParallelEngine:
    """data_parallel_size engines, each on its own group of devices."""
    if distributed.current() is not None:
        raise ValueError("data_parallel_size > 1 with nnodes > 1 is not supported yet")
    if options["speculative_config"]:
        raise ValueError("speculative_config is not supported with data_parallel_size > 1 yet")
    if options["enable_lora"]:
        raise ValueError("enable_lora is not supported with data_parallel_size > 1 yet")
    tp, ep = options["tensor_parallel_size"], options["expert_parallel_size"]
    per, devices = tp * ep, jax.devices()
    if data_parallel_size * per > len(devices):
        raise ValueError(
            f"data_parallel_size * tensor_parallel_size * expert_parallel_size = "
            f"{data_parallel_size} * {tp} * {ep} devices, "
            f"but only {len(devices)} are available")
    return DataParallelEngine([from_engine_args(model, devices=devices[i * per:(i + 1) * per], **options)
                               for i in range(data_parallel_size)])


def _check_lora(cfg, family_name: str, mesh) -> None:
    """What enable_lora serves: dense models of the llama family (Llama, Mistral, Qwen2/3) on
    one device (EngineConfig refuses it with speculative decoding)."""
    if family_name != "llama" or cfg.is_moe:
        raise ValueError(f"enable_lora: LoRA adapters are served for dense llama-family models "
                         f"(Llama, Mistral, Qwen2, Qwen3); {cfg.architecture} is not one")
    if mesh is not None:
        raise ValueError("enable_lora runs on one device; tensor_parallel_size and "
                         "expert_parallel_size must be 1")


def _default(value, gpu, cpu):
    if value is not None:
        return value
    return gpu if jax.default_backend() == "gpu" else cpu


def _build(model, *, dtype, load_format, served_model_name, block_size, num_kv_blocks,
           gpu_memory_utilization, kv_cache_memory_bytes, kv_cache_cpu_bytes, enable_prefix_caching,
           num_cached_states, max_num_seqs, max_num_batched_tokens, max_model_len,
           max_waiting_requests, long_prefill_token_threshold, num_scheduler_steps,
           tensor_parallel_size,
           expert_parallel_size, seed, max_logprobs, attention_impl, fused_kernels, warmup,
           warmup_all, program_cache, speculative_config, quantization, tokenizer, devices,
           device, enable_lora, max_loras, max_lora_rank, max_cpu_loras) -> LLMEngine:
    from jaxserve.models import loader, registry
    from jaxserve.models.loaders import default_model

    cluster = distributed.current()     # several hosts: engine/distributed.py
    distributed.check_engine_args(cluster, tensor_parallel_size, expert_parallel_size,
                                  speculative_config)
    enable_compilation_cache()
    speculative = SpeculativeConfig.from_dict(speculative_config)   # fail before loading
    dtype = _default(dtype, "bfloat16", "float32")
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                              expert_parallel_size=expert_parallel_size)
    mesh = None
    if tensor_parallel_size * expert_parallel_size > 1:
        from jaxserve.sharding.mesh import mesh_from_parallel_config
        mesh = mesh_from_parallel_config(parallel, devices)
    t0 = time.perf_counter()
    cfg, params, tokenizer = loader.load_model(model, load_format=load_format, dtype=dtype,
                                               mesh=mesh, seed=seed, quantization=quantization,
                                               tokenizer=tokenizer)
    load_s = time.perf_counter() - t0
    max_model_len = max_model_len or min(cfg.max_position_embeddings, _default(None, 8192, cpu_defaults.MAX_MODEL_LEN))
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}); got {max_model_len}")
    max_num_seqs = _default(max_num_seqs, 256, cpu_defaults.MAX_NUM_SEQS)
    max_num_batched_tokens = _default(max_num_batched_tokens, 2048, cpu_defaults.MAX_NUM_BATCHED_TOKENS)
    family_name = registry.get_family(cfg.architecture).name
    kernel_plan = KernelPlan.resolve(fused_kernels, cfg, family_name,
                                     tensor_parallel_size * expert_parallel_size)
    lora = None
    if enable_lora:
        lora = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
        _check_lora(cfg, family_name, mesh)
        kernel_plan = kernel_plan.with_lora()
    config = EngineConfig(
        model=cfg,
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                          gpu_memory_utilization=gpu_memory_utilization,
                          kv_cache_memory_bytes=kv_cache_memory_bytes,
                          kv_cache_cpu_bytes=kv_cache_cpu_bytes,
                          enable_prefix_caching=enable_prefix_caching,
                          num_cached_states=num_cached_states),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
                                  max_model_len=max_model_len,
                                  max_waiting_requests=max_waiting_requests,
                                  long_prefill_token_threshold=long_prefill_token_threshold,
                                  num_scheduler_steps=kernel_plan.scheduler_steps(
                                      num_scheduler_steps, speculative)),
        parallel=parallel,
        dtype=dtype, seed=seed, max_logprobs=max_logprobs, attention_impl=attention_impl,
        kernel_plan=kernel_plan,
        warmup=warmup, warmup_all=warmup_all, speculative=speculative, lora=lora,
        # NOTE: off unless asked (the CLI does): a program is keyed on the package's
        # sources, so code changed in memory (a notebook's monkeypatch) would not be seen
        program_cache_dir=os.path.join(default_model.cache_dir(), "steps") if program_cache
        else None)
    name = served_model_name or (default_model.DEFAULT_MODEL_NAME if model is None else model)
    engine = build_engine(config, params, tokenizer, registry.get_family(cfg.architecture), name,
                          mesh=mesh, device=device)
    engine.startup_seconds["load"] = load_s
    if cluster is not None and not cluster.config.is_worker:
        distributed.connect_workers(cluster, engine.runner)
    return engine
