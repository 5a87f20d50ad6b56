"""The MTP proposer: the target's own multi-token-prediction layer (DeepSeek V3's
`params["mtp"]`, models/deepseek.py `mtp_forward`) proposes one draft per request.

After each target step (the core waits for it while speculating) the MTP layer runs over
that step's valid positions (hidden_steps.py): at position p it reads embed(token p + 1)
with the target's final hidden state at p, which stayed on the device (the runner returns
it: StepVariant.hidden), over its own latent cache on the target's block tables. The logits
at a sampling chunk's last position propose the token after the one just sampled: the
draft of the request's next step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.spec_decode import hidden_steps


def _mtp_step(params, caches, x, hidden_TD, rows_T, *, model, cfg, attention_impl):
    """(MTP caches, the greedy draft after each sequence's last position i32[S])."""
    caches, logits_TV, _ = model.mtp_forward(cfg, params, caches, x, hidden_TD[rows_T],
                                             attention_impl=attention_impl)
    return caches, jnp.argmax(logits_TV[x.logits_indices], axis=-1).astype(jnp.int32)


class MtpProposer(hidden_steps.AfterStepProposer):
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
        runner.return_hidden_states()
        self.caches = allocate_caches(model.mtp_cache_specs(cfg), runner.num_blocks, 0,
                                      runner.block_size, runner.dtype)
        self._step = jax.jit(functools.partial(_mtp_step, model=model, cfg=cfg,
                                               attention_impl=runner.attention_impl),
                             donate_argnums=(1,))
        self._drafts: dict[str, list[int]] = {}

    def _drafts_of(self, x, hidden, rows_T):
        self.caches, drafts = self._step(self.runner.params, self.caches, x, hidden, rows_T)
        return drafts
