"""The engine end to end on the real default model (f32): batching invariance, preemption,
prefix caching, aborts, and no compilation after warm-up."""

import asyncio

import jax
import pytest

from jaxserve import SamplingParams
from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.engine import AsyncEngine
from jaxserve.engine.builder import build_engine
from jaxserve.engine.llm import LLM
from jaxserve.models import llama, loader, registry
from tests.step_bound import bound_steps

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model():
    return loader.load_model(None, dtype="float32")


def make_llm(model, *, max_num_seqs=16, max_tokens=128, max_len=256, num_kv_blocks=None,
             block_size=16, prefix=True, warmup=False):
    cfg, params, tok = model
    config = EngineConfig(
        model=cfg,
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                                  max_model_len=max_len),
        dtype="float32", warmup=warmup)
    return LLM.from_engine(bound_steps(build_engine(config, params, tok, registry.LLAMA)))


def prompts(n):
    words = "the cat sat on a warm mat while rain fell over quiet hills and rivers".split()
    return [" ".join(words[: 2 + (i * 7) % 13]) + f" {i}" for i in range(n)]


@pytest.fixture(scope="module")
def shared(model):
    """One engine of make_llm's defaults for the tests that only need some engine: a fresh one
    of the same config recompiles (from the disk cache) its step programs, ~3 s on 2 cores.
    Each test leaves it idle (no request, no used block); counters are compared as deltas."""
    return make_llm(model)


@pytest.fixture(scope="module")
def alone(shared):
    return {p: shared.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts(32)}


def test_batch_equals_alone(model, alone):
    # forces chunking and several steps; its programs are the shared engine's smaller buckets
    # (the same shapes: loaded from the compilation cache, not compiled again)
    llm = make_llm(model, max_tokens=64)
    outs = llm.generate(prompts(32), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in prompts(32)]
    assert [o.prompt for o in outs] == prompts(32)  # input order
    assert llm.engine.scheduler.pool.num_used == 0


def test_preemption_keeps_outputs_and_frees_everything(model, alone):
    llm = make_llm(model, num_kv_blocks=8, block_size=4, max_len=64)
    outs = llm.generate(prompts(12), GREEDY, use_tqdm=False)
    m = llm.get_metrics()
    assert m["num_preemptions_total"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in prompts(12)]
    assert llm.engine.scheduler.pool.num_used == 0 and m["num_requests_running"] == 0


