"""`jaxserve bench latency | throughput | serve`: the engine's benchmarks.

latency     one batch at a time: ms per output token, tokens/s, fraction of the HBM roofline,
            host vs device time per step, cold start-up
throughput  many requests offline (ShareGPT or random): requests/s, output tokens/s
serve       an async load generator for any OpenAI-compatible server: TTFT, TPOT, ITL, goodput
"""

from __future__ import annotations

import sys

COMMANDS = ("latency", "throughput", "serve")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nusage: jaxserve bench {latency,throughput,serve} [options] (-h for each)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "latency":
        from jaxserve.bench.latency import main as run
    elif command == "throughput":
        from jaxserve.bench.throughput import main as run
    elif command == "serve":
        from jaxserve.bench.serve import main as run
    else:
        print(f"jaxserve bench: unknown benchmark {command!r}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    from jaxserve.engine.checks import StartupError

    try:
        return run(rest)
    except StartupError as e:    # one line (the engine's start-up errors), as the other commands
        print(f"jaxserve bench {command}: error: {e}", file=sys.stderr)
        return 1
