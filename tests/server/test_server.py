"""The real server (conftest.py) through the official `openai` client and raw HTTP.

- API: greedy outputs equal the offline API's (`jaxserve.LLM`) for the same request, and a
  streamed answer puts together exactly the non-streamed one.
- Concurrency: many streaming clients all finish; clients that leave leave nothing behind.
- Errors: each invalid request gets its documented status and an OpenAI error body; API keys.
- Fuzz: hypothesis-drawn bodies (deterministic), sent 16 at a time so the valid ones batch
  in the engine as real traffic does: no 5xx, well-formed answers, server alive.

NOTE: one file, so that `pytest -n 2 --dist loadfile` builds the engine in one worker only.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_fuzz_bodies import NUM_CHAT_BODIES, NUM_COMPLETION_BODIES, chat_bodies, completion_bodies
from server_invalid_requests import INVALID
from server_agent_api_tests import *  # noqa: F401,F403  (run here, on this file's engine)
from server_structured_tests import *  # noqa: F401,F403  (run here, on this file's engine)


# ---- API -----------------------------------------------------------------------------------

def _stream_texts(stream) -> tuple[dict[int, str], dict[int, str], list]:
    texts, finish, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


def test_models_list_and_retrieve(served):
    client = served.client()
    models = client.models.list().data
    assert [m.id for m in models] == [served.model]
    assert client.models.retrieve(served.model).id == served.model


@pytest.mark.parametrize("case", ["completion", "completion_stop"])
def test_completion_equals_offline_streamed_or_not(served, case):
    prompt, params = served.cases[case]
    ref = served.reference[case].outputs[0]
    client = served.client()
    kwargs = dict(model=served.model, prompt=prompt, max_tokens=params.max_tokens, temperature=0,
                  stop=params.stop or None)
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.usage.prompt_tokens == len(served.reference[case].prompt_token_ids)
    texts, finish, _ = _stream_texts(client.completions.create(stream=True, **kwargs))
    assert texts == {0: ref.text}
    assert finish == {0: ref.finish_reason}


def test_stop_string_is_cut_and_reported(served):
    ref = served.reference["completion_stop"].outputs[0]
    assert ref.finish_reason == "stop" and " six" not in ref.text   # the case does what it says
    body = httpx.post(served.url + "/v1/completions", json={
        "prompt": served.cases["completion_stop"][0], "max_tokens": 16, "temperature": 0,
        "stop": " six", "include_stop_str_in_output": True}).json()
    assert body["choices"][0]["text"] == ref.text + " six"
    assert body["choices"][0]["stop_reason"] == " six"


def test_completion_logprobs_equal_offline(served):
    prompt, params = served.cases["completion_logprobs"]
    ref = served.reference["completion_logprobs"].outputs[0]
    client = served.client()
    kwargs = dict(model=served.model, prompt=prompt, max_tokens=params.max_tokens, temperature=0, logprobs=3)
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids)
    assert "".join(lp.tokens) == ref.text
    for got, want_id, want in zip(lp.token_logprobs, ref.token_ids, ref.logprobs):
        assert got == pytest.approx(want[want_id].logprob, abs=1e-4)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)       # top-3 plus the chosen token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert [t for part in streamed if part for t in part.tokens] == lp.tokens
    assert [o for part in streamed if part for o in part.text_offset] == lp.text_offset


def test_n2_greedy_choices_equal_offline(served):
    prompt, params = served.cases["completion"]
    ref = served.reference["completion"].outputs[0]
    client = served.client()
    whole = client.completions.create(model=served.model, prompt=prompt, max_tokens=params.max_tokens,
                                      temperature=0, n=2)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert [c.text for c in whole.choices] == [ref.text, ref.text]
    assert whole.usage.completion_tokens == 2 * len(ref.token_ids)
    texts, finish, _ = _stream_texts(client.chat.completions.create(
        model=served.model, messages=served.chat, max_tokens=served.cases["chat"][1].max_tokens,
        temperature=0, n=2, stream=True))
    chat_ref = served.reference["chat"].outputs[0].text
    assert texts == {0: chat_ref, 1: chat_ref}
    assert set(finish) == {0, 1}


def test_chat_equals_offline_streamed_or_not(served):
    ref = served.reference["chat"].outputs[0]
    client = served.client()
    kwargs = dict(model=served.model, messages=served.chat, max_completion_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(served.reference["chat"].prompt_token_ids)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    texts, finish, chunks = _stream_texts(stream)
    assert texts == {0: ref.text}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_logprobs_equal_offline(served):
    ref = served.reference["chat_logprobs"].outputs[0]
    out = served.client().chat.completions.create(model=served.model, messages=served.chat, max_tokens=6,
                                                  temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == ref.text
    for got, want_id, want in zip(content, ref.token_ids, ref.logprobs):
        assert got.logprob == pytest.approx(want[want_id].logprob, abs=1e-4)
        assert len(got.top_logprobs) == 2
        assert got.top_logprobs[0].logprob >= got.top_logprobs[1].logprob
        assert bytes(got.bytes) == got.token.encode()


def test_batch_prompts_token_ids_and_echo(served):
    prompt, _ = served.cases["completion"]
    ref = served.reference["completion"]
    client = served.client()
    batch = client.completions.create(model=served.model, prompt=[prompt, prompt], max_tokens=4, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1]
    first = batch.choices[0].text
    assert batch.choices[1].text == first and ref.outputs[0].text.startswith(first)
    by_ids = client.completions.create(model=served.model, prompt=ref.prompt_token_ids, max_tokens=4,
                                       temperature=0, echo=True)
    assert by_ids.choices[0].text == prompt + first


def test_prompt_logprobs_and_echoed_logprobs(served):
    client = served.client()
    ids = served.reference["completion"].prompt_token_ids
    out = client.completions.create(model=served.model, prompt=ids, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    positions = out.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    assert all(str(t) in pos for t, pos in zip(ids[1:], positions[1:]))
    echoed = client.completions.create(model=served.model, prompt=ids, max_tokens=2, temperature=0,
                                       echo=True, logprobs=1)
    lps = echoed.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(ids) + 2
    assert all(isinstance(x, float) for x in lps[1:])
    for t, pos, lp in zip(ids[1:], positions[1:], lps[1:]):
        assert abs(pos[str(t)]["logprob"] - lp) < 1e-4


def test_sampling_extras_and_seed(served):
    client = served.client()
    kwargs = dict(model=served.model, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=1234,
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5,
                              "ignore_eos": True, "skip_special_tokens": True})
    first, second = (client.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].text == second.choices[0].text          # same seed, same sample
    assert first.usage.completion_tokens == 5


def test_tokenize_detokenize_health_version_metrics(served):
    tok = httpx.post(served.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 512
    assert httpx.post(served.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    chat_tok = httpx.post(served.url + "/tokenize", json={"messages": served.chat}).json()
    assert chat_tok["tokens"] == served.reference["chat"].prompt_token_ids
    assert httpx.get(served.url + "/health").status_code == 200
    assert httpx.get(served.url + "/version").json()["version"]
    metrics = httpx.get(served.url + "/metrics")
    assert metrics.status_code == 200
    for name in ("jaxserve:num_requests_running", "jaxserve:kv_cache_usage_perc",
                 "jaxserve:time_to_first_token_seconds_bucket", "jaxserve:e2e_request_latency_seconds_count"):
        assert name in metrics.text



def test_metrics_under_vllm_names_with_model_name(served):
    """vLLM's names, with its `model_name` label, beside ours, counting the same."""
    before = served.metrics()
    label = f'{{model_name="{served.model}"}}'
    out = served.client().completions.create(model=served.model, prompt="Hello", max_tokens=3,
                                             temperature=0, extra_body={"ignore_eos": True})
    m = served.wait_idle()
    assert m["vllm:generation_tokens_total" + label] - before["vllm:generation_tokens_total" + label] == 3
    assert (m["vllm:prompt_tokens_total" + label] - before["vllm:prompt_tokens_total" + label]
            == out.usage.prompt_tokens)
    assert m["vllm:request_success_total" + label] - before["vllm:request_success_total" + label] == 1
    for ours, theirs in (("request_success_total", "request_success_total"),
                         ("num_requests_running", "num_requests_running"),
                         ("num_requests_waiting", "num_requests_waiting"),
                         ("kv_cache_usage_perc", "kv_cache_usage_perc"),
                         ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                         ("time_to_first_token_seconds_count", "time_to_first_token_seconds_count"),
                         ("e2e_request_latency_seconds_count", "e2e_request_latency_seconds_count"),
                         ("spec_decode_num_drafts_total", "spec_decode_num_drafts_total"),
                         ("spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens_total"),
                         ("spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_total")):
        assert m[f"vllm:{theirs}{label}"] == m[f"jaxserve:{ours}"], theirs
    assert m["vllm:e2e_request_latency_seconds_count" + label] >= 1
    assert m["vllm:e2e_request_latency_seconds_sum" + label] > 0
    text = httpx.get(served.url + "/metrics").text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:request_success_total counter" in text and "# TYPE vllm:num_requests_running gauge" in text
    assert f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{served.model}"}}' in text

