"""Runner warm-up: every bucket's programs are compiled up front (in parallel, or one by one
if threads fail), and afterwards a varied workload compiles nothing."""

import os
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.worker import compiling
from jaxserve.worker import runner as runner_module
from jaxserve.worker.step_program import token_buckets

TINY = os.path.join(os.path.dirname(__file__), "golden", "ckpt", "llama")


def workload(llm):
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 40))}],
                 [SamplingParams(temperature=0, max_tokens=5),
                  SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=3, logprobs=2)],
                 use_tqdm=False)


@pytest.mark.parametrize("threads_fail", [False, True])
def test_warmup_covers_every_program(threads_fail, monkeypatch):
    if threads_fail:
        def broken(*a, **k):
            raise RuntimeError("no threads here")
        monkeypatch.setattr(compiling.StepCompiler, "start", broken)
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    runner = llm.engine.runner
    # Warm-up returns with the lean programs ready; the full ones may still be compiling.
    assert all(key in runner._executables for key in runner._pending if not key[1].full)
    runner.wait_for_warmup()
    assert len(runner._executables) == len(runner.buckets) * 2
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    workload(llm)
    assert compiles == []


def test_buckets_start_with_a_single_token_step():
    assert token_buckets(2048) == [1, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(24) == [1, 16, 24]
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              warmup=False)
    # A lone decode runs unpadded; two decodes take the 16-token program (S = 4 rows).
    assert llm.engine.runner.bucket(1) == (1, 1)
    assert llm.engine.runner.bucket(2) == (16, 4)


def test_a_step_waits_for_its_program_still_compiling_in_the_background(monkeypatch):
    """Full-variant programs compile after warm-up returns; a step that needs one waits for
    that compile instead of starting a second one."""
    import threading
    import time

    calls, original = [], compiling.StepCompiler.compile
    lock = threading.Lock()

    def slow_compile(self, layout, variant, num_words):
        with lock:
            calls.append(variant.full)
        if variant.full:
            time.sleep(0.5)
        return original(self, layout, variant, num_words)

    monkeypatch.setattr(compiling.StepCompiler, "compile", slow_compile)
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    runner = llm.engine.runner
    assert not all(f.done() for f in runner._pending.values())
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 3
    runner.wait_for_warmup()
    assert len(calls) == len(runner.buckets) * 2       # each program compiled exactly once


def test_compiling_in_the_background_keeps_no_engine_alive(monkeypatch):
    """An engine dropped while its full programs still compile is freed at once: the compile
    threads hold only abstract arguments (and are daemons, so they never delay exit)."""
    import gc
    import threading
    import weakref

    slow_full_programs(monkeypatch, 1.0)
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    assert not all(f.done() for f in llm.engine.runner._pending.values())
    assert all(t.daemon for t in threading.enumerate() if t.name == "jaxserve-compile")
    runner = weakref.ref(llm.engine.runner)
    kv = weakref.ref(llm.engine.runner.kv_cache[0]["k"])
    gc.disable()     # freed by reference counting alone (test_del_frees_an_engine_at_once)
    try:
        del llm
        assert runner() is None and kv() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("model, options", [
    ("llama", {}),
    # state copies, saved states; no warm-up (the llama cases run theirs): a hybrid model's
    # warm-up compiles every state-saving program, ~20 s on 2 cores, where the workload
    # compiles the ones it runs
    ("qwen3_5_moe", {"enable_prefix_caching": True, "warmup": False}),
    ("llama", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}),
    ("llama", {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2,
                                       "model": TINY}}),
])
def test_del_frees_an_engine_at_once(model, options):
    """`del llm` frees the weights and caches without waiting for Python's cyclic collector:
    nothing in an engine refers back to its runner. NOTE: a closure over the runner did, and a
    second engine built in the same process then ran out of device memory (BENCHMARKS.md)."""
    import gc
    import weakref

    llm = LLM(os.path.join(os.path.dirname(TINY), model), dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, block_size=4, **options)
    workload(llm)
    runner, weights = weakref.ref(llm.engine.runner), weakref.ref(jax.tree.leaves(llm.engine.runner.params)[0])
    gc.collect()
    gc.disable()
    try:
        del llm
        assert runner() is None and weights() is None
    finally:
        gc.enable()


