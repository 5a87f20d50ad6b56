"""LoRARequest: the adapter a request runs with (vLLM's class: name, int id, path)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter to apply: `lora_name` (what the server lists and a request's `model` picks),
    `lora_int_id` (> 0, unique per adapter: the engine's key for its slot, caches and prefix
    blocks), `lora_path` (a PEFT directory: adapter_config.json + adapter_model.safetensors).
    Positional arguments follow vLLM's order: LoRARequest(name, int_id, path)."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None    # vLLM's JSON --lora-modules field (the parent listed)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1; got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_salt(self) -> str:
        """What keys its prefix-cache blocks besides the tokens (kv_cache/prefix_cache.py)."""
        return f"lora:{self.lora_int_id}:{self.lora_path}"

    # the short names (jaxserve's docs use them)
    name = property(lambda self: self.lora_name)
    int_id = property(lambda self: self.lora_int_id)
    path = property(lambda self: self.lora_path)
