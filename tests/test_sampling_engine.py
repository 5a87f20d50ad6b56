"""Sampling through the real engine (default SmolLM2 model, f32 on CPU): seeds, logprobs, stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.step_input import StepInput

PROMPT = "The capital of France is"
OTHERS = ["Once upon a time", "def fibonacci(n):", "My favourite colour"]


@pytest.fixture(scope="module")
def llm():
    # no warm-up: it compiled every program (~20 s on 2 cores, plus background compiles beside
    # the first tests) where these tests run a handful; nothing here checks compilation
    return LLM(model=None, dtype="float32", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32,
               warmup=False)


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def completion(llm, prompt, params):
    return generate(llm, [prompt], params)[0].outputs[0]


def test_same_seed_same_tokens_alone_or_batched(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12)
    alone = completion(llm, PROMPT, params)
    batch = [SamplingParams(temperature=0.9, seed=7, max_tokens=5),
             SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=1.2, max_tokens=9)]
    outs = generate(llm, [OTHERS[0], PROMPT, OTHERS[1], OTHERS[2]], [batch[0], params, batch[1], batch[2]])
    assert outs[1].outputs[0].token_ids == alone.token_ids
    assert outs[1].outputs[0].text == alone.text


def test_different_seeds_differ(llm):
    outs = generate(llm, [PROMPT] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=8) for s in range(4)])
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= 3
    # n > 1: each sample gets its own seed.
    n3 = generate(llm, [PROMPT], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8))[0]
    assert len({tuple(c.token_ids) for c in n3.outputs}) >= 2


def reference_logprobs(llm, token_ids: list[int]) -> np.ndarray:
    """log_softmax of the logits at every position, from one plain prefill of all the tokens."""
    engine = llm.engine
    cfg, params, model = engine.config.model, engine.runner.params, engine.runner.model
    p = 16
    n = len(token_ids)
    num_blocks = -(-n // p)
    pos = np.arange(n, dtype=np.int32)
    x = StepInput(token_ids=jnp.asarray(token_ids, jnp.int32), positions=jnp.asarray(pos),
                  slot_mapping=jnp.asarray(p + pos), token_seq_ids=jnp.zeros(n, jnp.int32),
                  query_start_loc=jnp.asarray([0, n], jnp.int32), seq_lens=jnp.asarray([n], jnp.int32),
                  block_tables=jnp.arange(1, num_blocks + 1, dtype=jnp.int32)[None],
                  logits_indices=jnp.asarray([n - 1], jnp.int32), sampling=None)
    shape = (num_blocks + 1, p, cfg.num_kv_heads, cfg.head_dim)
    kv = [{"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32)}
          for _ in range(cfg.num_layers)]
    _, hidden_TD, _ = model.forward(cfg, params, kv, x, "xla")
    return np.asarray(jax.nn.log_softmax(model.compute_logits(cfg, params, hidden_TD), axis=-1))


def test_logprobs_match_a_reference_forward(llm):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=3, repetition_penalty=1.3)
    out = generate(llm, [PROMPT], params)[0]
    gen = out.outputs[0]
    ref = reference_logprobs(llm, out.prompt_token_ids + gen.token_ids[:-1])
    n_prompt = len(out.prompt_token_ids)
    assert len(gen.logprobs) == len(gen.token_ids)
    for j, (tok, entry) in enumerate(zip(gen.token_ids, gen.logprobs)):
        row = ref[n_prompt + j - 1]
        np.testing.assert_allclose(entry[tok].logprob, row[tok], atol=1e-4)
        top3 = np.argsort(-row)[:3]
        for rank, t in enumerate(top3, start=1):
            assert t in entry and entry[t].rank == rank
            np.testing.assert_allclose(entry[t].logprob, row[t], atol=1e-4)
    np.testing.assert_allclose(gen.cumulative_logprob, sum(e[t].logprob for t, e in zip(gen.token_ids, gen.logprobs)),
                               atol=1e-4)


def test_multi_token_stop_string_cuts_the_text(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=14)
    full = completion(llm, PROMPT, greedy)
    tok = llm.get_tokenizer()
    # A stop string made of the end of one token and the start of the next.
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    k = next(i for i in range(3, len(full.token_ids) - 2)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k]):][:2]
    at = full.text.find(stop)
    assert at >= 0
    cut = completion(llm, PROMPT, greedy.clone(stop=["never appears", stop]))
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:at]
    kept = completion(llm, PROMPT, greedy.clone(stop=[stop], include_stop_str_in_output=True))
    assert kept.finish_reason == "stop" and kept.text == full.text[:at + len(stop)]


def test_allowed_token_ids_bias_and_penalties_reach_the_sampler(llm):
    first = completion(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=1)).token_ids[0]
    banned = completion(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100}))
    assert banned.token_ids[0] != first
    allowed = [first, 11, 28, 260, 314]
    out = completion(llm, PROMPT, SamplingParams(temperature=1.0, seed=0, max_tokens=10, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    repeats = completion(llm, PROMPT, plain).token_ids
    penalized = completion(llm, PROMPT, plain.clone(presence_penalty=2.0, frequency_penalty=2.0)).token_ids
    assert len(set(repeats)) < len(repeats) and len(set(penalized)) == len(penalized)


def test_prompt_logprobs_match_a_reference_forward(llm):
    # Long enough to be computed in several chunks (max_num_batched_tokens=32).
    prompt = "In the beginning the universe was created. This has made a lot of people very angry " * 2
    out = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    assert len(ids) > 32 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    ref = reference_logprobs(llm, ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        np.testing.assert_allclose(entry[ids[p]].logprob, ref[p - 1][ids[p]], atol=1e-4)
        best = int(np.argmax(ref[p - 1]))
        assert entry[best].rank == 1
