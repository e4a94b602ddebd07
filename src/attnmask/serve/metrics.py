"""What ``GET /metrics`` reports, in Prometheus' text format, from a registry of the app's own.

The engine's state (requests running and waiting, cache blocks used and total, tokens computed,
preemptions) is read at scrape time from the loop's latest snapshot (:meth:`EngineLoop.stats`);
latencies are observed by the handlers as tokens reach them: time to first token (from the
request's arrival to the step that produced its first token) and inter-token latency (between two
consecutive tokens of one request).

Each app has its own :class:`~prometheus_client.CollectorRegistry` (never the process-wide one), so
two servers or two tests in one process do not share or collide on metrics.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from attnmask.serve.loop import EngineLoop

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST  # Prometheus' text exposition format, as generate_latest writes it

# Seconds. A step of a tiny model takes ~1 ms, of SmolLM2 on a CPU ~10-100 ms; a long prefill under load, seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector:
    """The engine's snapshot as metric families, read at each scrape."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def collect(self):
        s = self.loop.stats()
        gauges = [
            ("attnmask_requests_running", "Requests being decoded (holding cache blocks)", s.running),
            ("attnmask_requests_waiting", "Requests queued for admission (waiting for cache blocks)", s.waiting),
            ("attnmask_cache_blocks_used", "KV cache blocks in use by requests", s.blocks_used),
            ("attnmask_cache_blocks_total", "KV cache blocks in the pool", s.blocks_total),
            ("attnmask_cache_blocks_cached", "Blocks the prefix cache keeps that no request holds", s.blocks_cached),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("attnmask_prompt_tokens", "Prompt tokens computed (recomputation after preemption included)", s.tokens_in),
            ("attnmask_generation_tokens", "Tokens generated", s.tokens_out),
            ("attnmask_engine_steps", "Engine steps run", s.steps),
            ("attnmask_preemptions", "Requests preempted (blocks freed, recomputed later)", s.preemptions),
            ("attnmask_prefix_cache_tokens", "Prompt tokens found in the prefix cache (not computed)", s.tokens_cached),
            ("attnmask_draft_tokens", "Speculative decoding: draft tokens checked", s.draft_tokens),
            ("attnmask_draft_accepted_tokens", "Speculative decoding: draft tokens the model chose", s.draft_accepted),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The app's registry: the engine collector, latency histograms and request counters."""

    def __init__(self, loop: EngineLoop):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(loop))
        self.ttft = Histogram(
            "attnmask_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "attnmask_inter_token_latency_seconds",
            "Between consecutive tokens of one request",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "attnmask_requests_finished",
            "Requests ended, by finish reason (stop, length, cancelled, error)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "attnmask_requests_rejected",
            "Requests answered with an error status, by status code",
            ["status"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
