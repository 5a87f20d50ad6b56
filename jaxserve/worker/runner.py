"""The model runner: SchedulerOutput -> padded StepInput -> one jitted step -> RunnerOutput.

Fixed shapes fill the role of CUDA graphs: the step's token count T is padded up to a
bucket (powers of two up to max_num_batched_tokens) and its sequence count to
S = min(T, max_num_seqs), so one compiled program per bucket covers every batch. Warm-up
compiles them all; after it nothing compiles. The caches (one dict of arrays per layer, from
the model's cache specs) are preallocated once and donated to every step, so XLA updates
them in place. The runner's own copy of the running requests is its persistent batch
(input_batch.py); the attention backend (models/attention.py) plans each step's attention.

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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.worker import packing
from jaxserve.sample import sampler
from jaxserve.worker import hosts
from jaxserve.worker.compiling import StepCompiler, wait_all
from jaxserve.config import EngineConfig
from jaxserve.worker.input_batch import InputBatch, StepPlan, and_grammar_masks
from jaxserve.core.kv_cache import manager as cache_manager
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.models.attention import AttentionBackend, AttentionPlan
from jaxserve.sample.tensors import make_sampling_tensors
from jaxserve.spec_decode import drafting
from jaxserve.sample import rejection_sampler
from jaxserve.worker import verify_rows
from jaxserve.worker.state_copies import StateCopier
from jaxserve.core.step_input import StepInput
from jaxserve.core.step_messages import (GrammarMasks, PromptLogprobs, RunnerOutput,
                                         SchedulerOutput, TokenLogprobs)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """What a step computes besides the next tokens; each variant is its own compiled program.

    `lean` (no logprobs, no penalties/bias/masks, no top-k/top-p/min-p sort) is the common
    case; `full` adds all of that. Warm-up compiles both for every bucket, and with a
    tokenizer a third, lean but with the allowed-token mask (its input layout differs), for
    steps whose only extra is a grammar's mask (jaxserve/structured/). Prompt logprobs
    (logits at every position) are rare and compile on first use.
    """
    num_top: int = 0                # logprobs returned per sequence (0 or max_logprobs)
    full: bool = False              # penalties, logit_bias, masks and truncation in the program
    prompt_logprobs: bool = False   # also log-softmax every position's logits
    attention: AttentionPlan = AttentionPlan()   # the attention backend's plan (opaque here)
    hidden: bool = False            # also return hidden states (a proposer's input): the final
                                    # ones, or those after `aux_layers`, concatenated
    aux_layers: tuple[int, ...] = ()
    steps: int = 1                  # multi-step decode: decode steps in one program (_decode_steps)


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


def _step_on_mesh(*args, mesh, **kwargs):
    """_step traced with `mesh` as the ambient (abstract) mesh, so kernel call sites can wrap
    their kernels per shard (sharding/kernels.py). Set here, inside the traced function, not
    around the runner's calls: warm-up lowers on threads, and a mesh context is per thread."""
    if mesh is None:
        return _step(*args, **kwargs)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return _step(*args, **kwargs)


def _step(params, caches, packed_W, prev_ids_MC, *, model, cfg, backend: AttentionBackend,
          fused: frozenset, block_size: int, variant: StepVariant, layout: packing.Layout):
    x: StepInput = packing.unpack(packed_W, layout)
    # Tokens sampled by the previous step come straight from its device output: the host
    # need not have read them (DESIGN.md §2: step N+1 never waits for step N's tokens). So
    # do the drafts a proposer made on the device after it (prev_ids_MC's other columns).
    from_prev_T = x.prev_token_rows >= 0
    token_ids_T = jnp.where(from_prev_T, prev_ids_MC.reshape(-1)[jnp.maximum(x.prev_token_rows, 0)],
                            x.token_ids)
    x = dataclasses.replace(x, token_ids=token_ids_T)
    if x.draft_rows is not None:   # each draft row verifies the token after its position
        last = token_ids_T.shape[0] - 1
        x = dataclasses.replace(x, draft_token_ids=jnp.where(
            x.draft_token_ids >= 0, token_ids_T[jnp.minimum(x.logits_indices + 1, last)], -1))
    kernels = model.make_kernels(cfg, backend, variant.attention, fused)
    if variant.steps > 1:
        caches, out, last_ids_S = _decode_steps(params, caches, x, model=model, cfg=cfg,
                                                kernels=kernels, backend=backend,
                                                variant=variant, block_size=block_size)
        ids_MC = jnp.zeros_like(prev_ids_MC).at[:last_ids_S.shape[0], 0].set(last_ids_S)
        return caches, out, None, ids_MC, None
    if variant.aux_layers:
        caches, hidden_TD, aux = model.forward(cfg, params, caches, x, kernels, variant.aux_layers)
    else:
        caches, hidden_TD, aux = model.forward(cfg, params, caches, x, kernels)
    logits_SV = model.compute_logits(cfg, params, hidden_TD[x.logits_indices], kernels)
    out, last_ids_S = _sample(logits_SV, x, variant, backend)
    prompt = None
    if variant.prompt_logprobs:
        prompt = sampler.prompt_logprobs(model.compute_logits(cfg, params, hidden_TD, kernels),
                                         x.next_token_ids, variant.num_top)
    ids_MC = jnp.zeros_like(prev_ids_MC).at[:last_ids_S.shape[0], 0].set(last_ids_S)
    if not variant.hidden:
        return caches, out, prompt, ids_MC, None
    if aux:
        # forward gives one stream per layer, in layer order; the proposer's order may repeat one
        layer_ids = sorted(set(variant.aux_layers))
        hidden_TD = jnp.concatenate([aux[layer_ids.index(i)] for i in variant.aux_layers], -1)
    return caches, out, prompt, ids_MC, (hidden_TD, *_after_step(x, out))


