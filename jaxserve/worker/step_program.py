"""The traced step program: one padded StepInput in, the sampled tokens (and what a variant
adds) out, with the caches donated. `make_step` jits it once per runner; each (input layout,
StepVariant) is its own compiled program (worker/compiling.py), chosen by the runner.

Legend: T tokens, S sequences, B blocks per sequence, P tokens per block, V vocabulary,
N logprobs returned per sequence, M max_num_seqs, C columns of the last ids (1 + drafts left
on the device by a proposer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.core.step_input import StepInput
from jaxserve.models.attention import AttentionBackend, AttentionPlan
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.sample import rejection_sampler, sampler
from jaxserve.worker import packing
from jaxserve.worker.state_copies import copy_slots


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """What a step computes besides the next tokens; each variant is its own compiled program.

    `lean` (no logprobs, no penalties/bias/masks, no top-k/top-p/min-p sort) is the common
    case; `full` adds all of that. Warm-up compiles both for every bucket, and with a
    tokenizer a third, lean but with the allowed-token mask (its input layout differs), for
    steps whose only extra is a grammar's mask (jaxserve/structured/). Prompt logprobs
    (logits at every position) are rare and compile on first use.
    """
    num_top: int = 0                # logprobs returned per sequence (0 or max_logprobs)
    full: bool = False              # penalties, logit_bias, masks and truncation in the program
    prompt_logprobs: bool = False   # also log-softmax every position's logits
    attention: AttentionPlan = AttentionPlan()   # the attention backend's plan (opaque here)
    hidden: bool = False            # also return hidden states (a proposer's input): the final
                                    # ones, or those after `aux_layers`, concatenated
    aux_layers: tuple[int, ...] = ()
    steps: int = 1                  # multi-step decode: decode steps in one program (_decode_steps)
    logits_only: bool = False       # stop at the f32 logits: a masked step's forward, whose
                                    # sampling runs as a second program (late_sampling.py)


# A bucket of one token for batch-1 decode (one user, a notebook): padded to 16 tokens it ran
# 16 query rows through attention and the sampler (NOTE: measured on the H200, BENCHMARKS.md).
SINGLE_TOKEN_BUCKET = True


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Step sizes that get a compiled program: 1, then powers of two from `smallest`, then
    max_tokens (the step budget)."""
    buckets, b = [1] if SINGLE_TOKEN_BUCKET and max_tokens > 1 else [], smallest
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_tokens]


