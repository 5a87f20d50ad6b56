"""The runner's persistent batch: its own copy of every running request, patched each step.

The scheduler sends a request's prompt and parameters once (`NewRequestData`) and after that
only diffs (`ScheduledRequest`: how many tokens, new block ids); the runner appends the tokens
it samples itself. Block tables live in one numpy array (a sliding-window group's in a
second: kv_cache/manager.py), a row per request, written only where blocks are added, so a
step's tables are one fancy-index, not rebuilt from lists.

A token the previous step sampled and the host has not read yet (the engine dispatches step
N+1 before it reads step N's tokens) is taken on the device from that step's output: its
`prev_token_rows` entry names the row, and the host's copy of the id is 0. So are drafts a
proposer made on the device after that step (spec_decode/hidden_steps.py): the scheduler
sends them as DRAFT_ON_DEVICE, and they sit in the columns after the sampled id.

Legend: T tokens (padded), S sequences (padded), R rows of the persistent batch
(max_num_seqs), B blocks per sequence, P tokens per block, N logprobs per token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.kv_cache.manager import PAGED, STATE, WINDOW
from jaxserve.sampling_params import SamplingParams
from jaxserve.sample.tensors import SamplingRow, make_sampling_tensors, needs_extras
from jaxserve.worker import verify_rows
from jaxserve.core.step_input import StepInput
from jaxserve.core.step_messages import DRAFT_ON_DEVICE, GrammarMasks, NewRequestData, SchedulerOutput


@dataclasses.dataclass
class CachedRequest:
    """The runner's state of one running request."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]     # the tokens this runner has read back (or was sent)
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    row: int                        # its row of InputBatch.block_table
    num_blocks: int = 0             # filled entries of that row
    num_window_blocks: int = 0      # filled entries of its row of InputBatch.window_table
    state_slot: int = 0             # its state slot (0: the model keeps no state)
    lora_slot: int = 0              # its LoRA adapter's device slot (0: none)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions start..end-1 (all known to the host)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the host knows of a built step besides its StepInput (to read the results)."""
    req_ids: list[str]
    requests: list[CachedRequest]   # the runner's copies the step ran (an id may be reused)
    samples: list[bool]             # per request: the chunk samples
    prompt_lp_starts: dict[str, tuple[int, int]]   # req -> (first position, rows) of prompt logprobs
    query_start_loc: np.ndarray     # i32[S+1]
    full: bool                      # the step needs the full sampler (logprobs, penalties, masks)
    prompt_logprobs: bool
    draft_starts: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # seq -> (logits row of its first draft, drafts) in a verifying step (verify_rows.py)
    input_ends: list[int] = dataclasses.field(default_factory=list)
    # per request: its chunk's inputs are its tokens before this position (drafts aside)

    def is_void(self, i: int) -> bool:
        """Request i's chunk started past what the request now holds: it assumed drafts of
        the step before were kept and one was not (scheduler.py: scheduling past drafts)."""
        return self.input_ends[i] > self.requests[i].num_tokens


