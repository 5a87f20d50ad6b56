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

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.models import registry  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402
from jaxserve.sharding import mesh as mesh_lib, rules  # noqa: E402
from model_step_builder import Chunk, build_step, empty_kv_cache, scattered_block_tables  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden")
DENSE_KV4 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 250, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 16}
BLOCK, NUM_BLOCKS = 8, 16


def _run(cfg, params, mesh, impl="xla"):
    """Logits of every step: prefill in two chunks, then two batched decode steps. impl
    "pallas": the attention kernel, run per head shard under the mesh (sharding/kernels.py)."""
    sharding = rules.kv_cache_sharding(cfg, mesh) if mesh is not None else None
    kv = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK, sharding=sharding)
    tables = scattered_block_tables(3, 4, NUM_BLOCKS, seed=1)
    prompts = [[5, 9, 3], list(range(10, 19)), list(range(30, 50))]
    steps = [[Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:8], 0)],
             [Chunk(2, prompts[2][8:], 8)],
             [Chunk(i, [7 + i], len(p)) for i, p in enumerate(prompts)],
             [Chunk(i, [11 + i], len(p) + 1) for i, p in enumerate(prompts)]]
    step_fn = jax.jit(lambda p, kv, x: _forward_logits(cfg, p, kv, x, mesh, impl))
    out = []
    for chunks in steps:
        x = build_step(chunks, tables, BLOCK, 24, 4)
        if mesh is not None:
            x = jax.device_put(x, rules.replicated(mesh))
        kv, logits = step_fn(params, kv, x)
        out.append(np.asarray(logits)[: sum(len(c.token_ids) for c in chunks)])
    if mesh is not None:
        want = rules.kv_cache_sharding(cfg, mesh)
        assert kv[0]["k"].sharding.is_equivalent_to(want, 4), (kv[0]["k"].sharding, want)
    return out


def _forward_logits(cfg, params, kv, x, mesh=None, impl="xla"):
    model = registry.get_model_module(cfg.architecture)    # llama's families, MiniMax-M2, ...
    if impl == "xla":
        kv, hidden, _ = model.forward(cfg, params, kv, x)
    else:   # traced with the mesh as the ambient one, as the runner's step is
        with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
              else contextlib.nullcontext()):
            kv, hidden, _ = model.forward(cfg, params, kv, x, model.make_kernels(cfg, impl))
    return kv, model.compute_logits(cfg, params, hidden)


def check_matches(source, tp, ep, load_format="auto", atol=2e-5, impl="xla"):
    cfg, ref_params, _ = load_model(source, load_format)
    want = _run(cfg, ref_params, None, impl)
    mesh = mesh_lib.make_mesh(tp, ep)
    cfg, params, _ = load_model(source, load_format, mesh=mesh)
    wq = params["layers"][0]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model"), wq.sharding
    assert wq.addressable_shards[0].data.shape[1] == wq.shape[1] // tp
    if cfg.is_moe:
        w_up = params["layers"][0]["w_up"]
        assert w_up.addressable_shards[0].data.shape == (cfg.num_experts // ep, cfg.hidden_size,
                                                        cfg.moe_intermediate_size // tp)
    got = _run(cfg, params, mesh, impl)
    for i, (g, w) in enumerate(zip(got, want)):
        err = float(np.max(np.abs(g - w)))
        if err > atol:
            sys.exit(f"{source} TP={tp} EP={ep}: step {i} logits differ by {err} (> {atol})")
    print(f"ok {os.path.basename(str(source)) if isinstance(source, str) else 'dict'} TP={tp} EP={ep} {impl}")


def check_errors():
    cfg, _, _ = load_model(os.path.join(GOLDEN, "ckpt", "llama"), "dummy")   # 4 heads, 2 kv heads
    for tp, field in ((4, "num_kv_heads"), (8, "num_heads")):
        try:
            rules.param_shardings(cfg, mesh_lib.make_mesh(tp))
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
    from jaxserve.models import dummy, hf_loader

    for name, tp, ep in (("Llama-3.1-8B", 8, 1), ("Qwen3-8B", 8, 1), ("Qwen3-30B-A3B", 4, 2)):
        cfg = hf_loader.model_config_from_hf(dummy.read_config(name))
        specs = rules.param_shardings(cfg, mesh_lib.make_mesh(tp, ep))
        assert specs["layers"][0]["wk"].spec == jax.sharding.PartitionSpec(None, "model"), name
    print("ok ready configs")


def check_shard_params():
    """The GGUF path: a host parameter tree put onto the mesh array by array."""
    cfg, params, _ = load_model(os.path.join(GOLDEN, "ckpt", "llama"))
    host = jax.tree.map(np.asarray, params)
    sharded = rules.shard_params(host, cfg, mesh_lib.make_mesh(2), dtype="float32")
    spec = sharded["layers"][1]["w_down"].sharding.spec
    assert spec == jax.sharding.PartitionSpec("model", None), spec
    assert sharded["lm_head"].addressable_shards[0].data.shape == (64, 128)
    jax.tree.map(np.testing.assert_array_equal, sharded, host)
    print("ok shard_params")


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
    for tp in (2, 4):                                             # the attention kernel per shard
        check_matches(DENSE_KV4, tp=tp, ep=1, load_format="dummy", atol=1e-5, impl="pallas")


if __name__ == "__main__":
    main()
