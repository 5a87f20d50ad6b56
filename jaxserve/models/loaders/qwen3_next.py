"""Qwen3-Next / Qwen3.5 checkpoints and dummy weights in models/qwen3_next.py's layout.

HF names (after the text model's prefix: "model." for ...ForCausalLM, "model.language_model."
for Qwen3.5's ...ForConditionalGeneration, whose vision tower is skipped):
  linear_attn.in_proj_qkvz [2GA + 2HB, D] (Qwen3-Next): rows grouped per key head j as
      [q_j (A) | k_j (A) | v of its r = H/G value heads (rB) | z of them (rB)];
  linear_attn.in_proj_ba [2H, D]: per key head [b (r) | a (r)]. Both are split here into
      w_qkv (q | k | v, the conv's channel order), w_z, w_b, w_a by a column permutation.
  linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5): already split.
  MoE experts one tensor per expert (mlp.experts.{j}.gate_proj, as save_pretrained writes
  them) or fused 3-D (mlp.experts.gate_up_proj [X, 2F, D], mlp.experts.down_proj [X, D, F]).
  mtp.* (multi-token prediction): every tensor, HF-named, in params["mtp"] (2-D weights
  transposed to [in, out]; experts as stored), for the speculative-decoding work.

Legend as models/qwen3_next.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import qwen3_next as qn
from jaxserve.models.loaders import dummy, hf as hf_loader
from jaxserve.sharding import rules


def qkvz_permutation(cfg: qn.Qwen3NextConfig):
    """Row indices of in_proj_qkvz giving (w_qkv's columns, w_z's) and of in_proj_ba giving
    (w_b's, w_a's)."""
    g, a, b = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // g
    group = 2 * a + 2 * r * b
    base = np.arange(g)[:, None] * group
    q = (base + np.arange(a)).ravel()
    k = (base + a + np.arange(a)).ravel()
    v = (base + 2 * a + np.arange(r * b)).ravel()
    z = (base + 2 * a + r * b + np.arange(r * b)).ravel()
    ba = np.arange(g)[:, None] * 2 * r
    return (np.concatenate([q, k, v]), z, (ba + np.arange(r)).ravel(), (ba + r + np.arange(r)).ravel())


def _prefix(ckpt) -> str:
    for p in ("model.language_model.", "model."):
        if p + "embed_tokens.weight" in ckpt.where:
            return p
    raise ValueError("checkpoint has no model.embed_tokens.weight nor model.language_model.embed_tokens.weight")


def _rows_source(ckpt, name: str, rows: np.ndarray):
    """Source of [in, len(rows)]: the chosen output rows of a [out, in] weight, transposed."""
    def read(index):
        return np.asarray(ckpt._slice(name)[:])[rows].T[index]
    return read


def _readers(cfg: qn.Qwen3NextConfig, ckpt):
    """(check, leaf): a shape check naming the tensor, and a planned leaf (HF name, source,
    our shape) after checking presence and shape."""
    def check(name, got, want):
        if tuple(got) != tuple(want):
            raise ValueError(f"tensor {name!r}: shape {tuple(got)} (in our [in, out] layout), "
                             f"{cfg.architecture} with this config.json expects {tuple(want)}")

    def leaf(name, transpose, want, reshape=None):
        if name not in ckpt.where:
            raise ValueError(f"checkpoint is missing tensor {name!r} (needed for a {want} parameter)")
        got = ckpt.shape(name, transpose)
        if reshape is not None:      # conv1d.weight [C, 1, W] -> [C, W]
            check(name, (got[0], got[-1]), want)
            sl = ckpt.source(name, False)
            return name, lambda index: sl((slice(None),) * 3)[:, 0, :][index], tuple(want)
        check(name, got, want)
        return name, ckpt.source(name, transpose), tuple(want)
    return check, leaf


def _plan(cfg: qn.Qwen3NextConfig, ckpt) -> dict:
    shapes = qn.param_shapes(cfg)
    pre = _prefix(ckpt)
    _, leaf = _readers(cfg, ckpt)
    plan = {"embed": leaf(pre + "embed_tokens.weight", False, shapes["embed"]),
            "final_norm": leaf(pre + "norm.weight", False, shapes["final_norm"])}
    if "lm_head" in shapes:
        plan["lm_head"] = leaf("lm_head.weight", True, shapes["lm_head"])
    plan["layers"] = [_layer_plan(cfg, ckpt, f"{pre}layers.{i}.", want, cfg.layer_types[i])
                      for i, want in enumerate(shapes["layers"])]
    return plan


def _layer_plan(cfg: qn.Qwen3NextConfig, ckpt, p: str, want: dict, kind: str) -> dict:
    """One decoder layer's tensors under the HF prefix `p`."""
    check, leaf = _readers(cfg, ckpt)
    lp = {"attn_norm": leaf(p + "input_layernorm.weight", False, want["attn_norm"]),
          "mlp_norm": leaf(p + "post_attention_layernorm.weight", False, want["mlp_norm"])}
    if kind == qn.LINEAR:
        la = p + "linear_attn."
        if cfg.split_projections:
            for ours, hf in (("w_qkv", "in_proj_qkv"), ("w_z", "in_proj_z"), ("w_b", "in_proj_b"),
                             ("w_a", "in_proj_a")):
                lp[ours] = leaf(la + hf + ".weight", True, want[ours])
        else:
            perm = qkvz_permutation(cfg)
            for ours, hf, rows in (("w_qkv", "in_proj_qkvz", perm[0]), ("w_z", "in_proj_qkvz", perm[1]),
                                   ("w_b", "in_proj_ba", perm[2]), ("w_a", "in_proj_ba", perm[3])):
                name = la + hf + ".weight"
                if name not in ckpt.where:
                    raise ValueError(f"checkpoint is missing tensor {name!r}")
                pair = perm[:2] if hf == "in_proj_qkvz" else perm[2:]
                check(name, ckpt.shape(name, True), (want[ours][0], sum(map(len, pair))))
                lp[ours] = (name, _rows_source(ckpt, name, rows), tuple(want[ours]))
        lp["conv_w"] = leaf(la + "conv1d.weight", False, want["conv_w"], reshape=True)
        lp["dt_bias"] = leaf(la + "dt_bias", False, want["dt_bias"])
        lp["a_log"] = leaf(la + "A_log", False, want["a_log"])
        lp["gdn_norm"] = leaf(la + "norm.weight", False, want["gdn_norm"])
        lp["w_out"] = leaf(la + "out_proj.weight", True, want["w_out"])
    else:
        sa = p + "self_attn."
        for ours, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            lp[ours] = leaf(sa + hf + ".weight", True, want[ours])
        lp["q_norm"] = leaf(sa + "q_norm.weight", False, want["q_norm"])
        lp["k_norm"] = leaf(sa + "k_norm.weight", False, want["k_norm"])
    if "router" in want:
        lp.update(_moe_plan(cfg, ckpt, p + "mlp.", want, leaf, check))
    else:
        for ours, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            lp[ours] = leaf(p + f"mlp.{hf}.weight", True, want[ours])
    return lp


