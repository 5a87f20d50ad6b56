"""The MTP proposer: the target's own multi-token-prediction layer (DeepSeek V3's
`params["mtp"]`, models/deepseek.py `mtp_forward`; V4's, models/deepseek_v4_mtp.py) proposes
k drafts per request: the first MTP layer, chained k times as vLLM does
(hidden_steps.chain_drafts).

After each target step, on the device and queued behind it, the MTP layer runs over that
step's positions (hidden_steps.py): at position p it reads embed(token p + 1) with the
target's final hidden state at p (V4: its hc streams; the family's mtp_hidden_layers), which
stayed on the device (the runner returns it: StepVariant.hidden), over its own cache on the
target's block tables. The logits at a sampling chunk's last kept position propose the token
after the one just sampled: the draft of the request's next step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jaxserve.spec_decode import hidden_steps
from jaxserve.worker.cache_sizing import allocate_caches
from jaxserve.worker.target_view import TargetView


def _mtp_step(params, caches, x, hidden_TD, sample_S, *, model, cfg, attention_impl, k, block_size):
    """(MTP caches, greedy drafts i32[S, k]): the pass over x, then the same MTP layer k - 1
    more times, each on the draft before and the layer's own output hidden state (vLLM's
    chaining of DeepSeek's one MTP layer)."""
    def run(caches, x, prev_hidden):
        caches, logits, hidden = model.mtp_forward(cfg, params, caches, x, prev_hidden,
                                                   attention_impl=attention_impl)
        return caches, jnp.argmax(logits, axis=-1).astype(jnp.int32), hidden

    def first(caches):
        caches, ids_T, h_TD = run(caches, x, hidden_TD)
        return caches, ids_T[x.logits_indices], h_TD[x.logits_indices]

    def chained(caches, x_j, ids_S, h_SD):
        return run(caches, dataclasses.replace(x_j, token_ids=ids_S), h_SD)

    return hidden_steps.chain_drafts(first, chained, caches, x, sample_S, k, block_size)


class MtpProposer(hidden_steps.AfterStepProposer):
    method = "mtp"

    def __init__(self, spec_config, model, cfg, params):
        """model, cfg, params: the target's family, config and loaded weights (their MTP
        layers are checked here, before the target's runner is built)."""
        layers = len(params.get("mtp", ())) if isinstance(params, dict) else 0
        if layers and not model.supports_mtp:
            raise ValueError(f"speculative_config['method'] 'mtp' is not built for {cfg.architecture} "
                             f"yet: its MTP layers load, but jaxserve has no forward for them "
                             f"(DeepSeek V3 / V3.2 / V4 have one)")
        if not layers:
            raise ValueError(f"speculative_config['method'] 'mtp' needs a model with MTP layers "
                             f"(DeepSeek V3's num_nextn_predict_layers, loaded with the checkpoint); "
                             f"{cfg.architecture} here has none")
        super().__init__(spec_config.num_speculative_tokens)
        # what the layer reads beside each token (V3: the final hidden; V4: its hc streams)
        self.aux_layers = tuple(model.mtp_hidden_layers(cfg))
        # its cache on the target's block tables; its weights are the target's, loaded already
        self.target_cache_specs = tuple(model.mtp_cache_specs(cfg))

    def bind(self, target: TargetView) -> None:
        self.target = target
        self.weights = target.params
        self.cache = allocate_caches(list(self.target_cache_specs), target.num_blocks, 0,
                                     target.block_size, target.dtype,
                                     num_window_blocks=target.num_window_blocks)
        self.forward = functools.partial(_mtp_step, model=target.family, cfg=target.cfg,
                                         attention_impl=target.attention_impl, k=self.k,
                                         block_size=target.block_size)
