"""Run by test_new_families_sharding.py in a subprocess with 8 fake CPU devices (XLA_FLAGS must
be set before jax is imported).

DeepSeek V3 / V3.2 and Qwen3-Next / Qwen3.5 under tensor and expert parallelism against one
device, in f32 within 1e-5: the logits of a chunked ragged prefill and two batched decode
steps, with the caches placed as the runner places them (rules.cache_array_sharding). Then the
partition specs that matter (heads split, the MLA latent and the indexer replicated, DeltaNet
state by head), the compiled step's collectives (no weight or cache gathered), the error for
an uneven split, MTP layers and dummy weights on a mesh, and the engine on a TP 2 x EP 2 mesh
against transformers' greedy tokens. Exits non-zero with a message on the first failure.

Usage: new_families_sharding_check.py deepseek | qwen3_next | deepseek_v4   (one family per process)
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hybrid_step_builder import Chunk, build_hybrid_step, scattered_block_tables  # noqa: E402
from model_step_builder import moe_regions  # noqa: E402
from jaxserve.core.kv_cache.specs import PagedSpec  # noqa: E402
from jaxserve.models import registry  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402
from jaxserve.sharding import mesh as mesh_lib, rules  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden")
ATOL = 1e-5
BLOCK, NUM_BLOCKS, NUM_SLOTS = 8, 16, 5
LAST_HLO = [""]           # the compiled step of the latest run()
SHARD_MAPS = [0]          # how many shard_map regions the latest run's step has
# TP 4 needs 4 kv heads, 4 linear key heads and 8 value heads (the tiny checkpoint has 2, 2, 4);
# head dims 16: the DeltaNet kernels' smallest (qwen3_next.pallas_fits)
QWEN_WIDE = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 250, "hidden_size": 64,
             "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 16, "layer_types": ["linear_attention",
             "full_attention", "linear_attention"], "linear_num_key_heads": 4,
             "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
             "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "mlp_only_layers": [1]}


def ckpt(name):
    return os.path.join(GOLDEN, "ckpt", name)


def empty_caches(cfg, mesh):
    """Zeroed caches from the family's specs, each array placed as the runner places it."""
    model = registry.get_family(cfg.architecture)
    out = []
    for spec in model.cache_specs(cfg):
        paged = isinstance(spec, PagedSpec)
        layer = {}
        for name, shape in spec.arrays:
            lead = (NUM_BLOCKS, spec.rows(name, BLOCK)) if paged else (NUM_SLOTS,)
            a = jnp.zeros(lead + tuple(shape), jnp.float32)
            layer[name] = a if mesh is None else jax.device_put(
                a, rules.cache_array_sharding(registry.get_family(cfg.architecture), cfg, mesh, name, a.shape))
        out.append(layer)
    return out


def run(cfg, params, mesh, impl="xla"):
    """Logits of every step: prefill in two chunks (ragged, beside short prompts), then two
    batched decode steps. impl "pallas": the family's kernels (interpreted), traced with the
    mesh as the ambient one as the runner's step is, so they run per shard (sharding/kernels.py)."""
    model = registry.get_family(cfg.architecture)
    caches = empty_caches(cfg, mesh)
    tables = scattered_block_tables(3, 4, NUM_BLOCKS, seed=1)
    slots = np.array([1, 3, 4])
    prompts = [[5, 9, 3], list(range(10, 19)), list(range(30, 50))]
    steps = [[Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:8], 0)],
             [Chunk(2, prompts[2][8:], 8)],
             [Chunk(i, [7 + i], len(p)) for i, p in enumerate(prompts)],
             [Chunk(i, [11 + i], len(p) + 1) for i, p in enumerate(prompts)]]

    def step(p, c, x):
        with contextlib.ExitStack() as ambient:
            if mesh is not None:
                ambient.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
            c, hidden, _ = model.forward(cfg, p, c, x, model.make_kernels(cfg, impl))
        return c, model.compute_logits(cfg, p, hidden)

    out, step_fn = [], None
    for chunks in steps:
        x = build_hybrid_step(chunks, tables, slots, BLOCK, 24, 4)
        if mesh is not None:
            x = jax.device_put(x, rules.replicated(mesh))
        if step_fn is None:       # every step has the same shapes: one compile
            lowered = jax.jit(step).lower(params, caches, x)
            SHARD_MAPS[0] = lowered.as_text().count("sdy.manual_computation")
            step_fn = lowered.compile()
        caches, logits = step_fn(params, caches, x)
        out.append(np.asarray(logits)[: sum(len(c.token_ids) for c in chunks)])
    LAST_HLO[0] = step_fn.as_text()
    if mesh is not None:      # the step kept each cache array where the runner put it
        for layer in caches:
            for name, a in layer.items():
                want = rules.cache_array_sharding(registry.get_family(cfg.architecture), cfg, mesh, name, a.shape)
                assert a.sharding.is_equivalent_to(want, a.ndim), (name, a.sharding, want)
    return out


