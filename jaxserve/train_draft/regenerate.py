"""--regenerate: replace each example's reply by the target's own greedy one (through the
engine), so the head learns the text it will draft for, and the held-out chained-agreement
estimate follows the tokens greedy decoding would produce (EAGLE's practice: a head trained
on the target's outputs accepts more than one trained on the dataset's replies).
"""

from __future__ import annotations

import json

import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.train_draft.data import MIN_TOKENS, Example, load_examples


def regenerate(llm, examples: list[Example], max_len: int, use_tqdm: bool = True) -> list[Example]:
    """Each example as its prompt and the target's greedy reply, up to max_len tokens in all
    (examples whose prompt leaves no room for a reply are dropped)."""
    keep = [e for e in examples if max_len - e.prompt_len >= 1]
    prompts = [{"prompt_token_ids": e.token_ids[:e.prompt_len].tolist()} for e in keep]
    params = [SamplingParams(temperature=0, max_tokens=max_len - e.prompt_len) for e in keep]
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
    with open(path) as f:
        splits = [json.loads(line)["split"] for line in f if line.strip()]
    examples = load_examples(path, None, max_len, len(splits), vocab_size)
    if len(examples) != len(splits):
        raise ValueError(f"{path}: {len(splits)} records but {len(examples)} usable examples "
                         f"(was it written with another --max-len?)")
    train = [e for e, s in zip(examples, splits) if s == "train"]
    return train, [e for e, s in zip(examples, splits) if s == "held_out"]
