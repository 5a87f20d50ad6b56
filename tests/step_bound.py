"""Engine generation in tests, bounded by steps.

A broken scheduler invariant (a wrong draft rollback leaves a request with nothing the
scheduler will ever compute) makes `LLM.generate` step forever, and the test hangs until
pytest's timeout. `bound_steps(engine)` lets the engine take only so many steps for the
requests it holds, then fails with each unfinished request's state, in seconds.

The bound: every step advances some request by at least a token (a chunk of its prompt, one
sampled token); rejected drafts, void chunks past drafts and preemptions take some back, so
each request is allowed MARGIN times its prompt plus the outputs it may still produce, plus
SLACK steps, summed over the requests the engine has held since it was last idle.
"""

from __future__ import annotations

MARGIN = 4
SLACK = 64


class StepBound:
    """Wraps one engine's `step` (an LLMEngine: LLM.generate and the tests' own loops call it)."""

    def __init__(self, engine):
        self.engine, self._step = engine, engine.step
        self.seen: set[str] = set()
        self.left = SLACK
        self.taken = 0

    def _allowance(self, req) -> int:
        max_len = self.engine.scheduler.config.max_model_len
        outputs = max_len - req.num_prompt_tokens
        if req.sampling_params.max_tokens is not None:
            outputs = min(outputs, req.sampling_params.max_tokens)
        return MARGIN * (req.num_prompt_tokens + outputs) + SLACK

    def __call__(self):
        requests = self.engine.scheduler.requests
        if not self.engine.has_unfinished_requests():
            self.seen.clear()             # idle: the next requests start a fresh count
            self.left, self.taken = SLACK, 0
        for rid, req in requests.items():
            if rid not in self.seen:
                self.seen.add(rid)
                self.left += self._allowance(req)
        if self.left <= 0:
            raise AssertionError(f"the engine took {self.taken} steps, more than its requests' "
                                 f"tokens allow; stuck:\n{describe(requests.values())}")
        self.left -= 1
        self.taken += 1
        return self._step()


def describe(requests) -> str:
    """One line per request: what the scheduler knows of it."""
    lines = []
    for r in requests:
        p = r.sampling_params
        lines.append(f"  {r.request_id}: {r.status.name}, tokens {r.num_tokens} (prompt "
                     f"{r.num_prompt_tokens}, outputs {len(r.output_token_ids)} of max_tokens "
                     f"{p.max_tokens}), computed {r.num_computed_tokens}, placeholders "
                     f"{r.num_output_placeholders}, drafts {r.spec_token_ids}, in-flight drafts "
                     f"{r.inflight_drafts}")
    return "\n".join(lines) or "  (no request in the scheduler)"


def bound_steps(engine):
    """Bound `engine`'s steps (module docstring); returns the engine."""
    engine.step = StepBound(engine)
    return engine
