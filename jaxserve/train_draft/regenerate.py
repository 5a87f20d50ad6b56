"""--regenerate: replace each example's reply by the target's own greedy one (through the
engine), so the head learns the text it will draft for, and the held-out chained-agreement
estimate follows the tokens greedy decoding would produce (EAGLE's practice: a head trained
on the target's outputs accepts more than one trained on the dataset's replies).
"""

from __future__ import annotations

import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.train_draft.data import MIN_TOKENS, Example


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
            new.append(Example(ids.astype(np.int32), e.prompt_len))
    return new
