"""The step's grammar masks: filled on the host for all constrained rows in one call, then
ANDed into the sampling tensors' packed allowed-token mask (applied on the device).

llguidance writes int32 words, token t at bit t % 32 of word t // 32; read as bytes on a
little-endian host that is bit t % 8 of byte t // 8, the layout of `allowed_mask`
(np.packbits(..., bitorder="little")), so the words are viewed as bytes, not converted.
A matcher that reached the end of its grammar allows only EOS; one in an error state (it
consumed a token its mask did not allow, which the mask prevents) allows only EOS as well.
"""

from __future__ import annotations

import sys

import numpy as np

assert sys.byteorder == "little", "the mask layout below assumes a little-endian host"


def fill_masks(executor, allowed_SW: np.ndarray, rows: list[tuple[int, object]]) -> None:
    """AND each (row, matcher)'s next-token mask into allowed_SW (u8[S, W], in place)."""
    if not rows:
        return
    import llguidance.numpy as lln

    S, W = allowed_SW.shape
    words = np.full((len(rows), -(-W // 4)), -1, np.int32)
    lln.fill_next_token_bitmask_par(executor, [(m, i) for i, (_, m) in enumerate(rows)], words)
    idx = np.array([r for r, _ in rows])
    allowed_SW[idx] &= words.view(np.uint8)[:, :W]


def advance(matcher, tokens: list[int]) -> None:
    """Feed a request's newly sampled tokens to its matcher (a stopped one ignores them)."""
    if tokens and not matcher.is_stopped():
        matcher.consume_tokens(tokens)


def new_matcher(grammars, new):
    """The matcher of a request the runner takes in (`NewRequestData`), having consumed the
    tokens it generated before a preemption."""
    if grammars is None:
        raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
    return grammars.matcher(new.sampling_params.structured_outputs, new.output_token_ids)
