"""Render and tokenize a ShareGPT sample once for `jaxserve train-draft`, as JSONL of
{"input_ids", "prompt_len"} records: for a machine without the tokenizer's files or room for
the 125 MB ShareGPT JSON (the device machine's carry limit is 64 MB).

    python benchmarks/prepare_draft_data.py SHAREGPT.json OUT.jsonl --num 8000 --max-len 512 [--tokenizer X]

The records are rendered with the tokenizer's chat template (the default model's by default)
exactly as train-draft renders them itself; the last ones are the held-out set there
(--num-eval), so keep the order. --all-turns makes one record of each human turn (the
conversation up to it, then its reply) whose prompt leaves --min-reply tokens of --max-len:
more prompts from a file that has few conversations, for --regenerate.
"""

from __future__ import annotations

import argparse
import json

from jaxserve.bench.datasets import iter_json_array
from jaxserve.bench.throughput import load_tokenizer
from jaxserve.train_draft.data import load_examples, tokenize_record


def turn_examples(path: str, tok, max_len: int, limit: int, min_reply: int) -> list:
    """An example per human turn of each conversation (alternating human / gpt turns)."""
    out = []
    for rec in iter_json_array(path):
        turns = rec.get("conversations") or []
        for i in range(0, len(turns) - 1, 2):
            if turns[i].get("from") != "human" or turns[i + 1].get("from") != "gpt":
                break
            ex = tokenize_record({"conversations": turns[:i + 2]}, tok, max_len)
            if ex is None or ex.prompt_len > max_len - min_reply:
                break                   # later turns' prompts are longer still
            out.append(ex)
        if len(out) >= limit:
            return out[:limit]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset")
    p.add_argument("output")
    p.add_argument("--num", type=int, default=8000, help="records written (usable ones, in file order)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--all-turns", action="store_true")
    p.add_argument("--min-reply", type=int, default=128)
    args = p.parse_args()
    tok = load_tokenizer(args.tokenizer)
    if args.all_turns:
        examples = turn_examples(args.dataset, tok, args.max_len, args.num, args.min_reply)
    else:
        examples = load_examples(args.dataset, tok, args.max_len, args.num, tok.vocab_size)
    with open(args.output, "w") as f:
        for e in examples:
            f.write(json.dumps({"input_ids": e.token_ids.tolist(), "prompt_len": e.prompt_len}) + "\n")
    n = sum(len(e.token_ids) for e in examples)
    print(f"{len(examples)} records, {n} tokens (mean {n / len(examples):.0f}) -> {args.output}")


if __name__ == "__main__":
    main()
