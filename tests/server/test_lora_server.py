"""Multi-LoRA through the server: adapters listed with their parent, picked by `model`, loaded
and unloaded at run time; greedy ids equal transformers + peft's (tests/golden/lora)."""

import argparse
import json
import os

import pytest
from fastapi.testclient import TestClient

from jaxserve.engine import AsyncEngine
from jaxserve.server.app import build_app
from jaxserve.server.lora_modules import lora_module
from jaxserve.server.startup import server_context

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(HERE, "golden", "lora")
GOLDENS = json.load(open(os.path.join(GOLDEN, "goldens.json")))


@pytest.fixture(scope="module")
def client():
    engine = AsyncEngine.from_engine_args(os.path.join(HERE, "golden", "ckpt", "llama"), enable_lora=True,
                                          max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_num_seqs=8,
                                          max_model_len=64, num_kv_blocks=64, block_size=4,
                                          served_model_name="base")
    args = argparse.Namespace(enable_lora=True, served_model_name=["base"],
                              lora_modules=[lora_module(f"sql={GOLDEN}/sql"),
                                            lora_module(json.dumps({"name": "chat", "path": f"{GOLDEN}/chat",
                                                                    "base_model_name": "base"}))])
    ctx = server_context(engine, args, {})
    with TestClient(build_app(ctx)) as c:
        yield c
    engine.shutdown()


def _complete(client, model, prompt):
    return client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": GOLDENS["greedy_steps"], "temperature": 0,
        "ignore_eos": True})


def _ids(resp):
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_models_lists_adapters_with_their_parent(client):
    data = client.get("/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {"base", "sql", "chat"}
    assert by_id["sql"]["parent"] == "base" and by_id["chat"]["parent"] == "base"
    assert by_id["sql"]["root"].endswith("sql")


@pytest.mark.parametrize("model", ["base", "sql", "chat"])
def test_greedy_ids_per_model_match_peft(client, model):
    """The prompt as token ids (the tiny model has no tokenizer); ids come back as logprob
    tokens 'token_id:N'."""
    golden = GOLDENS["greedy"][model]
    for prompt, want in zip(GOLDENS["prompts"], golden):
        r = client.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": len(want), "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert [int(t.split(":")[1]) for t in tokens] == want
        assert r.json()["model"] == model           # vLLM's: the adapter's name


def test_unknown_adapter_is_404_and_bad_path_400_and_the_server_goes_on(client, tmp_path):
    r = _complete(client, "nope", GOLDENS["prompts"][0])
    assert r.status_code == 404 and "nope" in r.text
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.text
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "DoRA" in r.text
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404
    assert _complete(client, "sql", GOLDENS["prompts"][0]).status_code == 200


def test_load_use_and_unload_at_run_time(client):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": f"{GOLDEN}/sql"})
    assert r.status_code == 200, r.text
    assert "sql2" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    r = client.post("/v1/completions", json={
        "model": "sql2", "prompt": GOLDENS["prompts"][1], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert [int(t.split(":")[1]) for t in tokens] == GOLDENS["greedy"]["sql"][1][:4]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": f"{GOLDEN}/sql"})
    assert r.status_code == 400          # already loaded
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 200
    assert _complete(client, "sql2", GOLDENS["prompts"][0]).status_code == 404


def test_a_stream_names_the_adapter(client):
    with client.stream("POST", "/v1/completions", json={
            "model": "chat", "prompt": GOLDENS["prompts"][0], "max_tokens": 3, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and all(e["model"] == "chat" for e in events)


def test_lora_modules_parse_both_forms():
    assert lora_module("a=/x") == {"name": "a", "path": "/x"}
    assert lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}')["base_model_name"] == "m"
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=PATH"):
        lora_module("nopath")
    with pytest.raises(argparse.ArgumentTypeError, match="base_model_name"):
        lora_module('{"name": "a"}')


def test_lora_modules_need_enable_lora_and_a_bad_one_stops_the_start(tmp_path):
    from jaxserve.engine.checks import StartupError
    from jaxserve.server.startup import lora_modules

    args = argparse.Namespace(enable_lora=False, lora_modules=[lora_module(f"sql={GOLDEN}/sql")])
    with pytest.raises(StartupError, match="--enable-lora"):
        lora_modules(None, args, ("base",))

    class Engine:        # refuses every adapter, as the real one does a bad directory
        def add_lora(self, lora):
            raise ValueError(f"LoRA adapter {lora.lora_path}: no adapter_config.json there")

    args = argparse.Namespace(enable_lora=True, lora_modules=[lora_module(f"bad={tmp_path}")])
    with pytest.raises(StartupError, match="--lora-modules bad: .*adapter_config.json"):
        lora_modules(Engine(), args, ("base",))
    assert lora_modules(Engine(), argparse.Namespace(enable_lora=True), ("base",)).names == []


def test_serve_parses_vllms_lora_flags():
    from jaxserve.cli import build_parser
    from jaxserve.engine.args import engine_kwargs

    args = build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
         "--lora-modules", "c=/z", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5"])
    assert [m["name"] for m in args.lora_modules] == ["a", "b", "c"]
    kw = engine_kwargs(args)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["max_cpu_loras"]) == (True, 3, 32, 5)
