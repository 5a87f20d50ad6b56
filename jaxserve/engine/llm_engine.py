"""LLMEngine: input processing -> engine core (schedule -> execute -> update) -> output
processing, one step at a time (jaxserve/engine/*.py each hold one of those roles). Its parts
(runner, scheduler, proposer) are assembled by engine/builder.py, which also builds an engine
from the command line's options."""

from __future__ import annotations

import logging
import os
import time

import jax

from jaxserve.config import EngineConfig
from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.core import EngineCore
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.lora.request import LoRARequest
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.startup_report import startup_lines
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode import metrics as spec_metrics
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.manager import StructuredOutputManager
from jaxserve.tokenizer import Tokenizer
from jaxserve.worker.rehearsal import rehearse
from jaxserve.worker.runner import ModelRunner

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 10.0     # a long wait (warm-up, a CPU request) shows a line this often


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



class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, runner: ModelRunner,
                 scheduler: Scheduler, proposer: Proposer | None = None, model_name: str = "default",
                 startup_seconds: dict[str, float] | None = None):
        """The engine over parts engine/builder.py assembled (build_engine: from loaded
        weights; from_engine_args: from the options). startup_seconds: where start-up went so
        far (warm-up is added here): a bench reports it."""
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.runner = runner
        self.startup_seconds = dict(startup_seconds or {})
        self.scheduler = scheduler
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
            if proposer is not None:   # its programs compile in the background
                proposer.warmup()
            if config.warmup_all:   # a failed compile is retried on first use (runner.run)
                logger.info("waiting for the programs compiling in the background (logprobs, "
                            "sampling extras, grammar masks, speculation): nothing compiles "
                            "once this engine is ready (--no-warmup-all: ready sooner, and "
                            "the first request needing one waits for it)")
                self.runner.wait_for_warmup(raise_errors=False, log_every=PROGRESS_EVERY_S)
                self.wait_for_warmup(raise_errors=False)
                # and each bucket's plain program run once, so the first request is as fast
                # as later ones (worker/rehearsal.py)
                ran, seconds = rehearse(self.runner)
                logger.info("ran %d step programs once in %.2f s (the first request's costs)", ran, seconds)
            self.startup_seconds["warmup"] = time.perf_counter() - t0
            logger.info("warm-up took %.1f s", self.startup_seconds["warmup"])
        logger.info("%s", "\n  ".join(["engine built:"] + startup_lines(
            config, self.runner.num_blocks, self.runner.block_size, self.runner.bytes_per_block,
            on_cpu=jax.default_backend() == "cpu", memory=self.runner.memory,
            window=(self.runner.num_window_blocks, self.runner.bytes_per_window_block))))
        self._update_gauges()

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        """Wait until every program warm-up started (the runner's and the proposer's) is
        compiled."""
        self.runner.wait_for_warmup(raise_errors)
        if self.core.proposer is not None:
            self.core.proposer.wait_for_warmup(raise_errors)

    # -- requests ------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field and the limit) for a request that cannot run."""
        self.inputs.validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        if request_id in self.outputs.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = self.inputs.process(request_id, prompt_token_ids, params,
                                       arrival_time or time.monotonic(), lora_request)
        if lora_request is not None:     # read (and so checked) now, not in a step
            self.add_lora(lora_request)
        taken = [c.request_id for c in children if c.request_id in self.outputs.samples
                 or c.request_id in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id {request_id!r} collides with a running request ({taken[0]!r})")
        self.outputs.add(children, prompt)
        for child in children:
            self.core.add(child)
        self.metrics.inc("prompt_tokens", len(prompt_token_ids))
        self._update_gauges()

    def add_lora(self, lora: LoRARequest) -> None:
        """Know an adapter, its weights read and checked now (ValueError if it cannot be
        served); requests then name it by its LoRARequest."""
        if self.runner.lora_store is None:
            raise ValueError(f"adapter {lora.lora_name!r}: this engine serves no adapters; start "
                             "it with enable_lora=True (--enable-lora)")
        self.runner.lora_store.check(lora)

    def remove_lora(self, int_id: int) -> None:
        """Drop an adapter's host copy (requests still running on it finish with it)."""
        if self.runner.lora_store is not None:
            self.runner.lora_store.unregister(int_id)

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


