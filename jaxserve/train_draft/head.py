"""The EAGLE3 head being trained, a flax.nnx module: its parameters, its forward under
EAGLE3's training-time test (TTT), and its export in the HF `LlamaForCausalLMEagle3` format
that spec_decode/eagle3.py::load_head (and vLLM) read.

Parameters (nnx.Param, f32) carry eagle3.load_head's names and layout (weights [in, out]):
fc f[3D, D]; layer: attn_norm (HF input_layernorm, over the token's embedding), hidden_norm,
wq/wk/wv f[2D, *], wo, mlp_norm, w_gate/w_up/w_down; norm; lm_head f[D, Dv]. They are plain
matrices rather than nnx.Linear/nnx.RMSNorm: the maths is the engine's (layers.rms_norm,
layers.apply_rope, matmuls with compute-dtype operands and f32 accumulation), which step 0
must match (tests/test_train_draft.py checks it against eagle3.head_forward). The draft vocabulary (draft_ids, the target id of each
output) is the head's too, a DraftVocab variable: checkpointed with it, never trained. The
embedding is the target's, frozen, and passed in.

TTT, step i = 0 .. k-1 at every position t of a sequence x: step 0 is the head as the engine
runs it (the target's aux streams at t through fc, token x[t+1], RoPE position t). Step
i > 0 feeds the head's own output hidden of step i-1 at t (no fc) with token x[t+1+i] at
position t+i, as a chained draft would. Its query attends to step 0's keys at positions
<= t (the real tokens before it) and to the keys that steps 1..i made at t itself (the
drafts before it in the chain), so k steps cost k passes, not k sequences.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import layers


class DraftVocab(nnx.Variable):
    """i32[Dv]: the target id of each of the head's outputs (not a Param: the optimizer's
    wrt=nnx.Param leaves it alone)."""


def _matmul(x, w, cd):
    """x @ w with cd operands (bf16: the tensor cores' rate), accumulated and returned in f32."""
    return jnp.matmul(x.astype(cd), w.astype(cd), preferred_element_type=jnp.float32)


class HeadLayer(nnx.Module):
    """The head's decoder layer: attention and MLP over [the token's embedding, the hidden]
    (eagle3.head_layer's maths, its attention the TTT one)."""

    def __init__(self, cfg, normal):
        self.cfg = cfg
        d, n, kh, e, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        ones = lambda: nnx.Param(jnp.ones((d,), jnp.float32))
        self.attn_norm, self.hidden_norm, self.mlp_norm = ones(), ones(), ones()
        self.wq, self.wk, self.wv = normal(2 * d, n * e), normal(2 * d, kh * e), normal(2 * d, kh * e)
        self.wo = normal(n * e, d)
        self.w_gate, self.w_up, self.w_down = normal(d, f), normal(d, f), normal(f, d)

    def __call__(self, emb_BTD, h_BTD, pos_T, keys: list, values: list, inv_freq, cd):
        """One TTT step: the new hidden f32[B, T, D]. keys, values: the steps' before it (as
        ttt_attention takes them); it appends its own."""
        cfg, (b, t, _) = self.cfg, h_BTD.shape
        n, kh, e, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        rope = lambda x_BTNE: jax.vmap(lambda x: layers.apply_rope(x, pos_T, inv_freq))(x_BTNE)
        both = jnp.concatenate([layers.rms_norm(emb_BTD, self.attn_norm[...], eps),
                                layers.rms_norm(h_BTD, self.hidden_norm[...], eps)], -1)
        keys.append(rope(_matmul(both, self.wk[...], cd).reshape(b, t, kh, e)))
        values.append(_matmul(both, self.wv[...], cd).reshape(b, t, kh, e))
        q = rope(_matmul(both, self.wq[...], cd).reshape(b, t, n, e))
        residual = h_BTD + _matmul(ttt_attention(q, keys, values, 1.0 / math.sqrt(e), cd), self.wo[...], cd)
        m = layers.rms_norm(residual, self.mlp_norm[...], eps)
        gated = jax.nn.silu(_matmul(m, self.w_gate[...], cd)) * _matmul(m, self.w_up[...], cd)
        return residual + _matmul(gated, self.w_down[...], cd)


class Eagle3Head(nnx.Module):
    """The trained head. cfg: the target's ModelConfig (the head's shapes are its own)."""

    def __init__(self, cfg, lm_head_DDv, draft_ids, key: jax.Array):
        """normal(0.02) matrices from `key` (split in 8: fc, then the layer's in order), unit
        norms, the given lm_head."""
        keys = iter(jax.random.split(key, 8))
        normal = lambda *shape: nnx.Param(0.02 * jax.random.normal(next(keys), shape, jnp.float32))
        self.cfg = cfg
        self.fc = normal(3 * cfg.hidden_size, cfg.hidden_size)
        self.layer = HeadLayer(cfg, normal)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), jnp.float32))
        self.lm_head = nnx.Param(jnp.asarray(lm_head_DDv, jnp.float32))
        self.draft_ids = DraftVocab(jnp.asarray(draft_ids, jnp.int32))

    def __call__(self, embed_VD, aux_BTH, token_ids_BT, num_steps: int,
                 compute_dtype=jnp.float32) -> list[jax.Array]:
        """The head's logits f32[B, T, Dv] at every position for each of `num_steps` TTT steps
        (step i predicts token t + 2 + i). Matmuls take compute_dtype operands and accumulate
        in f32; norms, softmax and the residual stream are f32."""
        cfg, cd = self.cfg, compute_dtype
        t = token_ids_BT.shape[1]
        inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        h = _matmul(aux_BTH, self.fc[...], cd)
        keys, values, out_logits = [], [], []
        for i in range(num_steps):
            emb = embed_VD[shift_left(token_ids_BT, 1 + i)].astype(jnp.float32)
            pos = jnp.arange(t, dtype=jnp.int32) + i
            h = self.layer(emb, h, pos, keys, values, inv_freq, cd)
            out_logits.append(_matmul(layers.rms_norm(h, self.norm[...], cfg.rms_norm_eps), self.lm_head[...], cd))
        return out_logits


