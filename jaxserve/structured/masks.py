"""The step's grammar masks: filled on the host for all constrained rows in one call, then
ANDed into the sampling tensors' packed allowed-token mask (applied on the device).

Pipelining: the engine dispatches step N+1 before it has read step N's tokens, and a
matcher must consume N's token before it can give N+1's mask. So the runner builds all of
N+1 first (while the device still runs N), and only then `fill_step_masks` waits for N's
sampled ids (that small array alone), feeds each matcher its token and fills the masks: the
device idles for the fill and the launch, not for the host's whole step.

Layout: llguidance writes int32 words, token t at bit t % 32 of word t // 32; read as bytes
on a little-endian host that is bit t % 8 of byte t // 8, the layout of `allowed_mask`
(np.packbits(..., bitorder="little")), so the words are viewed as bytes, not converted.
A matcher at the end of its grammar allows only EOS.
"""

from __future__ import annotations

import sys

import numpy as np

assert sys.byteorder == "little", "the mask layout below assumes a little-endian host"


class RequestGrammar:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher, consumed: int = 0):
        self.matcher = matcher
        self.consumed = consumed

    @classmethod
    def for_request(cls, grammars, new) -> "RequestGrammar":
        """The grammar of a request the runner takes in (`NewRequestData`), having consumed
        the tokens it generated before a preemption."""
        if grammars is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
        tokens = list(new.output_token_ids)
        return cls(grammars.matcher(new.sampling_params.structured_outputs, tokens), len(tokens))

    def catch_up(self, output_token_ids, pending: int | None = None) -> None:
        """Consume the output tokens not consumed yet, then `pending` (the token still on its
        way from the last step), unless it was consumed already."""
        n = len(output_token_ids)
        if self.consumed < n:
            self._consume(list(output_token_ids[self.consumed:]))
            self.consumed = n
        if pending is not None and self.consumed == n:
            self._consume([pending])
            self.consumed += 1

    def _consume(self, tokens: list[int]) -> None:
        if not self.matcher.is_stopped():       # past the end (ignore_eos): nothing to follow
            self.matcher.consume_tokens(tokens)


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


def fill_step_masks(grammars, allowed_SW: np.ndarray, constrained: list[tuple], last_sampled) -> None:
    """The masks of a step's constrained rows: `constrained` holds (row, CachedRequest, its
    row of the last step's ids if its last token is still on the device, else None);
    `last_sampled()` waits for that step and gives its ids on the host."""
    ids = None
    if any(prev is not None for _, _, prev in constrained):
        if last_sampled is None:
            raise RuntimeError("a grammar needs the last step's token, but no runner gives it")
        ids = last_sampled()
    rows = []
    for row, req, prev in constrained:
        req.grammar.catch_up(req.output_token_ids, None if prev is None else int(ids[prev]))
        rows.append((row, req.grammar.matcher))
    fill_masks(grammars.executor, allowed_SW, rows, grammars.mask_words)
