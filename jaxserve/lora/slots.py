"""Which adapter sits in which device slot (the scheduler's bookkeeping; data only).

The device holds max_loras adapter slots, 1..max_loras (slot 0 is "no adapter": zeros). A
running request holds a reference on its adapter's slot from admission until it finishes,
is aborted or is preempted, so the adapters of one step are at most max_loras. A slot
without references keeps its adapter (a later request finds it there, no copy) until a new
adapter needs a slot: then the least recently released one is evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}        # adapter int id -> its slot
        self.refs: dict[int, int] = {}           # adapter int id -> running requests on it
        self._idle: OrderedDict[int, None] = OrderedDict()   # resident, unreferenced: LRU first
        self._free = list(range(max_loras, 0, -1))
        self.num_loads = 0                       # slot writes asked for (metrics, tests)
        self.held: dict[str, int] = {}           # running request -> the adapter it references
        self._loads: list[tuple[int, int]] = []  # (slot, int id) to write before the next step

    # -- per request (the scheduler's calls) ---------------------------------------------------
    def take(self, request_id: str, lora: LoRARequest | None) -> None:
        """A starting request's reference (None: it runs the base model, nothing to take); a
        slot its adapter must be written into first (it was not resident) joins the next
        step's loads (take_loads)."""
        if lora is None:
            return
        int_id = lora.lora_int_id
        slot, write = self.acquire(int_id)
        self.held[request_id] = int_id
        if write:
            self._loads.append((slot, int_id))

    def take_loads(self) -> list[tuple[int, int]]:
        """The slot writes (slot, adapter int id) the step being scheduled needs first."""
        loads, self._loads = self._loads, []
        return loads

    def drop(self, request_id: str) -> None:
        """The request left the running set (finished, aborted, preempted): its reference goes."""
        int_id = self.held.pop(request_id, None)
        if int_id is not None:
            self.release(int_id)

    def slot_for(self, request_id: str) -> int:
        """The slot of a running request's adapter (0: it runs the base model)."""
        int_id = self.held.get(request_id)
        return 0 if int_id is None else self.slot_of[int_id]

    def can_acquire(self, int_id: int) -> bool:
        """Whether a request on this adapter could start now."""
        return int_id in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, int_id: int) -> tuple[int, bool]:
        """A reference on the adapter's slot: (slot, whether the slot must be written first).
        Raises RuntimeError when every slot is referenced (check can_acquire)."""
        if int_id in self.slot_of:
            self._idle.pop(int_id, None)
            self.refs[int_id] += 1
            return self.slot_of[int_id], False
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self.slot_of.pop(evicted)
            del self.refs[evicted]
        else:
            raise RuntimeError(f"all {self.max_loras} LoRA slots are in use (max_loras)")
        self.slot_of[int_id] = slot
        self.refs[int_id] = 1
        self.num_loads += 1
        return slot, True

    def release(self, int_id: int) -> None:
        """A request on the adapter left the running set (finished, aborted, preempted)."""
        self.refs[int_id] -= 1
        if self.refs[int_id] == 0:
            self._idle[int_id] = None

    def forget(self, int_id: int) -> None:
        """The adapter was unloaded: its slot, once unreferenced, is free at once."""
        if int_id in self.slot_of and self.refs.get(int_id) == 0:
            self._idle.pop(int_id, None)
            self._free.append(self.slot_of.pop(int_id))
            del self.refs[int_id]

    @property
    def num_referenced(self) -> int:
        return sum(1 for n in self.refs.values() if n)
