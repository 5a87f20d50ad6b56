"""The four family objects (models/interface.py's contract) over the family modules of pure
functions, with what each has of its own: config class, parameter axes, loaders, weight
re-layout, MTP. models/registry.py maps HF architecture names to them.

Here (not in the family modules) because a family object names its loaders, and each loader
builds on its family module: llama.py <- loaders/hf.py <- LLAMA, deepseek.py <-
loaders/deepseek.py <- DEEPSEEK, and so on, one way.

Logical axes of the families whose parameters are not llama's (sharding/rules.py maps the
logical names to mesh axes; this file only says what each dimension *is*). Why each choice
(TP = the `model` axis):
- MLA: q_b_proj (wq_b / wq) columns, the per-head halves of kv_b_proj (w_uk, w_uv) and o_proj
  rows (wo) split by head: each rank attends with its own heads, one all-reduce after wo.
  The latent cache holds ONE compressed row (latent | rope key) per token that every head
  reads, so it has no head axis to split: it is replicated over `model` (as are wkv_a and
  kv_a_norm, which make it; each rank computes the small [D, C+R] projection itself), and
  wq_a / q_a_norm (the q latent, also read by every head and by the indexer).
- V3.2 indexer: its top-k needs, for every cached position, the sum over ALL indexer heads;
  split heads would all-reduce f32[T, context] scores per layer, far more traffic than its
  small weights cost whole, so wq_idx, wk_idx, w_idx and the index-key cache stay replicated.
- Gated DeltaNet: value heads split (w_z, w_b, w_a columns, dt_bias, a_log, w_out rows, the
  recurrent state's H axis). The conv channels (w_qkv columns, conv_w rows, the conv state)
  split in contiguous blocks, the same blocks in all three, so the depthwise conv and its
  state update stay local. HF's channel order q | k | v would make those blocks parts of
  heads (XLA then reshards the conv output before the delta rule), so on a mesh the loaders
  reorder them per key head (w_qkv_grouped / conv_w_grouped: [q_j | k_j | v of its value
  heads] for each key head j; loaders/qwen3_next.group_conv_channels) whenever the key heads
  divide the `model` axis: each rank's block is then its own heads, and nothing moves.
- Router weights and DeepSeek's e_score_correction_bias: replicated (every rank scores every
  expert); experts over `expert`, their F over `model`; shared experts and dense MLPs like a
  dense MLP; Qwen's shared-expert gate [D, 1] replicated.
- DeepSeek V4: heads split (wq_b columns, sinks, wo_a's groups and wo_b's rows: each rank's
  heads form whole output groups, so o_groups must divide too, one all-reduce after wo_b). The
  single K=V head, its compressors and the indexer (as V3.2's), the mHC projections and the
  hash table are replicated, as are all of its caches (one row per token every head reads).
- MiniMax-M2 normalises q / k over the whole projection, so its norm weights span the heads.
"""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models import deepseek, deepseek_v4, deepseek_v4_mtp, llama, minimax_m2, moe, qwen3_next
from jaxserve.models.interface import DENSE_AXES, ModelFamily
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.models.loaders import deepseek as deepseek_loader
from jaxserve.models.loaders import deepseek_v4 as deepseek_v4_loader
from jaxserve.models.loaders import hf as hf_loader
from jaxserve.models.loaders import minimax_m2 as minimax_m2_loader
from jaxserve.models.loaders import qwen3_next as qwen3_next_loader


def fused_and_split(cfg: ModelConfig, params: dict, mesh, fuse) -> dict:
    """Unsharded only, in place: `fuse(cfg, params)` (the family's fuse_projections: the
    projections that read one input concatenated) and the expert arrays past the grouped
    kernel's reach split into chunks (moe.split_expert_weights). Under a mesh the sharding
    rules name the unfused weights: wq|wk|wv concatenated then split by columns would give
    rank 0 all of q and none of k, v."""
    if mesh is not None:
        return params
    return moe.split_expert_weights(fuse(cfg, params))


