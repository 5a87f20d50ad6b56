"""The server's options a vLLM user sets: --generation-config defaults, --chat-template, API keys
(which paths they protect), /docs. Behind the real app with a stand-in engine that records the
SamplingParams it was given."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from stubs import RecordingEngine

from jaxserve.engine.generation_config import default_sampling
from jaxserve.server.app import api_keys_from, build_app
from jaxserve.server.context import ServerContext
from jaxserve.engine.checks import StartupError
from jaxserve.server.startup import read_chat_template


def test_generation_config_defaults_fill_only_what_the_request_leaves_out():
    engine = RecordingEngine()
    ctx = ServerContext(engine, ("stub",), default_sampling={"temperature": 0.6, "top_k": 20,
                                                             "max_tokens": 5})
    with TestClient(build_app(ctx)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": None}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi", "temperature": 0,
                                                    "max_tokens": 2}).status_code == 200
    first, second = engine.params
    assert (first.temperature, first.top_k, first.max_tokens) == (0.6, 20, 5)
    assert (second.temperature, second.top_k, second.max_tokens) == (0.0, 20, 2)


def test_generation_config_sources(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 64, "do_sample": True}))
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 64}
    assert default_sampling("auto", str(tmp_path)) == want             # the model folder's
    assert default_sampling(str(tmp_path), "model.gguf") == want       # another folder's
    assert default_sampling("vllm", str(tmp_path)) == {}
    assert default_sampling("auto", "model.gguf") == {} and default_sampling("auto", None) == {}
    with pytest.raises(StartupError, match="--generation-config"):
        default_sampling(str(tmp_path / "missing"), None)
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(StartupError, match="temperature must be a number"):
        default_sampling("auto", str(tmp_path))


def test_chat_template_from_a_file_or_inline(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template
    assert read_chat_template(template) == template
    assert read_chat_template(None) is None
    with pytest.raises(StartupError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_api_keys_guard_v1_and_leave_health_version_docs_open():
    ctx = ServerContext(RecordingEngine(), ("stub",), api_keys=("secret",))
    with TestClient(build_app(ctx)) as client:
        for path in ("/v1/models",):
            r = client.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            assert client.get(path, headers={"Authorization": "Bearer secret"}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
        for path in ("/health", "/version", "/docs", "/openapi.json"):
            assert client.get(path).status_code == 200, path
        assert "swagger" in client.get("/docs").text.lower()
        spec = client.get("/openapi.json").json()
        body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        assert "messages" in spec["components"]["schemas"][name]["properties"]
        refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(spec)))
        assert refs - set(spec["components"]["schemas"]) == set()        # every $ref resolves


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_keys_from(SimpleNamespace(api_key=None)) == ("from-vllm",)
    monkeypatch.setenv("JAXSERVE_API_KEY", "ours")
    assert api_keys_from(SimpleNamespace(api_key=None)) == ("ours",)
    assert api_keys_from(SimpleNamespace(api_key=["flag"])) == ("flag",)
    with pytest.raises(StartupError, match="must not be empty"):
        api_keys_from(SimpleNamespace(api_key=[" "]))