def check_matches(source, meshes, load_format="auto", pallas_meshes=(), atol=ATOL):
    """Each (tp, ep) mesh's logits equal one device's (XLA) within ATOL, with the XLA path on
    `meshes` and the Pallas kernels per shard on `pallas_meshes`: (cfg, {(tp, ep): params})."""
    cfg, ref, _ = load_model(source, load_format)
    want = run(cfg, ref, None)
    label = os.path.basename(source) if isinstance(source, str) else "wide " + load_format
    placed = {}
    for (tp, ep), impl in [(m, "xla") for m in meshes] + [(m, "pallas") for m in pallas_meshes]:
        mesh = mesh_lib.make_mesh(tp, ep)
        cfg, params, _ = load_model(source, load_format, mesh=mesh)
        t0 = time.perf_counter()
        got = run(cfg, params, mesh, impl)
        # (V4's routed experts are split by XLA's partitioner, in no shard_map)
        experts = 0 if hasattr(cfg, "hc_mult") else moe_regions(params, tp, ep)
        want_maps = kernel_regions(cfg, tp) + experts
        if impl == "pallas" and SHARD_MAPS[0] != want_maps:
            sys.exit(f"{label} TP={tp} EP={ep}: {SHARD_MAPS[0]} kernels per shard, not {want_maps}")
        for i, (g, w) in enumerate(zip(got, want)):
            err = float(np.max(np.abs(g - w)))
            if err > atol:
                sys.exit(f"{label} TP={tp} EP={ep} {impl}: step {i} logits differ by {err} (> {atol})")
        print(f"ok {label} TP={tp} EP={ep} {impl} ({time.perf_counter() - t0:.1f} s)")
        placed[tp, ep] = params
    return cfg, placed


def kernel_regions(cfg, tp):
    """How many shard_maps a Pallas step has on a `model` axis of size tp: one per layer (MLA;
    paged attention or the DeltaNet kernels), plus MLA's cache writes and V3.2's indexer
    scores and top-k (all three run replicated)."""
    if tp == 1:
        return 0
    if hasattr(cfg, "hc_mult"):     # DeepSeek V4: attention a layer; a CSA layer's indexer scores,
        # top-k and two compressors; an HCA layer's compressor where its window fits the kernel
        csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)
        hca = sum(t == "heavily_compressed_attention" for t in cfg.layer_types)
        return cfg.num_layers + 4 * csa + (hca if cfg.hca_rate <= 32 else 0)
    mla_writes = 1 if hasattr(cfg, "kv_lora_rank") else 0
    indexer = 2 if getattr(cfg, "index_topk", 0) else 0
    return cfg.num_layers * (1 + mla_writes + indexer)


def as_on_mesh(cfg, params, mesh):
    """The parameter tree as the loaders lay it out on `mesh` (Qwen's conv channels grouped
    per key head), whatever the arrays' placement."""
    if registry.get_family(cfg.architecture).name == "qwen3_next":
        from jaxserve.models.loaders.qwen3_next import group_conv_channels
        return group_conv_channels(cfg, params, mesh)
    return params


