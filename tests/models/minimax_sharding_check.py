"""Run by test_minimax_m2_sharding.py in a subprocess with 8 fake CPU devices (XLA_FLAGS must
be set before jax is imported).

MiniMax-M2 under tensor and expert parallelism against one device, in f32 within 1e-5: the
logits of a chunked ragged prefill and two decode steps (model_sharding_check._run). The
full-width q/k norm spans the heads, so every rank holds part of each row: its q and k sums
of squares must cross the ranks in one all-reduce of f32[T, 2] per layer, which the compiled
step is checked for. Also the engine on a TP 2 x EP 2 mesh against transformers' greedy tokens,
and the full-width config's partition specs. Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

from jaxserve.models import loader, minimax_m2, registry  # noqa: E402
from jaxserve.sharding import mesh as mesh_lib, rules  # noqa: E402
from model_sharding_check import FUSED, GOLDEN, _forward_logits, _run, check_matches  # noqa: E402
from model_step_builder import Chunk, build_step, scattered_block_tables  # noqa: E402

ATOL = 1e-5
# 8 heads, 4 kv heads (TP 4 splits them), an uneven vocabulary (replicated)
WIDE = {"architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 250, "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 16, "rotary_dim": 8, "rope_theta": 50000.0,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6}
# head dim 32: the fused full-width q/k-norm kernel's smallest (minimax_m2.make_kernels)
WIDE_E32 = dict(WIDE, head_dim=32, rotary_dim=16)


def random_params(cfg, seed: int = 0) -> dict:
    """Host weights of the size the goldens use (HF's init gives near-ties): norms near 1,
    a correction bias that moves the expert choice."""
    rng = np.random.default_rng(seed)

    def one(name, shape):
        if name.endswith("norm"):
            return (1.0 + 0.2 * rng.normal(size=shape)).astype(np.float32)
        return ((0.3 if name == "router_bias" else 0.08) * rng.normal(size=shape)).astype(np.float32)

    shapes = minimax_m2.param_shapes(cfg)
    out = {k: one(k, v) for k, v in shapes.items() if k != "layers"}
    out["layers"] = [{k: one(k, v) for k, v in ls.items()} for ls in shapes["layers"]]
    return out


def check_random(cfg, host, want, tp, ep, impl="xla", fused=frozenset()):
    mesh = mesh_lib.make_mesh(tp, ep)
    params = rules.shard_params(registry.get_family(cfg.architecture), host, cfg, mesh)
    q_norm = params["layers"][0]["q_norm"]
    assert q_norm.sharding.spec == PartitionSpec("model"), q_norm.sharding
    assert q_norm.addressable_shards[0].data.shape == (cfg.num_heads * cfg.head_dim // tp,)
    got = _run(cfg, params, mesh, impl, fused)
    for i, (g, w) in enumerate(zip(got, want)):
        err = float(np.max(np.abs(g - w)))
        if err > ATOL:
            sys.exit(f"random weights TP={tp} EP={ep} {impl}: step {i} logits differ by {err} (> {ATOL})")
    print(f"ok random TP={tp} EP={ep} {impl} {'+'.join(sorted(fused))}")


def check_one_reduction(cfg, host, tp, impl="xla", fused=frozenset()):
    """The compiled step: per layer exactly one all-reduce of f32[T, 2] (q's and k's sums of
    squares together), and none of f32[T] or f32[T, 1] (one of them alone); with the fused
    kernel too (its psum inside the shard_map, sharding/kernels.full_qk_norm_rope_kv_write)."""
    mesh = mesh_lib.make_mesh(tp, 1)
    params = rules.shard_params(registry.get_family(cfg.architecture), host, cfg, mesh)
    kv = [{n: jax.device_put(np.zeros((16, 8, cfg.num_kv_heads, cfg.head_dim), np.float32),
                             rules.kv_cache_sharding(registry.get_family(cfg.architecture), cfg, mesh)) for n in ("k", "v")}
          for _ in range(cfg.num_layers)]
    t = 24
    x = jax.device_put(build_step([Chunk(0, list(range(5, 25)), 0)], scattered_block_tables(1, 4, 16),
                                  8, t, 4), rules.replicated(mesh))
    hlo = jax.jit(lambda p, kv, x: _forward_logits(cfg, p, kv, x, mesh, impl, fused)).lower(
        params, kv, x).compile().as_text()
    shapes = re.findall(r"= (f32\[[0-9,]*\])\{[^}]*\} all-reduce\(", hlo)
    pair, single = shapes.count(f"f32[{t},2]"), shapes.count(f"f32[{t}]") + shapes.count(f"f32[{t},1]")
    if pair != cfg.num_layers or single:
        sys.exit(f"TP={tp}: all-reduces {shapes}: want {cfg.num_layers} of f32[{t},2] (one per layer) "
                 f"and none of f32[{t}] / f32[{t},1]")
    print(f"ok one q/k reduction per layer TP={tp} {impl}")


def check_engine(tp, ep):
    """The whole engine on a mesh (sharded loading, caches split by kv heads, XLA kernels):
    greedy tokens equal transformers', the long prompt chunked beside the others' decodes."""
    from jaxserve import LLM, SamplingParams

    g = np.load(os.path.join(GOLDEN, "minimax_m2.npz"))
    llm = LLM(os.path.join(GOLDEN, "ckpt", "minimax_m2"), dtype="float32", tensor_parallel_size=tp,
              expert_parallel_size=ep, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
              block_size=4, num_kv_blocks=64, warmup=False)
    outs = llm.generate([{"prompt_token_ids": g[f"prompt_{i}"].tolist()} for i in range(3)],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for i, o in enumerate(outs):
        if o.outputs[0].token_ids != g[f"greedy_{i}"].tolist()[:6]:
            sys.exit(f"engine TP={tp} EP={ep}: seq {i} greedy {o.outputs[0].token_ids} != golden")
    print(f"ok engine TP={tp} EP={ep}")


def check_ready_config():
    """MiniMax-M2's full width splits over a whole 8-device mesh (specs only: nothing allocated)."""
    from jaxserve.models.loaders import dummy

    cfg = loader.model_config_from_hf(dummy.read_config("MiniMax-M2-4L"))
    for tp, ep in ((8, 1), (4, 2), (1, 8)):
        specs = rules.param_shardings(registry.get_family(cfg.architecture), cfg, mesh_lib.make_mesh(tp, ep))["layers"][0]
        assert specs["q_norm"].spec == PartitionSpec("model"), specs["q_norm"]
        assert specs["w_up"].spec == PartitionSpec("expert", None, "model"), specs["w_up"]
        assert specs["router_bias"].spec == PartitionSpec(None), specs["router_bias"]
    print("ok ready config")


def main():
    assert len(jax.devices()) == 8, jax.devices()
    ckpt = os.path.join(GOLDEN, "ckpt", "minimax_m2")           # 4 heads, 2 kv heads, 8 experts
    check_matches(ckpt, tp=2, ep=1, atol=ATOL)                  # the loader's sharded path
    check_matches(WIDE, tp=4, ep=1, load_format="dummy", atol=ATOL)   # dummy weights on a mesh
    cfg = loader.model_config_from_hf(WIDE)
    host = random_params(cfg)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = _run(cfg, jax.tree.map(lambda a: jax.device_put(a, one), host), None)
    check_random(cfg, host, want, tp=4, ep=2)
    check_one_reduction(cfg, host, tp=4)
    # the fused full-width q/k-norm kernel per head shard (its sums of squares psum'd), the
    # fused add+RMSNorm and the attention kernel; with weights of the goldens' size
    check_matches(ckpt, tp=2, ep=2, atol=ATOL, impl="pallas", fused=FUSED)
    cfg = loader.model_config_from_hf(WIDE_E32)
    host = random_params(cfg)
    want = _run(cfg, jax.tree.map(lambda a: jax.device_put(a, one), host), None)
    check_random(cfg, host, want, tp=4, ep=1, impl="pallas", fused=FUSED)
    check_one_reduction(cfg, host, tp=4, impl="pallas", fused=FUSED)
    check_ready_config()
    check_engine(tp=2, ep=2)


if __name__ == "__main__":
    main()