def _decode_steps(params, caches, x: StepInput, *, model, cfg, kernels, backend, variant,
                  block_size: int):
    """Multi-step decode (scheduler.py): `variant.steps` one-token-per-sequence decode steps
    in one program, each feeding its sampled ids to the next. Returns (caches, the sampler's
    output of every step, stacked: token_ids i32[steps, S], the logprobs fields too when the
    variant returns them, each sequence's last id).

    Step i's input is the first step's shifted by i positions: its K/V slot is read off the
    block table, and nothing is written past the table's blocks (a request nearing its
    longest length was given blocks up to it only; its tokens past that are never read)."""
    num_tokens, p = x.num_tokens, block_size
    width = x.block_tables.shape[1]
    real_T = jnp.arange(num_tokens) < x.query_start_loc[-1]
    live_S = x.seq_lens > 0

    def one(i, caches, token_ids_T):
        positions_T = x.positions + i
        block_T = positions_T // p
        slots_T = x.block_tables[x.token_seq_ids, jnp.minimum(block_T, width - 1)] * p + positions_T % p
        xi = dataclasses.replace(
            x, token_ids=token_ids_T, positions=positions_T,
            slot_mapping=jnp.where(real_T & (block_T < width), slots_T, 0),
            seq_lens=jnp.where(live_S, jnp.minimum(x.seq_lens + i, width * p), 0),
            sampling=dataclasses.replace(x.sampling, offsets=x.sampling.offsets + i))
        caches, hidden_TD, _ = model.forward(cfg, params, caches, xi, kernels)
        logits_SV = model.compute_logits(cfg, params, hidden_TD[xi.logits_indices], kernels)
        out = _sample(logits_SV, xi, variant, backend)[0]
        ids_S = out.token_ids.astype(jnp.int32)
        # a lean step keeps its ids alone (its logprobs would be computed for nothing)
        if not variant.num_top:
            return caches, sampler.SamplerOutput(ids_S, None, None, None, None)
        return caches, dataclasses.replace(out, token_ids=ids_S)

    def body(i, carry):
        caches, acc = carry
        # each sequence holds one token of a decode step: after the first, its last sampled id
        token_ids_T = jnp.where(i == 0, x.token_ids,
                                acc.token_ids[jnp.maximum(i - 1, 0)][x.token_seq_ids])
        caches, out = one(i, caches, token_ids_T)
        return caches, jax.tree.map(lambda a, v: a.at[i].set(v), acc, out)

    k, s, n = variant.steps, x.num_seqs, variant.num_top
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros((k,) + shape, dtype)  # noqa: E731
    acc = sampler.SamplerOutput(zeros(s, dtype=jnp.int32), *(
        (zeros(s), zeros(s, dtype=jnp.int32), zeros(s, n, dtype=jnp.int32), zeros(s, n))
        if n else (None,) * 4))
    caches, acc = jax.lax.fori_loop(0, k, body, (caches, acc))
    return caches, acc, acc.token_ids[-1]


