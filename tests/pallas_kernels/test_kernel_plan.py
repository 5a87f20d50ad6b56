"""The kernel plan (pallas_kernels/policy.py) and the attention tiling (ragged_paged_attention/
tiling.py) choose what the rules they replaced chose: sweeps over shapes, models and devices
against the old rules' outputs, computed once from the code before `KernelPlan` (commit
7b194c3) and kept here as a digest of each whole sweep, with a sample of its rows to read."""

from __future__ import annotations

import hashlib
import itertools
import json
from types import SimpleNamespace

import jax
import pytest

from jaxserve.config import ModelConfig
from jaxserve.models import registry
from jaxserve.pallas_kernels import dispatch, policy
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.pallas_kernels.ragged_paged_attention import mgpu, tiling

# device kind -> (jax's device_kind, SMs) of the GPU faked for it; "cpu": the real CPU device
DEVICES = {"H100": ("NVIDIA H100 80GB HBM3", 132), "H200": ("NVIDIA H200", 132), "cpu": None}


@pytest.fixture
def use_device(monkeypatch):
    """Make the first device one of DEVICES."""
    real = jax.devices

    def use(kind: str):
        spec = DEVICES[kind]
        fake = None if spec is None else SimpleNamespace(platform="gpu", device_kind=spec[0],
                                                         core_count=spec[1])
        monkeypatch.setattr(jax, "devices", real if fake is None else (lambda *a: [fake]))
        dispatch.device_info.cache_clear()
        assert dispatch.device_kind() == kind
    yield use
    dispatch.device_info.cache_clear()


def digest(rows) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Ragged paged attention: the whole tiling of the Triton kernel, the busy floor, Mosaic's splits
# ---------------------------------------------------------------------------------------------

# (T, S) buckets: decode buckets around the SM-count thresholds, prompt chunks, mixed ones
BUCKETS = [(1, 1), (2, 2), (4, 4), (8, 8), (13, 13), (16, 16), (17, 17), (32, 32), (33, 33),
           (64, 64), (96, 96), (128, 128), (256, 256), (16, 32), (64, 32), (256, 64),
           (512, 32), (2048, 64), (8, 256), (4096, 4096), (2048, 1), (128, 16)]

