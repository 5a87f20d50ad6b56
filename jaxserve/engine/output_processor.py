"""Output processing: tokens -> text, stop strings, logprobs, n > 1, delta outputs.

It holds the host-side state of every user request (a `_Group` of n `_Sample`s) and turns
each step's `RequestUpdate`s into RequestOutputs: cumulative (whole text and token lists so
far, as `LLM.generate` returns), `delta` (only what is new since the last output, what a
stream sends) or `final_only`. A stop string found in the text ends a sample: its id is
returned so the engine core finishes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxserve.engine.input_processor import EngineRequest
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler import RequestUpdate
from jaxserve.core.step_messages import PromptLogprobs, RunnerOutput, TokenLogprobs
from jaxserve.engine.stop import StopStrings
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Sample:
    """Host-side state of one child request: its text, logprobs and stop-string matcher."""
    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer | None
    stops: StopStrings | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0             # delta outputs: how much was handed out already
    sent_text: int = 0

    def output(self, delta: bool) -> CompletionOutput:
        text = self.text
        if self.finish_reason is None and self.stops is not None:
            # Hold back a tail that may yet become a stop string (it would then be cut).
            text = text[:len(text) - self.stops.held_back(text)]
        tokens, logprobs = self.token_ids, self.logprobs
        if delta:
            t0, c0 = self.sent_tokens, self.sent_text
            self.sent_tokens, self.sent_text = len(tokens), len(text)
            tokens, text = tokens[t0:], text[c0:]
            logprobs = logprobs[t0:] if logprobs is not None else None
        return CompletionOutput(index=self.index, text=text, token_ids=list(tokens),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=list(logprobs) if logprobs is not None else None,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass
class _Group:
    """One user request: its n samples and timings."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    output_kind: str
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    prompt_lp_k: int | None = None       # prompt_logprobs asked
    logprobs_k: int | None = None        # logprobs asked

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        delta = self.output_kind == "delta"
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[s.output(delta) for s in self.samples], finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics,
                             prompt_logprobs=self.prompt_logprobs, error=self.error)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, metrics: EngineMetrics):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.groups: dict[str, _Group] = {}
        self.samples: dict[str, tuple[_Group, _Sample]] = {}   # child request id -> its state
        # Child ids of requests that ended here (a stop string, an error, every sample done):
        # the engine core must finish them (a no-op for those it finished itself).
        self.ended: list[str] = []

    def add(self, children: list[EngineRequest], prompt: str | None) -> None:
        first = children[0]
        params = first.sampling_params
        group = _Group(first.parent_id, prompt, list(first.prompt_token_ids), [],
                       RequestMetrics(first.arrival_time), params.output_kind,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                       prompt_lp_k=params.prompt_logprobs, logprobs_k=params.logprobs)
        for child in children:
            detok = (IncrementalDetokenizer(self.tokenizer, list(child.prompt_token_ids),
                                            params.skip_special_tokens)
                     if self.tokenizer and params.detokenize else None)
            stops = StopStrings.of(params.stop, params.include_stop_str_in_output) if params.stop else None
            wants_lp = params.logprobs is not None
            sample = _Sample(child.index, child.request_id, detok, stops,
                             logprobs=[] if wants_lp else None,
                             cumulative_logprob=0.0 if wants_lp else None)
            group.samples.append(sample)
            self.samples[child.request_id] = (group, sample)
        self.groups[group.request_id] = group

    def remove(self, request_id: str) -> list[str] | None:
        """Forget a user request; its child ids (None if unknown)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for s in group.samples:
            self.samples.pop(s.request_id, None)
        return [s.request_id for s in group.samples]

    # -- one step ----------------------------------------------------------------------------
    def process(self, updates: list[RequestUpdate], result: RunnerOutput) -> list[RequestOutput]:
        """Outputs of the requests the step advanced (and self.ended extended)."""
        now = time.monotonic()
        rows = {rid: i for i, rid in enumerate(result.req_ids)}
        touched: dict[str, _Group] = {}
        for up in updates:
            entry = self.samples.get(up.request_id)
            if entry is None:
                continue
            group, sample = entry
            group.num_cached_tokens = max(group.num_cached_tokens, up.num_cached_tokens)
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            prompt_lp = result.prompt_logprobs.get(up.request_id)
            if prompt_lp is not None and sample.index == 0:
                self._append_prompt_logprobs(group, prompt_lp)
            try:
                lps = result.logprobs[rows[up.request_id]] if up.request_id in rows else None
                if self._process_tokens(group, sample, up, lps, now):
                    self.ended.append(sample.request_id)
            except Exception as e:  # a failure in one request's handling fails it alone
                self.fail(group.request_id, f"{type(e).__name__}: {e}")
            touched[group.request_id] = group
        return [self.finish_if_done(g, now) for g in touched.values()
                if g.output_kind != "final_only" or g.finished]

    def _process_tokens(self, group: _Group, sample: _Sample, up: RequestUpdate,
                        lps: TokenLogprobs | None, now: float) -> bool:
        """Append a step's tokens to a sample; True if a stop string ended it here."""
        new_ids = up.new_token_ids
        stopped = False
        if new_ids:
            m = group.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                self.metrics.observe("time_to_first_token_seconds", now - m.arrival_time)
            elif m.last_token_time is not None:
                self.metrics.observe("inter_token_latency_seconds", now - m.last_token_time)
            m.last_token_time = now
            if sample.stops is not None and len(new_ids) > 1:
                # several tokens a step (multi-step decode, speculation): one at a time, so a
                # stop string ends the output at the token that completes it, as with one
                for j in range(len(new_ids)):
                    if self._add_tokens(group, sample, new_ids[j:j + 1], lps, j):
                        stopped = up.finished is None
                        break
            elif self._add_tokens(group, sample, new_ids, lps, 0):
                stopped = up.finished is None
        if up.finished is not None and sample.finish_reason is None:
            sample.finish_reason = up.finished.finish_reason
            sample.stop_reason = up.stop_reason
        return stopped

    def _add_tokens(self, group: _Group, sample: _Sample, ids: list[int],
                    lps: TokenLogprobs | None, first: int) -> bool:
        """Append tokens (the step's from its `first`), their logprobs and text; True if a stop
        string matched in the new text (it is cut there and the sample's finish set)."""
        self.metrics.inc("generation_tokens", len(ids))
        sample.token_ids.extend(ids)
        if sample.logprobs is not None and lps is not None:
            for j, token in enumerate(ids):
                self._append_logprobs(group, sample, token, lps, first + j)
        delta = sample.detokenizer.add(ids) if sample.detokenizer is not None else ""
        sample.text += delta
        if sample.stops is not None and delta:
            match = sample.stops.find(sample.text, len(delta))
            if match is not None:
                sample.text, sample.stop_reason = match.text, match.stop
                sample.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
                return True
        return False

    def _append_logprobs(self, group: _Group, sample: _Sample, token: int, lps: TokenLogprobs,
                         j: int) -> None:
        k = group.logprobs_k
        chosen = float(lps.chosen[j])
        entry: dict[int, Logprob] = {token: Logprob(chosen, int(lps.ranks[j]), self._decode_one(token))}
        for i, (t, lp) in enumerate(zip(lps.top_ids[j][:k].tolist(), lps.top_logprobs[j][:k].tolist())):
            if t not in entry:
                entry[t] = Logprob(float(lp), i + 1, self._decode_one(t))
        sample.logprobs.append(entry)
        sample.cumulative_logprob += chosen

    def _append_prompt_logprobs(self, group: _Group, chunk: PromptLogprobs) -> None:
        """Record logprobs of prompt tokens 1.. from a chunk's positions (each once, even if a
        preempted request recomputes them)."""
        k, prompt = group.prompt_lp_k, group.prompt_token_ids
        for j in range(len(chunk.chosen)):
            target = chunk.start + j + 1                # the prompt token these logits predict
            if target < len(group.prompt_logprobs):
                continue
            token = prompt[target]
            chosen = float(chunk.chosen[j])
            entry = {token: Logprob(chosen, None, self._decode_one(token))}
            top = zip(chunk.top_ids[j][:k].tolist(), chunk.top_logprobs[j][:k].tolist())
            for r, (t, lp) in enumerate(top):
                if t == token:
                    entry[token] = Logprob(chosen, r + 1, entry[token].decoded_token)
                else:
                    entry.setdefault(t, Logprob(float(lp), r + 1, self._decode_one(t)))
            group.prompt_logprobs.append(entry)

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None

    # -- ends ----------------------------------------------------------------------------------
    def fail(self, request_id: str, message: str) -> None:
        """Fail a whole user request (all its samples)."""
        group = self.groups.get(request_id)
        if group is None:
            return
        for s in group.samples:
            s.finish_reason = s.finish_reason or "error"
        group.error = message

    def finish_if_done(self, group: _Group, now: float) -> RequestOutput:
        out = group.output()
        if out.finished:
            group.metrics.finished_time = now
            self.metrics.observe("e2e_request_latency_seconds", now - group.metrics.arrival_time)
            self.metrics.inc("request_failure" if group.error else "request_success")
            self.ended.extend(self.remove(group.request_id) or ())
        return out
