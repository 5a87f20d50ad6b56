"""Fields asking for a feature the engine lacks get a 400 naming them; unknown ones are logged once.

Behind the real app with a stand-in engine that answers every request it gets, so a 200
here means the field really went through (nothing else would refuse it).
"""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from stubs import RecordingEngine

from jaxserve.server import unsupported
from jaxserve.server.app import build_app
from jaxserve.server.context import ServerContext


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hi", "max_tokens": 1}

# (field, value, extra fields): each must be refused on both routes.
REFUSED = [
    ("structural_tag", {"type": "structural_tag", "format": {}}, {}),
    ("use_beam_search", True, {}),
    ("functions", [{"name": "f"}], {}),
    ("logits_processors", ["my.proc"], {}),
    ("truncate_prompt_tokens", 10, {}),
    ("priority", 5, {}),
]
# The same fields where they ask for nothing: accepted. (Structured output and tools are
# implemented: tests/server/test_structured_outputs.py.)
ACCEPTED = [
    ("response_format", {"type": "text"}, {}),
    ("use_beam_search", False, {}),
    ("tools", [{"type": "function", "function": {"name": "f"}}], {"tool_choice": "none"}),
    ("tool_choice", "none", {}),
    ("guided_json", None, {}),
    ("functions", [{"name": "f"}], {"function_call": "none"}),
    ("priority", 0, {}),
]


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(ServerContext(RecordingEngine(), ("stub",))), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
@pytest.mark.parametrize("field,value,extra", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_unsupported_field_is_a_400_naming_it(client, path, base, field, value, extra):
    r = client.post(path, json={**base, **extra, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == field and error["type"] == "BadRequestError"
    assert error["code"] == "unsupported_parameter" and error["message"].startswith(f"{field} is not supported")


@pytest.mark.parametrize("field,value,extra", ACCEPTED, ids=[f"{r[0]}-{i}" for i, r in enumerate(ACCEPTED)])
def test_the_same_fields_asking_for_nothing_are_accepted(client, field, value, extra):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra, field: value})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"


def test_every_table_entry_is_refused_when_it_asks(client):
    # Guards the table itself: a row whose predicate never fires would silently accept again.
    asking = {"use_beam_search": True, "functions": [{}], "logits_processors": ["p"],
              "bad_words": ["w"], "priority": 1}
    for field in unsupported.UNSUPPORTED:
        r = client.post("/v1/completions", json={**COMPLETION, field: asking.get(field, "x")})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_unknown_fields_are_logged_once_per_name(client, caplog):
    name = "a_field_nobody_reads"
    unsupported._logged_unknown.discard(name)
    with caplog.at_level(logging.WARNING, logger="jaxserve.server"):
        for _ in range(3):
            assert client.post("/v1/completions", json={**COMPLETION, name: 1, "user": "u"}).status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if name in rec.getMessage()]
    assert len(lines) == 1 and "ignoring the unknown request field" in lines[0]
    assert not any("'user'" in rec.getMessage() for rec in caplog.records)   # declared: not unknown
