"""Multi-step decode (`num_scheduler_steps`): the scheduler's counts and blocks, and the
engine's tokens equal to one step at a time (greedy and seeded), on tiny checkpoints of a
plain, a hybrid (recurrent state) and an MLA family."""

import pytest

from jaxserve import SamplingParams
from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_messages import RunnerOutput
from tests.step_bound import bound_steps

from test_scheduler import req


def make(steps=4, max_seqs=4, blocks=32, block_size=4, max_len=64):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64,
                                     max_model_len=max_len, num_scheduler_steps=steps),
                     CacheConfig(block_size=block_size), blocks)


def tokens_for(out, per_request):
    """A RunnerOutput giving each scheduled request `per_request[i]` tokens (its num_steps)."""
    sampled = [list(t) if r.sample else [] for r, t in zip(out.scheduled, per_request)]
    return RunnerOutput(out.req_ids, sampled, [None] * len(sampled))


def test_decode_steps_count_positions_tokens_and_blocks():
    s = make()
    r = req("a", 5, max_tokens=20)
    s.add_request(r)
    prefill = s.schedule()
    assert prefill.num_steps == 1                   # a prefill chunk is one step
    decode = s.schedule()                           # pipelined: before the prefill's token
    sched = decode.scheduled[0]
    assert (decode.num_steps, sched.start_position, sched.num_tokens) == (4, 5, 1)
    assert r.num_computed_tokens == 9 and r.num_output_placeholders == 5
    assert len(s.kv.blocks["a"]) == 3            # positions 5..8 need a third 4-token block
    s.update(prefill, tokens_for(prefill, [[11]]))
    s.update(decode, tokens_for(decode, [[12, 13, 14, 15]]))
    assert r.output_token_ids == [11, 12, 13, 14, 15] and r.num_output_placeholders == 0
    nxt = s.schedule()
    assert nxt.scheduled[0].start_position == 9 and nxt.num_steps == 4


def test_a_stop_inside_the_steps_ends_the_request_and_drops_the_rest():
    s = make()
    r = req("a", 5, max_tokens=20)
    s.add_request(r)
    s.update(out := s.schedule(), tokens_for(out, [[11]]))
    out = s.schedule()
    later = s.schedule()                            # already in flight behind it
    updates = s.update(out, tokens_for(out, [[12, 2, 13, 14]]))   # 2 is EOS
    assert r.output_token_ids == [11, 12, 2] and r.status == RequestStatus.FINISHED_STOPPED
    assert updates[0].new_token_ids == [12, 2] and s.pool.num_used == 0
    s.update(later, tokens_for(later, [[1, 1, 1, 1]]))
    assert r.output_token_ids == [11, 12, 2]


def test_max_tokens_caps_the_blocks_and_ends_the_request_mid_step():
    s = make()
    r = req("a", 4, max_tokens=3)                   # positions 0..5 at most (4 + 3 - 1)
    s.add_request(r)
    s.update(out := s.schedule(), tokens_for(out, [[11]]))
    out = s.schedule()
    assert out.num_steps == 4
    assert len(s.kv.blocks["a"]) == 2            # 7 tokens' blocks (its longest), not 4 + 4
    s.update(out, tokens_for(out, [[12, 13, 14, 15]]))
    assert r.output_token_ids == [11, 12, 13] and r.status == RequestStatus.FINISHED_LENGTH
    assert s.pool.num_used == 0


@pytest.mark.parametrize("why", ["waiting", "min_tokens", "penalty", "grammar"])
def test_one_step_at_a_time_when_a_request_needs_the_host(why):
    from jaxserve.sampling_params import StructuredOutputsParams
    s = make(max_seqs=4)
    kw = {"min_tokens": dict(min_tokens=10), "penalty": dict(presence_penalty=0.5),
          "grammar": dict(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))}.get(why, {})
    s.add_request(req("a", 5, max_tokens=20, **kw))
    s.update(out := s.schedule(), tokens_for(out, [[11]]))
    if why == "waiting":                            # a slot is free: admit it next step
        s.add_request(req("b", 5, max_tokens=20))
    assert s.schedule().num_steps == 1


def test_logprobs_and_truncation_decode_in_steps():
    s = make()
    s.add_request(req("a", 5, max_tokens=20, logprobs=2, top_p=0.9, top_k=5, temperature=1.0,
                      logit_bias={3: 1.0}))
    s.update(out := s.schedule(), tokens_for(out, [[11]]))
    assert s.schedule().num_steps == 4


def test_a_full_batch_keeps_decoding_in_steps_while_others_wait():
    s = make(max_seqs=1)
    s.add_request(req("a", 5, max_tokens=20))
    s.update(out := s.schedule(), tokens_for(out, [[11]]))
    s.add_request(req("b", 5, max_tokens=20))      # no slot for it before "a" ends
    assert s.schedule().num_steps == 4


def test_an_abort_while_steps_are_in_flight_frees_everything():
    s = make()
    r = req("a", 5, max_tokens=20)
    s.add_request(r)
    s.update(out := s.schedule(), tokens_for(out, [[11]]))
    first, second = s.schedule(), s.schedule()      # two multi-step steps in flight
    assert first.num_steps == second.num_steps == 4
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.pool.num_used == 0
    s.update(first, tokens_for(first, [[1, 2, 3, 4]]))
    s.update(second, tokens_for(second, [[5, 6, 7, 8]]))
    assert r.output_token_ids == [11] and not s.requests and s.pool.num_used == 0


def test_num_scheduler_steps_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=65)


# -- the engine on tiny checkpoints -------------------------------------------------------------