def test_shared_prefix_computes_only_new_tokens(model, shared):
    llm = shared                                   # no other test prompts with this text
    tok = llm.get_tokenizer()
    base = tok.encode("In a quiet village by the sea there lived an old fisherman who " * 3)
    assert len(base) >= 40
    first = llm.generate({"prompt_token_ids": base[:40]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    hits_before = llm.get_metrics()["prefix_cache_hits_total"]
    second = llm.generate({"prompt_token_ids": base[:32] + [11, 12, 13, 14]}, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32          # two full 16-token blocks reused
    assert llm.get_metrics()["prefix_cache_hits_total"] - hits_before == 32
    fresh = make_llm(model, prefix=False).generate(
        {"prompt_token_ids": base[:32] + [11, 12, 13, 14]}, GREEDY, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_chat_answers_paris(shared):
    llm = shared
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_an_engine_that_never_finishes_fails_in_steps_naming_its_requests(model, monkeypatch):
    """tests/step_bound.py: a broken invariant fails the test instead of hanging it."""
    llm = make_llm(model)
    monkeypatch.setattr(llm.engine.core, "step", lambda: None)      # nothing ever runs
    with pytest.raises(AssertionError, match=r"took \d+ steps.*stuck:\n  \d+: WAITING, tokens \d+ "
                                             r"\(prompt \d+, outputs 0 of max_tokens 6\), computed 0"):
        llm.generate(prompts(1), GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()                  # generate aborted it


def test_abort_frees_blocks(shared):
    llm = shared
    eng = llm.engine
    eng.add_request("x", list(range(100, 140)), SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    eng.step()
    assert eng.scheduler.pool.num_used > 0
    assert eng.abort_request("x")
    assert eng.scheduler.pool.num_used == 0 and not eng.has_unfinished_requests()


def test_invalid_requests_name_the_field(model):
    llm = make_llm(model, max_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 64}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=60), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**7]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_n_samples_share_the_prompt(shared):
    llm = shared
    out = llm.generate("A story about a dragon:", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_no_compilation_after_warmup(model):
    llm = make_llm(model, max_tokens=32, max_num_seqs=4, max_len=128, warmup=True)
    llm.engine.runner.wait_for_warmup()     # the full-variant programs finish in the background
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    llm.generate(prompts(6), GREEDY, use_tqdm=False)
    llm.generate(["x" * 50, "y"], [SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprobs=3),
                                    SamplingParams(temperature=0, max_tokens=9, stop=["."], top_k=5)],
                 use_tqdm=False)
    llm.generate("z", SamplingParams(n=2, temperature=1, max_tokens=3, repetition_penalty=1.2,
                                     logit_bias={5: 1.0}), use_tqdm=False)
    assert compiles == []


def test_async_engine_streams_and_cancels(model):
    cfg, params, tok = model
    engine = AsyncEngine(make_llm(model).engine)

    async def full(prompt):
        last = None
        async for out in engine.generate(tok.encode(prompt), SamplingParams(temperature=0, max_tokens=8)):
            last = out
        return last

    async def cut(prompt):
        agen = engine.generate(tok.encode(prompt), SamplingParams(temperature=0, max_tokens=200,
                                                                 ignore_eos=True))
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await agen.aclose()

    async def main():
        results = await asyncio.gather(full("Hello there"), cut("Tell me a long story"), full("Why is the sky"))
        for _ in range(100):
            if engine.get_metrics()["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.05)
        return results

    try:
        a, _, c = asyncio.run(main())
        assert a.finished and c.finished and len(a.outputs[0].token_ids) <= 8
        m = engine.get_metrics()
        assert m["num_requests_running"] == 0 and m["num_used_blocks"] == 0
    finally:
        engine.shutdown()


def test_a_failure_in_one_request_fails_it_alone(shared):
    llm = shared
    eng = llm.engine
    eng.add_request("good", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=4))
    eng.add_request("bad", list(range(200, 210)), SamplingParams(temperature=0, max_tokens=4))
    _, bad = eng.outputs.samples["bad"]

    def broken(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")

    bad.detokenizer.add = broken
    failures = eng.get_metrics()["request_failure_total"]
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["good"].outputs[0].finish_reason == "length" and finished["good"].error is None
    assert finished["bad"].outputs[0].finish_reason == "error" and "planted" in finished["bad"].error
    assert eng.scheduler.pool.num_used == 0 and not eng.scheduler.requests
    assert eng.get_metrics()["request_failure_total"] == failures + 1


def test_a_request_whose_step_inputs_cannot_be_built_fails_alone(shared):
    llm = shared
    eng = llm.engine
    eng.add_request("good", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=4))
    eng.add_request("bad", list(range(200, 210)), SamplingParams(temperature=1.0, top_k=5, max_tokens=4))
    eng.scheduler.requests["bad"].sampling_params.top_k = 2**40     # past validation: int32 overflow
    finished = {}
    for _ in range(50):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["good"].outputs[0].finish_reason == "length"
    assert finished["bad"].outputs[0].finish_reason == "error" and finished["bad"].error
    assert eng.scheduler.pool.num_used == 0 and not eng.scheduler.requests
    # The good request's step was taken back and redone: same tokens as on its own.
    alone = llm.generate({"prompt_token_ids": list(range(100, 110))},
                         SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert finished["good"].outputs[0].token_ids == alone.outputs[0].token_ids


def test_failure_while_pipelined_is_delivered_once(shared):
    llm = shared
    eng = llm.engine
    eng.add_request("good", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=2))
    outs = eng.step()                          # good's prefill runs; its decode is dispatched
    eng.add_request("bad", list(range(200, 210)), SamplingParams(temperature=1.0, top_k=5, max_tokens=4))
    eng.scheduler.requests["bad"].sampling_params.top_k = 2**40
    seen = [o.request_id for o in outs if o.finished]
    for _ in range(20):
        if not eng.has_unfinished_requests():
            break
        seen += [o.request_id for o in eng.step() if o.finished]
    assert sorted(seen) == ["bad", "good"]      # each finished output exactly once
    assert eng.step() == [] and not eng.has_unfinished_requests()
    assert eng.scheduler.pool.num_used == 0


def test_stop_string_on_the_last_allowed_token_wins(shared):
    llm = shared
    free = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[-3:]
    assert stop.strip() and stop not in free.text[:-3]
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == free.text[:-3]


def test_request_ids_that_collide_are_refused_cleanly(shared):
    llm = shared
    eng = llm.engine
    eng.add_request("x#0", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match="collides"):
        eng.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, n=2))
    done = []
    for _ in range(20):
        if not eng.has_unfinished_requests():
            break
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == ["x#0"] and eng.scheduler.pool.num_used == 0


def test_a_reused_id_is_not_confused_with_the_aborted_one(shared):
    llm = shared
    eng = llm.engine
    eng.add_request("x", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.step()
    eng.step()                                  # a step of the old "x" is in flight
    eng.abort_request("x")
    eng.add_request("x", list(range(300, 305)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    final = None
    for _ in range(20):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                final = o
    alone = llm.generate({"prompt_token_ids": list(range(300, 305))},
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert final.outputs[0].token_ids == alone.outputs[0].token_ids


def test_final_only_requests_report_once_and_match_cumulative_ones(shared):
    llm = shared
    eng = llm.engine
    tok = eng.tokenizer
    ids = tok.encode(prompts(1)[0])
    eng.add_request("cum", ids, SamplingParams(temperature=0, max_tokens=5))
    eng.add_request("fin", ids, SamplingParams(temperature=0, max_tokens=5, output_kind="final_only"))
    seen = {"cum": [], "fin": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert len(seen["cum"]) == 5 and [o.finished for o in seen["fin"]] == [True]
    assert seen["fin"][0].outputs[0].token_ids == seen["cum"][-1].outputs[0].token_ids
    assert seen["fin"][0].outputs[0].text == seen["cum"][-1].outputs[0].text
    with pytest.raises(ValueError, match="output_kind"):
        eng.add_request("bad", ids, SamplingParams(output_kind="streaming"))


def test_detokenize_false_gives_the_same_tokens_and_no_text(shared):
    llm = shared
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("Once upon a time")}
    with_text = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate(prompt, GREEDY.clone(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and with_text.text != "" and ids_only.text == ""
    with pytest.raises(ValueError, match="stop must be empty when detokenize=False"):
        SamplingParams(stop=["\n"], detokenize=False)
