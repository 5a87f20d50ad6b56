"""StructuredOutputsParams: what a request's output must match (vLLM's shape).

Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (a list of
strings), `grammar` (a Lark grammar as llguidance reads it, or GBNF) or `json_object=True`
(any JSON object). Checked here without the tokenizer; compiling it against the model's
vocabulary (jaxserve/structured/compiler.py) is what finds an invalid schema or grammar.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

MAX_GRAMMAR_CHARS = 1 << 20     # a schema, regex or grammar larger than 1 MiB is refused
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None          # JSON schema
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None              # Lark (llguidance's dialect) or GBNF
    json_object: bool = False               # any JSON object
    # NOTE: vLLM's flag; here JSON has no free whitespace unless it is set to False, because
    # small models given free whitespace may emit newlines until max_tokens.
    disable_any_whitespace: bool = True
    # Set by the server (or LLM.chat) when a reasoning parser says the output thinks first:
    # the grammar then starts after this token (the end of the thinking, `</think>`), the
    # tokens up to it unconstrained (vLLM's structured output with a reasoning parser). Not a
    # client field, and not part of the compiled grammar's key.
    reasoning_end_token_id: int | None = None

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                _bad("choice", "a list of strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    def validate(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar "
                             f"or json_object; got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema; its text is not "
                                     f"JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                _bad("json", "a JSON schema (an object)", self.json)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                _bad(name, "a non-empty string", v)
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                _bad("choice", "a non-empty list of non-empty strings", list(self.choice))
        end = self.reasoning_end_token_id
        if end is not None and (not isinstance(end, int) or isinstance(end, bool) or end < 0):
            _bad("reasoning_end_token_id", "a token id (an integer >= 0) or None", end)
        if not isinstance(self.json_object, bool):
            _bad("json_object", "true or false", self.json_object)
        if len(self.key()[1]) > MAX_GRAMMAR_CHARS:
            _bad(self.kind, f"at most {MAX_GRAMMAR_CHARS} characters", f"{len(self.key()[1])} characters")

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputsParams":
        known = {f.name for f in dataclasses.fields(cls)} - {"reasoning_end_token_id"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"structured_outputs has no field {unknown[0]!r}; its fields are "
                             f"{', '.join(sorted(known))}")
        return cls(**fields)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)   # key order matters: properties come in it
        elif kind == "choice":
            text = json.dumps(list(self.choice))
        elif kind == "json_object":
            text = '{"type": "object"}'
        else:
            text = getattr(self, kind)
        if kind in ("json", "json_object"):
            kind += ":compact" if self.disable_any_whitespace else ":flexible"
        return kind, text


def _bad(name: str, allowed: str, got) -> None:
    raise ValueError(f"structured_outputs.{name} must be {allowed}; got {got!r}")
