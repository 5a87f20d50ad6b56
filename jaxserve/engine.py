"""LLMEngine (the step loop) and AsyncEngine (an engine thread + per-request queues).

One step: scheduler.schedule() -> runner.execute() -> scheduler.update() -> detokenize,
stop strings, logprobs -> RequestOutput for every request that advanced. A request with
n > 1 runs as n child requests sharing the prompt (the prefix cache shares its full blocks)
and is reported as one RequestOutput with n CompletionOutputs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import jax

from jaxserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner import ModelRunner, StepResult
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.stop import StopStrings
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served (HTTP 503)."""


@dataclass
class _Sample:
    """Host-side state of one child request: its text, logprobs and stop-string matcher."""
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    stops: StopStrings | None
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        text = self.text
        if self.finish_reason is None and self.stops is not None:
            # Hold back a tail that may yet become a stop string (it would then be cut).
            text = text[:len(text) - self.stops.held_back(text)]
        return CompletionOutput(index=self.index, text=text,
                                token_ids=list(self.request.output_token_ids),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=list(self.logprobs) if self.logprobs is not None else None,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass
class _Group:
    """One user request: its n samples and timings."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def final_only(self) -> bool:
        return self.samples[0].request.sampling_params.output_kind == "final_only"

    @property
    def child_ids(self) -> list[str]:
        return [s.request.request_id for s in self.samples]

    def output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[s.output() for s in self.samples], finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics,
                             prompt_logprobs=self.prompt_logprobs,
                             error=self.error)


def enable_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache (step programs, Pallas kernels included), so a
    restart skips most of warm-up. JAX_COMPILATION_CACHE_DIR, if set, wins."""
    from jaxserve.default_model import cache_dir

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir",
                          os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_dir(), "xla"))


def _default(value, gpu, cpu):
    if value is not None:
        return value
    return gpu if jax.default_backend() == "gpu" else cpu


