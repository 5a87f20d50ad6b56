"""--regenerate: replace each example's reply by the target's own greedy one (through the
engine), so the head learns the text it will draft for, and the held-out chained-agreement
estimate follows the tokens greedy decoding would produce (EAGLE's practice: a head trained
on the target's outputs accepts more than one trained on the dataset's replies).
"""

from __future__ import annotations

import json

import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.train_draft.data import MIN_TOKENS, Example, check_token_ids, iter_records, tokenize_record


def regenerate(llm, examples: list[Example], max_len: int, use_tqdm: bool = True) -> list[Example]:
    """Each example as its prompt and the target's greedy reply, up to max_len tokens in all
    (examples whose prompt leaves no room for a reply are dropped)."""
    keep = [e for e in examples if max_len - e.prompt_len >= 1]
    prompts = [{"prompt_token_ids": e.token_ids[:e.prompt_len].tolist()} for e in keep]
    params = [SamplingParams(temperature=0, max_tokens=max_len - e.prompt_len, detokenize=False) for e in keep]
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    new = []
    for e, o in zip(keep, outs):
        ids = np.concatenate([e.token_ids[:e.prompt_len], np.asarray(o.outputs[0].token_ids, np.int32)])
        if len(ids) >= MIN_TOKENS:
            new.append(Example(ids.astype(np.int32), e.prompt_len, e.prompt_len))
    return new


def save_regenerated(path: str, train: list[Example], held_out: list[Example]) -> None:
    """Both splits as token-id records, the held-out ones marked."""
    with open(path, "w") as f:
        for split, examples in (("train", train), ("held_out", held_out)):
            for e in examples:
                f.write(json.dumps({"input_ids": e.token_ids.tolist(), "prompt_len": e.prompt_len,
                                    "split": split}) + "\n")


def load_regenerated(path: str, max_len: int, vocab_size: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out) as save_regenerated wrote them."""
    splits: dict[str, list[Example]] = {"train": [], "held_out": []}
    for n, record in enumerate(iter_records(path), 1):
        ex = tokenize_record(record, None, max_len)
        if ex is None or record.get("split") not in splits or len(record["input_ids"]) > max_len:
            raise ValueError(f"{path}:{n}: not a record save_regenerated wrote with --max-len {max_len}")
        check_token_ids(ex, vocab_size, f"{path}:{n}")
        splits[record["split"]].append(ex)
    return splits["train"], splits["held_out"]
