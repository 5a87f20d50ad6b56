"""The model family contract: what the engine, the loaders, the sharding rules and the
proposers may ask of an architecture, and nothing else.

One `ModelFamily` object per family (models/families.py) stands in the registry
(models/registry.py) for each HF architecture name it serves. This base class holds the
defaults: the config is `ModelConfig.from_hf`, the parameters are llama's layout (the names
and logical axes below) read by the generic HF loader (loaders/hf.py) or drawn at random
(loaders/dummy.py), the weights are used as loaded, and there is no MTP. A family overrides
what differs; the step itself (`param_shapes`, `cache_specs`, `make_kernels`, `forward`,
`compute_logits`) every family must give. Capabilities are members (`supports_mtp`), never
probed with `hasattr`.

The methods are pure functions of their arguments (a family object holds no state), so
`forward` and `compute_logits` can be traced inside the runner's jitted step.
"""

from __future__ import annotations

import abc

from jaxserve.config import ModelConfig
from jaxserve.models.loaders import dummy, hf as hf_loader
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.sharding import rules

# Parameter name -> logical axis of each dimension (llama's layout: models/llama.py; the
# sharding rules map the logical names to mesh axes).
DENSE_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",), "mlp_norm": ("embed",),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
}
# In a layer that holds a router (an MoE layer: models/moe.py) these names are experts.
EXPERT_AXES = {
    "router": ("embed", "router"),
    "w_gate": ("experts", "embed", "mlp"), "w_up": ("experts", "embed", "mlp"),
    "w_down": ("experts", "mlp", "embed"),
}
# Cache array name (core/kv_cache/specs.py) -> logical axes of [num_blocks, P, ...] (paged) or
# [num_slots, ...] (state). Why MLA latents and index keys are replicated, and how DeltaNet
# states split: models/families.py.
CACHE_AXES = {
    "k": ("kv_blocks", "block_tokens", "kv_heads", "head_dim"),
    "v": ("kv_blocks", "block_tokens", "kv_heads", "head_dim"),
    "latent": ("kv_blocks", "block_tokens", "lora"),
    "index_k": ("kv_blocks", "block_tokens", "head_dim"),
    "conv": ("state_slots", "conv_channels", "conv_width"),     # split like w_qkv's columns
    "ssm": ("state_slots", "v_heads", "head_dim", "head_dim"),  # [H, B, A]: by value head
}


