"""Output processing's three output kinds: cumulative, delta (only what is new since the last
output, what a stream sends) and final_only."""

import os

from jaxserve import LLM, SamplingParams

TINY = os.path.join(os.path.dirname(__file__), "golden", "ckpt", "llama")


def outputs(engine, kind, n=1):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=n, seed=0,
                            output_kind=kind, logprobs=1)
    engine.add_request("r", list(range(5, 14)), params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "r"]
    return seen


def test_deltas_add_up_to_the_cumulative_output():
    engine = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
                 max_model_len=64, warmup=False).engine
    cumulative = outputs(engine, "cumulative")
    deltas = outputs(engine, "delta")
    final = outputs(engine, "final_only")
    whole = cumulative[-1].outputs[0]
    assert len(final) == 1 and final[0].outputs[0].token_ids == whole.token_ids
    assert len(deltas) > 1 and deltas[-1].finished
    tokens = [t for o in deltas for t in o.outputs[0].token_ids]
    logprobs = [lp for o in deltas for lp in o.outputs[0].logprobs]
    assert tokens == whole.token_ids and len(logprobs) == len(whole.logprobs) == 6
    assert all(len(o.outputs[0].token_ids) <= 2 for o in deltas)    # never the whole list again
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_deltas_of_several_samples_are_kept_apart():
    engine = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                 max_model_len=64, warmup=False).engine
    whole = outputs(engine, "cumulative", n=2)[-1]
    deltas = outputs(engine, "delta", n=2)
    for i in range(2):
        got = [t for o in deltas for c in o.outputs if c.index == i for t in c.token_ids]
        assert got == whole.outputs[i].token_ids
