"""The jitted sampler against plain-numpy definitions: distributions, seeds, logprobs, penalties."""

from collections import Counter

import jax
import numpy as np
import pytest

from jaxserve.sample.sampler import (SamplingRow, make_sampling_tensors, needs_extras, processed_logits,
                              prompt_logprobs, sample)
from jaxserve.sampling_params import SamplingParams

V, L = 8, 16                   # tiny vocabulary and max_model_len for the distribution tests
DRAWS = 20_000                 # rows (each its own seed) per distribution test
LOGITS_V = np.array([2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.5, -1.0], np.float32)

sample_jit = jax.jit(sample, static_argnums=2)


def rows_for(params, n, seed0=0, prompt=(1, 2), output=(), offset=0, eos=()):
    return [SamplingRow(params, list(prompt), list(output), seed=seed0 + i, offset=offset,
                        eos_token_ids=tuple(eos)) for i in range(n)]


def draw(params) -> np.ndarray:
    t = make_sampling_tensors(rows_for(params, DRAWS), DRAWS, V, L)
    logits = np.broadcast_to(LOGITS_V, (DRAWS, V))
    return np.asarray(sample_jit(logits, t, 0).token_ids)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Definitions: min_p on probs, then top_k, then top_p over the renormalized rest."""
    p = softmax(LOGITS_V.astype(np.float64) / temperature)
    keep = p >= min_p * p.max()
    order = np.argsort(-p)
    if top_k:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    mass_before = np.cumsum(q[order]) - q[order]
    keep[order[mass_before >= top_p]] = False
    return np.where(keep, p, 0) / np.where(keep, p, 0).sum()


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0),
                                dict(top_k=3), dict(top_p=0.7), dict(temperature=0.7, top_p=0.9),
                                dict(min_p=0.3), dict(min_p=0.1, top_k=5, top_p=0.8, temperature=1.3)])
def test_empirical_distribution(kw):
    want = expected(**kw)
    counts = np.bincount(draw(SamplingParams(**kw)), minlength=V)
    got = counts / DRAWS
    # Excluded tokens are never drawn; total variation within 0.02 (about 3x its expected
    # size at 20k draws) and Pearson chi-square under 30 (p ~ 1e-4 at 7 degrees of freedom).
    assert np.all(counts[want == 0] == 0), (counts, want)
    assert 0.5 * np.abs(got - want).sum() < 0.02, (got, want)
    kept = want > 0
    chi2 = ((counts[kept] - DRAWS * want[kept]) ** 2 / (DRAWS * want[kept])).sum()
    assert chi2 < 30, (chi2, counts, want)


def test_greedy_and_padding_rows_take_the_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    rows = rows_for(SamplingParams(temperature=0.0), 3) + rows_for(SamplingParams(temperature=1e-6), 1)
    out = sample_jit(logits, make_sampling_tensors(rows, 6, 50, L), 0)   # rows 4, 5 are padding
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_seed_and_offset_decide_the_draw_whatever_the_batch():
    vocab = 1000
    rng = np.random.default_rng(1)
    row_logits = rng.standard_normal(vocab).astype(np.float32)
    p = SamplingParams(temperature=1.0)
    me = SamplingRow(p, [1], [2, 3], seed=1234, offset=2)

    def token_of_me(others, num_seqs, position):
        rows = list(others)
        rows.insert(position, me)
        logits = rng.standard_normal((num_seqs, vocab)).astype(np.float32)
        logits[position] = row_logits
        out = sample_jit(logits, make_sampling_tensors(rows, num_seqs, vocab, L), 0)
        return int(out.token_ids[position])

    alone = token_of_me([], 1, 0)
    assert token_of_me(rows_for(p, 5, seed0=7), 8, 3) == alone
    assert token_of_me(rows_for(SamplingParams(temperature=0.3, top_k=4), 15, seed0=99), 16, 15) == alone
    # Different seeds, or the same seed at different offsets, give different draws.
    rows = rows_for(p, 64, seed0=10**12)   # seeds wider than 32 bits
    same_offset = sample_jit(np.broadcast_to(row_logits, (64, vocab)), make_sampling_tensors(rows, 64, vocab, L), 0)
    assert len(set(np.asarray(same_offset.token_ids).tolist())) > 40
    walk = [SamplingRow(p, [1], [], seed=1234, offset=i) for i in range(64)]
    by_offset = sample_jit(np.broadcast_to(row_logits, (64, vocab)), make_sampling_tensors(walk, 64, vocab, L), 0)
    assert len(set(np.asarray(by_offset.token_ids).tolist())) > 40
    assert int(by_offset.token_ids[2]) == alone


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(2)
    logits = (3 * rng.standard_normal((5, 300))).astype(np.float32)
    params = [SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, logit_bias={7: 5.0}),
              SamplingParams(temperature=0.0)]
    rows = [SamplingRow(params[i % 2], [7, 8], [9], seed=i, offset=1) for i in range(5)]
    out = sample_jit(logits, make_sampling_tensors(rows, 5, 300, L), 20)
    want = log_softmax(logits)
    ids = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, want[np.arange(5), ids], atol=1e-5)
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-want, -1)[:, :20], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-want, -1, kind="stable")[:, :20])
    np.testing.assert_array_equal(out.ranks, 1 + (want > want[np.arange(5), ids][:, None]).sum(-1))

    next_ids = rng.integers(0, 300, 5)
    chosen, top_ids, top_lp = jax.jit(prompt_logprobs, static_argnums=2)(logits, next_ids, 3)
    np.testing.assert_allclose(chosen, want[np.arange(5), next_ids], atol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-want, -1, kind="stable")[:, :3])
    np.testing.assert_allclose(top_lp, -np.sort(-want, -1)[:, :3], atol=1e-5)
    assert jax.jit(prompt_logprobs, static_argnums=2)(logits, next_ids, 0)[1].shape == (5, 0)


def reference_processed(logits_V: np.ndarray, row: SamplingRow) -> np.ndarray:
    """vLLM V1's order, from the definitions: bans, logit_bias, then penalties."""
    p, x = row.params, logits_V.astype(np.float64).copy()
    if p.allowed_token_ids is not None:
        x[np.setdiff1d(np.arange(len(x)), p.allowed_token_ids)] = -np.inf
    if row.offset < p.min_tokens:      # offset = tokens generated so far (pending ones too)
        x[list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))] = -np.inf
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    for tok in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok, count in Counter(row.output_token_ids).items():
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    return x


