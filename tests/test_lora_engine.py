"""Multi-LoRA end to end, offline: greedy ids with each adapter, and with the base model and
two adapters mixed in one batch, equal transformers + peft's (tests/golden/make_golden_lora.py)."""

import json
import os

import pytest

from jaxserve import LLM, LoRARequest, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden", "lora")
BASE = os.path.join(HERE, "golden", "ckpt", "llama")
GOLDENS = json.load(open(os.path.join(GOLDEN, "goldens.json")))
ADAPTERS = {"sql": LoRARequest("sql", 1, os.path.join(GOLDEN, "sql")),
            "chat": LoRARequest("chat", 2, os.path.join(GOLDEN, "chat"))}


@pytest.fixture(scope="module")
def llm():
    # max_loras=2: both adapters resident; max_lora_rank 16 (the chat adapter's)
    return LLM(BASE, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=8,
               max_model_len=64, num_kv_blocks=64, block_size=4)


def _params():
    return SamplingParams(max_tokens=GOLDENS["greedy_steps"], temperature=0.0, ignore_eos=True)


def _prompts():
    return [{"prompt_token_ids": p} for p in GOLDENS["prompts"]]


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", ["sql", "chat"])
def test_each_adapter_alone_matches_peft(llm, name):
    outs = llm.generate(_prompts(), _params(), use_tqdm=False, lora_request=ADAPTERS[name])
    assert _ids(outs) == GOLDENS["greedy"][name]


def test_base_and_two_adapters_in_one_batch(llm):
    """Nine requests, every prompt with the base model and each adapter, in one batch (their
    prompts repeat across adapters: a prefix-cache hit across adapters would give the wrong
    keys); the step's tokens carry three slots."""
    names = ["base", "sql", "chat"]
    prompts = [p for _ in names for p in _prompts()]
    loras = [ADAPTERS.get(n) for n in names for _ in GOLDENS["prompts"]]
    outs = llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)
    got = _ids(outs)
    k = len(GOLDENS["prompts"])
    for i, name in enumerate(names):
        assert got[i * k:(i + 1) * k] == GOLDENS["greedy"][name], name
    sched = llm.engine.scheduler
    assert sched.lora_slots.num_referenced == 0 and not sched.lora_slots.held     # nothing leaks


def test_an_engine_without_lora_refuses_a_lora_request():
    from jaxserve.engine.input_processor import InputProcessor
    from jaxserve.config import EngineConfig, ModelConfig
    cfg = ModelConfig("LlamaForCausalLM", 256, 64, 96, 2, 4, 2, 16)
    inputs = InputProcessor(EngineConfig(model=cfg), (2,), 64)
    with pytest.raises(ValueError, match="enable_lora"):
        inputs.process("r", [5, 6], SamplingParams(max_tokens=2), 0.0, ADAPTERS["sql"])


def test_adapters_coming_and_going_compile_nothing(llm):
    """After the first slot write (its small program), a third adapter evicting a resident
    one and the batches mixing them compile nothing: the slots are fixed-shape parameters."""
    import jax

    llm.generate(_prompts()[:1], _params(), use_tqdm=False, lora_request=ADAPTERS["sql"])
    llm.engine.wait_for_warmup()     # (warm-up's background programs are not the adapters')
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    third = LoRARequest("sql-again", 3, ADAPTERS["sql"].lora_path)
    loads = llm.engine.scheduler.lora_slots.num_loads
    outs = llm.generate(_prompts(), _params(), use_tqdm=False, lora_request=[third, ADAPTERS["chat"], None])
    assert llm.engine.scheduler.lora_slots.num_loads > loads      # a slot was written
    assert _ids(outs)[0] == GOLDENS["greedy"]["sql"][0]
    assert _ids(outs)[1] == GOLDENS["greedy"]["chat"][1]
    assert _ids(outs)[2] == GOLDENS["greedy"]["base"][2]
    assert compiles == []


def test_latency_bench_with_random_adapters(llm, tmp_path):
    """`jaxserve bench latency --lora-adapters N`'s batch: requests over N synthetic adapters
    (every projection adapted), and the device-only replay of a decode step with them."""
    import argparse

    from jaxserve.bench.latency import bench_batch
    from jaxserve.lora.synthetic import random_adapters

    loras = random_adapters(str(tmp_path), llm.engine.config.model, 2, rank=8, first_id=10)
    args = argparse.Namespace(input_len=6, output_len=4, num_iters=1, num_iters_warmup=0,
                              device_only_iters=2, hbm_bandwidth=None, profile_dir=None,
                              top_p=1.0, top_k=0, temperature=1.0)
    row = bench_batch(llm, 4, args, loras=loras)
    assert row["num_decode_steps"] >= 1 and row["device_only_step_ms"] > 0
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.lora_slots.num_referenced == 0


def test_mixed_batch_with_chunked_prefill_and_multi_step_decode():
    """16-token steps chunk the 20-token prompt; decode runs 4 steps a launch (multi-step):
    each token keeps its slot through both."""
    llm = LLM(BASE, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=4,
              max_num_batched_tokens=16, num_scheduler_steps=4, max_model_len=64,
              num_kv_blocks=64, block_size=4, warmup=False)
    names = ["chat", "base", "sql"]
    outs = llm.generate(_prompts(), _params(), use_tqdm=False,
                        lora_request=[ADAPTERS.get(n) for n in names])
    assert _ids(outs) == [GOLDENS["greedy"][n][i] for i, n in enumerate(names)]
