"""Request fields vLLM (or OpenAI) honours and this engine does not, refused by name.

A client that sends `guided_json` believes the output is constrained; answering 200 with an
unconstrained output would be a silent lie, so such a request gets a 400 naming the field.
To implement a feature, delete its rows from UNSUPPORTED (and handle the field in
protocol.py / inputs.py): nothing else refers to them.

Any other field the request bodies do not declare is ignored (clients send `user`,
`metadata`, `store`, ... that change nothing here) and logged once per field name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from jaxserve.server.errors import APIError

logger = logging.getLogger("jaxserve.server")


def _given(value: Any, body: dict) -> bool:
    return value is not None


def _truthy(value: Any, body: dict) -> bool:
    return bool(value)


def _functions_in_use(value: Any, body: dict) -> bool:
    return bool(value) and body.get("function_call", "auto") != "none"


def _nonzero(value: Any, body: dict) -> bool:
    return value not in (None, 0)


@dataclass(frozen=True)
class Unsupported:
    feature: str                                  # what the field asks for, in words
    asks: Callable[[Any, dict], bool] = _given    # (value, whole body) -> does it ask for it?


UNSUPPORTED: dict[str, Unsupported] = {
    "structural_tag": Unsupported("structural tags are not implemented; use structured_outputs "
                                  "(json, regex, choice, grammar) or response_format"),
    "use_beam_search": Unsupported("beam search is not implemented", _truthy),
    "functions": Unsupported("the legacy functions field is not implemented; use tools",
                             _functions_in_use),
    "logits_processors": Unsupported("custom logits processors are not implemented", _truthy),
    "bad_words": Unsupported("bad_words is not implemented; logit_bias with -100 bans tokens", _truthy),
    "truncate_prompt_tokens": Unsupported("prompt truncation is not implemented; shorten the prompt"),
    "prompt_embeds": Unsupported("prompt embeddings are not implemented; send text or token ids"),
    "chat_template": Unsupported("a per-request chat template is not accepted; start the server "
                                 "with --chat-template"),
    "documents": Unsupported("documents for retrieval chat templates are not implemented"),
    "priority": Unsupported("priority scheduling is not implemented (requests run first come, "
                            "first served)", _nonzero),
}

# Field names already logged as ignored; capped so that clients inventing names cannot grow it.
_logged_unknown: set[str] = set()
_MAX_LOGGED_NAMES = 1000


def check_supported(fields: dict[str, Any]) -> None:
    """Raise a 400 naming the first field in `fields` (a request body's fields that were set)
    that asks for a feature this engine lacks."""
    for name, value in fields.items():
        rule = UNSUPPORTED.get(name)
        if rule is not None and rule.asks(value, fields):
            raise APIError(400, f"{name} is not supported by this server: {rule.feature}",
                           param=name, code="unsupported_parameter")


def log_unknown_fields(names) -> None:
    """Log each request field nobody reads, once per name for the life of the process."""
    for name in names:
        if name in UNSUPPORTED or name in _logged_unknown or len(_logged_unknown) >= _MAX_LOGGED_NAMES:
            continue
        _logged_unknown.add(name)
        logger.warning("ignoring the unknown request field %.80r (logged once per field name)", name)


def check_request(req) -> None:
    """For a parsed generation request: refuse the unsupported fields, log the unknown ones."""
    extra = req.model_extra or {}
    check_supported(extra)
    log_unknown_fields(extra)