def slow_full_programs(monkeypatch, seconds):
    """Make every full-variant compile take `seconds` longer (they run in the background)."""
    import time

    original = compiling.StepCompiler.compile

    def slow_compile(self, layout, variant, num_words):
        if variant.full:
            time.sleep(seconds)
        return original(self, layout, variant, num_words)

    monkeypatch.setattr(compiling.StepCompiler, "compile", slow_compile)


def test_warmup_all_waits_for_the_full_programs_too(monkeypatch):
    slow_full_programs(monkeypatch, 0.3)
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              warmup_all=True)
    runner = llm.engine.runner
    assert all(f.done() for f in runner._pending.values())
    assert len(runner._executables) == len(runner.buckets) * 2


def test_warmup_all_runs_each_lean_program_once_and_outputs_stay_the_same(monkeypatch):
    """serve's --warmup-all also runs each bucket's lean program once on an empty step
    (worker/rehearsal.py: a program's first run costs more); the empty steps write only the
    null block, so greedy outputs equal an engine's that never ran them."""
    from jaxserve.worker import rehearsal

    runs = []
    real = rehearsal.rehearse
    monkeypatch.setattr("jaxserve.engine.llm_engine.rehearse",
                        lambda runner: runs.append(real(runner)) or runs[-1])
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 40))}]
    params = SamplingParams(temperature=0, max_tokens=6)
    rehearsed = LLM(TINY, warmup_all=True, **kw)
    assert runs and runs[0][0] == len(rehearsed.engine.runner.buckets)
    plain = LLM(TINY, **kw)
    assert len(runs) == 1                     # only with warmup_all
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in rehearsed.generate(prompts, params, use_tqdm=False)]
    assert got == want


def attention_backend(kv_heads=8, head_dim=128, itemsize=2, gpu=True):
    """An AttentionBackend of the Pallas kernel as on a GPU (its tiling rules need none)."""
    from types import SimpleNamespace
    from jaxserve.models.attention import AttentionBackend

    cfg = SimpleNamespace(num_heads=32, num_kv_heads=kv_heads, head_dim=head_dim, sliding_window=None)
    b = AttentionBackend.__new__(AttentionBackend)
    b.cfg, b.impl, b.scale, b._buckets = cfg, "pallas", head_dim ** -0.5, {}
    b._tiling_kw = dict(context=512 * 16, head_dim=head_dim, itemsize=itemsize)
    b._tiles = gpu
    return b


