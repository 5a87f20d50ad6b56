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

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import packing, sampler
from jaxserve.compiling import StepCompiler
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.sampling_tensors import SamplingRow, make_sampling_tensors, needs_extras
from jaxserve.scheduler import PENDING_TOKEN, SchedulerOutput
from jaxserve.step_input import StepInput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """What a step computes besides the next tokens; each variant is its own compiled program.

    `lean` (no logprobs, no penalties/bias/masks, no top-k/top-p/min-p sort) is the common
    case; `full` adds all of that. Warm-up compiles both for every bucket. Prompt logprobs
    (logits at every position) are rare and compile on first use.
    """
    num_top: int = 0                # logprobs returned per sequence (0 or max_logprobs)
    full: bool = False              # penalties, logit_bias, masks and truncation in the program
    prompt_logprobs: bool = False   # also log-softmax every position's logits
    # At least this many sequence slots hold a chunk (0: not said, as for a step of skewed
    # contexts). Set only where it changes the attention kernel's tiling
    # (ModelRunner.attention_hint), so it adds few programs.
    busy_seqs: int = 0
    # The step's contexts are skewed, and the bucket tiles such steps apart (attention_hint).
    skewed: bool = False


@dataclasses.dataclass(frozen=True)
class StepResult:
    token_ids: list[int | None]           # sampled token per chunk (None: the chunk did not sample)
    logprobs: np.ndarray | None           # f32[S] chosen token's logprob (when asked)
    ranks: np.ndarray | None              # i32[S] its rank under the model's distribution
    top_ids: np.ndarray | None            # i32[S, N]
    top_logprobs: np.ndarray | None       # f32[S, N]
    # Per chunk asking prompt logprobs: (first position, logprob f32[n], top ids i32[n, N], top f32[n, N])
    prompt_logprobs: dict[int, tuple] | None = None


# A bucket of one token for batch-1 decode (one user, a notebook): padded to 16 tokens it ran
# 16 query rows through attention and the sampler (NOTE: measured on the H200, BENCHMARKS.md).
SINGLE_TOKEN_BUCKET = True


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Step sizes that get a compiled program: 1, then powers of two from `smallest`, then
    max_tokens (the step budget)."""
    buckets, b = [1] if SINGLE_TOKEN_BUCKET and max_tokens > 1 else [], smallest
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_tokens]


def _step(params, kv_cache, packed_W, prev_ids_M, *, model, cfg: ModelConfig, attention_impl: str,
          variant: StepVariant, layout: packing.Layout):
    x: StepInput = packing.unpack(packed_W, layout)
    # Tokens sampled by the previous step come straight from its device output: the host
    # need not have read them (DESIGN.md §6: step N+1 never waits for step N's tokens).
    from_prev_T = x.prev_token_rows >= 0
    token_ids_T = jnp.where(from_prev_T, prev_ids_M[jnp.maximum(x.prev_token_rows, 0)], x.token_ids)
    x = dataclasses.replace(x, token_ids=token_ids_T)
    kv_cache, hidden_TD = model.forward(cfg, params, kv_cache, x, attention_impl,
                                        busy_seqs=variant.busy_seqs, skewed=variant.skewed)
    logits_SV = model.compute_logits(cfg, params, hidden_TD[x.logits_indices])
    out = sampler.sample(logits_SV, x.sampling, variant.num_top, truncate=variant.full,
                         kernels=attention_impl != "xla")
    prompt = None
    if variant.prompt_logprobs:
        prompt = sampler.prompt_logprobs(model.compute_logits(cfg, params, hidden_TD),
                                         x.next_token_ids, variant.num_top)
    ids_M = jnp.zeros_like(prev_ids_M).at[:out.token_ids.shape[0]].set(out.token_ids)
    return kv_cache, out, prompt, ids_M


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A dispatched step whose results are still on the device."""
    out: SchedulerOutput
    x: StepInput                  # host copy of its input (query_start_loc is needed to unpack)
    variant: StepVariant
    result: sampler.SamplerOutput
    prompt: tuple | None