def _engine(path, steps, warmup=False, attention_impl="xla", num_kv_blocks=96):
    from jaxserve.engine.builder import build_engine
    from jaxserve.models import loader, registry
    cfg, params, tok = loader.load_model(path, dtype="float32")
    config = EngineConfig(model=cfg, cache=CacheConfig(block_size=4, num_kv_blocks=num_kv_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                    max_model_len=64, num_scheduler_steps=steps),
                          dtype="float32", warmup=warmup, attention_impl=attention_impl)
    return bound_steps(build_engine(config, params, tok, registry.get_family(cfg.architecture)))


def _spy(engine) -> list[int]:
    """The num_steps of every step the engine's scheduler makes from now on."""
    seen, schedule = [], engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.append(out.num_steps)
        return out
    engine.scheduler.schedule = spy
    return seen


def test_preemption_during_multi_step_decode_keeps_tokens_and_frees_blocks(tiny_checkpoint):
    """Few blocks: requests growing K positions a step preempt each other; each recomputes
    and the tokens equal one step at a time."""
    path = tiny_checkpoint("llama")
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 18, 22)]
    want = _generate(_engine(path, 1), PROMPTS, greedy)
    engine = _engine(path, 4, num_kv_blocks=14)
    got = _generate(engine, PROMPTS, greedy)
    assert engine.scheduler.num_preemptions > 0 and got == want


def _generate(engine, prompts, params):
    """{request id: output token ids}; every block and slot is free afterwards."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    assert engine.scheduler.pool.num_used == 0 and not engine.scheduler.requests
    return done


PROMPTS = [[5, 9, 13, 2 + i, 40 + 3 * i, 7] for i in range(3)]
PARAMS = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=123, max_tokens=11, ignore_eos=True)]


def test_logprobs_top_p_and_bias_equal_one_step_at_a_time(tiny_checkpoint):
    """The full sampler in the loop: seeded top-p / top-k sampling with a logit_bias draws the
    same tokens, and each token's logprobs are the one-step engine's."""
    path = tiny_checkpoint("llama")
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=9,
                             logprobs=3, ignore_eos=True, logit_bias={17: 2.0}),
              SamplingParams(temperature=0, max_tokens=7, logprobs=1, ignore_eos=True)]
    outs = {}
    for steps in (1, 4):
        engine = _engine(path, steps)
        seen = _spy(engine)
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            engine.add_request(str(i), p, sp)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs.setdefault(steps, {})[o.request_id] = o.outputs[0]
    assert 4 in seen
    for rid in ("0", "1"):
        one, four = outs[1][rid], outs[4][rid]
        assert four.token_ids == one.token_ids and len(one.token_ids) == (9, 7)[int(rid)]
        assert [sorted(d) for d in four.logprobs] == [sorted(d) for d in one.logprobs]
        for a, b in zip(four.logprobs, one.logprobs):
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) and a[t].rank == b[t].rank


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "deepseek_v32"])
def test_tokens_equal_one_step_at_a_time(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    one = _generate(_engine(path, 1), PROMPTS, PARAMS)
    engine = _engine(path, 4)
    seen = _spy(engine)
    four = _generate(engine, PROMPTS, PARAMS)
    assert four == one
    assert 4 in seen                                 # it did run several steps at once
    assert [len(four[str(i)]) for i in range(3)] == [9, 6, 11]


def test_pallas_attention_and_no_compilation_after_warmup(tiny_checkpoint):
    """The interpreted Pallas attention in the loop gives the XLA path's greedy tokens, and
    warm-up compiled every multi-step program a step of 1-4 requests takes."""
    import jax
    path = tiny_checkpoint("llama")
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 5, 6)]
    want = _generate(_engine(path, 1), PROMPTS, greedy)
    engine = _engine(path, 3, warmup=True, attention_impl="pallas")
    engine.wait_for_warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    assert _generate(engine, PROMPTS, greedy) == want
    assert _generate(engine, PROMPTS[:1], greedy[:1]) == {"0": want["0"]}
    assert compiles == []


def test_a_stop_string_inside_the_steps_ends_the_output_at_its_token():
    """Text stop strings are matched token by token: the output ends at the token that
    completes the stop, not at the end of the step that carried it (the default model: it
    has a tokenizer)."""
    from jaxserve.engine.builder import build_engine
    from jaxserve.engine.llm import LLM
    from jaxserve.models import llama, loader, registry
    cfg, params, tok = loader.load_model(None, dtype="float32")

    def llm(steps):
        config = EngineConfig(model=cfg, cache=CacheConfig(num_kv_blocks=64),
                              scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32,
                                                        max_model_len=128,
                                                        num_scheduler_steps=steps),
                              dtype="float32", warmup=False)
        return LLM.from_engine(bound_steps(build_engine(config, params, tok, registry.LLAMA)))

    prompt = "The capital of France is"
    free = llm(1).generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    stop = free.text[-3:]
    assert stop.strip() and stop not in free.text[:-3]
    engine = llm(4)
    seen = _spy(engine.engine)
    out = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                 ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert 4 in seen
    assert out.token_ids == free.token_ids and out.text == free.text[:-3]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_the_default_is_eight_steps_only_with_the_fused_stack_and_no_speculation():
    from jaxserve.pallas_kernels.policy import AUTO_SCHEDULER_STEPS, KernelPlan

    def resolve_scheduler_steps(value, fused_kernels, speculative):
        return KernelPlan(fused=fused_kernels).scheduler_steps(value, speculative)
    assert resolve_scheduler_steps(None, ("linear", "moe"), None) == AUTO_SCHEDULER_STEPS == 8
    assert resolve_scheduler_steps(None, ("moe",), None) == 1         # a MoE model: device-bound
    assert resolve_scheduler_steps(None, ("linear",), object()) == 1  # speculating
    assert resolve_scheduler_steps(3, (), None) == 3                  # as asked
