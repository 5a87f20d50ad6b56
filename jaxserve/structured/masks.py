"""The step's grammar masks: filled on the host for all constrained rows in one call, by the
engine's structured-output manager (manager.py), then ANDed by the runner into the sampling
tensors' packed allowed-token mask (applied on the device).

Pipelining: the engine dispatches step N+1 before it has read step N's tokens, and a
matcher must consume N's token before it can give N+1's mask. So the runner builds N+1 and
launches its forward first (worker/late_sampling.py), and only then asks for the masks:
`fill_step_masks` waits for N's sampled ids (that small array alone), the matchers consume
them (one parallel call) and the masks are filled while N+1's forward runs; its sampling
takes them after.

Layout: llguidance writes int32 words, token t at bit t % 32 of word t // 32; read as bytes
on a little-endian host that is bit t % 8 of byte t // 8, the layout of `allowed_mask`
(np.packbits(..., bitorder="little")), so the words are viewed as bytes, not converted.
A matcher at the end of its grammar allows only EOS.

After thinking: a request whose params name a `reasoning_end_token_id` is unconstrained until
it emits that token (its rows keep the all-allowed mask, its matcher consumes nothing); the
grammar starts with the token after it. Drafts follow the same rule, the switch undone with
the matcher's rollback.

Speculative decoding: a constrained request's drafts are first cut at the first token its
grammar rejects (`RequestGrammar.valid_drafts`, before the step is scheduled), so no invalid
draft is verified. A verifying step then needs a mask for each of the request's logits rows:
the row predicting draft j gets the mask after drafts[:j], its bonus row the mask after all
of them. `fill_step_masks` advances each matcher over its drafts, filling one row per
depth (all requests' rows of a depth in one parallel call), then rolls it back: the matcher
commits only the tokens the step keeps, when they come back (`catch_up`).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

assert sys.byteorder == "little", "the mask layout below assumes a little-endian host"


class RequestGrammar:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher, consumed: int = 0, thinking_end: int | None = None):
        self.matcher = matcher
        self.consumed = consumed
        self.thinking_end = thinking_end
        self.thinking = thinking_end is not None     # before the end of the thinking: no constraint

    @classmethod
    def for_request(cls, grammars, new) -> "RequestGrammar":
        """The grammar of a request the runner takes in (`NewRequestData`), having consumed
        the tokens it generated before a preemption."""
        if grammars is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
        params = new.sampling_params.structured_outputs
        grammar = cls(grammars.matcher(params), thinking_end=params.reasoning_end_token_id)
        grammar.catch_up(list(new.output_token_ids))    # as the live path consumed them
        return grammar

    def catch_up(self, output_token_ids, pending: int | None = None, feed: list | None = None) -> None:
        """Consume the output tokens not consumed yet, then `pending` (the token still on its
        way from the last step), unless it was consumed already. `feed`: the matcher's
        consuming of `pending` is appended there as (matcher, token) instead, for the caller
        to run many requests' at once (fill_step_masks)."""
        n = len(output_token_ids)
        if self.consumed < n:
            self._consume(list(output_token_ids[self.consumed:]))
            self.consumed = n
        if pending is not None and self.consumed == n:
            self.consumed += 1
            if self._follows(pending):
                if feed is None:
                    self.matcher.consume_token(pending)
                else:
                    feed.append((self.matcher, pending))

    def _consume(self, tokens: list[int]) -> None:
        for token in tokens:        # one by one: several come back at once from a verifying step
            if self._follows(token):
                self.matcher.consume_token(token)

    def _follows(self, token: int) -> bool:
        """Whether the matcher consumes `token`: not before the end of the thinking (whose
        token ends it here), nor past the grammar's end (ignore_eos: nothing to follow)."""
        if self.thinking:
            self.thinking = token != self.thinking_end
            return False
        return not self.matcher.is_stopped()

    def valid_drafts(self, output_token_ids, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar accepts after the request's output tokens
        (all read back: a request drafts only then). A stopped matcher allows only EOS, which
        it does not consume: no draft is worth verifying there."""
        self.catch_up(output_token_ids)
        free = 0
        if self.thinking:          # drafts up to the end of the thinking are all valid
            if self.thinking_end not in drafts:
                return len(drafts)
            free = drafts.index(self.thinking_end) + 1
            drafts = drafts[free:]
        if not drafts or self.matcher.is_stopped():
            return free
        return free + self.matcher.validate_tokens(list(drafts))


@dataclasses.dataclass(frozen=True)
class ConstrainedRows:
    """One constrained request's mask rows in a step: `row` (its sequence row, which samples
    after the drafts) and, in a verifying step, `draft_rows[j]` (the row predicting
    drafts[j]); `pending`: its last token is still on the device (the last step's)."""
    row: int
    request: object                 # manager.ConstrainedRequest (.req_id, .grammar, .output_token_ids)
    pending: bool = False
    drafts: tuple[int, ...] = ()
    draft_rows: tuple[int, ...] = ()


def fill_masks(executor, allowed_SW: np.ndarray, rows: list[tuple[int, object]],
               num_words: int | None = None) -> None:
    """AND each (row, matcher)'s next-token mask into allowed_SW (u8[S, W], in place);
    `num_words`: llguidance's mask width (its vocabulary may be larger than the model's)."""
    if not rows:
        return
    import llguidance.numpy as lln

    S, W = allowed_SW.shape
    words = np.full((len(rows), max(num_words or 0, -(-W // 4))), -1, np.int32)
    lln.fill_next_token_bitmask_par(executor, [(m, i) for i, (_, m) in enumerate(rows)], words)
    idx = np.array([r for r, _ in rows])
    allowed_SW[idx] &= words.view(np.uint8)[:, :W]


def fill_step_masks(grammars, allowed_SW: np.ndarray, constrained: list[ConstrainedRows],
                    last_sampled) -> None:
    """The masks of a step's constrained rows (`ConstrainedRows`), ANDed into allowed_SW;
    `last_sampled()` waits for the last step and gives each request's token it sampled, by
    request id. A request with drafts gets one mask per depth: depth j fills the row
    predicting draft j (or, at j = k, the bonus row) with the matcher advanced over
    drafts[:j]; every matcher is rolled back to its committed state."""
    ids = None
    if any(c.pending for c in constrained):
        if last_sampled is None:
            raise RuntimeError("a grammar needs the last step's token, but no runner gives it")
        ids = last_sampled()
    feed = []       # the pending tokens, consumed by all their matchers in one parallel call
    for c in constrained:
        c.request.grammar.catch_up(c.request.output_token_ids,
                                   int(ids[c.request.req_id]) if c.pending else None, feed)
    if feed:
        import llguidance.numpy as lln

        lln.consume_token_par(grammars.executor, feed)
    advanced = [0] * len(constrained)       # draft tokens each matcher consumed (to roll back)
    alive = [True] * len(constrained)       # its drafts so far were valid
    thinking = [c.request.grammar.thinking for c in constrained]    # committed state (to restore)
    try:
        for depth in range(1 + max((len(c.drafts) for c in constrained), default=0)):
            rows = []
            for i, c in enumerate(constrained):
                k = len(c.drafts)
                if depth <= k and alive[i] and not c.request.grammar.thinking:
                    rows.append((c.draft_rows[depth] if depth < k else c.row, c.request.grammar.matcher))
            fill_masks(grammars.executor, allowed_SW, rows, grammars.mask_words)
            for i, c in enumerate(constrained):
                if depth < len(c.drafts) and alive[i]:
                    advanced[i], alive[i] = _advance(c.request.grammar, c.drafts[depth], advanced[i])
    finally:
        for c, n, t in zip(constrained, advanced, thinking):
            c.request.grammar.thinking = t
            if n and not c.request.grammar.matcher.rollback(n):
                raise RuntimeError(f"request {c.request.req_id}: its matcher could not roll back "
                                   f"{n} draft tokens")


def _advance(grammar: RequestGrammar, token: int, advanced: int) -> tuple[int, bool]:
    """Feed one draft to a request's grammar as the committed path would (a stopped matcher
    consumes nothing; one still thinking only watches for the end of the thinking): (tokens
    its matcher consumed so far, whether the draft was valid). An invalid draft (drafts are
    cut before scheduling, so only if a caller skipped that) is left unconsumed: its own row's
    mask rejects it, so the rows after it are never kept and keep no mask."""
    if grammar.thinking:
        grammar.thinking = token != grammar.thinking_end
        return advanced, True
    matcher = grammar.matcher
    if matcher.is_stopped():
        return advanced, True
    if matcher.try_consume_tokens([token]) == 1:
        return advanced + 1, True
    return advanced, False
