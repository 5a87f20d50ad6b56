"""Run by test_expert_parallel.py in a subprocess with 8 fake CPU devices (XLA_FLAGS must be set
before jax is imported).

1. The dispatch / combine itself (sharding/expert_parallel.moe_on_mesh, both forms, impl "xla"
   and "pallas") against a dense float64 reference, routing given: random rows, experts that
   receive no rows (a whole rank idle), every row to one expert, a token count EP does not
   divide.
2. Whole models: Qwen3-MoE, DeepSeek-V3 (shared experts dense), Qwen3.5-MoE (gated shared
   expert; its first two layers) and MiniMax-M2 tiny checkpoints on the MESHES below, traced
   under the mesh as the runner's step is (so the MoE runs in the shard_map): logits of a
   prefill and a decode step equal one device's within 1e-5 (f32), impl "xla" and "pallas".
Exits non-zero with a message on the first failure.

Usage: expert_parallel_check.py dispatch | models
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxserve.models import moe  # noqa: E402
from jaxserve.sharding import expert_parallel, mesh as mesh_lib  # noqa: E402

ATOL = 1e-5
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden")


def dense_reference(h, w_gate, w_up, w_down, weights, experts):
    """float64: sum over each token's k choices of weight * SwiGLU expert."""
    h, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (h, w_gate, w_up, w_down))
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            g, u = h[t] @ w_gate[e], h[t] @ w_up[e]
            out[t] += w * ((g / (1 + np.exp(-g))) * u) @ w_down[e]
    return out


def dispatch_cases(t, k, x, rng):
    yield "random", rng.integers(0, x, (t, k))
    yield "experts 3.. empty", rng.integers(0, 3, (t, k))
    yield "all to one expert", np.full((t, k), x - 3)


def check_dispatch():
    x, d, f, k = 8, 32, 32, 2
    rng = np.random.default_rng(0)
    w = {n: (0.2 * rng.normal(size=s)).astype(np.float32)
         for n, s in (("w_gate", (x, d, f)), ("w_up", (x, d, f)), ("w_down", (x, f, d)))}
    for ep, tp in ((2, 1), (4, 1), (2, 2), (1, 2)):
        mesh = mesh_lib.make_mesh(tp, ep)
        specs = {"w_gate": P("expert", None, "model"), "w_up": P("expert", None, "model"),
                 "w_down": P("expert", "model", None)}
        placed = {n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in w.items()}
        t = 7           # EP 2 / 4 do not divide it: the all-to-all form pads
        h = rng.normal(size=(t, d)).astype(np.float32)
        h[:, 0] = np.arange(t)          # the token's index: what route_by_index reads
        h_placed = jax.device_put(h, NamedSharding(mesh, P()))
        cases = [(label, experts, rng.uniform(0.1, 1.0, (t, k)).astype(np.float32))
                 for label, experts in dispatch_cases(t, k, x, rng)]
        for dispatch in expert_parallel.DISPATCH_FORMS:
            for impl in ("xla", "pallas"):
                # one compile per form and impl: the routing is an argument
                fn = jax.jit(lambda lp, h: _on_mesh(mesh, lp, h, x, impl, dispatch))
                for label, experts, weights in cases:
                    want = dense_reference(h, w["w_gate"], w["w_up"], w["w_down"], weights, experts)
                    lp = dict(placed, router=(jnp.asarray(weights), jnp.asarray(experts, jnp.int32)))
                    err = float(np.max(np.abs(np.asarray(fn(lp, h_placed)) - want)))
                    if err > ATOL:
                        sys.exit(f"dispatch {dispatch} {impl} EP={ep} TP={tp} T={t} {label}: "
                                 f"differs from the dense reference by {err}")
        print(f"ok dispatch EP={ep} TP={tp}")
    try:
        with jax.sharding.use_abstract_mesh(mesh_lib.make_mesh(1, 2).abstract_mesh):
            expert_parallel.moe_on_mesh(lambda p, h: p["router"], moe.EXPERT_MATHS, dict(w, router=None), h, x, "xla", "ring")
    except ValueError as e:
        assert "dispatch" in str(e), e
    else:
        sys.exit("an unknown dispatch form should raise a ValueError naming dispatch")
    print("ok dispatch errors")


def route_by_index(table, h):
    """The given routing of each token, looked up by the index it carries in column 0 (the
    all-to-all form routes each rank's token slice, so the routing must follow the token)."""
    weights, experts = table["router"]
    i = jnp.clip(h[:, 0].astype(jnp.int32), 0, weights.shape[0] - 1)
    return weights[i], experts[i]


