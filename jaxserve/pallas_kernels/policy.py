"""Which kernels a model runs: `KernelPlan`, decided once per engine from the model's config,
its family, the device and the engine's options, and carried by the runner and the models
without their reading the rules that made it. The rules (all measured; BENCHMARKS.md):

- fused kernels (FUSABLE): which of them an engine turns on by default for a model
  (auto_fused_kernels), and whether the fused stack can run the model at all (fused_stack_fits);
- by step size: the fused stack takes steps of up to FUSED_STACK_MAX_TOKENS tokens, the MoE
  decode kernels steps of up to MOE_DECODE_MAX_TOKENS;
- per projection of the fused stack: fused_linear's one-row program, its dot program, or XLA
  (`projection`);
- the scheduler's decode steps per launch where the step is bound by launches
  (AUTO_SCHEDULER_STEPS).

How each kernel tiles is not decided here: each kernel's wrapper reads its own tuning table
(ragged_paged_attention/tuning.py, fused_linear.tiling).

Legend: T tokens of a step.
"""

from __future__ import annotations

import dataclasses

from jaxserve.pallas_kernels.dispatch import device_kind
from jaxserve.pallas_kernels import fused_linear

# Fused Pallas kernels an engine may switch on (--fused-kernels): fused add+RMSNorm ("norm")
# and QK-norm+RoPE+KV write ("rope"). Off by default: inside the whole 8B step on the H200 both
# together made decode slower (BENCHMARKS.md, Kernels), since XLA fuses those ops into their
# neighbours, which a custom call prevents. "linear": every projection with its norm, bias, gate
# or residual add fused in (fused_linear.py), the packed q/k/v through one rope + KV-write
# kernel, and the LM head: five kernels a dense layer plus attention, for small models whose
# decode step is bound by kernel launches (issue 33; models/llama.py fused_stack). "moe": the
# routed experts of steps of a few tokens in two kernels (moe_decode.py, every MoE family).
# "mla": DeepSeek V3 / V3.2's attention around its projections in three kernels (mla_input_prep,
# mla_q_absorb, mla_merge_uv; models/deepseek_mla.py), one device; off until the whole step
# measures faster (issue 71: .scratch/fuse32_gpu.sh).
FUSABLE = ("norm", "rope", "linear", "moe", "mla")

# auto_fused_kernels turns "linear" on up to this model width (measured on the H200:
# BENCHMARKS.md, "The default model's step"); wider models' steps are bound by their weights'
# bytes, where XLA's own GEMMs run at 90 % of HBM.
AUTO_LINEAR_MAX_HIDDEN = 1024

# Steps of more tokens than this (prefill chunks, large decode batches) keep XLA's GEMMs, which
# reuse each weight tile over many rows better than fused_linear's small-batch tiling (H200,
# default model: slower at 64 tokens a step; BENCHMARKS.md). The LM head stays fused: its rows
# are the step's sequences, few at decode.
FUSED_STACK_MAX_TOKENS = 32

# "moe": steps of at most this many tokens run the routed experts through moe_decode.py (two
# kernels, no sort or gathers); each (token, expert) row reads its expert's weights, so past a
# few tokens the grouped path, which reads each distinct expert once, reads fewer bytes.
MOE_DECODE_MAX_TOKENS = 4

# "mla": steps of at most this many tokens take the fused MLA kernels; past it their 16-row
# token tiles re-read W_UK / W_UV per tile where XLA's batched matmuls tile for the tensor
# cores, and the attention's partials (f32) would double its output's bytes.
MLA_FUSED_MAX_TOKENS = 32

# Multi-step decode where it was measured to pay: a model the fused stack covers (small dense
# ones and the llama family's MoE, one GPU) is bound by the host's launch of each step at
# small batch (BENCHMARKS.md, issue 33, H100: the default model 2.3 -> 0.58 ms/token at 8
# steps; an 8-layer Qwen3-30B-A3B cut 1.4-1.8 -> 0.73, batch 16 the same either way);
# elsewhere the device bounds a step, and more steps a launch would only delay new requests.
AUTO_SCHEDULER_STEPS = 8