def init_head(target_cfg, target_params, family, draft_ids: np.ndarray, seed: int) -> Eagle3Head:
    """A fresh head, its lm_head started from the target's own output rows of the draft tokens
    (a useful prior: the head's output lives near the target's final hidden states)."""
    eye = jnp.eye(target_cfg.hidden_size, dtype=jnp.float32)
    rows = family.compute_logits(target_cfg, target_params, eye)[:, jnp.asarray(draft_ids)]
    return Eagle3Head(target_cfg, rows, draft_ids, jax.random.PRNGKey(seed))


def shift_left(x_BT: jax.Array, s: int) -> jax.Array:
    """x[:, t + s] at t (zeros past the end)."""
    if s == 0:
        return x_BT
    pad = jnp.zeros((x_BT.shape[0], s) + x_BT.shape[2:], x_BT.dtype)
    return jnp.concatenate([x_BT[:, s:], pad], axis=1)


def ttt_attention(q_BTNE, keys, values, scale: float, cd=jnp.float32) -> jax.Array:
    """Attention of step len(keys) - 1: causal over keys[0] (step 0's, every position), and
    at each position over its own keys of steps 1.. (the chain's drafts). Grouped heads:
    N query heads share K kv heads. Products in cd, accumulated and softmaxed in f32."""
    b, t, n, e = q_BTNE.shape
    kh = keys[0].shape[2]
    q = q_BTNE.reshape(b, t, kh, n // kh, e).astype(cd)
    f32 = dict(preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))
    s0 = jnp.einsum("btkge,bske->bkgts", q, keys[0].astype(cd), **f32) * scale
    scores = [jnp.where(causal, s0, -jnp.inf)]
    scores += [jnp.einsum("btkge,btke->bkgt", q, k.astype(cd), **f32)[..., None] * scale
               for k in keys[1:]]
    p = jax.nn.softmax(jnp.concatenate(scores, -1), axis=-1)
    out = jnp.einsum("bkgts,bske->btkge", p[..., :t].astype(cd), values[0].astype(cd), **f32)
    for j, v in enumerate(values[1:]):
        out = out + p[..., t + j].transpose(0, 3, 1, 2)[..., None] * v.astype(jnp.float32)[:, :, :, None]
    return out.reshape(b, t, n * e)


def head_hf_config(target_cfg, draft_vocab_size: int, aux_layers) -> dict:
    rs = target_cfg.rope_scaling_dict
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target_cfg.hidden_size, "intermediate_size": target_cfg.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": target_cfg.num_heads,
            "num_key_value_heads": target_cfg.num_kv_heads, "head_dim": target_cfg.head_dim,
            "rms_norm_eps": target_cfg.rms_norm_eps, "rope_theta": target_cfg.rope_theta,
            "rope_scaling": rs, "hidden_act": "silu",
            "max_position_embeddings": target_cfg.max_position_embeddings,
            "vocab_size": target_cfg.vocab_size, "draft_vocab_size": draft_vocab_size,
            "tie_word_embeddings": False, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layers]}}


def export_head(path: str, head: Eagle3Head, aux_layers) -> str:
    """Write config.json and model.safetensors (f32; HF names, weights [out, in]; d2t the
    offset of each draft id's target id, t2d which target ids are in the draft vocabulary)."""
    from safetensors.numpy import save_file

    from jaxserve.models.loaders.hf import _LAYER_TENSORS

    target_cfg, draft_ids = head.cfg, np.asarray(head.draft_ids[...])
    # {"fc": .., "layer": {"wq": .., ..}, ..}: the Params under their attribute names
    host = jax.tree.map(lambda a: np.asarray(a, np.float32), nnx.to_pure_dict(nnx.state(head, nnx.Param)))
    tensors = {"fc.weight": host["fc"].T, "norm.weight": host["norm"], "lm_head.weight": host["lm_head"].T,
               "midlayer.hidden_norm.weight": host["layer"]["hidden_norm"]}
    for hf_name, (ours, transpose) in _LAYER_TENSORS.items():
        if ours in host["layer"]:
            value = host["layer"][ours]
            tensors["midlayer." + hf_name] = value.T if transpose else value
    tensors["d2t"] = draft_ids.astype(np.int64) - np.arange(len(draft_ids))
    t2d = np.zeros(target_cfg.vocab_size, bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(head_hf_config(target_cfg, len(draft_ids), aux_layers), f, indent=2)
    return path
