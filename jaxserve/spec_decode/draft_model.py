"""The draft-model proposer: a smaller model on the target's vocabulary proposes greedily.

It runs on its own ModelRunner (its own paged cache, jitted bucketed steps) and its own
block manager, speaking to that runner through the same step messages as the scheduler.
Each time the engine asks for drafts:
  1. catch-up: each request computes the tokens its draft cache lacks (those since the
     longest prefix still valid: the draft's own rejected guesses are overwritten), the
     last chunk sampling draft 0 (read back, so the next steps know it);
  2. k - 1 one-token steps, dispatched back to back without reading anything back: each
     takes the previous step's token on the device (prev_token_rows), so the k - 1 steps
     queue on the device and the host waits once, for all of them.
Drafts are greedy, so the verifier treats them as one-hot q (exact for random sampling too).
Catch-up steps re-send the request (NewRequestData with its real tokens): the runner's copy
then never keeps draft tokens the target rejected.

It reads token ids only, so it also drafts ahead of the target's step (spec_decode/drafting.py):
the request's tokens are then followed by the step's drafts, assumed kept (its own drafts of
the step before, so its cache mostly holds them already), and it proposes one token more.
Its steps queue behind the target's step on the device, so the engine still waits for that
step before dispatching the next; reading and applying it overlap, the dispatch does not.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from jaxserve.core.kv_cache.manager import PAGED, WINDOW, KVCacheManager
from jaxserve.core.step_messages import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.worker.runner import ModelRunner
from jaxserve.worker.target_view import TargetView

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0, max_tokens=None)


def _check_compatible(draft_cfg, target_cfg) -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_config['model'] must have the target's vocabulary "
                         f"({target_cfg.vocab_size} tokens); the draft model has {draft_cfg.vocab_size}")


def _draft_needs(path: str, engine_config) -> tuple[tuple, int]:
    """(the draft's cache specs, its weights' bytes in the engine's dtype), read from its HF
    config: the target's runner sizes its caches with them (worker/memory_plan.py), as the
    draft's cache holds at most the target's blocks and its weights load after the sizing. A
    GGUF draft: its file's size (its config is read when it loads), no cache specs."""
    import os

    import jax.numpy as jnp

    from jaxserve.models import loader, registry
    from jaxserve.models.loaders import hf as hf_loader

    if not (isinstance(path, str) and hf_loader.is_hf_dir(path)):
        return (), os.path.getsize(path) if isinstance(path, str) and os.path.isfile(path) else 0
    cfg = loader.model_config_from_hf(hf_loader.read_hf_config(path))
    family = registry.get_family(cfg.architecture)
    elements = sum(math.prod(shape) for shape in _shape_leaves(family.param_shapes(cfg)))
    return tuple(family.cache_specs(cfg)), elements * jnp.dtype(engine_config.dtype).itemsize


def _shape_leaves(tree):
    """The shapes (tuples of ints) of a family's param_shapes tree."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _shape_leaves(value)
    elif isinstance(tree, (list, tuple)) and not all(isinstance(d, int) for d in tree):
        for value in tree:
            yield from _shape_leaves(value)
    else:
        yield tuple(tree)


class DraftModelProposer(Proposer):
    method = "draft_model"
    pipelines = True      # reads token ids only (module docstring)

    def __init__(self, spec_config, engine_config):
        """The draft loads when bound, after the target's caches are sized: the target's
        memory plan pays for its weights and its cache first (_draft_needs)."""
        self.spec_config, self.engine_config = spec_config, engine_config
        self.target_cache_specs, self.target_weight_bytes = _draft_needs(spec_config.model, engine_config)
        self.k = spec_config.num_speculative_tokens
        self.budget = engine_config.scheduler.max_num_batched_tokens
        self.cached: dict[str, np.ndarray] = {}    # request -> tokens whose KV the draft cache holds
        self._dropped: list[str] = []               # to drop from the runner with the next step

    def bind(self, target: TargetView) -> None:
        """Load the draft (spec_config.model) onto its own runner, of at most the target's
        block count."""
        from jaxserve.models import loader, registry

        engine_config = self.engine_config
        cfg, params, _ = loader.load_model(self.spec_config.model, dtype=engine_config.dtype)
        sched = engine_config.scheduler
        _check_compatible(cfg, engine_config.model)
        # A draft shorter than the target drafts only below its own length (as vLLM caps
        # the draft's max_model_len): drafting.py stops a request's drafts there, and the
        # draft's runner and blocks are sized for its length alone
        max_len = min(sched.max_model_len, cfg.max_position_embeddings)
        if max_len < sched.max_model_len:
            self.max_positions = max_len
            logger.info("the draft model allows %d positions (max_model_len %d): a request "
                        "carries on without drafts past them", max_len, sched.max_model_len)
        bs = engine_config.cache.block_size
        useful = sched.max_num_seqs * math.ceil(max_len / bs) + 1
        blocks = min(useful, target.num_blocks)
        config = dataclasses.replace(engine_config, model=cfg, speculative=None,
                                     scheduler=dataclasses.replace(sched, max_model_len=max_len),
                                     cache=dataclasses.replace(engine_config.cache, num_kv_blocks=blocks,
                                                               enable_prefix_caching=False))
        self.runner = ModelRunner(config, params, registry.get_family(cfg.architecture))
        if any(kind != PAGED for kind in self.runner.group_kinds):
            # (its KVCacheManager below hands out the paged group's blocks alone)
            kept = ("a sliding-window cache group (its own blocks, freed as a request advances)"
                    if WINDOW in self.runner.group_kinds else "per-request state")
            raise ValueError(f"speculative_config['model'] must be an attention-only model with "
                             f"one paged cache group; {cfg.architecture} keeps {kept}")
        self.kv = KVCacheManager(self.runner.cache_specs, block_size=bs, num_blocks=blocks,
                                 enable_prefix_caching=False)

    def warmup(self) -> None:
        """Start compiling the draft's step programs (lean: its drafts are greedy) in the
        background; returns at once (the engine's warm-up waits for the target's plain
        programs only). A draft step whose program is still compiling waits for it."""
        self.runner.warmup(background=True, lean_only=True)

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        self.runner.wait_for_warmup(raise_errors)

    def retain(self, running_ids) -> None:
        """Free the draft cache of requests that ended or were preempted (a preempted one
        computes its draft cache again when it drafts next)."""
        for rid in [r for r in self.cached if r not in running_ids]:
            self.kv.free(rid)
            del self.cached[rid]
            self._dropped.append(rid)

    def propose(self, requests, limits: list[int], tails=None) -> list[list[int]]:
        reqs, lims, tokens = [], [], []
        for i, (req, lim) in enumerate(zip(requests, limits)):
            toks = np.asarray(req.all_token_ids + (list(tails[i]) if tails else []), np.int64)
            if self._reserve(req.request_id, len(toks) + lim - 1):
                reqs.append(req)
                lims.append(lim)
                tokens.append(toks)
        drafts = {r.request_id: [] for r in requests}
        if reqs:
            self._catch_up(reqs, tokens, drafts)
            self._extend(reqs, lims, tokens, drafts)
        return [drafts[r.request_id] for r in requests]

    def _reserve(self, rid: str, num_tokens: int) -> bool:
        """Blocks for `num_tokens` positions of `rid` (False: none free; it drafts nothing)."""
        if self.kv.blocks_needed(rid, num_tokens) > self.kv.num_free_blocks:
            return False
        if rid in self.kv.blocks:
            self.kv.grow(rid, num_tokens)
        else:
            self.kv.admit(rid, [], num_tokens)
            self.cached[rid] = np.zeros(0, np.int64)
        return True

    def _message(self, chunks, resend=None) -> SchedulerOutput:
        """A step of (request, start, tokens, sample) chunks; `resend`: each request's token
        ids (its real ones, and any tail), with which it is sent whole (its whole block table
        too); None: it goes on from the last step."""
        new = [NewRequestData(r.request_id, list(r.prompt_token_ids),
                              resend[r.request_id][r.num_prompt_tokens:].tolist(), _GREEDY, 0, ())
               for r, *_ in chunks] if resend else []
        scheduled = [ScheduledRequest(r.request_id, start, n,
                                      self.kv.group_block_ids(r.request_id) if resend else [[]], sample)
                     for r, start, n, sample in chunks]
        dropped, self._dropped = self._dropped, []
        return SchedulerOutput(new_requests=new, scheduled=scheduled, finished_req_ids=dropped,
                               num_tokens=sum(c[2] for c in chunks), preempted_ids=[],
                               num_cached_tokens=0)

    def _catch_up(self, reqs, tokens, drafts) -> None:
        """Compute what each draft cache lacks; the last chunk samples draft 0."""
        todo, known = [], {r.request_id: t for r, t in zip(reqs, tokens)}
        for req, toks in zip(reqs, tokens):
            old = self.cached[req.request_id]
            m = min(len(old), len(toks) - 1)       # at least one token left to compute
            same = old[:m] == toks[:m]
            valid = m if same.all() else int(np.argmin(same))
            todo.append([req, valid, len(toks)])
        while todo:
            chunks, budget = [], self.budget
            for item in todo:
                req, start, end = item
                n = min(end - start, budget)
                if n <= 0:
                    break
                chunks.append((req, start, n, start + n == end))
                item[1] += n
                budget -= n
            result = self.runner.execute(self._message(chunks, resend=known))
            for (req, _, _, sample), ids in zip(chunks, result.sampled_token_ids):
                if sample:
                    drafts[req.request_id] = list(ids)
            todo = [item for item in todo if item[1] < item[2]]

    def _extend(self, reqs, lims, tokens, drafts) -> None:
        """Drafts 1 .. limit - 1: one-token steps dispatched back to back, read once."""
        steps = []
        for j in range(1, max(lims)):
            chunks = [(r, len(t) - 1 + j, 1, True) for r, t, lim in zip(reqs, tokens, lims) if lim > j]
            steps.append((chunks, self.runner.dispatch(self._message(chunks))))
        for chunks, step in steps:
            for (req, *_), ids in zip(chunks, self.runner.collect(step).sampled_token_ids):
                drafts[req.request_id] += ids
        for req, toks in zip(reqs, tokens):     # the last draft was sampled, not computed
            self.cached[req.request_id] = np.concatenate([toks, drafts[req.request_id][:-1]])
