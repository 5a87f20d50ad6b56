"""AsyncEngine: an LLMEngine on its own thread, requests in through typed commands, outputs out
through one asyncio.Queue per request."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from jaxserve.config import EngineConfig
from jaxserve.engine import builder
from jaxserve.engine.llm_engine import EngineDeadError, EngineOverloadedError, LLMEngine
from jaxserve.engine.stats_log import LOG_STATS_INTERVAL_S, StatsLogger
from jaxserve.lora.request import LoRARequest
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    """Command: start a request (its stream is already registered)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Command: abort a request (a disconnect, a cancelled coroutine)."""
    request_id: str


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
        self._stats: StatsLogger | None = None     # log_stats
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs) -> "AsyncEngine":
        return cls(builder.from_engine_args(model, **kwargs))

    def log_stats(self, interval: float = LOG_STATS_INTERVAL_S) -> None:
        """Log a line of throughput, queue and cache statistics every `interval` seconds in
        which the engine works (a server's, unless --disable-log-stats)."""
        self._stats = StatsLogger(self.engine.get_metrics, interval)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def grammars(self):
        """The engine's GrammarCompiler (thread-safe: the server compiles off the engine thread)."""
        return self.engine.grammars

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
                       request_id: str | None = None, prompt: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
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
        self._commands.put(AddRequest(request_id, list(prompt_token_ids), sampling_params, prompt,
                                      time.monotonic(), lora_request))
        self._wake.set()
        finished = False
        # Delta outputs are each yielded (each holds only its own news); cumulative ones that
        # queued up while the caller was busy are skipped to the newest.
        cumulative = sampling_params.output_kind == "cumulative"
        try:
            while True:
                item = await q.get()
                while (cumulative and not q.empty() and not isinstance(item, BaseException)
                       and not item.finished):
                    item = q.get_nowait()      # cumulative outputs: only the newest matters
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
                self._commands.put(AbortRequest(request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))
        self._wake.set()

    def add_lora(self, lora: LoRARequest) -> None:
        """Load and check an adapter (any thread: LLMEngine.add_lora touches only the adapter
        store, which has its own lock). ValueError: it cannot be served."""
        self.engine.add_lora(lora)

    def remove_lora(self, int_id: int) -> None:
        self.engine.remove_lora(int_id)

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
            if isinstance(cmd, AddRequest):
                rid = cmd.request_id
                if rid not in self._streams:          # cancelled before it reached us
                    continue
                try:
                    self.engine.add_request(rid, cmd.prompt_token_ids, cmd.sampling_params,
                                            prompt=cmd.prompt, arrival_time=cmd.arrival_time,
                                            lora_request=cmd.lora_request)
                except Exception as e:
                    self._deliver(rid, e if isinstance(e, ValueError) else RuntimeError(str(e)))
            else:
                self.engine.abort_request(cmd.request_id)

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
                if self._stats is not None:
                    self._stats.maybe_log()
            except Exception as e:  # the step itself failed: nothing can be trusted any more
                logger.exception("engine step failed; failing all in-flight requests")
                self.dead_error = e
                for rid in list(self._streams):
                    self._deliver(rid, EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
                return
        self.engine.core.drain()
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError("the engine is shutting down"))