class LlamaFamily(ModelFamily):
    """Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE: models/llama.py (+ moe.py)."""
    name = "llama"

    def config_from_hf(self, hf: dict) -> ModelConfig:
        return hf_loader.llama_config_from_hf(hf)

    def config_from_gguf(self, hf: dict) -> ModelConfig:
        # GGUF metadata carries none of the variants llama_config_from_hf refuses
        return ModelConfig.from_hf(hf)

    def param_shapes(self, cfg):
        return llama.param_shapes(cfg)

    def cache_specs(self, cfg):
        return llama.cache_specs(cfg)

    def prepare_weights(self, cfg, params, *, kernel_plan, mesh, backend):
        """fused_and_split, then with the fused stack (Kernels.linear) its projections stored
        [out, in] (llama.transpose_for_fused_stack)."""
        if mesh is not None:
            return params
        params = fused_and_split(cfg, params, mesh, llama.fuse_projections)
        if self.make_kernels(cfg, backend, kernel_plan=kernel_plan).linear:
            params = llama.transpose_for_fused_stack(cfg, params)
        return params

    def make_kernels(self, cfg, backend, plan=None, kernel_plan=KernelPlan()):
        if plan is None:        # llama's own default plan
            return llama.make_kernels(cfg, backend, kernel_plan=kernel_plan)
        return llama.make_kernels(cfg, backend, plan, kernel_plan)

    def forward(self, cfg, params, caches, x, kernels="xla", aux_layers=()):
        return llama.forward(cfg, params, caches, x, kernels, aux_layers)

    def compute_logits(self, cfg, params, hidden_SD, kernels=None):
        return llama.compute_logits(cfg, params, hidden_SD, kernels)


_SHARED_EXPERT_AXES = {"ws_gate": ("embed", "mlp"), "ws_up": ("embed", "mlp"), "ws_down": ("mlp", "embed")}


class DeepseekFamily(ModelFamily):
    """DeepSeek V3 / V3.2: MLA, group-limited MoE with shared experts, the V3.2 indexer, MTP
    layers (models/deepseek.py; loaders/deepseek.py)."""
    name = "deepseek"
    param_axes = {
        **DENSE_AXES, **_SHARED_EXPERT_AXES, "router_bias": ("router",),
        "wq_a": ("embed", "lora"), "q_a_norm": ("lora",), "wq_b": ("lora", "heads"),
        "wkv_a": ("embed", "lora"), "kv_a_norm": ("lora",),
        "w_uk": ("heads", "head_dim", "lora"), "w_uv": ("heads", "lora", "head_dim"),
        # replicated indexer (module doc)
        "wq_idx": ("lora", "head_dim"), "wk_idx": ("embed", "head_dim"),
        "k_idx_norm": ("head_dim",), "k_idx_bias": ("head_dim",), "w_idx": ("embed", "head_dim"),
        # MTP (params["mtp"][m]): its decoder layer as above, and
        "enorm": ("embed",), "hnorm": ("embed",), "eh_proj": ("embed", "embed"),
        "head_norm": ("embed",), "head": ("embed", "vocab"),
    }
    supports_mtp = True
    keeps_fp8_experts = True

    def config_from_hf(self, hf: dict) -> ModelConfig:
        return deepseek.config_from_hf(hf)

    def param_shapes(self, cfg):
        return deepseek.param_shapes(cfg)

    def divisible_dims(self, cfg):
        dims = [("num_attention_heads", cfg.num_heads, "heads")]
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers + cfg.num_mtp_layers)):
            dims.append(("intermediate_size", cfg.intermediate_size, "mlp"))
        if cfg.num_experts:
            dims += [("moe_intermediate_size", cfg.moe_intermediate_size, "mlp"),
                     ("n_routed_experts", cfg.num_experts, "experts")]
        return dims

    def prepare_weights(self, cfg, params, *, kernel_plan, mesh, backend):
        return fused_and_split(cfg, params, mesh, deepseek.fuse_projections)

    def load_hf(self, path, cfg, dtype="float32", mesh=None, quantization=None):
        return deepseek_loader.load_hf(self, path, cfg, dtype, mesh, quantization)

    def cache_specs(self, cfg):
        return deepseek.cache_specs(cfg)

    def make_kernels(self, cfg, backend, plan=None, kernel_plan=KernelPlan()):
        return deepseek.make_kernels(cfg, backend, plan, kernel_plan)

    def forward(self, cfg, params, caches, x, kernels="xla", aux_layers=()):
        return deepseek.forward(cfg, params, caches, x, kernels, aux_layers)

    def compute_logits(self, cfg, params, hidden_SD, kernels=None):
        return deepseek.compute_logits(cfg, params, hidden_SD, kernels)

    def mtp_cache_specs(self, cfg):
        return deepseek.mtp_cache_specs(cfg)

    def mtp_forward(self, cfg, params, caches, x, prev_hidden, *, attention_impl):
        return deepseek.mtp_forward(cfg, params, caches, x, prev_hidden, attention_impl=attention_impl)


