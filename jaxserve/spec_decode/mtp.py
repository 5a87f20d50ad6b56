"""The MTP proposer: the target's own multi-token-prediction layer (DeepSeek V3's
`params["mtp"]`, models/deepseek.py `mtp_forward`) proposes one draft per request.

After each target step (the core waits for it while speculating), for every chunk of that
step, the MTP layer runs over the positions whose target KV stayed valid (the rejected draft
positions are left out): at position p it reads embed(token p + 1) with the target's final
hidden state at p, which stayed on the device (the runner returns it: StepVariant.hidden).
Its own latent cache is paged on the target's block tables (the same slot per position), so
it needs no blocks of its own. The logits at a sampling chunk's last position propose the
token after the one just sampled: the draft of the request's next step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.step_messages import ScheduledRequest, SchedulerOutput


def _mtp_step(params, caches, x, hidden_TD, rows_T, *, model, cfg, attention_impl):
    """(MTP caches, the greedy draft after each sequence's last position i32[S])."""
    caches, logits_TV, _ = model.mtp_forward(cfg, params, caches, x, hidden_TD[rows_T],
                                             attention_impl=attention_impl)
    return caches, jnp.argmax(logits_TV[x.logits_indices], axis=-1).astype(jnp.int32)


class MtpProposer:
    def __init__(self, spec_config, runner):
        from jaxserve.runner import allocate_caches

        model, cfg = runner.model, runner.cfg
        layers = len(runner.params.get("mtp", ())) if isinstance(runner.params, dict) else 0
        if not hasattr(model, "mtp_forward") or not layers:
            raise ValueError(f"speculative_config['method'] 'mtp' needs a model with MTP layers "
                             f"(DeepSeek V3's num_nextn_predict_layers, loaded with the checkpoint); "
                             f"{cfg.architecture} here has none")
        if spec_config.num_speculative_tokens != 1:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be 1 with method "
                             f"'mtp' (one MTP layer, not chained yet); got "
                             f"{spec_config.num_speculative_tokens}")
        self.k = 1
        self.runner = runner
        self.caches = allocate_caches(model.mtp_cache_specs(cfg), runner.num_blocks, 0,
                                      runner.block_size, runner.dtype)
        self._step = jax.jit(functools.partial(_mtp_step, model=model, cfg=cfg,
                                               attention_impl=runner.attention_impl),
                             donate_argnums=(1,))
        self._drafts: dict[str, list[int]] = {}

    def observe(self, out: SchedulerOutput, step, result) -> None:
        """Run the MTP layer over the step's valid positions; keep each sampling chunk's draft."""
        plan, batch = step.plan, self.runner.batch
        chunks, rows, tokens = [], [], []
        for i, (sched, kept) in enumerate(zip(out.scheduled, result.sampled_token_ids)):
            req = plan.requests[i]
            if batch.requests.get(req.req_id) is not req:
                continue                  # dropped meanwhile
            # Positions whose token p + 1 is known: up to the last kept token, so the rejected
            # drafts' positions (beyond it) are left out.
            n = min(sched.num_tokens, req.num_tokens - 1 - sched.start_position)
            if n <= 0:
                continue
            chunks.append(ScheduledRequest(req.req_id, sched.start_position, n, [], bool(kept)))
            first = int(plan.query_start_loc[i])
            rows += range(first, first + n)
            tokens += [req.token(p + 1) for p in range(sched.start_position, sched.start_position + n)]
        self._drafts = {}
        if not chunks:
            return
        total = sum(c.num_tokens for c in chunks)
        t_pad, s_pad = self.runner.bucket(total)
        x, _ = batch.build(SchedulerOutput([], chunks, [], total, [], 0), t_pad, s_pad)
        ids_T = np.zeros(t_pad, np.int32)
        ids_T[:total] = tokens
        rows_T = np.zeros(t_pad, np.int32)
        rows_T[:total] = rows
        x = dataclasses.replace(x, token_ids=ids_T, prev_token_rows=None)
        self.caches, drafts = self._step(self.runner.params, self.caches, x, step.hidden, rows_T)
        drafts = np.asarray(drafts).tolist()
        for s, c in enumerate(chunks):
            if c.sample:
                self._drafts[c.req_id] = [drafts[s]]

    def propose(self, requests, limits: list[int]) -> list[list[int]]:
        return [self._drafts.get(r.request_id, [])[:lim] for r, lim in zip(requests, limits)]

    def retain(self, running_ids) -> None:
        """Nothing per request: the MTP cache lives on the target's blocks."""
