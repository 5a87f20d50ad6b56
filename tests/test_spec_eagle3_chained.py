"""Chained EAGLE3 drafts (num_speculative_tokens > 1) on the tiny Llama: greedy outputs equal
those without speculation, batched, alone and under preemption; each chain is what the head
predicts running on its own drafts over the whole sequence; a head right by construction has
every draft at every position accepted; the scheduler allocates the chain's lookahead blocks
and the head's cache is paid from the KV budget."""

import jax.numpy as jnp

from jaxserve import SamplingParams
from jaxserve.core.kv_cache import manager as cache_manager
from jaxserve.models import llama
from jaxserve.spec_decode import eagle3
from tests.spec_helpers import make_llm, record_drafts, spec_counts, token_ids, write_eagle3_head
from tests.test_spec_decode import MAX_LEN, prompts
from tests.test_spec_eagle3 import GREEDY, eagle, model  # noqa: F401 (the fixture)

K = 3


def per_position(counts, k):
    return [counts.get(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}', 0)
            for p in range(k)]


def test_chained_drafts_change_no_greedy_output(model, tmp_path):
    head = write_eagle3_head(tmp_path / "head", model[0], draft_vocab=64, aux_layers=(0, 1, 1))
    want = token_ids(make_llm(model, max_len=MAX_LEN).generate(prompts(4), GREEDY, use_tqdm=False))
    spec = make_llm(model, eagle(head, K), max_len=MAX_LEN)
    assert token_ids(spec.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert [token_ids(spec.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts(2)] == want[:2]
    c = spec_counts(spec)
    assert c["spec_decode_num_draft_tokens_total"] > c["spec_decode_num_drafts_total"] > 0
    assert all(len(d) == K for d in spec.engine.core.proposer._drafts.values())
    assert spec.engine.scheduler.pool.num_used == 0
    # The engine pipelined (the drafts on the device) and voided chunks past rejections.
    assert spec.engine.scheduler.num_chunks_past_drafts > 0 and spec.engine.scheduler.num_void_chunks > 0
    # Sampled (the rejection sampler, one-hot q): runs, max_tokens kept exactly.
    sampled = spec.generate(prompts(4), SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1),
                            use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in sampled] == [10] * 4
    assert spec.engine.scheduler.pool.num_used == 0
    # Few blocks: requests are preempted and recompute, the head's cache with them.
    tight = make_llm(model, eagle(head, K), max_len=MAX_LEN, num_kv_blocks=14)
    assert token_ids(tight.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.scheduler.pool.num_used == 0


def test_each_chain_is_the_heads_own_continuation_over_the_whole_sequence(model, tmp_path):
    """Draft j + 1 is what the head predicts over the whole sequence (fresh caches) with drafts
    1..j appended, each fed the head's own output at the position before: the chained steps'
    positions, K/V slots, lookahead blocks and hidden feed match a pass that has none of them,
    also after rejected drafts (their stale K/V must not be read) and after preemption (the
    recompute rewrites the head's cache: few blocks here)."""
    import jax
    import jax.numpy as jnp

    from tests.models.model_step_builder import Chunk, build_step, scattered_block_tables

    cfg, params, _ = model
    head = write_eagle3_head(tmp_path / "head", cfg, draft_vocab=64, aux_layers=(1, 0, 1), seed=3)
    spec = make_llm(model, eagle(head, K), max_len=MAX_LEN, num_kv_blocks=10)
    proposer, scheduler = spec.engine.core.proposer, spec.engine.scheduler
    seen = record_drafts(spec, prompts(3))
    assert len(seen) >= 8 and scheduler.num_preemptions > 0
    c = spec_counts(spec)
    assert c["spec_decode_num_accepted_tokens_total"] < c["spec_decode_num_draft_tokens_total"]
    hcfg, hp, embed = proposer.cfg, proposer.params, proposer.embed
    tables = scattered_block_tables(1, 16, 32, seed=1)
    kernels = llama.make_kernels(hcfg)

    def zeros(c):
        return [{n: jnp.zeros((32, 4, *shape)) for n, shape in s.arrays} for s in llama.cache_specs(c)]

    @jax.jit
    def streams(x):
        _, _, aux = llama.forward(cfg, params, zeros(cfg), x, "xla", (0, 1))
        return jnp.concatenate([aux[1], aux[0], aux[1]], -1)

    @jax.jit
    def head_pass(x, h_TD):
        _, ids, out = eagle3.head_layer(hcfg, hp, zeros(hcfg)[0], x, embed, h_TD, kernels)
        return ids, out

    def step(tokens):
        return build_step([Chunk(0, tokens, 0)], tables, 4, 64, 1)

    for tokens, drafts in seen:
        n = len(tokens) - 1                            # head positions 0..n-1 read tokens[1:]
        h = jnp.zeros((64, cfg.hidden_size)).at[:n].set(
            eagle3.layers.linear(streams(step(tokens[:-1]))[:n], hp["fc"]))
        inputs, want = list(tokens[1:]), []
        for j in range(K):
            ids, out = head_pass(step(inputs), h)
            last = len(inputs) - 1
            want.append(int(ids[last]))
            inputs.append(want[-1])
            h = h.at[last + 1].set(out[last])
        assert drafts == want, (tokens, drafts, want)


def right_by_construction(model, tmp_path):
    """A target whose logits are all 0 (final norm 0: greedy always picks token 0) and a head
    whose logits are all 0 too (it always drafts draft id 0, target id 0): every draft is right."""
    cfg, params, tok = model
    head = write_eagle3_head(tmp_path / "perfect", cfg, draft_vocab=cfg.vocab_size, aux_layers=(0, 1, 1),
                             zero_norm=True)
    return (cfg, {**params, "final_norm": jnp.zeros_like(params["final_norm"])}, tok), head


def test_a_head_right_by_construction_has_every_chained_draft_accepted(model, tmp_path):
    target, head = right_by_construction(model, tmp_path)
    spec = make_llm(target, eagle(head, K), max_len=MAX_LEN)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # Alone: the prefill samples 1 token, two steps keep 1 + 3 each (9), the last draft_limit 0.
    assert token_ids(spec.generate(prompts(1), params, use_tqdm=False)) == [[[0] * 10]]
    c = spec_counts(spec)
    assert (c["spec_decode_num_drafts_total"], c["spec_decode_num_draft_tokens_total"],
            c["spec_decode_num_accepted_tokens_total"]) == (2, 6, 6)
    assert per_position(c, K) == [2, 2, 2]
    # Batched, across block boundaries (P = 4), near max_model_len (drafts cut to the limit).
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = token_ids(spec.generate(prompts(4), long, use_tqdm=False))
    assert all(set(o[0]) == {0} for o in outs)
    c = spec_counts(spec)
    assert c["spec_decode_num_accepted_tokens_total"] == c["spec_decode_num_draft_tokens_total"]
    assert min(per_position(c, K)) > 2
    assert spec.engine.scheduler.pool.num_used == 0


def test_the_scheduler_allocates_the_chains_lookahead_blocks(model, tmp_path):
    """Chained steps write K - 1 positions past a chunk: its blocks cover them, up to the
    request's longest sequence (prompt + max_tokens, max_model_len)."""
    target, head = right_by_construction(model, tmp_path)
    spec = make_llm(target, eagle(head, K), max_len=MAX_LEN)
    scheduler = spec.engine.scheduler
    assert scheduler.num_lookahead_tokens == K - 1
    seen = []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        for s in out.scheduled:
            seen.append((s.start_position + s.num_tokens, len(scheduler.kv.blocks[s.req_id])))
        return out

    scheduler.schedule = recording
    prompt = prompts(1)[0]
    n_prompt = len(prompt["prompt_token_ids"])
    spec.generate(prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    for end, blocks in seen:
        assert blocks == -(-min(end + K - 1, n_prompt + 9) // 4), (end, blocks)


def test_the_heads_cache_is_paid_from_the_kv_budget(model, tmp_path):
    head = write_eagle3_head(tmp_path / "head", model[0], draft_vocab=64, aux_layers=(0, 1, 1))
    cfg = model[0]
    per_target = cache_manager.bytes_per_block(llama.cache_specs(cfg), 4, 4)
    per_head = cache_manager.bytes_per_block(eagle3.cache_specs(head, cfg), 4, 4)
    assert per_head > 0
    budget = 30 * (per_target + per_head) + eagle3.weight_bytes(head)
    plain = make_llm(model, cache_bytes=budget)     # max_len 128: room for 8 * 32 + 1 blocks
    spec = make_llm(model, eagle(head, K), cache_bytes=budget)
    assert spec.engine.runner.num_blocks == 30
    assert plain.engine.runner.num_blocks == budget // per_target > 30
    assert spec.engine.runner.bytes_per_block == per_target + per_head
    assert spec.engine.core.proposer.cache["k"].shape[0] == 30


def test_a_chained_input_has_one_token_per_sampling_sequence_at_its_next_position():
    """Sampling sequences first (x's order kept), the others padding; slots on each one's
    table; a position past the table writes the null slot and reads as the table's last."""
    import numpy as np

    from jaxserve.spec_decode import hidden_steps
    from tests.models.model_step_builder import Chunk, build_step, scattered_block_tables

    tables = scattered_block_tables(3, 10, 32, seed=2)           # 40 positions each, P = 4
    x = build_step([Chunk(0, [1, 2, 3], 0), Chunk(1, [4, 5], 6), Chunk(2, [7], 37)], tables, 4, 16, 4)
    sample = np.array([True, False, True, False])
    order, back = hidden_steps.chain_order(sample)
    assert order.tolist() == [0, 2, 1, 3] and order[back].tolist() == [0, 1, 2, 3]
    for step, (p0, p2) in enumerate([(3, 38), (4, 39), (5, 39)], start=1):
        x_j = hidden_steps.chained_input(x, sample, order, step, 4)
        assert x_j.positions.tolist() == [p0, p2, 0, 0]
        assert x_j.seq_lens.tolist() == [p0 + 1, p2 + 1, 0, 0]
        assert x_j.query_start_loc.tolist() == [0, 1, 2, 2, 2]
        slot2 = tables[2][p2 // 4] * 4 + p2 % 4 if 37 + step < 40 else 0
        assert x_j.slot_mapping.tolist() == [tables[0][p0 // 4] * 4 + p0 % 4, slot2, 0, 0]
        assert (np.asarray(x_j.block_tables[:2]) == tables[[0, 2]]).all()
        assert not np.asarray(x_j.block_tables[2:]).any()
