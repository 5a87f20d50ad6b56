"""Structured output with speculative decoding: a constrained request's drafts are cut at the
first token its grammar rejects, every logits row of a verifying step gets the mask after
the drafts before it, and the matcher commits only the kept tokens.

On the tiny random-weight Llama with the byte-level tokenizer of tests/test_structured.py:
constrained greedy output equals constrained output without speculation (n-gram drafts and
a draft model and EAGLE3, batched with unconstrained requests), random sampling always conforms, no
verified draft breaks its grammar, and after every step each matcher is the one a fresh
matcher fed only the kept tokens would be.
"""

from __future__ import annotations

import os
import shutil
import types

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.structured import StructuredOutputsParams as SO
from jaxserve.structured import masks
from jaxserve.structured.compiler import GrammarCompiler
from tests.spec_helpers import spec_counts
from tests.test_structured import CASES, CKPT, _matches, ckpt_dir, llm, tiny_tokenizer  # noqa: F401

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, warmup=False)
# Repetitive prompts: the n-gram proposer finds drafts in them (and in the outputs)
PROMPTS = ["abab-1abab-1", "yes no yes no", '{"ab": "a", "n": 12}{"ab": "a", "n": 12}', "abcabc"]
REGEX = SO(regex=r"[ab]{8,30}")   # long enough for repeats in the output: accepted drafts


def _params(temperature: float, seed: int = 0) -> list[SamplingParams]:
    """JSON schema, regex and choice requests beside a plain one (the same batch)."""
    return ([SamplingParams(temperature=temperature, seed=seed + i, max_tokens=40, structured_outputs=so)
             for i, so in enumerate([CASES[2], REGEX, CASES[1]])]
            + [SamplingParams(temperature=temperature, seed=seed + 3, max_tokens=16)])


@pytest.fixture(scope="module")
def ngram_llm(ckpt_dir):
    return LLM(ckpt_dir, speculative_config=NGRAM, **ENGINE)