def test_attention_plan_marks_only_nearly_full_buckets_of_specially_tiled_grids(monkeypatch):
    # A step's plan says how many sequence slots are busy only where the Pallas attention
    # tiles a full bucket differently (ragged_paged_attention.tiling_busy_floor): 8 kv heads,
    # 16 or 32 slots = 128 or 256 programs, at least 13 busy; 128 slots, at least 100; 4 kv
    # heads, 16 slots, all; never off the GPU's Pallas path.
    from jaxserve.models import attention, llama
    from jaxserve.models.attention import AttentionPlan

    def floor(b, t, s, busy, contexts=None):
        plan = b.plan(t, s, busy, contexts)
        return plan.busy_seqs if not plan.skewed else ("skewed", plan.busy_seqs)
    llama8b = attention_backend()
    assert floor(llama8b, 16, 16, 16) == floor(llama8b, 16, 16, 13) == 13
    assert floor(llama8b, 16, 16, 12) == 0         # padded: tiled as a bucket of few decodes
    assert floor(llama8b, 32, 32, 32) == 13        # 256 programs: pipelined from 104 busy
    assert floor(llama8b, 32, 32, 12) == 0
    assert floor(llama8b, 64, 64, 64) == 0         # 512 programs: never pipelined
    # 1,024 programs: 64-key 3-stage steps from 100 busy (ragged_paged_attention.many_wave_decode)
    assert floor(llama8b, 128, 128, 128) == floor(llama8b, 128, 128, 100) == 100
    assert floor(llama8b, 128, 128, 99) == 0
    assert floor(llama8b, 1, 1, 1) == 0
    qwen = attention_backend(kv_heads=4)           # Qwen3-30B-A3B's heads: 32 slots
    assert floor(qwen, 32, 32, 31) == 26 and floor(qwen, 32, 32, 25) == 0
    assert floor(qwen, 64, 64, 64) == 26
    # 16 slots = 64 programs: split two ways when all are busy, fill_splits below
    assert floor(qwen, 16, 16, 16) == 16 and floor(qwen, 16, 16, 15) == 0
    # skewed contexts: no busy count where the bucket's unsaid variant is fill_splits
    assert floor(llama8b, 16, 16, 16, np.array([4096] + [1024] * 15)) == 0
    assert floor(llama8b, 16, 16, 16, np.array([1500] + [1024] * 15)) == 13
    assert floor(qwen, 16, 16, 16, np.array([9000] + [100] * 15)) == 0
    assert floor(llama8b, 32, 32, 32, np.array([9000] + [100] * 31)) == 0
    # 64 slots: no floor, but a skewed step's fill_splits is a program of its own
    assert floor(llama8b, 64, 64, 64, np.array([9000] + [100] * 63)) == ("skewed", 0)
    assert floor(llama8b, 64, 64, 40, np.array([9000] + [100] * 39)) == ("skewed", 0)
    assert floor(llama8b, 64, 64, 64, np.array([1000] * 64)) == 0
    assert floor(qwen, 128, 128, 128, np.array([9000] + [100] * 127)) == ("skewed", 0)
    assert floor(llama8b, 128, 128, 128, np.array([9000] + [100] * 127)) == 100   # 1,024: not
    assert llama8b._bucket(1, 1) == (0, False, False)       # one slot: never skewed
    assert floor(attention_backend(gpu=False), 16, 16, 16) == 0
    assert floor(attention_backend(head_dim=64), 16, 16, 16) == 0    # not the measured case
    assert floor(attention_backend(itemsize=4), 16, 16, 16) == 0
    assert llama8b.warmup_plans(64, 64) == [AttentionPlan(), AttentionPlan(skewed=True)]
    assert llama8b.warmup_plans(16, 16) == [AttentionPlan(), AttentionPlan(busy_seqs=13)]
    # ... and the model hands the plan to the kernel untouched
    seen = {}
    monkeypatch.setattr(attention, "ragged_paged_attention", lambda *a, **kw: seen.update(kw))
    x = SimpleNamespace(query_start_loc=None, seq_lens=None, block_tables=None)
    cfg = SimpleNamespace(head_dim=128, rms_norm_eps=1e-5)
    kernels = llama.make_kernels(cfg, llama8b, AttentionPlan(busy_seqs=3, skewed=True))
    kernels.attention(None, None, None, x)
    assert seen["busy_seqs"] == 3 and seen["skewed"]
    llama.make_kernels(cfg, llama8b).attention(None, None, None, x)
    assert seen["busy_seqs"] == 0 and not seen["skewed"]   # unknown: never as a full bucket


def test_each_step_hands_the_backend_its_chunks_contexts(monkeypatch):
    # the skew rule needs every step's seq_lens: the chunks' contexts after the step
    from jaxserve import SamplingParams as SP
    from jaxserve.models.attention import AttentionPlan
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              warmup=False)
    runner = llm.engine.runner
    seen = []
    monkeypatch.setattr(runner.backend, "plan",
                        lambda t, s, busy, contexts=None: seen.append(list(contexts)) or AttentionPlan())
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8] * 11}],
                 SP(max_tokens=3, temperature=0.0))
    assert seen[0] == [3, 11]                  # both prompts in one step
    assert [3 + 1, 11 + 1] in seen and [3 + 2, 11 + 2] in seen   # then their decodes


