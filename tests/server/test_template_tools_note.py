"""A chat template that drops `tools` is said once in the log (the model could never call
them), not discovered by a user wondering why no tool is ever called (issue 69)."""

from __future__ import annotations

import logging

from fastapi.testclient import TestClient

from jaxserve.server.app import build_app
from jaxserve.server.context import ServerContext
from test_tool_calls import BODY, ScriptedEngine

NOTE = "the chat template ignores `tools`"


def _post_twice(template, caplog) -> str:
    engine = ScriptedEngine("It is sunny.")
    engine.tokenizer = type(engine.tokenizer)()
    engine.tokenizer.apply_chat_template = template
    ctx = ServerContext(engine, ("stub",), enable_auto_tool_choice=True, tool_call_parser="hermes")
    with caplog.at_level(logging.WARNING, logger="jaxserve.server.inputs"), \
            TestClient(build_app(ctx)) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    return caplog.text


def test_a_template_that_drops_tools_is_said_once(caplog):
    log = _post_twice(lambda messages, add_generation_prompt=True, **kw: "prompt", caplog)
    assert log.count(NOTE) == 1, log


def test_a_template_that_shows_tools_is_not_noted(caplog):
    log = _post_twice(lambda messages, add_generation_prompt=True, **kw: f"prompt {len(kw.get('tools') or [])}",
                      caplog)
    assert NOTE not in log, log
