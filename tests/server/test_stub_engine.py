"""States the real engine cannot be put in on demand, behind the real app (protocol only):
overloaded / dead -> 503 + Retry-After, failed alone -> 500; a model without a tokenizer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from jaxserve.engine import EngineDeadError, EngineOverloadedError
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.server.app import build_app
from jaxserve.server.context import ServerContext


class _Tokenizer:
    vocab_size = 100

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


class _FailingEngine:
    """generate() fails as `failure` says: 'overloaded', 'dead' or 'alone'."""

    model_name = "stub"
    tokenizer = _Tokenizer()
    config = SimpleNamespace(scheduler=SimpleNamespace(max_model_len=64),
                             model=SimpleNamespace(vocab_size=100), max_logprobs=5)

    def __init__(self, failure: str, healthy: bool = True):
        self.failure, self.is_healthy = failure, healthy

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        if self.failure == "overloaded":
            raise EngineOverloadedError("too many requests in flight")
        if self.failure == "dead":
            raise EngineDeadError("engine step failed")
        yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                            [CompletionOutput(0, "", [], finish_reason="error")], finished=True,
                            error="RuntimeError: boom")

    async def abort(self, request_id):
        pass


def _client(engine) -> TestClient:
    return TestClient(build_app(ServerContext(engine, ("stub",))), raise_server_exceptions=False)


@pytest.mark.parametrize("failure,status,code", [("overloaded", 503, "overloaded"),
                                                 ("dead", 503, "engine_stopped"),
                                                 ("alone", 500, "internal_error")])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_status(failure, status, code, stream):
    with _client(_FailingEngine(failure)) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": stream})
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == code
        if status == 503:
            assert int(r.headers["retry-after"]) >= 1
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 1})
        # The stand-in tokenizer has no chat template: a 400 naming it, before the engine.
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_health_is_503_when_the_engine_is_dead():
    with _client(_FailingEngine("dead", healthy=False)) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/version").status_code == 200


class _NoTokenizerEngine(_FailingEngine):
    """Dummy weights without a tokenizer: answers token ids with token ids (and logprobs)."""

    tokenizer = None

    def __init__(self):
        super().__init__("none")

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        lps = [{7: Logprob(-0.5, 1, None)}] if sampling_params.logprobs is not None else None
        yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                            [CompletionOutput(0, "", [7], logprobs=lps, finish_reason="length")], finished=True)


def test_a_model_without_tokenizer_takes_token_ids_only():
    with _client(_NoTokenizerEngine()) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "logprobs": 0, "echo": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and choice["logprobs"]["tokens"][-1] == "token_id:7"
        for path, body in (("/v1/completions", {"prompt": "text"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/tokenize", {"prompt": "text"}), ("/detokenize", {"tokens": [1]})):
            r = client.post(path, json=body)
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"], (path, r.text)
