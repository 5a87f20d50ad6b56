"""Render and tokenize a ShareGPT sample once for `jaxserve train-draft`, as JSONL of
{"input_ids", "prompt_len"} records: for a machine without the tokenizer's files or room for
the 125 MB ShareGPT JSON (the device machine's carry limit is 64 MB).

    python benchmarks/prepare_draft_data.py SHAREGPT.json OUT.jsonl --num 8000 --max-len 512 [--tokenizer X]

The records are rendered with the tokenizer's chat template (the default model's by default)
exactly as train-draft renders them itself; the last ones are the held-out set there
(--num-eval), so keep the order.
"""

from __future__ import annotations

import argparse
import json

from jaxserve.bench.throughput import load_tokenizer
from jaxserve.train_draft.data import load_examples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset")
    p.add_argument("output")
    p.add_argument("--num", type=int, default=8000, help="records written (usable ones, in file order)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--tokenizer", default=None)
    args = p.parse_args()
    tok = load_tokenizer(args.tokenizer)
    examples = load_examples(args.dataset, tok, args.max_len, args.num, tok.vocab_size)
    with open(args.output, "w") as f:
        for e in examples:
            f.write(json.dumps({"input_ids": e.token_ids.tolist(), "prompt_len": e.prompt_len}) + "\n")
    n = sum(len(e.token_ids) for e in examples)
    print(f"{len(examples)} records, {n} tokens (mean {n / len(examples):.0f}) -> {args.output}")


if __name__ == "__main__":
    main()
