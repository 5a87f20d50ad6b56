"""What `serve`, `generate` and `run-batch` do before their first request, with a log line per
phase (the first start downloads and compiles, which takes a while; the user should see why):
check the model argument, fetch the default model, load, compile, check that the
configuration can serve, then apply --chat-template and --generation-config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from jaxserve.engine.args import engine_kwargs, served_model_names
from jaxserve.engine.checks import StartupError, check_can_serve, check_model_argument
from jaxserve.engine.vllm_flags import check_vllm_combinations, noop_notes

logger = logging.getLogger("jaxserve")


class _StderrHandler(logging.StreamHandler):
    """A handler on the sys.stderr of the moment, not the one at set-up: notebooks and tests
    swap sys.stderr, and a handler kept on a closed one printed "--- Logging error ---" for
    every line after."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):      # StreamHandler's __init__ and setStream: the moment's wins
        pass


def configure_logging(level: str = "info") -> None:
    """jaxserve's log lines to stderr at `level`, once (uvicorn configures its own loggers)."""
    root = logging.getLogger("jaxserve")
    root.setLevel("DEBUG" if level == "trace" else level.upper())
    if not any(getattr(h, "_jaxserve", False) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                               "%H:%M:%S"))
        handler._jaxserve = True
        root.addHandler(handler)
        root.propagate = False


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself if it is a Jinja template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise StartupError(f"--chat-template {value!r}: no such file, and not an inline Jinja template "
                       f"(one holds '{{{{' or '{{%')")


def fetch_default_model() -> str:
    """The default model's path, downloaded on first use; StartupError if that fails."""
    from jaxserve.models.loaders.default_model import ensure_default_model

    try:
        return ensure_default_model()    # shows its own progress the first time
    except RuntimeError as e:
        raise StartupError(str(e)) from e


def start_engine(args: argparse.Namespace):
    """(the AsyncEngine for the parsed flags, ready to serve; the sampling defaults of
    --generation-config). StartupError, before anything loads where it can, if it cannot."""
    from jaxserve.models.loaders.default_model import DEFAULT_MODEL_NAME
    from jaxserve.engine import AsyncEngine
    from jaxserve.engine.generation_config import default_sampling

    check_vllm_combinations(args)
    kwargs = engine_kwargs(args)
    for note in noop_notes(args):    # vLLM's flags that change nothing here, and why
        logger.info("%s", note)
    check_model_argument(kwargs["model"], kwargs["load_format"])
    template = read_chat_template(getattr(args, "chat_template", None))
    defaults = default_sampling(getattr(args, "generation_config", "vllm"), kwargs["model"])
    t0 = time.perf_counter()
    if kwargs["model"] is None and kwargs["load_format"] != "dummy":
        fetch_default_model()
    logger.info("loading %s%s", kwargs["model"] or DEFAULT_MODEL_NAME,
                "; then compiling the step programs (the first start compiles them all, later "
                "ones load them from the cache)" if kwargs["warmup"] else "")
    try:
        engine = AsyncEngine.from_engine_args(**kwargs)
    except (ValueError, OSError) as e:   # a bad file or a limit the model cannot take
        raise StartupError(str(e)) from e
    try:
        check_can_serve(engine.config, engine.engine.runner.num_blocks)
        if template is not None:
            if engine.tokenizer is None:
                raise StartupError("--chat-template: this model has no tokenizer, so chat is not served")
            engine.tokenizer.hf.chat_template = template
        if engine.tokenizer is not None:
            trial_render(engine.tokenizer)
    except BaseException:
        engine.shutdown()
        raise
    if not getattr(args, "disable_log_stats", False):
        engine.log_stats()
    seconds = engine.engine.startup_seconds
    logger.info("ready in %.1f s (loading %.1f s, warm-up %.1f s)", time.perf_counter() - t0,
                seconds.get("load", 0.0), seconds.get("warmup", 0.0))
    return engine, defaults


def trial_render(tokenizer) -> None:
    """A chat message through the template, the tokenizer and the detokenizer once: each
    sets itself up on first use (transformers compiles the Jinja template, ~35 ms on the 2-core
    CPU), which is then not the first request's cost (issue 69)."""
    text = "What is the capital of France?"
    if tokenizer.hf.chat_template:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        except Exception as e:      # a template that needs more than this; requests will say
            logger.debug("the chat template's trial render failed: %s", e)
    tokenizer.decode(tokenizer.encode(text))


def lora_modules(engine, args: argparse.Namespace, names: tuple[str, ...]):
    """The server's adapters (--enable-lora), --lora-modules loaded now (a bad one stops the
    start with its reason); None without --enable-lora."""
    from jaxserve.server.lora_modules import LoRAModules

    modules = getattr(args, "lora_modules", None) or []
    if not getattr(args, "enable_lora", False):
        if modules:
            raise StartupError("--lora-modules needs --enable-lora")
        return None
    loras = LoRAModules(engine, names[0], names)
    for entry in modules:
        try:
            loras.add(entry["name"], entry["path"], entry.get("base_model_name"))
        except ValueError as e:
            raise StartupError(f"--lora-modules {entry['name']}: {e}") from None
    return loras


def server_context(engine, args: argparse.Namespace, default_sampling: dict, **kwargs):
    """The ServerContext for `engine`: the served names of `args`, the sampling defaults."""
    from jaxserve.parsers.reasoning import reasoning_parser
    from jaxserve.server.context import ServerContext

    reasoning = getattr(args, "reasoning_parser", None)
    names = served_model_names(args) or (engine.model_name,)
    return ServerContext(engine, served_model_names=names, lora=lora_modules(engine, args, names),
                         default_sampling=default_sampling,
                         enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                         tool_call_parser=getattr(args, "tool_call_parser", None),
                         reasoning_parser=reasoning_parser(reasoning) if reasoning else None,
                         default_chat_template_kwargs=getattr(args, "default_chat_template_kwargs", None) or {},
                         return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
                         log_requests=getattr(args, "enable_log_requests", False),
                         max_log_len=getattr(args, "max_log_len", None), **kwargs)
