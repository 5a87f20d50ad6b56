"""A masked step as two programs (worker/late_sampling.py): its forward launches before the
grammar masks are filled, the masks join at sampling, and nothing in the outputs changes.

On the tiny random-weight Llama in float32 with the byte-level tokenizer of
tests/test_structured.py: the same requests (constrained and plain in one batch, greedy and
seeded, with n-gram drafts too) give the same tokens with the masks filled before one program
(`runner.late_masks = False`, the old path) and after the forward's launch.
"""

from __future__ import annotations

import pytest

from jaxserve.worker import late_sampling
from tests.test_structured import CASES, _matches, ckpt_dir, llm  # noqa: F401
from tests.test_structured_spec import PROMPTS, _params, ngram_llm  # noqa: F401


def _both_paths(engine_llm, prompts, params):
    """Token ids per request with the masks filled late (the default), then before one program."""
    runner = engine_llm.engine.runner
    late = engine_llm.generate(prompts, params, use_tqdm=False)
    runner.late_masks = False
    try:
        early = engine_llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.late_masks = True
    return [o.outputs[0].token_ids for o in late], [o.outputs[0].token_ids for o in early], late


def test_a_masked_step_launches_its_forward_before_the_masks_and_samples_after(llm, monkeypatch):
    runner, structured, events = llm.engine.runner, llm.engine.core.structured, []
    run, program, step_masks = runner.run, runner.late_sampling.program, structured.step_masks
    monkeypatch.setattr(runner, "run", lambda x, v: events.append(
        "forward" if v.logits_only else "step") or run(x, v))
    monkeypatch.setattr(runner.late_sampling, "program", lambda *a: events.append("sampling") or program(*a))
    monkeypatch.setattr(structured, "step_masks", lambda out: events.append("masks") or step_masks(out))
    outs = llm.generate(["q", "plain"], [_choice(0.0), _plain(0.0)], use_tqdm=False)
    assert outs[0].outputs[0].text in CASES[1].choice
    masked = [i for i, e in enumerate(events) if e == "masks"]
    assert masked and all(events[i - 1] == "forward" and events[i + 1] == "sampling" for i in masked)
    assert "step" in events      # the plain steps after the constrained request ended: one program


def _choice(temperature: float, seed: int = 0):
    from jaxserve import SamplingParams
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=20, structured_outputs=CASES[1])


def _plain(temperature: float, seed: int = 1):
    from jaxserve import SamplingParams
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=12)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_and_plain_requests_give_the_same_tokens_either_way(llm, temperature):
    from jaxserve import SamplingParams

    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=30, structured_outputs=so)
              for i, so in enumerate(CASES)] + [_plain(temperature, seed=9)]
    prompts = ["ab", "cd", "ef", "gh", "ij", "plain"]
    late, early, outs = _both_paths(llm, prompts, params)
    assert late == early
    for so, out in zip(CASES[:4], outs):
        assert _matches(so, out.outputs[0].text), out.outputs[0].text


def test_constrained_greedy_with_drafts_gives_the_same_tokens_either_way(ngram_llm, monkeypatch):
    runs = []
    real = late_sampling.LateSampling.run
    monkeypatch.setattr(late_sampling.LateSampling, "run",
                        lambda self, runner, x, *a: runs.append(x.draft_rows is not None) or real(self, runner, x, *a))
    late, early, _ = _both_paths(ngram_llm, PROMPTS, _params(0.0))
    assert late == early
    assert any(runs), "no verifying step ran as two programs"


def test_steps_that_keep_one_program(llm):
    """Hidden states for a proposer, prompt logprobs and multi-step decode keep one program."""
    from jaxserve.worker.step_program import StepVariant

    runner = llm.engine.runner
    assert runner.masks_late(StepVariant())
    for variant in (StepVariant(hidden=True), StepVariant(prompt_logprobs=True), StepVariant(steps=4)):
        assert not runner.masks_late(variant)
    runner.late_masks = False
    try:
        assert not runner.masks_late(StepVariant())
    finally:
        runner.late_masks = True
