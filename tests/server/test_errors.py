"""Invalid requests get their documented status and an OpenAI error body; keys are enforced."""

from __future__ import annotations

import json

import httpx
import pytest

LONG_PROMPT_IDS = [28] * 600      # > max_model_len (512)
# (name, path, body (dict, or raw bytes), status, `param` expected (or None), text in message)
INVALID = [
    ("invalid JSON", "/v1/completions", b'{"prompt": "a",', 400, None, "not valid JSON"),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None, "object"),
    ("NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, None, ""),
    ("missing prompt", "/v1/completions", {"max_tokens": 1}, 400, "prompt", "prompt"),
    ("string for int", "/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("bool for int", "/v1/completions", {"prompt": "a", "n": True}, 400, "n", "integer"),
    ("negative temperature", "/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature", "0"),
    ("n = 0", "/v1/completions", {"prompt": "a", "n": 0}, 400, "n", "1"),
    ("top_p = 0", "/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p", "0"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("empty prompt in a batch", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt", "prompt[1]"),
    ("token id past the vocab", "/v1/completions", {"prompt": [1, 49152]}, 400, "prompt", "[0, 49151]"),
    ("negative token id", "/v1/completions", {"prompt": [-1]}, 400, "prompt", "[0, 49151]"),
    ("prompt too long", "/v1/completions", {"prompt": LONG_PROMPT_IDS}, 400, "prompt", "512"),
    ("max_tokens past the context", "/v1/completions", {"prompt": "a", "max_tokens": 1000}, 400, "max_tokens",
     "512"),
    ("logprobs above the limit", "/v1/completions", {"prompt": "a", "logprobs": 6}, 400, "logprobs", "[0, 5]"),
    ("min_tokens above max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens", "max_tokens"),
    ("empty stop string", "/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop", "non-empty"),
    ("logit_bias key not a token", "/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias",
     "token ids"),
    ("logit_bias out of range", "/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "[-100, 100]"),
    ("stop_token_ids past the vocab", "/v1/completions", {"prompt": "a", "stop_token_ids": [10**6]}, 400,
     "stop_token_ids", "[0, 49151]"),
    ("negative seed", "/v1/completions", {"prompt": "a", "seed": -1}, 400, "seed", "0"),
    ("suffix", "/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix", "not supported"),
    ("prompt_logprobs", "/v1/completions", {"prompt": "a", "prompt_logprobs": 1}, 400, "prompt_logprobs",
     "not supported"),
    ("unknown model", "/v1/completions", {"prompt": "a", "model": "gpt-17"}, 404, "model", "gpt-17"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "empty"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role", "system, user, assistant"),
    ("content of the wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", ""),
    ("message not an object", "/v1/chat/completions", {"messages": ["hi"]}, 400, "messages[0]", ""),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("top_logprobs above the limit", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 6}, 400,
     "top_logprobs", "[0, 5]"),
    ("max_completion_tokens past the context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600}, 400,
     "max_completion_tokens", "512"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400,
     "tools", "not supported"),
    ("detokenize past the vocab", "/detokenize", {"tokens": [49152]}, 400, "tokens", "[0, 49151]"),
    ("tokenize with neither", "/tokenize", {}, 400, "prompt", "exactly one"),
    ("body over the size limit", "/v1/completions", {"prompt": "x" * (5 << 20)}, 413, None, "limit"),
]


def _post(url: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)


def _assert_error_body(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("name,path,body,status,param,text", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_request_gets_its_status_and_error_body(served, name, path, body, status, param, text):
    error = _assert_error_body(_post(served.url + path, body), status)
    if param is not None:
        assert error["param"] == param, error
    assert text in error["message"], error


def test_unknown_route_and_method_use_the_error_shape(served):
    _assert_error_body(httpx.get(served.url + "/v1/nothing"), 404)
    _assert_error_body(httpx.get(served.url + "/v1/completions"), 405)


def test_server_keeps_serving_after_invalid_requests(served):
    for _, path, body, *_ in INVALID[:10]:
        _post(served.url + path, body)
    out = served.client().completions.create(model=served.model, prompt="Hello", max_tokens=1)
    assert out.choices[0].text is not None and out.usage.completion_tokens == 1


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "first-secret-key"},
                                     {"Authorization": "Bearer"}], ids=["none", "wrong", "no-scheme", "empty"])
def test_auth_refuses_missing_or_wrong_keys(served, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
        r = httpx.request(method, served.auth_url + path, headers=headers, json={"prompt": "a", "max_tokens": 1})
        error = _assert_error_body(r, 401)
        assert "API key" in error["message"]


def test_auth_accepts_each_key_and_leaves_health_and_metrics_open(served):
    import openai

    for key in ("first-secret-key", "second-secret-key"):
        client = openai.OpenAI(base_url=served.auth_url + "/v1", api_key=key, max_retries=0)
        assert client.models.list().data[0].id == served.model
        assert client.completions.create(model=served.model, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    bad = openai.OpenAI(base_url=served.auth_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(served.auth_url + "/health").status_code == 200
    assert httpx.get(served.auth_url + "/metrics").status_code == 200
