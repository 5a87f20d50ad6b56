"""Command-line flags of `jaxserve serve` beyond the engine's (engine_args.py), vLLM's names.

add_frontend_arguments: what shapes requests and responses, shared with `generate` and
`run-batch` (they run the server's code on a batch file).
"""

from __future__ import annotations

import argparse
import json

from jaxserve.engine.arg_types import int_at_least
from jaxserve.parsers.reasoning import REASONING_PARSERS
from jaxserve.parsers.tools import TOOL_PARSERS
from jaxserve.server.lora_modules import lora_module

LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("requests and responses")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients use for the model; each is listed by /v1/models and accepted "
                        "as `model`, the first is the one responses carry (default: the model path)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, as a file or inline, instead of the model's own")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="default sampling parameters (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens as max_tokens) for requests that leave "
                        "them out: 'auto' reads generation_config.json from the model folder (a .gguf "
                        "has none), a FOLDER reads it from there, 'vllm' uses none (vLLM's defaults); "
                        "a request's own values always win")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the tools go through the chat template and the '
                        "model's tool calls are parsed (needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format, vLLM's names: hermes (Hermes, Qwen2.5/Qwen3: "
                        "<tool_call>{...}</tool_call>), llama3_json (Llama 3.x), qwen3_coder / qwen3_xml "
                        "(Qwen3-Coder, Qwen3.5: <function=...> XML), deepseek_v3, deepseek_v31, "
                        "deepseek_v32 (their special-token call formats), minimax_m2 (<invoke> XML), "
                        "mistral ([TOOL_CALLS]), pythonic ([f(x=1)])")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's output into `reasoning` (its <think> block) and "
                        "`content` (vLLM's names); with it, a grammar (response_format, forced tool "
                        "calls) constrains only the text after the thinking")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='chat template arguments for every request, e.g. \'{"enable_thinking": false}\' '
                        "(a request's own chat_template_kwargs win, key by key)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="in logprobs, name every token 'token_id:N' instead of its text (as vLLM; "
                        "for tokens that do not decode to text on their own); a request's own "
                        "return_tokens_as_token_ids also asks for it")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    add_frontend_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora), each NAME=PATH or vLLM's JSON "
                        '{"name": ..., "path": ..., "base_model_name": ...}; a request picks one '
                        "by its model; more at run time: POST /v1/load_lora_adapter"),
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int_at_least(0), default=8000)
    g.add_argument("--api-key", action="append", default=None,
                   help="require this bearer key on /v1/* and the tokenize routes (repeatable; default: "
                        "$JAXSERVE_API_KEY, else $VLLM_API_KEY); /health, /version, /metrics and /docs "
                        "stay open")
    g.add_argument("--max-request-body-bytes", type=int_at_least(1), default=4 << 20,
                   help="larger request bodies are refused (HTTP 413)")
    g.add_argument("--protect-health-and-metrics", action="store_true",
                   help="also require the API key on /health and /metrics")
    g.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=LOG_LEVELS, help="jaxserve's and uvicorn's log level (--uvicorn-log-level "
                                            "is vLLM's name for it)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per HTTP request")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request: its id, prompt (cut at --max-log-len) and "
                        "sampling parameters (off by default)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's command lines: requests are logged only with "
                        "--enable-log-requests (the access log is uvicorn's: "
                        "--disable-uvicorn-access-log)")
    g.add_argument("--max-log-len", type=int_at_least(0), default=None, metavar="N",
                   help="with --enable-log-requests: characters (or token ids) of the prompt "
                        "logged (default: all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic statistics line (throughput, running and waiting "
                        "requests, KV cache use) in the log; /metrics has them either way")
