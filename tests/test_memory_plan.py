"""Memory planning (worker/memory_plan.py, cache_sizing.plan_caches): vLLM's formula (the
caches take utilization x total - weights - the step programs' peak - headroom), the one-line
error of a budget that cannot hold one max_model_len request (before any compile), JAX's
allocator variables, and the memory report. On the CPU, with the device's memory faked
(`memory_plan.measure`): the CPU itself keeps its byte budget."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import jax
import pytest

from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.core.kv_cache import manager as cache_manager
from jaxserve.models import loader, registry
from jaxserve.worker import compiling, memory_plan
from jaxserve.worker import cache_sizing
from jaxserve.worker.cache_sizing import Measured, plan_caches
from jaxserve.worker.memory_plan import CacheDoesNotFit, DeviceMemory
from jaxserve.worker.runner import ModelRunner

TINY = os.path.join(os.path.dirname(__file__), "golden", "ckpt", "llama")
GiB = 1 << 30


@pytest.fixture(scope="module")
def tiny():
    cfg, params, _ = loader.load_model(TINY, dtype="float32")
    return cfg, params


def _config(cfg, *, max_len=64, max_seqs=4, utilization=0.9, **cache) -> EngineConfig:
    return EngineConfig(model=cfg, cache=CacheConfig(block_size=4, gpu_memory_utilization=utilization, **cache),
                        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=32,
                                                  max_model_len=max_len),
                        dtype="float32", warmup=False)


def _per_block(config) -> int:
    specs = registry.get_family(config.model.architecture).cache_specs(config.model)
    return cache_manager.bytes_per_block(specs, config.cache.block_size, 4)


def _plan(config, measured, **kw):
    specs = registry.get_family(config.model.architecture).cache_specs(config.model)
    max_blocks = -(-config.scheduler.max_model_len // config.cache.block_size)
    return plan_caches(config, specs, [], 0, max_blocks, measured, **kw)


def _weights_leaving(left: int, total: int, peak: int, headroom: int, utilization=0.9) -> int:
    """The bytes in use that leave `left` for the caches."""
    return int(utilization * total) - peak - headroom - left


def test_vllm_formula_sizes_the_cache(tiny):
    """blocks = (utilization x total - weights - peak - headroom) // bytes per block."""
    config = _config(tiny[0], max_len=256, max_seqs=32)   # useful: 32 x 64 + 1 blocks
    per_block = _per_block(config)
    in_use = _weights_leaving(1000 * per_block + 5, 80 * GiB, 3 * GiB, 2 * GiB)
    memory = DeviceMemory(total=80 * GiB, limit=72 * GiB, in_use=in_use)
    plan = _plan(config, Measured(memory, peak_bytes=3 * GiB, headroom_bytes=2 * GiB))
    budget = int(0.9 * 80 * GiB) - in_use - 3 * GiB - 2 * GiB
    assert memory_plan.cache_budget(0.9, memory, 3 * GiB, 2 * GiB) == budget == 1000 * per_block + 5
    assert plan.num_blocks == 1000
    report = plan.memory
    assert (report.source, report.device_total_bytes, report.weights_bytes, report.peak_bytes,
            report.headroom_bytes) == ("gpu_memory_utilization", 80 * GiB, in_use, 3 * GiB, 2 * GiB)
    # weights + peak + cache stay under utilization x total (the headroom is the slack)
    assert report.weights_bytes + report.peak_bytes + report.cache_bytes <= 0.9 * 80 * GiB
    assert report.tokens == (plan.num_blocks - 1) * 4
    assert report.max_concurrency == report.tokens / 256
    # no more than every sequence at full length
    roomy = dataclasses.replace(memory, in_use=GiB)
    assert _plan(config, Measured(roomy, 3 * GiB, 2 * GiB)).num_blocks == 32 * 64 + 1


