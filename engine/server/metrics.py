"""Prometheus metrics of the server (`GET /metrics`), in a registry of their own.

Counters count sequences (an `n=2` request is two); `deepseek_http_requests_total` counts HTTP requests by
endpoint and status code. With speculative decoding, the drafted and accepted tokens, the acceptance
rate per draft position and the mean accepted length (tokens per verifying step) join them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.spec_decode.stats import SpecDecodeStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.http = Counter(
            "deepseek_http_requests", "HTTP requests", ["endpoint", "status"], registry=self.registry
        )
        self._finished = self._metric(Counter, "requests_finished", "Sequences finished", "finish_reason")
        self.prompt_tokens = self._metric(Counter, "prompt_tokens", "Prompt tokens of sequences added")
        self.generation_tokens = self._metric(Counter, "generation_tokens", "Tokens generated")
        self.ttft = self._metric(Histogram, "time_to_first_token_seconds", "Arrival to first token")
        self.tpot = self._metric(Histogram, "time_per_output_token_seconds", "Mean time per later token")
        self.e2e = self._metric(Histogram, "e2e_request_latency_seconds", "Arrival to finish")
        self.running = self._metric(Gauge, "requests_running", "Sequences being computed")
        self.waiting = self._metric(Gauge, "requests_waiting", "Sequences queued or preempted")
        self._kv_usage = self._metric(Gauge, "kv_cache_usage_ratio", "Share of KV cache blocks held", "group")
        self.preemptions = self._metric(Counter, "preemptions", "Sequences preempted for lack of KV cache")
        self._preempted = 0
        self._drafted = self._metric(Counter, "spec_decode_draft_tokens", "Draft tokens verified")
        self._accepted = self._metric(Counter, "spec_decode_accepted_tokens", "Draft tokens accepted")
        self._acceptance = self._metric(
            Gauge, "spec_decode_acceptance_rate", "Accepted / drafted at each draft position", "position"
        )
        self._mean_length = self._metric(
            Gauge, "spec_decode_mean_accepted_length", "Tokens per verifying step (accepted drafts + 1)"
        )
        self._counted = SpecDecodeStats()

    def _metric(self, kind: type, name: str, doc: str, *labels: str) -> Any:
        extra = {}
        if kind is Histogram:
            extra["buckets"] = _TOKEN_BUCKETS if "per_output" in name else _LATENCY_BUCKETS
        metric = kind(f"deepseek_{name}", doc, ["model_name", *labels], registry=self.registry, **extra)
        return metric if labels else metric.labels(self.model_name)

    @staticmethod
    def count(metric: Any) -> float:
        """The current value of a counter or gauge of this model."""
        return next(s.value for m in metric.collect() for s in m.samples if not s.name.endswith("_created"))

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def observe_engine(self, usage: dict[str, int], num_blocks: int, preemptions: int) -> None:
        for group, blocks in usage.items():
            self._kv_usage.labels(self.model_name, group).set(blocks / num_blocks)
        self.preemptions.inc(preemptions - self._preempted)
        self._preempted = preemptions

    def observe_spec_decode(self, stats: SpecDecodeStats) -> None:
        self._drafted.inc(stats.drafted - self._counted.drafted)
        self._accepted.inc(stats.accepted - self._counted.accepted)
        self._counted = SpecDecodeStats(stats.verify_steps, stats.drafted, stats.accepted)
        for position, rate in enumerate(stats.acceptance_rate):
            self._acceptance.labels(self.model_name, str(position)).set(rate)
        self._mean_length.set(stats.mean_accepted_length)

    def render(self) -> bytes:
        return generate_latest(self.registry)
