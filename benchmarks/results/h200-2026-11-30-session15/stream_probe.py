"""Session 15's probe of how fast one program an SM streams a decode's paged K/V, and what in a
key step holds it back (H200; not engine code):

    python3 benchmarks/results/h200-2026-11-30-session15/stream_probe.py [--cpu-check]

A stand-alone Triton kernel (pallas_call), one program per (kv head, sequence) of a full decode
batch, each walking its context as the committed decode kernel does (slots through the block
table, the same [NB*P, K*E] view of the cache), with the body of a key step cut down:

  attn   the online softmax of the committed kernel, unmasked (every key visible)
  dots   q k^T and p v alone: the two matmuls without the softmax's reductions and exp2
  loads  the K and V tiles summed into a register tile: the loads and nothing else
  kload  the K tile alone (half the bytes): is the rate per byte or per step?

beside the committed kernel, cuDNN on the same K/V gathered dense, and XLA reading that dense
K/V once (a column sum: the rate a plain read stream gets). The probe walks whole key steps
unmasked: every context must be a multiple of block_k (else it reads past the block table; an
illegal address on the GPU). Times are CUPTI, inputs out of L2,
as benchmarks/kernels.py takes them. --cpu-check runs attn in interpret mode against the XLA
reference on a small case and exits."""
import functools, os, sys
_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_here, "..", "h200-2026-11-30-session13"))
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxserve.pallas_kernels import ragged_paged_attention as rpa
from jaxserve.pallas_kernels.dispatch import whole

LOG2E = 1.4426950408889634


def _probe_kernel(bt_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, *, mode, block_k, block_size,
                  blocks_per_seq, kv_heads, head_dim, g, rows, sm_scale, interpret):
    h, s = pl.program_id(0), pl.program_id(1)
    n = kv_heads * g
    r = jnp.arange(rows, dtype=jnp.int32)
    real = r < g
    head_R = h * g + jnp.minimum(r, g - 1)
    e_1E = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    q = plgpu.load(q_ref.at[jnp.full((rows, 1), s, jnp.int32), head_R[:, None], e_1E])
    cols = h * head_dim + e_1E
    steps = pl.cdiv(lens_ref[s], block_k)

    def exp2(x):
        if interpret:
            return jnp.exp2(x)
        return plgpu.elementwise_inline_asm(
            "ex2.approx.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]

    def kv(step):
        kpos = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        page = plgpu.load(bt_ref.at[s * blocks_per_seq + kpos // block_size])
        slot = page * block_size + kpos % block_size
        return plgpu.load(k_ref.at[slot[:, None], cols]), slot

    def body(step, carry):
        k, slot = kv(step)
        if mode == "kload":
            return carry + k
        v = plgpu.load(v_ref.at[slot[:, None], cols])
        if mode == "loads":
            return carry + k + v
        if mode == "dots":
            sc = plgpu.dot(q, k, trans_b=True)
            return carry + plgpu.dot(sc.astype(v.dtype), v).astype(jnp.float32)
        acc, m, l = carry
        sc = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * (sm_scale * LOG2E)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = exp2(sc - m_new[:, None])
        corr = exp2(m - m_new)
        acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, m_new, l * corr + p.sum(axis=1)

    if mode in ("loads", "kload"):
        tile = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_k, head_dim), k_ref.dtype))
        # every key's column sum on each row (keeps every load live; once per program)
        o = jnp.zeros((rows, head_dim), jnp.float32) + jnp.sum(tile.astype(jnp.float32),
                                                               axis=0)[None, :]
    elif mode == "dots":
        o = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, head_dim), jnp.float32))
    else:
        acc, m, l = jax.lax.fori_loop(0, steps, body, (
            jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32)))
        o = acc / l[:, None]
    # rows past the group index past the tokens (interpret mode would write stale values back
    # over a real row they aliased, as in the committed kernel)
    tok_R = jnp.where(real, s, pl.num_programs(1) + r)
    plgpu.store(o_ref.at[tok_R[:, None], head_R[:, None], e_1E],
                o.astype(o_ref.dtype), mask=real[:, None])