# ---- concurrency and disconnects -----------------------------------------------------------

def test_32_concurrent_streaming_clients_all_finish(served):
    async def one(client, i: int) -> tuple[str, str | None]:
        text, finish = "", None
        stream = await client.completions.create(model=served.model, prompt=f"Fact number {i}:", max_tokens=4,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def health_latencies(http) -> list[float]:
        # The event loop must stay free while the engine works: /health answers at once.
        latencies = []
        for _ in range(10):
            t0 = time.perf_counter()
            assert (await http.get(served.url + "/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.2)
        return latencies

    async def main():
        async with served.async_client() as client, httpx.AsyncClient() as http:
            return await asyncio.gather(health_latencies(http), *(one(client, i) for i in range(32)))

    latencies, *results = asyncio.run(main())
    assert all(finish == "length" and text for text, finish in results), results
    assert max(latencies) < 2.0, latencies
    m = served.wait_idle()
    assert m["jaxserve:num_requests_running"] == 0


def test_disconnecting_clients_leave_no_request_and_no_block(served):
    aborted_before = served.metrics().get("jaxserve:request_abort_total", 0.0)
    long = dict(model=served.model, prompt="Write a very long story:", max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True})

    async def quit_stream(client) -> int:
        stream = await client.completions.create(stream=True, **long)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()      # drops the connection mid-stream
        return seen

    async def quit_whole() -> None:
        # A non-streamed request whose client gives up waiting: the server must notice. (The
        # wait is long enough for the request to be in the engine by then.)
        async with httpx.AsyncClient(timeout=4.0) as http:
            try:
                await http.post(served.url + "/v1/completions", json={
                    "prompt": "Another long story:", "max_tokens": 400, "ignore_eos": True})
            except httpx.TimeoutException:
                return
        raise AssertionError("a 400-token answer should not have come back within 4 s")

    async def main():
        async with served.async_client() as client:
            seen = await asyncio.gather(*(quit_stream(client) for _ in range(8)), quit_whole())
        return seen[:8]

    assert asyncio.run(main()) == [2] * 8
    m = served.wait_idle()
    assert m["jaxserve:num_requests_running"] == 0
    assert m["jaxserve:num_requests_waiting"] == 0
    assert m["jaxserve:num_used_blocks"] == 0
    assert m["jaxserve:kv_cache_usage_perc"] == 0
    assert m["jaxserve:request_abort_total"] - aborted_before == 9
    # ...and the server still answers.
    out = served.client().completions.create(model=served.model, prompt="Hi", max_tokens=1)
    assert out.choices[0].finish_reason == "length"


def test_load_64_clients_5_requests_a_third_disconnect(served):
    """Issue 10's loopback load: 64 clients x 5 streamed requests; every third client drops
    each stream after its first chunk. The others get exactly the greedy answer; nothing stays."""
    prompts = [f"List item {i}:" for i in range(4)]
    client = served.client()
    expected = [client.completions.create(model=served.model, prompt=p, max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one_client(ac, i: int) -> list[str | None]:
        texts = []
        for j in range(5):
            stream = await ac.completions.create(model=served.model, prompt=prompts[(i + j) % 4], max_tokens=3,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
            text = ""
            async for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
                if i % 3 == 0:
                    break
            await stream.close()
            texts.append(None if i % 3 == 0 else text)
        return texts

    async def main():
        async with served.async_client() as ac:
            return await asyncio.gather(*(one_client(ac, i) for i in range(64)))

    results = asyncio.run(main())
    for i, texts in enumerate(results):
        for j, text in enumerate(texts):
            if text is not None:
                assert text == expected[(i + j) % 4], (i, j, text)
    m = served.wait_idle()
    assert m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
    assert m["jaxserve:num_used_blocks"] == 0


# ---- invalid requests and API keys ---------------------------------------------------------

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
    for key in ("first-secret-key", "second-secret-key"):
        client = openai.OpenAI(base_url=served.auth_url + "/v1", api_key=key, max_retries=0)
        assert client.models.list().data[0].id == served.model
        assert client.completions.create(model=served.model, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    bad = openai.OpenAI(base_url=served.auth_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(served.auth_url + "/health").status_code == 200
    assert httpx.get(served.auth_url + "/metrics").status_code == 200


# ---- fuzz ----------------------------------------------------------------------------------

def _draw(strategy: st.SearchStrategy, count: int) -> list[dict]:
    bodies: list[dict] = []

    @settings(max_examples=count, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(body):
        bodies.append(body)

    collect()
    return bodies


def _check(http: httpx.Client, path: str, body: dict) -> str | None:
    """Sends one body; returns a complaint, or None when the answer is well-formed and not 5xx."""
    r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    if r.status_code >= 500:
        return f"{r.status_code} {r.text[:300]}"
    if r.status_code != 200:
        error = r.json().get("error", {})
        return None if error.get("message") else f"{r.status_code} without an error message: {r.text[:300]}"
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        if events[-1] != "[DONE]":
            return f"stream did not end in [DONE]: {r.text[-300:]}"
        if any("error" in json.loads(e) for e in events[:-1]):
            return f"stream carried an error: {r.text[-300:]}"
        return None
    return None if r.json().get("choices") else f"200 without choices: {r.text[:300]}"


def _fuzz(served, path: str, bodies: list[dict]) -> None:
    with httpx.Client(base_url=served.url, timeout=120,
                      limits=httpx.Limits(max_connections=16)) as http, ThreadPoolExecutor(16) as pool:
        complaints = list(pool.map(lambda b: _check(http, path, b), bodies))
    bad = [(b, c) for b, c in zip(bodies, complaints) if c is not None]
    assert not bad, "\n".join(f"{json.dumps(b)[:300]} -> {c}" for b, c in bad[:10])
    assert httpx.get(served.url + "/health").status_code == 200


def test_fuzz_completions(served):
    bodies = _draw(completion_bodies, NUM_COMPLETION_BODIES)
    assert len(bodies) == NUM_COMPLETION_BODIES
    _fuzz(served, "/v1/completions", bodies)


def test_fuzz_chat_completions(served):
    bodies = _draw(chat_bodies, NUM_CHAT_BODIES)
    assert len(bodies) == NUM_CHAT_BODIES
    _fuzz(served, "/v1/chat/completions", bodies)
    m = served.wait_idle()
    assert m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_used_blocks"] == 0
