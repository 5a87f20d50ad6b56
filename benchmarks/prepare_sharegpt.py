"""Tokenize a ShareGPT sample once (vLLM's filter) and save it as JSONL for
`jaxserve bench throughput|serve --dataset-name jsonl`, e.g. for a machine without the
tokenizer's files or the 125 MB ShareGPT JSON.

    python benchmarks/prepare_sharegpt.py SHAREGPT.json OUT.jsonl --num-prompts 1000 [--tokenizer X]

The tokenizer defaults to the default model's (SmolLM2, 49152 tokens); token counts then
differ from a Llama-3 tokenizer's (about 10-20 % more tokens for English text).
"""

from __future__ import annotations

import argparse

from jaxserve.bench.datasets import sample_sharegpt, save_requests
from jaxserve.bench.throughput import load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset")
    p.add_argument("output")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    reqs = sample_sharegpt(args.dataset, load_tokenizer(args.tokenizer), args.num_prompts, seed=args.seed)
    save_requests(args.output, reqs)
    n_in = sum(r.prompt_len for r in reqs)
    n_out = sum(r.output_len for r in reqs)
    print(f"{len(reqs)} requests: {n_in} prompt tokens, {n_out} output tokens "
          f"(mean {n_in / len(reqs):.0f} in, {n_out / len(reqs):.0f} out) -> {args.output}")


if __name__ == "__main__":
    main()