def test_penalties_bias_allowed_and_min_tokens_match_numpy():
    vocab = 40
    rng = np.random.default_rng(3)
    logits = (2 * rng.standard_normal((8, vocab))).astype(np.float32)
    eos = (0, 1)
    rows = [
        SamplingRow(SamplingParams(repetition_penalty=1.7), [3, 4, 5, 3], [6, 6, 2], 0, 3, eos),
        SamplingRow(SamplingParams(presence_penalty=0.8, frequency_penalty=0.5), [3, 4], [4, 4, 4, 9], 0, 4, eos),
        SamplingRow(SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=-0.3,
                                   logit_bias={3: 4.0, 12: -100.0, 39: 1.5}), [3, 12, 30], [12, 39, 39], 0, 3, eos),
        SamplingRow(SamplingParams(allowed_token_ids=[0, 5, 7, 11, 1]), [2], [], 0, 0, eos),
        SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=[7, 8]), [2], [5, 6], 0, 2, eos),
        SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True), [2], [5], 0, 1, eos),
        SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=[7]), [2], [5, 6], 0, 2, eos),   # reached
        SamplingRow(SamplingParams(min_tokens=4, allowed_token_ids=[0, 1, 2], logit_bias={2: -3.0},
                                   frequency_penalty=1.0), [2], [2], 0, 1, eos),
    ]
    t = make_sampling_tensors(rows, 8, vocab, L)
    got = np.asarray(jax.jit(processed_logits)(logits, t))
    for i, row in enumerate(rows):
        np.testing.assert_allclose(got[i], reference_processed(logits[i], row), rtol=1e-6, atol=1e-5,
                                   err_msg=f"row {i}")
    # Greedy rows pick the argmax of the processed logits, not of the raw ones.
    greedy_rows = [SamplingRow(r.params.clone(temperature=0.0), r.prompt_token_ids, r.output_token_ids,
                               r.seed, r.offset, r.eos_token_ids) for r in rows]
    out = sample_jit(logits, make_sampling_tensors(greedy_rows, 8, vocab, L), 0)
    want = [int(np.argmax(reference_processed(logits[i], r))) for i, r in enumerate(rows)]
    assert np.asarray(out.token_ids).tolist() == want


def test_random_rows_respect_bans():
    vocab, n = 30, 256
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((n, vocab)).astype(np.float32)
    p = SamplingParams(temperature=1.5, allowed_token_ids=[3, 4, 5, 6], min_tokens=5, stop_token_ids=[4])
    rows = [SamplingRow(p, [1], [3], seed=i, offset=1, eos_token_ids=(5,)) for i in range(n)]
    ids = np.asarray(sample_jit(logits, make_sampling_tensors(rows, n, vocab, L), 0).token_ids)
    assert set(ids.tolist()) == {3, 6}


def test_tensor_shapes_depend_only_on_num_seqs_and_constants():
    few = make_sampling_tensors(rows_for(SamplingParams(), 1), 4, 100, 32)
    many = make_sampling_tensors(rows_for(SamplingParams(repetition_penalty=1.1, logit_bias={1: 1.0},
                                                         allowed_token_ids=[1, 2]), 4, output=range(10)),
                                 4, 100, 32)
    shapes = lambda t: [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(t)]
    assert shapes(few) == shapes(many)
    with pytest.raises(ValueError, match="rows must be at most num_seqs"):
        make_sampling_tensors(rows_for(SamplingParams(), 5), 4, 100, 32)


