"""What every route needs: the engine, the served names, the limits, the tokenizer thread."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from jaxserve.parsers.reasoning import ReasoningParser
from jaxserve.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ServerContext:
    engine: Any                          # jaxserve.engine.AsyncEngine (or a test double)
    served_model_names: tuple[str, ...]  # the first is the name responses carry
    api_keys: tuple[str, ...] = ()       # empty = no authentication
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Sampling defaults for fields a request leaves out (--generation-config): {field: value}.
    default_sampling: dict = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    # tool_choice "auto": vLLM's --enable-auto-tool-choice and --tool-call-parser (server/tools.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser (jaxserve.parsers.reasoning; None: the thinking stays in the content)
    reasoning_parser: ReasoningParser | None = None
    # --default-chat-template-kwargs: under each request's chat_template_kwargs
    default_chat_template_kwargs: dict = field(default_factory=dict)
    # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" (a request may ask too)
    return_tokens_as_token_ids: bool = False
    # --enable-log-requests: one log line per request, its prompt cut at --max-log-len
    log_requests: bool = False
    max_log_len: int | None = None
    # LoRA adapters by name (--enable-lora; server/lora_modules.py), None: none served
    lora: Any = None
    # NOTE: tokenizing and chat templates run here, off the event loop; one thread, so that
    # requests never tokenize concurrently with each other.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenize"))
    # what the server has checked once (first_time's keys)
    checked_once: set = field(default_factory=set)

    def first_time(self, key: str) -> bool:
        """True the first time `key` is asked about (a warning the log shows once)."""
        if key in self.checked_once:
            return False
        self.checked_once.add(key)
        return True

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        """The engine's tokenizer; None for a model without one (dummy weights, bare config)."""
        return self.engine.tokenizer

    def require_tokenizer(self, param: str):
        if self.engine.tokenizer is None:
            raise APIError(400, f"this model has no tokenizer, so {param} cannot be text; send token ids",
                           param=param, code="no_tokenizer")
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model.vocab_size

    @property
    def max_logprobs(self) -> int:
        return self.engine.config.max_logprobs

    def template_kwargs(self, asked: dict | None) -> dict:
        """The chat template's arguments for a request: the server's defaults, then its own."""
        return {**self.default_chat_template_kwargs, **(asked or {})}

    def tokens_as_ids(self, asked: bool | None) -> bool:
        """Whether logprobs name tokens "token_id:N": the request's return_tokens_as_token_ids
        if it gives one, else --return-tokens-as-token-ids."""
        return self.return_tokens_as_token_ids if asked is None else asked

    def check_model(self, name: str | None):
        """A request may leave `model` out; if it names one, it must be one we serve: the base
        model (None returned) or a LoRA adapter (its LoRARequest)."""
        if name is None or name in self.served_model_names:
            return None
        lora = self.lora.get(name) if self.lora is not None else None
        if lora is None:
            served = list(self.served_model_names) + (self.lora.names if self.lora is not None else [])
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in served)}",
                           param="model", code="model_not_found")
        return lora

    def response_model(self, lora) -> str:
        """The `model` a response carries: the adapter's name, else the first served name."""
        return lora.lora_name if lora is not None else self.model_name

    async def in_tokenizer_thread(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, lambda: fn(*args, **kwargs))
