"""The rejection sampler against definitions: greedy acceptance, exactness of the kept tokens'
distribution (empirical, as tests/test_sampler.py), q == p accepts everything."""

import jax
import numpy as np
import pytest

from jaxserve.sample.sampler import SamplingRow, make_sampling_tensors
from jaxserve.sampling_params import SamplingParams
from jaxserve.sample.rejection_sampler import verify
from tests import test_sampler

V, L = 8, 16
DRAWS = 20_000
P0 = test_sampler.LOGITS_V
P1 = P0[::-1].copy()

verify_jit = jax.jit(verify, static_argnames=("num_top", "truncate", "kernels"))


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def layout(num_seqs, k):
    """Rows of S sequences with k drafts each: bonus rows 0..S-1, then each sequence's drafts."""
    rows_SK = num_seqs + np.arange(num_seqs * k, dtype=np.int32).reshape(num_seqs, k)
    return rows_SK, np.full(num_seqs, k, np.int32)


def tensors(params, num_seqs, k):
    """Sampling rows in row order: bonus rows (offset k), then draft rows (offset j)."""
    rows = [SamplingRow(params, [1], [], seed=i, offset=k) for i in range(num_seqs)]
    rows += [SamplingRow(params, [1], [], seed=i, offset=j) for i in range(num_seqs) for j in range(k)]
    return make_sampling_tensors(rows, len(rows), V, L)


def run(params, draft_logits, drafts_SK, bonus_logits, draft_probs=None, num_top=0):
    S, k = drafts_SK.shape
    rows_SK, n_S = layout(S, k)
    logits = np.concatenate([np.broadcast_to(bonus_logits, (S, V)),
                             np.broadcast_to(np.stack(draft_logits), (S, k, V)).reshape(S * k, V)])
    draft_ids = np.concatenate([np.full(S, -1, np.int32), drafts_SK.reshape(-1).astype(np.int32)])
    out = verify_jit(logits, tensors(params, S, k), draft_ids, rows_SK, n_S, num_top=num_top,
                     draft_probs_RV=draft_probs)
    emitted = np.asarray(out.rows.token_ids)
    tokens = np.concatenate([emitted[rows_SK], emitted[:S, None]], axis=1)
    return tokens, np.asarray(out.num_accepted), np.asarray(out.last_ids)


def assert_distribution(samples, want):
    counts = np.bincount(samples, minlength=V)
    n = len(samples)
    got = counts / n
    assert np.all(counts[want == 0] == 0), (counts, want)
    assert 0.5 * np.abs(got - want).sum() < 3 * np.sqrt(V / n), (got, want)
    kept = want > 0
    chi2 = ((counts[kept] - n * want[kept]) ** 2 / (n * want[kept])).sum()
    assert chi2 < 30, (chi2, counts, want)


def test_greedy_accepts_while_the_draft_is_the_argmax():
    greedy = SamplingParams(temperature=0)
    # argmax of P0 is 0, of P1 is 7: drafts [0, 7] both right, the bonus row's argmax (P0) is 0
    tokens, acc, last = run(greedy, [P0, P1], np.array([[0, 7], [0, 3], [5, 7]]), P0)
    assert acc.tolist() == [2, 1, 0]
    assert tokens[0].tolist() == [0, 7, 0]          # two drafts, then the bonus token
    assert tokens[1, :2].tolist() == [0, 7]          # second draft rejected: the argmax instead
    assert tokens[2, :1].tolist() == [0]
    assert last.tolist() == [0, 7, 0]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                dict(top_p=0.8, min_p=0.05)])
def test_fixed_drafts_keep_the_target_distribution(kw, monkeypatch):
    """A proposer without probabilities (one-hot q): the first kept token is distributed as the
    target's (after temperature / truncation), and so is the second given the first draft was
    accepted."""
    drafts = np.tile(np.array([[1, 6]]), (DRAWS, 1))
    tokens, acc, _ = run(SamplingParams(**kw), [P0, P1], drafts, P0)
    want0 = test_sampler.expected(**kw)              # the sampler test's definition, over P0
    monkeypatch.setattr(test_sampler, "LOGITS_V", P1)
    want1 = test_sampler.expected(**kw)
    assert_distribution(tokens[:, 0], want0)
    second = tokens[acc >= 1, 1]
    assert len(second) > 1000
    assert_distribution(second, want1)
    # Acceptance of draft 1 happens with probability p(1).
    assert abs((acc >= 1).mean() - want0[1]) < 0.02


def test_drafts_drawn_from_q_keep_the_target_distribution():
    rng = np.random.default_rng(0)
    q = softmax(rng.normal(size=V)).astype(np.float32)
    drafts = rng.choice(V, size=(DRAWS, 1), p=q / q.sum())
    probs = np.concatenate([np.zeros((DRAWS, V), np.float32), np.broadcast_to(q, (DRAWS, V))])
    tokens, acc, _ = run(SamplingParams(temperature=1.0), [P0], drafts, P1, draft_probs=probs)
    assert_distribution(tokens[:, 0], softmax(P0.astype(np.float64)))
    # Acceptance rate of exact speculative sampling: sum_x min(p, q).
    assert abs(acc.mean() - np.minimum(softmax(P0.astype(np.float64)), q).sum()) < 0.02
    # Given acceptance, the bonus token is the bonus row's sample.
    assert_distribution(tokens[acc == 1, 1], softmax(P1.astype(np.float64)))


def test_q_equal_to_p_accepts_every_draft():
    p = softmax(P0.astype(np.float64)).astype(np.float32)
    n = 2000
    drafts = np.random.default_rng(1).choice(V, size=(n, 1), p=p / p.sum())
    probs = np.concatenate([np.zeros((n, V), np.float32), np.broadcast_to(p, (n, V))])
    _, acc, _ = run(SamplingParams(temperature=1.0), [P0], drafts, P0, draft_probs=probs)
    assert acc.mean() > 0.99


def test_logprobs_are_those_of_each_emitted_token():
    S, k = 1, 2
    rows_SK, n_S = layout(S, k)
    logits = np.stack([P0, P0, P1])
    out = verify_jit(logits, tensors(SamplingParams(temperature=0), S, k),
                     np.array([-1, 0, 7], np.int32), rows_SK, n_S, num_top=2)
    logp = np.log(softmax(P1.astype(np.float64)))
    assert np.isclose(float(out.rows.logprobs[2]), logp[7], atol=1e-5)
    assert out.rows.top_ids[2].tolist() == [7, 6]
