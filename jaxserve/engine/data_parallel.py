"""Data parallelism (vLLM's --data-parallel-size): N whole engines behind one LLM / one server.

The devices are split into N groups of tensor_parallel_size * expert_parallel_size; each group
runs its own LLMEngine (weights, KV cache, scheduler), built by engine/builder.py. `DataParallelEngine` has LLMEngine's
interface, so AsyncEngine and LLM wrap it unchanged: it is the narrowest point, below which
nothing knows there are several replicas. A request goes to the replica with the fewest
unfinished requests (ties: round robin) and stays there; an abort goes where its request is.

One thread steps the replicas in turn. Each replica's core dispatches its next step before
waiting for the current one, so while the thread waits on replica A's tokens, B's step is
already running on B's devices: the devices overlap without a thread per replica.

Metrics: counters, histograms and gauges are summed over the replicas (get_metrics and the
server's /metrics), but for get_metrics' kv_cache_usage_perc, the replicas' mean (/metrics
still sums that gauge).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from jaxserve.outputs import RequestOutput


class _SummedCollector:
    """Every replica's samples, summed by name and labels (one Prometheus family each)."""

    def __init__(self, registries):
        self.registries = registries

    def collect(self):
        families = {}
        for registry in self.registries:
            for family in registry.collect():
                mine = families.get(family.name)
                if mine is None:
                    families[family.name] = family
                    family.samples = list(family.samples)
                    continue
                index = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(mine.samples)}
                for s in family.samples:
                    i = index.get((s.name, tuple(sorted(s.labels.items()))))
                    if i is None:
                        mine.samples.append(s)
                    else:
                        mine.samples[i] = mine.samples[i]._replace(value=mine.samples[i].value + s.value)
        return list(families.values())


class SummedMetrics:
    """What the server reads of an engine's metrics (`registry`), over all replicas."""

    def __init__(self, replicas):
        self.registry = CollectorRegistry()
        self.registry.register(_SummedCollector([r.metrics.registry for r in replicas]))


class _Cores:
    """What AsyncEngine asks of `engine.core` (drain at stop), for every replica's core."""

    def __init__(self, replicas):
        self.replicas = replicas

    def drain(self) -> None:
        for r in self.replicas:
            r.core.drain()


class DataParallelEngine:
    def __init__(self, replicas: list):
        """replicas: LLMEngines built alike (engine/builder.py from_engine_args)."""
        self.replicas = replicas
        self.core = _Cores(replicas)
        self.metrics = SummedMetrics(replicas)
        self._owner: dict[str, int] = {}     # request id -> replica index
        self._next = 0                        # round robin among the least loaded

    # -- what the wrappers read: the replicas are built alike, the first speaks for all --------
    def __getattr__(self, name):
        if name in ("config", "tokenizer", "model_name", "grammars", "runner", "startup_seconds"):
            return getattr(self.replicas[0], name)
        raise AttributeError(name)

    @property
    def num_steps(self) -> int:
        return sum(r.num_steps for r in self.replicas)

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        for r in self.replicas:
            r.wait_for_warmup(raise_errors)

    # -- requests -------------------------------------------------------------------------
    def load(self, i: int) -> int:
        """Unfinished requests of replica i."""
        return len(self.replicas[i].outputs.groups)

    def _route(self) -> int:
        n = len(self.replicas)
        order = [(self._next + k) % n for k in range(n)]
        least = min(order, key=self.load)      # min keeps the first of equals: round robin
        self._next = (least + 1) % n
        return least

    def validate_request(self, prompt_token_ids, params) -> None:
        self.replicas[0].validate_request(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids, params, prompt=None,
                    arrival_time=None, lora_request=None) -> None:
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        i = self._route()
        # (LoRA with data parallelism is refused at build: lora_request is None here)
        self.replicas[i].add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                     arrival_time=arrival_time, lora_request=lora_request)
        self._owner[request_id] = i

    def abort_request(self, request_id: str) -> bool:
        i = self._owner.pop(request_id, None)
        return i is not None and self.replicas[i].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work."""
        outputs = []
        for r in self.replicas:
            if r.has_unfinished_requests():
                outputs += r.step()
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def get_metrics(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for r in self.replicas:
            for name, value in r.get_metrics().items():
                total[name] = total.get(name, 0.0) + value
        total["kv_cache_usage_perc"] /= len(self.replicas)    # a share: the mean, not the sum
        return total