def check_random(cfg, meshes, seed=0, impls=("xla",)):
    """Host weights larger than the dummies' (N(0, 0.08^2); zero-centred norms near 0) put on
    each mesh by rules.shard_params: logits equal one device's (XLA), with each impl."""
    rng = np.random.default_rng(seed)
    model = registry.get_family(cfg.architecture)
    one = lambda shape: (0.08 * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
    shapes = model.param_shapes(cfg)
    host = {k: one(v) for k, v in shapes.items() if k != "layers"}
    host["layers"] = [{k: one(v) for k, v in ls.items()} for ls in shapes["layers"]]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = run(cfg, jax.tree.map(lambda a: jax.device_put(a, device), host), None)
    for (tp, ep), impl in ((m, i) for m in meshes for i in impls):
        mesh = mesh_lib.make_mesh(tp, ep)
        got = run(cfg, as_on_mesh(cfg, rules.shard_params(registry.get_family(cfg.architecture), host, cfg, mesh), mesh), mesh, impl)
        want_maps = kernel_regions(cfg, tp) + moe_regions(host, tp, ep)
        if impl == "pallas" and SHARD_MAPS[0] != want_maps:
            sys.exit(f"random TP={tp} EP={ep}: {SHARD_MAPS[0]} kernels per shard, not {want_maps}")
        for i, (g, w) in enumerate(zip(got, want)):
            err = float(np.max(np.abs(g - w)))
            if err > ATOL:
                sys.exit(f"random {cfg.architecture} TP={tp} EP={ep} {impl}: step {i} logits differ by {err}")
        print(f"ok random TP={tp} EP={ep} {impl}")


def check_dummy(source, tp, ep):
    """Dummy weights drawn on a mesh (each device its slice) equal the unsharded draw; returns
    (cfg, params) for the spec checks."""
    cfg, ref, _ = load_model(source, "dummy")
    mesh = mesh_lib.make_mesh(tp, ep)
    cfg, params, _ = load_model(source, "dummy", mesh=mesh)
    ref = as_on_mesh(cfg, ref, mesh)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ref, params)
    print(f"ok dummy TP={tp} EP={ep}")
    return cfg, params


