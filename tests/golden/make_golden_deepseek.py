"""Tiny DeepSeek V3 / V3.2 checkpoints and their goldens, made with transformers' own classes.

Run where torch + transformers exist (not in the test environment):

    /work/ref311/bin/python tests/golden/make_golden_deepseek.py          # checkpoints + goldens
    /work/ref311/bin/python tests/golden/make_golden_deepseek.py --mtp    # the MTP layer's golden

Same layout as make_golden.py (whose helpers it reuses): `ckpt/<name>/` in the Hub's tensor
layout, `<name>.npz` with every prefill position's logits and 16 greedy decode steps.
DeepSeek specifics made non-trivial on purpose: a non-zero `e_score_correction_bias` (it
changes the expert choice but not the weights), n_group > 1 with topk_group < n_group, a
dense first layer, YaRN with mscale != mscale_all_dim (so both the cos/sin factor and the
softmax-scale correction matter) and, for V3.2, index_topk = 8 below the prompt lengths so
the sparse selection matters. The V3.2 selection is checked for near-ties at the top-k
boundary (a tie would make the golden depend on torch.topk's tie order).
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import torch
import transformers as tf

from make_golden import CKPT_DIR, HERE, PROMPT_LENS, SEED, _greedy_goldens, _randomize

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
             first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)

# name -> (config class, model class, config kwargs)
SPECS = {
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                    dict(rope_parameters=_YARN, rope_interleave=True)),
    # q straight from the hidden state (q_proj), half-split rotary, plain RoPE
    "deepseek_v3_noqlora": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                            dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                 norm_topk_prob=False, routed_scaling_factor=1.0,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "deepseek_v32": (tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM,
                     dict(rope_parameters=_YARN, index_topk=8, index_head_dim=16, index_n_heads=8)),
}


def _build(name: str, gen: torch.Generator):
    cfg_cls, model_cls, extra = SPECS[name]
    kwargs = dict(_BASE)
    kwargs.update(extra)
    model = model_cls(cfg_cls(**kwargs)).eval()
    _randomize(model, gen)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):   # a buffer: _randomize skips it
                mod.e_score_correction_bias.copy_(0.3 * torch.randn(mod.e_score_correction_bias.shape,
                                                                    generator=gen))
    out = os.path.join(CKPT_DIR, name)
    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def _index_margins(model) -> list[float]:
    """Hooks on every V3.2 indexer that record, per query, the gap between its k-th and
    (k+1)-th visible index score (the selection boundary). Recomputes the scores from the
    indexer's own sub-modules, as its forward does, because it returns indices only."""
    gaps: list[float] = []

    def hook(mod, args, kwargs):
        hidden, q_resid, (cos, sin), mask = args[:4]
        b, s, _ = hidden.shape
        q = mod.wq_b(q_resid).view(b, s, mod.n_heads, mod.head_dim)
        k = mod.k_norm(mod.wk(hidden))
        r = mod.qk_rope_head_dim

        def rope(x, c, si):   # half-split rotary on the first r dims
            x1, x2 = x[..., : r // 2], x[..., r // 2: r]
            return torch.cat([x1 * c[..., : r // 2] - x2 * si[..., : r // 2],
                              x2 * c[..., : r // 2] + x1 * si[..., : r // 2], x[..., r:]], -1)

        q = rope(q, cos[:, :, None], sin[:, :, None])
        k = rope(k, cos, sin)
        # a prompt's prefill starts a new sequence; a decode step (s == 1) extends it
        keys = torch.cat([mod._seen, k], dim=1) if s == 1 else k
        mod._seen = keys
        sc = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), keys.float())) * mod.softmax_scale
        w = mod.weights_proj(hidden).float() * mod.n_heads ** -0.5
        idx = torch.einsum("bsh,bsht->bst", w, sc)[0]
        visible = mask[0] if mask.dtype == torch.bool else mask[0] == 0
        for row, vis in zip(idx, visible):
            vals = torch.sort(row[vis], descending=True).values
            if len(vals) > mod.index_topk:
                gaps.append(float(vals[mod.index_topk - 1] - vals[mod.index_topk]))

    for layer in model.model.layers:
        ix = layer.self_attn.indexer
        ix._seen = None
        ix.register_forward_pre_hook(hook, with_kwargs=True)
    return gaps


def make_mtp_golden() -> None:
    """deepseek_v3_mtp.npz: a random MTP layer for the tiny deepseek_v3 checkpoint, in the Hub's
    names (model.layers.3.*: enorm, hnorm, eh_proj, the decoder layer's tensors with experts
    one by one, shared_head.norm, shared_head.head = lm_head), and its logits from HF's own
    MtpLayer on prompt 2: embed(token i+1) with the main model's final hidden state i, at
    position i, causal. The test writes the tensors beside the checkpoint and loads them."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                      DeepseekV3RMSNorm)

    path = os.path.join(CKPT_DIR, "deepseek_v3")
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    cfg = model.config
    n = cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(SEED + 7)
    mtp = MtpLayer(cfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, n, use_post_norm=True).eval()
    _randomize(mtp, gen)
    with torch.no_grad():
        bias = mtp.mtp_block.mlp.gate.e_score_correction_bias
        bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    prompt = np.load(os.path.join(HERE, "deepseek_v3.npz"))["prompt_2"].tolist()
    ids = torch.tensor([prompt])
    t = len(prompt) - 1
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[:, :t]
        pos = torch.arange(t)[None]
        mask = torch.triu(torch.full((t, t), torch.finfo(torch.float32).min), 1)[None, None]
        out = mtp(model.model.embed_tokens(ids[:, 1:]), hidden, model.model.rotary_emb(hidden, pos),
                  mask, pos, None)
        logits = model.lm_head(out)[0].numpy()
    pre = f"model.layers.{n}."
    tensors = {pre + "enorm.weight": mtp.enorm.weight, pre + "hnorm.weight": mtp.hnorm.weight,
               pre + "eh_proj.weight": mtp.eh_proj.weight, pre + "shared_head.norm.weight": mtp.post_norm.weight,
               pre + "shared_head.head.weight": model.lm_head.weight}
    m = cfg.moe_intermediate_size
    for name, p in mtp.mtp_block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":       # HF's fused [X, 2M, D]: the Hub has experts one by one
            for j in range(p.shape[0]):
                tensors[pre + f"mlp.experts.{j}.gate_proj.weight"] = p[j, :m]
                tensors[pre + f"mlp.experts.{j}.up_proj.weight"] = p[j, m:]
        elif name == "mlp.experts.down_proj":
            for j in range(p.shape[0]):
                tensors[pre + f"mlp.experts.{j}.down_proj.weight"] = p[j]
        else:
            tensors[pre + name] = p
    arrays = {"tensor:" + k: v.detach().float().numpy() for k, v in tensors.items()}
    np.savez_compressed(os.path.join(HERE, "deepseek_v3_mtp.npz"), logits=logits.astype(np.float32), **arrays)
    print(f"deepseek_v3_mtp: {len(tensors)} tensors, logits {logits.shape}")


def main() -> None:
    if "--mtp" in sys.argv:       # only the MTP golden (it reads the deepseek_v3 checkpoint)
        make_mtp_golden()
        return
    os.makedirs(CKPT_DIR, exist_ok=True)
    torch.manual_seed(SEED)
    for name in SPECS:
        gen = torch.Generator().manual_seed(SEED + sum(map(ord, name)))
        path = _build(name, gen)
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
        gaps = _index_margins(model) if name == "deepseek_v32" else None
        prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
                   for n in PROMPT_LENS]
        goldens = _greedy_goldens(model, prompts)
        np.savez_compressed(os.path.join(HERE, f"{name}.npz"), **goldens)
        extra = ""
        if gaps is not None:
            goldens["min_index_gap"] = np.float32(min(gaps))
            np.savez_compressed(os.path.join(HERE, f"{name}.npz"), **goldens)
            extra = f", min index top-k gap {min(gaps):.2e} over {len(gaps)} rows"
        print(f"{name}: min top-2 margin {goldens['min_top2_margin']:.4f}{extra}, "
              f"greedy {goldens['greedy_0'][:6].tolist()}...")
    make_mtp_golden()


if __name__ == "__main__":
    main()