def _moe_plan(cfg, ckpt, p: str, want: dict, leaf, check) -> dict:
    lp = {"router": leaf(p + "gate.weight", True, want["router"])}
    if "ws_gate" in want:
        for ours, hf in (("ws_gate", "gate_proj"), ("ws_up", "up_proj"), ("ws_down", "down_proj")):
            lp[ours] = leaf(p + f"shared_expert.{hf}.weight", True, want[ours])
        lp["w_shared_gate"] = leaf(p + "shared_expert_gate.weight", True, want["w_shared_gate"])
    x, f = cfg.num_experts, cfg.moe_intermediate_size
    fused = p + "experts.gate_up_proj"
    if fused in ckpt.where:
        # [X, 2F, D] (gate rows, then up rows) and [X, D, F]: transposed per expert to [X, in, out]
        def part(name, lo, hi, ours):
            got = tuple(ckpt.shape(name, False))
            check(name, (got[0], got[2], hi - lo), want[ours])

            def read(index):
                return np.swapaxes(np.asarray(ckpt._slice(name)[:])[:, lo:hi], 1, 2)[index]
            return name, read, tuple(want[ours])
        lp["w_gate"] = part(fused, 0, f, "w_gate")
        lp["w_up"] = part(fused, f, 2 * f, "w_up")
        lp["w_down"] = part(p + "experts.down_proj", 0, cfg.hidden_size, "w_down")
        return lp
    for ours, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        names = [p + f"experts.{j}.{hf}.weight" for j in range(x)]
        for name in names:
            leaf(name, True, want[ours][1:])
        lp[ours] = (p + f"experts.*.{hf}.weight", ckpt.stacked_source(names), tuple(want[ours]))
    return lp


