"""Which running requests get drafts after a step, and how many at most.

A proposer (spec_decode/proposer.py, the contract) has `k` (num_speculative_tokens),
`propose(requests, limits) -> drafts per request` (scheduler Requests, each at most its
limit) and `retain(running_ids)` (forget the others: a proposer with per-request state
frees it there).

A request drafts only in decode (its last token sampled and read back, every other token
computed), and never so many that the step could pass max_tokens or max_model_len: a step
with k drafts keeps up to k + 1 tokens.

A proposer with `pipelines = True` also drafts ahead, so the engine need not wait for each
step: for a request whose step is still on the device, `propose(requests, limits, tails)`
continues each request's tokens by `tail` (that step's drafts, assumed kept), and of what it
proposes the first token stands for the one the step samples after them (not sent: it comes
from the device) and the rest are the drafts. One that reads only token ids (n-gram, the
draft model) guesses that token, and a wrong guess costs only acceptance; one that runs on
the device after each step (MTP, EAGLE3: hidden_steps.py) answers DRAFT_ON_DEVICE for every
draft, the drafts its pass left there. A rejected draft voids the chunk (scheduler.py).
"""

from __future__ import annotations

from jaxserve.core.kv_cache.manager import STATE, group_kinds
from jaxserve.core.request import Request, RequestStatus
from jaxserve.spec_decode.proposer import Proposer


def draft_limit(req: Request, k: int, max_model_len: int, ahead: int = 0) -> int:
    """Drafts the request's next step may carry; `ahead`: its tokens still on the device."""
    p = req.sampling_params
    limit = min(k, max_model_len - req.num_tokens - ahead - 1)
    if p.max_tokens is not None:
        limit = min(limit, p.max_tokens - len(req.output_token_ids) - ahead - 1)
    return max(0, limit)


def position_limit(proposer: Proposer, max_model_len: int) -> int:
    """Positions a request's drafts may reach: the target's and the proposer's own limit."""
    if proposer.max_positions is None:
        return max_model_len
    return min(max_model_len, proposer.max_positions)


def propose_drafts(proposer: Proposer, running: list[Request], k: int, max_model_len: int,
                   valid=None) -> None:
    """Set `spec_token_ids` of each decoding request in `running` from the proposer, which
    forgets every other request first (ended or preempted: a draft model's rows and blocks
    are bounded by max_num_seqs, like the running requests). `valid(request id, drafts)`
    cuts a request's drafts (structured output: at the first token its grammar rejects, so
    the step neither computes nor verifies the rest; StructuredOutputManager.valid_drafts)."""
    proposer.retain({r.request_id for r in running})
    max_model_len = position_limit(proposer, max_model_len)
    reqs, limits = [], []
    for req in running:
        if (req.status == RequestStatus.RUNNING and not req.num_output_placeholders
                and req.num_computed_tokens == req.num_tokens - 1 and req.output_token_ids):
            limit = draft_limit(req, k, max_model_len)
            if limit:
                reqs.append(req)
                limits.append(limit)
    if reqs:
        for req, drafts in zip(reqs, proposer.propose(reqs, limits)):
            drafts = list(drafts)
            req.spec_token_ids = valid(req.request_id, drafts) if valid and drafts else drafts


def propose_ahead(proposer: Proposer, running: list[Request], k: int, max_model_len: int) -> None:
    """Drafts for each request whose newest step (a decode or a verifying one) is still on the
    device, assuming the step keeps its drafts (module docstring): they are the next step's."""
    max_model_len = position_limit(proposer, max_model_len)
    reqs, limits, tails = [], [], []
    for req in running:
        tail = req.inflight_drafts
        if (req.status == RequestStatus.RUNNING and req.num_output_placeholders == 1
                and not req.spec_token_ids
                and req.num_computed_tokens == req.num_tokens + len(tail)):
            limit = draft_limit(req, k, max_model_len, ahead=len(tail) + 1)
            if limit:
                reqs.append(req)
                limits.append(limit + 1)
                tails.append(tail)
    if reqs:
        for req, drafts in zip(reqs, proposer.propose(reqs, limits, tails)):
            req.spec_token_ids = list(drafts[1:])


# Proposers that run beside a target with recurrent state (hybrid models)
HYBRID_METHODS = ("ngram", "draft_model")


def make_proposer(spec_config, engine_config, model, params) -> Proposer | None:
    """The proposer of `spec_config.method` (None when speculation is off), for the target
    `model` (its family) with the loaded `params`: unbound (engine/builder.py builds the
    target's runner with its target_needs(), then binds it)."""
    if spec_config is None:
        return None
    cfg = engine_config.model
    if STATE in group_kinds(model.cache_specs(cfg)) and spec_config.method not in HYBRID_METHODS:
        # NOTE: the scheduler rolls the target's recurrent state back (scheduler.py); a
        # proposer reading the target's hidden states would also see the recomputed rows
        raise ValueError(f"speculative_config['method'] {spec_config.method!r} is not supported "
                         f"for models with recurrent state (linear-attention layers: "
                         f"{cfg.architecture}); use one of {', '.join(HYBRID_METHODS)}")
    if spec_config.method == "eagle3":
        from jaxserve.spec_decode.eagle3 import Eagle3Proposer
        return Eagle3Proposer(spec_config, engine_config)
    if spec_config.method == "mtp":
        from jaxserve.spec_decode.mtp import MtpProposer
        return MtpProposer(spec_config, model, cfg, params)
    if spec_config.method == "ngram":
        from jaxserve.spec_decode.ngram import NgramProposer
        return NgramProposer(spec_config)
    if spec_config.method == "draft_model":
        from jaxserve.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(spec_config, engine_config)
    raise ValueError(f"speculative_config['method'] {spec_config.method!r} has no proposer")
