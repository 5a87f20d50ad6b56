"""The model runner: SchedulerOutput -> padded StepInput -> one jitted step -> RunnerOutput.

Fixed shapes fill the role of CUDA graphs: the step's token count T is padded up to a
bucket (powers of two up to max_num_batched_tokens) and its sequence count to
S = min(T, max_num_seqs), so one compiled program per bucket covers every batch. Warm-up
compiles them all; after it nothing compiles. The caches (one dict of arrays per layer, from
the model's cache specs) are preallocated once and donated to every step, so XLA updates
them in place. The runner's own copy of the running requests is its persistent batch
(input_batch.py); the attention backend (models/attention.py) plans each step's attention.

The runner by role: this file prepares, dispatches, runs and collects steps; the traced step
program and its variants are step_program.py, the caches' sizing and allocation
cache_sizing.py, warm-up's enumeration warmup.py. A proposer (spec_decode/) reads the runner
only through its TargetView and asks of it only its TargetNeeds (target_view.py).

Legend: T tokens, S sequences, B blocks per sequence, P tokens per block, V vocabulary,
N logprobs returned per sequence.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache import manager as cache_manager
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.core.step_input import StepInput
from jaxserve.core.step_messages import (GrammarMasks, PromptLogprobs, RunnerOutput,
                                         SchedulerOutput, TokenLogprobs)
from jaxserve.models.attention import AttentionBackend, AttentionPlan
from jaxserve.sample import rejection_sampler, sampler
from jaxserve.worker import memory_plan, packing, verify_rows, warmup
from jaxserve.worker.cache_sizing import (CachePlan, CacheReservation, Measured, abstract_caches,
                                          allocate_caches, plan_caches)
from jaxserve.lora import weights as lora_weights
from jaxserve.lora.store import AdapterStore
from jaxserve.worker.compiling import StepCompiler, abstract, wait_all
from jaxserve.worker.input_batch import InputBatch, StepPlan, and_grammar_masks
from jaxserve.worker import late_sampling
from jaxserve.worker.late_sampling import LateSampling
from jaxserve.worker.state_copies import StateCopier
from jaxserve.worker.step_program import StepVariant, make_step, matmul_precision, token_buckets
from jaxserve.worker.target_view import TargetNeeds, TargetView

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A dispatched step whose results are still on the device."""
    plan: StepPlan
    variant: StepVariant
    result: sampler.SamplerOutput | rejection_sampler.VerifyOutput
    prompt: tuple | None
    # What a proposer running after the step reads (variant.hidden), on the device: f[T, D]
    # hidden states, the token after each position and each sequence's last kept row
    # (step_program._after_step)
    hidden: jax.Array | None = None
    next_ids: jax.Array | None = None
    kept_rows: jax.Array | None = None
    inputs: StepInput | None = None   # the step's host-side input (numpy)