class MiniMaxM2Family(ModelFamily):
    """MiniMax-M2 / M2.5: llama's decoder with a full-width q/k norm, partial rotary and
    DeepSeek's biased sigmoid routing (models/minimax_m2.py; loaders/minimax_m2.py)."""
    name = "minimax_m2"
    param_axes = {**DENSE_AXES, "q_norm": ("heads",), "k_norm": ("kv_heads",), "router_bias": ("router",)}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        return minimax_m2.config_from_hf(hf)

    def param_shapes(self, cfg):
        return minimax_m2.param_shapes(cfg)

    def prepare_weights(self, cfg, params, *, kernel_plan, mesh, backend):
        return fused_and_split(cfg, params, mesh, minimax_m2.fuse_projections)

    def load_hf(self, path, cfg, dtype="float32", mesh=None, quantization=None):
        return minimax_m2_loader.load_hf(self, path, cfg, dtype, mesh)

    def dummy_params(self, cfg, dtype="float32", mesh=None, seed=0):
        return minimax_m2_loader.dummy_params(self, cfg, dtype, mesh, seed)

    def cache_specs(self, cfg):
        return minimax_m2.cache_specs(cfg)

    def make_kernels(self, cfg, backend, plan=None, kernel_plan=KernelPlan()):
        return minimax_m2.make_kernels(cfg, backend, plan, kernel_plan)

    def forward(self, cfg, params, caches, x, kernels="xla", aux_layers=()):
        return minimax_m2.forward(cfg, params, caches, x, kernels, aux_layers)

    def compute_logits(self, cfg, params, hidden_SD, kernels=None):
        return minimax_m2.compute_logits(cfg, params, hidden_SD, kernels)


class Qwen3NextFamily(ModelFamily):
    """Qwen3-Next / Qwen3.5: hybrid gated-DeltaNet and gated full attention, MoE with a gated
    shared expert or dense MLPs (models/qwen3_next.py; loaders/qwen3_next.py). Its MTP
    weights load (params["mtp"]) but no forward runs them yet: supports_mtp is False."""
    name = "qwen3_next"
    param_axes = {
        **DENSE_AXES, **_SHARED_EXPERT_AXES, "w_shared_gate": ("embed", "one"),
        # full attention: wq's columns are per head [E query | E gate], so "heads" splits both
        "wq": ("embed", "heads"),
        # gated DeltaNet
        "w_qkv": ("embed", "conv_channels"), "conv_w": ("conv_channels", "conv_width"),
        "w_qkv_grouped": ("embed", "conv_channels"), "conv_w_grouped": ("conv_channels", "conv_width"),
        "w_z": ("embed", "v_heads"), "w_b": ("embed", "v_heads"), "w_a": ("embed", "v_heads"),
        "dt_bias": ("v_heads",), "a_log": ("v_heads",), "gdn_norm": ("head_dim",),
        "w_out": ("v_heads", "embed"),
        # MTP (params["mtp"]): fc, its norms, then full-attention layers as above
        "fc": ("embed", "embed"), "pre_fc_norm_embedding": ("embed",), "pre_fc_norm_hidden": ("embed",),
        "norm": ("embed",),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        return qwen3_next.config_from_hf(hf)

    def param_shapes(self, cfg):
        return qwen3_next.param_shapes(cfg)

    def divisible_dims(self, cfg):
        dims = []
        if qwen3_next.FULL in cfg.layer_types:
            dims += [("num_attention_heads", cfg.num_heads, "heads"),
                     ("num_key_value_heads", cfg.num_kv_heads, "kv_heads")]
        if qwen3_next.LINEAR in cfg.layer_types:
            dims += [("linear_num_value_heads", cfg.linear_num_value_heads, "v_heads"),
                     ("conv channels (2 * linear_num_key_heads * linear_key_head_dim + "
                      "linear_num_value_heads * linear_value_head_dim)", cfg.conv_dim, "conv_channels")]
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
            dims.append(("intermediate_size", cfg.intermediate_size, "mlp"))
        if cfg.num_experts:
            dims += [("moe_intermediate_size", cfg.moe_intermediate_size, "mlp"),
                     ("num_experts", cfg.num_experts, "experts")]
            if cfg.shared_expert_intermediate_size:
                dims.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, "mlp"))
        return dims

    def prepare_weights(self, cfg, params, *, kernel_plan, mesh, backend):
        return fused_and_split(cfg, params, mesh, qwen3_next.fuse_projections)

    def load_hf(self, path, cfg, dtype="float32", mesh=None, quantization=None):
        return qwen3_next_loader.load_hf(self, path, dtype, mesh)   # (reads its own config.json)

    def dummy_params(self, cfg, dtype="float32", mesh=None, seed=0):
        return qwen3_next_loader.dummy_params(self, cfg, dtype, mesh, seed)

    def cache_specs(self, cfg):
        return qwen3_next.cache_specs(cfg)

    def make_kernels(self, cfg, backend, plan=None, kernel_plan=KernelPlan()):
        return qwen3_next.make_kernels(cfg, backend, plan, kernel_plan)

    def forward(self, cfg, params, caches, x, kernels="xla", aux_layers=()):
        return qwen3_next.forward(cfg, params, caches, x, kernels, aux_layers)

    def compute_logits(self, cfg, params, hidden_SD, kernels=None):
        return qwen3_next.compute_logits(cfg, params, hidden_SD, kernels)


