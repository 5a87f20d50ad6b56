"""Multi-LoRA's parts without an engine: PEFT adapters read onto the fused projections (and
refused with a reason), the slot LRU, and the scheduler's slot references and prefix keys."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_messages import RunnerOutput
from jaxserve.lora.adapter import LoRAError, load_adapter, slot_rank
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import LoRASlots
from jaxserve.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden", "lora")
CFG = ModelConfig("LlamaForCausalLM", 256, 64, 96, 2, 4, 2, 16)   # tests/golden/ckpt/llama's shape


def _copy(tmp_path, name="chat", **config_changes):
    path = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), path)
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(config_changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return str(path)


def test_chat_adapter_lands_in_its_parts_with_rslora_scales():
    a = load_adapter("chat", 2, os.path.join(GOLDEN, "chat"), CFG, max_lora_rank=16)
    t = load_file(os.path.join(GOLDEN, "chat", "adapter_model.safetensors"))
    pre = "base_model.model.model.layers.1."
    r = slot_rank(16)
    wqkv_a, wqkv_b = a.layers[1]["wqkv"]
    # k is part 1 of q|k|v: A in columns r..2r, B (scaled 8 / sqrt(16)) over k's columns
    np.testing.assert_allclose(wqkv_a[:, r:2 * r], t[pre + "self_attn.k_proj.lora_A.weight"].T)
    np.testing.assert_allclose(wqkv_b[r:2 * r, 64:96], 2.0 * t[pre + "self_attn.k_proj.lora_B.weight"].T,
                               rtol=1e-6)
    assert not wqkv_a[:, :r].any() and not wqkv_b[:, :64].any()     # q untouched
    # down_proj at its own rank 4 (rank_pattern): scale 8 / sqrt(4), zero-padded to r
    down_a, down_b = a.layers[1]["w_down"]
    np.testing.assert_allclose(down_b[:4], 8 / math.sqrt(4) * t[pre + "mlp.down_proj.lora_B.weight"].T,
                               rtol=1e-6)
    assert not down_a[:, 4:].any()
    assert a.max_rank == 16 and a.targets == ("down_proj", "gate_proj", "k_proj", "up_proj")


def test_plain_lora_scale_is_alpha_over_r():
    a = load_adapter("sql", 1, os.path.join(GOLDEN, "sql"), CFG, max_lora_rank=8)
    t = load_file(os.path.join(GOLDEN, "sql", "adapter_model.safetensors"))
    b = t["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"]
    np.testing.assert_allclose(a.layers[0]["wo"][1][:8], 16 / 8 * b.T, rtol=1e-6)


@pytest.mark.parametrize("change,match", [
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embeddings"),
    (dict(target_modules="all-linear"), "pattern"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="IA3"), "peft_type"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, change, match):
    with pytest.raises(LoRAError, match=match):
        load_adapter("x", 1, _copy(tmp_path, **change), CFG, 16)


def test_rank_past_max_lora_rank_and_other_shapes_are_refused(tmp_path):
    with pytest.raises(LoRAError, match="max_lora_rank is 8"):
        load_adapter("chat", 2, os.path.join(GOLDEN, "chat"), CFG, max_lora_rank=8)
    other = ModelConfig("LlamaForCausalLM", 256, 128, 96, 2, 4, 2, 32)
    with pytest.raises(LoRAError, match="another base model"):
        load_adapter("chat", 2, os.path.join(GOLDEN, "chat"), other, max_lora_rank=16)
    with pytest.raises(LoRAError, match="adapter_config.json"):
        load_adapter("x", 1, str(tmp_path / "missing"), CFG, 16)
    path = _copy(tmp_path, "sql")
    t = load_file(os.path.join(path, "adapter_model.safetensors"))
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((8, 256), np.float32)
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="embeddings"):
        load_adapter("x", 1, path, CFG, 16)


def test_slots_lru_keeps_referenced_adapters_and_evicts_the_oldest_idle():
    s = LoRASlots(2)
    assert s.acquire(10) == (1, True) and s.acquire(20) == (2, True)
    assert not s.can_acquire(30)                  # both referenced
    s.release(10)
    s.release(20)
    assert s.acquire(10) == (1, False)            # resident: no write
    s.release(10)
    assert s.acquire(30) == (2, True)             # 20 idle longest: evicted
    assert 20 not in s.slot_of and s.slot_of == {10: 1, 30: 2}


def test_lora_with_speculative_decoding_is_refused():
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=CFG, lora=LoRAConfig(), speculative=object())


# -- the scheduler --------------------------------------------------------------------------

SQL, CHAT = LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")


def _sched(max_loras=1, blocks=64):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                     CacheConfig(block_size=4), blocks, max_loras=max_loras)


def _req(rid, lora, n=8, max_tokens=3):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=(2,), lora_request=lora)


def _finish_step(s, out):
    sampled = [[7] if r.sample else [] for r in out.scheduled]
    s.update(out, RunnerOutput(out.req_ids, sampled, [None] * len(sampled)))


def test_max_loras_bounds_the_adapters_of_a_step_and_base_requests_go_by():
    s = _sched(max_loras=1)
    for r in (_req("a", SQL), _req("b", CHAT), _req("c", None), _req("d", SQL)):
        s.add_request(r)
    out = s.schedule()
    assert sorted(out.req_ids) == ["a", "c", "d"]          # chat waits: one slot, sql's
    assert out.lora_loads == [(1, SQL.lora_int_id)]        # written once for a and d
    slots = {n.req_id: n.lora_slot for n in out.new_requests}
    assert slots == {"a": 1, "c": 0, "d": 1}
    assert [r.request_id for r in s.waiting] == ["b"]
    _finish_step(s, out)
    while "b" not in {r.request_id for r in s.running}:
        out = s.schedule()
        _finish_step(s, out)
    assert out.lora_loads == [(1, CHAT.lora_int_id)]       # sql's slot, once it was idle


def test_preemption_and_abort_release_the_slot_reference():
    s = _sched(max_loras=2)
    s.add_request(_req("a", SQL))
    s.add_request(_req("b", CHAT))
    s.schedule()
    assert s.lora_slots.num_referenced == 2
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.lora_slots.refs[SQL.lora_int_id] == 0
    s._preempt(s.running.pop())
    assert s.lora_slots.num_referenced == 0 and not s.lora_slots.held


def test_a_prefix_hit_never_crosses_adapters():
    s = _sched(max_loras=2)
    s.add_request(_req("a", SQL, n=12, max_tokens=1))
    _finish_step(s, s.schedule())                 # a's 3 full blocks cached under sql
    s.add_request(_req("b", CHAT, n=12, max_tokens=1))
    s.add_request(_req("c", SQL, n=12, max_tokens=1))
    s.add_request(_req("d", None, n=12, max_tokens=1))
    s.schedule()
    assert s.requests["b"].num_cached_tokens == 0 and s.requests["d"].num_cached_tokens == 0
    assert s.requests["c"].num_cached_tokens == 8             # same adapter: a hit


def test_startup_block_states_the_slots_bytes():
    from jaxserve.engine.startup_report import startup_lines
    from jaxserve.lora.weights import slot_bytes

    lora = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    # per layer, rank 16 (8 rounded up), 3 slots: qkv 64x48 + 48x128, o 64x16 + 16x64,
    # gate|up 64x32 + 32x192, down 96x16 + 16x64; two layers of f32
    per_layer = 64 * 48 + 48 * 128 + 64 * 16 + 16 * 64 + 64 * 32 + 32 * 192 + 96 * 16 + 16 * 64
    assert slot_bytes(CFG, lora, "float32") == 3 * per_layer * 2 * 4
    lines = startup_lines(EngineConfig(model=CFG, lora=lora), 10, 4, 100, on_cpu=True)
    assert any(line.startswith("LoRA: 2 adapter slots of rank 8") and "3 adapters cached" in line
               for line in lines)


def test_cpu_cache_keeps_max_cpu_loras_adapters_and_reads_others_again():
    from jaxserve.lora.store import AdapterStore

    store = AdapterStore(CFG, LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
    sql = LoRARequest("sql", 1, os.path.join(GOLDEN, "sql"))
    chat = LoRARequest("chat", 2, os.path.join(GOLDEN, "chat"))
    store.check(sql)
    store.check(chat)                 # evicts sql from the host cache
    assert store.num_disk_loads == 2
    store.get(2)
    assert store.num_disk_loads == 2  # cached
    assert store.get(1).name == "sql" and store.num_disk_loads == 3
    with pytest.raises(ValueError, match="already 'sql'"):
        store.register(LoRARequest("other", 1, os.path.join(GOLDEN, "chat")))