class ModelRunner:
    def __init__(self, config: EngineConfig, params, model, num_blocks: int | None = None, mesh=None,
                 device=None, proposer: TargetNeeds = TargetNeeds()):
        """model: the family (models/interface.py ModelFamily). device: without a mesh, the one
        device to run on (default: jax's default device). proposer: what the proposer asks of
        this runner (engine/builder.py builds it first)."""
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
        kernel_plan = config.kernel_plan
        # The weights re-laid for the step's kernels, in place (the family's contract)
        self.params = params = model.prepare_weights(self.cfg, params, kernel_plan=kernel_plan, mesh=mesh,
                                                     backend=self.backend)
        self.cache_specs = model.cache_specs(self.cfg)
        self.group_kinds = cache_manager.group_kinds(self.cache_specs)
        state_layers = tuple(i for i, spec in enumerate(self.cache_specs) if not isinstance(spec, PagedSpec))
        # LoRA (jaxserve/lora/): the adapters' device slots, zeroed, in each layer's parameters,
        # and the adapters known to the engine. Allocated before the cache plan measures the
        # device's memory in use, so the KV budget already leaves them out.
        self.lora_store = None
        if config.lora is not None:
            self.lora_store = AdapterStore(self.cfg, config.lora)
            self.params = params = lora_weights.attach(params, self.cfg, config.lora, self.dtype, device)
        # With a mesh (tensor / expert parallel) each cache array is placed by its name's rule
        # (k / v by kv heads, MLA latents replicated, DeltaNet states by head) and step inputs
        # are replicated; jit partitions the step from the parameters' shardings.
        self.mesh = mesh
        self.input_sharding = None
        sharding_of = None
        if mesh is not None:
            from jaxserve.sharding import rules
            self.input_sharding = rules.replicated(mesh)
            sharding_of = functools.partial(rules.cache_array_sharding, model, self.cfg, mesh)
        elif device is not None:     # a data-parallel replica's device (engine/data_parallel.py)
            self.input_sharding = jax.sharding.SingleDeviceSharding(device)
            self.params = params = jax.device_put(params, device)
            sharding_of = lambda name, shape: self.input_sharding   # noqa: E731
        else:   # the weights' device, named: programs compile against the caches' shapes first
            where = next((a.sharding for a in jax.tree.leaves(params) if isinstance(a, jax.Array)), None)
            if isinstance(where, jax.sharding.SingleDeviceSharding):
                sharding_of = lambda name, shape: where   # noqa: E731
        self._step = make_step(mesh=mesh, model=model, cfg=self.cfg, backend=self.backend,
                               kernel_plan=kernel_plan, block_size=self.block_size,
                               precision=matmul_precision(self.dtype), state_layers=state_layers)
        self.return_hidden_states(proposer.hidden_states, proposer.aux_layers)
        self.batch = InputBatch(max_num_seqs=config.scheduler.max_num_seqs,
                                max_blocks_per_seq=self.max_blocks_per_seq,
                                block_size=self.block_size, vocab_size=self.cfg.vocab_size,
                                max_model_len=config.scheduler.max_model_len,
                                group_kinds=self.group_kinds,
                                max_spec_tokens=config.num_speculative_tokens,
                                lora=config.lora is not None)
        # The previous step's sampled ids (padded to max_num_seqs), a row per sequence, then the
        # drafts a proposer made on the device after it (spec_decode/hidden_steps.py: its pass
        # takes them and gives them back with its drafts, through set_prev_ids).
        self.draft_columns = proposer.draft_columns
        self.batch.prev_stride = 1 + self.draft_columns
        self.prev_ids = jax.device_put(
            jnp.zeros((config.scheduler.max_num_seqs, self.batch.prev_stride), jnp.int32),
            self.input_sharding)
        self.grammar_masks = False    # steps may carry grammar masks (use_grammar_masks)
        # late_masks: masks filled while a step's forward runs (late_sampling.py); False: before (A/B)
        self.late_masks, self.late_sampling = True, None if mesh is not None else LateSampling.of(self)
        # NOTE: the identity names what the jitted step closes over: a stored program is
        # loaded only for the same ones (compiling.ProgramStore)
        self._identity = repr((model.name, self.cfg, self.backend.impl, repr(mesh), kernel_plan))
        # A proposer's caches on the target's block tables (MTP, EAGLE3) are sized with these
        self._reservation = CacheReservation(self.cache_specs, self.block_size, self.dtype, sharding_of)
        plan = self._plan_caches(proposer, device, num_blocks, sharding_of)
        self.memory = plan.memory
        self.num_blocks, self.num_slots, self.num_window_blocks = plan.num_blocks, plan.num_slots, plan.num_window_blocks
        self.num_cached_states, self.num_state_snapshots = plan.num_cached_states, plan.num_state_snapshots
        self.bytes_per_block, self.bytes_per_window_block = plan.bytes_per_block, plan.bytes_per_window_block
        # NOTE: allocated on first use (kv_cache), into the memory _reservation holds: warm-up
        # compiles the plain programs first, with the memory outside it (issue 62)
        self._kv_cache = None
        self._cache_layout = (self.cache_specs, self.num_blocks, self.num_slots + self.num_state_snapshots,
                              self.block_size, self.dtype, sharding_of, self.num_window_blocks)
        # Hybrid prefix caching and speculation: saved states and snapshots in and out of the
        # live slots (state_copies.py)
        self.state_copier = None
        if self.num_cached_states or self.num_state_snapshots:
            self.state_copier = StateCopier(
                list(state_layers),
                config.scheduler.max_num_seqs)
        # Compiled step programs by (input layout, variant): warm-up fills it, run() uses it.
        self._compiler = StepCompiler(self._step, self.params, abstract_caches(*self._cache_layout), self.prev_ids,
                                      self.input_sharding, store=config.program_cache_dir,
                                      identity=self._identity)
        self._executables = self._compiler.executables
        # Seconds spent tracing + lowering, compiling and loading stored step programs, summed
        # over programs.
        self.compile_seconds = self._compiler.seconds
        self._pending: dict[tuple, concurrent.futures.Future] = {}   # warm-up's compiles
        # Told every device program a step launches, before it launches: on several hosts the
        # broadcaster that makes the other hosts launch it too (jaxserve/distributed.py)
        self.step_tap = None
        self._lean_keys: dict[int, tuple] = {}   # bucket -> (layout, variant) of its lean program

    def _plan_caches(self, proposer: TargetNeeds, device, num_blocks: int | None, sharding_of) -> CachePlan:
        """The caches' plan (cache_sizing.plan_caches). On a device that reports its memory
        and without a fixed size: the weights alone must leave room for one request of
        max_model_len (CacheDoesNotFit before any compile), then the largest step program is
        measured (_profile_peak): the caches take what the budget leaves."""
        config = self.config
        args = (config, self.cache_specs, list(proposer.cache_specs), proposer.weight_bytes,
                self.max_blocks_per_seq)
        if num_blocks or config.cache.num_kv_blocks:
            return plan_caches(*args, num_blocks=num_blocks)
        first = device or (self.mesh.devices.flat[0] if self.mesh is not None else jax.local_devices()[0])
        # NOTE: once the weights are ready: a draw or copy still running holds its scratch
        jax.block_until_ready(self.params)
        memory = memory_plan.measure(first)
        if memory is None:          # the CPU: its own byte budget
            if first.platform != "cpu":
                logger.warning("JAX's allocator reports no memory limit on %s (%s); the KV cache "
                               "takes kv_cache_cpu_bytes (%d): give --kv-cache-memory-bytes or "
                               "--num-gpu-blocks-override", first.platform, memory_plan.allocator_note(),
                               config.cache.kv_cache_cpu_bytes)
            return plan_caches(*args)
        measured = Measured(memory, None, memory_plan.headroom_bytes(self.params))
        # held until the caches take its place; raises if even a peak of 0 leaves too little
        plan = self._reservation.hold(plan_caches(*args, measured))
        if config.cache.kv_cache_memory_bytes:       # the size is given: nothing to measure
            return plan
        try:
            return plan_caches(*args, dataclasses.replace(measured, peak_bytes=self._profile_peak(sharding_of)))
        except BaseException:
            self._reservation.release()
            raise

    def _profile_peak(self, sharding_of) -> int:
        """The peak (memory_plan.program_peak_bytes) of the largest step programs
        (warmup.profile_jobs), compiled against caches of one request of max_model_len: the
        real caches' size depends on this peak, and a step's temporaries depend on its tokens
        and sequences, not on the blocks. XLA reuses this compile's GEMM autotuning when
        warm-up compiles the real programs. With a program store the peak is noted there, and
        a warm start reads it instead of compiling (StepCompiler.peak_bytes)."""
        provisional = abstract_caches(self.cache_specs, self.max_blocks_per_seq + 1,
                                      self.config.scheduler.max_num_seqs + 2, self.block_size,
                                      self.dtype, sharding_of, self.max_blocks_per_seq + 1)
        compiler = StepCompiler(self._step, self.params, provisional, self.prev_ids, self.input_sharding,
                                store=self.config.program_cache_dir, identity=self._identity)
        peaks = [compiler.peak_bytes(*job) for job in warmup.profile_jobs(self)]
        compiler.stop()
        if None in peaks:
            logger.warning("XLA gave no memory analysis of the step programs; sizing the caches "
                           "with the headroom alone")
            return 0
        logger.info("the largest step programs need %.2f GiB beyond the weights and caches",
                    max(peaks) / 2**30)
        return max(peaks)

    @property
    def kv_cache(self) -> list[dict[str, jax.Array]]:
        """The caches, one dict of arrays per layer; allocated on first use (warm-up's)."""
        self._allocate_caches()
        return self._kv_cache

    def _allocate_caches(self) -> None:
        if self._kv_cache is None:
            self._reservation.release()
            self._kv_cache = allocate_caches(*self._cache_layout)

    @kv_cache.setter
    def kv_cache(self, caches: list[dict[str, jax.Array]]) -> None:
        self._kv_cache = caches

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
        (spec_decode/mtp.py, eagle3.py: their TargetNeeds); call before warm-up."""
        self.keep_hidden, self.aux_layers = on, tuple(aux_layers) if on else ()
        self.warmup_variants = tuple(
            StepVariant(num_top, full=full, hidden=on, aux_layers=self.aux_layers)
            for num_top, full in ((0, False), (self.config.max_logprobs, True)))

    def target_view(self) -> TargetView:
        """What a proposer bound to this runner may read of it (target_view.py)."""
        return TargetView(cfg=self.cfg, family=self.model, params=self.params,
                          block_size=self.block_size, num_blocks=self.num_blocks,
                          num_window_blocks=self.num_window_blocks,
                          buckets=tuple(self.buckets), dtype=self.dtype,
                          attention_impl=self.attention_impl, last_ids=abstract(self.prev_ids),
                          hidden_spec=self.hidden_spec, empty_step=self.empty_step)

    def set_prev_ids(self, prev_ids: jax.Array) -> None:
        """The last ids the next step reads, as a proposer's pass behind the step left them
        (its drafts in the columns after each token: spec_decode/hidden_steps.py)."""
        self.prev_ids = prev_ids

    def empty_step(self, num_tokens: int) -> tuple[StepInput, StepPlan]:
        """The input and plan of an empty step of this bucket (its shapes, for warm-up)."""
        empty = SchedulerOutput([], [], [], 0, [], 0)
        return self.batch.build(empty, *self.bucket(num_tokens))

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
        for slot, int_id in out.lora_loads:    # the step's new adapters into their slots
            self.params = lora_weights.write_slot(self.params, slot, self.lora_store.get(int_id))
        x, plan, variant = self.prepare(out)     # masks below: late or now (bench's timer wraps it)
        fill = grammar_masks and (lambda t: and_grammar_masks(t.allowed_mask, plan, grammar_masks()))
        if fill and self.masks_late(variant):
            result, prompt, after = self.late_sampling.run(self, x, variant, fill), None, None
        else:
            if fill:        # last: they may wait for the last step's tokens
                fill(x.sampling)
            result, prompt, after = self.run(x, variant)
        if out.state_saves:
            self.copy_states(out.state_saves)
        stride = self.batch.prev_stride
        self.batch.prev_rows = {rid: i * stride for i, (rid, s) in enumerate(zip(plan.req_ids, plan.samples)) if s}
        return InFlightStep(plan, variant, result, prompt, *(after or (None, None, None)), inputs=x)

    def masks_late(self, variant: StepVariant) -> bool:
        """Whether a masked step of this variant runs as forward, then sampling (late_sampling.py)."""
        return self.late_masks and self.late_sampling is not None and late_sampling.applies(self, variant)

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
        # A verifying step's rows are its sequences' then its drafts' (worker/verify_rows.py)
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
        """Compile the step programs (warmup.py: which, and in what order) on threads.

        Returns once the lean programs are ready; the others (logprobs, top-k/p, penalties,
        verifying, masked, the attention backend's other plans) finish in the background,
        and a step that needs one before then waits for it (`wait_for_warmup` waits for
        all), except that a skewed step runs as an even one until its program is ready.

        background: return at once, all of them compiling (a draft model's runner: the
        target's plain programs are the ones start-up waits for). lean_only: no full programs
        (a draft model samples greedily: its steps never run one)."""
        now, later = warmup.step_jobs(self, lean_only, self._lean_keys)
        self._pending = warmup.start(self, now, later, background)
        late = warmup.late_sampling_jobs(self)
        self._pending.update(zip(late, self.late_sampling.start(late) if late else ()))
        planned = self.memory is not None and self.memory.on_device and not background
        if planned:
            # NOTE: on a device whose memory was planned, every program compiles before the
            # caches take their share: XLA's GEMM autotuner allocates while it compiles, and
            # beside 16 background compiles the 8B's first step ran out of memory with 2 GiB
            # of headroom (H100, issue 62)
            wait_all(self._pending.values(), False, log_every=10.0)
        self._allocate_caches()     # now: after the programs' compiles (__init__'s note)
        if self.state_copier is not None:     # a few small programs (hybrid prefix caching)
            self.state_copier.warmup(self.kv_cache)
        waited = len(now) + len(later) if planned else 0 if background else len(now)
        logger.info("compiled %d step programs; %d more compile in the background",
                    waited, len(now) + len(later) - waited)

    def hidden_spec(self, num_tokens: int) -> jax.ShapeDtypeStruct | None:
        """The hidden states a step of this bucket returns, abstract (warmup.hidden_spec)."""
        return warmup.hidden_spec(self, num_tokens)

    def wait_for_warmup(self, raise_errors: bool = True, log_every: float | None = None) -> None:
        """Wait until every program warm-up started is compiled (log_every: wait_all's)."""
        wait_all(self._pending.values(), raise_errors, log_every)