def probe(q, k_cache, v_cache, seq_lens, bt, *, mode="attn", block_k=128, num_stages=5,
          num_warps=4, interpret=False):
    t, n, e = q.shape
    nb, p, kh, _ = k_cache.shape
    s, b = bt.shape
    g = n // kh
    rows = max(16, pl.next_power_of_2(g))
    kern = functools.partial(_probe_kernel, mode=mode, block_k=block_k, block_size=p,
                             blocks_per_seq=b, kv_heads=kh, head_dim=e, g=g, rows=rows,
                             sm_scale=e ** -0.5, interpret=interpret)
    return pl.pallas_call(
        kern, grid=(kh, s),
        in_specs=[whole(s * b), whole(s), whole(t, n, e), whole(nb * p, kh * e),
                  whole(nb * p, kh * e)],
        out_specs=whole(t, n, e), out_shape=jax.ShapeDtypeStruct((t, n, e), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"ragged_probe_{mode}",
    )(bt.reshape(s * b), seq_lens, q, k_cache.reshape(nb * p, kh * e),
      v_cache.reshape(nb * p, kh * e))


def cpu_check(kb):
    rng = np.random.default_rng(0)
    kb.use_model("llama3-8b")
    c = kb.paged_case(rng, [1] * 3, [256] * 3)
    args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
    ref = rpa.xla_ragged_paged_attention(*args, sm_scale=kb.E ** -0.5)
    out = probe(c["q"], c["k"], c["v"], c["seq_lens"], c["bt"], block_k=64, interpret=True)
    err = kb.rel_err(out, ref)
    print(f"attn probe vs XLA reference: rel err {err:.1e}")
    assert err < 1e-2, err
    for mode in ("dots", "loads", "kload"):
        probe(c["q"], c["k"], c["v"], c["seq_lens"], c["bt"], mode=mode, block_k=64,
              interpret=True).block_until_ready()
    print("all modes run in interpret mode")


def main():
    import sweeps as s13
    kb = s13.kb
    if "--cpu-check" in sys.argv:
        return cpu_check(kb)
    rng = np.random.default_rng(0)
    for model, s, ctx in (("llama3-8b", 16, 1024), ("qwen3-30b-a3b", 24, 1024),
                          ("qwen3-30b-a3b", 32, 1024), ("llama3-8b", 32, 1024)):
        kb.use_model(model)
        c = kb.paged_case(rng, [1] * s, [ctx] * s)
        args = (c["q"], c["k"], c["v"], c["seq_lens"], c["bt"])
        byts = 2 * s * ctx * kb.KH * kb.E * 2
        name = f"{model} {s}x{ctx}"
        ref = rpa.xla_ragged_paged_attention(c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"],
                                             c["bt"], sm_scale=kb.E ** -0.5)

        def show(label, fn, a, check=False):
            try:
                err = f"  err={kb.rel_err(fn(*a), ref):.1e}" if check else ""
                b = s13.breakdown(fn, a, byts)
                tot = sum(b.values())
                print(f"{name:26s} {label:28s} {tot:8.2f} us  {byts / tot / 1e6:6.2f} TB/s"
                      + "  " + " ".join(f"{k}={v:.2f}" for k, v in sorted(b.items())) + err,
                      flush=True)
            except Exception as ex:  # noqa: BLE001
                print(f"# {name} {label}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)

        committed = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=kb.E ** -0.5,
                                              impl="pallas"))
        kargs = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        k_d, v_d = kb.dense_kv(c)
        q4 = c["q"].reshape(s, 1, kb.N, kb.E)
        cud = jax.jit(lambda q4, k_d, v_d: jax.nn.dot_product_attention(
            q4, k_d, v_d, scale=kb.E ** -0.5, implementation="cudnn"))
        colsum = jax.jit(lambda k_d, v_d: (k_d.astype(jnp.float32).sum(axis=1)
                                           + v_d.astype(jnp.float32).sum(axis=1)))
        for rep in range(2):
            show("committed", committed, kargs, check=rep == 0)
            show("cudnn", cud, (q4, k_d, v_d))
            show("xla colsum (read only)", colsum, (k_d, v_d))
            for mode in ("attn", "dots", "loads", "kload"):
                for bk, st, w in ((128, 5, 4), (64, 8, 4), (128, 3, 4), (128, 5, 8)):
                    if rep and (bk, st, w) != (128, 5, 4):
                        continue
                    show(f"{mode} bk{bk} s{st} w{w}",
                         jax.jit(functools.partial(probe, mode=mode, block_k=bk,
                                                   num_stages=st, num_warps=w)),
                         args, check=mode == "attn" and rep == 0)


if __name__ == "__main__":
    main()
