"""The adapters an engine knows (registered by name) and a CPU cache of loaded ones.

`register` validates the directory's adapter_config.json at once (a bad path or an
unsupported option fails the caller, not a later step); the weights are read when a slot
first needs them and kept in an LRU of max_cpu_loras adapters, so an adapter evicted from
its device slot comes back without reading the disk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.lora.adapter import LoRAAdapter, load_adapter, read_config
from jaxserve.lora.request import LoRARequest


class AdapterStore:
    def __init__(self, cfg: ModelConfig, config: LoRAConfig):
        self.cfg = cfg
        self.config = config
        self._by_id: dict[int, LoRARequest] = {}
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()    # the server registers from its thread, the engine reads
        self.num_disk_loads = 0

    def register(self, req: LoRARequest) -> None:
        """Know this adapter (its config checked now; the weights are read on first use and
        checked then). The same int id with another path is refused."""
        known = self._by_id.get(req.lora_int_id)
        if known is not None and known.lora_path != req.lora_path:
            raise ValueError(f"lora_int_id {req.lora_int_id} is already {known.lora_name!r} at "
                             f"{known.lora_path}; give this adapter another id")
        read_config(req.lora_path)
        with self._lock:
            self._by_id[req.lora_int_id] = req

    def unregister(self, int_id: int) -> None:
        """Drop the adapter's host arrays. Its path stays known: requests already running on
        it may need its slot written again (after a preemption); new ones no longer name it
        (the server forgets the name)."""
        with self._lock:
            self._cache.pop(int_id, None)

    def get(self, int_id: int) -> LoRAAdapter:
        """The adapter's host arrays: from the CPU cache, else read from its path."""
        with self._lock:
            if int_id in self._cache:
                self._cache.move_to_end(int_id)
                return self._cache[int_id]
            req = self._by_id[int_id]
        adapter = load_adapter(req.lora_name, int_id, req.lora_path, self.cfg, self.config.max_lora_rank)
        with self._lock:
            self.num_disk_loads += 1
            self._cache[int_id] = adapter
            while len(self._cache) > self.config.cpu_capacity:
                self._cache.popitem(last=False)
        return adapter

    def check(self, req: LoRARequest) -> None:
        """Load (and so validate) a request's adapter before the engine takes the request."""
        self.register(req)
        self.get(req.lora_int_id)