def test_a_skewed_step_runs_the_skewed_program_warm_up_compiled(monkeypatch):
    # prepare() -> backend.plan -> StepVariant(attention=skewed plan) -> _step -> make_kernels:
    # a bucket whose skewed steps have a program of their own (stubbed: the CPU has none)
    from jaxserve import SamplingParams as SP
    from jaxserve.models import llama
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              warmup=False)
    runner = llm.engine.runner
    runner.backend._tiles = True
    monkeypatch.setattr(runner.backend, "_bucket", lambda t, s: (0, True, True))
    traced = []
    make_kernels = llama.make_kernels
    monkeypatch.setattr(llama, "make_kernels",
                        lambda cfg, backend, plan, fused: traced.append(plan.skewed)
                        or make_kernels(cfg, backend, plan, fused))
    runner.warmup()
    runner.wait_for_warmup()
    compiled = set(runner._executables)
    assert True in traced and False in traced  # the skewed programs reach the model
    ran = []
    build = runner._build
    monkeypatch.setattr(runner, "_build", lambda out: (lambda r: ran.append(r[2]) or r)(build(out)))
    llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7] * 30}],
                 SP(max_tokens=2, temperature=0.0))
    assert any(v.attention.skewed for v in ran)          # 2 against 30 tokens: skewed
    assert {v for v in ran} <= {v for _, v in compiled}    # nothing compiled on the way


def test_a_skewed_step_runs_as_an_even_one_until_its_program_is_ready():
    # skewed programs compile in warm-up's background batch: a step does not wait for one
    import dataclasses
    from jaxserve.models.attention import AttentionPlan
    from jaxserve.core.step_messages import SchedulerOutput
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    runner = llm.engine.runner
    x, _, variant = runner.prepare(SchedulerOutput([], [], [], 16, [], 0))
    _, layout = runner_module.packing.pack(x)
    skewed = dataclasses.replace(variant, attention=AttentionPlan(skewed=True))
    assert (layout, skewed) not in runner._executables
    calls = []
    even = runner._executables[(layout, variant)]
    runner._executables[(layout, variant)] = lambda *a: calls.append(1) or even(*a)
    runner.run(x, skewed)
    assert calls == [1] and (layout, skewed) not in runner._executables


def test_skewed_contexts_threshold():
    from jaxserve.pallas_kernels.ragged_paged_attention import tiling as rt
    assert not rt.skewed_contexts([]) and not rt.skewed_contexts([9000])
    assert not rt.skewed_contexts([0, 0, 0])
    assert not rt.skewed_contexts([1800, 200, 1000, 1000])    # max = 1.8 x the mean
    assert rt.skewed_contexts([1801, 200, 1000, 1000])


def test_warmup_packs_busy_variants_like_the_steps_that_use_them(monkeypatch):
    # where a bucket has busy or skewed plans (only on a GPU), warm-up compiles them with
    # the layout of their lean / full twins: the (layout, variant) keys a step asks for
    import dataclasses
    from jaxserve.models.attention import AttentionPlan
    llm = LLM(TINY, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              warmup=False)
    runner = llm.engine.runner
    runner.backend._tiles = True
    monkeypatch.setattr(runner.backend, "_bucket",
                        lambda t, s: {16: (3, False, False), 32: (0, True, True)}.get(
                            t, (0, False, False)))
    jobs, batches = [], []
    monkeypatch.setattr(runner._compiler, "start",
                        lambda js, threads: batches.append(js) or jobs.extend(js) or {})
    runner.warmup()
    keys = {(layout, variant) for layout, variant, _ in jobs}
    later = lambda v: v.full or v.attention.skewed  # noqa: E731
    # the lean programs first (warm-up waits for them), then the full and skewed ones
    assert not any(later(v) for _, v, _ in batches[0])
    assert all(later(v) for _, v, _ in batches[1])
    busy = [(layout, v) for layout, v in keys if v.attention.busy_seqs]
    assert sorted(v.full for _, v in busy) == [False, True]
    for layout, variant in busy:
        assert (layout, dataclasses.replace(variant, attention=AttentionPlan())) in keys
    skewed = [(layout, v) for layout, v in keys if v.attention.skewed]
    assert sorted(v.full for _, v in skewed) == [False, True] and 32 in runner.buckets
    for layout, variant in skewed:
        assert (layout, dataclasses.replace(variant, attention=AttentionPlan())) in keys
    assert len(keys) == 2 * len(runner.buckets) + 4


