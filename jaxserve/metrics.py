"""Engine metrics as Prometheus collectors (the server's /metrics) and as a plain dict
(`LLM.get_metrics()`), under the same names without the `jaxserve:` prefix. /metrics also
shows them under vLLM's names (`prometheus_text`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_used_blocks",
          "num_free_blocks")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
            "generation_tokens", "request_success", "request_failure", "request_abort",
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            # hybrid models: rejected drafts whose recurrent state was restored (scheduler.py)
            "num_state_rollbacks")
# Counters with one label; in as_dict as name_total{label="value"}.
LABELED_COUNTERS = {"spec_decode_num_accepted_tokens_per_pos": "position"}
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds")

# Ours -> vLLM's names for the same count (docs.vllm.ai, "Production Metrics"; counters without
# `_total`, which the exposition appends). NOTE: both are exported: a vLLM user's dashboards and
# alerts read the vllm: ones unchanged, while the jaxserve: ones stay for the scrapes and
# LLM.get_metrics() keys already built on them, and for the counts vLLM has no name for
# (request_failure / request_abort, num_state_rollbacks, the block counts).
VLLM_NAMES = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; older dashboards read the first
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_success": ("vllm:request_success",),
    "num_preemptions": ("vllm:num_preemptions",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
}


class VllmNames:
    """A Prometheus collector: the families of `registry` named in VLLM_NAMES under vLLM's
    names, each sample with vLLM's `model_name` label (the first served model name)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry = registry
        self.model_name = model_name

    def collect(self):
        for family in self.registry.collect():
            for name in VLLM_NAMES.get(family.name.removeprefix("jaxserve:"), ()):
                twin = Metric(name, family.documentation, family.type)
                for s in family.samples:   # `jaxserve:x_total` -> `vllm:y_total`, `_bucket`, ...
                    twin.add_sample(name + s.name[len(family.name):],
                                    {"model_name": self.model_name, **s.labels}, s.value, s.timestamp)
                yield twin


def prometheus_text(registry: CollectorRegistry, model_name: str) -> bytes:
    """/metrics: our metrics, then the same under vLLM's names (VllmNames)."""
    return generate_latest(registry) + generate_latest(VllmNames(registry, model_name))


class EngineMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.gauges = {n: Gauge(f"jaxserve:{n}", n.replace("_", " "), registry=self.registry)
                       for n in GAUGES}
        # prometheus_client appends `_total` to counter names itself.
        self.counters = {n: Counter(f"jaxserve:{n}", n.replace("_", " "), registry=self.registry)
                         for n in COUNTERS}
        self.labeled = {n: Counter(f"jaxserve:{n}", n.replace("_", " "), labelnames=(label,),
                                   registry=self.registry) for n, label in LABELED_COUNTERS.items()}
        self.histograms = {n: Histogram(f"jaxserve:{n}", n.replace("_", " "), registry=self.registry,
                                        buckets=_LATENCY_BUCKETS) for n in HISTOGRAMS}

    def set(self, name: str, value: float) -> None:
        self.gauges[name].set(value)

    def inc(self, name: str, amount: float = 1) -> None:
        if amount:
            self.counters[name].inc(amount)

    def inc_labeled(self, name: str, label_value, amount: float = 1) -> None:
        if amount:
            self.labeled[name].labels(str(label_value)).inc(amount)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def as_dict(self) -> dict[str, float]:
        out = {n: g._value.get() for n, g in self.gauges.items()}
        out.update({f"{n}_total": c._value.get() for n, c in self.counters.items()})
        for n, c in self.labeled.items():
            for sample in c.collect()[0].samples:
                if sample.name.endswith("_total"):
                    (label, value), = sample.labels.items()
                    out[f'{n}_total{{{label}="{value}"}}'] = sample.value
        for n, h in self.histograms.items():
            samples = {s.name: s.value for s in h.collect()[0].samples}
            out[f"{n}_count"] = samples.get(f"jaxserve:{n}_count", 0.0)
            out[f"{n}_sum"] = samples.get(f"jaxserve:{n}_sum", 0.0)
        return out
