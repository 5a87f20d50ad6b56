"""Shared by the speculative decoding tests: engines with and without a proposer."""

from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.engine.builder import build_engine
from jaxserve.engine.llm import LLM
from jaxserve.models import registry
from jaxserve.spec_decode.config import SpeculativeConfig
from tests.step_bound import bound_steps


def make_llm(model, spec: dict | None = None, *, max_num_seqs=8, max_tokens=32, max_len=128,
             block_size=4, num_kv_blocks=None, cache_bytes=CacheConfig.kv_cache_cpu_bytes,
             warmup=False, num_scheduler_steps=1) -> LLM:
    cfg, params, tok = model
    config = EngineConfig(
        model=cfg, cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                     kv_cache_cpu_bytes=cache_bytes),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                                  max_model_len=max_len, num_scheduler_steps=num_scheduler_steps),
        dtype="float32", warmup=warmup, speculative=SpeculativeConfig.from_dict(spec))
    engine = build_engine(config, params, tok, registry.get_family(cfg.architecture))
    return LLM.from_engine(bound_steps(engine))     # a broken invariant fails, never hangs


def token_ids(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def spec_counts(llm) -> dict:
    return {k: v for k, v in llm.get_metrics().items() if k.startswith("spec_decode")}


def write_tiny_llama(path, vocab_size: int, seed: int = 0, **config) -> str:
    """A tiny random-weight Llama checkpoint in HF format (config.json + model.safetensors) on
    a vocabulary of `vocab_size` tokens: a draft model for the target of that vocabulary."""
    import json
    import os

    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.models.loader import dummy_params, model_config_from_hf
    from jaxserve.models.loaders.hf import _LAYER_TENSORS

    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 2048, "tie_word_embeddings": True, "vocab_size": vocab_size,
          "bos_token_id": 1, "eos_token_id": 2, **config}
    cfg = model_config_from_hf(hf)
    params = dummy_params(cfg, "float32", seed=seed)
    ours = {o: (n, t) for n, (o, t) in _LAYER_TENSORS.items()}
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if "lm_head" in params:
        tensors["lm_head.weight"] = np.asarray(params["lm_head"]).T
    for i, layer in enumerate(params["layers"]):
        for name, value in layer.items():
            hf_name, transpose = ours[name]
            tensors[f"model.layers.{i}.{hf_name}"] = np.asarray(value).T if transpose else np.asarray(value)
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return str(path)


def write_eagle3_head(path, target_cfg, draft_vocab: int, aux_layers=None, seed: int = 0,
                      zero_norm: bool = False, heads=(2, 1, 16), intermediate_size: int = 64) -> str:
    """A random-weight EAGLE3 head in HF format (LlamaForCausalLMEagle3: fc, midlayer, norm,
    lm_head over `draft_vocab` tokens, d2t), on the target's embedding and width. zero_norm:
    its final norm's weight is 0, so every logit is 0 and it always drafts draft id 0. heads:
    (query heads, kv heads, head dim) of its decoder layer (benchmarks/spec_decode.py gives a
    real head's shape)."""
    import json
    import os

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    d, (n, kh, e), f = target_cfg.hidden_size, heads, intermediate_size
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)
    ones = lambda k: (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    mid = {"input_layernorm.weight": ones(d), "hidden_norm.weight": ones(d),
           "self_attn.q_proj.weight": w(n * e, 2 * d), "self_attn.k_proj.weight": w(kh * e, 2 * d),
           "self_attn.v_proj.weight": w(kh * e, 2 * d), "self_attn.o_proj.weight": w(d, n * e),
           "post_attention_layernorm.weight": ones(d), "mlp.gate_proj.weight": w(f, d),
           "mlp.up_proj.weight": w(f, d), "mlp.down_proj.weight": w(d, f)}
    targets = np.sort(rng.choice(target_cfg.vocab_size, draft_vocab, replace=False))
    tensors = {"fc.weight": w(d, 3 * d), "norm.weight": ones(d), "lm_head.weight": w(draft_vocab, d),
               "d2t": (targets - np.arange(draft_vocab)).astype(np.int64),
               **{f"midlayer.{k}": v for k, v in mid.items()}}
    if zero_norm:
        tensors["norm.weight"] = np.zeros(d, np.float32)
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
          "intermediate_size": f, "num_hidden_layers": 1, "num_attention_heads": n,
          "num_key_value_heads": kh, "head_dim": e, "rms_norm_eps": 1e-5, "vocab_size": target_cfg.vocab_size,
          "draft_vocab_size": draft_vocab, "max_position_embeddings": 2048, "tie_word_embeddings": False}
    if aux_layers is not None:
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf, fh)
    return str(path)


def record_drafts(llm, prompts, max_tokens: int = 8) -> list[tuple[list[int], list[int]]]:
    """Greedy generation of `prompts` on a speculating engine; after every step, each running
    request's (token ids so far, the drafts its proposer just made)."""
    from jaxserve.sampling_params import SamplingParams

    proposer, scheduler = llm.engine.core.proposer, llm.engine.scheduler
    seen, observe = [], proposer.observe

    def recording(out, step, result):
        observe(out, step, result)
        seen.extend((list(scheduler.requests[rid].all_token_ids), d)
                    for rid, d in proposer._drafts.items() if rid in scheduler.requests)

    proposer.observe = recording
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                 use_tqdm=False)
    return seen
