"""Times one train-draft step's parts at B x T on dummy weights of a HF config: the target's
forward (Pallas attention) and the head's train step with bf16 and f32 matmul operands.

    python benchmarks/train_draft_stepbench.py CONFIG_DIR 32 768
"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxserve.models import loader, registry
from jaxserve.train_draft import head, target, train, data

B, T = int(sys.argv[2]), int(sys.argv[3])
cfg, params, _ = loader.load_model(sys.argv[1], load_format="dummy", dtype="bfloat16", seed=0)
module = registry.get_family(cfg.architecture)
draft_ids = np.arange(32000, dtype=np.int32)
rng = np.random.default_rng(0)
ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
lengths = jnp.full(B, T, jnp.int32); tf = jnp.asarray(rng.integers(0, T // 2, B), jnp.int32)
out = {"B": B, "T": T}

def timed(f, n=5):
    t = time.perf_counter(); r = f(); jax.block_until_ready(r); c = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n): r = f()
    jax.block_until_ready(r)
    return c, (time.perf_counter() - t) / n, r

tfn = target.make_target_fn(module, cfg, (2, 15, 27), "pallas")
dd = jnp.asarray(draft_ids)
c, s, tgt = timed(lambda: tfn(params, ids, dd))
out["target_compile_s"], out["target_step_s"] = round(c, 2), round(s, 4)
batch = (tgt[0], ids, lengths, tf, *tgt[1:])
for name, dt in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
    h = head.init_head(cfg, params, module, draft_ids, 0)
    graphdef, state = nnx.split((h, train.make_optimizer(h, 5e-4, 1000, 50, 0.0)))
    step = train.make_train_step(graphdef, 3, dt)
    st = [state]
    def one():
        st[0], loss, _, _ = step(st[0], params["embed"], batch)
        return loss
    c, s, _ = timed(one)
    out[f"head_{name}_compile_s"], out[f"head_{name}_step_s"] = round(c, 2), round(s, 4)
    print(json.dumps(out), flush=True)
# host batch build
ex = [data.Example(np.arange(min(700, T), dtype=np.int32) % 999, T // 2, T // 2)] * 64
t = time.perf_counter(); [data.train_batch(ex, i, B, T, 0) for i in range(20)]
out["host_batch_s"] = round((time.perf_counter() - t) / 20, 4)
print(json.dumps(out), flush=True)
