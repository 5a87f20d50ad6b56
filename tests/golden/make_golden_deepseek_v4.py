"""A tiny random DeepSeek V4 checkpoint and its transformers goldens.

    /work/ref311/bin/python tests/golden/make_golden_deepseek_v4.py
    /work/ref311/bin/python tests/golden/make_golden_deepseek_v4.py --mtp   # the MTP layer's golden

Made with transformers' own DeepseekV4ForCausalLM (versions in deepseek_v4_versions.json),
saved in bf16 into ckpt/deepseek_v4/ and loaded back in f32; deepseek_v4.npz holds every
prefill position's logits and 16 greedy decode steps per prompt (as make_golden._greedy_goldens;
the decode steps run on transformers' own V4 cache: sliding layer, compressor buffers and
overlap state).

Shapes are small but every V4 part is exercised: the four layer kinds' schedule is sliding,
CSA, HCA, CSA; compression every 4 tokens (CSA) and 8 (HCA), a window of 8 and index_topk 3,
so the prompts (5, 19, 45 tokens, then 16 decoded) cross many compression boundaries and the
window, and the indexer's top-k really chooses; hash routing in the first two layers (a random
tid2eid table), sqrtsoftplus top-2 of 4 experts after; hc_mult 4 with 20 Sinkhorn iterations;
YaRN on the compressed branches (attention factor 1, as transformers forces). Weights, norms,
position biases, sinks and the mHC scales are drawn away from their initial values so each
matters.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402

HERE, CKPT_DIR = make_golden.HERE, make_golden.CKPT_DIR
NAME = "deepseek_v4"
PROMPT_LENS = (5, 19, 45)
SEED = 4467

CONFIG = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
    qk_rope_head_dim=8, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    max_position_embeddings=256, rope_theta=10000.0, compress_rope_theta=40000.0,
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                         beta_fast=32, beta_slow=1),
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=1.5, sliding_window=8,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
    num_nextn_predict_layers=0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False)


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    rnd = lambda shape, scale: scale * torch.randn(shape, generator=gen)  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + rnd(p.shape, 0.2))
            elif name.endswith(("position_bias", "sinks", "base", "hc_base")):
                p.copy_(rnd(p.shape, 0.5))
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(1.0 + rnd(p.shape, 0.3))
            elif name.endswith(("fn", "hc_fn")):
                p.copy_(rnd(p.shape, 0.3))
            elif "experts" in name and "shared" not in name:
                p.copy_(rnd(p.shape, 0.25))     # so the swiglu clip (1.5) bites now and then
            else:
                p.copy_(rnd(p.shape, 0.08))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=gen)[:b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(rnd(b.shape, 0.3))


def greedy_goldens(model, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """make_golden._greedy_goldens with V4's `cache=` keyword (its past_key_values alias
    hands nothing back in transformers 5.25, which would decode without context)."""
    out, margins = {}, []
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            res = model(torch.tensor([prompt]), use_cache=True)
        prefill, cache = res.logits[0].float().numpy(), res.cache
        tokens, step_logits = [int(prefill[-1].argmax())], []
        for _ in range(make_golden.DECODE_STEPS):
            with torch.no_grad():
                res = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache = res.cache
            step_logits.append(res.logits[0, -1].float().numpy())
            tokens.append(int(step_logits[-1].argmax()))
        margins += [np.diff(np.sort(row)[-2:])[0] for row in [prefill[-1]] + step_logits]
        out[f"prompt_{i}"] = np.asarray(prompt, np.int32)
        out[f"prefill_logits_{i}"] = prefill.astype(np.float32)
        out[f"decode_logits_{i}"] = np.stack(step_logits).astype(np.float32)
        out[f"greedy_{i}"] = np.asarray(tokens, np.int32)
    out["min_top2_margin"] = np.float32(min(margins))
    return out


def topk_gaps(model, sequences: list[list[int]]) -> float:
    """The smallest gap, over every query of every CSA layer, between the index_topk-th and the
    next best causal index score (where more entries than index_topk are visible). A near tie
    (ReLU zeroes whole scores) would make the goldens depend on torch.topk's tie order."""
    cfg, found = model.config, []
    m = cfg.compress_rates["compressed_sparse_attention"]
    hooks = [mod.register_forward_hook(lambda _m, _a, out: found.append(out[0].float()))
             for mod in model.modules() if type(mod).__name__ == "DeepseekV4IndexerScorer"]
    for seq in sequences:
        with torch.no_grad():
            model(torch.tensor([seq]), use_cache=False)
    for h in hooks:
        h.remove()
    gaps = []
    for scores_ST in found:
        for t in range(scores_ST.shape[0]):
            visible = scores_ST[t, :(t + 1) // m]
            if visible.numel() > cfg.index_topk:
                top = visible.sort(descending=True).values
                gaps.append(float(top[cfg.index_topk - 1] - top[cfg.index_topk]))
    return min(gaps)


def make_mtp_golden() -> None:
    """deepseek_v4_mtp.npz: a random MTP layer for the tiny checkpoint in DeepSeek's checkpoint
    names (mtp.0.*: enorm, hnorm, e_proj, h_proj, norm, hc_head_fn / base / scale, and a V4
    block's tensors: a sliding, score-routed layer, as compress_ratios' MTP entry 0 of the
    released configs), and its logits on prompt 2 by DeepSeek's inference/model.py MTPBlock
    maths written here around transformers' own V4 block: at position i, e_proj(enorm(embed(
    token i + 1))) + h_proj(hnorm(streams i)) (streams: the main model's last layer's output,
    before its hyper head), the block, the layer's own hyper head, norm, the shared LM head.
    The block is layer 4 of a 5-layer copy of the model (layers 0-3 the checkpoint's): its
    save_pretrained writes the block's tensors in DeepSeek's names, and running that copy on
    tokens 0..n-2 with a hook swapping layer 4's input gives the block its positions, mask and
    rotary. The test writes the tensors beside the checkpoint and loads them."""
    import tempfile

    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(SEED + 1)
    path = os.path.join(CKPT_DIR, NAME)
    main_model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg5 = dict(CONFIG, num_hidden_layers=5, layer_types=CONFIG["layer_types"] + ["sliding_attention"],
                mlp_layer_types=CONFIG["mlp_layer_types"] + ["moe"])
    big = tf.DeepseekV4ForCausalLM(tf.DeepseekV4Config(**cfg5)).eval()
    randomize(big, gen)
    missing, unexpected = big.load_state_dict(main_model.state_dict(), strict=False)
    assert not unexpected and all(".layers.4." in k for k in missing), (missing, unexpected)
    with tempfile.TemporaryDirectory() as tmp:
        big.to(torch.bfloat16).save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
        big = tf.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    d, hc, eps = CONFIG["hidden_size"], CONFIG["hc_mult"], CONFIG["rms_norm_eps"]
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731  (stored as the checkpoint is)
    rnd = lambda shape, scale: bf(scale * torch.randn(shape, generator=gen))  # noqa: E731
    own = {"enorm.weight": 1.0 + rnd((d,), 0.2), "hnorm.weight": 1.0 + rnd((d,), 0.2),
           "norm.weight": 1.0 + rnd((d,), 0.2), "e_proj.weight": rnd((d, d), 0.15),
           "h_proj.weight": rnd((d, d), 0.15), "hc_head_fn": rnd((hc, hc * d), 0.3),
           "hc_head_base": rnd((hc,), 0.5), "hc_head_scale": 1.0 + rnd((1,), 0.3)}

    def rms(x, w):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w

    ids = torch.tensor([np.load(os.path.join(HERE, f"{NAME}.npz"))["prompt_2"].tolist()])
    block, out = big.model.layers[4], {}

    def mtp_input(_module, args, kwargs):      # DeepSeek's MTPBlock.forward, before the block
        streams = args[0] if args else kwargs.pop("hidden_states")
        e = rms(big.model.embed_tokens(ids[:, 1:]), own["enorm.weight"])
        x = F.linear(e, own["e_proj.weight"]).unsqueeze(2) + F.linear(rms(streams, own["hnorm.weight"]),
                                                                      own["h_proj.weight"])
        return (x, *args[1:]), kwargs

    hooks = [block.register_forward_pre_hook(mtp_input, with_kwargs=True),
             block.register_forward_hook(lambda _m, _a, y: out.update(streams=y))]
    with torch.no_grad():
        big(ids[:, :-1], use_cache=False)
        for h in hooks:
            h.remove()
        x = out["streams"]                     # DeepSeek's ParallelHead.hc_head with the MTP's weights
        flat = x.flatten(2)
        mixes = F.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps), own["hc_head_fn"])
        pre = torch.sigmoid(mixes * own["hc_head_scale"] + own["hc_head_base"]) + CONFIG["hc_eps"]
        logits = big.lm_head(rms((pre.unsqueeze(-1) * x).sum(2), own["norm.weight"]))[0].numpy()
    tensors = {"mtp.0." + k[len("model.layers.4."):]: v.float() for k, v in saved.items()
               if k.startswith("model.layers.4.")}
    tensors.update({"mtp.0." + k: v for k, v in own.items()})
    arrays = {f"tensor:{k}": v.numpy().astype(np.float32) for k, v in tensors.items()}
    np.savez_compressed(os.path.join(HERE, f"{NAME}_mtp.npz"), logits=logits.astype(np.float32),
                        prompt=ids[0].numpy().astype(np.int32), **arrays)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    print(f"{NAME}_mtp: {len(tensors)} tensors, logits {logits.shape}, "
          f"min top-2 margin {np.min(top2[:, 1] - top2[:, 0]):.4f}")


