"""Decode per layer of a reduced-depth, full-width model (dummy bf16 weights), any family:
the step's kernel time per layer at batch 1 / 16 / 64 against that layer's HBM roofline, and
the kernels a layer launches (issues 30, 32, 33: DeepSeek V3 / V3.2, Qwen3.5, MiniMax-M2).

    python benchmarks/reduced_depth_decode.py --config DeepSeek-V3-4L [--batch 1 16 64] [--json out.json]
    python benchmarks/reduced_depth_decode.py --config Qwen3.5-397B-A17B-4L
    python benchmarks/reduced_depth_decode.py --smoke    # the tests' tiny checkpoints' shapes, any backend
    python benchmarks/reduced_depth_decode.py --config DeepSeek-V3-4L --fp8   # experts kept in FP8
    python benchmarks/reduced_depth_decode.py --config DeepSeek-V3-4L --depth 3  # fits an 80 GB card
    python benchmarks/reduced_depth_decode.py --config Qwen3-30B-A3B --batch 1 --kernels DIR
        # also each kernel's device time in the deepest step (a jax.profiler trace under DIR)

The step is the model's forward + logits over B decode tokens at `--context` cached tokens
each (no sampler, no host): one jitted program looping it over its caches, timed by
benchmarks/kernel_timing.py gpu_time_ms (CUPTI kernel time). Per layer = (step of 4 layers - step of
2 layers) / 2, which removes the embedding and the LM head: layers 2 and 3 of the config (for
DeepSeek-V3-4L two MoE layers; for Qwen3.5-4L one linear-attention and one full-attention
layer, so the figure is their mean). `--depth 3` builds and times 3 layers against 2: layer 2
alone (DeepSeek-V3's 4 layers of weights, 72 GB, do not fit an H100's 80 GB with the runner's
copies; 3 do). Roofline per layer: those layers' weights (routed experts
counted as the expected distinct experts a uniform top-k router reaches at that batch), their
paged cache rows read, their recurrent state read and written, over the device's measured copy
rate (H200 4.24 TB/s, H100 3.0). Kernels a layer: fusions and custom calls of the compiled
one-step program, (4 layers - 2 layers) / 2 (on a CPU these are XLA:CPU's, not the GPU's).
Measured on the H200 (session 21) and an H100 (session 33): BENCHMARKS.md.

Legend: B batch (decode sequences), L context per sequence, X routed experts, k chosen per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_timing as kb  # noqa: E402  (benchmarks/kernel_timing.py: timing and rows)
from jaxserve.bench import roofline  # noqa: E402
from jaxserve.pallas_kernels.policy import KernelPlan  # noqa: E402
from jaxserve.core.kv_cache.specs import PagedSpec  # noqa: E402
from jaxserve.models import registry
from jaxserve.models.loaders import dummy
from jaxserve.models import loader  # noqa: E402
from jaxserve.models.attention import AttentionBackend  # noqa: E402
from jaxserve.models.moe import quantize_experts_fp8  # noqa: E402
from jaxserve.worker.cache_sizing import allocate_caches  # noqa: E402
from jaxserve.core.step_input import StepInput  # noqa: E402

BLOCK = 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ("deepseek_v3", "deepseek_v32", "deepseek_v4", "qwen3_5_moe", "minimax_m2")   # tests/golden/ckpt/


def layer_bytes(layers: list[dict], specs, hf: dict, batch: int, context: int) -> float:
    """HBM bytes a decode step must move for these layers (see the module docstring)."""
    x = hf.get("n_routed_experts") or hf.get("num_experts") or hf.get("num_local_experts") or 0
    k = hf.get("num_experts_per_tok") or 0
    total = 0.0
    for a in jax.tree.leaves(layers):
        routed = x and a.ndim == 3 and a.shape[0] == x
        total += a.nbytes * (roofline.expected_experts(batch, x, k) / x if routed else 1.0)
    for spec in specs:
        per = sum(int(np.prod(shape)) for _, shape in spec.arrays) * 2       # bf16 elements
        total += per * batch * (context + 1) if isinstance(spec, PagedSpec) else 2 * per * batch
    return total


def decode_input(batch: int, context: int, per_seq: int, with_state: bool, with_window: bool) -> StepInput:
    """B decode tokens, sequence s at position `context` over its own blocks (and state slot s + 1;
    a sliding-window group's table equal to the full one: every window block still held)."""
    tables = (1 + np.arange(batch * per_seq, dtype=np.int32)).reshape(batch, per_seq)
    pos = np.full(batch, context, np.int32)
    slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
    a = jnp.asarray
    return StepInput(token_ids=a(np.arange(batch, dtype=np.int32) + 7), positions=a(pos),
                     slot_mapping=a(slots.astype(np.int32)), token_seq_ids=a(np.arange(batch, dtype=np.int32)),
                     query_start_loc=a(np.arange(batch + 1, dtype=np.int32)),
                     seq_lens=a(np.full(batch, context + 1, np.int32)), block_tables=a(tables),
                     logits_indices=a(np.arange(batch, dtype=np.int32)), sampling=None,
                     state_slots=a(np.arange(1, batch + 1, dtype=np.int32)) if with_state else None,
                     window_block_tables=a(tables) if with_window else None)


def step_program(model, cfg, batch: int, context: int, impl: str,
                 kernel_plan: KernelPlan = KernelPlan()):
    """(one decode step fn(params, caches) -> (caches, scalar), its caches, the cache specs)."""
    per_seq = -(-(context + 1) // BLOCK)
    specs = model.cache_specs(cfg)
    with_state = any(not isinstance(s, PagedSpec) for s in specs)
    with_window = any(isinstance(s, PagedSpec) and s.window_arrays for s in specs)
    caches = allocate_caches(specs, batch * per_seq + 1, batch + 1, BLOCK, jnp.bfloat16,
                             num_window_blocks=batch * per_seq + 1 if with_window else 0)
    backend = AttentionBackend(cfg, impl, context=per_seq * BLOCK, itemsize=2)
    plan = backend.plan(batch, batch, batch, np.full(batch, context + 1))
    kernels = model.make_kernels(cfg, backend, plan, kernel_plan)
    x = decode_input(batch, context, per_seq, with_state, with_window)

    def step(p, kv):
        kv, hidden, _ = model.forward(cfg, p, kv, x, kernels)
        return kv, model.compute_logits(cfg, p, hidden)[0, 0]
    return step, caches, specs


def launches(step, params, caches) -> int:
    """Fusions and custom calls in the compiled step's entry computation."""
    text = jax.jit(step).lower(params, caches).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    return len(re.findall(r"= [^=]*? (?:fusion|custom-call)\(", entry))


def kernel_table(step, params, caches, trace_dir: str, reps: int = 5) -> None:
    """Print the device kernels of `reps` runs of the step, by name (the 40 longest): launches a
    run, mean us, us a run (from a jax.profiler trace: what each kernel of a layer costs)."""
    from jaxserve.bench import profile
    mark = "reduced_depth_step"
    f = jax.jit(step, donate_argnums=(1,))
    for _ in range(3):
        caches, s = f(params, caches)
    s.block_until_ready()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(reps):
            with jax.profiler.TraceAnnotation(mark):
                caches, s = f(params, caches)
                s.block_until_ready()
    summary = profile.summarize_events(profile.load_trace_events(trace_dir), mark)
    print(f"#   launches a run x mean us = us a run  kernel ({summary['windows']} runs)")
    for name, ms in summary.get("top_kernels_ms", {}).items():
        count = summary["top_kernels_launches"][name]
        print(f"#   {count:5.1f} x {1e3 * ms / count:7.2f} = {1e3 * ms:8.1f}  {name}")


def with_layers(cfg, n: int):
    """cfg cut to its first n layers (a hybrid's layer types too)."""
    if hasattr(cfg, "layer_types"):
        return dataclasses.replace(cfg, num_layers=n, layer_types=tuple(cfg.layer_types[:n]))
    return dataclasses.replace(cfg, num_layers=n)


def measure(model, cfg, params, layer_bytes_of: dict, batches, context: int, impl: str, label: str,
            kernel_plan: KernelPlan = KernelPlan(), depth: int = 4,
            kernels_dir: str | None = None):
    reps = 3 if jax.default_backend() == "cpu" else 20
    for b in batches:
        times, counts = {}, {}
        for n in (depth, 2):
            c = with_layers(cfg, n)
            p = dict(params, layers=params["layers"][:n])
            step, caches, _ = step_program(model, c, b, context, impl, kernel_plan)
            counts[n] = launches(step, p, caches)
            if kernels_dir and n == depth:
                kernel_table(step, p, caches, os.path.join(kernels_dir, f"b{b}"))
                caches = step_program(model, c, b, context, impl, kernel_plan)[1]   # (donated above)

            def run(p, kv, step=step):
                """`reps` steps over the carried caches; only a scalar comes out, so the
                parameters are read in place (a returned copy would add their bytes a call)."""
                def body(_, carry):
                    kv, acc = carry
                    kv, s = step(p, kv)
                    return kv, acc + s
                return jax.lax.fori_loop(0, reps, body, (kv, jnp.float32(0)))[1]
            times[n] = kb.gpu_time_ms(jax.jit(run), p, caches, iters=5) / reps
        per_layer = (times[depth] - times[2]) / (depth - 2)
        byts = layer_bytes_of[b]
        kb.record("decode", f"{label} B={b} L={context} per layer", impl, per_layer, bytes_=byts,
                  note=f"step {depth}L {times[depth] * 1e3:.0f} us, 2L {times[2] * 1e3:.0f} us; "
                       f"roofline {byts / kb.HBM_BYTES_PER_S * 1e6:.0f} us/layer; "
                       f"kernels/layer {(counts[depth] - counts[2]) / (depth - 2):.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", default=["DeepSeek-V3-4L"],
                    help="jaxserve/models/configs names (or config.json paths) of 4 layers or more")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--impl", default="pallas", help="attention implementation")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any backend)")
    ap.add_argument("--fp8", action="store_true",
                    help="routed experts as block-scaled FP8 (as --quantization fp8 keeps an FP8 "
                         "checkpoint's; DeepSeek V3 / V3.2 only)")
    ap.add_argument("--fused", default="auto", help="fused kernels, as --fused-kernels: 'auto' (the "
                    "engine's choice on one GPU), 'none' or names (e.g. moe, or linear,moe: the "
                    "fused stack, its projections stored [out, in] as the runner stores them)")
    ap.add_argument("--depth", type=int, default=4, choices=(3, 4),
                    help="layers built and timed against 2 (3: layer 2 alone, less memory)")
    ap.add_argument("--kernels", default=None, metavar="DIR",
                    help="also print each kernel's device time in the deepest step, from a "
                         "jax.profiler trace written under DIR")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kb.COLD = False
    sources = [os.path.join(ROOT, "tests/golden/ckpt", n, "config.json") for n in SMOKE] \
        if args.smoke else args.config
    for source in sources:
        hf = dummy.read_config(source)
        hf = dict(hf, num_hidden_layers=max(4, hf.get("num_hidden_layers", 0)))
        if "layer_types" in hf:       # hybrid: repeat the pattern up to 4 layers
            hf["layer_types"] = (hf["layer_types"] * 4)[:hf["num_hidden_layers"]]
        cfg = loader.model_config_from_hf(hf)
        model = registry.get_family(cfg.architecture)
        if args.fp8 and not model.keeps_fp8_experts:
            continue
        params = loader.dummy_params(with_layers(cfg, args.depth), "bfloat16")
        if args.fp8:
            params = quantize_experts_fp8(params)
        kernel_plan = KernelPlan.resolve(args.fused, cfg, model.name, 1)
        label = ((os.path.basename(os.path.dirname(source)) if args.smoke else source)
                 + (" fp8" if args.fp8 else "") + "".join(f" +{name}" for name in sorted(kernel_plan.fused)))
        batches, context = ((1, 4), 32) if args.smoke else (args.batch, args.context)
        specs = model.cache_specs(cfg)[2:args.depth]
        per_layer_bytes = {b: layer_bytes(params["layers"][2:args.depth], specs, hf, b, context)
                           / (args.depth - 2) for b in batches}
        # The weights as the engine's runner holds them (runner.ModelRunner, unsharded): fused
        # projections, and expert arrays past the grouped-matmul kernel's reach in chunks.
        params = model.prepare_weights(cfg, params, kernel_plan=kernel_plan, mesh=None, backend="pallas")
        measure(model, cfg, params, per_layer_bytes, batches, context,
                "xla" if args.smoke else args.impl, label, kernel_plan, args.depth, args.kernels)
        del params
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": sources, "context": args.context, "rows": kb.ROWS}, f, indent=1)


if __name__ == "__main__":
    main()
