"""The model family contract: what the engine, the loaders, the sharding rules and the
proposers may ask of an architecture, and nothing else.

One `ModelFamily` object per family stands in the registry (models/registry.py) for each HF
architecture name it serves. The base class holds the defaults (HF config parsing, no MTP,
weights used as loaded); a family overrides what differs. Capabilities are explicit members
(`supports_mtp`, `eagle3_aux_layers`), never probed with `hasattr`.

The methods are pure functions of their arguments (the family object holds no state), so
`forward` and `compute_logits` can be traced inside the runner's jitted step.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.pallas_kernels.policy import KernelPlan


class ModelFamily:
    """A family backed by a module of pure functions (llama.py, deepseek.py, ...): each method
    calls the module's function of the same name; optional functions are capabilities."""

    def __init__(self, module: ModuleType):
        self.module = module
        self.name = module.__name__.rsplit(".", 1)[-1]    # "llama", "deepseek", ...

    def __repr__(self) -> str:
        return f"ModelFamily({self.name})"

    # -- configuration and parameters ---------------------------------------------------
    def config_from_hf(self, hf: dict) -> ModelConfig:
        """The engine's ModelConfig from an HF config.json dict (or GGUF metadata mapped to it)."""
        fn = getattr(self.module, "config_from_hf", None)
        return fn(hf) if fn is not None else ModelConfig.from_hf(hf)

    def param_shapes(self, cfg: ModelConfig) -> dict:
        """The shape of every parameter (nested dicts / lists of tuples)."""
        return self.module.param_shapes(cfg)

    def cache_specs(self, cfg: ModelConfig) -> list:
        """One cache spec per layer (core/kv_cache/specs.py)."""
        return self.module.cache_specs(cfg)

    # -- the step -----------------------------------------------------------------------
    def make_kernels(self, cfg: ModelConfig, backend, plan=None,
                     kernel_plan: KernelPlan = KernelPlan()):
        """The kernels of one compiled step (the attention backend's `plan`, the engine's
        `kernel_plan`)."""
        if plan is None:
            return self.module.make_kernels(cfg, backend, kernel_plan=kernel_plan)
        return self.module.make_kernels(cfg, backend, plan, kernel_plan)

    def forward(self, cfg: ModelConfig, params, caches, x, kernels, aux_layers: tuple[int, ...] = ()):
        """(caches, hidden f[T, D], aux hidden states after `aux_layers`)."""
        if aux_layers:
            return self.module.forward(cfg, params, caches, x, kernels, aux_layers)
        return self.module.forward(cfg, params, caches, x, kernels)

    def compute_logits(self, cfg: ModelConfig, params, hidden_SD, kernels=None):
        """f32[S, V] logits of the rows `hidden_SD`."""
        return self.module.compute_logits(cfg, params, hidden_SD, kernels)

    def prepare_weights(self, cfg: ModelConfig, params: dict, *, kernel_plan: KernelPlan, mesh,
                        backend) -> dict:
        """The loaded parameters re-laid for the step's kernels, in place (no second copy):
        projections that read one input fused, expert arrays past the grouped kernel's reach
        split into chunks, the fused stack's projections stored [out, in]. Unsharded only:
        under a mesh the sharding rules name the unfused weights, and wq|wk|wv concatenated
        then split by columns would give rank 0 all of q and none of k, v."""
        from jaxserve.models.moe import split_expert_weights

        if mesh is not None:
            return params
        fuse = getattr(self.module, "fuse_projections", None)
        if fuse is not None:
            params = fuse(cfg, params)
        params = split_expert_weights(params)
        transpose = getattr(self.module, "transpose_for_fused_stack", None)
        if transpose is not None and getattr(self.make_kernels(cfg, backend, kernel_plan=kernel_plan), "linear", False):
            params = transpose(cfg, params)
        return params

    # -- capabilities ---------------------------------------------------------------------
    @property
    def supports_mtp(self) -> bool:
        """Whether the family has a forward for its multi-token-prediction layers."""
        return hasattr(self.module, "mtp_forward")

    def mtp_cache_specs(self, cfg: ModelConfig) -> list:
        return self.module.mtp_cache_specs(cfg)

    def mtp_forward(self, cfg: ModelConfig, params, caches, x, prev_hidden, *, attention_impl: str):
        return self.module.mtp_forward(cfg, params, caches, x, prev_hidden, attention_impl=attention_impl)

