"""The server's options a vLLM user sets: --generation-config defaults, --chat-template, API keys
(which paths they protect), /docs. Behind the real app with a stand-in engine that records the
SamplingParams it was given."""

from __future__ import annotations

import json
import logging
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


class _LogprobEngine(RecordingEngine):
    """Answers one token (id 7, "x") with its logprob and a runner-up (id 3)."""

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput

        self.params.append(sampling_params)
        position = {7: Logprob(-0.5, rank=1), 3: Logprob(-1.5, rank=2)}
        yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                            [CompletionOutput(0, "x", [7], logprobs=[position], finish_reason="length")],
                            finished=True)


@pytest.mark.parametrize("flag,field,want", [
    (True, None, True), (False, None, False), (False, True, True), (True, False, False)])
def test_return_tokens_as_token_ids(flag, field, want):
    ctx = ServerContext(_LogprobEngine(), ("stub",), return_tokens_as_token_ids=flag)
    extra = {} if field is None else {"return_tokens_as_token_ids": field}
    with TestClient(build_app(ctx)) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "logprobs": 2, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
            "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        chat = r.json()["choices"][0]["logprobs"]["content"][0]
        stream = client.post("/v1/completions", json={"prompt": "hi", "logprobs": 1, "max_tokens": 1,
                                                      "stream": True, **extra}).text
    if want:
        assert lp["tokens"] == ["token_id:7"] and list(lp["top_logprobs"][0]) == ["token_id:7", "token_id:3"]
        assert chat["token"] == "token_id:7" and chat["bytes"] == list(b"token_id:7")
        assert [t["token"] for t in chat["top_logprobs"]] == ["token_id:7", "token_id:3"]
        assert '"tokens":["token_id:7"]' in stream.replace(" ", "")
    else:
        assert lp["tokens"] == ["x"] and chat["token"] == "x"
        assert "token_id:" not in stream


def test_enable_log_requests_logs_each_request(caplog):
    ctx = ServerContext(RecordingEngine(), ("stub",), log_requests=True, max_log_len=3)
    with caplog.at_level(logging.INFO, logger="jaxserve"), TestClient(build_app(ctx)) as client:
        assert client.post("/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 2,
                                                    "temperature": 0}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxserve.server.requests"]
    assert len(lines) == 2
    assert "prompt: 'hel'" in lines[0] and "prompt_token_ids: [4, 1, 8]" in lines[0]
    assert "-0:" in lines[0] and "-1:" in lines[1] and "max_tokens=2" in lines[0]


def test_requests_are_not_logged_by_default(caplog):
    ctx = ServerContext(RecordingEngine(), ("stub",))
    with caplog.at_level(logging.INFO, logger="jaxserve"), TestClient(build_app(ctx)) as client:
        assert client.post("/v1/completions", json={"prompt": "hello"}).status_code == 200
    assert not [r for r in caplog.records if r.name == "jaxserve.server.requests"]
