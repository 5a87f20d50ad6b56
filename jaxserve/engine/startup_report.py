"""The engine's start-up block: the numbers a vLLM user looks for in its log once the engine
is built (context length, KV cache size, concurrency it allows, speculation), from the
engine's own config and runner, so they are what it will really do."""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.worker.memory_plan import MemoryReport
from jaxserve.lora.weights import slot_bytes


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


def startup_lines(config: EngineConfig, num_blocks: int, block_size: int, bytes_per_block: int,
                  on_cpu: bool, memory: MemoryReport | None = None,
                  window: tuple[int, int] = (0, 0)) -> list[str]:
    """One line each: max_model_len, KV cache (the full group's blocks: what bounds the tokens
    held), a sliding-window group's blocks (`window`: their count and bytes each; kv_cache/
    manager.py), concurrency, the cache budget (on a GPU the memory plan: device total,
    weights, step programs' peak, headroom; memory_plan.py), speculation."""
    max_len = config.scheduler.max_model_len
    # block 0 is the null block (cache_sizing.CachePlan): it holds no request's tokens
    tokens = (num_blocks - 1) * block_size
    cache_bytes = num_blocks * bytes_per_block
    lines = [f"max_model_len: {max_len} tokens (the model's maximum: "
             f"{config.model.max_position_embeddings})",
             f"KV cache: {num_blocks} blocks of {block_size} tokens, {tokens} tokens, "
             f"{_bytes(cache_bytes)} ({cache_bytes} bytes) per device"]
    if window[0]:
        lines.append(f"sliding-window cache: {window[0]} blocks of {block_size} tokens, "
                     f"{_bytes(window[0] * window[1])} per device (the running requests' windows, "
                     "freed as they advance, and a window a sequence kept for prefix hits)")
    lines.append(f"maximum concurrency at max_model_len ({max_len} tokens per request): "
                 f"{tokens / max_len:.2f}x")
    if config.cache.num_kv_blocks:
        lines.append(f"KV cache budget: num_kv_blocks={config.cache.num_kv_blocks} set explicitly")
    elif config.cache.kv_cache_memory_bytes:
        lines.append(f"KV cache budget: kv_cache_memory_bytes={config.cache.kv_cache_memory_bytes} "
                     "per device, set explicitly")
    elif on_cpu:
        # NOTE: the CPU reports no free memory to take a share of (cache_sizing.plan_caches)
        lines.append("KV cache budget: on the CPU --gpu-memory-utilization is not used; the budget is "
                     f"a fixed {_bytes(config.cache.kv_cache_cpu_bytes)} (kv_cache_cpu_bytes; the cache "
                     "takes no more than max_num_seqs requests at max_model_len need)")
    else:
        lines.append(f"KV cache budget: what {config.cache.gpu_memory_utilization:g} of the "
                     "device's total memory leaves after the weights, the step programs' peak and "
                     "the headroom (--gpu-memory-utilization)")
    if memory is not None:
        lines += memory.lines()
    spec = config.speculative
    lines.append("speculative decoding: off" if spec is None else
                 f"speculative decoding: on (method={spec.method}, "
                 f"num_speculative_tokens={spec.num_speculative_tokens})")
    if config.lora is not None:     # (its slots were allocated before the KV budget was read)
        lora = config.lora
        lines.append(f"LoRA: {lora.max_loras} adapter slots of rank {lora.max_lora_rank}, "
                     f"{_bytes(slot_bytes(config.model, lora, config.dtype))} on the device; "
                     f"{lora.cpu_capacity} adapters cached on the host")
    return lines
