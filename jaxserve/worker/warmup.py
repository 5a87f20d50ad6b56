"""Warm-up: which step programs the runner compiles before serving, and in what order.

Every bucket gets its lean and full program (worker/step_program.py StepVariant); with
speculation, every draft-row count a verifying step of the bucket can have
(verify_rows.warmup_draft_rows); with grammars, the lean program with an allowed-token mask;
with multi-step decode, a decode bucket's plain programs again, running `steps` steps (and,
for a hybrid model saving states, those of a loop that saves some: their layout differs); and
each of them for every attention plan the backend may choose (models/attention.py). After
warm-up nothing compiles.

They compile on threads (XLA compiles outside the GIL, so start-up takes about as long as
the slowest program, not the sum): the lean plain programs first (start-up waits for them),
then the rest in the background (a step that needs one before it is ready waits for it,
except that a skewed step runs as an even one). NOTE: measured on the H200 (BENCHMARKS.md,
Start-up): compiling the skewed programs up front delayed the 8B engine's first token by 12 s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os

import jax
import numpy as np

from jaxserve.core.step_input import StepInput
from jaxserve.core.step_messages import SchedulerOutput
from jaxserve.sample.tensors import make_sampling_tensors
from jaxserve.worker import late_sampling, packing, verify_rows
from jaxserve.worker.compiling import wait_all

logger = logging.getLogger(__name__)

Job = tuple   # (input layout, StepVariant, packed words): one step program to compile


def step_jobs(runner, lean_only: bool, lean_keys: dict) -> tuple[list[Job], list[Job]]:
    """(jobs to wait for, jobs for the background) of `runner`; `lean_keys` gets each bucket's
    lean program key (bucket -> (layout, variant): hidden_spec reads its output shape)."""
    empty = SchedulerOutput(new_requests=[], scheduled=[], finished_req_ids=[], num_tokens=0,
                            preempted_ids=[], num_cached_tokens=0)
    config = runner.config
    jobs, verifying, masked_layouts = [], [], set()
    k = config.num_speculative_tokens
    variants = runner.warmup_variants[:1] if lean_only else runner.warmup_variants
    for t_prev, t in zip([0] + runner.buckets, runner.buckets):
        lean, _, _ = runner._build(dataclasses.replace(empty, num_tokens=t))
        inputs = [(lean, with_sampling(runner, lean, lean.num_seqs, True))]
        # every draft-row count a verifying step of this bucket can have
        for d in verify_rows.warmup_draft_rows(t_prev, t, k, config.scheduler.max_num_seqs) if k else ():
            rows = lean.num_seqs + d
            inputs.append(tuple(verify_rows.with_draft_rows(
                lean, d, k, with_sampling(runner, lean, rows, extras).sampling)
                for extras in (False, True)))
        masked = masked_input(runner, lean)
        # multi-step decode (scheduler.py): a decode bucket's plain programs (lean and
        # full) again, running `steps` steps
        steps = config.scheduler.num_scheduler_steps
        multi = steps > 1 and t_prev < config.scheduler.max_num_seqs
        for attention in runner.backend.warmup_plans(t, lean.num_seqs):
            for i, (lean_x, full_x) in enumerate(inputs):
                for variant in variants:
                    variant = dataclasses.replace(variant, attention=attention)
                    packed, layout = packing.pack(full_x if variant.full else lean_x)
                    (verifying if i else jobs).append((layout, variant, len(packed)))
                    lean_keys.setdefault(t, (layout, variant))
                    if multi and not i:
                        for x in loop_inputs(runner, full_x if variant.full else lean_x):
                            packed, layout = packing.pack(x)
                            jobs.append((layout, dataclasses.replace(variant, steps=steps), len(packed)))
            if masked is not None:   # steps whose only extra is a grammar's mask
                variant = dataclasses.replace(runner.warmup_variants[0], attention=attention)
                if late_masks(runner, variant):     # their forward (late_sampling.py)
                    packed, layout = packing.pack(lean)
                    variant = late_sampling.forward_variant(variant)
                else:
                    packed, layout = packing.pack(masked)
                jobs.append((layout, variant, len(packed)))
                masked_layouts.add((layout, variant))

    # Verifying programs (speculative decoding) and masked ones (structured output) compile
    # in the background too: a plain step then starts exactly as soon as without them. The
    # lean ones first (a speculating engine's decode steps are lean verifying ones), the
    # skewed ones last (a skewed step does not wait for its program).
    later = [job for job in jobs if job[1].full or job[1].attention.skewed
             or job[:2] in masked_layouts] + verifying
    later.sort(key=lambda job: (job[1].attention.skewed, job[1].full))
    jobs += verifying
    return [job for job in jobs if job not in later], later


def late_masks(runner, variant) -> bool:
    """Whether masked steps of `variant` run as two programs (late_sampling.py)."""
    return runner.grammar_masks and runner.masks_late(variant)


def late_sampling_jobs(runner) -> list[tuple]:
    """The sampling programs of masked steps, a (layout, variant, rows, words) job per bucket
    (late_sampling.py), when they run as two programs."""
    if not late_masks(runner, runner.warmup_variants[0]):
        return []
    empty = SchedulerOutput([], [], [], 0, [], 0)
    jobs = []
    for t in runner.buckets:
        masked = masked_input(runner, runner._build(dataclasses.replace(empty, num_tokens=t))[0])
        packed, layout = packing.pack(masked)
        variant = late_sampling.sampling_variant(runner.warmup_variants[0])
        jobs.append((layout, variant, masked.sampling.num_seqs, len(packed)))
    return jobs


def loop_inputs(runner, x: StepInput) -> list[StepInput]:
    """A multi-step program's inputs: `x`, and for a hybrid model saving states `x` with save
    slots (StepInput.state_save_slots: a loop that saves some sequence's state)."""
    if not runner.num_cached_states:
        return [x]
    return [x, dataclasses.replace(x, state_save_slots=np.zeros(x.num_seqs, np.int32))]


def profile_jobs(runner) -> list[Job]:
    """The programs whose peak sizes the caches (memory_plan.py): the largest bucket's, with
    the sampler's extras and logprobs (its full variant) unless the runner's steps never
    need them. Its temporaries are the largest: the most tokens through the layers, the most
    rows through the sampler; smaller buckets, multi-step and verifying programs take fewer."""
    empty = SchedulerOutput(new_requests=[], scheduled=[], finished_req_ids=[],
                            num_tokens=runner.buckets[-1], preempted_ids=[], num_cached_tokens=0)
    lean, _, _ = runner._build(empty)
    variant = runner.warmup_variants[-1]
    x = with_sampling(runner, lean, lean.num_seqs, True) if variant.full else lean
    packed, layout = packing.pack(x)
    return [(layout, variant, len(packed))]


def start(runner, now: list[Job], later: list[Job], background: bool
          ) -> dict[tuple, concurrent.futures.Future]:
    """Compile `now` (waited for unless `background`) and `later` on threads; the compiles
    still in flight, by (layout, variant)."""
    threads = os.cpu_count() or 1
    compiler = runner._compiler
    pending = {}
    try:
        if background:
            pending = compiler.start(now + later, threads)
        else:
            pending = compiler.start(now, threads)
            for future in list(pending.values()):
                future.result()
            # Only now the full and skewed ones: tracing and lowering hold the GIL, so
            # lowering them beside the lean ones slowed those (a warm start spent 12 s in
            # warm-up).
            pending.update(compiler.start(later, threads))
    except Exception:  # NOTE: threads only save time; compile what is missing one by one
        logger.warning("parallel compilation failed; compiling one by one", exc_info=True)
        wait_all(pending.values(), False)
        for layout, variant, num_words in now + later:
            if (layout, variant) not in compiler.executables:
                compiler.compile(layout, variant, num_words)
    return pending


def hidden_spec(runner, num_tokens: int) -> jax.ShapeDtypeStruct | None:
    """The hidden states (InFlightStep.hidden) that a step of this bucket returns, as an
    abstract array read off its compiled lean program (None: no hidden states, or not
    compiled yet): what a proposer reading them compiles its own programs for."""
    exe = runner._executables.get(runner._lean_keys.get(num_tokens)) if runner.keep_hidden else None
    if exe is None:
        return None
    out = exe.out_info[4][0]
    return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=out.sharding)


def masked_input(runner, lean: StepInput) -> StepInput | None:
    """`lean` with a full-width allowed-token mask and no other extras: the program of
    steps whose only extra is a grammar's mask (None: no step carries grammar masks)."""
    if not runner.grammar_masks:
        return None
    return dataclasses.replace(lean, sampling=make_sampling_tensors(
        [], lean.num_seqs, runner.cfg.vocab_size, runner.config.scheduler.max_model_len,
        with_extras=False, with_mask=True))


def with_sampling(runner, x: StepInput, rows: int, extras: bool) -> StepInput:
    """`x` with empty sampling tensors of `rows` rows (the full program's with extras)."""
    return dataclasses.replace(x, sampling=make_sampling_tensors(
        [], rows, runner.cfg.vocab_size, runner.config.scheduler.max_model_len, with_extras=extras))
