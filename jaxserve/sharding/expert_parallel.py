"""The MoE layer under a mesh: experts split over `expert`, their F over `model`, one
`jax.shard_map` over both axes instead of leaving the layer to jit's partitioner.

Two forms of token dispatch and combine, both exact (no token is ever dropped):

- "psum" (what the engine runs): the tokens enter replicated, as our activations are between
  blocks. Every rank routes all T tokens (the router is replicated and tiny), keeps the
  (token, expert) rows routed to ITS X/EP experts, runs the grouped matmul on its local expert
  weights and F slice only (models/moe.expert_rows_sum), and the combine is one all-reduce over
  `expert` and `model` together of each rank's weighted partial output f32[T, D]: the w_down
  partial sums over F and the experts' contributions add up in the same reduction.
- "all_to_all": the textbook EP form (DeepEP, vLLM's all2all backends). Rank r takes token
  slice r of T/EP tokens, routes it, and sends each row to the rank owning its expert with
  `lax.all_to_all` in fixed buffers of capacity C = (T/EP) * k rows per destination (the worst
  case: every row to one rank, so nothing is dropped), plus each destination's per-expert row
  counts; the owner sorts what it received by local expert, runs its grouped matmul, sends the
  rows back the same way, the source combines its tokens' k rows, and an all-gather over
  `expert` (and a psum over `model` for the F split) rebuilds the replicated output.

Why the engine uses "psum" (bytes a rank moves per MoE layer, D model dim, k experts a token,
b bytes an activation element):
- psum: one ring all-reduce of f32[T, D] over n = EP*TP ranks, ~2 (n-1)/n * 4 T D bytes.
- all_to_all: dispatch and return each move EP * C = T k rows of D (the fixed capacity is
  what makes it exact), 2 T k D b bytes, plus the all-gather of the output ((EP-1)/EP T D b)
  and the model-axis psum. At k = 8 and bf16 (b = 2) that is 32 T D against the f32 psum's
  ~8 T D, ~4x; even a ragged all-to-all that sent only real rows would move ~T k D b (EP-1)/EP
  each way, still more. (The psum is in f32, as the one-device combine sums in f32.)
The all-to-all form wins only when activations are already split over the expert ranks
(data-parallel attention, vLLM's DP + EP): then it sends T_local k rows where the psum form
would first have to all-gather the tokens. Here attention is replicated over `expert`, so
"psum" is both simpler and cheaper; "all_to_all" is kept, tested against the dense
reference, for the DP-attention layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.pallas_kernels.grouped_matmul import BlockScaledFp8
from jaxserve.sharding.mesh import EXPERT_AXIS, MODEL_AXIS

DISPATCH = "psum"        # the engine's form (module doc); "all_to_all" for the DP layout
DISPATCH_FORMS = ("psum", "all_to_all")
ROUTER_KEYS = ("router", "router_bias")          # replicated: every rank scores every expert
EXPERT_KEYS = ("w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class ExpertMaths:
    """The one-device expert computation that each rank runs on its own experts (models/moe.py
    EXPERT_MATHS), passed in so that sharding imports no model code."""
    rows_sum: Callable     # (lp, h_TD, weights_Tk, experts_Tk, num_experts, impl, first_expert=0) -> f32[T, D]
    group_rows: Callable   # (experts_M, num_experts) -> (sorted pos i32[M], row of each i32[M], sizes i32[X])
    mlp: Callable          # (lp, x_sorted, group_sizes, impl) -> the rows through their expert's MLP


def _axis_sizes() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return {}
    return {name: mesh.shape[name] for name in (EXPERT_AXIS, MODEL_AXIS) if name in mesh.axis_names}


def splits_experts() -> bool:
    """Whether the ambient mesh (the runner traces its step under use_abstract_mesh) splits an
    MoE layer's experts or their F: an `expert` or `model` axis of size > 1."""
    return any(size > 1 for size in _axis_sizes().values())


def _expert_specs(lp: dict, names: dict) -> dict:
    """Each expert array's spec; a block-scaled FP8 one's values and scales split alike (its
    scale blocks are whole on every rank: fp8_split_problem)."""
    e, m = names.get(EXPERT_AXIS), names.get(MODEL_AXIS)
    specs = {"w_gate": P(e, None, m), "w_up": P(e, None, m), "w_down": P(e, m, None)}
    return {n: BlockScaledFp8(spec, spec, lp[n].block) if isinstance(lp[n], BlockScaledFp8) else spec
            for n, spec in specs.items()}


