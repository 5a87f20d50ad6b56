"""End to end: `openai` client -> the HTTP server -> the real engine, on a tiny checkpoint with
Qwen3's real tokenizer and chat template, whose output is forced.

The checkpoint is a "transition" model: its layers are zero (the residual stream is the
token's embedding), each scripted token's embedding is its own one-hot direction and the LM
head maps that direction to the next scripted token. Greedy decoding then writes the script
(`<think>Looks warm</think>Sunny.` after the prompt's last token, then <|im_end|>); a grammar,
once it engages, overrides it (the answer after the thinking is the grammar's)."""

from __future__ import annotations

import json
import os

import numpy as np
import openai
import pytest
from families import qwen3

HIDDEN = 64
SCRIPT = "<think>Looks warm</think>Sunny."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# NOTE: the call is forced with a regex, and llguidance reads Qwen's `<tool_call>` in a regex as
# its special token, whose mask it then allows but whose consumption it refuses (the output
# ends there): so the forced call here is in Mistral's format, plain text to this vocabulary.
# Qwen's own formats go through the server in test_chat_server.py.
CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _checkpoint(path: str) -> str:
    from safetensors.numpy import save_file

    tok = qwen3()
    vocab, eos = len(tok.hf), tok.hf.convert_tokens_to_ids("<|im_end|>")
    script = tok.encode(SCRIPT, add_special_tokens=False)
    chain = [tok.encode("\n", add_special_tokens=False)[0]] + script + [eos]   # the prompt ends in "\n"
    assert len(set(chain[:-1])) == len(chain) - 1, "each scripted token needs one successor"
    embed = np.zeros((vocab, HIDDEN), np.float32)
    head = np.zeros((vocab, HIDDEN), np.float32)
    for k, (a, b) in enumerate(zip(chain, chain[1:])):
        embed[a, k] = 1.0
        head[b, k] = 10.0
    z = lambda *shape: np.zeros(shape, np.float32)   # noqa: E731
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": np.ones(HIDDEN, np.float32),
               "model.layers.0.input_layernorm.weight": np.ones(HIDDEN, np.float32),
               "model.layers.0.post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
               "model.layers.0.self_attn.q_proj.weight": z(64, HIDDEN), "model.layers.0.self_attn.k_proj.weight": z(32, HIDDEN),
               "model.layers.0.self_attn.v_proj.weight": z(32, HIDDEN), "model.layers.0.self_attn.o_proj.weight": z(HIDDEN, 64),
               "model.layers.0.mlp.gate_proj.weight": z(64, HIDDEN), "model.layers.0.mlp.up_proj.weight": z(64, HIDDEN),
               "model.layers.0.mlp.down_proj.weight": z(HIDDEN, 64)}
    save_file(weights, os.path.join(path, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": vocab, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": eos, "hidden_act": "silu"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tok.hf.save_pretrained(path)
    return path


ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=2, max_num_batched_tokens=512, warmup=False)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(str(tmp_path_factory.mktemp("transition_qwen3")))


@pytest.fixture(scope="module")
def client(ckpt):
    from jaxserve import LLM
    from jaxserve.engine import AsyncEngine
    from jaxserve.parsers.reasoning import reasoning_parser
    from jaxserve.server.app import build_app
    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.context import ServerContext

    llm = LLM(ckpt, **ENGINE)
    engine = AsyncEngine(llm.engine)
    ctx = ServerContext(engine, ("tiny-qwen3",), reasoning_parser=reasoning_parser("qwen3"),
                        enable_auto_tool_choice=True, tool_call_parser="mistral")
    server = BackgroundServer(build_app(ctx)).start()
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    finally:
        server.stop()
        engine.shutdown()


def _both(client, **body):
    whole = client.chat.completions.create(model="tiny-qwen3", temperature=0, max_tokens=40, **body).choices[0]
    reasoning, content, calls = "", "", {}
    for chunk in client.chat.completions.create(model="tiny-qwen3", temperature=0, max_tokens=40, stream=True, **body):
        for c in chunk.choices:
            d = c.delta.model_dump()
            reasoning += d.get("reasoning") or ""
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], [tc["function"]["name"], ""])
                entry[1] += tc["function"]["arguments"] or ""
    return whole, (reasoning, content, [tuple(calls[i]) for i in sorted(calls)])


def test_thinking_and_answer_split(client):
    whole, streamed = _both(client, messages=USER)
    msg = whole.message.model_dump()
    assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == ("Looks warm", "Looks warm", "Sunny.")
    assert streamed == ("Looks warm", "Sunny.", [])
    assert whole.finish_reason == "stop"


def test_response_format_constrains_the_answer_after_the_thinking(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY}}
    whole, streamed = _both(client, messages=USER, response_format=fmt)
    assert whole.message.model_dump()["reasoning"] == "Looks warm" == streamed[0]
    assert json.loads(whole.message.content) == {"city": "Paris"} == json.loads(streamed[1])


def test_tool_call_after_the_thinking(client):
    regex = "".join("\\" + c if c in '\\.^$|?*+()[]{}' else c for c in CALL)
    whole, streamed = _both(client, messages=USER, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}})
    (call,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert whole.message.model_dump()["reasoning"] == "Looks warm" and whole.finish_reason == "tool_calls"
    assert streamed[0] == "Looks warm" and not streamed[1].strip()
    assert streamed[2] == [("get_weather", '{"city": "Paris"}')]


def test_offline_chat_with_ngram_drafts_across_the_end_of_thinking(ckpt):
    """The prompt repeats the script, so the n-gram proposer drafts " warm", "</think>", "{..."
    while the output still thinks: the drafts before and at </think> pass unconstrained, the
    ones after it under the grammar; the output is the one without speculation."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.structured import StructuredOutputsParams as SO
    from tests.spec_helpers import spec_counts

    llm = LLM(ckpt, reasoning_parser="qwen3", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}, **ENGINE)
    structured = llm.engine.core.structured
    kept, valid_drafts = [], structured.valid_drafts
    structured.valid_drafts = lambda rid, drafts: kept.append(valid_drafts(rid, drafts)) or kept[-1]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=CITY))
    messages = [{"role": "user", "content": 'Looks warm</think>{"city":"Paris"}'}]
    (out,) = llm.chat(messages, params, use_tqdm=False)
    c = out.outputs[0]
    assert (c.reasoning, c.content) == ("Looks warm", '{"city":"Paris"}')
    end = qwen3().encode("</think>", add_special_tokens=False)[0]
    # drafts kept through the end of the thinking and on into the grammar's first tokens
    assert any(end in k and 0 < k.index(end) < len(k) - 1 for k in kept), kept
    assert spec_counts(llm)["spec_decode_num_accepted_tokens_total"] >= 3