def run_python(script: str, *argv: str, cache=None, timeout: int = 600):
    """`script` in a fresh CPU-only Python process (caches under `cache` if given; jax's
    Mosaic GPU runtime variable unset, as in a process that never imported it); asserts it
    exited cleanly and returns it."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("MOSAIC_GPU_RUNTIME_LIB_PATH", None)
    if cache is not None:
        env.update(JAXSERVE_CACHE=str(cache), JAX_COMPILATION_CACHE_DIR=str(cache / "xla"))
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_exiting_while_programs_compile_in_the_background_exits_cleanly(tmp_path):
    """A script that ends right after building its engine, the full programs still compiling:
    the interpreter must not finalise under a compile in flight (before, it segfaulted or
    aborted on every such exit)."""
    script = ("import sys\nfrom jaxserve import LLM\n"
              "llm = LLM(sys.argv[1], dtype='float32', max_num_seqs=4, max_num_batched_tokens=32,"
              " max_model_len=64)\n"
              "print(sum(not f.done() for f in llm.engine.runner._pending.values()))\n")
    done = run_python(script, TINY, cache=tmp_path)
    if int(done.stdout.split()[-1]) == 0:       # (not seen: three programs compile after it)
        pytest.skip("every program had compiled before the script ended: nothing to test")


STORE_SCRIPT = """
import json, sys
from jaxserve import LLM, SamplingParams
from jaxserve.worker import compiling
compiling.STORE_PLATFORMS += ("cpu",)     # one engine a process: see STORE_PLATFORMS
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
          max_model_len=64, warmup_all=True, program_cache=True, max_logprobs=int(sys.argv[2]))
outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 40))}],
                    SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)
print(json.dumps({"seconds": llm.engine.runner.compile_seconds,
                  "out": [[o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs]]
                          for o in outs]}))
