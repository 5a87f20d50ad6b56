"""Engine logprobs (one {token_id: Logprob} dict per position) in OpenAI's two shapes.

completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (parallel lists)
chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
"""

from __future__ import annotations

import math

from jaxserve.outputs import Logprob, PositionLogprobs

# JSON has no -inf; OpenAI clients expect a number, so impossible tokens get this floor.
_LOGPROB_FLOOR = -9999.0


def _finite(x: float) -> float:
    return _LOGPROB_FLOOR if math.isnan(x) or x < _LOGPROB_FLOOR else float(x)


def _token_str(tokenizer, token_id: int, lp: Logprob | None, as_ids: bool = False) -> str:
    """The token's text; "token_id:N" with as_ids (--return-tokens-as-token-ids)."""
    if as_ids:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if tokenizer is None:   # a model without a tokenizer: name the token by its id (as vLLM does)
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _ranked(position: PositionLogprobs, top_n: int) -> list[tuple[int, Logprob]]:
    """The top_n entries of a position, most likely first (by rank, else by logprob)."""
    items = sorted(position.items(),
                   key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf, -kv[1].logprob))
    return items[:top_n]


class CompletionLogprobs:
    """Accumulates the completions shape; `text_offset` runs on across calls (streaming)."""

    def __init__(self, tokenizer, text_offset: int = 0, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.text_offset = text_offset
        self.as_ids = as_ids

    def format(self, token_ids: list[int], positions: list[PositionLogprobs | None]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position else None
            token = _token_str(self.tokenizer, token_id, chosen, self.as_ids)
            out["tokens"].append(token)
            out["token_logprobs"].append(None if chosen is None else _finite(chosen.logprob))
            out["top_logprobs"].append(
                None if position is None else
                {_token_str(self.tokenizer, t, lp, self.as_ids): _finite(lp.logprob) for t, lp in
                 sorted(position.items(), key=lambda kv: -kv[1].logprob)})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(token)
        return out


def merge_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [v for part in parts for v in part[key]] for key in
            ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(tokenizer, token_ids: list[int], positions: list[PositionLogprobs | None],
                  top_n: int, as_ids: bool = False) -> dict:
    def entry(token_id: int, lp: Logprob | None) -> dict:
        token = _token_str(tokenizer, token_id, lp, as_ids)
        return {"token": token, "logprob": _finite(lp.logprob) if lp else _LOGPROB_FLOOR,
                "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, position in zip(token_ids, positions):
        position = position or {}
        item = entry(token_id, position.get(token_id))
        item["top_logprobs"] = [entry(t, lp) for t, lp in _ranked(position, top_n)]
        content.append(item)
    return {"content": content}