def main() -> None:
    if "--mtp" in sys.argv:       # only the MTP golden (it reads the deepseek_v4 checkpoint)
        make_mtp_golden()
        return
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    model = tf.DeepseekV4ForCausalLM(tf.DeepseekV4Config(**CONFIG)).eval()
    randomize(model, gen)
    path = os.path.join(CKPT_DIR, NAME)
    shutil.rmtree(path, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(path)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    prompts = [torch.randint(3, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
    goldens = greedy_goldens(model, prompts)
    # the cached decode must equal a full recompute (the cache's buffers are transformers' own)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + goldens[f"greedy_{i}"][:-1].tolist()])
        with torch.no_grad():
            full = model(ids, use_cache=False).logits[0, len(prompt):].float().numpy()
        diff = np.abs(full - goldens[f"decode_logits_{i}"]).max()
        assert diff < 1e-4, f"prompt {i}: cached decode differs from a full recompute by {diff}"
    gap = topk_gaps(model, [p + goldens[f"greedy_{i}"].tolist() for i, p in enumerate(prompts)])
    assert gap > 2e-4, f"an index top-k near tie ({gap}): pick another SEED"
    np.savez_compressed(os.path.join(HERE, f"{NAME}.npz"), **goldens)
    with open(os.path.join(HERE, f"{NAME}_versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": tf.__version__,
                   "numpy": np.__version__}, f, indent=1)
    print(f"{NAME}: min top-2 margin {goldens['min_top2_margin']:.4f}, "
          f"min index top-k gap {gap:.4f}, "
          f"greedy {goldens['greedy_2'][:8].tolist()}...")


if __name__ == "__main__":
    main()
