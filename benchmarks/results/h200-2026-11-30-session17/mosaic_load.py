"""Does a serialized program that calls a Mosaic GPU kernel load in a fresh process?
Session 17. `save`: compile our Mosaic GPU prefill attention (256 tokens, 8B's heads, paged
cache) under jit, run it, write the serialized executable, its inputs and output to DIR.
`bare`: a fresh process that imports jax only, loads it and runs it. `prepared`: the same
after compiling.prepare_mosaic_gpu_runtime(). Prints whether it loaded and whether the output
matches the saving process's, bit for bit."""
import os, pickle, sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import serialize_executable

DIR = "/tmp/mosaic_load"
stage = sys.argv[1]
print("MOSAIC_GPU_RUNTIME_LIB_PATH at start:", os.environ.get("MOSAIC_GPU_RUNTIME_LIB_PATH"))
if stage == "save":
    from jaxserve.pallas_kernels import ragged_paged_attention_mgpu as mg

    os.makedirs(DIR, exist_ok=True)
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (256, 32, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (40, 16, 8, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (40, 16, 8, 128), jnp.bfloat16)
    qsl = jnp.array([0, 100, 256, 256, 256], jnp.int32)
    lens = jnp.array([300, 156, 0, 0], jnp.int32)
    bt = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, 40))[:32].reshape(1, 32)
                     .repeat(4, 0).astype(np.int32))
    bt = bt.at[1].set(jnp.roll(bt[1], 7))
    args = (q, k, v, qsl, lens, bt)
    fn = jax.jit(lambda *a: mg.ragged_paged_attention_mgpu(*a, sm_scale=0.088))
    compiled = fn.lower(*args).compile()
    out = np.asarray(compiled(*args).astype(jnp.float32))
    ref = np.asarray(mg.ref_ragged_paged_attention(*args, sm_scale=0.088).astype(jnp.float32))
    print("saved; rel. err vs reference", np.linalg.norm(out - ref) / np.linalg.norm(ref))
    with open(f"{DIR}/program.pkl", "wb") as f:
        pickle.dump((serialize_executable.serialize(compiled),
                     [np.asarray(a) for a in args], out), f)
else:
    with open(f"{DIR}/program.pkl", "rb") as f:
        (blob, in_tree, out_tree), args, out = pickle.load(f)
    if stage == "prepared":
        from jaxserve import compiling
        compiling.prepare_mosaic_gpu_runtime()
        print("after prepare:", os.environ.get("MOSAIC_GPU_RUNTIME_LIB_PATH"))
    try:
        loaded = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        got = np.asarray(loaded(*[jnp.asarray(a) for a in args]).astype(jnp.float32))
        print(stage, "loaded; output identical:", bool(np.array_equal(got, out)))
    except Exception as e:  # noqa: BLE001 - the result is what is printed
        print(stage, "FAILED:", type(e).__name__, str(e)[:300])
