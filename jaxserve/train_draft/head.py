"""The EAGLE3 head being trained: its parameters, its forward under EAGLE3's training-time
test (TTT), and its export in the HF `LlamaForCausalLMEagle3` format that
spec_decode/eagle3.py::load_head (and vLLM) read.

Parameters use eagle3.load_head's names (weights [in, out]): fc f[3D, D]; layer: attn_norm
(HF input_layernorm, over the token's embedding), hidden_norm, wq/wk/wv f[2D, *], wo,
mlp_norm, w_gate/w_up/w_down; norm; lm_head f[D, Dv]. The embedding is the target's, frozen.

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

from jaxserve.models import layers


def init_head(target_cfg, target_params, module, draft_ids: np.ndarray, seed: int) -> dict:
    """Fresh f32 head parameters: normal(0.02) matrices, unit norms, and lm_head started
    from the target's own output rows of the draft tokens (a useful prior: the head's
    output lives near the target's final hidden states)."""
    d, n, kh, e, f = (target_cfg.hidden_size, target_cfg.num_heads, target_cfg.num_kv_heads,
                      target_cfg.head_dim, target_cfg.intermediate_size)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
    w = lambda *shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)
    ones = lambda: jnp.ones((d,), jnp.float32)
    eye = jnp.eye(d, dtype=jnp.float32)
    rows = module.compute_logits(target_cfg, target_params, eye)[:, jnp.asarray(draft_ids)]
    return {
        "fc": w(3 * d, d), "norm": ones(), "lm_head": rows.astype(jnp.float32),
        "layer": {"attn_norm": ones(), "hidden_norm": ones(), "wq": w(2 * d, n * e),
                  "wk": w(2 * d, kh * e), "wv": w(2 * d, kh * e), "wo": w(n * e, d),
                  "mlp_norm": ones(), "w_gate": w(d, f), "w_up": w(d, f), "w_down": w(f, d)},
    }


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


def ttt_forward(cfg, hp: dict, embed_VD, aux_BTH, token_ids_BT, num_steps: int,
                compute_dtype=jnp.float32) -> list[jax.Array]:
    """The head's logits f32[B, T, Dv] at every position for each of `num_steps` TTT steps
    (step i predicts token t + 2 + i). Matmuls take compute_dtype operands (bf16: the
    tensor cores' rate) and accumulate in f32; norms, softmax and the residual stream are f32."""
    lp, eps, cd = hp["layer"], cfg.rms_norm_eps, compute_dtype
    mm = lambda x, w: jnp.matmul(x.astype(cd), w.astype(cd), preferred_element_type=jnp.float32)
    b, t = token_ids_BT.shape
    n, kh, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv_freq = layers.rope_inv_freq(e, cfg.rope_theta, cfg.rope_scaling_dict)
    rope = lambda x_BTNE, pos_T: jax.vmap(lambda x: layers.apply_rope(x, pos_T, inv_freq))(x_BTNE)
    h = mm(aux_BTH, hp["fc"])
    keys, values, out_logits = [], [], []
    for i in range(num_steps):
        tokens = shift_left(token_ids_BT, 1 + i)
        emb = layers.rms_norm(embed_VD[tokens].astype(jnp.float32), lp["attn_norm"], eps)
        both = jnp.concatenate([emb, layers.rms_norm(h, lp["hidden_norm"], eps)], -1)
        pos = jnp.arange(t, dtype=jnp.int32) + i
        keys.append(rope(mm(both, lp["wk"]).reshape(b, t, kh, e), pos))
        values.append(mm(both, lp["wv"]).reshape(b, t, kh, e))
        q = rope(mm(both, lp["wq"]).reshape(b, t, n, e), pos)
        residual = h + mm(ttt_attention(q, keys, values, 1.0 / math.sqrt(e), cd), lp["wo"])
        m = layers.rms_norm(residual, lp["mlp_norm"], eps)
        h = residual + mm(jax.nn.silu(mm(m, lp["w_gate"])) * mm(m, lp["w_up"]), lp["w_down"])
        out_logits.append(mm(layers.rms_norm(h, hp["norm"], eps), hp["lm_head"]))
    return out_logits


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


def export_head(path: str, hp: dict, target_cfg, draft_ids: np.ndarray, aux_layers) -> str:
    """Write config.json and model.safetensors (f32; HF names, weights [out, in]; d2t the
    offset of each draft id's target id, t2d which target ids are in the draft vocabulary)."""
    from safetensors.numpy import save_file

    from jaxserve.models.loaders.hf import _LAYER_TENSORS

    host = jax.tree.map(lambda a: np.asarray(a, np.float32), hp)
    tensors = {"fc.weight": host["fc"].T, "norm.weight": host["norm"], "lm_head.weight": host["lm_head"].T,
               "midlayer.hidden_norm.weight": host["layer"]["hidden_norm"]}
    for hf_name, (ours, transpose) in _LAYER_TENSORS.items():
        if ours in host["layer"]:
            value = host["layer"][ours]
            tensors["midlayer." + hf_name] = value.T if transpose else value
    tensors["d2t"] = (np.asarray(draft_ids, np.int64) - np.arange(len(draft_ids)))
    t2d = np.zeros(target_cfg.vocab_size, bool)
    t2d[np.asarray(draft_ids)] = True
    tensors["t2d"] = t2d
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(head_hf_config(target_cfg, len(draft_ids), aux_layers), f, indent=2)
    return path