def collectives(hlo_text: str) -> dict:
    """{op: Counter of result shapes} of a compiled step's HLO."""
    return {op: collections.Counter(re.findall(rf"= ([a-z0-9]+\[[0-9,]*\])\S* {op}(?:-start)?\(", hlo_text))
            for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")}


def check_collectives(cfg, mesh, allowed_permutes=()):
    """The latest run's compiled step (on `mesh`) never gathers a weight or a cache: its only
    collectives are all-reduces of the f32[T, D] block outputs (attention's o_proj, the MLP /
    MoE), plus `allowed_permutes`."""
    found = collectives(LAST_HLO[0])
    t_d = f"f32[24,{cfg.hidden_size}]"
    bad = {op: dict(c) for op, c in found.items()
           if (op == "all-reduce" and set(c) - {t_d}) or (op == "collective-permute" and set(c) - set(allowed_permutes))
           or (op in ("all-gather", "all-to-all") and c)}
    if bad or not found["all-reduce"]:
        sys.exit(f"{cfg.architecture} on {dict(mesh.shape)}: unexpected collectives {bad} (all: {found})")
    print(f"ok collectives {dict(found['all-reduce'])} permutes {dict(found['collective-permute'])}")


def spec(a):
    return a.sharding.spec


def check_deepseek_specs(cfg, params, tp, ep):
    """TP x EP placements of V3.2: heads split, the latent path and the indexer whole."""
    dense, moe = params["layers"][0], params["layers"][1]
    assert spec(dense["wq_b"]) == P(None, "model") and spec(dense["w_uk"]) == P("model", None, None)
    assert spec(dense["w_uv"]) == P("model", None, None) and spec(dense["wo"]) == P("model", None)
    for name in ("wkv_a", "wq_a", "wq_idx", "wk_idx", "w_idx"):
        assert spec(dense[name]) in (P(), P(None, None)), (name, spec(dense[name]))
    assert spec(dense["w_gate"]) == P(None, "model"), spec(dense["w_gate"])
    assert spec(moe["w_up"]) == P("expert", None, "model") and spec(moe["ws_down"]) == P("model", None)
    assert spec(moe["router"]) == P(None, None) and spec(moe["router_bias"]) == P(None)
    assert moe["router_bias"].dtype == jnp.float32
    assert moe["w_up"].addressable_shards[0].data.shape == (cfg.num_experts // ep, cfg.hidden_size,
                                                           cfg.moe_intermediate_size // tp)
    mesh = mesh_lib.make_mesh(tp, ep)
    latent = rules.cache_array_sharding(registry.get_family(cfg.architecture), cfg, mesh, "latent", (4, 8, cfg.latent_dim))
    assert latent.spec == P(None, None, None), latent
    try:
        rules.param_shardings(registry.get_family(cfg.architecture), cfg, mesh_lib.make_mesh(8))
    except ValueError as e:
        assert "num_attention_heads" in str(e) and "8" in str(e), str(e)
    else:
        sys.exit("TP=8 with 4 heads should raise a ValueError naming num_attention_heads")
    print("ok deepseek specs")


def mtp_checkpoint() -> str:
    """deepseek_v3's tiny checkpoint plus one MTP layer (a copy of its last, MoE, layer and random
    MTP-only tensors), in a temporary directory: transformers saves none."""
    import shutil
    import tempfile

    from safetensors.numpy import save_file

    from jaxserve.models.loaders.deepseek import SafetensorsDir

    path = os.path.join(tempfile.mkdtemp(), "deepseek_v3_mtp")
    shutil.copytree(ckpt("deepseek_v3"), path)
    src = SafetensorsDir(ckpt("deepseek_v3"))
    extra = {n.replace("model.layers.2.", "model.layers.3."): np.asarray(src.raw(n))
             for n in src.entries if n.startswith("model.layers.2.")}
    rng = np.random.default_rng(1)
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128)),
                        ("shared_head.norm.weight", (64,)), ("shared_head.head.weight", (256, 64))):
        extra["model.layers.3." + name] = (0.1 * rng.normal(size=shape)).astype(np.float32)
    save_file(extra, os.path.join(path, "model-mtp.safetensors"))
    return path


def check_deepseek_mtp():
    """The MTP layer (params["mtp"]) is placed like a decoder layer, and its proposer forward on
    TP 2 x EP 2 equals one device's."""
    from jaxserve.models import deepseek

    path = mtp_checkpoint()
    mesh = mesh_lib.make_mesh(2, 2)
    outs = []
    for m in (None, mesh):
        cfg, params, _ = load_model(path, mesh=m)
        if "mtp" not in params:
            sys.exit("the MTP checkpoint should load its MTP layer")
        caches = [{"latent": jnp.zeros((NUM_BLOCKS, BLOCK, cfg.latent_dim), jnp.float32)}]
        if m is not None:
            caches = jax.device_put(caches, rules.replicated(m))
        x = build_hybrid_step([Chunk(0, list(range(3, 15)), 0)], scattered_block_tables(1, 4, NUM_BLOCKS),
                              np.array([1]), BLOCK, 16, 2)
        prev = jnp.asarray(np.random.default_rng(2).normal(size=(16, 64)).astype(np.float32))
        if m is not None:
            x, prev = jax.device_put((x, prev), rules.replicated(m))
        fn = jax.jit(lambda p, c, x, h: deepseek.mtp_forward(cfg, p, c, x, h)[1])
        outs.append(np.asarray(fn(params, caches, x, prev))[:12])
    mp = params["mtp"][0]
    assert spec(mp["wq_b"]) == P(None, "model") and spec(mp["head"]) == P(None, "model"), spec(mp["head"])
    assert spec(mp["w_up"]) == P("expert", None, "model"), spec(mp["w_up"])
    err = float(np.max(np.abs(outs[0] - outs[1])))
    if err > ATOL:
        sys.exit(f"MTP TP=2 EP=2: logits differ by {err} (> {ATOL})")
    print("ok deepseek mtp TP=2 EP=2")