# A row: device, T, S, N, K, E, itemsize, context, busy_seqs, skewed, then the outputs: busy
# floor, Mosaic decode splits, block_q, block_k, num_splits, num_warps, num_stages,
# mask_all_steps, heavy_first, prefetch_slots, heads_inner, fill splits, fill programs.
RPA_SAMPLE = [
    ('H100', 1, 1, 32, 8, 128, 2, 256, None, False, 0, 2, 1, 64, 4, 4, 5, True, False, False, False, 0, 0),
    ('H100', 8, 8, 32, 4, 64, 2, 32768, 0, True, 0, 4, 2, 128, 16, 4, 2, True, False, False, False, 0, 0),
    ('H100', 17, 17, 8, 1, 128, 2, 8192, 17, False, 17, 7, 2, 128, 7, 4, 5, True, False, False, False, 0, 0),
    ('H100', 64, 64, 64, 8, 128, 4, 8192, 0, False, 0, 1, 2, 128, 1, 4, 2, True, False, False, True, 0, 0),
    ('H100', 16, 32, 32, 4, 64, 2, 1024, 8, False, 0, 2, 2, 64, 8, 4, 2, True, False, False, False, 0, 0),
    ('H100', 512, 32, 8, 1, 128, 2, 1024, None, False, 0, 1, 8, 64, 1, 4, 2, False, True, True, False, 0, 0),
    ('H100', 4096, 4096, 64, 8, 128, 4, 256, 0, True, 0, 1, 2, 128, 1, 4, 2, True, False, False, True, 0, 0),
    ('H200', 2, 2, 32, 4, 128, 2, 32768, 2, False, 2, 16, 2, 128, 16, 4, 5, True, False, False, False, 0, 0),
    ('H200', 13, 13, 16, 16, 128, 4, 32768, 0, False, 0, 1, 16, 128, 1, 4, 2, True, False, False, True, 0, 0),
    ('H200', 32, 32, 64, 8, 64, 2, 8192, 8, False, 0, 1, 2, 128, 1, 4, 2, True, False, False, True, 0, 0),
    ('H200', 128, 128, 32, 4, 128, 2, 8192, None, False, 0, 1, 2, 64, 1, 4, 2, True, False, False, True, 0, 0),
    ('H200', 64, 32, 16, 16, 128, 4, 1024, 0, True, 0, 1, 16, 128, 1, 4, 2, False, False, False, False, 0, 0),
    ('H200', 2048, 64, 64, 8, 64, 2, 256, 0, False, 0, 1, 8, 64, 1, 4, 2, False, True, True, False, 0, 0),
    ('H200', 128, 16, 32, 4, 128, 2, 256, 0, False, 0, 1, 8, 64, 1, 4, 2, False, True, True, False, 0, 0),
    ('cpu', 4, 4, 16, 16, 64, 2, 32768, 1, False, 0, 2, 16, 128, 8, 4, 2, True, False, False, False, 0, 0),
    ('cpu', 16, 16, 64, 8, 128, 2, 32768, None, False, 13, 1, 2, 128, 1, 4, 5, True, False, False, True, 0, 0),
    ('cpu', 64, 64, 32, 8, 128, 4, 8192, 0, True, 0, 1, 4, 128, 1, 4, 2, True, False, False, True, 0, 0),
    ('cpu', 256, 256, 16, 16, 64, 2, 1024, 0, False, 0, 1, 16, 128, 1, 4, 2, True, False, False, True, 0, 0),
    ('cpu', 256, 64, 64, 8, 128, 2, 1024, 0, False, 0, 1, 4, 64, 1, 4, 2, True, True, True, False, 0, 0),
    ('cpu', 4096, 4096, 32, 8, 128, 4, 256, 1024, False, 0, 1, 4, 128, 1, 4, 2, True, False, False, True, 0, 0),
]