class ModelRunner:
    def __init__(self, config: EngineConfig, params, model, num_blocks: int | None = None, mesh=None):
        self.config = config
        self.cfg = config.model
        # One matmul per group of projections that share an input (unsharded only; see
        # models/llama.py fuse_projections). In place, so no second copy of the weights.
        if mesh is None and hasattr(model, "fuse_projections"):
            params = model.fuse_projections(config.model, params)
        self.params = params
        self.model = model
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = math.ceil(config.scheduler.max_model_len / self.block_size)
        self.buckets = token_buckets(config.scheduler.max_num_batched_tokens)
        self.dtype = jnp.dtype(config.dtype)
        self.num_blocks = num_blocks or config.cache.num_kv_blocks or self._blocks_from_budget()
        shape = (self.num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        # With a mesh (tensor / expert parallel) the cache is split by kv heads and step inputs
        # are replicated; jit partitions the step from the parameters' shardings.
        self.mesh = mesh
        self.input_sharding = None
        kv_sharding = None
        if mesh is not None:
            from jaxserve.sharding import rules
            self.input_sharding = rules.replicated(mesh)
            kv_sharding = rules.kv_cache_sharding(self.cfg, mesh)
        zeros = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=kv_sharding)
        self.kv_cache = [(zeros(), zeros()) for _ in range(self.cfg.num_layers)]
        # "auto": the model picks the Pallas kernels on a GPU where they apply, XLA elsewhere.
        # NOTE: the kernels are not wrapped in shard_map yet, so a mesh runs the XLA path.
        impl = self.attention_impl = "xla" if mesh is not None else config.attention_impl
        self._pallas_attention = (jax.default_backend() == "gpu" and hasattr(model, "kernel_impl")
                                  and model.kernel_impl(self.cfg, impl) == "pallas")
        self._tilings: dict[tuple[int, int], tuple[int, bool, bool]] = {}
        self._step = jax.jit(functools.partial(_step, model=model, cfg=self.cfg, attention_impl=impl),
                             donate_argnums=(1,), static_argnames=("variant", "layout"))
        self.warmup_variants = (StepVariant(), StepVariant(config.max_logprobs, full=True))
        # The previous step's sampled ids (padded to max_num_seqs) and its row of each request.
        self._prev_ids = jax.device_put(jnp.zeros(config.scheduler.max_num_seqs, jnp.int32),
                                        self.input_sharding)
        self._prev_rows: dict[str, int] = {}
        # Compiled step programs by (input layout, variant): warm-up fills it, run() uses it.
        # NOTE: the identity names what the jitted step closes over (and the fused-kernel
        # switch it reads from the environment while tracing): a stored program is loaded
        # only for the same ones (compiling.ProgramStore)
        from jaxserve.models.llama import FUSED_KERNELS_ENV
        identity = repr((getattr(model, "__name__", repr(model)), self.cfg, impl, repr(mesh),
                         os.environ.get(FUSED_KERNELS_ENV, "")))
        self._compiler = StepCompiler(self._step, self.params, self.kv_cache, self._prev_ids,
                                      self.input_sharding, store=config.program_cache_dir,
                                      identity=identity)
        self._executables = self._compiler.executables
        # Seconds spent tracing + lowering, compiling and loading stored step programs, summed
        # over programs.
        self.compile_seconds = self._compiler.seconds
        self._pending: dict[tuple, concurrent.futures.Future] = {}   # warm-up's compiles

    # -- sizing --------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes on each device (the cache is split over the tensor-parallel ones)."""
        return 2 * self.cfg.num_layers * self.block_size * self.cfg.num_kv_heads * self.cfg.head_dim \
            * self.dtype.itemsize // self.config.parallel.tensor_parallel_size

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

    def bucket_tilings(self, num_tokens: int, num_seqs: int) -> tuple[int, bool, bool]:
        """What the Pallas attention's tiling of a (num_tokens, num_seqs) bucket depends on:
        (its busy floor, whether a skewed step takes fill_splits, whether that needs a program
        of its own, i.e. differs from the bucket's tiling without a busy count). Computed once
        per bucket: prepare() runs every step."""
        key = (num_tokens, num_seqs)
        if key not in self._tilings:
            self._tilings[key] = (0, False, False)
            if self._pallas_attention:
                from jaxserve.pallas_kernels import ragged_paged_attention as rpa
                cfg = self.cfg
                kw = dict(context=self.max_blocks_per_seq * self.block_size,
                          head_dim=cfg.head_dim, itemsize=self.dtype.itemsize)
                shape = (num_tokens, num_seqs, cfg.num_heads, cfg.num_kv_heads)
                skew = rpa.special_decode_tiling(*shape, 0, skewed=True, **kw)
                skew_fills = bool(skew and skew.fill_splits)
                self._tilings[key] = (rpa.tiling_busy_floor(*shape, **kw), skew_fills,
                                      skew_fills and skew != rpa.special_decode_tiling(
                                          *shape, 0, **kw))
        return self._tilings[key]

    def attention_hint(self, num_tokens: int, num_seqs: int, busy: int,
                       contexts: np.ndarray | None = None) -> tuple[int, bool]:
        """The variant's (busy_seqs, skewed) for a step of `busy` chunks in a (num_tokens,
        num_seqs) bucket whose chunks' contexts (seq_lens) are `contexts`.

        busy_seqs: the least count from which the Pallas attention tiles this bucket's decode
        grid as a full one's, if `busy` reaches it; else 0. (A padded bucket with few chunks
        must not be tiled as a full one: ragged_paged_attention.tiling_busy_floor.)
        A step of skewed contexts (ragged_paged_attention.skewed_contexts) where the bucket
        takes fill_splits for them (each sequence split by its own keys: a full bucket's tiling
        is set by its longest context) gets busy_seqs 0, and skewed only where that tiling is
        not already the one without a busy count (16 and 32 slots at Llama-3.1-8B's heads:
        there busy_seqs 0 is fill_splits; 64: it needs a program of its own)."""
        floor, skew_fills, skew_apart = self.bucket_tilings(num_tokens, num_seqs)
        if skew_fills and contexts is not None:
            from jaxserve.pallas_kernels import ragged_paged_attention as rpa
            if rpa.skewed_contexts(contexts):
                return 0, skew_apart
        return (floor if floor and busy >= floor else 0), False

    def bucket(self, num_tokens: int) -> tuple[int, int]:
        t = next(b for b in self.buckets if b >= num_tokens)
        return t, min(t, self.config.scheduler.max_num_seqs)

    # -- one step ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[StepInput, StepVariant]:
        """Host-side numpy StepInput for the step, and the program variant it needs."""
        t_pad, s_pad = self.bucket(max(out.num_tokens, 1))
        p, b = self.block_size, self.max_blocks_per_seq
        # Per-token fields gather in Python lists (one numpy conversion each at the end): at
        # hundreds of one-token decode chunks that is several times cheaper than numpy slices.
        token_ids, positions, slots, seq_ids = [], [], [], []
        next_ids = np.zeros(t_pad, np.int32)
        prev_rows = np.full(t_pad, -1, np.int32)
        qsl = np.zeros(s_pad + 1, np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        tables = np.zeros((s_pad, b), np.int32)
        logits_idx = np.zeros(s_pad, np.int32)
        rows = []
        full = prompt_lp = False
        t = 0
        for s, ch in enumerate(out.chunks):
            req, n, start = ch.request, len(ch.token_ids), ch.start_position
            params = req.sampling_params
            blocks = ch.block_ids
            token_ids += ch.token_ids
            positions += range(start, start + n)
            slots += [blocks[q // p] * p + q % p for q in range(start, start + n)]
            seq_ids += [s] * n
            if ch.token_ids[-1] == PENDING_TOKEN:         # only ever the last one
                prev_rows[t + n - 1] = self._prev_rows[req.request_id]
                token_ids[-1] = 0
            qsl[s + 1] = t + n
            seq_lens[s] = start + n
            tables[s, :len(blocks)] = blocks
            logits_idx[s] = t + n - 1
            if params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                prompt_lp = True
                nxt = req.prompt_token_ids[start + 1:min(start + n, req.num_prompt_tokens - 1) + 1]
                next_ids[t:t + len(nxt)] = nxt
            # This step samples output token number `offset` (its predecessor may be pending).
            offset = req.num_generated - int(ch.sample)
            rows.append(SamplingRow(params=params, prompt_token_ids=req.prompt_token_ids,
                                    output_token_ids=req.output_token_ids, seed=req.seed,
                                    offset=offset, eos_token_ids=req.eos_token_ids))
            full = full or params.logprobs is not None or params.uses_truncation
            t += n
        pad = t_pad - t
        token_ids = np.array(token_ids + [0] * pad, np.int32)
        positions = np.array(positions + [0] * pad, np.int32)
        slots = np.array(slots + [0] * pad, np.int32)
        seq_ids = np.array(seq_ids + [0] * pad, np.int32)
        qsl[len(out.chunks) + 1:] = t
        full = full or prompt_lp or needs_extras(rows)
        tensors = make_sampling_tensors(rows, s_pad, self.cfg.vocab_size,
                                        self.config.scheduler.max_model_len, with_extras=full)
        x = StepInput(token_ids=token_ids, positions=positions, slot_mapping=slots,
                      token_seq_ids=seq_ids, query_start_loc=qsl, seq_lens=seq_lens,
                      block_tables=tables, logits_indices=logits_idx, next_token_ids=next_ids,
                      prev_token_rows=prev_rows, sampling=tensors)
        busy, skewed = self.attention_hint(t_pad, s_pad, len(out.chunks),
                                           seq_lens[:len(out.chunks)])
        variant = StepVariant(self.config.max_logprobs if full else 0, full, prompt_lp, busy,
                              skewed)
        return x, variant

    def run(self, x: StepInput, variant: StepVariant):
        """Dispatch one step (asynchronously); the cache is donated and replaced."""
        packed, layout = packing.pack(x)
        exe = self._executables.get((layout, variant))
        if exe is None and variant.skewed:
            # NOTE: a skewed step's program compiles in warm-up's background batch; until it is
            # ready the step runs as an even one (the same result, the attention tiled for
            # even contexts) rather than waiting for it
            exe = self._executables.get((layout, dataclasses.replace(variant, skewed=False)))
        if exe is None and (layout, variant) in self._pending:    # still compiling in warm-up
            try:
                self._pending[(layout, variant)].result()
                exe = self._executables[(layout, variant)]
            except Exception:
                logger.warning("a warm-up compile failed; compiling again", exc_info=True)
        if exe is None:           # a shape warm-up did not cover (or warm-up was off)
            exe = self._compile(layout, variant, len(packed))
        self.kv_cache, result, prompt, self._prev_ids = exe(
            self.params, self.kv_cache, jax.device_put(packed, self.input_sharding), self._prev_ids)
        return result, prompt

    def _compile(self, layout: packing.Layout, variant: StepVariant, num_words: int):
        """The step program for one input layout and variant, compiled ahead of time (and
        kept in self._executables)."""
        return self._compiler.compile(layout, variant, num_words)

    def dispatch(self, out: SchedulerOutput) -> InFlightStep:
        """Build and launch the step without waiting for the device."""
        x, variant = self.prepare(out)
        result, prompt = self.run(x, variant)
        self._prev_rows = {ch.request.request_id: i for i, ch in enumerate(out.chunks) if ch.sample}
        return InFlightStep(out, x, variant, result, prompt)

    def failing_chunks(self, out: SchedulerOutput) -> list[int]:
        """Indices of the chunks whose step inputs cannot be built even alone (after a
        dispatch failed): those requests fail; the others run on."""
        bad = []
        for i, ch in enumerate(out.chunks):
            try:
                self.prepare(dataclasses.replace(out, chunks=[ch], num_tokens=len(ch.token_ids)))
            except Exception:
                bad.append(i)
        return bad

    def collect(self, step: InFlightStep) -> StepResult:
        """Wait for a dispatched step and bring its sampled tokens (and logprobs) to the host."""
        out, variant = step.out, step.variant
        if variant.num_top or variant.prompt_logprobs:
            result, prompt = jax.device_get((step.result, step.prompt))
            ids = result.token_ids.tolist()
        else:                            # lean step: only the sampled ids come back
            result, prompt = None, None
            ids = np.asarray(step.result.token_ids).tolist()
        prompt_lps = None
        if prompt is not None:
            prompt_lps = {}
            qsl = step.x.query_start_loc
            for i, ch in enumerate(out.chunks):
                req = ch.request
                if req.sampling_params.prompt_logprobs is None or ch.start_position >= req.num_prompt_tokens:
                    continue
                # Position p's logits predict prompt token p + 1: keep p < num_prompt_tokens - 1.
                n = min(len(ch.token_ids), req.num_prompt_tokens - 1 - ch.start_position)
                sl = slice(qsl[i], qsl[i] + max(n, 0))
                prompt_lps[i] = (ch.start_position, prompt[0][sl], prompt[1][sl], prompt[2][sl])
        has_top = variant.num_top > 0
        return StepResult(
            token_ids=[ids[i] if ch.sample else None for i, ch in enumerate(out.chunks)],
            logprobs=result.logprobs if has_top else None,
            ranks=result.ranks if has_top else None,
            top_ids=result.top_ids if has_top else None,
            top_logprobs=result.top_logprobs if has_top else None,
            prompt_logprobs=prompt_lps)

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.collect(self.dispatch(out))

    def warmup(self) -> None:
        """Compile the lean and full program of every bucket, on a thread each: XLA compiles
        outside the GIL, so start-up takes about as long as the slowest program, not the sum.

        Returns once the lean programs are ready; the full ones (logprobs, top-k/p, penalties)
        finish in the background, and a step that needs one before then waits for it
        (`wait_for_warmup` waits for all). So do the skewed ones (a bucket's program for steps
        of skewed contexts, attention_hint), except that a skewed step runs as an even one
        until its program is ready: H200, cold, 8B engine (session 14, runs 10-11, two
        machines), the lean skewed program compiled up front with the others took the first
        token from 46.2 to 58.7 s. NOTE: measured on the H200 (BENCHMARKS.md, Start-up):
        waiting for all 18 programs of the 8B engine took 58 s of a 63 s cold start.
        While they compile, the engine thread blocks on one that a step needs (every request
        waits with it), and their lowering takes host time from the running steps."""
        empty = SchedulerOutput(chunks=[], num_tokens=0, preempted_ids=[], new_ids=[], num_cached_tokens=0)
        jobs = []
        for t in self.buckets:
            lean, _ = self.prepare(dataclasses.replace(empty, num_tokens=t))
            full = dataclasses.replace(lean, sampling=make_sampling_tensors(
                [], lean.num_seqs, self.cfg.vocab_size, self.config.scheduler.max_model_len))
            s = lean.num_seqs
            busy, _, skew_apart = self.bucket_tilings(t, s)   # a full bucket's own programs
            variants = self.warmup_variants + tuple(
                dataclasses.replace(v, busy_seqs=busy) for v in self.warmup_variants if busy)
            variants += tuple(dataclasses.replace(v, skewed=True)    # and a skewed step's
                              for v in self.warmup_variants if skew_apart)
            for variant in variants:
                packed, layout = packing.pack(full if variant.full else lean)
                jobs.append((layout, variant, len(packed)))

        later = [job for job in jobs if job[1].full or job[1].skewed]
        now = [job for job in jobs if job not in later]
        threads = os.cpu_count() or 1
        try:
            self._pending = self._compiler.start(now, threads)
            for future in list(self._pending.values()):
                future.result()
            # Only now the full and skewed ones: tracing and lowering hold the GIL, so lowering
            # them beside the lean ones slowed those (a warm start spent 12 s in warm-up).
            self._pending.update(self._compiler.start(later, threads))
        except Exception:  # NOTE: threads only save time; compile what is missing one by one
            logger.warning("parallel compilation failed; compiling one by one", exc_info=True)
            self.wait_for_warmup(raise_errors=False)
            for layout, variant, num_words in jobs:
                if (layout, variant) not in self._executables:
                    self._compile(layout, variant, num_words)
        logger.info("compiled %d lean step programs; %d full or skewed ones compile in the "
                    "background", len(now), len(later))

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        """Wait until every program warm-up started is compiled."""
        for future in self._pending.values():
            try:
                future.result()
            except Exception:
                if raise_errors:
                    raise
