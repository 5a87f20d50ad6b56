"""The OpenAI API through the official `openai` client against the real server.

Greedy outputs must equal the offline API's (`jaxserve.LLM`) for the same request, and a
streamed answer must put together exactly the non-streamed one.
"""

from __future__ import annotations

import httpx
import pytest


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