def check_deepseek_expert_reads():
    """On EP 2 each device's slice reads only its own 4 of the 8 experts (per projection), so
    the host never holds a layer's experts at once."""
    from jaxserve.models.loaders.deepseek import SafetensorsDir

    groups, inside = [], [False]      # the tensors read by each device's slice callback
    weight, make = SafetensorsDir.weight, jax.make_array_from_callback

    def counting(self, name, *args):
        if inside[0]:
            groups[-1].append(name)
        return weight(self, name, *args)

    def tracing(shape, sharding, callback, *args, **kw):
        def traced(index):
            groups.append([])
            inside[0] = True
            try:
                return callback(index)
            finally:
                inside[0] = False
        return make(shape, sharding, traced, *args, **kw)

    SafetensorsDir.weight, jax.make_array_from_callback = counting, tracing
    try:
        load_model(ckpt("deepseek_v3"), mesh=mesh_lib.make_mesh(1, 2))
    finally:
        SafetensorsDir.weight, jax.make_array_from_callback = weight, make
    experts = [g for g in groups if any(".mlp.experts." in n for n in g)]
    ids = [{int(n.split(".mlp.experts.")[1].split(".")[0]) for n in g} for g in experts]
    # 2 MoE layers x 3 projections x 2 devices, each reading one half of the experts
    if len(experts) != 12 or any(len(g) != 4 for g in experts) or any(i not in ({0, 1, 2, 3}, {4, 5, 6, 7}) for i in ids):
        sys.exit(f"EP=2 expert reads per device slice: {experts}")
    print("ok deepseek expert reads EP=2")