# Families whose own decode stacks (not the fused stack) take AUTO_SCHEDULER_STEPS by default
# on one GPU: DeepSeek V3 / V3.2 (MLA; the indexer's keys), MiniMax-M2 and Qwen3-Next / Qwen3.5
# (the recurrent state advances once a step inside the loop). Their multi-step programs give
# one step at a time's tokens (tests/test_multi_step_families.py). On one GPU their models
# are small ones or reduced-depth ones (the frontier checkpoints take a mesh, where the
# default stays 1), whose small-batch steps the host's launch bounds, as the llama MoE's
# (8 layers of Qwen3-30B-A3B at batch 1: 1.9 ms/token one step a launch, 0.73 at 8;
# BENCHMARKS.md); each family's own A/B is issue 71's to measure.
AUTO_MULTI_STEP_FAMILIES = ("deepseek", "minimax_m2", "qwen3_next")


def fused_kernel_names(option: str | tuple | list) -> tuple[str, ...] | None:
    """The names an option gives ("linear,rope" or a sequence; "none": no names), None for
    "auto"; a ValueError names the allowed values."""
    if isinstance(option, str):
        if option == "auto":
            return None
        option = () if option in ("none", "") else tuple(n.strip() for n in option.split(","))
    names = tuple(option)
    bad = sorted(set(names) - set(FUSABLE))
    if bad:
        raise ValueError(f"fused_kernels must be 'auto', 'none' or names from "
                         f"{', '.join(FUSABLE)}; got {', '.join(bad)}")
    return names


def fused_stack_fits(cfg, family: str) -> bool:
    """Whether the fused stack (models/llama.py fused_stack) can run this model (a ModelConfig
    of the family named `family`): shapes the kernels tile (a power-of-two head dim >= 32 for
    the rope kernel, widths in multiples of 16: the MLP's, or an MoE layer's expert count (the
    router's output) and expert width). Other families' MoE layers (DeepSeek, MiniMax,
    Qwen3.5) have stacks of their own."""
    if cfg.is_moe and family != "llama":
        return False
    e = cfg.head_dim
    mlp = ((cfg.num_experts, cfg.moe_intermediate_size) if cfg.is_moe
           else (cfg.intermediate_size,))
    return (e >= 32 and e & (e - 1) == 0 and cfg.hidden_size % 16 == 0
            and all(w % 16 == 0 for w in mlp) and cfg.vocab_size % 16 == 0)


def auto_fused_kernels(cfg, family: str) -> tuple[str, ...]:
    """The fused kernels an engine on one GPU uses by default for this model: "moe" for any
    family with routed experts (moe_decode: 32.6 against 41.3 us for one token's experts at
    Qwen3-30B-A3B's shapes, 246 against 337 at DeepSeek-V3's; H100, BENCHMARKS.md), with
    "linear" too where the fused stack takes the llama family's MoE layers (a Qwen3-30B-A3B
    layer at batch 1: 68 against 82 us, 10 kernels against 20; at 4 tokens 157 against 151,
    at 16 318 against 326; H100), and "linear" for narrow dense llama-family models (the fused
    stack's projections)."""
    stack = family == "llama" and fused_stack_fits(cfg, family)
    if cfg.is_moe:
        return ("linear", "moe") if stack else ("moe",)
    return ("linear",) if stack and cfg.hidden_size <= AUTO_LINEAR_MAX_HIDDEN else ()


def mla_fused_takes(num_tokens: int) -> bool:
    """Whether a step of this many tokens runs DeepSeek's fused MLA kernels (when "mla" is on)."""
    return num_tokens <= MLA_FUSED_MAX_TOKENS