def _mtp_plan(cfg: qn.Qwen3NextConfig, ckpt) -> dict:
    """The multi-token-prediction head, if the checkpoint has one (mtp.fc.weight), in our
    layout: fc f[2D, D] (its input: [RMSNorm(embedding) | RMSNorm(hidden)]), the zero-centred
    norms pre_fc_norm_embedding, pre_fc_norm_hidden and norm f[D], and `layers`: full-attention
    decoder layers (mtp.layers.{i}.*) shaped like the main model's (qn.mtp_layer_shapes)."""
    if "mtp.fc.weight" not in ckpt.where:
        return {}
    _, leaf = _readers(cfg, ckpt)
    d = cfg.hidden_size
    plan = {"fc": leaf("mtp.fc.weight", True, (2 * d, d))}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        plan[name] = leaf(f"mtp.{name}.weight", False, (d,))
    count = len({n.split(".")[2] for n in ckpt.where if n.startswith("mtp.layers.")})
    plan["layers"] = [_layer_plan(cfg, ckpt, f"mtp.layers.{i}.", qn.mtp_layer_shapes(cfg), qn.FULL)
                      for i in range(count)]
    return plan


def load_hf(family, path: str, dtype: str = "float32", mesh=None):
    """(config, params in `dtype`): on the first device, or placed by the sharding rules over
    `mesh` (models/families.py), each device reading only its slice of each tensor."""
    cfg = qn.config_from_hf(hf_loader.read_hf_config(path))
    jdtype = jnp.dtype(dtype)
    with contextlib.ExitStack() as stack:
        ckpt = hf_loader._Checkpoint(path, stack)
        plan = _plan(cfg, ckpt)
        mtp = _mtp_plan(cfg, ckpt)
        if mtp:
            plan["mtp"] = mtp
        is_leaf = lambda e: isinstance(e, tuple) and len(e) == 3 and callable(e[1])  # noqa: E731
        shapes = jax.tree.map(lambda e: e[2], plan, is_leaf=is_leaf)
        placements = rules.param_placements(family, cfg, mesh, shapes)

        def build(entry, sharding):
            _, read, shape = entry
            return jax.make_array_from_callback(
                shape, sharding, lambda index: np.asarray(read(index)).astype(jdtype))

        params = jax.tree.map(build, plan, placements, is_leaf=is_leaf)
    return cfg, group_conv_channels(cfg, params, mesh)


def grouped_channel_order(cfg: qn.Qwen3NextConfig) -> np.ndarray:
    """Conv channel indices (of HF's q | k | v order) grouped per key head j: [q_j | k_j | v of
    value heads j*r .. j*r+r-1] (gated_deltanet.post_conv's `grouped` layout)."""
    g, a, b = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rb = cfg.linear_num_value_heads // g * b
    j = np.arange(g)[:, None]
    return np.concatenate([j * a + np.arange(a), g * a + j * a + np.arange(a),
                           2 * g * a + j * rb + np.arange(rb)], axis=1).ravel()


def group_conv_channels(cfg: qn.Qwen3NextConfig, params: dict, mesh) -> dict:
    """On a mesh whose `model` axis the key heads divide: w_qkv / conv_w -> w_qkv_grouped /
    conv_w_grouped (channels in grouped_channel_order, each array keeping its sharding), so
    each rank's contiguous channel block holds whole heads (models/families.py says why).
    In place; unchanged without a mesh or when the heads do not divide."""
    if mesh is None or cfg.linear_num_key_heads % mesh.shape["model"] or qn.LINEAR not in cfg.layer_types:
        return params
    order = jnp.asarray(grouped_channel_order(cfg))
    for lp in params["layers"]:
        for name, axis in (("w_qkv", 1), ("conv_w", 0)):
            if name in lp:
                w = lp.pop(name)
                lp[name + "_grouped"] = jax.jit(lambda w, axis=axis: jnp.take(w, order, axis=axis),
                                                out_shardings=w.sharding)(w)
    return params


ZERO_CENTRED = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm")


def dummy_params(family, cfg: qn.Qwen3NextConfig, dtype: str = "float32", mesh=None, seed: int = 0) -> dict:
    """Random weights (models/dummy.py's draws): zero-centred norms 0 (a scale of 1), the gated
    norm 1, a_log 0 and dt_bias 1 (decays exp(-softplus(a + 1)), about 0.27 per token)."""
    params = dummy.draw_params(qn.param_shapes(cfg), rules.param_placements(family, cfg, mesh), dtype, seed)
    like = lambda a, fill: jnp.full_like(a, fill, device=a.sharding)  # noqa: E731  (keeps the placement)
    for tree in [params] + params["layers"]:
        for name in ZERO_CENTRED:
            if name in tree:
                tree[name] = like(tree[name], 0)
        if "a_log" in tree:
            tree["a_log"] = like(tree["a_log"], 0)
            tree["dt_bias"] = like(tree["dt_bias"], 1)
    return group_conv_channels(cfg, params, mesh)
