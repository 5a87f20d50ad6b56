"""Tool-call formats whose arguments are JSON the model writes (vLLM's names):

- `hermes` (Hermes, Qwen2.5 / Qwen3): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  any number, after optional text (the content);
- `llama3_json` (Llama 3.1 / 3.2): the output is `{"name": "f", "parameters": {...}}`, maybe after
  `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (older tokenizers) or
  `[TOOL_CALLS]f[ARGS]{...}` (v11 and later), after optional text;
- `deepseek_v3` (V3, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- `deepseek_v31` (V3.1): the same markers, `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`;
- `pythonic` (Llama 3.2 / 4's other format): the output is `[f(x=1, y="a"), g()]`.

Arguments stream as the model writes them (its JSON text, up to where the object may still
end); pythonic calls come once the list is whole (Python literals are not JSON).
"""

from __future__ import annotations

import ast
import json
import re

from jaxserve.parsers.calls import (NotACall, Parsed, PartialCall, ToolParser, content_before,
                                    json_arguments)

_NAMED_OBJECT = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def object_call(text: str, start: int, done: bool) -> tuple[PartialCall | None, int | None]:
    """A `{"name": ..., "arguments" | "parameters": {...}}` object at text[start:]: (the call as
    far as known, or None before its name is; where the object ended, or None)."""
    m = _NAMED_OBJECT.match(text, start)
    if m is None:
        if done or not _could_start_object(text[start:]):
            raise NotACall("not a {name, arguments} object")
        return None, None
    args, end = json_arguments(text, m.end(), done)
    call = PartialCall(json.loads(f'"{m.group(1)}"'), args)
    if end is None:
        return call, None
    close = re.compile(r"\s*\}").match(text, end)
    if close is None:
        if done or text[end:].strip():
            raise NotACall("a call object holds more than name and arguments")
        return call, None
    call.done = True
    return call, close.end()


def _could_start_object(prefix: str) -> bool:
    """Whether `prefix` may still grow into `{"name": "...", "arguments": `."""
    probe = prefix.lstrip()
    return probe == "" or re.fullmatch(r'\{\s*("n?a?m?e?"?\s*:?\s*)?', probe) is not None or (
        re.fullmatch(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("\s*,?\s*("[a-z]*"?\s*:?\s*)?)?', probe) is not None)


class Hermes(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text, final, tools) -> Parsed:
        content, pos = content_before(text, self.start, final)
        out = Parsed(content)
        while pos >= 0:
            body = pos + len(self.start)
            close = text.find(self.end, body)
            done = close >= 0 or final
            call, _ = object_call(text[:close] if close >= 0 else text, body, done)
            if call is None:
                break
            call.done = close >= 0
            out.calls.append(call)
            pos = text.find(self.start, close) if close >= 0 else -1
        return out


class Llama3Json(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text, final, tools) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag):]
        elif self.tag.startswith(body) and body and not final:
            return Parsed("")
        offset = len(text) - len(body)
        if not body.lstrip().startswith("{"):
            if body.strip() or final:     # not a call: it all is content
                return Parsed(text)
            return Parsed("")
        out, pos = Parsed(""), offset
        while pos < len(text):
            call, end = object_call(text, pos, final)
            if call is None:
                break
            out.calls.append(call)
            if end is None:
                break
            pos = end
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
        return out


class Mistral(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    needs_special_tokens = True      # [TOOL_CALLS] / [ARGS] are control tokens in Mistral's vocabularies

    def parse(self, text, final, tools) -> Parsed:
        content, pos = content_before(text, self.start, final)
        out = Parsed(content)
        if pos < 0:
            return out
        pos += len(self.start)
        rest = text[pos:].lstrip()
        if not rest:
            if final:
                raise NotACall("no call after [TOOL_CALLS]")
            return out
        if rest.startswith("["):          # a JSON array of {name, arguments}
            pos = text.index("[", pos) + 1
            while True:
                while pos < len(text) and text[pos] in " \t\r\n,":
                    pos += 1
                if pos >= len(text) or text[pos] == "]":
                    if final and pos >= len(text):
                        raise NotACall("call list cut short")
                    return out
                call, end = object_call(text, pos, final)
                if call is None:
                    return out
                out.calls.append(call)
                if end is None:
                    return out
                pos = end
        while pos >= 0:                    # name[ARGS]{...} after each [TOOL_CALLS]
            head = text[pos:].lstrip()
            sep = head.find("[ARGS]")
            if sep < 0:
                if final:
                    raise NotACall("a call without [ARGS]")
                return out
            start = len(text) - len(head) + sep + len("[ARGS]")
            args, end = json_arguments(text, start, final)
            out.calls.append(PartialCall(head[:sep].strip(), args, end is not None))
            pos = text.find(self.start, end) if end is not None else -1
            if pos >= 0:
                pos += len(self.start)
        return out


class DeepSeekV3(ToolParser):
    name = "deepseek_v3"
    calls_begin, call_begin, call_end = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"

    def parse(self, text, final, tools) -> Parsed:
        content, pos = content_before(text, self.calls_begin, final)
        out = Parsed(content)
        while pos >= 0:
            pos = text.find(self.call_begin, pos)
            if pos < 0:
                break
            close = text.find(self.call_end, pos)
            body = text[pos + len(self.call_begin):close if close >= 0 else len(text)]
            call = self.call(body, close >= 0 or final)
            if call is None:
                break
            call.done = close >= 0
            out.calls.append(call)
            pos = close if close >= 0 else -1
        if final and not out.calls:
            raise NotACall("tool-call markers without a call")
        return out

    def call(self, body: str, done: bool) -> PartialCall | None:
        """V3: `function<sep>NAME\\n```json\\n{...}\\n```"""
        head, sep, rest = body.partition(self.sep)
        name, nl, rest = rest.partition("\n")
        if not sep or not nl:
            if done:
                raise NotACall("a call without its name")
            return None
        if "```json\n".startswith(rest) and not done:       # its fence still coming
            return PartialCall(name.strip(), "")
        args, _ = json_arguments(rest.removeprefix("```json"), 0, done)   # (the closing fence is past the object)
        return PartialCall(name.strip(), args)


class DeepSeekV31(DeepSeekV3):
    name = "deepseek_v31"

    def call(self, body: str, done: bool) -> PartialCall | None:
        """V3.1: `NAME<sep>{...}`"""
        name, sep, rest = body.partition(self.sep)
        if not sep:
            if done:
                raise NotACall("a call without its name")
            return None
        args, _ = json_arguments(rest, 0, done)
        return PartialCall(name.strip(), args)


class Pythonic(ToolParser):
    name = "pythonic"

    def parse(self, text, final, tools) -> Parsed:
        body = text.strip()
        if not body.startswith("["):
            return Parsed(text if (body or final) else "")
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            if final:
                raise NotACall("not a Python list of calls") from None
            return Parsed("")
        if not isinstance(tree, ast.List):
            raise NotACall("not a list")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise NotACall("a list item is not f(name=value, ...)")
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                raise NotACall("an argument is not a literal") from None
            calls.append(PartialCall(node.func.id, json.dumps(args, ensure_ascii=False), True))
        return Parsed("", calls)