def moe_decode_takes(num_tokens: int) -> bool:
    """Whether a step of this many tokens may run its routed experts through moe_decode (when
    "moe" is on and the weights suit the kernel)."""
    return num_tokens <= MOE_DECODE_MAX_TOKENS


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The kernels an engine runs a model with; one value for the engine's life (part of
    EngineConfig). The default: no fused kernel."""
    fused: tuple[str, ...] = ()   # the fused kernels switched on (FUSABLE names, as given)
    fused_stack: bool = False     # "linear" is on and fused_stack_fits the model
    device: str = "cpu"           # the device kind the plan was made for (dispatch.device_kind)
    lora: bool = False            # the layers carry LoRA slots (lora_sgmv.py on each projection)
    multi_step: bool = False      # AUTO_SCHEDULER_STEPS by default without the fused stack
                                  # (AUTO_MULTI_STEP_FAMILIES on one GPU)

    @property
    def cheap_branches(self) -> bool:
        """Whether a data-dependent `lax.cond` inside a step costs nothing: on the CPU. On a
        GPU its predicate is read back by the host mid-step, stalling the stream."""
        return self.device == "cpu"

    @classmethod
    def for_model(cls, cfg, family: str, fused: tuple | list | frozenset | set = (),
                  device: str | None = None) -> KernelPlan:
        """The plan of these fused kernels for a model (a ModelConfig of the family named
        `family`) on `device` (default: this process's first device)."""
        names = tuple(fused)
        if not set(names) <= set(FUSABLE):
            raise ValueError(f"fused_kernels must name some of {', '.join(FUSABLE)}; got "
                             f"{sorted(names)}")
        return cls(names, "linear" in names and fused_stack_fits(cfg, family),
                   device or device_kind())

    @classmethod
    def resolve(cls, option: str | tuple | list, cfg, family: str, num_devices: int,
                device: str | None = None) -> KernelPlan:
        """The plan of an engine's --fused-kernels option: "auto" is auto_fused_kernels on one
        GPU (nothing on a CPU or a mesh), else the names given ("linear" only on one device:
        its kernels and [out, in] weights are unsharded; a mesh keeps the unfused weights).
        One GPU also decodes an AUTO_MULTI_STEP_FAMILIES model in steps by default."""
        device = device or device_kind()
        names = fused_kernel_names(option)
        if names is None:
            names = () if device == "cpu" or num_devices != 1 else auto_fused_kernels(cfg, family)
        else:
            for name in ("linear", "mla"):    # unsharded kernels and fused weights
                if name in names and num_devices != 1:
                    raise ValueError(f"fused_kernels '{name}' runs on one device; got {num_devices} "
                                     f"(tensor x expert parallel): leave it out or use 'auto'")
        plan = cls.for_model(cfg, family, names, device)
        return dataclasses.replace(plan, multi_step=device != "cpu" and num_devices == 1
                                   and family in AUTO_MULTI_STEP_FAMILIES)

    def without(self, *names: str) -> KernelPlan:
        """This plan less some fused kernels (a family whose own blocks replace them)."""
        kept = tuple(n for n in self.fused if n not in names)
        return dataclasses.replace(self, fused=kept, fused_stack=self.fused_stack and "linear" in kept)

    def with_lora(self) -> KernelPlan:
        """This plan for an engine serving LoRA adapters: the projections take each token's
        adapter update (lora_sgmv.py), which the fused stack's kernels have no place for, so
        "linear" is off."""
        return dataclasses.replace(self.without("linear"), lora=True)

    def stack_takes(self, num_tokens: int) -> bool:
        """Whether a step of this many tokens runs through the fused stack."""
        return self.fused_stack and num_tokens <= FUSED_STACK_MAX_TOKENS

    @staticmethod
    def projection(rows: int, weight_elements: int) -> str:
        """How the fused stack runs one projection of `rows` rows by an [out, in] weight:
        "one_row" (fused_linear's one-row program: one row, up to 16M elements), "dot" (its
        dot program: weights of up to a few million elements), else "xla" (the same ops in
        XLA: the dot program read Qwen3-30B-A3B's q|k|v and o at a third of the one-row
        program's speed, H100, BENCHMARKS.md)."""
        # NOTE: through the module, so that a benchmark's patch of one_row reaches it
        # (benchmarks/multi_step_ab.py --no-one-row)
        if fused_linear.one_row(rows, weight_elements, "NK"):
            return "one_row"
        return "dot" if weight_elements <= fused_linear.SMALL_WEIGHT_ELEMENTS else "xla"

    def scheduler_steps(self, value: int | None, speculative) -> int:
        """SchedulerConfig.num_scheduler_steps from the option: None is AUTO_SCHEDULER_STEPS
        with the fused stack ("linear") or a multi-step family's plan, and no speculation (a
        verifying step is one step), else 1."""
        if value is not None:
            return value
        auto = "linear" in self.fused or self.multi_step
        return AUTO_SCHEDULER_STEPS if auto and speculative is None else 1