def write_ab_draft(path) -> str:
    """The tiny checkpoint made a draft that only ever drafts "a" or "b": its final norm keeps
    one channel and its lm_head reads only that one, +1 for "b", -1 for "a" (mostly "b" here). Its drafts fit
    REGEX (verified, some accepted) and rarely the JSON or choice grammars (cut)."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(CKPT, "config.json"), path)
    tensors = load_file(os.path.join(CKPT, "model.safetensors"))
    a, b = (tiny_tokenizer().encode(s)[0] for s in "ab")
    tensors["model.norm.weight"] = np.eye(1, tensors["model.norm.weight"].shape[0], dtype=np.float32)[0]
    head = np.zeros_like(tensors["lm_head.weight"])
    head[b, 0], head[a, 0] = 1.0, -1.0
    tensors["lm_head.weight"] = head
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def draft_llm(ckpt_dir, tmp_path_factory):
    draft = write_ab_draft(tmp_path_factory.mktemp("ab_draft"))
    return LLM(ckpt_dir, speculative_config={"method": "draft_model", "model": draft,
                                             "num_speculative_tokens": 3}, **ENGINE)


def _fresh(grammars, so: SO, tokens):
    """A new matcher fed `tokens` one by one the way the committed path feeds them (nothing
    after it stops)."""
    m = grammars.matcher(so)
    for t in tokens:
        if m.is_stopped():
            break
        assert m.consume_token(t)
    return m


class Spy:
    """Checks every step of an engine: each verified draft of a constrained request is valid
    for a fresh matcher fed its committed tokens, and after the step its matcher equals a
    fresh one fed the kept tokens only. Counts verified and cut drafts."""

    def __init__(self, engine, monkeypatch):
        self.structured, self.grammars = engine.core.structured, engine.grammars
        self.verified = self.cut = self.checked = 0
        fill, accept, cut = masks.fill_step_masks, self.structured.accept, self.structured.valid_drafts
        monkeypatch.setattr(masks, "fill_step_masks",
                            lambda g, allowed, rows, last: self._filling(rows) or fill(g, allowed, rows, last))
        monkeypatch.setattr(self.structured, "accept", lambda updates: self._accepted(accept(updates)))
        monkeypatch.setattr(self.structured, "valid_drafts", lambda rid, d: self._cut(d, cut(rid, d)))

    def _cut(self, drafts, kept):
        self.cut += len(drafts) - len(kept)
        return kept

    def _filling(self, constrained):
        for c in constrained:
            if c.drafts:
                so = c.request.sampling_params.structured_outputs
                fresh = _fresh(self.grammars, so, c.request.output_token_ids)
                assert not fresh.is_stopped() and fresh.validate_tokens(list(c.drafts)) == len(c.drafts)
                assert len(c.draft_rows) == len(c.drafts)
                self.verified += len(c.drafts)

    def _accepted(self, result):
        for req in self.structured.requests.values():
            req.grammar.catch_up(req.output_token_ids)
            fresh = _fresh(self.grammars, req.sampling_params.structured_outputs, req.output_token_ids)
            m = req.grammar.matcher
            assert not m.is_error()
            assert (m.is_stopped(), m.is_accepting()) == (fresh.is_stopped(), fresh.is_accepting())
            assert m.compute_bitmask() == fresh.compute_bitmask()
            self.checked += 1
        return result


# ---- the masks of a verifying step -----------------------------------------------------------

@pytest.fixture(scope="module")
def grammars():
    return GrammarCompiler(tiny_tokenizer(), 256, [2])


def _allowed(allowed_SW, row):
    return np.unpackbits(allowed_SW[row], count=256, bitorder="little").astype(bool)


def _mask_of(grammars, matcher):
    allowed = np.full((1, 32), 0xFF, np.uint8)
    masks.fill_masks(grammars.executor, allowed, [(0, matcher)], grammars.mask_words)
    return _allowed(allowed, 0)


def _request(grammars, so, output=()):
    g = masks.RequestGrammar(grammars.matcher(so))
    return types.SimpleNamespace(req_id="r", grammar=g, output_token_ids=list(output))


def test_each_draft_row_gets_the_mask_after_the_drafts_before_it_and_the_matcher_rolls_back(grammars):
    tok = tiny_tokenizer()
    so = SO(regex=r"[ab]{2,4}-\d")
    a, b, dash, one = (tok.encode(s)[0] for s in "ab-1")
    with_drafts = _request(grammars, so, [a])
    plain = _request(grammars, SO(choice=["yes", "no"]))
    before = with_drafts.grammar.matcher.compute_bitmask()
    drafts = (b, dash, one)
    allowed = np.full((8, 32), 0xFF, np.uint8)
    constrained = [masks.ConstrainedRows(0, with_drafts, False, drafts, (4, 5, 6)),
                   masks.ConstrainedRows(1, plain)]
    masks.fill_step_masks(grammars, allowed, constrained, None)
    for j, row in enumerate([4, 5, 6, 0]):          # draft rows, then the bonus row
        want = _mask_of(grammars, _fresh(grammars, so, [a, *drafts[:j]]))
        np.testing.assert_array_equal(_allowed(allowed, row), want)
    np.testing.assert_array_equal(_allowed(allowed, 1), _mask_of(grammars, grammars.matcher(SO(choice=["yes", "no"]))))
    assert np.all(allowed[[2, 3, 7]] == 0xFF)     # rows of no grammar are untouched
    m = with_drafts.grammar.matcher
    assert m.compute_bitmask() == before and not m.is_error() and with_drafts.grammar.consumed == 1


def test_an_invalid_draft_is_rejected_by_its_own_row_and_leaves_the_matcher_clean(grammars):
    """Drafts are cut before scheduling; should an invalid one reach the masks, the row that
    verifies it rejects it (so the rows after it are never kept) and nothing is consumed past it."""
    tok = tiny_tokenizer()
    so = SO(regex=r"[ab]{2,4}-\d")
    a, z = tok.encode("a")[0], tok.encode("z")[0]
    req = _request(grammars, so)
    before = req.grammar.matcher.compute_bitmask()
    allowed = np.full((4, 32), 0xFF, np.uint8)
    masks.fill_step_masks(grammars, allowed, [masks.ConstrainedRows(0, req, False, (a, z, a), (1, 2, 3))], None)
    assert _allowed(allowed, 1)[a] and not _allowed(allowed, 2)[z]
    assert req.grammar.matcher.compute_bitmask() == before and not req.grammar.matcher.is_error()


def test_rows_past_the_grammars_end_allow_only_eos_as_without_drafts(grammars):
    """A draft that ends the grammar: the rows after it allow only EOS (a stopped matcher
    consumes nothing, as on the committed path), and the rollback undoes only what was consumed."""
    tok = tiny_tokenizer()
    a, b = (tok.encode(s)[0] for s in "ab")
    so = SO(choice=["ab"])
    req = _request(grammars, so, [a])
    assert req.grammar.valid_drafts([a], [b, 2, 2]) == 2
    allowed = np.full((3, 32), 0xFF, np.uint8)
    masks.fill_step_masks(grammars, allowed, [masks.ConstrainedRows(0, req, False, (b, 2), (1, 2))], None)
    assert np.flatnonzero(_allowed(allowed, 1)).tolist() == [b]
    assert np.flatnonzero(_allowed(allowed, 2)).tolist() == [2] == np.flatnonzero(_allowed(allowed, 0)).tolist()
    assert not req.grammar.matcher.is_stopped() and req.grammar.matcher.validate_tokens([b]) == 1


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(grammars):
    tok = tiny_tokenizer()
    a, b, z = (tok.encode(s)[0] for s in "abz")
    req = _request(grammars, SO(choice=["abab"]))
    assert req.grammar.valid_drafts([a], [b, a, z, b]) == 2
    assert req.grammar.consumed == 1                 # the output was committed, the drafts not
    assert req.grammar.valid_drafts([a, b, a, b], [2, 2]) == 0 and req.grammar.matcher.is_stopped()


# ---- end to end ------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["ngram_llm", "draft_llm"])
def test_constrained_greedy_with_drafts_equals_without(request, llm, which, monkeypatch):
    spec = request.getfixturevalue(which)
    spy = Spy(spec.engine, monkeypatch)
    before = spec.get_metrics()
    want = llm.generate(PROMPTS, _params(0.0), use_tqdm=False)
    got = spec.generate(PROMPTS, _params(0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for so, out in zip([CASES[2], REGEX, CASES[1]], got):
        assert _matches(so, out.outputs[0].text), out.outputs[0].text
    after = spec.get_metrics()
    drafted = after["spec_decode_num_draft_tokens_total"] - before["spec_decode_num_draft_tokens_total"]
    accepted = after["spec_decode_num_accepted_tokens_total"] - before["spec_decode_num_accepted_tokens_total"]
    assert spy.verified > 0 and 0 < accepted < drafted      # drafts accepted and rejected
    assert spy.checked > 0
    if which == "draft_llm":
        assert spy.cut > 0         # "a" and "b" drafts leave the JSON and choice grammars
    assert spec.engine.scheduler.pool.num_used == 0 and not spec.engine.scheduler.requests


@pytest.mark.parametrize("which", ["ngram_llm", "draft_llm"])
def test_random_sampling_with_drafts_always_matches(request, which, monkeypatch):
    spec = request.getfixturevalue(which)
    spy = Spy(spec.engine, monkeypatch)
    for seed in (0, 10):
        outs = spec.generate(PROMPTS, _params(0.9, seed), use_tqdm=False)
        for so, out in zip([CASES[2], REGEX, CASES[1]], outs):
            assert _matches(so, out.outputs[0].text), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"
    assert spy.verified > 0 and spy.checked > 0
    assert spec.engine.scheduler.pool.num_used == 0


def test_preempted_constrained_requests_with_drafts_replay_their_tokens(ckpt_dir, llm):
    small = LLM(ckpt_dir, speculative_config=NGRAM, **{**ENGINE, "max_model_len": 64},
                num_kv_blocks=10, block_size=4)
    so = SO(regex="[ab]{12,20}")
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=so) for _ in range(4)]
    prompts = [f"ab{i}ab{i}" for i in range(4)]
    outs = small.generate(prompts, params, use_tqdm=False)
    m = small.get_metrics()
    assert m["num_preemptions_total"] > 0 and m["spec_decode_num_draft_tokens_total"] > 0
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    assert small.engine.scheduler.pool.num_used == 0


def write_b_head(path, target_cfg) -> str:
    """A random EAGLE3 head that always drafts "b": its final norm is 0 (every logit 0: it
    drafts draft id 0) and its d2t maps draft id 0 to "b" (swapped with the id that had it)."""
    from safetensors.numpy import load_file, save_file

    from tests.spec_helpers import write_eagle3_head

    head = write_eagle3_head(path, target_cfg, draft_vocab=64, aux_layers=(0, 1, 1), zero_norm=True)
    tensors = load_file(os.path.join(head, "model.safetensors"))
    targets = np.arange(64) + tensors["d2t"]
    b = tiny_tokenizer().encode("b")[0]
    holder = np.flatnonzero(targets == b)
    if len(holder):
        targets[holder[0]] = targets[0]
    targets[0] = b
    tensors["d2t"] = (targets - np.arange(64)).astype(np.int64)
    save_file(tensors, os.path.join(head, "model.safetensors"))
    return head


def test_eagle3_drafts_keep_constrained_greedy_output(ckpt_dir, llm, tmp_path, monkeypatch):
    """A proposer reading the target's hidden states: its verifying masked steps run as one
    program that also returns them."""
    head = write_b_head(tmp_path / "head", llm.engine.config.model)
    spec = LLM(ckpt_dir, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2},
               **ENGINE)
    spy = Spy(spec.engine, monkeypatch)
    want = llm.generate(PROMPTS, _params(0.0), use_tqdm=False)
    got = spec.generate(PROMPTS, _params(0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spy.verified > 0 and spy.cut > 0 and spy.checked > 0
    assert spec_counts(spec)["spec_decode_num_accepted_tokens_total"] > 0
    assert spec.engine.scheduler.pool.num_used == 0
