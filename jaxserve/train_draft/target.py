"""The target's side of training: one forward over a padded batch gives the residual
streams after the head's aux layers (its input) and the target's next-token logits over the
draft vocabulary (its teacher), computed on the device and handed straight to the trainer.

The batch runs through the family's own `forward` as one prefill step of B sequences of T
tokens each, on a scratch paged cache made inside the program (row b on blocks
1 + b*T/P ..): the same code, with the same aux-layer convention, as the engine's steps
(runner._step). Padding at the end of a row is computed like any token; causal attention
keeps it out of the real positions, and the loss masks its outputs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.core.step_input import StepInput

BLOCK_SIZE = 16         # the scratch cache's block size (T is a multiple: data.bucket_len)


def prefill_input(batch: int, length: int) -> StepInput:
    """StepInput of `batch` sequences of `length` tokens (token ids filled in later)."""
    if length % BLOCK_SIZE:
        raise ValueError(f"the padded length must be a multiple of {BLOCK_SIZE}; got {length}")
    per_seq = length // BLOCK_SIZE
    tables = 1 + np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    pos = np.tile(np.arange(length, dtype=np.int32), batch)
    seq = np.repeat(np.arange(batch, dtype=np.int32), length)
    slots = tables[seq, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    return StepInput(
        token_ids=jnp.zeros(batch * length, jnp.int32), positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(slots), token_seq_ids=jnp.asarray(seq),
        query_start_loc=jnp.asarray(np.arange(batch + 1, dtype=np.int32) * length),
        seq_lens=jnp.full(batch, length, jnp.int32), block_tables=jnp.asarray(tables),
        logits_indices=jnp.asarray(np.arange(1, batch + 1, dtype=np.int32) * length - 1),
        sampling=None, state_slots=jnp.arange(1, batch + 1, dtype=jnp.int32))


def _scratch_caches(specs, num_blocks: int, num_slots: int, dtype):
    caches = []
    for spec in specs:
        paged = isinstance(spec, PagedSpec)     # else a StateSpec, whose float32 names stay f32
        f32 = () if paged else spec.float32
        caches.append({name: jnp.zeros(((num_blocks, spec.rows(name, BLOCK_SIZE)) if paged else (num_slots,))
                                       + tuple(shape), jnp.float32 if name in f32 else dtype)
                       for name, shape in spec.arrays})
    return caches


def _target_step(params, token_ids_BT, draft_ids_V, *, module, cfg, aux_layers, impl):
    b, t = token_ids_BT.shape
    x = prefill_input(b, t)
    x = dataclasses.replace(x, token_ids=token_ids_BT.reshape(-1))
    dtype = params["embed"].dtype
    caches = _scratch_caches(module.cache_specs(cfg), b * t // BLOCK_SIZE + 1, b + 1, dtype)
    kernels = module.make_kernels(cfg, impl)
    _, hidden_TD, aux = module.forward(cfg, params, caches, x, kernels, aux_layers)
    # forward gives one stream per distinct layer, in layer order; the head's order may repeat one
    layer_ids = sorted(set(aux_layers))
    streams = jnp.concatenate([aux[layer_ids.index(i)] for i in aux_layers], -1)

    def row_logits(h_TD):          # one row at a time: never the whole [B*T, V] in f32
        full = module.compute_logits(cfg, params, h_TD)
        return full[:, draft_ids_V].astype(dtype), jnp.argmax(full, -1).astype(jnp.int32)

    logits, top1 = jax.lax.map(row_logits, hidden_TD.reshape(b, t, -1))
    in_draft = jnp.zeros(cfg.vocab_size, bool).at[draft_ids_V].set(True)[top1]
    return streams.reshape(b, t, -1), logits, top1, in_draft


def make_target_fn(module, cfg, aux_layers: tuple[int, ...], impl: str = "xla"):
    """jit(params, token_ids i32[B, T], draft ids i32[Dv]) -> (aux streams f[B, T, 3D], the
    target's logits over the draft vocabulary f[B, T, Dv], its top-1 target id i32[B, T],
    whether that top-1 is in the draft vocabulary bool[B, T])."""
    return jax.jit(functools.partial(_target_step, module=module, cfg=cfg,
                                     aux_layers=tuple(aux_layers), impl=impl))