def check_deepseek_fp8_on_mesh():
    """--quantization fp8 on a mesh: the kept FP8 experts' values and block scales split alike
    (experts over `expert`, F over `model` in whole scale blocks), each device reading only its
    experts, and the logits equal one device's FP8 ones; a split of F into partial blocks, and
    dummy FP8 weights placed like a checkpoint's."""
    import tempfile

    from fp8_checkpoint import fp8_copy
    from jaxserve.pallas_kernels.grouped_matmul import BlockScaledFp8

    with tempfile.TemporaryDirectory() as tmp:
        path = fp8_copy(ckpt("deepseek_v3"), os.path.join(tmp, "fp8"), block=8)   # F = 16: 2 blocks
        cfg, ref, _ = load_model(path, quantization="fp8")
        want = run(cfg, ref, None)
        mesh = mesh_lib.make_mesh(2, 2)
        cfg, params, _ = load_model(path, mesh=mesh, quantization="fp8")
        w_up, w_down = params["layers"][1]["w_up"], params["layers"][1]["w_down"]
        assert isinstance(w_up, BlockScaledFp8) and w_up.values.dtype == jnp.float8_e4m3fn
        assert spec(w_up.values) == spec(w_up.scales) == P("expert", None, "model"), spec(w_up.scales)
        assert spec(w_down.scales) == P("expert", "model", None), spec(w_down.scales)
        assert w_up.scales.addressable_shards[0].data.shape == (cfg.num_experts // 2, cfg.hidden_size // 8, 1)
        for i, (g, w) in enumerate(zip(run(cfg, params, mesh), want)):
            err = float(np.max(np.abs(g - w)))
            if err > ATOL:
                sys.exit(f"FP8 experts TP=2 EP=2: step {i} logits differ by {err} (> {ATOL})")
        try:
            load_model(path, mesh=mesh_lib.make_mesh(4, 1), quantization="fp8")   # 4 of F's 16 a rank
        except ValueError as e:
            assert "scale blocks" in str(e) and "tensor_parallel_size" in str(e), str(e)
        else:
            sys.exit("TP=4 over two 8-wide scale blocks should raise a ValueError naming the blocks")
        _, dummy, _ = load_model(ckpt("deepseek_v3"), "dummy", mesh=mesh_lib.make_mesh(1, 2), quantization="fp8")
        d_up = dummy["layers"][1]["w_up"]
        assert spec(d_up.values) == spec(d_up.scales) == P("expert", None, "model"), spec(d_up.scales)
        # the engine: the same greedy tokens on TP 2 x EP 2 as on one device
        from jaxserve import LLM, SamplingParams
        tokens = []
        for tp, ep in ((1, 1), (2, 2)):
            llm = LLM(path, dtype="float32", tensor_parallel_size=tp, expert_parallel_size=ep,
                      quantization="fp8", max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
                      block_size=4, num_kv_blocks=64, warmup=False)
            outs = llm.generate([{"prompt_token_ids": list(range(3 + i, 20 + 3 * i))} for i in range(3)],
                                SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
            tokens.append([o.outputs[0].token_ids for o in outs])
            del llm
        if tokens[0] != tokens[1]:
            sys.exit(f"FP8 engine TP=2 EP=2 greedy {tokens[1]} != one device's {tokens[0]}")
    print("ok deepseek FP8 experts TP=2 EP=2 (logits, engine)")


def check_qwen_specs(cfg, params, tp):
    lin, full = params["layers"][0], params["layers"][1]
    assert spec(lin["w_qkv_grouped"]) == P(None, "model") and spec(lin["conv_w_grouped"]) == P("model", None)
    assert spec(lin["a_log"]) == P("model") and spec(lin["w_out"]) == P("model", None)
    assert spec(full["wq"]) == P(None, "model") and spec(full["q_norm"]) == P(None)
    mesh = mesh_lib.make_mesh(tp)
    h, b, a = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
    ssm = rules.cache_array_sharding(registry.get_family(cfg.architecture), cfg, mesh, "ssm", (NUM_SLOTS, h, b, a))
    conv = rules.cache_array_sharding(registry.get_family(cfg.architecture), cfg, mesh, "conv", (NUM_SLOTS, cfg.conv_dim, 3))
    assert ssm.spec == P(None, "model", None, None) and conv.spec == P(None, "model", None), (ssm, conv)
    try:
        rules.param_shardings(registry.get_family(cfg.architecture), cfg, mesh_lib.make_mesh(8))
    except ValueError as e:
        assert "num_attention_heads" in str(e) or "num_key_value_heads" in str(e), str(e)
    else:
        sys.exit("TP=8 with 8 heads / 4 kv heads should raise")
    print("ok qwen3_next specs")


def check_qwen35_mtp_loads_sharded():
    """Qwen3.5 as ForConditionalGeneration with fused 3-D experts and an MTP head (the loading
    test's checkpoint) on TP 2 x EP 2: each device reads its slice, the values equal the
    unsharded load's, and params["mtp"] is placed like the decoder."""
    import tempfile

    from test_qwen3_next_loading import _rewrite_as_vlm

    path = tempfile.mkdtemp()
    _rewrite_as_vlm(path)
    mesh = mesh_lib.make_mesh(2, 2)
    cfg, ref, _ = load_model(path)
    _, params, _ = load_model(path, mesh=mesh)
    ref = as_on_mesh(cfg, ref, mesh)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ref, params)
    mtp = params["mtp"]
    assert spec(mtp["fc"]) == P(None, None) and spec(mtp["norm"]) == P(None), spec(mtp["fc"])
    layer = mtp["layers"][0]
    assert spec(layer["wq"]) == P(None, "model") and spec(layer["w_up"]) == P("expert", None, "model")
    assert spec(params["layers"][0]["w_down"]) == P("expert", "model", None)
    print("ok qwen3.5 fused experts and mtp TP=2 EP=2")


def check_engine(name, tp, ep, steps=6):
    """The whole engine on a mesh (sharded loading, caches by the rules, XLA kernels): greedy
    tokens equal transformers', the long prompt chunked beside the others' decodes; run twice,
    the second time from prefix-cache hits (a hybrid model's saved states copied on the mesh)."""
    from jaxserve import LLM, SamplingParams

    g = np.load(os.path.join(GOLDEN, f"{name}.npz"))
    llm = LLM(ckpt(name), dtype="float32", tensor_parallel_size=tp, expert_parallel_size=ep,
              max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128, block_size=4,
              num_kv_blocks=64, num_cached_states=32, warmup=False)
    for run in range(2):
        outs = llm.generate([{"prompt_token_ids": g[f"prompt_{i}"].tolist()} for i in range(3)],
                            SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
        for i, o in enumerate(outs):
            if o.outputs[0].token_ids != g[f"greedy_{i}"].tolist()[:steps]:
                sys.exit(f"engine {name} TP={tp} EP={ep} run {run}: seq {i} greedy "
                         f"{o.outputs[0].token_ids} != golden")
        s = llm.engine.scheduler
        assert not s.requests and s.pool.num_used == 0 and not s.kv.slots, "blocks or slots leaked"
    assert llm.get_metrics()["prefix_cache_hits_total"] > 0, "no prefix hits on the second run"
    print(f"ok engine {name} TP={tp} EP={ep}")


def main(family):
    assert len(jax.devices()) == 8, jax.devices()
    if family == "deepseek":
        # V3 at TP 2 and EP 2; TP 4 (the same MLA head split, V3.2 adding its indexer): V3.2's
        check_matches(ckpt("deepseek_v3"), [(2, 1), (1, 2)], pallas_meshes=[(2, 1)])
        cfg, placed = check_matches(ckpt("deepseek_v32"), [(2, 2), (4, 1)], pallas_meshes=[(2, 2), (4, 1)])
        check_deepseek_specs(cfg, placed[4, 1], tp=4, ep=1)
        check_collectives(cfg, mesh_lib.make_mesh(4, 1))        # the last run: TP 4, the kernels
        check_deepseek_mtp()
        check_dummy(ckpt("deepseek_v32"), tp=2, ep=2)
        check_deepseek_expert_reads()
        check_deepseek_fp8_on_mesh()
        check_engine("deepseek_v32", tp=2, ep=2)
    elif family == "qwen3_next":
        cfg, _ = check_matches(ckpt("qwen3_next"), [(1, 2), (2, 2), (2, 1)], pallas_meshes=[(2, 2), (2, 1)])
        # the last run, TP 2 with the kernels: conv channels grouped per key head, so nothing
        # moves but the block outputs' all-reduces
        check_collectives(cfg, mesh_lib.make_mesh(2, 1))
        cfg, params = check_dummy(QWEN_WIDE, tp=4, ep=2)
        check_qwen_specs(cfg, params, tp=4)
        check_random(cfg, [(4, 1)], impls=("xla", "pallas"))
        check_qwen35_mtp_loads_sharded()
        check_engine("qwen3_next", tp=2, ep=2)
    elif family == "deepseek_v4":
        # 4e-5: the all-reduces' order over four mHC streams and 20 Sinkhorn steps a block
        check_matches(ckpt("deepseek_v4"), [(2, 1), (1, 2), (2, 2)], atol=4e-5, pallas_meshes=[(2, 1)])
        # the last run, TP 2 with the kernels per shard: nothing gathered (XLA's partitioner
        # splits the experts' grouped matmuls; an EP run adds only the s32[X] group sizes)
        found = collectives(LAST_HLO[0])
        gathered = set(found["all-gather"]) - {"s32[4]"}
        if gathered or found["all-to-all"] or not found["all-reduce"]:
            sys.exit(f"deepseek_v4 on TP 2 x EP 2: unexpected collectives {found}")
        print(f"ok collectives {dict(found['all-reduce'])}")
        check_dummy(ckpt("deepseek_v4"), tp=2, ep=2)
    else:
        sys.exit(f"unknown family {family!r}: deepseek | qwen3_next | deepseek_v4")


if __name__ == "__main__":
    main(sys.argv[1])