def test_budget_is_capped_by_the_allocators_pool(tiny):
    """A user's smaller XLA_PYTHON_CLIENT_MEM_FRACTION: the pool, not utilization x total, bounds it."""
    memory = DeviceMemory(total=80 * GiB, limit=40 * GiB, in_use=16 * GiB)
    assert memory_plan.cache_budget(0.9, memory, GiB, GiB) == 40 * GiB - 18 * GiB


def test_kv_cache_memory_bytes_fixes_the_size(tiny):
    config = _config(tiny[0], max_len=256, max_seqs=32, kv_cache_memory_bytes=1 << 20)
    memory = DeviceMemory(total=80 * GiB, limit=72 * GiB, in_use=16 * GiB)
    plan = _plan(config, Measured(memory, None, 2 * GiB))
    assert plan.num_blocks == (1 << 20) // _per_block(config) < 32 * 64 + 1
    assert plan.memory.source == "kv_cache_memory_bytes"
    small = _config(tiny[0], kv_cache_memory_bytes=1000)
    for measured in (None, Measured(memory, None, 2 * GiB)):      # the CPU, a GPU
        with pytest.raises(CacheDoesNotFit, match="--kv-cache-memory-bytes 1000 holds less than one request"):
            _plan(small, measured)


def test_one_request_that_cannot_fit_names_the_numbers_and_the_flags(tiny):
    config = _config(tiny[0], max_len=64)
    per_block = _per_block(config)
    # room for 9 blocks after weights, peak and headroom: 8 usable (32 tokens) < 16 needed
    budget = 9 * per_block
    memory = DeviceMemory(total=10 * GiB, limit=10 * GiB, in_use=9 * GiB - GiB // 2 - budget)
    measured = Measured(memory, peak_bytes=GiB // 4, headroom_bytes=GiB // 4)
    assert memory_plan.cache_budget(0.9, memory, GiB // 4, GiB // 4) == budget
    with pytest.raises(CacheDoesNotFit) as e:
        _plan(config, measured)
    message = str(e.value)
    assert "\n" not in message
    for part in ("max_model_len 64", "--max-model-len (at most 32 tokens fit)",
                 "--gpu-memory-utilization (now 0.9)", "--tensor-parallel-size, now 1",
                 "10.00 GiB total", "step programs' peak 256.0 MiB", "headroom 256.0 MiB"):
        assert part in message, message
    # one block more than the request needs fits
    roomy = dataclasses.replace(memory, in_use=memory.in_use - 8 * per_block)
    assert _plan(config, dataclasses.replace(measured, memory=roomy)).num_blocks == 17


def _runner(tiny, config):
    cfg, params = tiny
    return ModelRunner(config, dict(params), registry.get_family(cfg.architecture))


def test_runner_profiles_the_largest_program_then_sizes(tiny, monkeypatch):
    headroom = 1 << 20
    memory = DeviceMemory(total=64 * GiB, limit=64 * GiB,
                          in_use=_weights_leaving(3 << 20, 64 * GiB, 0, headroom))
    monkeypatch.setattr(memory_plan, "measure", lambda device: memory)
    monkeypatch.setattr(memory_plan, "headroom_bytes", lambda params: headroom)
    compiled, held = [], []
    original = compiling.StepCompiler._compile_fresh
    monkeypatch.setattr(compiling.StepCompiler, "_compile_fresh",
                        lambda self, layout, variant, n: compiled.append((variant, held[-1][0].held))
                        or original(self, layout, variant, n))
    hold = cache_sizing.CacheReservation.hold

    def spy(self, plan):
        out = hold(self, plan)
        held.append((self, plan, jax.tree.leaves(self._held)))
        return out
    monkeypatch.setattr(cache_sizing.CacheReservation, "hold", spy)
    config = _config(tiny[0], max_len=256, max_seqs=32)   # useful: 2049 blocks
    runner = _runner(tiny, config)
    report = runner.memory
    assert len(compiled) == 1 and compiled[0][0].full     # the largest bucket's full program, once
    # ... compiled while the memory of the caches at a peak of 0 was held (issue 62: the
    # compiles fragmented the free memory), released only for the real caches
    (reservation, plan0, arrays), = held
    assert compiled[0][1] and plan0.num_blocks > runner.num_blocks
    assert arrays[0].shape[0] == plan0.num_blocks and not any(a.is_deleted() for a in arrays)
    runner.kv_cache
    assert all(a.is_deleted() for a in arrays) and not reservation.held
    assert 0 < report.peak_bytes < 3 << 20 and report.headroom_bytes == headroom
    budget = memory_plan.cache_budget(0.9, memory, report.peak_bytes, report.headroom_bytes)
    assert runner.num_blocks == budget // runner.bytes_per_block < 2049
    # the caches were allocated at that size (the profile's were only shapes)
    assert runner.kv_cache[0]["k"].shape[0] == runner.num_blocks
    lines = report.lines()
    assert lines[0].startswith("memory: device total 64.00 GiB, budget 0.9 x total = 57.60 GiB")
    assert "step programs' peak" in lines[1] and "KV cache" in lines[1]


def test_a_warm_start_reads_the_noted_peak_instead_of_compiling(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(compiling, "STORE_PLATFORMS", ("cpu",))     # a GPU's program store
    memory = DeviceMemory(total=64 * GiB, limit=64 * GiB, in_use=_weights_leaving(3 << 20, 64 * GiB, 0, 1 << 20))
    monkeypatch.setattr(memory_plan, "measure", lambda device: memory)
    monkeypatch.setattr(memory_plan, "headroom_bytes", lambda params: 1 << 20)
    config = dataclasses.replace(_config(tiny[0], max_len=256, max_seqs=32), program_cache_dir=str(tmp_path))
    first = _runner(tiny, config)
    assert len(list(tmp_path.glob("*.peak"))) == 1 and not list(tmp_path.glob("*.jaxprog"))

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled a step program")
    monkeypatch.setattr(compiling.StepCompiler, "_compile_fresh", no_compile)
    second = _runner(tiny, config)
    assert second.memory.peak_bytes == first.memory.peak_bytes > 0
    assert second.num_blocks == first.num_blocks


def test_weights_that_leave_no_room_fail_before_any_compile(tiny, monkeypatch):
    memory = DeviceMemory(total=10 * GiB, limit=10 * GiB, in_use=9 * GiB)
    monkeypatch.setattr(memory_plan, "measure", lambda device: memory)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled a step program")
    monkeypatch.setattr(compiling.StepCompiler, "_compile_fresh", no_compile)
    with pytest.raises(CacheDoesNotFit, match="step programs' peak not measured yet"):
        _runner(tiny, _config(tiny[0]))


def test_a_peak_that_leaves_no_room_fails_after_the_profile_only(tiny, monkeypatch):
    """Room for the weights but not for the measured peak: the error comes after the one
    profiling compile, before any cache is allocated or warm-up compiles."""
    per_block = _per_block(_config(tiny[0]))
    headroom = memory_plan.HEADROOM_BYTES + 4096 * 64 * 4          # the tiny model's largest array
    memory = DeviceMemory(total=10 * GiB, limit=10 * GiB,
                          in_use=9 * GiB - headroom - 100 * per_block)
    monkeypatch.setattr(memory_plan, "measure", lambda device: memory)
    monkeypatch.setattr(memory_plan, "headroom_bytes", lambda params: headroom)
    monkeypatch.setattr(memory_plan, "program_peak_bytes", lambda compiled: 99 * per_block)
    allocated, released = [], []
    monkeypatch.setattr("jaxserve.worker.runner.allocate_caches", lambda *a: allocated.append(a))
    monkeypatch.setattr(cache_sizing, "allocate_caches", lambda *a: allocated.append(("held",) + a) or [])
    release = cache_sizing.CacheReservation.release
    monkeypatch.setattr(cache_sizing.CacheReservation, "release",
                        lambda self: released.append(self.held) or release(self))
    with pytest.raises(CacheDoesNotFit, match="step programs' peak [0-9.]+ MiB"):
        _runner(tiny, _config(tiny[0]))
    # only the reservation (the caches at a peak of 0: the 65 blocks of 4 requests at full length), released on the error
    assert [a[0] for a in allocated] == ["held"] and allocated[0][2] == 65 and released[-1]


def test_cpu_keeps_its_byte_budget_and_reports_no_device(tiny):
    runner = _runner(tiny, _config(tiny[0], max_len=256, max_seqs=32, kv_cache_cpu_bytes=1 << 20))
    assert runner.num_blocks == (1 << 20) // runner.bytes_per_block
    assert runner.memory.source == "cpu" and runner.memory.device_total_bytes is None
    assert runner.memory.lines() == []


@pytest.fixture
def fresh_allocator(monkeypatch):
    from jax._src import xla_bridge

    for name in memory_plan.ALLOCATOR_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "")        # as on a GPU machine
    monkeypatch.setattr(memory_plan, "_configured", None)
    monkeypatch.setattr(memory_plan, "_note", "")
    state = SimpleNamespace(initialised=False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: state.initialised)
    return state


def test_allocator_gets_the_utilization_before_the_backend_starts(fresh_allocator):
    # the budget plus POOL_SLACK: the pool fragments (memory_plan's doc)
    line = memory_plan.configure_allocator(0.85)
    assert os.environ[memory_plan.MEM_FRACTION_ENV] == "0.89"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.89" in line and memory_plan.allocator_note() == line
    assert memory_plan.allocator_fraction() == 0.89
    assert memory_plan.configure_allocator(0.85) == line         # again (CLI, then engine): same
    assert memory_plan.pool_fraction(0.95) == 0.97 and memory_plan.pool_fraction(0.99) == 0.99


def test_allocator_keeps_a_users_variables(fresh_allocator, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    line = memory_plan.configure_allocator(0.9)
    assert memory_plan.MEM_FRACTION_ENV not in os.environ
    assert "kept as set by the environment (XLA_PYTHON_CLIENT_PREALLOCATE=false)" in line
    monkeypatch.setenv(memory_plan.MEM_FRACTION_ENV, "0.5")
    memory_plan.configure_allocator(0.9)
    assert os.environ[memory_plan.MEM_FRACTION_ENV] == "0.5"
    assert memory_plan.allocator_fraction() == 0.5


def test_allocator_left_alone_on_the_cpu(fresh_allocator, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert "not configured (JAX_PLATFORMS=cpu)" in memory_plan.configure_allocator(0.9)
    assert memory_plan.MEM_FRACTION_ENV not in os.environ


def test_allocator_left_alone_once_the_backend_started(fresh_allocator):
    fresh_allocator.initialised = True
    line = memory_plan.configure_allocator(0.9)
    assert memory_plan.MEM_FRACTION_ENV not in os.environ
    assert "already initialised" in line and "0.75 stands" in line


def test_measure_reads_the_total_back_from_the_allocators_share(fresh_allocator, monkeypatch):
    monkeypatch.setenv(memory_plan.MEM_FRACTION_ENV, "0.8")
    device = SimpleNamespace(platform="gpu", memory_stats=lambda: {
        "bytes_limit": 64 * GiB, "bytes_in_use": 5 * GiB})
    assert memory_plan.measure(device) == DeviceMemory(total=80 * GiB, limit=64 * GiB, in_use=5 * GiB)
    assert memory_plan.measure(SimpleNamespace(platform="cpu", memory_stats=lambda: None)) is None


def test_program_peak_counts_temps_outputs_and_code_not_donated_outputs():
    stats = SimpleNamespace(temp_size_in_bytes=100, output_size_in_bytes=1000, alias_size_in_bytes=900,
                            generated_code_size_in_bytes=7, argument_size_in_bytes=10**9)
    assert memory_plan.program_peak_bytes(SimpleNamespace(memory_analysis=lambda: stats)) == 207


BENCH = [TINY, "--dtype", "float", "--input-len", "4", "--output-len", "2", "--batch-size", "1",
         "--num-iters", "1", "--num-iters-warmup", "0", "--device-only-iters", "0",
         "--max-num-batched-tokens", "16", "--disable-tqdm", "--no-program-cache"]


def test_bench_json_carries_the_memory_plan(tmp_path, monkeypatch, capsys):
    from jaxserve.bench.latency import main

    memory = DeviceMemory(total=64 * GiB, limit=64 * GiB,
                          in_use=_weights_leaving(4 << 20, 64 * GiB, 0, 1 << 20))
    monkeypatch.setattr(memory_plan, "measure", lambda device: memory)
    monkeypatch.setattr(memory_plan, "headroom_bytes", lambda params: 1 << 20)
    out = tmp_path / "latency.json"
    assert main(BENCH + ["--output-json", str(out)]) == 0
    fields = json.loads(out.read_text())["engine"]["memory"]
    assert fields["device_total_bytes"] == 64 * GiB and fields["weights_bytes"] == memory.in_use
    assert fields["peak_bytes"] > 0 and fields["headroom_bytes"] == 1 << 20
    assert fields["num_blocks"] >= 2 and fields["tokens"] == (fields["num_blocks"] - 1) * 16
    assert fields["max_concurrency"] == fields["tokens"] / fields["max_model_len"]
    assert fields["weights_bytes"] + fields["peak_bytes"] + fields["cache_bytes"] <= 0.9 * 64 * GiB
    assert "== memory" in capsys.readouterr().out


def test_bench_says_a_model_that_cannot_fit_in_one_line(monkeypatch, capsys):
    from jaxserve.bench import main

    monkeypatch.setattr(memory_plan, "measure",
                        lambda device: DeviceMemory(total=GiB, limit=GiB, in_use=GiB))
    assert main(["latency"] + BENCH) == 1
    # log lines (the loader's progress) reach stderr where an earlier test of this process
    # set up the server's logging; the error itself must be one line, no traceback
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith(("INFO ", "WARNING ", "DEBUG "))]
    assert len(err) == 1 and err[0].startswith(
        "jaxserve bench latency: error: not enough GPU memory for one request of max_model_len 16")
    assert "--gpu-memory-utilization" in err[0] and "--tensor-parallel-size" in err[0]


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_loading_goes_a_layer_at_a_time_with_progress(load_format, caplog):
    import logging

    logger = logging.getLogger("jaxserve")
    own = not logger.propagate      # configure_logging (other tests) stops propagation
    if own:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="jaxserve"):
            cfg, params, _ = loader.load_model(TINY, load_format=load_format, dtype="float32")
    finally:
        if own:
            logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "layer " in r.getMessage()]
    assert [line.split(": layer ")[1].split(",")[0] for line in lines] == ["1/2", "2/2"], lines
    import jax

    total = sum(a.nbytes for a in jax.tree.leaves(params))
    assert f"{total / 2**30:.2f} GiB" in lines[-1]


def test_warmup_compiles_the_plain_programs_before_the_caches_take_their_memory(monkeypatch):
    """XLA's autotuner allocates operands of its own while compiling: the plain programs
    compile against the caches' shapes, and the caches are allocated only then."""
    from jaxserve import LLM
    from jaxserve.worker import runner as runner_module

    events = []
    original_compile, original_allocate = compiling.StepCompiler.compile, runner_module.allocate_caches
    monkeypatch.setattr(compiling.StepCompiler, "compile", lambda self, layout, variant, n: events.append(
        ("compile", variant.full)) or original_compile(self, layout, variant, n))
    monkeypatch.setattr(runner_module, "allocate_caches",
                        lambda *a: events.append(("allocate", None)) or original_allocate(*a))
    monkeypatch.setattr(os, "cpu_count", lambda: 1)      # the background ones after, in order
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    llm.engine.wait_for_warmup()
    allocated = events.index(("allocate", None))
    lean = [i for i, e in enumerate(events) if e == ("compile", False)]
    assert events.count(("allocate", None)) == 1 and len(lean) == len(llm.engine.runner.buckets)
    assert max(lean) < allocated


def test_the_engine_configures_the_allocator_before_anything_else(monkeypatch):
    from jaxserve.engine import builder

    class Stop(Exception):
        pass

    def configure(utilization):
        raise Stop(utilization)
    monkeypatch.setattr(memory_plan, "configure_allocator", configure)
    with pytest.raises(Stop) as e:     # before data parallelism asks for jax.devices()
        builder.from_engine_args(TINY, gpu_memory_utilization=0.7, data_parallel_size=2)
    assert e.value.args == (0.7,)


def test_a_draft_models_weights_and_cache_are_paid_from_the_targets_budget(tiny, tmp_path):
    """A draft model loads after the target's caches are sized: its weights and its cache
    (at most the target's blocks) come out of the same budget first."""
    from jaxserve.core.kv_cache import manager
    from jaxserve.spec_decode.config import SpeculativeConfig
    from jaxserve.spec_decode.draft_model import DraftModelProposer
    from tests.spec_helpers import write_tiny_llama

    path = str(write_tiny_llama(tmp_path / "draft", 256))
    config = _config(tiny[0], max_len=256, max_seqs=32)
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    needs = DraftModelProposer(spec, config).target_needs()
    draft_cfg = loader.model_config_from_hf(json.loads((tmp_path / "draft" / "config.json").read_text()))
    # 1 layer of 32 wide (2 heads of 16, 1 kv head), MLP 64, tied 256-token embedding; f32
    assert needs.weight_bytes == 4 * (256 * 32 + 32 + 32 * (32 + 16 + 16 + 32) + 2 * 32 + 3 * 32 * 64)
    per_block = manager.bytes_per_block(list(needs.cache_specs), 4, 4)
    assert per_block == 4 * 4 * 2 * 16 and draft_cfg.num_layers == 1      # k and v of one kv head
    specs = registry.get_family(config.model.architecture).cache_specs(config.model)
    memory = DeviceMemory(total=64 * GiB, limit=64 * GiB, in_use=_weights_leaving(1 << 20, 64 * GiB, 0, 0))
    alone = plan_caches(config, specs, [], 0, 64, Measured(memory, 0, 0))
    drafted = plan_caches(config, specs, list(needs.cache_specs), needs.weight_bytes, 64, Measured(memory, 0, 0))
    assert drafted.num_blocks == ((1 << 20) - needs.weight_bytes) // (alone.bytes_per_block + per_block)


def test_on_a_planned_device_every_program_compiles_before_the_caches(tiny, monkeypatch):
    """With the memory planned (a GPU), the background programs finish before the caches take
    their share: beside them XLA's autotuner ran the 8B's first step out of memory (H100)."""
    from jaxserve.worker import runner as runner_module

    headroom = 1 << 20
    memory = DeviceMemory(total=64 * GiB, limit=64 * GiB,
                          in_use=_weights_leaving(3 << 20, 64 * GiB, 0, headroom))
    monkeypatch.setattr(memory_plan, "measure", lambda device: memory)
    monkeypatch.setattr(memory_plan, "headroom_bytes", lambda params: headroom)
    runner = _runner(tiny, _config(tiny[0], max_len=256, max_seqs=32))
    assert runner.memory.on_device
    pending_at_allocation = []
    original = runner_module.allocate_caches
    monkeypatch.setattr(runner_module, "allocate_caches", lambda *a: pending_at_allocation.append(
        [f for f in runner._pending.values() if not f.done()]) or original(*a))
    runner.warmup()
    assert pending_at_allocation == [[]] and len(runner._pending) > len(runner.buckets)
