"""Command-line flags of `jaxserve serve` beyond the engine's (engine_args.py)."""

from __future__ import annotations

import argparse


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model path)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require this bearer key on /v1/* and tokenize routes (repeatable)")
    g.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                   help="larger request bodies are refused (HTTP 413)")
    g.add_argument("--protect-health-and-metrics", action="store_true",
                   help="also require the API key on /health and /metrics")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