def _on_mesh(mesh, lp, h, x, impl, dispatch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return expert_parallel.moe_on_mesh(route_by_index, moe.EXPERT_MATHS, lp, h, x, impl, dispatch)


def check_models():
    """Every MoE family, EP 2 / EP 4 / EP 2 x TP 2, impl xla and pallas, against one device."""
    from jaxserve.models import registry
    from jaxserve.models.loader import load_model
    from jaxserve.sharding import rules
    from new_families_sharding_check import BLOCK, empty_caches
    from hybrid_step_builder import Chunk, build_hybrid_step, scattered_block_tables

    tables = scattered_block_tables(2, 4, 16, seed=1)
    slots = np.array([1, 3])
    steps = [[Chunk(0, list(range(5, 16)), 0), Chunk(1, [4, 8, 2], 0)],
             [Chunk(0, [21], 11), Chunk(1, [22], 3)]]

    def run(cfg, params, mesh, impl):
        model = registry.get_family(cfg.architecture)
        caches = empty_caches(cfg, mesh)

        def step(p, c, xs):
            ctx = (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
                   else _null())
            with ctx:
                c, hidden, _ = model.forward(cfg, p, c, xs, model.make_kernels(cfg, impl))
            return c, model.compute_logits(cfg, p, hidden)

        fn, out = None, []
        for chunks in steps:
            xs = build_hybrid_step(chunks, tables, slots, BLOCK, 16, 2)
            if mesh is not None:
                xs = jax.device_put(xs, rules.replicated(mesh))
            if fn is None:        # both steps have the same shapes: one compile
                fn = jax.jit(step).lower(params, caches, xs).compile()
            caches, logits = fn(params, caches, xs)
            out.append(np.asarray(logits)[: sum(len(c.token_ids) for c in chunks)])
        if mesh is not None and mesh.shape["model"] == 1:
            # EP alone: attention and the vocabulary are whole on every rank, so any gather or
            # all-to-all would be experts (or tokens) moved; only the psum combines
            hlo = fn.as_text()
            moved = [op for op in ("all-gather", "all-to-all", "collective-permute") if f" {op}" in hlo]
            if moved or "all-reduce" not in hlo:
                sys.exit(f"{cfg.architecture} EP={mesh.shape['expert']}: collectives {moved}, "
                         f"all-reduce {'all-reduce' in hlo}")
        return out

    for name in ("qwen3_moe", "deepseek_v3", "qwen3_5_moe", "minimax_m2"):
        path = two_layers(name) if name == "qwen3_5_moe" else os.path.join(GOLDEN, "ckpt", name)
        for impl, meshes in MESHES.items():
            cfg, ref, _ = load_model(path)
            want = run(cfg, ref, None, impl)
            for ep, tp in meshes:
                if cfg.num_experts % ep:
                    continue
                mesh = mesh_lib.make_mesh(tp, ep)
                cfg, params, _ = load_model(path, mesh=mesh)
                got = run(cfg, params, mesh, impl)
                for i, (g, w_) in enumerate(zip(got, want)):
                    err = float(np.max(np.abs(g - w_)))
                    if err > ATOL:
                        sys.exit(f"{name} {impl} EP={ep} TP={tp}: step {i} logits differ by {err}")
            print(f"ok {name} {impl} (EP, TP) in {meshes}")


# (EP, TP) meshes per impl, kept few for CI time (each is a compile of the whole model; the
# dispatch check above runs EP 2, 4, 2 x TP 2 and TP 2 for both impls): EP 4 (one or two
# experts a rank) and EP 2 x TP 2 (the F split's partial sums in the same psum); interpreted
# Pallas compiles slowest, so it runs EP 2 x TP 2 only
MESHES = {"xla": [(4, 1), (2, 2)], "pallas": [(2, 2)]}


def two_layers(name):
    """The tiny checkpoint cut to its first two layers (a DeltaNet and a full-attention one, both
    MoE): half the compile time, every kind of layer kept."""
    import json
    import tempfile

    src = os.path.join(GOLDEN, "ckpt", name)
    dst = tempfile.mkdtemp()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"], config["layer_types"] = 2, config["layer_types"][:2]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    os.symlink(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    return dst


def _null():
    import contextlib
    return contextlib.nullcontext()


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    {"dispatch": check_dispatch, "models": check_models}[sys.argv[1]]()
