"""Regenerate train-draft's replies in several engine processes on one GPU, for `jaxserve
train-draft --regenerate --resume` to train on.

Regenerating is bound by the engine's host work (scheduling, inputs, outputs of ~1,000
sequences a step: ~55 ms against ~5 ms on an H200 for the default model), so W processes
sharing the GPU regenerate about W times as fast as one. Each worker takes every W-th of the
dataset's usable records from --skip on, generates greedy replies (the target's, as
regenerate.regenerate does) until --seconds have passed, and writes what finished; the
parent then writes OUTPUT/regenerated.jsonl: the records of --base (a finished run's
regenerated.jsonl: its held-out split stays the held-out split) and the new ones as training
records.

    python benchmarks/train_draft_regen_parallel.py MODEL DATASET OUTPUT --base FILE \\
        --skip 8064 --workers 6 --seqs 1024 --seconds 420
    jaxserve train-draft MODEL --dataset DATASET --output OUTPUT --regenerate --resume ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker(args) -> None:
    import numpy as np

    from jaxserve.models import loader, registry
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.train_draft import data
    from jaxserve.train_draft.evaluate import make_llm
    from jaxserve.train_draft.regenerate import save_regenerated

    cfg, params, tok = loader.load_model(args.model, dtype="bfloat16")
    examples = data.load_examples(args.dataset, tok, args.max_len, args.max_examples, cfg.vocab_size)
    mine = [e for e in examples[args.skip:][args.worker::args.workers] if args.max_len - e.prompt_len >= 1]
    engine = make_llm(cfg, params, tok, registry.get_family(cfg.architecture), "bfloat16", None,
                      args.max_len, args.seqs).engine
    for i, e in enumerate(mine):
        engine.add_request(str(i), e.token_ids[:e.prompt_len].tolist(),
                           SamplingParams(temperature=0, max_tokens=args.max_len - e.prompt_len,
                                          detokenize=False, output_kind="final_only"))
    t0, new, tokens = time.perf_counter(), [], 0
    while engine.has_unfinished_requests() and time.perf_counter() - t0 < args.seconds:
        for out in engine.step():
            if not out.finished:
                continue
            e = mine[int(out.request_id)]
            reply = np.asarray(out.outputs[0].token_ids, np.int32)
            ids = np.concatenate([e.token_ids[:e.prompt_len], reply])
            tokens += len(reply)
            if len(ids) >= data.MIN_TOKENS:
                new.append(data.Example(ids, e.prompt_len, e.prompt_len))
    save_regenerated(f"{args.output}/shard{args.worker}.jsonl", new, [])
    print(json.dumps({"worker": args.worker, "examples": len(new), "of": len(mine), "reply_tokens": tokens,
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    os._exit(0)                 # the unfinished requests: nothing to wait for


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("dataset")
    p.add_argument("output")
    p.add_argument("--base", default=None, help="a regenerated.jsonl whose records come first")
    p.add_argument("--skip", type=int, default=0, help="usable records of the dataset to leave out first")
    p.add_argument("--max-examples", type=int, default=100_000)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seqs", type=int, default=1024, help="sequences each engine decodes together")
    p.add_argument("--seconds", type=float, default=300, help="each worker's generation time")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return worker(args)
    os.makedirs(args.output, exist_ok=True)
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / args.workers:.3f}"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--worker", str(i)], env=env)
             for i in range(args.workers)]
    while any(q.poll() is None for q in procs):
        if any(q.poll() for q in procs):             # one failed: the others' work is moot
            for q in procs:
                q.kill()
        time.sleep(1)
    codes = [q.returncode for q in procs]
    if any(codes):
        sys.exit(f"a worker failed: exit codes {codes}")
    n = 0
    with open(os.path.join(args.output, "regenerated.jsonl"), "w") as out:
        for path in ([args.base] if args.base else []) + [f"{args.output}/shard{i}.jsonl" for i in range(args.workers)]:
            with open(path) as f:
                for line in f:
                    out.write(line)
                    n += 1
    print(json.dumps({"records": n, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
