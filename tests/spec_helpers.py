"""Shared by the speculative decoding tests: engines with and without a proposer."""

from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.models import registry
from jaxserve.spec_decode.config import SpeculativeConfig


def make_llm(model, spec: dict | None = None, *, max_num_seqs=8, max_tokens=32, max_len=128,
             block_size=4, num_kv_blocks=None) -> LLM:
    cfg, params, tok = model
    config = EngineConfig(
        model=cfg, cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                                  max_model_len=max_len),
        dtype="float32", warmup=False, speculative=SpeculativeConfig.from_dict(spec))
    return LLM.from_engine(LLMEngine(config, params, tok, registry.get_model_module(cfg.architecture)))


def token_ids(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def spec_counts(llm) -> dict:
    return {k: v for k, v in llm.get_metrics().items() if k.startswith("spec_decode")}