"""


def test_stored_programs_load_on_the_next_start_and_match(tmp_path):
    """program_cache: each compiled step program is kept on disk; the next engine with the same
    code, model and settings loads them instead of tracing the model, and computes the same;
    other settings or a damaged file compile again. Real serialization, one engine a fresh
    process each (the GPU's case; the CPU's is gated off: compiling.STORE_PLATFORMS)."""
    import json

    steps = tmp_path / "steps"

    def start(max_logprobs=20):
        done = run_python(STORE_SCRIPT, TINY, str(max_logprobs), cache=tmp_path)
        return json.loads(done.stdout.splitlines()[-1]), done.stderr

    first, _ = start()
    stored = sorted(os.listdir(steps))
    assert len(stored) == 2 * 3 and first["seconds"]["stored"] == 0     # buckets 1, 16, 32
    again, _ = start()
    assert again["seconds"]["lower"] == 0 and again["seconds"]["stored"] > 0
    assert again["out"] == first["out"]
    # other full programs (3 logprobs a row), compiled; the lean ones are the same, loaded
    other, _ = start(max_logprobs=3)
    assert other["seconds"]["lower"] > 0 and other["seconds"]["stored"] > 0
    assert len(os.listdir(steps)) == len(stored) + 3
    with open(steps / stored[0], "wb") as f:
        f.write(b"not a program")
    mended, log = start()
    assert "could not load the stored step program" in log and mended["out"] == first["out"]
    assert mended["seconds"]["lower"] > 0 and mended["seconds"]["stored"] > 0
    with open(steps / stored[0], "rb") as f:
        assert f.read(13) != b"not a program"    # replaced by the recompiled program


def test_program_cache_is_off_on_the_cpu_and_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    assert LLM(TINY, **kw).engine.config.program_cache_dir is None
    llm = LLM(TINY, program_cache=True, **kw)
    assert llm.engine.config.program_cache_dir == str(tmp_path / "steps")
    assert llm.engine.runner._compiler.store is None and not (tmp_path / "steps").exists()


def test_a_store_prepares_the_mosaic_runtime_before_it_loads_a_program(tmp_path, monkeypatch):
    # programs calling Mosaic GPU kernels (the prefill buckets' attention on a GPU) load only
    # where the kernels' runtime library can be found: the store sees to it when it opens, on
    # the caller's thread, before any program loads
    import jax.numpy as jnp
    from jax.experimental import serialize_executable

    monkeypatch.setattr(compiling, "STORE_PLATFORMS", ("cpu", "gpu"))
    step = jax.jit(lambda p, kv, w, prev, *, variant, layout: (kv, w.sum() + p, prev),
                   static_argnames=("variant", "layout"))

    def compiler():
        return compiling.StepCompiler(step, jnp.ones(()), jnp.zeros(4), jnp.zeros(2), None,
                                      store=str(tmp_path), identity="test")

    assert compiler().compile("layout", "variant", 8) is not None
    events = []
    monkeypatch.setattr(compiling, "prepare_mosaic_gpu_runtime", lambda: events.append("prepare"))
    real = serialize_executable.deserialize_and_load
    monkeypatch.setattr(serialize_executable, "deserialize_and_load",
                        lambda *a: events.append("load") or real(*a))
    again = compiler()
    assert events == ["prepare"]
    assert again.compile("layout", "variant", 8) is not None
    assert events == ["prepare", "load"]
    assert again.seconds["lower"] == 0 and again.seconds["stored"] > 0


def test_preparing_the_mosaic_runtime_imports_the_module_that_names_its_library():
    # jax.experimental.mosaic.gpu sets MOSAIC_GPU_RUNTIME_LIB_PATH where its library exists
    # (a CUDA jaxlib; the CPU one has none): a fresh process that only loads programs has not
    # imported it
    script = ("import sys, os\n"
              "from jaxserve.worker import compiling\n"
              "assert 'jax.experimental.mosaic.gpu' not in sys.modules\n"
              "compiling.prepare_mosaic_gpu_runtime()\n"
              "assert 'jax.experimental.mosaic.gpu' in sys.modules\n"
              "from jax.experimental.mosaic.gpu import core\n"
              "lib = core.RUNTIME_PATH\n"
              "assert lib is None or os.environ['MOSAIC_GPU_RUNTIME_LIB_PATH'] == str(lib)\n"
              "print('ok')\n")
    assert run_python(script, timeout=300).stdout.strip() == "ok"


def test_a_stored_program_is_named_by_everything_that_shapes_it(monkeypatch, tmp_path):
    import jax.numpy as jnp

    def path(identity="model", args=(jnp.zeros(4),), layout="layout", variant="lean", words=8):
        return compiling.ProgramStore(str(tmp_path), identity, args).path(layout, variant, words)

    base = path()
    assert base == path()
    others = [path(identity="other model"), path(args=(jnp.zeros(5),)),
              path(args=(jnp.zeros(4, jnp.int32),)), path(layout="other"),
              path(variant="full"), path(words=9)]
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    others.append(path())
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(compiling, "source_digest", lambda: "edited sources")
    others.append(path())
    assert len({base, *others}) == len(others) + 1


def test_the_source_digest_follows_the_traced_packages_files(tmp_path, monkeypatch):
    # every package a step can run, each from its own folder (the models and kernels live in
    # top-level folders of a checkout); an edited file gives another digest
    import importlib.util

    from jaxserve.models import layers

    folders = {os.path.dirname(importlib.util.find_spec(p).origin)
               for p in compiling.TRACED_PACKAGES}
    assert {os.path.dirname(os.path.abspath(m.__file__)) for m in (compiling, layers)} <= folders
    (tmp_path / "probe_pkg").mkdir()
    (tmp_path / "probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "probe_pkg" / "kernel.py").write_text("SCALE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(compiling, "TRACED_PACKAGES", ("probe_pkg",))
    before = compiling.source_digest()
    assert before == compiling.source_digest()
    (tmp_path / "probe_pkg" / "kernel.py").write_text("SCALE = 2\n")
    assert compiling.source_digest() != before


def test_the_cli_keeps_programs_unless_told_not_to():
    import argparse

    from jaxserve.engine.args import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args([]))["program_cache"] is True
    assert engine_kwargs(parser.parse_args(["--no-program-cache"]))["program_cache"] is False
