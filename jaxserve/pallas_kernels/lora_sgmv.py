"""Batched LoRA products for a step whose tokens use different adapters (vLLM's punica / SGMV
idea): each token t adds its adapter's low-rank update to a projection's output,

    delta_TN[t] = (x_TK[t] @ a_LKR[slot[t]]) @ b_LRN[slot[t]]      (0 where slot[t] == 0)

Layouts: x_TK f[T, K] (the projection's input), a_LKR f[L, K, R] and b_LRN f[L, R, N] (the
device slots of lora/weights.py; slot 0 is "no adapter", zeros), slots_T i32[T] -> f[T, N] in
x's dtype. Legend: T tokens, K input width, N output width, R slot rank (a multiple of 16:
the adapters' ranks zero-padded), L slots (max_loras + 1).

Why this design. A step mixes decode rows and prefill chunks of requests on a few adapters
(max_loras bounds them). Gathering a [K, R] matrix per token reads each adapter's weights
once per token; looping over slots (the reference) does L dense passes over all tokens.
Instead the tokens are sorted by slot, so each adapter's tokens are one consecutive group,
and the update runs as two grouped matmuls over those groups, "shrink" x @ a -> [T, R] then
"expand" h @ b -> [T, N], each reading an adapter's matrices once for all its tokens, the
intermediate staying R wide. The base model's tokens (slot 0) sort last, past every group:
the grouped kernel writes zeros there and reads no weights for them, so a step where few
tokens carry adapters pays only for those. The grouped kernel is grouped_matmul.py's
"pallas" program (row tiles of 16 per group, a tile list sized for the worst case: fixed
shapes, so adapters coming and going never recompile); the sort, counts and unsort are a few
small XLA ops on [T] ids and the [T, N] result.

Implementations: "pallas" (the above; interpret mode on CPU), "dense" (two XLA dot products
over every slot at once: x @ [all slots' a] -> [T, L, R], each token's own slot kept, then
[T, L*R] @ [all slots' b]), "xla" (the reference: a masked dense pass per slot, in f32),
"auto" = on a GPU "dense" up to DENSE_MAX_SLOTS slots, else "pallas"; on CPU "xla". Why
"dense" for few slots: a decode step applies the update to every projection of every layer
(4 x 32 on the 8B shape), and the grouped path's sort, gathers and two grouped kernels are
about eight launches each time, which bound the step (H200, BENCHMARKS.md: 1.59x the base
step at batch 16 with 4 adapters); the dense path is two dot products, reading every slot's
matrices (a few hundred KB a projection) whether a token uses them or not, which costs more
than the grouped kernel's reads only when many slots are resident. The grouped kernel tiles
K and N by 16: a projection whose width is not a multiple of 16 takes "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.dispatch import resolve_impl
from jaxserve.pallas_kernels.grouped_matmul import grouped_matmul


DENSE_MAX_SLOTS = 9      # slots (max_loras + 1) up to which "auto" takes "dense" on a GPU


def ref_lora_delta(x_TK, a_LKR, b_LRN, slots_T):
    """Plain jnp: for every adapter slot, its tokens' update (others masked), summed; f32."""
    x = x_TK.astype(jnp.float32)
    out = jnp.zeros((x_TK.shape[0], b_LRN.shape[2]), jnp.float32)
    for slot in range(1, a_LKR.shape[0]):
        y = (x @ a_LKR[slot].astype(jnp.float32)) @ b_LRN[slot].astype(jnp.float32)
        out = out + jnp.where((slots_T == slot)[:, None], y, 0.0)
    return out.astype(x_TK.dtype)


def _validate(x_TK, a_LKR, b_LRN, slots_T):
    t, k = x_TK.shape
    if a_LKR.ndim != 3 or b_LRN.ndim != 3 or a_LKR.shape[1] != k or a_LKR.shape[0] != b_LRN.shape[0] \
            or a_LKR.shape[2] != b_LRN.shape[1]:
        raise ValueError(f"a_LKR must be [L, K={k}, R] and b_LRN [L, R, N] with the same L and R; "
                         f"got {a_LKR.shape} and {b_LRN.shape}")
    if slots_T.shape != (t,):
        raise ValueError(f"slots_T must be i32[T = {t}]; got {slots_T.shape}")


def _dense(x_TK, a_LKR, b_LRN, slots_T):
    num_slots = a_LKR.shape[0]
    h_TLR = jnp.einsum("tk,lkr->tlr", x_TK, a_LKR.astype(x_TK.dtype), preferred_element_type=jnp.float32)
    # each token keeps its own slot's R columns; slot 0 ("no adapter") keeps none
    own_TL = (slots_T[:, None] == jnp.arange(num_slots, dtype=slots_T.dtype)[None, :]) & (slots_T > 0)[:, None]
    h_TLR = jnp.where(own_TL[:, :, None], h_TLR, 0.0).astype(x_TK.dtype)
    return jnp.einsum("tlr,lrn->tn", h_TLR, b_LRN.astype(x_TK.dtype), preferred_element_type=jnp.float32)


def _sgmv(x_TK, a_LKR, b_LRN, slots_T, interpret):
    num_slots = a_LKR.shape[0]
    # slot 0 (no adapter) sorts last: past the groups, where the grouped kernel writes zeros
    key_T = jnp.where(slots_T > 0, slots_T, num_slots).astype(jnp.int32)
    order_T = jnp.argsort(key_T, stable=True)
    sizes_L = jnp.sum(key_T[None, :] == jnp.arange(num_slots, dtype=jnp.int32)[:, None], axis=1,
                      dtype=jnp.int32)          # sizes_L[0] == 0: slot 0's rows are past the groups
    x_sorted = x_TK[order_T]
    h_TR = grouped_matmul(x_sorted, a_LKR.astype(x_TK.dtype), sizes_L, impl="pallas", interpret=interpret)
    y_TN = grouped_matmul(h_TR, b_LRN.astype(x_TK.dtype), sizes_L, impl="pallas", interpret=interpret)
    # back to token order by a gather (the [T] inverse permutation is the only scatter)
    rank_T = jnp.zeros_like(order_T).at[order_T].set(jnp.arange(order_T.shape[0], dtype=order_T.dtype))
    return y_TN[rank_T]


@functools.partial(jax.jit, static_argnames=("impl", "interpret"))
def lora_delta(x_TK, a_LKR, b_LRN, slots_T, *, impl: str = "auto", interpret: bool | None = None):
    """Each token's adapter update f[T, N] (module doc); impl "auto" | "pallas" | "dense" | "xla"."""
    _validate(x_TK, a_LKR, b_LRN, slots_T)
    if impl == "dense" or (impl == "auto" and jax.default_backend() == "gpu"
                           and a_LKR.shape[0] <= DENSE_MAX_SLOTS):
        return _dense(x_TK, a_LKR, b_LRN, slots_T).astype(x_TK.dtype)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla" or x_TK.shape[1] % 16 or b_LRN.shape[2] % 16 or a_LKR.shape[2] % 16:
        return ref_lora_delta(x_TK, a_LKR, b_LRN, slots_T)
    return _sgmv(x_TK, a_LKR, b_LRN, slots_T, (not on_gpu) if interpret is None else interpret)