def attention_rows(use_device) -> list[list]:
    rows = []
    for dev in DEVICES:
        use_device(dev)
        for (t, s), (n, kh), (e, itemsize), ctx in itertools.product(
                BUCKETS, [(32, 8), (32, 4), (16, 16), (8, 1), (64, 8)],
                [(128, 2), (64, 2), (128, 4)], (256, 1024, 8192, 32768)):
            floor = tiling.tiling_busy_floor(t, s, n, kh, context=ctx, head_dim=e,
                                             itemsize=itemsize)
            for busy, skewed in [(None, False), (0, False), (0, True), (max(1, s // 4), False),
                                 (floor, False)]:
                x = tiling.choose_tiling(t, s, n, kh, context=ctx, head_dim=e, itemsize=itemsize,
                                         busy_seqs=busy, skewed=skewed, interpret=dev == "cpu")
                rows.append([dev, t, s, n, kh, e, itemsize, ctx, busy, skewed, floor,
                             mgpu.default_num_splits(t, s, kh, ctx, 64),
                             x.block_q, x.block_k, x.num_splits, x.num_warps, x.num_stages,
                             x.mask_all_steps, x.heavy_first, x.prefetch_slots, x.heads_inner,
                             x.num_splits if x.fill_splits else 0, x.fill_programs])
    return rows


def test_attention_tilings_are_the_old_rules(use_device):
    rows = attention_rows(use_device)
    assert len(rows) == 19800
    assert [tuple(r) for r in rows[::997]] == RPA_SAMPLE
    assert digest(rows) == "372643ceaa294153e24e761a2a34acf6dddf9542f15906c0ff99ec7fd4f66012"


# ---------------------------------------------------------------------------------------------
# The kernel plan: fused kernels by model, projections, step sizes, scheduler steps
# ---------------------------------------------------------------------------------------------

ARCHITECTURES = ["LlamaForCausalLM", "Qwen3MoeForCausalLM", "MiniMaxM2ForCausalLM",
                 "Qwen3_5MoeForCausalLM"]


def model_configs():
    """(architecture, D, E, F, V, (experts, expert width) | None) and its ModelConfig."""
    for arch, d, e, f, v, experts in itertools.product(
            ARCHITECTURES, (576, 1024, 1040, 4096), (32, 64, 80, 128), (1536, 1544),
            (49152, 49153), (None, (128, 768), (8, 14336), (60, 770), (64, 1544))):
        kw = (dict(num_experts=experts[0], num_experts_per_tok=2, moe_intermediate_size=experts[1])
              if experts else {})
        yield (arch, d, e, f, v, experts), ModelConfig(
            architecture=arch, vocab_size=v, hidden_size=d, intermediate_size=f, num_layers=2,
            num_heads=8, num_kv_heads=2, head_dim=e, **kw)


# A row: architecture, D, E, F, V, experts, then fused_stack_fits and auto_fused_kernels.
CONFIG_SAMPLE = [
    ('LlamaForCausalLM', 576, 32, 1536, 49152, None, True, ('linear',)),
    ('LlamaForCausalLM', 1024, 32, 1544, 49153, (8, 14336), False, ('moe',)),
    ('LlamaForCausalLM', 1040, 64, 1544, 49152, (64, 1544), False, ('moe',)),
    ('LlamaForCausalLM', 4096, 80, 1544, 49152, (128, 768), False, ('moe',)),
    ('Qwen3MoeForCausalLM', 576, 128, 1536, 49153, (60, 770), False, ('moe',)),
    ('Qwen3MoeForCausalLM', 1040, 32, 1536, 49153, None, False, ()),
    ('Qwen3MoeForCausalLM', 4096, 64, 1536, 49152, (8, 14336), False, ('moe',)),
    ('MiniMaxM2ForCausalLM', 576, 64, 1544, 49153, (64, 1544), False, ('moe',)),
    ('MiniMaxM2ForCausalLM', 1024, 80, 1544, 49153, (128, 768), False, ('moe',)),
    ('MiniMaxM2ForCausalLM', 1040, 128, 1544, 49152, (60, 770), False, ('moe',)),
    ('Qwen3_5MoeForCausalLM', 576, 32, 1544, 49152, None, False, ()),
    ('Qwen3_5MoeForCausalLM', 1024, 64, 1536, 49153, (8, 14336), False, ('moe',)),
    ('Qwen3_5MoeForCausalLM', 1040, 80, 1536, 49152, (64, 1544), False, ('moe',)),
    ('Qwen3_5MoeForCausalLM', 4096, 128, 1536, 49152, (128, 768), False, ('moe',)),
]


def test_fused_kernels_by_model_are_the_old_rules(use_device):
    rows = []
    for (arch, d, e, f, v, experts), cfg in model_configs():
        family = registry.get_family(arch).name
        fits, auto = policy.fused_stack_fits(cfg, family), policy.auto_fused_kernels(cfg, family)
        rows.append([arch, d, e, f, v, list(experts) if experts else None, fits, list(auto)])
        # the plan an engine resolves: the auto names on one GPU, none on a CPU or a mesh
        for dev in DEVICES:
            use_device(dev)
            plan = KernelPlan.resolve("auto", cfg, family, 1)
            assert plan.fused == (() if dev == "cpu" else auto) and plan.device == dev
            assert plan.fused_stack == (dev != "cpu" and "linear" in auto and fits)
            assert KernelPlan.resolve("auto", cfg, family, 2).fused == ()
    assert [(r[0], *r[1:5], tuple(r[5]) if r[5] else None, r[6], tuple(r[7]))
            for r in rows[::97]] == CONFIG_SAMPLE
    assert digest(rows) == "860c314b220d26adb53d47a7f87729f930c0801cd2fd63c11339b77bd9edb0cb"


# (rows, weight elements) -> how the fused stack runs the projection
PROJECTIONS = {
    (1, 1024): 'one_row',
    (1, 4194303): 'one_row',
    (1, 4194304): 'one_row',
    (1, 4194305): 'one_row',
    (1, 10485760): 'one_row',
    (1, 16777216): 'one_row',
    (1, 16777217): 'xla',
    (1, 268435456): 'xla',
    (2, 1024): 'dot',
    (2, 4194303): 'dot',
    (2, 4194304): 'dot',
    (2, 4194305): 'xla',
    (2, 10485760): 'xla',
    (2, 16777216): 'xla',
    (2, 16777217): 'xla',
    (2, 268435456): 'xla',
    (4, 1024): 'dot',
    (4, 4194303): 'dot',
    (4, 4194304): 'dot',
    (4, 4194305): 'xla',
    (4, 10485760): 'xla',
    (4, 16777216): 'xla',
    (4, 16777217): 'xla',
    (4, 268435456): 'xla',
    (32, 1024): 'dot',
    (32, 4194303): 'dot',
    (32, 4194304): 'dot',
    (32, 4194305): 'xla',
    (32, 10485760): 'xla',
    (32, 16777216): 'xla',
    (32, 16777217): 'xla',
    (32, 268435456): 'xla',
}


def test_projections_are_the_old_rules():
    assert {(t, w): KernelPlan.projection(t, w) for t, w in PROJECTIONS} == PROJECTIONS


def test_step_sizes_are_the_old_rules():
    stack = KernelPlan(fused=("linear",), fused_stack=True)
    for t in (1, 2, 4, 5, 8, 16, 31, 32, 33, 64, 2048):
        assert stack.stack_takes(t) == (t <= 32) and not KernelPlan().stack_takes(t)
        assert policy.moe_decode_takes(t) == (t <= 4)


def test_scheduler_steps_are_the_old_rules():
    for fused in ((), ("linear",), ("moe",), ("linear", "moe"), ("norm", "rope")):
        plan = KernelPlan(fused=fused)
        for speculating, asked in itertools.product((False, True), (None, 1, 3)):
            want = asked if asked is not None else (
                8 if "linear" in fused and not speculating else 1)
            assert plan.scheduler_steps(asked, object() if speculating else None) == want


def test_plan_without_a_kernel_keeps_the_rest():
    plan = KernelPlan(fused=("linear", "rope"), fused_stack=True, device="H100")
    assert plan.without("rope") == KernelPlan(("linear",), True, "H100")
    assert plan.without("linear") == KernelPlan(("rope",), False, "H100")
    with pytest.raises(ValueError, match="fused_kernels"):
        KernelPlan.for_model(next(model_configs())[1], "llama", ("linear", "lineer"))


def test_fused_mla_is_asked_for_on_one_device_and_small_steps():
    """"mla" (DeepSeek's fused MLA kernels): never on by "auto", refused under a mesh, taken by
    steps of up to MLA_FUSED_MAX_TOKENS tokens, and only with Pallas kernels."""
    from jaxserve.models import deepseek, deepseek_mla

    cfg = next(model_configs())[1]
    assert "mla" not in KernelPlan.resolve("auto", cfg, "deepseek", 1, device="H100").fused
    assert KernelPlan.resolve("mla,moe", cfg, "deepseek", 1, device="H100").fused == ("mla", "moe")
    with pytest.raises(ValueError, match="'mla' runs on one device"):
        KernelPlan.resolve("mla", cfg, "deepseek", 2, device="H100")
    for t in (1, 16, 32, 33, 2048):
        assert policy.mla_fused_takes(t) == (t <= 32)
        assert deepseek_mla.takes({"w_in": None}, t) == (t <= 32) and not deepseek_mla.takes({}, t)
    plan = KernelPlan(fused=("mla", "moe"))
    assert deepseek.make_kernels(cfg, "pallas", kernel_plan=plan) == deepseek.Kernels("pallas", "fused", True)
    assert deepseek.make_kernels(cfg, "xla", kernel_plan=plan) == deepseek.Kernels("xla", "xla", False)
    assert deepseek.Kernels.named("fused") == deepseek.Kernels("pallas", "fused", False)