_V4_REPLICATED = ("hc_attn_fn", "hc_ffn_fn", "hc_head_fn", "wkv", "wc_kv", "wc_gate", "wi_kv",
                  "wi_gate", "wi_w", "c_ape", "i_ape")


class DeepseekV4Family(ModelFamily):
    """DeepSeek V4: sliding / CSA / HCA attention, mHC, hash-routed and sqrtsoftplus MoE
    (models/deepseek_v4.py; loaders/deepseek_v4.py), its MTP layers (models/deepseek_v4_mtp.py:
    DeepSeek's checkpoint keys mtp.{m}.*, which transformers skips)."""
    name = "deepseek_v4"
    param_axes = {
        **DENSE_AXES, **_SHARED_EXPERT_AXES, "router_bias": ("router",),
        **{n: ("lora", "lora") for n in _V4_REPLICATED},
        "hc_attn_base": ("one",), "hc_attn_scale": ("one",), "hc_ffn_base": ("one",),
        "hc_ffn_scale": ("one",), "hc_head_base": ("one",), "hc_head_scale": ("one",),
        "wq_a": ("embed", "lora"), "q_a_norm": ("lora",), "wq_b": ("lora", "heads"),
        "kv_norm": ("lora",), "c_norm": ("lora",), "i_norm": ("lora",), "wi_q": ("lora", "lora"),
        "wo_a": ("heads", "lora", "lora"), "wo_b": ("heads", "embed"), "sinks": ("heads",),
        "tid2eid": ("one", "one"),
        # MTP (params["mtp"][m]): its decoder layer as above, and
        "enorm": ("embed",), "hnorm": ("embed",), "head_norm": ("embed",),
        "e_proj": ("embed", "embed"), "h_proj": ("embed", "embed"),
    }
    supports_mtp = True
    cache_axes = {name: ("kv_blocks", "block_tokens", "lora")
                  for name in ("kv", "ckv", "cgate", "comp", "ikv", "igate", "icomp")}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        return deepseek_v4.config_from_hf(hf)

    def param_shapes(self, cfg):
        return deepseek_v4.param_shapes(cfg)

    def divisible_dims(self, cfg):
        return [("num_attention_heads", cfg.num_heads, "heads"), ("o_groups", cfg.o_groups, "heads"),
                ("moe_intermediate_size", cfg.moe_intermediate_size, "mlp"),
                ("n_routed_experts", cfg.num_experts, "experts")]

    def load_hf(self, path, cfg, dtype="float32", mesh=None, quantization=None):
        if quantization is not None:
            raise ValueError(f"DeepSeek V4 loads dequantized; quantization {quantization!r} is not built")
        return deepseek_v4_loader.load_hf(self, path, cfg, dtype, mesh)

    def dummy_params(self, cfg, dtype="float32", mesh=None, seed=0):
        return deepseek_v4_loader.dummy_params(self, cfg, dtype, mesh, seed)

    def cache_specs(self, cfg):
        return deepseek_v4.cache_specs(cfg)

    def make_kernels(self, cfg, backend, plan=None, kernel_plan=KernelPlan()):
        return deepseek_v4.make_kernels(cfg, backend, plan, kernel_plan)

    def forward(self, cfg, params, caches, x, kernels="xla", aux_layers=()):
        return deepseek_v4.forward(cfg, params, caches, x, kernels, aux_layers)

    def compute_logits(self, cfg, params, hidden_SD, kernels=None):
        return deepseek_v4.compute_logits(cfg, params, hidden_SD, kernels)

    def mtp_cache_specs(self, cfg):
        return deepseek_v4_mtp.mtp_cache_specs(cfg)

    def mtp_forward(self, cfg, params, caches, x, prev_hidden, *, attention_impl):
        return deepseek_v4_mtp.mtp_forward(cfg, params, caches, x, prev_hidden, attention_impl=attention_impl)

    def mtp_hidden_layers(self, cfg):
        return (cfg.num_layers,)    # the last layer's hc streams, before the hyper head


LLAMA, DEEPSEEK, MINIMAX_M2, QWEN3_NEXT = LlamaFamily(), DeepseekFamily(), MiniMaxM2Family(), Qwen3NextFamily()
DEEPSEEK_V4 = DeepseekV4Family()
