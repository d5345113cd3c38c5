"""Prometheus metrics of the server (`GET /metrics`), in a registry of their own, under vLLM's names,
types and labels (`vllm:` prefix, labels `model_name` and `engine`), so existing vLLM dashboards work.
The project's own extras carry the `deepseek:` prefix.

Requests count sequences (an `n=2` request is two), as vLLM's do. The prefix-cache counters count
prompt tokens looked up and found each time a sequence is admitted (again, after a preemption); the
speculative-decoding series exist only when speculating.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.spec_decode.stats import SpecDecodeStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
_PARAM_N_BUCKETS = (1, 2, 4, 8, 16)


def _token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context, as vLLM's token-count histograms."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 4096, speculating: bool = False):
        self.registry = CollectorRegistry()
        self.model_name, self._labels = model_name, (model_name, "0")
        tokens = _token_buckets(max_model_len)
        self.running = self._vllm(Gauge, "num_requests_running", "Sequences being computed")
        self.waiting = self._vllm(Gauge, "num_requests_waiting", "Sequences admitted, not yet computed")
        self.kv_usage = self._vllm(Gauge, "kv_cache_usage_perc", "Share of KV cache blocks held (1 = full)")
        self.preemptions = self._vllm(Counter, "num_preemptions", "Sequences preempted for lack of KV cache")
        self.prompt_tokens = self._vllm(Counter, "prompt_tokens", "Prompt tokens of sequences added")
        self.generation_tokens = self._vllm(Counter, "generation_tokens", "Tokens generated")
        self._success = self._vllm(
            Counter, "request_success", "Sequences finished", labels=("finished_reason",)
        )
        self.prefix_cache_queries = self._vllm(Counter, "prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_cache_hits = self._vllm(Counter, "prefix_cache_hits", "Prompt tokens found cached")
        self.request_prompt_tokens = self._vllm(Histogram, "request_prompt_tokens", "Prompt tokens", tokens)
        self.request_generation_tokens = self._vllm(
            Histogram, "request_generation_tokens", "Generated tokens", tokens
        )
        self.params_n = self._vllm(Histogram, "request_params_n", "n of each request", _PARAM_N_BUCKETS)
        self.params_max_tokens = self._vllm(Histogram, "request_params_max_tokens", "max_tokens", tokens)
        self.iteration_tokens = self._vllm(
            Histogram, "iteration_tokens_total", "Tokens per engine step", tokens
        )
        self.ttft = self._vllm(Histogram, "time_to_first_token_seconds", "Arrival to first token")
        self.itl = self._vllm(Histogram, "inter_token_latency_seconds", "Between tokens", _ITL_BUCKETS)
        self.tpot = self._vllm(
            Histogram,
            "request_time_per_output_token_seconds",
            "Mean time per later token",
            _ITL_BUCKETS,
        )
        self.e2e = self._vllm(Histogram, "e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = self._vllm(Histogram, "request_queue_time_seconds", "Arrival to first scheduled")
        self.inference_time = self._vllm(Histogram, "request_inference_time_seconds", "Scheduled to finish")
        self.prefill_time = self._vllm(Histogram, "request_prefill_time_seconds", "Scheduled to first token")
        self.decode_time = self._vllm(Histogram, "request_decode_time_seconds", "First token to finish")
        self.cache_config = self._vllm(Gauge, "cache_config_info", "KV cache configuration",
                                       labels=("block_size", "cache_dtype", "enable_prefix_caching",
                                               "num_gpu_blocks"))  # fmt: skip
        self.http = Counter("deepseek:http_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=self.registry)  # fmt: skip
        self._spec: dict[str, Any] = {}
        if speculating:
            self._spec = {
                "drafts": self._vllm(Counter, "spec_decode_num_drafts", "Verifying steps"),
                "drafted": self._vllm(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified"),
                "accepted": self._vllm(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted"),
                "per_position": self._vllm(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted per draft position", labels=("position",)),
            }  # fmt: skip
        self._counted = SpecDecodeStats()
        self._preempted = 0
        self._prefix_counted = (0, 0)

    def _vllm(
        self, kind: type, name: str, doc: str, buckets: tuple | None = None, labels: tuple[str, ...] = ()
    ) -> Any:
        """A vLLM metric of this model: the series itself, or with further `labels` the family, whose
        children are taken with ``labels(*self._labels, ...)``."""
        extra = {} if kind is not Histogram else {"buckets": buckets or _LATENCY_BUCKETS}
        metric = kind(f"vllm:{name}", doc, ["model_name", "engine", *labels], registry=self.registry, **extra)
        return metric if labels else metric.labels(*self._labels)

    @staticmethod
    def count(metric: Any) -> float:
        """The current value of a counter or gauge of this model."""
        return next(s.value for m in metric.collect() for s in m.samples if not s.name.endswith("_created"))

    def describe_cache(self, block_size: int, num_blocks: int, prefix_caching: bool = False) -> None:
        labels = (str(block_size), "auto", str(prefix_caching), str(num_blocks))
        self.cache_config.labels(*self._labels, *labels).set(1)

    def finished(self, reason: str) -> None:
        self._success.labels(*self._labels, reason).inc()

    def observe_engine(self, preemptions: int, prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        """The engine's running totals: each series grows by what is new since the last call."""
        self.preemptions.inc(preemptions - self._preempted)
        self._preempted = preemptions
        queried, hit = self._prefix_counted
        self.prefix_cache_queries.inc(prefix_queries - queried)
        self.prefix_cache_hits.inc(prefix_hits - hit)
        self._prefix_counted = (prefix_queries, prefix_hits)

    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache over those looked up, since the start (0 before any)."""
        queries = self.count(self.prefix_cache_queries)
        return self.count(self.prefix_cache_hits) / queries if queries else 0.0

    def observe_spec_decode(self, stats: SpecDecodeStats) -> None:
        if not self._spec:
            return
        self._spec["drafts"].inc(stats.verify_steps - self._counted.verify_steps)
        self._spec["drafted"].inc(stats.drafted - self._counted.drafted)
        self._spec["accepted"].inc(stats.accepted - self._counted.accepted)
        before = self._counted.accepted_at
        for position, count in enumerate(stats.accepted_at):
            self._spec["per_position"].labels(*self._labels, str(position)).inc(
                count - (before[position] if position < len(before) else 0)
            )
        self._counted = replace(stats, drafted_at=list(stats.drafted_at), accepted_at=list(stats.accepted_at))

    def render(self) -> bytes:
        return generate_latest(self.registry)