def _after_step(x: StepInput, out):
    """(next_ids i32[T], kept_rows i32[S]): what a proposer running after the step on its
    hidden states reads besides them (spec_decode/hidden_steps.py). next_ids: the token after
    each position as the step knows it, the next input token or, at a logits row, the token
    the step emitted there (after a chunk's last input, what it sampled; after a draft, the
    target's own choice). kept_rows: each sequence's last position whose input it keeps (its
    last accepted draft, else its last token): the proposer's pass there drafts its next token."""
    t, s = x.num_tokens, x.num_seqs
    next_T = jnp.concatenate([x.token_ids[1:], jnp.zeros(1, jnp.int32)])
    real_R = x.query_start_loc[1:] > x.query_start_loc[:-1]
    if x.draft_rows is None:
        emitted_R, kept_S = out.token_ids, x.logits_indices
    else:
        emitted_R = out.rows.token_ids
        real_R = jnp.concatenate([real_R, x.draft_token_ids[s:] >= 0])
        kept_S = x.logits_indices[:s] - x.num_drafts + out.num_accepted
    rows_R = jnp.where(real_R, x.logits_indices, t)       # padding rows write nothing
    next_T = next_T.at[rows_R].set(emitted_R.astype(jnp.int32), mode="drop")
    return next_T, kept_S.astype(jnp.int32)


