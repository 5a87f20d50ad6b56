"""The host side of verification: the extra logits rows a step with drafts computes.

A sequence with k drafts computes its last real token and the k drafts; the logits after
each of these k + 1 positions are verified. The last one is the sequence's usual row (its
*bonus* row, s < S); the k before it become draft rows appended after the S sequence rows,
padded to a power of two so that steps of similar size share one compiled program.
Legend as in rejection_sampler.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.sample.tensors import SamplingRow

PAD_ROW = SamplingRow(SamplingParams(temperature=0), (), (), seed=0, offset=0)


@dataclasses.dataclass(frozen=True)
class DraftSeq:
    """One sequence's drafts in a step."""
    seq: int                        # its index in the step
    first_position_row: int         # step token index of the position predicting its draft 0
    drafts: list[int]
    bonus_row: SamplingRow          # its sequence row (offset after the drafts; with penalties,
                                    # its history ends with them)


@dataclasses.dataclass(frozen=True)
class DraftRows:
    logits_indices: np.ndarray      # i32[D] step token whose hidden state gives each draft row
    sampling_rows: list[SamplingRow]   # D of them (padding: greedy)
    draft_token_ids: np.ndarray     # i32[S + D] the draft each row verifies (-1: none)
    draft_rows: np.ndarray          # i32[S, K] logits row of sequence s's draft j (0 when none)
    num_drafts: np.ndarray          # i32[S]
    starts: dict[int, tuple[int, int]]   # seq -> (logits row of its draft 0, k)


# Fewest draft rows of a verifying step: below this the extra rows cost next to nothing (the
# lm_head reads its weights once), while every other row count is one more program to compile.
MIN_DRAFT_ROWS = 16


def padded(n: int) -> int:
    """Draft rows are padded to a power of two, at least MIN_DRAFT_ROWS."""
    return max(MIN_DRAFT_ROWS, 1 << max(0, n - 1).bit_length())


def build(seqs: list[DraftSeq], num_seqs: int, max_drafts: int) -> DraftRows:
    total = sum(len(d.drafts) for d in seqs)
    d_pad = padded(total)
    k_pad = max([max_drafts] + [len(d.drafts) for d in seqs])
    logits_idx = np.zeros(d_pad, np.int32)
    draft_ids = np.full(num_seqs + d_pad, -1, np.int32)
    rows_SK = np.zeros((num_seqs, k_pad), np.int32)
    num_S = np.zeros(num_seqs, np.int32)
    sampling = [PAD_ROW] * d_pad
    starts, r = {}, 0
    for d in seqs:
        k, b = len(d.drafts), d.bonus_row
        # Penalties alone read the history (its copies cost O(length) per draft row).
        history = b.params.uses_penalties
        before = list(b.output_token_ids)[:len(b.output_token_ids) - k] if history else ()
        starts[d.seq] = (num_seqs + r, k)
        num_S[d.seq] = k
        for j, token in enumerate(d.drafts):
            logits_idx[r] = d.first_position_row + j
            draft_ids[num_seqs + r] = token
            rows_SK[d.seq, j] = num_seqs + r
            # Draft j is sampled as output token offset - k + j, after the drafts before it.
            sampling[r] = dataclasses.replace(
                b, output_token_ids=before + d.drafts[:j] if history else b.output_token_ids,
                offset=b.offset - k + j)
            r += 1
    return DraftRows(logits_idx, sampling, draft_ids, rows_SK, num_S, starts)


def rows_of(seq: int, starts: dict[int, tuple[int, int]]) -> tuple[int, ...]:
    """The draft rows of sequence `seq`, in draft order (none: it has no drafts)."""
    first, k = starts.get(seq, (0, 0))
    return tuple(range(first, first + k))


def kept_rows(seq: int, starts: dict[int, tuple[int, int]], num_accepted: int) -> list[int]:
    """Logits rows whose emitted tokens sequence `seq` keeps: its accepted drafts, then the
    recovered token of the first rejected one or, when all were accepted, its bonus row."""
    if seq not in starts:
        return [seq]
    first, k = starts[seq]
    return list(range(first, first + num_accepted)) + [first + num_accepted if num_accepted < k else seq]


def warmup_draft_rows(prev_bucket: int, bucket: int, k: int, max_num_seqs: int) -> list[int]:
    """Every padded draft-row count a verifying step of the token bucket (prev_bucket, bucket]
    can have, for warm-up to compile: m sequences with drafts (at most S = min(bucket,
    max_num_seqs)) carry m..m * k drafts and compute one token each besides, within the
    bucket; when all S sequences draft, nothing else fills the step, so it must also pass
    prev_bucket. Every padding from 16 to the most drafts is reachable (a long prefill beside
    one draft), so a bucket of 2048 tokens with k = 3 and 256 sequences gets 7 counts."""
    s = min(bucket, max_num_seqs)
    counts = set()
    for m in range(1, s + 1):
        least, most = m, min(m * k, bucket - m)
        if m == s:
            least = max(least, prev_bucket + 1 - m)
        if least <= most:
            row = padded(least)
            while row <= padded(most):
                counts.add(row)
                row *= 2
    return sorted(counts)


def with_draft_rows(x, num_draft_rows: int, k: int, sampling):
    """An empty step input `x` made a verifying one (for warm-up): its layout is that of a
    built step with `num_draft_rows` draft rows and K = k. `sampling`: S + D rows."""
    s = x.num_seqs
    return dataclasses.replace(
        x, logits_indices=np.zeros(s + num_draft_rows, np.int32), sampling=sampling,
        draft_token_ids=np.full(s + num_draft_rows, -1, np.int32),
        draft_rows=np.zeros((s, k), np.int32), num_drafts=np.zeros(s, np.int32))