class LLMEngine:
    def __init__(self, config: EngineConfig, params, tokenizer: Tokenizer | None, model_module,
                 model_name: str = "default", mesh=None):
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        t0 = time.perf_counter()
        self.runner = ModelRunner(config, params, model_module, mesh=mesh)
        # Where start-up went, in seconds (from_engine_args adds "load"): a bench reports it.
        self.startup_seconds = {"runner_init": time.perf_counter() - t0}
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks,
                                   step_sizes=tuple(self.runner.buckets))
        self.metrics = EngineMetrics()
        self.groups: dict[str, _Group] = {}
        self.samples: dict[str, tuple[_Group, _Sample]] = {}   # child request id -> its state
        self._rng = random.Random(config.seed)
        self.step_listeners: list = []      # callables(SchedulerOutput, StepResult, seconds)
        self._inflight = None               # the dispatched step whose tokens are not read yet
        self._failed_outputs: list[RequestOutput] = []   # failed while building a step
        self.num_steps = 0
        if config.warmup_all and not config.warmup:
            logger.warning("warmup_all has no effect without warmup: programs compile on first use")
        if config.warmup:
            t0 = time.perf_counter()
            self.runner.warmup()
            if config.warmup_all:   # a failed compile is retried on first use (runner.run)
                self.runner.wait_for_warmup(raise_errors=False)
            self.startup_seconds["warmup"] = time.perf_counter() - t0
            logger.info("warm-up took %.1f s", self.startup_seconds["warmup"])
        self._update_gauges()

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, dtype: str | None = None,
                         load_format: str = "auto", served_model_name: str | None = None,
                         block_size: int = 16, num_kv_blocks: int | None = None,
                         kv_cache_memory_fraction: float = 0.9, kv_cache_cpu_bytes: int = 1 << 30,
                         enable_prefix_caching: bool = True, max_num_seqs: int | None = None,
                         max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                         max_waiting_requests: int = 4096, long_prefill_token_threshold: int = 0,
                         tensor_parallel_size: int = 1,
                         expert_parallel_size: int = 1, seed: int = 0, max_logprobs: int = 20,
                         attention_impl: str = "auto", warmup: bool = True,
                         warmup_all: bool = False, program_cache: bool = False) -> "LLMEngine":
        from jaxserve import default_model
        from jaxserve.models import loader, registry

        enable_compilation_cache()
        dtype = _default(dtype, "bfloat16", "float32")
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                  expert_parallel_size=expert_parallel_size)
        mesh = None
        if tensor_parallel_size * expert_parallel_size > 1:
            from jaxserve.sharding.mesh import mesh_from_parallel_config
            mesh = mesh_from_parallel_config(parallel)
        t0 = time.perf_counter()
        cfg, params, tokenizer = loader.load_model(model, load_format=load_format, dtype=dtype,
                                                   mesh=mesh, seed=seed)
        load_s = time.perf_counter() - t0
        max_model_len = max_model_len or min(cfg.max_position_embeddings, _default(None, 8192, 2048))
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}); got {max_model_len}")
        max_num_seqs = _default(max_num_seqs, 256, 16)
        max_num_batched_tokens = _default(max_num_batched_tokens, 2048, 256)
        config = EngineConfig(
            model=cfg,
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory_fraction=kv_cache_memory_fraction,
                              kv_cache_cpu_bytes=kv_cache_cpu_bytes,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
                                      max_model_len=max_model_len,
                                      max_waiting_requests=max_waiting_requests,
                                      long_prefill_token_threshold=long_prefill_token_threshold),
            parallel=parallel,
            dtype=dtype, seed=seed, max_logprobs=max_logprobs, attention_impl=attention_impl,
            warmup=warmup, warmup_all=warmup_all,
            # NOTE: off unless asked (the CLI does): a program is keyed on the package's
            # sources, so code changed in memory (a notebook's monkeypatch) would not be seen
            program_cache_dir=os.path.join(default_model.cache_dir(), "steps") if program_cache
            else None)
        name = served_model_name or (default_model.DEFAULT_MODEL_NAME if model is None else model)
        engine = cls(config, params, tokenizer, registry.get_model_module(cfg.architecture), name, mesh=mesh)
        engine.startup_seconds["load"] = load_s
        return engine

    # -- requests ------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field and the limit) for a request that cannot run."""
        limit = self.config.scheduler.max_model_len
        vocab = self.config.model.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}]")
        if len(prompt_token_ids) >= limit:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens; this model's max_model_len is "
                             f"{limit}, so the prompt must be at most {limit - 1} tokens")
        params.validate(max_logprobs=self.config.max_logprobs, vocab_size=vocab)
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens is {params.max_tokens} but the prompt is {len(prompt_token_ids)} "
                             f"tokens and max_model_len is {limit}: max_tokens must be at most "
                             f"{limit - len(prompt_token_ids)}")
        longest = min(limit, len(prompt_token_ids) + (params.max_tokens or limit))
        blocks = -(-longest // self.config.cache.block_size)
        if blocks > self.runner.num_blocks - 1:
            raise ValueError(f"the request needs up to {blocks} KV blocks but the cache holds "
                             f"{self.runner.num_blocks - 1}; lower max_tokens or raise num_kv_blocks")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        arrival = arrival_time or time.monotonic()
        group = _Group(request_id, prompt, list(prompt_token_ids), [], RequestMetrics(arrival),
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [c for c in child_ids if c in self.samples or c in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id {request_id!r} collides with a running request ({taken[0]!r})")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else self.config.model.eos_token_ids
        for i in range(params.n):
            child_id = child_ids[i]
            req = Request(child_id, list(prompt_token_ids), params, arrival_time=arrival,
                          eos_token_ids=tuple(eos), seed=base_seed + i)
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                     if self.tokenizer else None)
            stops = StopStrings.of(params.stop, params.include_stop_str_in_output) if params.stop else None
            sample = _Sample(i, req, detok, stops, logprobs=[] if params.logprobs is not None else None,
                             cumulative_logprob=0.0 if params.logprobs is not None else None)
            group.samples.append(sample)
            self.samples[child_id] = (group, sample)
        self.groups[request_id] = group
        for s in group.samples:
            self.scheduler.add_request(s.request)
        self.metrics.inc("prompt_tokens", len(prompt_token_ids))
        self._update_gauges()

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for child in group.child_ids:
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            self.samples.pop(child, None)
        self.metrics.inc("request_abort")
        self._update_gauges()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._failed_outputs)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Finish one step and return the outputs of the requests it advanced.

        Pipelined: before waiting for step N's tokens, step N+1 is scheduled and dispatched,
        taking N's sampled tokens straight from the device; N's tokens are then read and
        applied one step late. Requests that finish at N waste one token of N+1. Requests
        with penalties need their full token history on the host, so while one runs the
        engine waits for each step before scheduling the next."""
        if self._inflight is None:
            out = self.scheduler.schedule()
            if out.chunks:
                self._inflight = self._dispatch(out)
            if self._inflight is None:
                self._update_gauges()
                return self._take_failed()
        current, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        if not any(r.sampling_params.uses_penalties for r in self.scheduler.running):
            upcoming = self.scheduler.schedule()
            if upcoming.chunks:
                self._inflight = self._dispatch(upcoming)
        out = current.out
        result = self.runner.collect(current)
        now = time.monotonic()
        self.num_steps += 1
        updates = self.scheduler.update(out, result.token_ids)
        touched: dict[str, _Group] = {}
        row_of = {ch.request.request_id: i for i, ch in enumerate(out.chunks)}
        for up in updates:
            entry = self.samples.get(up.request.request_id)
            if entry is None or entry[1].request is not up.request:   # a reused id: not this one
                continue
            group, sample = entry
            group.num_cached_tokens = max(group.num_cached_tokens, up.request.num_cached_tokens)
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            row = row_of[sample.request.request_id]
            if result.prompt_logprobs and row in result.prompt_logprobs and sample.index == 0:
                self._append_prompt_logprobs(group, result.prompt_logprobs[row])
            if up.new_token_ids:
                try:
                    self._process_tokens(group, sample, up.new_token_ids, result, row, now)
                except Exception as e:  # a failure in one request's handling fails it alone
                    logger.exception("request %s failed", group.request_id)
                    self._fail(group, sample, f"{type(e).__name__}: {e}")
            touched[group.request_id] = group
        outputs = [self._finish_if_done(g, now) for g in touched.values()
                   if g.finished or not g.final_only]
        for listener in self.step_listeners:
            listener(out, result, time.perf_counter() - t0)
        self._update_gauges()
        return outputs + self._take_failed()

    def _take_failed(self) -> list[RequestOutput]:
        """Outputs of requests failed while a step was being built: handed out exactly once."""
        failed, self._failed_outputs = self._failed_outputs, []
        return failed

    def _dispatch(self, out: SchedulerOutput):
        """Launch a step. If its inputs cannot be built, the requests at fault fail alone (their
        outputs come with the next step() call) and the step is taken back; a failure no single
        request explains propagates (the engine stops)."""
        try:
            return self.runner.dispatch(out)
        except Exception as e:
            bad = self.runner.failing_chunks(out)
            if not bad:
                raise
            logger.exception("could not build a step's inputs; failing %d request(s)", len(bad))
            self.scheduler.unschedule(out)
            now = time.monotonic()
            for i in bad:
                entry = self.samples.get(out.chunks[i].request.request_id)
                if entry is not None and entry[0].request_id in self.groups:
                    self._fail(entry[0], entry[1], f"{type(e).__name__}: {e}")
                    self._failed_outputs.append(self._finish_if_done(entry[0], now))
            return None

    def _process_tokens(self, group: _Group, sample: _Sample, new_ids: list[int], result: StepResult,
                        row: int, now: float) -> None:
        req = sample.request
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.metrics.observe("time_to_first_token_seconds", now - m.arrival_time)
        elif m.last_token_time is not None:
            self.metrics.observe("inter_token_latency_seconds", now - m.last_token_time)
        m.last_token_time = now
        self.metrics.inc("generation_tokens", len(new_ids))
        if sample.logprobs is not None and result.logprobs is not None:
            self._append_logprobs(sample, new_ids[-1], result, row)
        delta = sample.detokenizer.add(new_ids) if sample.detokenizer is not None else ""
        sample.text += delta
        if sample.stops is not None and delta:
            match = sample.stops.find(sample.text, len(delta))
            if match is not None:
                sample.text, sample.stop_reason = match.text, match.stop
                if req.is_finished:      # max_tokens reached on this very token: the stop wins
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished and sample.finish_reason is None:
            sample.finish_reason = req.status.finish_reason
            if sample.stop_reason is None:
                sample.stop_reason = req.stop_reason

    def _append_logprobs(self, sample: _Sample, token: int, result: StepResult, row: int) -> None:
        k = sample.request.sampling_params.logprobs
        chosen = float(result.logprobs[row])
        top_ids = result.top_ids[row][:k].tolist()
        top_lps = result.top_logprobs[row][:k].tolist()
        entry: dict[int, Logprob] = {}
        decode = self._decode_one
        entry[token] = Logprob(chosen, int(result.ranks[row]), decode(token))
        for i, (t, lp) in enumerate(zip(top_ids, top_lps)):
            if t not in entry:
                entry[t] = Logprob(float(lp), i + 1, decode(t))
        sample.logprobs.append(entry)
        sample.cumulative_logprob += chosen

    def _append_prompt_logprobs(self, group: _Group, chunk: tuple) -> None:
        """Record logprobs of prompt tokens 1.. from a chunk's positions (each once, even if a
        preempted request recomputes them)."""
        start, chosen, top_ids, top_lps = chunk
        k = group.samples[0].request.sampling_params.prompt_logprobs
        prompt = group.prompt_token_ids
        for j in range(len(chosen)):
            target = start + j + 1                      # the prompt token these logits predict
            if target < len(group.prompt_logprobs):
                continue
            token = prompt[target]
            entry = {token: Logprob(float(chosen[j]), None, self._decode_one(token))}
            for r, (t, lp) in enumerate(zip(top_ids[j][:k].tolist(), top_lps[j][:k].tolist())):
                if t == token:
                    entry[token] = Logprob(float(chosen[j]), r + 1, entry[token].decoded_token)
                else:
                    entry.setdefault(t, Logprob(float(lp), r + 1, self._decode_one(t)))
            group.prompt_logprobs.append(entry)

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None

    def _fail(self, group: _Group, sample: _Sample, message: str) -> None:
        """Fail the whole user request (all its samples); the rest of the batch runs on."""
        for s in group.samples:
            self.scheduler.finish_request(s.request.request_id, RequestStatus.FINISHED_ERROR)
            s.finish_reason = s.finish_reason or "error"
        group.error = message

    def _finish_if_done(self, group: _Group, now: float) -> RequestOutput:
        out = group.output()
        if out.finished:
            group.metrics.finished_time = now
            self.metrics.observe("e2e_request_latency_seconds", now - group.metrics.arrival_time)
            self.metrics.inc("request_failure" if group.error else "request_success")
            self.groups.pop(group.request_id, None)
            for child in group.child_ids:
                self.samples.pop(child, None)
                # A sample finished by a stop string was already freed; make sure all are.
                self.scheduler.finish_request(child, RequestStatus.FINISHED_STOPPED)
        return out

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
                            ("num_preemptions", s.num_preemptions)):
            m.inc(name, value - m.counters[name]._value.get())

    def get_metrics(self) -> dict[str, float]:
        return self.metrics.as_dict()


class AsyncEngine:
    """Runs an LLMEngine on its own thread; coroutines submit requests and await outputs.

    The engine thread is the only one touching the engine (and the device). Requests and
    aborts reach it through a command queue; outputs come back through one asyncio.Queue per
    request, filled with `call_soon_threadsafe`, so the event loop never blocks.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs) -> "AsyncEngine":
        return cls(LLMEngine.from_engine_args(model, **kwargs))

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def get_metrics(self) -> dict[str, float]:
        return self.engine.get_metrics()

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, prompt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        if not self.is_healthy:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        limit = self.config.scheduler.max_num_seqs + self.config.scheduler.max_waiting_requests
        if len(self._streams) >= limit:
            raise EngineOverloadedError(f"too many requests in flight ({limit}); retry later")
        self.engine.validate_request(prompt_token_ids, sampling_params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if self._stopping or self.dead_error is not None:
            # The loop may already have told every stream it knew about: don't wait on it.
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        self._commands.put(("add", request_id, list(prompt_token_ids), sampling_params, prompt,
                            time.monotonic()))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                while not q.empty() and not isinstance(item, BaseException) and not item.finished:
                    item = q.get_nowait()      # outputs are cumulative: only the newest matters
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:      # the loop is closed: the consumer is gone
                pass

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, prompt, arrival = cmd
                if rid not in self._streams:          # cancelled before it reached us
                    continue
                try:
                    self.engine.add_request(rid, ids, params, prompt=prompt, arrival_time=arrival)
                except Exception as e:
                    self._deliver(rid, e if isinstance(e, ValueError) else RuntimeError(str(e)))
            else:
                self.engine.abort_request(cmd[1])

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
            except Exception as e:  # the step itself failed: nothing can be trusted any more
                logger.exception("engine step failed; failing all in-flight requests")
                self.dead_error = e
                for rid in list(self._streams):
                    self._deliver(rid, EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
                return
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError("the engine is shutting down"))