class ModelFamily(abc.ABC):
    """An architecture family: its config, parameters (shapes and logical axes), caches, step,
    loading and capabilities."""

    name: str                               # "llama", "deepseek", ...: logs, program identity
    param_axes: dict = DENSE_AXES           # parameter name -> logical axes
    expert_axes: dict = EXPERT_AXES         # ... overriding param_axes inside an MoE layer
    cache_axes: dict = CACHE_AXES           # cache array name -> logical axes
    supports_mtp: bool = False              # has a forward for its multi-token-prediction layers
    keeps_fp8_experts: bool = False         # its HF loader can keep FP8 experts (quantization="fp8")

    def __repr__(self) -> str:
        return f"ModelFamily({self.name})"

    # -- configuration ------------------------------------------------------------------
    def config_from_hf(self, hf: dict) -> ModelConfig:
        """The engine's ModelConfig from an HF config.json dict; unsupported variants raise."""
        return ModelConfig.from_hf(hf)

    def config_from_gguf(self, hf: dict) -> ModelConfig:
        """The ModelConfig of GGUF metadata mapped to an HF config dict (loaders/gguf.py)."""
        return self.config_from_hf(hf)

    # -- parameters ---------------------------------------------------------------------
    @abc.abstractmethod
    def param_shapes(self, cfg: ModelConfig) -> dict:
        """The shape of every parameter (nested dicts / lists of tuples)."""

    def param_logical_axes(self, cfg: ModelConfig, shapes: dict | None = None) -> dict:
        """The parameter tree (`shapes`, default param_shapes; an "mtp" subtree too) with a
        tuple of logical axis names at every leaf, by name (param_axes; in a dict that holds a
        router, expert_axes over them)."""
        return _axes_of(self.param_shapes(cfg) if shapes is None else shapes, self.param_axes,
                        self.expert_axes, "")

    def divisible_dims(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        """(config field, size, logical axis) of each dimension a mesh must split evenly."""
        dims = [("num_heads", cfg.num_heads, "heads"), ("num_kv_heads", cfg.num_kv_heads, "kv_heads")]
        if cfg.is_moe:
            return dims + [("moe_intermediate_size", cfg.moe_intermediate_size, "mlp"),
                           ("num_experts", cfg.num_experts, "experts")]
        return dims + [("intermediate_size", cfg.intermediate_size, "mlp")]

    def prepare_weights(self, cfg: ModelConfig, params: dict, *, kernel_plan: KernelPlan, mesh,
                        backend) -> dict:
        """The loaded parameters re-laid for the step's kernels (in place: no second copy).
        Default: used as loaded."""
        del cfg, kernel_plan, mesh, backend
        return params

    # -- loading ------------------------------------------------------------------------
    def load_hf(self, path: str, cfg: ModelConfig, dtype: str = "float32", mesh=None,
                quantization: str | None = None) -> tuple[ModelConfig, dict]:
        """(config, params) from an HF directory whose config.json gave `cfg`: by default
        llama's tensor names (loaders/hf.py). `quantization` only where keeps_fp8_experts."""
        del quantization
        return cfg, hf_loader.load_llama_layout(self, path, cfg, dtype, mesh)

    def dummy_params(self, cfg: ModelConfig, dtype: str = "float32", mesh=None, seed: int = 0) -> dict:
        """Random parameters of param_shapes, each made where the sharding rules place it."""
        return dummy.draw_params(self.param_shapes(cfg), rules.param_placements(self, cfg, mesh),
                                 dtype, seed)

    # -- caches and the step ------------------------------------------------------------
    @abc.abstractmethod
    def cache_specs(self, cfg: ModelConfig) -> list:
        """One cache spec per layer (core/kv_cache/specs.py)."""

    @abc.abstractmethod
    def make_kernels(self, cfg: ModelConfig, backend, plan=None,
                     kernel_plan: KernelPlan = KernelPlan()):
        """The kernels of one compiled step (the attention backend's `plan`, the engine's
        `kernel_plan`)."""

    @abc.abstractmethod
    def forward(self, cfg: ModelConfig, params, caches, x, kernels="xla",
                aux_layers: tuple[int, ...] = ()):
        """(caches, hidden f[T, D], aux hidden states after `aux_layers`); `kernels` a
        make_kernels result or an attention impl name."""

    @abc.abstractmethod
    def compute_logits(self, cfg: ModelConfig, params, hidden_SD, kernels=None):
        """f32[S, V] logits of the rows `hidden_SD`."""

    # -- multi-token prediction (supports_mtp) -------------------------------------------
    def mtp_cache_specs(self, cfg: ModelConfig) -> list:
        raise NotImplementedError(f"{self.name} has no MTP layers to run (supports_mtp is False)")

    def mtp_forward(self, cfg: ModelConfig, params, caches, x, prev_hidden, *, attention_impl: str):
        raise NotImplementedError(f"{self.name} has no MTP layers to run (supports_mtp is False)")

    def mtp_hidden_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The target step's aux_layers whose hidden states mtp_forward reads as prev_hidden
        (StepVariant.aux_layers); () is forward's final hidden states."""
        return ()


def _axes_of(tree, table: dict, expert_table: dict, where: str):
    """Logical axes at every shape leaf of a parameter shape tree; a dict holding a router is an
    MoE layer (its w_gate / w_up / w_down are experts), any other a dense one."""
    if isinstance(tree, list):
        return [_axes_of(t, table, expert_table, f"{where}[{i}]") for i, t in enumerate(tree)]
    if "router" in tree:
        table = {**table, **expert_table}
    out = {}
    for name, sub in tree.items():
        if isinstance(sub, tuple):
            if name not in table:
                raise ValueError(f"no sharding rule for parameter {where}{name} (its family's "
                                 f"param_axes: models/families.py)")
            out[name] = table[name]
        else:
            out[name] = _axes_of(sub, table, expert_table, f"{where}{name}.")
    return out
