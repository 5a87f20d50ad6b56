"""Multi-step decode A/B in one engine: the same `jaxserve bench latency` measurement at each
of several --num-scheduler-steps values, interleaved, twice (issue 33).

    python benchmarks/multi_step_ab.py 1,8 OUT.json -- <jaxserve bench latency arguments>

The engine is built once with num_scheduler_steps = the largest value (warm-up compiles the
one-step programs and that value's; a value between them compiles in the bench's warm-up
iterations); each value is then set on the scheduler's config in turn. --no-one-row (before `--`): the fused stack's one-row projections on the dot program
instead (fused_linear.one_row patched; pass --no-program-cache too, since a stored program is
keyed on the sources, not on a patch)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from jaxserve.bench import latency
from jaxserve.bench.report import print_table

COLUMNS = ["K", "rep", "batch_size", "ms_per_output_token", "decode_steps_per_step", "step_host_ms",
           "device_only_step_ms", "roofline_ms", "roofline_fraction"]


def main(argv: list[str]) -> int:
    if "--" not in argv or len(argv[:argv.index("--")]) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    ours, bench_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    ks, out_json = [int(k) for k in ours[0].split(",")], ours[1]
    if "--no-one-row" in ours:
        from jaxserve.pallas_kernels import fused_linear
        fused_linear.one_row = lambda *a, **k: False
    args = latency.build_parser().parse_args(bench_args + ["--num-scheduler-steps", str(max(ks))])
    max_len = -(-(args.input_len + args.output_len) // args.block_size) * args.block_size
    t0 = time.time()
    llm, build_s = latency.build_llm(args, max_num_seqs=max(args.batch_size), max_model_len=max_len)
    llm.engine.wait_for_warmup()
    print(f"# built in {build_s:.1f} s, ready {time.time() - t0:.1f} s", flush=True)
    scheduler = llm.engine.scheduler
    base, rows = scheduler.config, []
    for rep in range(2):
        for k in ks:
            scheduler.config = dataclasses.replace(base, num_scheduler_steps=k)
            for b in args.batch_size:
                row = {n: v for n, v in latency.bench_batch(llm, b, args).items() if not isinstance(v, dict)}
                rows.append({**row, "K": k, "rep": rep})
    print_table("multi-step A/B", rows, COLUMNS)
    with open(out_json, "w") as f:
        json.dump({"ks": ks, "argv": argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