def _sample(logits_RV, x: StepInput, variant: StepVariant, backend: AttentionBackend):
    """(the step's sampler output, each sequence's last new token). A step that carries
    drafts (x.draft_rows: a static part of its layout, so a step without them compiles
    exactly as before) verifies them instead: rejection_sampler.verify."""
    kernels = backend.impl != "xla"
    if x.draft_rows is None:
        out = sampler.sample(logits_RV, x.sampling, variant.num_top, truncate=variant.full,
                             kernels=kernels)
        return out, out.token_ids
    out = rejection_sampler.verify(logits_RV, x.sampling, x.draft_token_ids, x.draft_rows,
                                   x.num_drafts, variant.num_top, truncate=variant.full,
                                   kernels=kernels)
    return out, out.last_ids


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A dispatched step whose results are still on the device."""
    plan: StepPlan
    variant: StepVariant
    result: sampler.SamplerOutput | rejection_sampler.VerifyOutput
    prompt: tuple | None
    # What a proposer running after the step reads (variant.hidden), on the device: f[T, D]
    # hidden states, the token after each position and each sequence's last kept row (_after_step)
    hidden: jax.Array | None = None
    next_ids: jax.Array | None = None
    kept_rows: jax.Array | None = None
    inputs: StepInput | None = None   # the step's host-side input (numpy)


def allocate_caches(specs, num_blocks: int, num_slots: int, block_size: int, dtype,
                    sharding_of=None) -> list[dict[str, jax.Array]]:
    """Zeroed device arrays of every layer's cache spec: paged arrays [num_blocks, P, *shape],
    state arrays [num_slots, *shape]; `sharding_of(name, shape)` places them (None: default)."""
    caches, makers = [], {}
    for spec in specs:
        lead = (num_blocks, block_size) if isinstance(spec, PagedSpec) else (num_slots,)
        layer = {}
        for name, shape in spec.arrays:
            full = lead + tuple(shape)
            out = sharding_of(name, full) if sharding_of else None
            kind = jnp.float32 if name in getattr(spec, "float32", ()) else dtype
            # One compiled zeros per distinct array (not per layer: 4 s of start-up at 8B)
            key = (full, jnp.dtype(kind).name, out)
            if key not in makers:
                makers[key] = jax.jit(lambda s=full, d=kind: jnp.zeros(s, d), out_shardings=out)
            layer[name] = makers[key]()
        caches.append(layer)
    return caches


class ModelRunner:
    def __init__(self, config: EngineConfig, params, model, num_blocks: int | None = None, mesh=None,
                 device=None):
        """device: without a mesh, the one device to run on (default: jax's default device)."""
        self.config = config
        self.device = device
        self.cfg = config.model
        self.model = model
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = math.ceil(config.scheduler.max_model_len / self.block_size)
        self.buckets = token_buckets(config.scheduler.max_num_batched_tokens)
        self.dtype = jnp.dtype(config.dtype)
        # Under a mesh the kernels run per `model` shard, or on replicated inputs
        # (sharding/kernels.py), so the impl is the configured one with or without a mesh.
        self.backend = AttentionBackend(self.cfg, config.attention_impl,
                                        context=self.max_blocks_per_seq * self.block_size,
                                        itemsize=self.dtype.itemsize)
        self.attention_impl = self.backend.impl
        fused = frozenset(config.fused_kernels)
        # The weights re-laid for the step's kernels, in place (the family's contract)
        self.params = params = model.prepare_weights(self.cfg, params, fused=fused, mesh=mesh,
                                                     backend=self.backend)
        self.cache_specs = model.cache_specs(self.cfg)
        # A proposer's cache on the target's block tables (MTP, EAGLE3) is sized with it.
        self.proposer_cache_specs, self.proposer_weight_bytes = drafting.cache_on_target_blocks(
            config.speculative, model, self.cfg)
        self.group_kinds = cache_manager.group_kinds(self.cache_specs)
        # Speculating with recurrent state: a snapshot slot per live slot, past the scheduler's
        # slots, holds a request's state from before its verifying step (scheduler.py: rollback)
        self.num_state_snapshots = (config.scheduler.max_num_seqs if config.speculative is not None
                                    and cache_manager.STATE in self.group_kinds else 0)
        self.num_blocks, self.num_slots, self.num_cached_states = self._size_caches(num_blocks)
        # With a mesh (tensor / expert parallel) each cache array is placed by its name's rule
        # (k / v by kv heads, MLA latents replicated, DeltaNet states by head) and step inputs
        # are replicated; jit partitions the step from the parameters' shardings.
        self.mesh = mesh
        self.input_sharding = None
        sharding_of = None
        if mesh is not None:
            from jaxserve.sharding import rules
            self.input_sharding = rules.replicated(mesh)
            sharding_of = functools.partial(rules.cache_array_sharding, self.cfg, mesh)
        elif device is not None:     # a data-parallel replica's device (engine/data_parallel.py)
            self.input_sharding = jax.sharding.SingleDeviceSharding(device)
            self.params = params = jax.device_put(params, device)
            sharding_of = lambda name, shape: self.input_sharding   # noqa: E731
        self.kv_cache = allocate_caches(self.cache_specs, self.num_blocks,
                                        self.num_slots + self.num_state_snapshots,
                                        self.block_size, self.dtype, sharding_of)
        # Hybrid prefix caching and speculation: saved states and snapshots in and out of the
        # live slots (state_copies.py)
        self.state_copier = None
        if self.num_cached_states or self.num_state_snapshots:
            self.state_copier = StateCopier(
                [i for i, spec in enumerate(self.cache_specs) if not isinstance(spec, PagedSpec)],
                config.scheduler.max_num_seqs)
        self._step = jax.jit(functools.partial(_step_on_mesh, mesh=mesh, model=model, cfg=self.cfg,
                                               backend=self.backend, fused=fused,
                                               block_size=self.block_size),
                             donate_argnums=(1,), static_argnames=("variant", "layout"))
        self.return_hidden_states(False)
        self.batch = InputBatch(max_num_seqs=config.scheduler.max_num_seqs,
                                max_blocks_per_seq=self.max_blocks_per_seq,
                                block_size=self.block_size, vocab_size=self.cfg.vocab_size,
                                max_model_len=config.scheduler.max_model_len,
                                group_kinds=self.group_kinds,
                                max_spec_tokens=config.num_speculative_tokens)
        # The previous step's sampled ids (padded to max_num_seqs), a row per sequence, then the
        # drafts a proposer made on the device after it (spec_decode/hidden_steps.py writes them).
        self.draft_columns = drafting.device_draft_columns(config.speculative)
        self.batch.prev_stride = 1 + self.draft_columns
        self.prev_ids = jax.device_put(
            jnp.zeros((config.scheduler.max_num_seqs, self.batch.prev_stride), jnp.int32),
            self.input_sharding)
        self.grammar_masks = False    # steps may carry grammar masks (use_grammar_masks)
        # Compiled step programs by (input layout, variant): warm-up fills it, run() uses it.
        # NOTE: the identity names what the jitted step closes over: a stored program is
        # loaded only for the same ones (compiling.ProgramStore)
        identity = repr((model.module.__name__, self.cfg, self.backend.impl,
                         repr(mesh), sorted(fused)))
        self._compiler = StepCompiler(self._step, self.params, self.kv_cache, self.prev_ids,
                                      self.input_sharding, store=config.program_cache_dir,
                                      identity=identity)
        self._executables = self._compiler.executables
        # Seconds spent tracing + lowering, compiling and loading stored step programs, summed
        # over programs.
        self.compile_seconds = self._compiler.seconds
        self._pending: dict[tuple, concurrent.futures.Future] = {}   # warm-up's compiles
        # Told every device program a step launches, before it launches: on several hosts the
        # broadcaster that makes the other hosts launch it too (jaxserve/distributed.py)
        self.step_tap = None
        self._lean_keys: dict[int, tuple] = {}   # bucket -> (layout, variant) of its lean program

    def use_grammar_masks(self, on: bool = True) -> None:
        """Steps may carry grammar masks (the engine's structured output): warm-up also
        compiles the lean program with the allowed-token mask. Call before warm-up."""
        self.grammar_masks = on

    def last_sampled(self) -> dict[str, int]:
        """Each request's token sampled by the last dispatched step, by request id, read from
        the device (waits for that step's ids only): what a grammar's next mask needs."""
        ids = np.asarray(self.prev_ids).reshape(-1)
        return {rid: int(ids[i]) for rid, i in self.batch.prev_rows.items()}

    def return_hidden_states(self, on: bool = True, aux_layers: tuple[int, ...] = ()) -> None:
        """Every step also returns its hidden states (InFlightStep.hidden): the final ones, or
        the residual stream after `aux_layers` concatenated. For proposers that read them
        (spec_decode/mtp.py, eagle3.py); call before warm-up."""
        self.keep_hidden, self.aux_layers = on, tuple(aux_layers) if on else ()
        self.warmup_variants = tuple(
            StepVariant(num_top, full=full, hidden=on, aux_layers=self.aux_layers)
            for num_top, full in ((0, False), (self.config.max_logprobs, True)))

    # -- sizing --------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes on each device (the cache is split over the tensor-parallel ones)."""
        return cache_manager.bytes_per_block(self.cache_specs + self.proposer_cache_specs,
                                             self.block_size, self.dtype.itemsize) \
            // self.config.parallel.tensor_parallel_size

    def _size_caches(self, num_blocks: int | None) -> tuple[int, int, int]:
        """(blocks, state slots, of those the saved states' for prefix hits): given,
        configured, or from the memory budget (which pays for the snapshot slots too)."""
        max_seqs = self.config.scheduler.max_num_seqs
        num_blocks = num_blocks or self.config.cache.num_kv_blocks
        budget = None
        if not num_blocks:
            first = self.device or jax.local_devices()[0]
            stats = first.memory_stats() if jax.default_backend() != "cpu" else None
            if stats and "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                budget = int(free * self.config.cache.kv_cache_memory_fraction)
            else:
                budget = self.config.cache.kv_cache_cpu_bytes
            # a proposer's weights (an EAGLE3 head) load after the sizing: their bytes first
            budget = (budget - self.proposer_weight_bytes) * self.config.parallel.tensor_parallel_size
            budget = hosts.agree_min(budget)     # every host sizes the same cache
        cached = self._num_cached_states(budget)
        if num_blocks:
            num_slots = max_seqs + 1 + cached if cache_manager.STATE in self.group_kinds else 0
            return num_blocks, num_slots, cached
        # No use holding more than every sequence at full length.
        useful = max_seqs * self.max_blocks_per_seq + 1
        blocks, slots = cache_manager.size_caches(
            self.cache_specs + self.proposer_cache_specs, block_size=self.block_size,
            itemsize=self.dtype.itemsize, budget_bytes=budget, max_num_seqs=max_seqs,
            useful_blocks=useful, cached_states=cached + self.num_state_snapshots)
        return blocks, slots - self.num_state_snapshots, cached

    def _num_cached_states(self, budget: int | None) -> int:
        """Saved states for hybrid prefix caching: configured, or cache_manager's default."""
        cache = self.config.cache
        if not cache.enable_prefix_caching or cache_manager.STATE not in self.group_kinds:
            return 0
        if cache.num_cached_states is not None:
            return cache.num_cached_states
        return cache_manager.auto_cached_states(self.cache_specs, itemsize=self.dtype.itemsize,
                                                budget_bytes=budget,
                                                max_num_seqs=self.config.scheduler.max_num_seqs)

    def bucket(self, num_tokens: int) -> tuple[int, int]:
        t = next(b for b in self.buckets if b >= num_tokens)
        return t, min(t, self.config.scheduler.max_num_seqs)

    # -- one step ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, grammar_masks: Callable[[], GrammarMasks] | None = None
                ) -> tuple[StepInput, StepPlan, StepVariant]:
        """Take in the step's diffs; its host-side numpy StepInput, plan and program variant.
        `grammar_masks`: () -> the step's grammar masks, ANDed into its sampling masks."""
        self.batch.apply(out)
        x, plan, variant = self._build(out)
        if grammar_masks is not None:   # last: they may wait for the last step's tokens
            and_grammar_masks(x.sampling.allowed_mask, plan, grammar_masks())
        return x, plan, variant

    def _build(self, out: SchedulerOutput) -> tuple[StepInput, StepPlan, StepVariant]:
        t_pad, s_pad = self.bucket(max(out.num_tokens, 1))
        x, plan = self.batch.build(out, t_pad, s_pad)
        n = len(out.scheduled)
        attention = self.backend.plan(t_pad, s_pad, n, np.asarray(x.seq_lens[:n]))
        steps = out.num_steps
        if steps > 1 and (plan.prompt_logprobs or self.keep_hidden or x.draft_rows is not None
                          or out.num_tokens != n or not all(plan.samples)):
            raise RuntimeError(f"a {steps}-step decode needs one sampled token per request "
                               f"(scheduler.Scheduler._steps_ok)")
        variant = StepVariant(self.config.max_logprobs if plan.full else 0, plan.full,
                              plan.prompt_logprobs, attention, self.keep_hidden, self.aux_layers,
                              steps)
        return x, plan, variant

    def run(self, x: StepInput, variant: StepVariant):
        """Dispatch one step (asynchronously); the caches are donated and replaced. Returns
        (sampler output, prompt logprobs or None, (hidden states, next ids, kept rows) or
        None), on the device."""
        packed, layout = packing.pack(x)
        exe = self._executables.get((layout, variant))
        if exe is None and variant.attention.skewed:
            # NOTE: a skewed step's program compiles in warm-up's background batch; until it is
            # ready the step runs as an even one (the same result, the attention tiled for
            # even contexts) rather than waiting for it
            even = dataclasses.replace(variant, attention=AttentionPlan())
            exe = self._executables.get((layout, even))
            variant = even if exe is not None else variant
        if exe is None:
            exe = self.program(layout, variant, len(packed))
        if self.step_tap is not None:     # other hosts run the same program (distributed.py)
            self.step_tap.step(layout, variant, packed)
        return self.launch(exe, packed)

    def program(self, layout: packing.Layout, variant: StepVariant, num_words: int):
        """The compiled step program of this exact key: compiled, compiling in warm-up
        (waited for), or compiled now."""
        exe = self._executables.get((layout, variant))
        if exe is None and (layout, variant) in self._pending:    # still compiling in warm-up
            try:
                self._pending[(layout, variant)].result()
                exe = self._executables[(layout, variant)]
            except Exception:
                logger.warning("a warm-up compile failed; compiling again", exc_info=True)
        if exe is None:           # a shape warm-up did not cover (or warm-up was off)
            exe = self._compile(layout, variant, num_words)
        return exe

    def launch(self, exe, packed: np.ndarray):
        """Run a compiled step program on the packed input; the caches are replaced."""
        self.kv_cache, result, prompt, self.prev_ids, hidden = exe(
            self.params, self.kv_cache, jax.device_put(packed, self.input_sharding), self.prev_ids)
        return result, prompt, hidden

    def _compile(self, layout: packing.Layout, variant: StepVariant, num_words: int):
        """The step program for one input layout and variant, compiled ahead of time (and
        kept in self._executables)."""
        return self._compiler.compile(layout, variant, num_words)

    def dispatch(self, out: SchedulerOutput,
                 grammar_masks: Callable[[], GrammarMasks] | None = None) -> InFlightStep:
        """Build and launch the step without waiting for the device (with a hybrid model's
        state copies before and after it: state_copies.py). `grammar_masks`: () -> the step's
        grammar masks (the engine's structured output), which the runner ANDs into the step's
        sampling masks; called once the step is built, as it may wait for the last step."""
        if out.state_loads:   # first: a step taken back after this keeps its requests' loads
            self.copy_states(out.state_loads)
        x, plan, variant = self.prepare(out, grammar_masks)
        result, prompt, after = self.run(x, variant)
        if out.state_saves:
            self.copy_states(out.state_saves)
        stride = self.batch.prev_stride
        self.batch.prev_rows = {rid: i * stride for i, (rid, s) in enumerate(zip(plan.req_ids, plan.samples)) if s}
        return InFlightStep(plan, variant, result, prompt, *(after or (None, None, None)), inputs=x)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state slots (src, dst) on the device (hybrid prefix caching)."""
        if self.step_tap is not None:
            self.step_tap.copy_states(pairs)
        self.kv_cache = self.state_copier(self.kv_cache, pairs)

    def failing_requests(self, out: SchedulerOutput) -> list[int]:
        """Indices of the scheduled requests whose step inputs cannot be built even alone
        (after a dispatch failed): those requests fail; the others run on."""
        bad = []
        for i, sched in enumerate(out.scheduled):
            try:
                self._build(dataclasses.replace(out, scheduled=[sched], num_tokens=sched.num_tokens))
            except Exception:
                bad.append(i)
        return bad

    def collect(self, step: InFlightStep) -> RunnerOutput:
        """Wait for a dispatched step, bring its sampled tokens (and logprobs) to the host and
        append them to the persistent batch."""
        plan, variant = step.plan, step.variant
        # A verifying step's rows are its sequences' then its drafts' (spec_decode/verify_rows.py)
        rows_out = step.result.rows if plan.draft_starts else step.result
        accepted = step.result.num_accepted if plan.draft_starts else None
        if variant.num_top or variant.prompt_logprobs:
            result, prompt, accepted = jax.device_get((rows_out, step.prompt, accepted))
            ids = result.token_ids.tolist()
        elif accepted is not None:       # lean verifying step: ids and counts come back
            result, prompt = None, None
            ids, accepted = jax.device_get((rows_out.token_ids, accepted))
            ids = ids.tolist()
        else:                            # lean step: only the sampled ids come back
            result, prompt = None, None
            ids = np.asarray(rows_out.token_ids).tolist()
        if variant.steps > 1:            # multi-step decode: ids[i][s], every request samples
            sampled = [list(column) for column in zip(*ids)][:len(plan.samples)]
            kept_rows = None
        elif not plan.draft_starts:      # one token per sampling request (the common case)
            sampled = [[t] if s else [] for t, s in zip(ids, plan.samples)]
            kept_rows = None
        else:
            accepted = accepted.tolist()
            kept_rows = [verify_rows.kept_rows(i, plan.draft_starts, accepted[i])
                         for i in range(len(plan.samples))]
            sampled = [[ids[r] for r in rows] if s else [] for rows, s in zip(kept_rows, plan.samples)]
        for i, (req, tokens) in enumerate(zip(plan.requests, sampled)):
            if tokens and plan.is_void(i):     # never read: the scheduler took it back
                sampled[i] = []
                continue
            self.batch.append_tokens(req, tokens)
        logprobs = [None] * len(sampled)
        if variant.num_top:
            for i, s in enumerate(plan.samples):
                if s and sampled[i]:
                    # multi-step: request i's row of every step; else its kept rows
                    rows = (slice(None), i) if variant.steps > 1 else kept_rows[i] if kept_rows else [i]
                    logprobs[i] = TokenLogprobs(result.logprobs[rows], result.ranks[rows],
                                                result.top_ids[rows], result.top_logprobs[rows])
        prompt_lps = {}
        if prompt is not None:
            qsl = plan.query_start_loc
            for i, rid in enumerate(plan.req_ids):
                if rid in plan.prompt_lp_starts:
                    start, n = plan.prompt_lp_starts[rid]
                    sl = slice(qsl[i], qsl[i] + n)
                    prompt_lps[rid] = PromptLogprobs(start, prompt[0][sl], prompt[1][sl], prompt[2][sl])
        return RunnerOutput(req_ids=list(plan.req_ids), sampled_token_ids=sampled,
                            logprobs=logprobs, prompt_logprobs=prompt_lps)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(out))

    def warmup(self, background: bool = False, lean_only: bool = False) -> None:
        """Compile the lean and full program of every bucket, on a thread each: XLA compiles
        outside the GIL, so start-up takes about as long as the slowest program, not the sum.

        Returns once the lean programs are ready; the full ones (logprobs, top-k/p, penalties)
        finish in the background, and a step that needs one before then waits for it
        (`wait_for_warmup` waits for all). So do the attention backend's other plans (a full
        bucket's, a skewed step's), except that a skewed step runs as an even one until its
        program is ready. NOTE: measured on the H200 (BENCHMARKS.md, Start-up): compiling the
        skewed programs up front delayed the 8B engine's first token by 12 s.

        background: return at once, all of them compiling (a draft model's runner: the
        target's plain programs are the ones start-up waits for). lean_only: no full programs
        (a draft model samples greedily: its steps never run one)."""
        empty = SchedulerOutput(new_requests=[], scheduled=[], finished_req_ids=[], num_tokens=0,
                                preempted_ids=[], num_cached_tokens=0)
        jobs, verifying, masked_layouts = [], [], set()
        k = self.config.num_speculative_tokens
        variants = self.warmup_variants[:1] if lean_only else self.warmup_variants
        for t_prev, t in zip([0] + self.buckets, self.buckets):
            lean, _, _ = self._build(dataclasses.replace(empty, num_tokens=t))
            inputs = [(lean, self._with_sampling(lean, lean.num_seqs, True))]
            # every draft-row count a verifying step of this bucket can have
            for d in verify_rows.warmup_draft_rows(t_prev, t, k, self.config.scheduler.max_num_seqs) if k else ():
                rows = lean.num_seqs + d
                inputs.append(tuple(verify_rows.with_draft_rows(
                    lean, d, k, self._with_sampling(lean, rows, extras).sampling)
                    for extras in (False, True)))
            masked = self._masked_input(lean)
            # multi-step decode (scheduler.py): a decode bucket's plain programs (lean and
            # full) again, running `steps` steps
            steps = self.config.scheduler.num_scheduler_steps
            multi = steps > 1 and t_prev < self.config.scheduler.max_num_seqs
            for attention in self.backend.warmup_plans(t, lean.num_seqs):
                for i, (lean_x, full_x) in enumerate(inputs):
                    for variant in variants:
                        variant = dataclasses.replace(variant, attention=attention)
                        packed, layout = packing.pack(full_x if variant.full else lean_x)
                        (verifying if i else jobs).append((layout, variant, len(packed)))
                        self._lean_keys.setdefault(t, (layout, variant))   # (hidden_spec)
                        if multi and not i:
                            jobs.append((layout, dataclasses.replace(variant, steps=steps),
                                         len(packed)))
                if masked is not None:   # steps whose only extra is a grammar's mask
                    packed, layout = packing.pack(masked)
                    variant = dataclasses.replace(self.warmup_variants[0], attention=attention)
                    jobs.append((layout, variant, len(packed)))
                    masked_layouts.add(layout)

        # Verifying programs (speculative decoding) and masked ones (structured output) compile
        # in the background too: a plain step then starts exactly as soon as without them. The
        # lean ones first (a speculating engine's decode steps are lean verifying ones), the
        # skewed ones last (a skewed step does not wait for its program).
        later = [job for job in jobs if job[1].full or job[1].attention.skewed
                 or job[0] in masked_layouts] + verifying
        later.sort(key=lambda job: (job[1].attention.skewed, job[1].full))
        jobs += verifying
        now = [job for job in jobs if job not in later]
        threads = os.cpu_count() or 1
        try:
            if background:
                self._pending = self._compiler.start(now + later, threads)
            else:
                self._pending = self._compiler.start(now, threads)
                for future in list(self._pending.values()):
                    future.result()
                # Only now the full and skewed ones: tracing and lowering hold the GIL, so
                # lowering them beside the lean ones slowed those (a warm start spent 12 s in
                # warm-up).
                self._pending.update(self._compiler.start(later, threads))
        except Exception:  # NOTE: threads only save time; compile what is missing one by one
            logger.warning("parallel compilation failed; compiling one by one", exc_info=True)
            self.wait_for_warmup(raise_errors=False)
            for layout, variant, num_words in jobs:
                if (layout, variant) not in self._executables:
                    self._compile(layout, variant, num_words)
        if self.state_copier is not None:     # a few small programs (hybrid prefix caching)
            self.state_copier.warmup(self.kv_cache)
        logger.info("compiled %d step programs; %d more compile in the background",
                    0 if background else len(now), len(later) + (len(now) if background else 0))

    def hidden_spec(self, num_tokens: int) -> jax.ShapeDtypeStruct | None:
        """The hidden states (InFlightStep.hidden) that a step of this bucket returns, as an
        abstract array read off its compiled lean program (None: no hidden states, or not
        compiled yet): what a proposer reading them compiles its own programs for."""
        exe = self._executables.get(self._lean_keys.get(num_tokens)) if self.keep_hidden else None
        if exe is None:
            return None
        out = exe.out_info[4][0]
        return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=out.sharding)

    def _masked_input(self, lean: StepInput) -> StepInput | None:
        """`lean` with a full-width allowed-token mask and no other extras: the program of
        steps whose only extra is a grammar's mask (None: no step carries grammar masks)."""
        if not self.grammar_masks:
            return None
        return dataclasses.replace(lean, sampling=make_sampling_tensors(
            [], lean.num_seqs, self.cfg.vocab_size, self.config.scheduler.max_model_len,
            with_extras=False, with_mask=True))

    def _with_sampling(self, x: StepInput, rows: int, extras: bool) -> StepInput:
        """`x` with empty sampling tensors of `rows` rows (the full program's with extras)."""
        return dataclasses.replace(x, sampling=make_sampling_tensors(
            [], rows, self.cfg.vocab_size, self.config.scheduler.max_model_len, with_extras=extras))

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        """Wait until every program warm-up started is compiled."""
        wait_all(self._pending.values(), raise_errors)
