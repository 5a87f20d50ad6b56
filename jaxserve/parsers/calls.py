"""The tool-call parsers' common machinery: a format is a *prefix parser* (the text so far ->
the content that is sure, the calls seen, each call's arguments as far as they are sure),
and one `ToolStream` turns successive prefixes into OpenAI deltas.

Why prefixes: the streamed and the whole response then come from the same function (a whole
output is one prefix, `final`), so they cannot disagree; a format only has to say what is
stable so far, never how to diff. What a format reports only grows: content is cut before
anything that could still become a call (a partial start marker is held back), and a call's
arguments are reported only as far as they are known (JSON copied as the model wrote it, up
to where its value may still end; XML parameters converted once each closes).

A call that turns out wrong when the output is whole (not JSON, not an object, a function not
in `tools`) is no call: the whole output is then content, as vLLM returns text it cannot
parse. A stream has already sent that call's first deltas; it sends the rest as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from jaxserve.parsers import held_prefix


@dataclass
class PartialCall:
    name: str
    arguments: str = ""         # the JSON text known so far
    done: bool = False          # its closing marker came


@dataclass
class Parsed:
    content: str                            # leading text that is content for sure
    calls: list[PartialCall] = field(default_factory=list)


class NotACall(ValueError):
    """What looked like a call is malformed: the output is text."""


@dataclass
class CallDelta:
    index: int
    name: str | None        # on a call's first delta only
    arguments: str


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at text[start] ends (past its closing bracket),
    or None if it has not ended yet. Strings are skipped, brackets in them not counted."""
    depth, in_str, esc = 0, False, False
    for k in range(start, len(text)):
        c = text[k]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def json_arguments(text: str, start: int, done: bool) -> tuple[str, int | None]:
    """(the arguments' JSON text known so far, where it ended or None) for a value starting at
    `start` (after whitespace). A call that is `done` must hold a whole object."""
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    if start >= len(text):
        if done:
            raise NotACall("no arguments")
        return "", None
    if text[start] != "{":
        raise NotACall("arguments are not an object")
    end = json_value_end(text, start)
    if end is None:
        if done:
            raise NotACall("arguments cut short")
        return text[start:].rstrip(), None
    return text[start:end], end


def content_before(text: str, marker: str, final: bool) -> tuple[str, int]:
    """(the content before `marker`, where the marker starts or -1). Without the marker, a
    tail that may begin it and trailing whitespace are held back (a stream sends them later,
    or never if a call follows: the content before a call is sent stripped)."""
    i = text.find(marker)
    if i >= 0:
        return text[:i].rstrip(), i
    if final:
        return text, -1
    cut = text[:len(text) - held_prefix(text, (marker,))]
    return cut.rstrip(), -1


class ToolParser:
    """A family's tool-call format: `parse(text, final, tools)` is its prefix parser."""

    name: ClassVar[str]
    # its markers are special tokens that skip_special_tokens would drop from the text (as
    # vLLM, the request then keeps them)
    needs_special_tokens: ClassVar[bool] = False

    def parse(self, text: str, final: bool, tools: dict[str, dict]) -> Parsed:
        raise NotImplementedError

    def stream(self, tools: list[dict] | None) -> "ToolStream":
        return ToolStream(self.parse, tools)

    def extract(self, text: str, tools: list[dict] | None) -> tuple[str | None, list[tuple[str, str]]]:
        """A whole output's (content or None, [(name, arguments JSON)])."""
        s = self.stream(tools)
        s.feed(text, final=True)
        return s.result()


def schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schema, from the request's tools (as rendered)."""
    out = {}
    for t in tools or []:
        fn = t.get("function", t)
        out[fn["name"]] = fn.get("parameters") or {}
    return out


class ToolStream:
    """One output's calls, fed content deltas in order (`final` on the last)."""

    def __init__(self, parse: Callable[[str, bool, dict], Parsed], tools: list[dict] | None):
        self.parse, self.tools = parse, schemas(tools)
        self.text = ""
        self.content_sent = 0
        self.args_sent: list[int] = []
        self.calls: list[PartialCall] = []
        self.failed = False

    def feed(self, text: str, final: bool = False) -> ToolDelta:
        self.text += text
        if self.failed:
            return ToolDelta(text)
        try:
            parsed = self.parse(self.text, final, self.tools)
            if final:
                self._check(parsed)
        except NotACall:
            if not final:       # the rest may yet read as a call's text: wait for the end
                return ToolDelta()
            self.failed, rest = True, self.text[self.content_sent:]
            self.content_sent = len(self.text)
            return ToolDelta(rest)
        out = ToolDelta(parsed.content[self.content_sent:])
        self.content_sent = max(self.content_sent, len(parsed.content))
        for i, call in enumerate(parsed.calls):
            if i == len(self.args_sent):
                self.args_sent.append(0)
                out.calls.append(CallDelta(i, call.name, call.arguments))
            elif len(call.arguments) > self.args_sent[i]:
                out.calls.append(CallDelta(i, None, call.arguments[self.args_sent[i]:]))
            self.args_sent[i] = len(call.arguments)
        self.calls = parsed.calls
        return out

    def _check(self, parsed: Parsed) -> None:
        for call in parsed.calls:
            if self.tools and call.name not in self.tools:
                raise NotACall(f"{call.name!r} is not one of the tools")
            try:
                if not isinstance(json.loads(call.arguments), dict):
                    raise NotACall("arguments are not an object")
            except json.JSONDecodeError as e:
                raise NotACall(str(e)) from None

    def result(self) -> tuple[str | None, list[tuple[str, str]]]:
        """After the final feed: (content or None, [(name, arguments)])."""
        if self.failed:
            return self.text or None, []
        content = self.text[:self.content_sent]
        return content or None, [(c.name, c.arguments) for c in self.calls]