def test_without_extras_same_draws_and_refuses_rows_that_need_them():
    vocab, n = 64, 16
    logits = np.random.default_rng(5).standard_normal((n, vocab)).astype(np.float32)
    rows = rows_for(SamplingParams(temperature=0.9, top_p=0.9, min_tokens=1), 6, output=[3]) \
        + rows_for(SamplingParams(temperature=0.0), 4, seed0=50)
    assert not needs_extras(rows)
    full = sample_jit(logits, make_sampling_tensors(rows, n, vocab, L), 5)
    lean_tensors = make_sampling_tensors(rows, n, vocab, L, with_extras=False)
    assert lean_tensors.token_history.shape == (n, 0) and lean_tensors.allowed_mask.shape == (n, 0)
    lean = sample_jit(logits, lean_tensors, 5)
    for a, b in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(lean)):
        np.testing.assert_array_equal(a, b)
    for params in [SamplingParams(frequency_penalty=0.1), SamplingParams(logit_bias={1: 1.0}),
                   SamplingParams(allowed_token_ids=[1]), SamplingParams(min_tokens=2)]:
        row = rows_for(params, 1, eos=(0,))
        assert needs_extras(row)
        with pytest.raises(ValueError, match="with_extras=False"):
            make_sampling_tensors(row, n, vocab, L, with_extras=False)


def test_truncation_thresholds_of_the_gpu_kernels_match_the_sort(monkeypatch):
    # on a GPU _truncate finds the top-k / top-p thresholds by radix select (Pallas kernels,
    # interpreted here); rows with ties, bans and every truncation option keep the same tokens
    # as the one-sort path
    from jaxserve.sample import sampler
    from jaxserve.pallas_kernels import topk_threshold as tk

    rng = np.random.default_rng(3)
    v = 700
    x = rng.standard_normal((6, v)).astype(np.float32) * 3
    x[1, :40] = x[1].max()                    # ties at the top
    x[2, ::5] = -np.inf                       # banned tokens
    params = [SamplingParams(top_k=10), SamplingParams(top_p=0.8), SamplingParams(min_p=0.05),
              SamplingParams(top_k=50, top_p=0.6), SamplingParams(top_k=v + 5, top_p=0.95),
              SamplingParams(min_p=0.01, top_k=200, top_p=0.3)]
    t = make_sampling_tensors([SamplingRow(p, [1], [], seed=i, offset=0)
                               for i, p in enumerate(params)], 6, v, L)
    assert not sampler.threshold_kernels_apply(6, True)          # CPU: the sort
    want = np.asarray(jax.jit(sampler._truncate)(x, t))
    kernel = dict(block_v=128, programs=12)   # interpreted; several chunks a row
    monkeypatch.setattr(sampler, "threshold_kernels_apply", lambda rows, kernels: True)
    monkeypatch.setattr(sampler, "topk_threshold",
                        lambda x, k, impl: tk.topk_threshold(x, k, impl=impl, **kernel))
    monkeypatch.setattr(sampler, "topp_threshold",
                        lambda x, p, floor, impl: tk.topp_threshold(x, p, floor, impl=impl,
                                                                    **kernel))
    got = np.asarray(jax.jit(lambda x, t: sampler._truncate(x, t))(x, t))   # a fresh trace
    np.testing.assert_array_equal(got, want)
    kept = np.isfinite(got).sum(axis=1)
    assert kept[0] == 10 and kept[1] < v and 0 < kept[5] <= 200, kept


def test_threshold_kernels_only_where_they_were_measured_faster(monkeypatch):
    # the runner's XLA path (and a device mesh) passes kernels=False; past
    # THRESHOLD_KERNEL_MAX_ROWS rows one sort serves both thresholds faster (H200)
    from jaxserve.sample import sampler

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert sampler.threshold_kernels_apply(1, True)
    assert sampler.threshold_kernels_apply(sampler.THRESHOLD_KERNEL_MAX_ROWS, True)
    assert not sampler.threshold_kernels_apply(sampler.THRESHOLD_KERNEL_MAX_ROWS + 1, True)
    assert not sampler.threshold_kernels_apply(4, False)


@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0), (0.0, 0.9, 0.0), (1.0, 1.0, 0.5)])
def test_branching_on_greedy_changes_no_draw(temps):
    """branch_on_greedy (the CPU's step: no Gumbel draw when every row is greedy) draws what
    the unbranched sampler draws, for all-greedy, mixed and random batches (with padding)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    rows = [SamplingRow(SamplingParams(temperature=t), [1], [], seed=50 + i, offset=0)
            for i, t in enumerate(temps)]
    t = make_sampling_tensors(rows, 4, 300, L)
    plain = jax.jit(lambda x, t: sample(x, t, 2))(logits, t)
    branched = jax.jit(lambda x, t: sample(x, t, 2, branch_on_greedy=True))(logits, t)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(branched)):
        np.testing.assert_array_equal(a, b)
    if max(temps) == 0:
        np.testing.assert_array_equal(branched.token_ids, logits.argmax(-1))
