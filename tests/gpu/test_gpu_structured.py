"""Structured output on the GPU: the masked step program (Pallas attention, the lean sampler
with a full-width mask) on the real default model. Each output must have the grammar's shape
and a batch must equal each request alone (float32: in bf16 a
lone request's bucket may round differently, test_gpu_engine.py)."""

from __future__ import annotations

import json
import re

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.structured import StructuredOutputsParams as SO

from test_gpu_engine import model_path

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_constrained_batch_on_the_gpu():
    llm = LLM(model_path(), dtype="float32", attention_impl="pallas", max_num_seqs=8, max_model_len=512,
              num_kv_blocks=256)
    llm.engine.runner.wait_for_warmup()
    cases = [(SO(json=SCHEMA), "A person as JSON:"), (SO(regex=r"[0-9]{3}-[0-9]{4}"), "A phone number:"),
             (SO(choice=["yes", "no"]), "Is the sky blue?"), (None, "The capital of France is")]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs=so)
              for i, ((so, _), t) in enumerate(zip(cases, (0.0, 0.8, 0.0, 0.0)))]
    prompts = [p for _, p in cases]
    batch = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    obj = json.loads(batch[0].text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", batch[1].text) and batch[2].text in ("yes", "no")
    for prompt, p, out in zip(prompts, params, batch):
        assert llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids == out.token_ids
