"""Run by test_models_sharding.py in a subprocess with 8 fake CPU devices (XLA_FLAGS must be
set before jax is imported, which would disturb every other test in the same process).

For each case, logits of a chunked ragged prefill and two decode steps with parameters and
KV cache sharded over an (expert, model) mesh must match the unsharded run.
Exits non-zero with a message on the first mismatch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.models import registry  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402
from jaxserve.pallas_kernels.policy import KernelPlan  # noqa: E402
from jaxserve.sharding import mesh as mesh_lib, rules  # noqa: E402
from model_step_builder import Chunk, build_step, empty_kv_cache, moe_regions, scattered_block_tables  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden")
DENSE_KV4 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 250, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 16}
# head dim 32: the fused rope/KV-write kernel's smallest (models/llama.py make_kernels)
DENSE_E32 = dict(DENSE_KV4, head_dim=32)
LLAMA_E32 = dict(DENSE_E32, architectures=["LlamaForCausalLM"])      # no q/k norms
FUSED = frozenset({"norm", "rope"})
BLOCK, NUM_BLOCKS = 8, 16
SHARD_MAPS = [0]          # how many shard_map regions the latest _run's step has


def _run(cfg, params, mesh, impl="xla", fused=frozenset()):
    """Logits of every step: prefill in two chunks, then two batched decode steps. impl
    "pallas": the attention kernel (and the `fused` ones), run per head shard under the mesh
    (sharding/kernels.py)."""
    sharding = rules.kv_cache_sharding(registry.get_family(cfg.architecture), cfg, mesh) if mesh is not None else None
    kv = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK, sharding=sharding)
    tables = scattered_block_tables(3, 4, NUM_BLOCKS, seed=1)
    prompts = [[5, 9, 3], list(range(10, 19)), list(range(30, 50))]
    steps = [[Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:8], 0)],
             [Chunk(2, prompts[2][8:], 8)],
             [Chunk(i, [7 + i], len(p)) for i, p in enumerate(prompts)],
             [Chunk(i, [11 + i], len(p) + 1) for i, p in enumerate(prompts)]]
    step_fn = jax.jit(lambda p, kv, x: _forward_logits(cfg, p, kv, x, mesh, impl, fused))
    out = []
    for chunks in steps:
        x = build_step(chunks, tables, BLOCK, 24, 4)
        if mesh is not None:
            x = jax.device_put(x, rules.replicated(mesh))
        if not out:
            SHARD_MAPS[0] = step_fn.lower(params, kv, x).as_text().count("sdy.manual_computation")
        kv, logits = step_fn(params, kv, x)
        out.append(np.asarray(logits)[: sum(len(c.token_ids) for c in chunks)])
    if mesh is not None:
        want = rules.kv_cache_sharding(registry.get_family(cfg.architecture), cfg, mesh)
        assert kv[0]["k"].sharding.is_equivalent_to(want, 4), (kv[0]["k"].sharding, want)
    return out


def _forward_logits(cfg, params, kv, x, mesh=None, impl="xla", fused=frozenset()):
    model = registry.get_family(cfg.architecture)    # llama's families, MiniMax-M2, ...
    if impl == "xla":
        kv, hidden, _ = model.forward(cfg, params, kv, x)
    else:   # traced with the mesh as the ambient one, as the runner's step is
        with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
              else contextlib.nullcontext()):
            kv, hidden, _ = model.forward(cfg, params, kv, x, model.make_kernels(
                cfg, impl, kernel_plan=KernelPlan.for_model(cfg, model.name, fused)))
    return kv, model.compute_logits(cfg, params, hidden)


def kernel_regions(cfg, tp, fused=frozenset()):
    """shard_maps in a Pallas step on a `model` axis of size tp: per layer the attention (and
    the fused rope/KV write), and each add+RMSNorm (2 per layer and the first) if fused."""
    if tp == 1:
        return 0
    rope = "rope" in fused and cfg.head_dim >= 32
    return cfg.num_layers * (1 + rope) + (2 * cfg.num_layers + 1) * ("norm" in fused)


def check_matches(source, tp, ep, load_format="auto", atol=2e-5, impl="xla", fused=frozenset()):
    """Logits on a (tp, ep) mesh with `impl` (and the `fused` kernels) equal one device's XLA
    path within atol."""
    cfg, ref_params, _ = load_model(source, load_format)
    want = _run(cfg, ref_params, None)
    mesh = mesh_lib.make_mesh(tp, ep)
    cfg, params, _ = load_model(source, load_format, mesh=mesh)
    wq = params["layers"][0]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model"), wq.sharding
    assert wq.addressable_shards[0].data.shape[1] == wq.shape[1] // tp
    if cfg.is_moe:
        w_up = params["layers"][0]["w_up"]
        assert w_up.addressable_shards[0].data.shape == (cfg.num_experts // ep, cfg.hidden_size,
                                                        cfg.moe_intermediate_size // tp)
    t0 = time.perf_counter()
    got = _run(cfg, params, mesh, impl, fused)
    want_maps = kernel_regions(cfg, tp, fused) + moe_regions(params, tp, ep)
    if impl == "pallas" and SHARD_MAPS[0] != want_maps:
        sys.exit(f"{source} TP={tp} EP={ep}: {SHARD_MAPS[0]} kernels per shard, not {want_maps}")
    for i, (g, w) in enumerate(zip(got, want)):
        err = float(np.max(np.abs(g - w)))
        if err > atol:
            sys.exit(f"{source} TP={tp} EP={ep} {impl}: step {i} logits differ by {err} (> {atol})")
    label = os.path.basename(source) if isinstance(source, str) else source["architectures"][0]
    print(f"ok {label} TP={tp} EP={ep} {impl} {'+'.join(sorted(fused))} "
          f"({time.perf_counter() - t0:.1f} s)")


def check_errors():
    cfg, _, _ = load_model(os.path.join(GOLDEN, "ckpt", "llama"), "dummy")   # 4 heads, 2 kv heads
    for tp, field in ((4, "num_kv_heads"), (8, "num_heads")):
        try:
            rules.param_shardings(registry.get_family(cfg.architecture), cfg, mesh_lib.make_mesh(tp))
        except ValueError as e:
            assert field in str(e) and str(tp) in str(e), str(e)
        else:
            sys.exit(f"TP={tp} with 4 heads / 2 kv heads should raise a ValueError naming {field}")
    try:
        mesh_lib.make_mesh(4, 4)
    except ValueError as e:
        assert "16" in str(e) and "8" in str(e), str(e)
    else:
        sys.exit("a 16-device mesh on 8 devices should raise")
    print("ok errors")


def check_ready_configs():
    """The benchmark shapes split over a full 8-device mesh (specs only: nothing allocated)."""
    from jaxserve.models.loaders import dummy
    from jaxserve.models import loader

    for name, tp, ep in (("Llama-3.1-8B", 8, 1), ("Qwen3-8B", 8, 1), ("Qwen3-30B-A3B", 4, 2)):
        cfg = loader.model_config_from_hf(dummy.read_config(name))
        specs = rules.param_shardings(registry.get_family(cfg.architecture), cfg, mesh_lib.make_mesh(tp, ep))
        assert specs["layers"][0]["wk"].spec == jax.sharding.PartitionSpec(None, "model"), name
    print("ok ready configs")


def check_shard_params():
    """The GGUF path: a host parameter tree put onto the mesh array by array."""
    cfg, params, _ = load_model(os.path.join(GOLDEN, "ckpt", "llama"))
    host = jax.tree.map(np.asarray, params)
    sharded = rules.shard_params(registry.get_family(cfg.architecture), host, cfg, mesh_lib.make_mesh(2), dtype="float32")
    spec = sharded["layers"][1]["w_down"].sharding.spec
    assert spec == jax.sharding.PartitionSpec("model", None), spec
    assert sharded["lm_head"].addressable_shards[0].data.shape == (64, 128)
    jax.tree.map(np.testing.assert_array_equal, sharded, host)
    print("ok shard_params")


def check_engine(name, tp, impl, steps=6):
    """The engine (runner, sampler, scheduler) on a TP mesh with `impl`: greedy tokens equal
    transformers' (what one device gives, tests/models/test_models_llm.py), the long prompt
    chunked beside the others' decodes."""
    from jaxserve import LLM, SamplingParams

    g = np.load(os.path.join(GOLDEN, f"{name}.npz"))
    t0 = time.perf_counter()
    llm = LLM(os.path.join(GOLDEN, "ckpt", name), dtype="float32", tensor_parallel_size=tp,
              attention_impl=impl, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
              block_size=4, num_kv_blocks=48, warmup=False)
    assert llm.engine.runner.attention_impl == impl, llm.engine.runner.attention_impl
    outs = llm.generate([{"prompt_token_ids": g[f"prompt_{i}"].tolist()} for i in range(3)],
                        SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    for i, o in enumerate(outs):
        if o.outputs[0].token_ids != g[f"greedy_{i}"].tolist()[:steps]:
            sys.exit(f"engine {name} TP={tp} {impl}: seq {i} greedy {o.outputs[0].token_ids} != golden")
    print(f"ok engine {name} TP={tp} {impl} ({time.perf_counter() - t0:.1f} s)")


def main():
    assert len(jax.devices()) == 8, jax.devices()
    ckpt = lambda name: os.path.join(GOLDEN, "ckpt", name)  # noqa: E731
    check_errors()
    check_shard_params()
    check_ready_configs()
    check_matches(ckpt("qwen2"), tp=2, ep=1)                      # qkv bias, f32 checkpoint
    check_matches(DENSE_KV4, tp=4, ep=1, load_format="dummy")     # uneven vocab: replicated
    check_matches(ckpt("qwen3_moe"), tp=1, ep=4)
    check_matches(ckpt("mixtral"), tp=2, ep=2)
    check_matches(ckpt("llama_tied"), tp=2, ep=1)                 # tied embedding, vocab split
    # the Pallas kernels per shard (interpreted): attention, and the fused add+RMSNorm and
    # q/k-norm + RoPE + KV write, with q/k norms (Qwen3) and without (Llama)
    check_matches(DENSE_E32, tp=4, ep=1, load_format="dummy", atol=1e-5, impl="pallas", fused=FUSED)
    check_matches(LLAMA_E32, tp=2, ep=1, load_format="dummy", atol=1e-5, impl="pallas", fused=FUSED)
    check_matches(ckpt("qwen3_moe"), tp=2, ep=2, atol=1e-5, impl="pallas")    # MoE: see kernels.py
    check_engine("llama", tp=2, impl="pallas")


if __name__ == "__main__":
    main()
