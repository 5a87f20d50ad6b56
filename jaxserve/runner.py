"""The model runner: SchedulerOutput -> padded StepInput -> one jitted step on the device.

Fixed shapes fill the role of CUDA graphs: the step's token count T is padded up to a
bucket (powers of two up to max_num_batched_tokens) and its sequence count to
S = min(T, max_num_seqs), so one compiled program per bucket covers every batch. Warm-up
compiles them all; after it nothing compiles. The KV cache is preallocated once and donated
to every step, so XLA updates it in place.

Legend: T tokens, S sequences, B blocks per sequence, P tokens per block, V vocabulary,
N logprobs returned per sequence.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import sampler
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.sampling_tensors import SamplingRow, make_sampling_tensors
from jaxserve.scheduler import SchedulerOutput
from jaxserve.step_input import StepInput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    token_ids: list[int | None]           # sampled token per chunk (None: the chunk did not sample)
    logprobs: np.ndarray | None           # f32[S] chosen token's logprob (when asked)
    top_ids: np.ndarray | None            # i32[S, N]
    top_logprobs: np.ndarray | None       # f32[S, N]


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    buckets, b = [], smallest
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_tokens]


def _step(params, kv_cache, x: StepInput, *, model, cfg: ModelConfig, attention_impl: str, num_top: int):
    kv_cache, hidden_TD = model.forward(cfg, params, kv_cache, x, attention_impl)
    logits_SV = model.compute_logits(cfg, params, hidden_TD[x.logits_indices])
    return kv_cache, sampler.sample(logits_SV, x.sampling, num_top)


class ModelRunner:
    def __init__(self, config: EngineConfig, params, model, num_blocks: int | None = None):
        self.config = config
        self.cfg = config.model
        self.params = params
        self.model = model
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = math.ceil(config.scheduler.max_model_len / self.block_size)
        self.buckets = token_buckets(config.scheduler.max_num_batched_tokens)
        self.dtype = jnp.dtype(config.dtype)
        self.num_blocks = num_blocks or config.cache.num_kv_blocks or self._blocks_from_budget()
        shape = (self.num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_cache = [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                         for _ in range(self.cfg.num_layers)]
        impl = config.attention_impl
        if impl == "auto":
            impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        self.attention_impl = impl
        self._steps = {}
        for num_top in sorted({0, config.max_logprobs}):
            fn = functools.partial(_step, model=model, cfg=self.cfg, attention_impl=impl, num_top=num_top)
            self._steps[num_top] = jax.jit(fn, donate_argnums=(1,))

    # -- sizing --------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return 2 * self.cfg.num_layers * self.block_size * self.cfg.num_kv_heads * self.cfg.head_dim \
            * self.dtype.itemsize

    def _blocks_from_budget(self) -> int:
        stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            budget = int(free * self.config.cache.kv_cache_memory_fraction)
        else:
            budget = self.config.cache.kv_cache_cpu_bytes
        # No use holding more than every sequence at full length.
        useful = self.config.scheduler.max_num_seqs * self.max_blocks_per_seq + 1
        return max(2, min(budget // self.bytes_per_block, useful))

    def bucket(self, num_tokens: int) -> tuple[int, int]:
        t = next(b for b in self.buckets if b >= num_tokens)
        return t, min(t, self.config.scheduler.max_num_seqs)

    # -- one step ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[StepInput, int]:
        """Host-side numpy StepInput for the step, and the static logprobs width it needs."""
        t_pad, s_pad = self.bucket(max(out.num_tokens, 1))
        p, b = self.block_size, self.max_blocks_per_seq
        token_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slots = np.zeros(t_pad, np.int32)
        seq_ids = np.zeros(t_pad, np.int32)
        qsl = np.zeros(s_pad + 1, np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        tables = np.zeros((s_pad, b), np.int32)
        logits_idx = np.zeros(s_pad, np.int32)
        rows = []
        t = 0
        for s, ch in enumerate(out.chunks):
            n = len(ch.token_ids)
            pos = np.arange(ch.start_position, ch.start_position + n, dtype=np.int32)
            blocks = np.asarray(ch.block_ids, np.int32)
            token_ids[t:t + n] = ch.token_ids
            positions[t:t + n] = pos
            slots[t:t + n] = blocks[pos // p] * p + pos % p
            seq_ids[t:t + n] = s
            qsl[s + 1] = t + n
            seq_lens[s] = ch.start_position + n
            tables[s, :len(blocks)] = blocks
            logits_idx[s] = t + n - 1
            req = ch.request
            rows.append(SamplingRow(params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
                                    output_token_ids=req.output_token_ids, seed=req.seed,
                                    offset=len(req.output_token_ids), eos_token_ids=req.eos_token_ids))
            t += n
        qsl[len(out.chunks) + 1:] = t
        tensors = make_sampling_tensors(rows, s_pad, self.cfg.vocab_size,
                                                self.config.scheduler.max_model_len)
        wants_logprobs = any(ch.sample and ch.request.sampling_params.logprobs is not None
                             for ch in out.chunks)
        x = StepInput(token_ids=token_ids, positions=positions, slot_mapping=slots,
                      token_seq_ids=seq_ids, query_start_loc=qsl, seq_lens=seq_lens,
                      block_tables=tables, logits_indices=logits_idx, sampling=tensors)
        return x, (self.config.max_logprobs if wants_logprobs else 0)

    def run(self, x: StepInput, num_top: int) -> sampler.SamplerOutput:
        """Dispatch one step (asynchronously); the cache is donated and replaced."""
        self.kv_cache, result = self._steps[num_top](self.params, self.kv_cache, jax.device_put(x))
        return result

    def execute(self, out: SchedulerOutput) -> StepResult:
        x, num_top = self.prepare(out)
        result = jax.device_get(self.run(x, num_top))
        ids = result.token_ids.tolist()
        return StepResult(
            token_ids=[ids[i] if ch.sample else None for i, ch in enumerate(out.chunks)],
            logprobs=result.logprobs if num_top else None,
            top_ids=result.top_ids if num_top else None,
            top_logprobs=result.top_logprobs if num_top else None)

    def warmup(self) -> None:
        """Compile every (bucket, logprobs width) program with an all-padding step."""
        empty = SchedulerOutput(chunks=[], num_tokens=0, preempted_ids=[], new_ids=[], num_cached_tokens=0)
        for t in self.buckets:
            x, _ = self.prepare(SchedulerOutput(**{**empty.__dict__, "num_tokens": t}))
            for num_top in self._steps:
                jax.block_until_ready(self.run(x, num_top))
        logger.info("compiled %d step programs", len(self.buckets) * len(self._steps))
