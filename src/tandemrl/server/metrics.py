"""The rollout server's Prometheus metrics (`/metrics`, text format with HELP and TYPE, by prometheus_client).

Histograms are observed as requests finish and weight updates land; everything else (queue depth,
KV-cache usage, preemptions, policy version, tokens/s) is read from the live service at scrape time, so
a scrape always shows the present. One registry per server: several servers in one process never mix.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TOKENS_PER_S_WINDOW_S = 10.0  # tokens/s is over the completions that finished this recently
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class LiveService(Protocol):
    """What a scrape reads off the service (server/service.py's RolloutService), named here so this module
    needs no import of the service that owns it."""

    counters: Any  # requests, weight_syncs, prompt_tokens, generated_tokens, last_sync_s
    gate: Any  # num_running, num_queued
    generator: Any  # version, and stats() when it has them
    update_in_progress: bool
    asleep: bool

    @property
    def num_async_results_held(self) -> int: ...


class ServerMetrics:
    """Request latency, time to first token and weight-sync histograms, plus the service's live state."""

    def __init__(self, service: LiveService):
        disable_created_metrics()  # no `*_created` timestamp series beside each histogram (process-wide, as vLLM does)
        self.registry = CollectorRegistry()
        self.request_latency = Histogram(
            "tandem_request_latency_seconds", "Seconds from a request's admission (queueing included) to its last token.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "tandem_time_to_first_token_seconds", "Seconds from admission to the first sampled token, of streamed requests.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.weight_sync = Histogram(
            "tandem_weight_sync_seconds", "Seconds of a weight update, from the first byte received to the new version live.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (finished at, tokens sampled)
        self.registry.register(_LiveState(service, self))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds, open fds

    def finished(self, num_tokens: int) -> None:
        self._recent.append((time.monotonic(), num_tokens))

    def tokens_per_s(self) -> float:
        horizon = time.monotonic() - TOKENS_PER_S_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / TOKENS_PER_S_WINDOW_S

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _LiveState:
    """A collector that reads counters and gauges off the service when scraped."""

    def __init__(self, service: LiveService, metrics: ServerMetrics):
        self.service, self.metrics = service, metrics

    def collect(self) -> Iterator[Metric]:
        s, c = self.service, self.service.counters
        requests = CounterMetricFamily("tandem_requests", "Requests finished, by finish reason.", labels=["finish_reason"])
        for reason, count in c.requests.items():
            requests.add_metric([reason], count)
        syncs = CounterMetricFamily("tandem_weight_syncs", "Weight updates, by result.", labels=["result"])
        for result, count in c.weight_syncs.items():
            syncs.add_metric([result], count)
        yield from (requests, syncs)
        yield CounterMetricFamily("tandem_prompt_tokens", "Prompt tokens of finished requests.", value=c.prompt_tokens)
        yield CounterMetricFamily("tandem_generated_tokens", "Tokens sampled by finished requests.", value=c.generated_tokens)
        gauges = {
            "tandem_generated_tokens_per_second": ("Tokens sampled per second over the last 10 s.", self.metrics.tokens_per_s()),
            "tandem_requests_running": ("Requests admitted and generating.", s.gate.num_running),
            "tandem_requests_queued": ("Requests waiting for admission (queue depth).", s.gate.num_queued),
            "tandem_async_results_held": ("Results of async requests not collected yet.", s.num_async_results_held),
            "tandem_policy_version": ("Version of the weights generating now.", s.generator.version),
            "tandem_update_in_progress": ("1 while a weight update is being received or applied.", int(s.update_in_progress)),
            "tandem_asleep": ("1 while the generator sleeps (KV cache, and at level 2 weights, freed).", int(s.asleep)),
            "tandem_weight_sync_last_seconds": ("Seconds of the last successful weight update.", c.last_sync_s),
        }
        stats = s.generator.stats() if hasattr(s.generator, "stats") else {}
        if stats.get("engine/kv_blocks_total"):
            usage = stats["engine/kv_blocks_used"] / stats["engine/kv_blocks_total"]
            gauges["tandem_kv_cache_usage_ratio"] = ("Fraction of the engine's KV-cache blocks in use.", usage)
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        if "engine/num_preemptions" in stats:
            yield CounterMetricFamily("tandem_preemptions", "Sequences the engine preempted for lack of KV cache.", value=stats["engine/num_preemptions"])