class InputBatch:
    def __init__(self, *, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 vocab_size: int, max_model_len: int, group_kinds: list[str],
                 max_spec_tokens: int = 0, lora: bool = False):
        self.max_spec_tokens = max_spec_tokens    # K of a verifying step (at least its most drafts)
        self.lora = lora                          # steps carry each token's LoRA slot
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.group_kinds = group_kinds
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)   # i32[R, B]
        # the sliding-window group's tables (kv_cache/manager.py), when the model has one
        self.window_table = np.zeros_like(self.block_table) if WINDOW in group_kinds else None
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, CachedRequest] = {}
        self.prev_rows: dict[str, int] = {}     # req -> its sampled id's index in the last step's
        self.prev_stride = 1                    # ... ids (flat: [rows, 1 + device draft columns])

    # -- the diffs ---------------------------------------------------------------------------
    def apply(self, out: SchedulerOutput) -> None:
        """Take in a step's diffs: drop finished requests, add new ones, append block ids."""
        for rid in out.finished_req_ids:
            self.remove(rid)
        for new in out.new_requests:
            self.add(new)
        for sched in out.scheduled:
            req = self.requests[sched.req_id]
            for kind, ids in zip(self.group_kinds, sched.new_block_ids):
                if kind == PAGED and ids:
                    self.block_table[req.row, req.num_blocks:req.num_blocks + len(ids)] = ids
                    req.num_blocks += len(ids)
                elif kind == STATE and ids:
                    req.state_slot = ids[0]
                elif kind == WINDOW and ids:
                    n = req.num_window_blocks
                    self.window_table[req.row, n:n + len(ids)] = ids
                    req.num_window_blocks += len(ids)

    def add(self, new: NewRequestData) -> None:
        if new.req_id in self.requests:      # resumed after preemption: start again
            self.remove(new.req_id)
        row = self.free_rows.pop()
        self.block_table[row] = 0
        if self.window_table is not None:
            self.window_table[row] = 0
        self.requests[new.req_id] = CachedRequest(
            new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
            new.sampling_params, new.seed, tuple(new.eos_token_ids), row, lora_slot=new.lora_slot)

    def remove(self, req_id: str) -> None:
        req = self.requests.pop(req_id, None)
        if req is not None:
            self.free_rows.append(req.row)
        self.prev_rows.pop(req_id, None)

    def append_tokens(self, req: CachedRequest, tokens: list[int]) -> None:
        """Tokens this runner sampled for `req` and has read back (ignored once it was
        dropped, also when its id now names a new request)."""
        if self.requests.get(req.req_id) is req:
            req.output_token_ids.extend(tokens)

    # -- one step's input --------------------------------------------------------------------
    def build(self, out: SchedulerOutput, num_tokens: int, num_seqs: int) -> tuple[StepInput, StepPlan]:
        """Host-side numpy StepInput of the step, padded to (num_tokens, num_seqs). A step in
        which a request with structured output samples gets a full-width allowed-token mask,
        for the engine's grammar masks (and_grammar_masks)."""
        p = self.block_size
        token_ids, positions, seq_ids, lora_T = [], [], [], []
        rows = np.zeros(num_seqs, np.int64)
        next_ids = np.zeros(num_tokens, np.int32)
        prev_rows = np.full(num_tokens, -1, np.int32)
        qsl = np.zeros(num_seqs + 1, np.int32)
        seq_lens = np.zeros(num_seqs, np.int32)
        logits_idx = np.zeros(num_seqs, np.int32)
        slots_S = np.zeros(num_seqs, np.int32)
        sampling_rows, samples, prompt_lp, reqs, draft_seqs, ends = [], [], {}, [], [], []
        full = constrained = False
        t = 0
        for s, sched in enumerate(out.scheduled):
            req = self.requests[sched.req_id]
            reqs.append(req)
            start, n = sched.start_position, sched.num_tokens
            drafts = list(sched.spec_token_ids)
            real = start + n - len(drafts)         # the drafts are the chunk's last tokens
            on_device = bool(drafts) and drafts[0] == DRAFT_ON_DEVICE
            ends.append(real)
            known = min(real, req.num_tokens)
            token_ids += req.tokens(start, known)
            if known < real:           # the last token is still on the device
                # (a draft model's proposer runs several steps ahead of what it read back:
                # only the chunk's own tokens must be known, so max(known, start))
                if max(known, start) + 1 != real or sched.req_id not in self.prev_rows:
                    raise RuntimeError(f"request {sched.req_id}: tokens {known}..{real - 1} "
                                       f"are neither known nor on their way from the last step")
                prev_rows[t + real - start - 1] = self.prev_rows[sched.req_id]
                token_ids.append(0)
            if on_device:            # after the sampled id, in its row of the last step's ids
                if sched.req_id not in self.prev_rows or len(drafts) >= self.prev_stride:
                    raise RuntimeError(f"request {sched.req_id}: its drafts are not on the device")
                first = t + real - start
                prev_rows[first:first + len(drafts)] = self.prev_rows[sched.req_id] + 1 + np.arange(len(drafts))
                drafts = [0] * len(drafts)
            token_ids += drafts
            positions += range(start, start + n)
            seq_ids += [s] * n
            if self.lora:
                lora_T += [req.lora_slot] * n
            rows[s] = req.row
            slots_S[s] = req.state_slot
            qsl[s + 1] = t + n
            seq_lens[s] = start + n
            logits_idx[s] = t + n - 1
            params = req.sampling_params
            n_prompt = len(req.prompt_token_ids)
            if params.prompt_logprobs is not None and start < n_prompt:
                # Position q's logits predict prompt token q + 1: keep q < n_prompt - 1.
                nxt = req.prompt_token_ids[start + 1:min(start + n, n_prompt - 1) + 1]
                next_ids[t:t + len(nxt)] = nxt
                prompt_lp[sched.req_id] = (start, len(nxt))
            sampling_rows.append(SamplingRow(
                params=params, prompt_token_ids=req.prompt_token_ids,
                # (penalties alone read the history: no copy of it per step otherwise)
                output_token_ids=req.output_token_ids + drafts if drafts and params.uses_penalties
                else req.output_token_ids,
                seed=req.seed, offset=start + n - n_prompt if sched.sample else 0,
                eos_token_ids=req.eos_token_ids))
            if drafts:
                draft_seqs.append(verify_rows.DraftSeq(s, t + n - len(drafts) - 1, drafts,
                                                       sampling_rows[-1]))
            samples.append(sched.sample)
            constrained = constrained or (sched.sample and params.structured_outputs is not None)
            full = full or params.logprobs is not None or params.uses_truncation
            t += n
        qsl[len(out.scheduled) + 1:] = t
        pad = num_tokens - t
        positions_T = np.array(positions + [0] * pad, np.int32)
        tables_SB = self.block_table[rows]
        tables_SB[len(out.scheduled):] = 0
        window_SB = None
        if self.window_table is not None:
            window_SB = self.window_table[rows]
            window_SB[len(out.scheduled):] = 0
        seq_T = np.array(seq_ids + [0] * pad, np.int32)
        # Padding tokens write slot 0 of the null block (step_input.py's conventions).
        slots_T = tables_SB[seq_T, positions_T // p] * p + positions_T % p
        slots_T[t:] = 0
        spec = None
        if draft_seqs:       # verification: draft rows after the sequence rows
            spec = verify_rows.build(draft_seqs, num_seqs, self.max_spec_tokens)
            logits_idx = np.concatenate([logits_idx, spec.logits_indices])
            sampling_rows += [verify_rows.PAD_ROW] * (num_seqs - len(sampling_rows)) + spec.sampling_rows
        full = full or bool(prompt_lp) or needs_extras(sampling_rows)
        sampling = make_sampling_tensors(sampling_rows, len(logits_idx), self.vocab_size,
                                         self.max_model_len, with_extras=full,
                                         with_mask=full or constrained)
        x = StepInput(token_ids=np.array(token_ids + [0] * pad, np.int32), positions=positions_T,
                      slot_mapping=slots_T.astype(np.int32), token_seq_ids=seq_T,
                      query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables_SB,
                      logits_indices=logits_idx, next_token_ids=next_ids,
                      prev_token_rows=prev_rows, sampling=sampling,
                      state_slots=slots_S if STATE in self.group_kinds else None,
                      window_block_tables=window_SB,
                      state_save_slots=loop_saves(out, num_seqs),
                      lora_slots=np.array(lora_T + [0] * pad, np.int32) if self.lora else None,
                      draft_token_ids=spec.draft_token_ids if spec else None,
                      draft_rows=spec.draft_rows if spec else None,
                      num_drafts=spec.num_drafts if spec else None)
        plan = StepPlan(out.req_ids, reqs, samples, prompt_lp, qsl, full, bool(prompt_lp),
                        spec.starts if spec else {}, ends)
        return x, plan


def loop_saves(out: SchedulerOutput, num_seqs: int) -> np.ndarray | None:
    """i32[S] each sequence's saved-state slot in a multi-step decode step that saves some
    (StepInput.state_save_slots), else None (a step without saves keeps its own program)."""
    if out.num_steps == 1 or not any(s.save_state_slot for s in out.scheduled):
        return None
    saves = np.zeros(num_seqs, np.int32)
    saves[:len(out.scheduled)] = [s.save_state_slot for s in out.scheduled]
    return saves


def and_grammar_masks(allowed_SW: np.ndarray, plan: StepPlan, masks: GrammarMasks) -> None:
    """AND a built step's grammar masks (structured output: the engine makes them) into its
    allowed-token masks (u8[rows, W], in place): a request's mask rows are its draft rows
    (verify_rows.py), then its sequence row."""
    seq_of = {rid: s for s, rid in enumerate(plan.req_ids)}
    rows = []
    for rid in masks.req_ids:
        s = seq_of[rid]
        rows += [*verify_rows.rows_of(s, plan.draft_starts), s]
    if len(rows) != len(masks.bits):
        raise RuntimeError(f"the step's grammar masks have {len(masks.bits)} rows, its "
                           f"constrained requests {len(rows)}")
    if rows:
        allowed_SW[rows] &= masks.bits