def fp8_split_problem(name: str, shape: tuple, spec, axis_sizes: dict, block: int) -> str | None:
    """Why a block-scaled FP8 array of `shape` ([X, in, out]) cannot be split by `spec` over
    axes of these sizes (None if it can): each rank's part of a split in / out dim must be
    whole B x B scale blocks, or its scales would not split with it."""
    for dim, axes in list(enumerate(spec))[1:]:
        n = 1
        for a in (axes if isinstance(axes, tuple) else (axes,) if axes else ()):
            n *= axis_sizes.get(a, 1)
        if n > 1 and shape[dim] % (n * block):
            return (f"{name}: its dim {shape[dim]} split {n} ways is not whole {block}-wide FP8 "
                    f"scale blocks; tensor_parallel_size must divide {shape[dim] // block}")
    return None


def check_fp8_placement(name: str, shape: tuple, sharding, block: int) -> None:
    """Raise fp8_split_problem's reason if a block-scaled FP8 array placed by `sharding` (a
    mesh's NamedSharding; any other placement keeps it whole) would split its scale blocks."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        why = fp8_split_problem(name, shape, sharding.spec, dict(sharding.mesh.shape), block)
        if why:
            raise ValueError(why)


def _check(lp: dict, num_experts: int, sizes: dict, dispatch: str):
    if dispatch not in DISPATCH_FORMS:
        raise ValueError(f"dispatch must be one of {DISPATCH_FORMS}; got {dispatch!r}")
    if "w_gate_up" in lp or any(isinstance(lp.get(n), (tuple, list)) for n in EXPERT_KEYS):
        # a column-split w_gate|w_up would mix gate and up columns; expert chunks
        # (moe.split_expert_weights) are for unsharded engines only
        raise ValueError("under a mesh the experts must be whole, unfused w_gate / w_up / w_down "
                         "arrays (no fuse_projections, no split_expert_weights)")
    ep, tp = sizes.get(EXPERT_AXIS, 1), sizes.get(MODEL_AXIS, 1)
    f = lp["w_down"].shape[1]
    if num_experts % ep or f % tp:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by expert_parallel_size "
                         f"({ep}) and the expert MLP dim ({f}) by tensor_parallel_size ({tp})")
    specs = _expert_specs(lp, {a: a for a in sizes})
    for name in EXPERT_KEYS:
        if isinstance(lp[name], BlockScaledFp8):
            why = fp8_split_problem(name, lp[name].shape, specs[name].values, sizes, lp[name].block)
            if why:
                raise ValueError(why)


def moe_on_mesh(route_fn, maths: ExpertMaths, lp: dict, h_TD: jax.Array, num_experts: int,
                impl: str, dispatch: str | None = None) -> jax.Array:
    """The routed experts' output [T, D] (h_TD's dtype, replicated) under the ambient mesh.

    route_fn(router_params, h) -> (weights f32[t, k], experts i32[t, k]) runs inside the
    shard_map on replicated router parameters (lp's ROUTER_KEYS), so a Pallas router kernel
    sees whole local arrays; `maths` computes each rank's experts. dispatch: "psum" |
    "all_to_all" (module doc; default DISPATCH)."""
    dispatch = DISPATCH if dispatch is None else dispatch
    sizes = _axis_sizes()
    _check(lp, num_experts, sizes, dispatch)
    names = {a: a for a in sizes}
    axes = tuple(sizes)
    router = {n: lp[n] for n in ROUTER_KEYS if n in lp}
    experts = {n: lp[n] for n in EXPERT_KEYS}
    local = num_experts // sizes.get(EXPERT_AXIS, 1)

    def psum_form(router, experts, h_TD):
        weights_Tk, experts_Tk = route_fn(router, h_TD)
        first = _expert_rank() * local
        partial = maths.rows_sum(experts, h_TD, weights_Tk, experts_Tk, num_experts, impl, first)
        return jax.lax.psum(partial, axes).astype(h_TD.dtype)

    def all_to_all_form(router, experts, h_TD):
        return _all_to_all(route_fn, maths, router, experts, h_TD, num_experts, local, impl, axes)

    body = psum_form if dispatch == "psum" else all_to_all_form
    in_specs = (jax.tree.map(lambda _: P(), router), _expert_specs(experts, names), P())
    # check_vma off: a Pallas kernel's output carries no varying-axes annotation to check
    return jax.shard_map(body, in_specs=in_specs, out_specs=P(), check_vma=False)(router, experts, h_TD)


def _expert_rank():
    sizes = _axis_sizes()
    return jax.lax.axis_index(EXPERT_AXIS) if sizes.get(EXPERT_AXIS, 1) > 1 else jnp.int32(0)


def _all_to_all(route_fn, maths, router, experts, h_TD, num_experts, local, impl, axes):
    """The all-to-all form, per rank (module doc)."""
    ep = num_experts // local
    t, d = h_TD.shape
    if ep == 1:     # nothing to dispatch: only the F split's psum
        weights_Tk, experts_Tk = route_fn(router, h_TD)
        partial = maths.rows_sum(experts, h_TD, weights_Tk, experts_Tk, num_experts, impl)
        return jax.lax.psum(partial, axes).astype(h_TD.dtype)
    t_l = -(-t // ep)                                   # tokens per rank (T padded to EP * t_l)
    h_pad = jnp.pad(h_TD, ((0, ep * t_l - t), (0, 0)))
    r = jax.lax.axis_index(EXPERT_AXIS)
    h_l = jax.lax.dynamic_slice_in_dim(h_pad, r * t_l, t_l)
    weights_lk, experts_lk = route_fn(router, h_l)
    k = experts_lk.shape[1]
    cap = t_l * k                                       # rows per destination: the worst case
    # my rows sorted by expert are consecutive per destination rank
    experts_m = experts_lk.reshape(-1)
    pos_m, row_of_m, sizes_x = maths.group_rows(experts_m, num_experts)
    counts_EL = sizes_x.reshape(ep, local)              # rows I send each rank, per its expert
    ends_E = jnp.cumsum(counts_EL.sum(axis=1))
    starts_E = ends_E - counts_EL.sum(axis=1)
    slot_C = jnp.arange(cap, dtype=jnp.int32)
    src_EC = jnp.minimum(starts_E[:, None] + slot_C[None, :], cap - 1)
    used_EC = slot_C[None, :] < counts_EL.sum(axis=1)[:, None]
    send_ECD = jnp.where(used_EC[:, :, None], h_l[row_of_m[src_EC] // k], 0).astype(h_TD.dtype)
    # to each rank its buffer and its experts' counts; from each rank theirs
    recv_ECD = jax.lax.all_to_all(send_ECD, EXPERT_AXIS, 0, 0)
    recv_counts_EL = jax.lax.all_to_all(counts_EL, EXPERT_AXIS, 0, 0)
    # each received row's local expert (rows from one source arrive sorted by expert); local
    # means a padding slot
    ends_EL = jnp.cumsum(recv_counts_EL, axis=1)
    expert_EC = jnp.sum(ends_EL[:, None, :] <= slot_C[None, :, None], axis=2, dtype=jnp.int32)
    y_ECD = _local_experts(maths, experts, recv_ECD.reshape(ep * cap, d), expert_EC.reshape(-1), local,
                           impl).reshape(ep, cap, d)
    back_ECD = jax.lax.all_to_all(y_ECD, EXPERT_AXIS, 0, 0)
    # my row m went to rank e = expert // local, slot pos - start_e there
    dest_m = experts_m // local
    y_mD = back_ECD[dest_m, pos_m - starts_E[dest_m]].reshape(t_l, k, d).astype(jnp.float32)
    out_lD = (y_mD * weights_lk[:, :, None]).sum(axis=1)
    if MODEL_AXIS in axes:
        out_lD = jax.lax.psum(out_lD, MODEL_AXIS)
    out_TD = jax.lax.all_gather(out_lD.astype(h_TD.dtype), EXPERT_AXIS, tiled=True)
    return out_TD[:t]


def _local_experts(maths, experts, x_RD, expert_R, local, impl):
    """Received rows x_RD through their local expert expert_R (== local: padding, out 0)."""
    pos_R, row_of_R, sizes = maths.group_rows(expert_R, local + 1)
    # padding sorts last: past the groups, computed as 0
    y_sorted = maths.mlp(experts, x_RD[row_of_R], sizes[:local], impl)
    return jnp.where((expert_R < local)[:, None], y_sorted[pos_R], 0)
