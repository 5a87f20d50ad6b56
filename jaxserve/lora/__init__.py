"""Multi-LoRA: PEFT adapters served beside the base model in one batch.

request.py  LoRARequest (vLLM's: name, int id, path), what a request names its adapter with
adapter.py  a PEFT adapter directory -> host arrays laid out on the engine's fused projections
slots.py    which adapter sits in which device slot: references, LRU (the scheduler's)
store.py    the registered adapters and a CPU cache of loaded ones (max_cpu_loras)
weights.py  the device slot arrays (max_loras + 1 per projection and layer) and their writes
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
