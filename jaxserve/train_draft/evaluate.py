"""Acceptance measured by the engine itself: the held-out prompts generated greedily with
the written head as the `"eagle3"` proposer, and with the n-gram proposer beside it, the
mean acceptance length taken from the engine's spec-decode metrics (spec_decode/metrics.py),
and whether greedy output equals the output without speculation.
"""

from __future__ import annotations

from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.engine.builder import build_engine
from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.metrics import mean_acceptance_length


def make_llm(cfg, params, tokenizer, module, dtype, spec, max_len, max_num_seqs) -> LLM:
    """An offline engine on the already loaded target (no warm-up: it compiles on first use),
    its cache just big enough for max_num_seqs sequences of max_len (not most of the GPU's
    memory: the training runs beside it)."""
    blocks = max_num_seqs * -(-max_len // 16) + 2
    config = EngineConfig(
        model=cfg, cache=CacheConfig(block_size=16, num_kv_blocks=blocks),
        # 4 tokens a sequence a step: the prompts of finished sequences' successors prefill
        # beside the decodes instead of waiting for slots to drain
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(256, 4 * max_num_seqs),
                                  max_model_len=max_len),
        dtype=dtype, warmup=False, speculative=SpeculativeConfig.from_dict(spec))
    return LLM.from_engine(build_engine(config, params, tokenizer, module))


def engine_acceptance(cfg, params, tokenizer, module, dtype: str, head_dir: str,
                      prompts: list[list[int]], max_tokens: int, num_spec: int,
                      max_num_seqs: int = 8) -> dict:
    """{"eagle3": mean acceptance length, "ngram": the same, "num_speculative_tokens",
    "greedy_equal": eagle3's output == no speculation's} over `prompts`."""
    max_len = max(len(p) for p in prompts) + max_tokens + num_spec + 1
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    run = lambda llm: [list(o.outputs[0].token_ids) for o in llm.generate(inputs, greedy, use_tqdm=False)]
    plain = run(make_llm(cfg, params, tokenizer, module, dtype, None, max_len, max_num_seqs))
    report = {"num_prompts": len(prompts), "max_tokens": max_tokens}
    for k in dict.fromkeys((num_spec, 1)):       # the asked k, else the most the head takes
        try:
            eagle = make_llm(cfg, params, tokenizer, module, dtype,
                            {"method": "eagle3", "model": head_dir, "num_speculative_tokens": k},
                            max_len, max_num_seqs)
        except ValueError as e:
            if k == 1:
                raise
            report["note"] = f"eagle3 with {k} speculative tokens refused ({e}); measured with 1"
            continue
        before = eagle.get_metrics()
        out = run(eagle)
        report.update(num_speculative_tokens=k, greedy_equal=out == plain,
                      eagle3=mean_acceptance_length(before, eagle.get_metrics()))
        ngram = make_llm(cfg, params, tokenizer, module, dtype,
                        {"method": "ngram", "num_speculative_tokens": k}, max_len, max_num_seqs)
        before = ngram.get_metrics()
        run(ngram)
        report["ngram"] = mean_acceptance_length(before, ngram.get_metrics())
        break
    return report