def matmul_precision(dtype) -> str | None:
    """XLA's matmul precision for an engine computing in `dtype`: "highest" for float32, else
    JAX's default. A GPU's default f32 matmul is TF32 (10 mantissa bits), which is not what a
    user asking for float32 gets from vLLM (torch keeps f32 matmuls in f32 by default) nor
    what transformers computes: it flipped greedy near-ties (issue 70). Traced inside the
    step, it also reaches the Triton kernels' dots that name no precision (attention, MLA)."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def make_step(*, mesh, model, cfg, backend: AttentionBackend, kernel_plan: KernelPlan,
              block_size: int, precision: str | None = None, state_layers: tuple[int, ...] = ()):
    """The step, jitted: (params, caches, packed input, last ids; variant, layout) ->
    (caches, sampler output, prompt logprobs or None, last ids, hidden or None); the caches
    are donated. `variant` and `layout` are static: one program per pair. `precision`: XLA's
    matmul precision inside the step (matmul_precision; None: JAX's configured one).
    `state_layers`: the layers whose caches are states (a multi-step loop saves them)."""
    return jax.jit(functools.partial(_step_on_mesh, mesh=mesh, precision=precision, model=model, cfg=cfg,
                                     backend=backend, state_layers=state_layers,
                                     kernel_plan=kernel_plan, block_size=block_size),
                   donate_argnums=(1,), static_argnames=("variant", "layout"))


def _step_on_mesh(*args, mesh, precision, **kwargs):
    """_step traced with `mesh` as the ambient (abstract) mesh, so kernel call sites can wrap
    their kernels per shard (sharding/kernels.py), and at `precision`. Set here, inside the
    traced function, not around the runner's calls: warm-up lowers on threads, and these
    contexts are per thread."""
    with contextlib.ExitStack() as stack:
        if precision is not None:
            stack.enter_context(jax.default_matmul_precision(precision))
        if mesh is not None:
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        return _step(*args, **kwargs)


def step_input(packed_W, prev_ids_MC, layout: packing.Layout) -> StepInput:
    """Inside jit: the step's input unpacked, its tokens (and drafts) from the last ids."""
    x: StepInput = packing.unpack(packed_W, layout)
    # Tokens sampled by the previous step come straight from its device output: the host
    # need not have read them (DESIGN.md §2: step N+1 never waits for step N's tokens). So
    # do the drafts a proposer made on the device after it (prev_ids_MC's other columns).
    from_prev_T = x.prev_token_rows >= 0
    token_ids_T = jnp.where(from_prev_T, prev_ids_MC.reshape(-1)[jnp.maximum(x.prev_token_rows, 0)],
                            x.token_ids)
    x = dataclasses.replace(x, token_ids=token_ids_T)
    if x.draft_rows is not None:   # each draft row verifies the token after its position
        last = token_ids_T.shape[0] - 1
        x = dataclasses.replace(x, draft_token_ids=jnp.where(
            x.draft_token_ids >= 0, token_ids_T[jnp.minimum(x.logits_indices + 1, last)], -1))
    return x


def _step(params, caches, packed_W, prev_ids_MC, *, model, cfg, backend: AttentionBackend,
          kernel_plan: KernelPlan, block_size: int, variant: StepVariant, layout: packing.Layout,
          state_layers: tuple[int, ...] = ()):
    x = step_input(packed_W, prev_ids_MC, layout)
    kernels = model.make_kernels(cfg, backend, variant.attention, kernel_plan)
    if variant.steps > 1:
        caches, out, last_ids_S = _decode_steps(params, caches, x, model=model, cfg=cfg,
                                                kernels=kernels, kernel_plan=kernel_plan,
                                                backend=backend, state_layers=state_layers,
                                                variant=variant, block_size=block_size)
        ids_MC = jnp.zeros_like(prev_ids_MC).at[:last_ids_S.shape[0], 0].set(last_ids_S)
        return caches, out, None, ids_MC, None
    if variant.aux_layers:
        caches, hidden_TD, aux = model.forward(cfg, params, caches, x, kernels, variant.aux_layers)
    else:
        caches, hidden_TD, aux = model.forward(cfg, params, caches, x, kernels)
    logits_SV = model.compute_logits(cfg, params, hidden_TD[x.logits_indices], kernels)
    if variant.logits_only:     # the last ids stay the step before's until the sampling runs
        return caches, logits_SV.astype(jnp.float32), None, None, None
    out, last_ids_S = _sample(logits_SV, x, variant, backend, kernel_plan)
    prompt = None
    if variant.prompt_logprobs:
        prompt = sampler.prompt_logprobs(model.compute_logits(cfg, params, hidden_TD, kernels),
                                         x.next_token_ids, variant.num_top)
    ids_MC = jnp.zeros_like(prev_ids_MC).at[:last_ids_S.shape[0], 0].set(last_ids_S)
    if not variant.hidden:
        return caches, out, prompt, ids_MC, None
    if aux:
        # forward gives one stream per layer, in layer order; the proposer's order may repeat one
        layer_ids = sorted(set(variant.aux_layers))
        hidden_TD = jnp.concatenate([aux[layer_ids.index(i)] for i in variant.aux_layers], -1)
    return caches, out, prompt, ids_MC, (hidden_TD, *_after_step(x, out))


def _decode_steps(params, caches, x: StepInput, *, model, cfg, kernels, kernel_plan, backend,
                  variant, block_size: int, state_layers: tuple[int, ...] = ()):
    """Multi-step decode (scheduler.py): `variant.steps` one-token-per-sequence decode steps
    in one program, each feeding its sampled ids to the next. Returns (caches, the sampler's
    output of every step, stacked: token_ids i32[steps, S], the logprobs fields too when the
    variant returns them, each sequence's last id).

    Step i's input is the first step's shifted by i positions: its K/V slot is read off the
    block table, and nothing is written past the table's blocks (a request nearing its
    longest length was given blocks up to it only; its tokens past that are never read).
    A sequence with a state_save_slots entry has its state copied there after its step
    ending on the last block boundary the loop crosses (the scheduler's plan_loop_save)."""
    num_tokens, p = x.num_tokens, block_size
    width = x.block_tables.shape[1]
    real_T = jnp.arange(num_tokens) < x.query_start_loc[-1]
    live_S = x.seq_lens > 0

    def one(i, caches, token_ids_T):
        positions_T = x.positions + i
        block_T = positions_T // p
        slots_T = x.block_tables[x.token_seq_ids, jnp.minimum(block_T, width - 1)] * p + positions_T % p
        xi = dataclasses.replace(
            x, token_ids=token_ids_T, positions=positions_T,
            slot_mapping=jnp.where(real_T & (block_T < width), slots_T, 0),
            seq_lens=jnp.where(live_S, jnp.minimum(x.seq_lens + i, width * p), 0),
            sampling=dataclasses.replace(x.sampling, offsets=x.sampling.offsets + i))
        caches, hidden_TD, _ = model.forward(cfg, params, caches, xi, kernels)
        if x.state_save_slots is not None:
            last_S = (x.seq_lens + variant.steps - 1) // p * p
            now_S = (x.state_save_slots > 0) & (x.seq_lens + i == last_S)
            caches = _copy_states(caches, state_layers, x.state_slots,
                                  jnp.where(now_S, x.state_save_slots, x.state_slots))
        logits_SV = model.compute_logits(cfg, params, hidden_TD[xi.logits_indices], kernels)
        out = _sample(logits_SV, xi, variant, backend, kernel_plan)[0]
        ids_S = out.token_ids.astype(jnp.int32)
        # a lean step keeps its ids alone (its logprobs would be computed for nothing)
        if not variant.num_top:
            return caches, sampler.SamplerOutput(ids_S, None, None, None, None)
        return caches, dataclasses.replace(out, token_ids=ids_S)

    def body(i, carry):
        caches, acc = carry
        # each sequence holds one token of a decode step: after the first, its last sampled id
        token_ids_T = jnp.where(i == 0, x.token_ids,
                                acc.token_ids[jnp.maximum(i - 1, 0)][x.token_seq_ids])
        caches, out = one(i, caches, token_ids_T)
        return caches, jax.tree.map(lambda a, v: a.at[i].set(v), acc, out)

    k, s, n = variant.steps, x.num_seqs, variant.num_top
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros((k,) + shape, dtype)  # noqa: E731
    acc = sampler.SamplerOutput(zeros(s, dtype=jnp.int32), *(
        (zeros(s), zeros(s, dtype=jnp.int32), zeros(s, n, dtype=jnp.int32), zeros(s, n))
        if n else (None,) * 4))
    caches, acc = jax.lax.fori_loop(0, k, body, (caches, acc))
    return caches, acc, acc.token_ids[-1]


def make_sampling(*, backend: AttentionBackend, kernel_plan: KernelPlan):
    """The sampling of a step whose forward ran as a `logits_only` program, jitted:
    (f32 logits, packed input, last ids; variant, layout) -> (sampler output, last ids). The
    last ids are the ones the forward read (its drafts' tokens come from them)."""
    return jax.jit(functools.partial(_sample_logits, backend=backend, kernel_plan=kernel_plan),
                   static_argnames=("variant", "layout"))


def _sample_logits(logits_RV, packed_W, prev_ids_MC, *, backend, kernel_plan, variant, layout):
    x = step_input(packed_W, prev_ids_MC, layout)
    out, last_ids_S = _sample(logits_RV, x, variant, backend, kernel_plan)
    return out, jnp.zeros_like(prev_ids_MC).at[:last_ids_S.shape[0], 0].set(last_ids_S)


def _copy_states(caches, state_layers: tuple[int, ...], src_S, dst_S):
    """`caches` with the state layers' rows dst_S[s] set to rows src_S[s] (a sequence that
    saves nothing now copies its slot onto itself: no branch, which a GPU would read back)."""
    states = copy_slots([caches[i] for i in state_layers], src_S, dst_S)
    out = list(caches)
    for i, layer in zip(state_layers, states):
        out[i] = layer
    return type(caches)(out)


def _after_step(x: StepInput, out):
    """(next_ids i32[T], kept_rows i32[S]): what a proposer running after the step on its
    hidden states reads besides them (spec_decode/hidden_steps.py). next_ids: the token after
    each position as the step knows it, the next input token or, at a logits row, the token
    the step emitted there (after a chunk's last input, what it sampled; after a draft, the
    target's own choice). kept_rows: each sequence's last position whose input it keeps (its
    last accepted draft, else its last token): the proposer's pass there drafts its next token."""
    t, s = x.num_tokens, x.num_seqs
    next_T = jnp.concatenate([x.token_ids[1:], jnp.zeros(1, jnp.int32)])
    real_R = x.query_start_loc[1:] > x.query_start_loc[:-1]
    if x.draft_rows is None:
        emitted_R, kept_S = out.token_ids, x.logits_indices
    else:
        emitted_R = out.rows.token_ids
        real_R = jnp.concatenate([real_R, x.draft_token_ids[s:] >= 0])
        kept_S = x.logits_indices[:s] - x.num_drafts + out.num_accepted
    rows_R = jnp.where(real_R, x.logits_indices, t)       # padding rows write nothing
    next_T = next_T.at[rows_R].set(emitted_R.astype(jnp.int32), mode="drop")
    return next_T, kept_S.astype(jnp.int32)


def _sample(logits_RV, x: StepInput, variant: StepVariant, backend: AttentionBackend,
            kernel_plan: KernelPlan):
    """(the step's sampler output, each sequence's last new token). A step that carries
    drafts (x.draft_rows: a static part of its layout, so a step without them compiles
    exactly as before) verifies them instead: rejection_sampler.verify."""
    kernels = backend.impl != "xla"
    if x.draft_rows is None:
        out = sampler.sample(logits_RV, x.sampling, variant.num_top, truncate=variant.full,
                             kernels=kernels, branch_on_greedy=kernel_plan.cheap_branches)
        return out, out.token_ids
    out = rejection_sampler.verify(logits_RV, x.sampling, x.draft_token_ids, x.draft_rows,
                                   x.num_drafts, variant.num_top, truncate=variant.full,
                                   kernels=kernels)
    return out, out.last_ids
