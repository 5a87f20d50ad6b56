"""A masked step as two programs, so that the grammar masks join it only at sampling.

A step whose sampling needs grammar masks (structured output) cannot be one program launched
before the masks exist, and the masks of step N+1 need step N's sampled ids (a matcher must
consume N's token first). As one program, the host waited for N's ids, then filled the
masks, then launched N+1: the device idled for the wait's read-back, the fill and the launch,
in series (issue 67: 0.67x unconstrained at 64 schemas, H100). Here the step's forward, a
`logits_only` program (step_program.py) whose tokens come from N's output on the device as
always, launches first; then the host reads N's ids, the matchers consume them and the masks
are filled while that forward runs; then a small sampling program over its f32 logits
(`step_program.make_sampling`) launches with the masks in its input. The device runs the
forward meanwhile, so the fill costs it nothing while it takes less than the forward.

Only for steps without hidden states (a proposer reading them, MTP / EAGLE3, takes the
sampler's output behind the step), prompt logprobs or several decode steps, on one device
and one host: those keep the one program, masks filled first. The forward's input carries
lean sampling tensors (its program is the lean one's, stopped at the logits); the sampling
program's, the step's own with the masks.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.core.step_input import StepInput
from jaxserve.sample.tensors import SamplingTensors, make_sampling_tensors
from jaxserve.worker import packing
from jaxserve.worker.compiling import BackgroundCompiler, abstract
from jaxserve.worker.step_program import StepVariant, make_sampling

Key = tuple   # (input layout, StepVariant (num_top, full only), logits rows, logits width)


def forward_variant(variant: StepVariant) -> StepVariant:
    """The masked step's forward program: the lean one's, stopped at the logits."""
    return dataclasses.replace(variant, num_top=0, full=False, logits_only=True)


def sampling_variant(variant: StepVariant) -> StepVariant:
    """What the sampling program depends on of the step's variant."""
    return StepVariant(variant.num_top, variant.full)


def applies(runner, variant: StepVariant) -> bool:
    """Whether a masked step of `variant` can run as two programs (module docstring)."""
    return runner.step_tap is None and not (variant.hidden or variant.prompt_logprobs or variant.steps > 1)


class LateSampling:
    """The compiled sampling programs of masked steps, by (input layout, variant, logits shape)."""

    @classmethod
    def of(cls, runner) -> "LateSampling":
        """The masked steps' sampling of a runner on one device."""
        return cls(backend=runner.backend, kernel_plan=runner.config.kernel_plan,
                   vocab_size=runner.cfg.vocab_size, max_model_len=runner.config.scheduler.max_model_len,
                   prev_ids=runner.prev_ids, input_sharding=runner.input_sharding)

    def __init__(self, *, backend, kernel_plan, vocab_size: int, max_model_len: int, prev_ids,
                 input_sharding):
        self._jit = make_sampling(backend=backend, kernel_plan=kernel_plan)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self._prev_ids = abstract(prev_ids)
        self._sharding = input_sharding
        self.programs: dict[Key, object] = {}
        self._pending: dict[Key, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._background = BackgroundCompiler()

    def compile(self, layout: packing.Layout, variant: StepVariant, rows: int, width: int, num_words: int):
        logits = jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=self._sharding)
        packed = jax.ShapeDtypeStruct((num_words,), jnp.uint32, sharding=self._sharding)
        exe = self._jit.lower(logits, packed, self._prev_ids, variant=variant, layout=layout).compile()
        with self._lock:
            self.programs[(layout, variant, rows, width)] = exe
        return exe

    def start(self, jobs: list[tuple]) -> list[concurrent.futures.Future]:
        """Compile (layout, variant, rows, words) jobs, logits as wide as the vocabulary, on a
        background thread (warm-up)."""
        keys = [(layout, variant, rows, self.vocab_size, words) for layout, variant, rows, words in jobs]
        futures = self._background.start([(key[:4], functools.partial(self.compile, *key)) for key in keys], 1)
        self._pending.update(futures)
        return list(futures.values())

    def program(self, layout: packing.Layout, variant: StepVariant, logits, num_words: int):
        """The compiled program for these `logits`: compiled, compiling in warm-up (waited
        for), or compiled now."""
        key = (layout, variant, *logits.shape)
        exe = self.programs.get(key)
        if exe is None and key in self._pending:
            try:
                exe = self._pending[key].result()
            except Exception:     # compiled again below, raising where it really fails
                exe = None
        return exe if exe is not None else self.compile(*key, num_words)

    def lean_input(self, x: StepInput) -> StepInput:
        """`x` with lean sampling tensors of its rows: the forward's input (its layout is the
        lean program's)."""
        return dataclasses.replace(x, sampling=make_sampling_tensors(
            [], x.sampling.num_seqs, self.vocab_size, self.max_model_len, with_extras=False))

    def run(self, runner, x: StepInput, variant: StepVariant,
            fill_masks: Callable[[SamplingTensors], None]):
        """On `runner` (the ModelRunner): launch the step's forward, then `fill_masks(x.sampling)` (the masks ANDed into the
        step's sampling tensors; it may wait for the last step's ids), then the sampling.
        Returns the sampler's output (on the device); the runner's last ids become the
        sampling's."""
        last_ids = runner.prev_ids
        logits, _, _ = runner.run(self.lean_input(x), forward_variant(variant))
        runner.set_prev_ids(last_ids)     # the forward returns none: the sampling writes them
        fill_masks(x.sampling)
        packed, layout = packing.pack(x)
        exe = self.program(layout, sampling_variant(variant), logits, len(packed))
        result, last_ids = exe(logits, jax.device_put(packed, self._sharding), last_ids)
        runner.set_prev_ids(last_ids)
        return result
