"""Tool-call formats whose arguments come as XML-like parameters (vLLM's names):

- `qwen3_coder` / `qwen3_xml` (Qwen3-Coder, Qwen3.5):
  `<tool_call>\\n<function=f>\\n<parameter=x>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`;
- `minimax_m2`: `<minimax:tool_call>\\n<invoke name="f">\\n<parameter name="x">value</parameter>\\n</invoke>\\n</minimax:tool_call>`;
- `deepseek_v32` (V3.2's DSML): `<｜DSML｜function_calls>\\n<｜DSML｜invoke name="f">\\n
  <｜DSML｜parameter name="x" string="true">value</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n</｜DSML｜function_calls>`.

Values are raw text. Each becomes a JSON value by the function's parameter schema: a
"string" parameter stays text, other types are read as JSON (falling back to text); DSML says
it itself (`string="true"`: text, `"false"`: JSON); a parameter the schema does not list is
text. The arguments stream one parameter at a time, as each closes: `{"x": 1`, `, "y": "a"`,
then `}` with the call's closing tag, so the pieces concatenate to the final object.
"""

from __future__ import annotations

import json
import re

from jaxserve.parsers.calls import NotACall, Parsed, PartialCall, ToolParser, content_before


class XmlCalls(ToolParser):
    block: str                          # where the calls begin (the content ends)
    invoke: re.Pattern                  # a call's opening tag, the function name as group 1
    invoke_end: str
    param: re.Pattern                   # a parameter's opening tag: name, [string="true|false"]
    param_end: str

    def parse(self, text, final, tools) -> Parsed:
        content, pos = content_before(text, self.block, final)
        out = Parsed(content)
        while pos >= 0:
            m = self.invoke.search(text, pos)
            if m is None:
                if final and not out.calls:
                    raise NotACall("tool-call block without a call")
                break
            close = text.find(self.invoke_end, m.end())
            body = text[m.end():close if close >= 0 else len(text)]
            if final and close < 0:
                raise NotACall(f"call of {m.group(1)!r} cut short")
            name = m.group(1).strip()
            out.calls.append(PartialCall(name, self.arguments(body, close >= 0, tools.get(name, {})), close >= 0))
            pos = close + len(self.invoke_end) if close >= 0 else -1
        return out

    def arguments(self, body: str, done: bool, schema: dict) -> str:
        props = schema.get("properties") or {}
        parts, pos = [], 0
        while True:
            m = self.param.search(body, pos)
            if m is None:
                break
            close = body.find(self.param_end, m.end())
            if close < 0:
                if done:
                    raise NotACall(f"parameter {m.group(1)!r} not closed")
                break
            key = m.group(1).strip()
            value = body[m.end():close].removeprefix("\n").removesuffix("\n")
            as_string = m.group(2) if m.re.groups >= 2 else None
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(_value(value, props.get(key), as_string), ensure_ascii=False)}")
            pos = close + len(self.param_end)
        return "{" + ", ".join(parts) + ("}" if done else "")


def _value(text: str, prop: dict | None, as_string: str | None):
    if as_string == "true":
        return text
    kind = (prop or {}).get("type")
    if as_string is None and (prop is None or kind == "string" or
                              (isinstance(kind, list) and "string" in kind)):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if as_string == "false":
            raise NotACall(f"parameter value {text!r} is marked JSON but is not") from None
        return text


class Qwen3Coder(XmlCalls):
    name = "qwen3_coder"
    block = "<tool_call>"
    invoke = re.compile(r"<function=([^>\n]+)>")
    invoke_end = "</function>"
    param = re.compile(r"<parameter=([^>\n]+)>")
    param_end = "</parameter>"


class Qwen3Xml(Qwen3Coder):
    name = "qwen3_xml"


class MiniMaxM2(XmlCalls):
    name = "minimax_m2"
    block = "<minimax:tool_call>"
    invoke = re.compile(r'<invoke name="([^"]+)">')
    invoke_end = "</invoke>"
    param = re.compile(r'<parameter name="([^"]+)">')
    param_end = "</parameter>"


class DeepSeekV32(XmlCalls):
    name = "deepseek_v32"
    block = "<｜DSML｜function_calls>"
    invoke = re.compile(r'<｜DSML｜invoke name="([^"]+)">')
    invoke_end = "</｜DSML｜invoke>"
    param = re.compile(r'<｜DSML｜parameter name="([^"]+)"(?: string="(true|false)")?>')
    param_end = "</｜DSML｜parameter>"
