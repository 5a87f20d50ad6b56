"""StepTrace records what the scheduler did, step by step (tiny random llama: fast)."""

import pytest

from jaxserve.engine import builder
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.trace import StepTrace

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True}
BUDGET, MAX_TOKENS = 16, 10


@pytest.fixture(scope="module")
def traced():
    """Five requests sharing a 3-block prefix, a budget that chunks prompts, and a cache of
    11 blocks of 4 tokens: chunked prefill, prefix hits and preemptions all happen."""
    engine = builder.from_engine_args(TINY_LLAMA, load_format="dummy", max_num_seqs=4,
                                      max_num_batched_tokens=BUDGET, max_model_len=128,
                                      block_size=4, num_kv_blocks=12, warmup=False)
    trace = StepTrace.attach(engine)
    shared = list(range(1, 13))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", shared + list(range(20 + i, 21 + 4 * i)), params)
    while engine.has_unfinished_requests():
        engine.step()
    trace.detach()
    return engine, trace


def test_steps_account_for_every_token(traced):
    engine, trace = traced
    assert [s.step for s in trace.steps] == list(range(len(trace.steps)))
    for s in trace.steps:
        assert s.num_tokens == sum(c.num_tokens for c in s.chunks) <= BUDGET
        assert s.num_tokens == s.num_prefill_tokens + s.num_decode_tokens
        assert 1 <= s.kv_blocks_used <= s.kv_blocks_total == 11
        assert s.kv_blocks_used == len({b for c in s.chunks for b in c.block_ids})
    assert trace.steps[-1].num_waiting == 0 and engine.scheduler.pool.num_used == 0
    # every output token was sampled once, preemptions or not
    sampled = {rid: 0 for rid in trace.request_ids()}
    for s in trace.steps:
        for c in s.chunks:
            sampled[c.request_id] += c.sampled_token is not None
    assert sampled == {f"r{i}": MAX_TOKENS for i in range(5)}
    assert trace.request_ids() == [f"r{i}" for i in range(5)]


def test_prefill_is_chunked_and_the_prefix_cache_and_preemption_show(traced):
    engine, trace = traced
    whole, part = trace.steps[0].chunks        # r0's whole prompt, then the start of r1's
    assert whole.request_id == "r0" and whole.is_prefill and whole.sampled_token is not None
    assert whole.num_tokens == 13 and len(whole.block_ids) == 4       # 13 tokens in blocks of 4
    assert part.request_id == "r1" and part.num_tokens == BUDGET - 13 and part.sampled_token is None
    assert sum(s.prefix_cache_hit_tokens for s in trace.steps) >= 12 * 4   # r1..r4 reuse the prefix
    preempted = [rid for s in trace.steps for rid in s.preempted_ids]
    assert preempted and len(preempted) == engine.scheduler.num_preemptions
    for s in trace.steps:              # a preempted request is re-admitted later
        for rid in s.preempted_ids:
            assert any(rid in later.new_ids for later in trace.steps[s.step:])


def test_views(traced):
    _, trace = traced
    by_request = trace.tokens_by_request()
    assert all(len(v) == len(trace.steps) for v in by_request.values())
    assert [sum(col) for col in zip(*by_request.values())] == [s.num_tokens for s in trace.steps]
    rows = trace.rows()
    assert len(rows) == len(trace.steps) and rows[0]["requests"].startswith("r0:13p")
    assert len(trace.format_table().splitlines()) == len(trace.steps) + 1


def test_detach_stops_recording(traced):
    engine, trace = traced
    assert trace not in engine.step_listeners
    before = len(trace.steps)
    engine.add_request("late", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(trace.steps) == before
