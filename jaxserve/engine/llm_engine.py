"""LLMEngine: input processing -> engine core (schedule -> execute -> update) -> output
processing, one step at a time (jaxserve/engine/*.py each hold one of those roles)."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import jax

from jaxserve.engine import cpu_defaults
from jaxserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import RequestOutput
from jaxserve.core.request import RequestStatus
from jaxserve.worker.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.spec_decode import drafting
from jaxserve.spec_decode import metrics as spec_metrics
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.manager import StructuredOutputManager
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served (HTTP 503)."""


def enable_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache (step programs, Pallas kernels included), so a
    restart skips most of warm-up. JAX_COMPILATION_CACHE_DIR, if set, wins."""
    from jaxserve.models.loaders.default_model import cache_dir

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir",
                          os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_dir(), "xla"))


def fused_kernel_names(option: str | tuple | list) -> tuple[str, ...] | None:
    """The names an option gives ("linear,rope" or a sequence; "none": no names), None for
    "auto"; a ValueError names the allowed values."""
    from jaxserve.models import llama
    if isinstance(option, str):
        if option == "auto":
            return None
        option = () if option in ("none", "") else tuple(n.strip() for n in option.split(","))
    names = tuple(option)
    bad = sorted(set(names) - set(llama.FUSABLE))
    if bad:
        raise ValueError(f"fused_kernels must be 'auto', 'none' or names from "
                         f"{', '.join(llama.FUSABLE)}; got {', '.join(bad)}")
    return names


def resolve_fused_kernels(option: str | tuple | list, cfg, num_devices: int) -> tuple[str, ...]:
    """EngineConfig.fused_kernels from the option: "auto" is the model family's choice on one
    GPU (models/llama.py auto_fused_kernels), else the names given."""
    from jaxserve.models import llama, registry
    names = fused_kernel_names(option)
    if names is None:
        if jax.default_backend() != "gpu" or num_devices != 1:
            return ()
        return llama.auto_fused_kernels(cfg, registry.get_family(cfg.architecture).name == "llama")
    if "linear" in names and num_devices != 1:
        # (its kernels and [out, in] weights are unsharded; a mesh keeps the unfused weights)
        raise ValueError(f"fused_kernels 'linear' runs on one device; got {num_devices} "
                         f"(tensor x expert parallel): leave it out or use 'auto'")
    return names


# Multi-step decode where it was measured to pay: a model the fused stack covers (small dense
# ones and the llama family's MoE, one GPU) is bound by the host's launch of each step at
# small batch (BENCHMARKS.md, issue 33, H100: the default model 2.3 -> 0.58 ms/token at 8
# steps; an 8-layer Qwen3-30B-A3B cut 1.4-1.8 -> 0.73, batch 16 the same either way);
# elsewhere the device bounds a step, and more steps a launch would only delay new requests.
AUTO_SCHEDULER_STEPS = 8


def resolve_scheduler_steps(value: int | None, fused_kernels: tuple[str, ...], speculative) -> int:
    """SchedulerConfig.num_scheduler_steps from the option: None is AUTO_SCHEDULER_STEPS with
    the fused stack ("linear") and no speculation, else 1."""
    if value is not None:
        return value
    return AUTO_SCHEDULER_STEPS if "linear" in fused_kernels and speculative is None else 1


def _default(value, gpu, cpu):
    if value is not None:
        return value
    return gpu if jax.default_backend() == "gpu" else cpu


class LLMEngine:
    def __init__(self, config: EngineConfig, params, tokenizer: Tokenizer | None, model_module,
                 model_name: str = "default", mesh=None, device=None):
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        t0 = time.perf_counter()
        self.runner = ModelRunner(config, params, model_module, mesh=mesh, device=device)
        # Where start-up went, in seconds (from_engine_args adds "load"): a bench reports it.
        self.startup_seconds = {"runner_init": time.perf_counter() - t0}
        proposer = drafting.make_proposer(config.speculative, config, self.runner)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks,
                                   step_sizes=tuple(self.runner.buckets),
                                   cache_specs=self.runner.cache_specs,
                                   num_slots=self.runner.num_slots,
                                   num_cached_states=self.runner.num_cached_states,
                                   state_snapshots=self.runner.num_state_snapshots > 0,
                                   num_lookahead_tokens=getattr(proposer, "num_lookahead_tokens", 0))
        eos = tokenizer.eos_token_ids if tokenizer else config.model.eos_token_ids
        # Structured output needs the vocabulary as text: only a model with a tokenizer has it.
        self.grammars = GrammarCompiler(tokenizer.hf, config.model.vocab_size, eos) if tokenizer else None
        structured = (StructuredOutputManager(self.grammars, self.runner.last_sampled)
                      if self.grammars is not None else None)
        self.runner.use_grammar_masks(structured is not None)
        self.core = EngineCore(self.scheduler, self.runner, proposer, structured)
        self.metrics = EngineMetrics()
        self.inputs = InputProcessor(config, tuple(eos), self.runner.num_blocks, self.grammars)
        self.outputs = OutputProcessor(tokenizer, self.metrics)
        self.step_listeners: list = []      # callables(core.StepOutcome)
        self.num_steps = 0
        if config.warmup_all and not config.warmup:
            logger.warning("warmup_all has no effect without warmup: programs compile on first use")
        if config.warmup:
            t0 = time.perf_counter()
            logger.info("compiling the step programs of %d step sizes", len(self.runner.buckets))
            self.runner.warmup()
            if hasattr(proposer, "warmup"):   # its programs compile in the background
                proposer.warmup()
            if config.warmup_all:   # a failed compile is retried on first use (runner.run)
                self.wait_for_warmup(raise_errors=False)
            self.startup_seconds["warmup"] = time.perf_counter() - t0
            logger.info("warm-up took %.1f s", self.startup_seconds["warmup"])
        self._update_gauges()

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        """Wait until every program warm-up started (the runner's and the proposer's) is
        compiled."""
        self.runner.wait_for_warmup(raise_errors)
        if hasattr(self.core.proposer, "wait_for_warmup"):
            self.core.proposer.wait_for_warmup(raise_errors)

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, dtype: str | None = None,
                         load_format: str = "auto", served_model_name: str | None = None,
                         block_size: int = 16, num_kv_blocks: int | None = None,
                         kv_cache_memory_fraction: float = 0.9,
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
                         data_parallel_size: int = 1, devices: list | None = None) -> "LLMEngine":
        """The engine for these options. data_parallel_size > 1: a DataParallelEngine of that
        many (engine/data_parallel.py). devices: the ones this engine runs on (default: the
        first tensor_parallel_size * expert_parallel_size)."""
        # every option but these, as given (first: before this function has locals of its own)
        options = {k: v for k, v in locals().items()
                   if k not in ("cls", "model", "data_parallel_size", "devices")}
        if data_parallel_size > 1:
            from jaxserve.engine.data_parallel import DataParallelEngine
            return DataParallelEngine.from_engine_args(model, data_parallel_size=data_parallel_size,
                                                       **options)
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1; got {data_parallel_size}")
        device, place = None, contextlib.nullcontext()
        if devices is not None and tensor_parallel_size * expert_parallel_size == 1:
            # One device, maybe not the default one: all this engine makes lands there
            device = devices[0]
            place = jax.default_device(device)
        with place:
            return cls._build(model, devices=devices, device=device, **options)

    @classmethod
    def _build(cls, model, *, dtype, load_format, served_model_name, block_size, num_kv_blocks,
               kv_cache_memory_fraction, kv_cache_cpu_bytes, enable_prefix_caching,
               num_cached_states, max_num_seqs, max_num_batched_tokens, max_model_len,
               max_waiting_requests, long_prefill_token_threshold, num_scheduler_steps,
               tensor_parallel_size,
               expert_parallel_size, seed, max_logprobs, attention_impl, fused_kernels, warmup,
               warmup_all, program_cache, speculative_config, quantization, devices, device) -> "LLMEngine":
        from jaxserve.models.loaders import default_model
        from jaxserve.engine import distributed
        from jaxserve.models import loader, registry

        from jaxserve.spec_decode.config import SpeculativeConfig

        cluster = distributed.current()     # several hosts: jaxserve/distributed.py
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
                                                   mesh=mesh, seed=seed, quantization=quantization)
        load_s = time.perf_counter() - t0
        max_model_len = max_model_len or min(cfg.max_position_embeddings, _default(None, 8192, cpu_defaults.MAX_MODEL_LEN))
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}); got {max_model_len}")
        max_num_seqs = _default(max_num_seqs, 256, cpu_defaults.MAX_NUM_SEQS)
        max_num_batched_tokens = _default(max_num_batched_tokens, 2048, cpu_defaults.MAX_NUM_BATCHED_TOKENS)
        fused = resolve_fused_kernels(fused_kernels, cfg, tensor_parallel_size * expert_parallel_size)
        config = EngineConfig(
            model=cfg,
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory_fraction=kv_cache_memory_fraction,
                              kv_cache_cpu_bytes=kv_cache_cpu_bytes,
                              enable_prefix_caching=enable_prefix_caching,
                              num_cached_states=num_cached_states),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
                                      max_model_len=max_model_len,
                                      max_waiting_requests=max_waiting_requests,
                                      long_prefill_token_threshold=long_prefill_token_threshold,
                                      num_scheduler_steps=resolve_scheduler_steps(
                                          num_scheduler_steps, fused, speculative)),
            parallel=parallel,
            dtype=dtype, seed=seed, max_logprobs=max_logprobs, attention_impl=attention_impl,
            fused_kernels=fused,
            warmup=warmup, warmup_all=warmup_all, speculative=speculative,
            # NOTE: off unless asked (the CLI does): a program is keyed on the package's
            # sources, so code changed in memory (a notebook's monkeypatch) would not be seen
            program_cache_dir=os.path.join(default_model.cache_dir(), "steps") if program_cache
            else None)
        name = served_model_name or (default_model.DEFAULT_MODEL_NAME if model is None else model)
        engine = cls(config, params, tokenizer, registry.get_family(cfg.architecture), name, mesh=mesh,
                     device=device)
        engine.startup_seconds["load"] = load_s
        if cluster is not None and not cluster.config.is_worker:
            distributed.connect_workers(cluster, engine.runner)
        return engine

    # -- requests ------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field and the limit) for a request that cannot run."""
        self.inputs.validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self.outputs.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = self.inputs.process(request_id, prompt_token_ids, params,
                                       arrival_time or time.monotonic())
        taken = [c.request_id for c in children if c.request_id in self.outputs.samples
                 or c.request_id in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id {request_id!r} collides with a running request ({taken[0]!r})")
        self.outputs.add(children, prompt)
        for child in children:
            self.core.add(child)
        self.metrics.inc("prompt_tokens", len(prompt_token_ids))
        self._update_gauges()

    def abort_request(self, request_id: str) -> bool:
        children = self.outputs.remove(request_id)
        if children is None:
            return False
        self.core.finish(children, RequestStatus.FINISHED_ABORTED)
        self.metrics.inc("request_abort")
        self._update_gauges()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Finish one step and return the outputs of the requests it advanced (pipelined:
        see engine/core.py)."""
        outcome = self.core.step()
        outputs = self._take_failed()
        if outcome is None:
            self._update_gauges()
            return outputs
        self.num_steps += 1
        if self.core.proposer is not None:
            spec_metrics.record(self.metrics, outcome.scheduled, outcome.result)
        step_outputs = self.outputs.process(outcome.updates, outcome.result)
        self._finish_ended()
        for listener in self.step_listeners:
            listener(outcome)
        self._update_gauges()
        return step_outputs + outputs

    def _take_failed(self) -> list[RequestOutput]:
        """Outputs of requests failed while a step was being built: handed out exactly once."""
        failed, self.core.failed = self.core.failed, []
        outputs, now = [], time.monotonic()
        for rid, message in failed:
            entry = self.outputs.samples.get(rid)
            if entry is not None:
                self.outputs.fail(entry[0].request_id, message)
                outputs.append(self.outputs.finish_if_done(entry[0], now))
        self._finish_ended()
        return outputs

    def _finish_ended(self) -> None:
        ended, self.outputs.ended = self.outputs.ended, []
        self.core.finish(ended, RequestStatus.FINISHED_STOPPED)

    # -- metrics -------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        s, pool = self.scheduler, self.scheduler.pool
        m = self.metrics
        m.set("num_requests_running", len(s.running))
        m.set("num_requests_waiting", len(s.waiting))
        m.set("kv_cache_usage_perc", pool.usage)
        m.set("num_used_blocks", pool.num_used)
        m.set("num_free_blocks", pool.num_free)
        for name, value in (("prefix_cache_queries", s.prefix_queries), ("prefix_cache_hits", s.prefix_hits),
                            ("num_preemptions", s.num_preemptions),
                            ("num_state_rollbacks", s.num_state_rollbacks)):
            m.inc(name, value - m.counters[name]._value.get())

    def get_metrics(self) -> dict[str, float]:
        return self.metrics.as_dict()


