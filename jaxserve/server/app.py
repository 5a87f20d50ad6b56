"""The FastAPI app: OpenAI-compatible routes plus tokenize / health / version / metrics.

Bodies are read and parsed here (not by FastAPI's own body binding) so that the size limit,
invalid JSON and wrong types all come back as OpenAI-shaped 400s.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import signal
import socket
import threading
from typing import Callable, TypeVar

import pydantic
import uvicorn
from prometheus_client import CollectorRegistry
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from jaxserve.server.auth import DEFAULT_OPEN_PATHS, APIKeyMiddleware
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError, bad_request, from_validation_error, install_error_handlers
from jaxserve.server.http_metrics import RequestCounter, http_metrics_text
from jaxserve.server.inputs import check_token_ids, render_chat
from jaxserve.server.messages import count_tokens, create_message, in_anthropic_shape
from jaxserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from jaxserve.server.lora_modules import install_lora_routes
from jaxserve.server.openapi import install_openapi
from jaxserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from jaxserve.server.responses import create_response, delete_response, stored_response
from jaxserve.server.responses_protocol import ResponsesRequest
from jaxserve.server.responses_store import ResponsesStore
from jaxserve.server.serving_chat import create_chat_completion
from jaxserve.server.serving_completions import create_completion

Body = TypeVar("Body", bound=pydantic.BaseModel)
# Lifecycle messages go where uvicorn's own go (it configures this logger at --log-level).
logger = logging.getLogger("uvicorn.error")

API_KEY_ENV = "JAXSERVE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"
# On SIGTERM the engine stops at once and open streams send their last event; connections
# still open after this long are cut. It bounds the time from the signal to the exit.
GRACEFUL_SHUTDOWN_S = 5


def _version() -> str:
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def read_body(ctx: ServerContext, request: Request, model: type[Body]) -> Body:
    limit = ctx.max_request_body_bytes
    too_big = APIError(413, f"request body is larger than the server's limit of {limit} bytes "
                            f"(--max-request-body-bytes)", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:   # gone before the body was sent: no one reads the answer
        raise bad_request("the client disconnected while sending the request body") from None
    try:
        return model.model_validate_json(b"".join(chunks))
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from None


def _model_card(ctx: ServerContext, name: str) -> dict:
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "jaxserve",
            "root": ctx.model_name, "max_model_len": ctx.max_model_len}


def build_app(ctx: ServerContext, open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS,
              on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The app for one engine. It does not own the engine: whoever made it shuts it down
    (`on_shutdown` runs when the server stops, after the last connection closed)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if on_shutdown is not None:
            on_shutdown()

    # /docs: FastAPI's Swagger UI (its scripts come from a CDN, so offline the page stays blank).
    app = FastAPI(title="jaxserve", version=_version(), docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    install_openapi(app)
    if ctx.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=ctx.api_keys, open_paths=open_paths)
    http_registry = CollectorRegistry()    # outermost: refused requests are counted too
    app.add_middleware(RequestCounter, router=app.router, registry=http_registry)

    @app.get("/v1/models")
    async def list_models():
        adapters = ctx.lora.cards(ctx.created, ctx.max_model_len) if ctx.lora is not None else []
        return {"object": "list", "data": [_model_card(ctx, n) for n in ctx.served_model_names] + adapters}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        ctx.check_model(model)
        return _model_card(ctx, model)

    install_lora_routes(app, ctx, read_body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(ctx, request, await read_body(ctx, request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(ctx, request, await read_body(ctx, request, ChatCompletionRequest))

    responses_store = ResponsesStore()

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await create_response(ctx, request, await read_body(ctx, request, ResponsesRequest),
                                     responses_store)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return stored_response(responses_store, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str):
        return delete_response(responses_store, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request):
        async def answer():
            return await create_message(ctx, request, await read_body(ctx, request, MessagesRequest))
        return await in_anthropic_shape(answer())

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        async def answer():
            return await count_tokens(ctx, await read_body(ctx, request, CountTokensRequest))
        return await in_anthropic_shape(answer())

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await read_body(ctx, request, TokenizeRequest)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")

        def encode() -> list[int]:
            if req.messages is not None:
                text = render_chat(ctx, req.messages, req.add_generation_prompt,
                                   template_kwargs=ctx.template_kwargs(None))
                return ctx.tokenizer.encode(text, add_special_tokens=False)
            return ctx.require_tokenizer("prompt").encode(req.prompt, add_special_tokens=req.add_special_tokens)

        tokens = await ctx.in_tokenizer_thread(encode)
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await read_body(ctx, request, DetokenizeRequest)
        ctx.check_model(req.model)
        check_token_ids(ctx, req.tokens, "tokens")
        tokenizer = ctx.require_tokenizer("tokens")
        return {"prompt": await ctx.in_tokenizer_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        if not ctx.engine.is_healthy:
            raise APIError(503, "the engine is not running", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        from jaxserve.metrics import prometheus_text

        registry = getattr(getattr(ctx.engine, "metrics", None), "registry", None)
        # vLLM labels its metrics with the first served model name
        text = prometheus_text(registry, ctx.model_name) if registry is not None else b""
        return Response(text + http_metrics_text(http_registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, stopping the engine as soon as SIGINT / SIGTERM arrives: every open
    stream then ends with an error event and `data: [DONE]` (streaming.sse_events), so the
    connections close and uvicorn's graceful wait ends early instead of cutting them."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None], ready_line: str = ""):
        super().__init__(config)
        self._on_signal = on_signal
        self._ready_line = ready_line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._ready_line:   # only now is the socket listening
            logger.info("%s", self._ready_line)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info("%s: stopping the engine; open streams end with an error event",
                        signal.Signals(sig).name)
            # NOTE: in a thread: this runs in the event loop's thread, which must stay free to
            # send the streams' last events while the engine thread winds down.
            threading.Thread(target=self._on_signal, name="jaxserve-stop", daemon=True).start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            # A shutdown the user asked for is a success (exit status 0): do not re-raise the
            # signal once the server has stopped, as uvicorn would. NOTE: uvicorn's private
            # list (0.29 to 0.54 at least); were it renamed, the exit status would be -15 again
            # and tests/server/test_serve_command.py would say so.
            getattr(self, "_captured_signals", []).clear()


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key values, else $JAXSERVE_API_KEY, else $VLLM_API_KEY (vLLM's variable)."""
    if args.api_key:
        keys = tuple(args.api_key)
    else:
        env = os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV)
        keys = (env,) if env else ()
    if any(not k.strip() for k in keys):
        from jaxserve.engine.checks import StartupError
        raise StartupError("--api-key must not be empty")
    return keys


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use fails at once
    (StartupError naming host:port) instead of after loading and compiling."""
    from jaxserve.engine.checks import StartupError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # as uvicorn does: a port in TIME_WAIT from the last run can be taken again at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port} (--host / --port): {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def run_server(args: argparse.Namespace) -> None:
    """`jaxserve serve`: loads the model, serves until SIGINT/SIGTERM, then stops the engine thread.

    `args` carries the flags of jaxserve.engine.args.add_engine_arguments and
    jaxserve.server.args.add_server_arguments.
    """
    from jaxserve.server.startup import server_context, start_engine

    keys = api_keys_from(args)
    sock = bind_listen_socket(args.host, args.port)
    try:
        engine, default_sampling = start_engine(args)
    except BaseException:
        sock.close()
        raise

    def stop_engine() -> None:
        engine.shutdown()
        logger.info("engine stopped")

    try:
        ctx = server_context(engine, args, default_sampling, api_keys=keys,
                             max_request_body_bytes=args.max_request_body_bytes)
        open_paths = () if getattr(args, "protect_health_and_metrics", False) else DEFAULT_OPEN_PATHS
        # NOTE: the engine stops in the app's shutdown too, for a server stopped another way.
        app = build_app(ctx, open_paths, on_shutdown=stop_engine)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                access_log=not args.disable_uvicorn_access_log,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        port = sock.getsockname()[1]    # the one the system chose for --port 0
        ready = (f"serving {', '.join(ctx.served_model_names)} on http://{args.host}:{port} "
                 f"(API keys: {len(keys) or 'off'}; API docs at /docs)")
        # SIGINT / SIGTERM: stop, drain, exit
        _Server(config, on_signal=engine.shutdown, ready_line=ready).run(sockets=[sock])
    finally:
        engine.shutdown()   # for every other way out (no-op if already stopped)
        sock.close()
