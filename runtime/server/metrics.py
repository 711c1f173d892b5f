"""``GET /metrics``: the server's and the runtime's figures in the Prometheus text format.

Through prometheus-client, in a registry of the server's own (so several
servers in one process never mix their figures). Two kinds:

- what the server counts as requests come and go: requests by endpoint and
  outcome, time to first token (a histogram), prompt, reused and generated
  tokens;
- what the runtime counts, read from one :meth:`CacheRuntime.stats
  <mlxkv.CacheRuntime.stats>` snapshot per scrape by a custom collector:
  prefix-cache queries and hits, tokens reused and computed, KV blocks held,
  cached and in the pool, decode steps and the request-steps they served
  (their ratio is the decode batch size), the admission slots and queue, the
  chat turns continued exactly, and with ``--kv-tier`` each tier's blocks by
  event (written, loaded, missed, dropped, corrupt, evicted), whether it
  answers, the write queue's drops and the tier timeouts. A tier is labelled
  by its kind (``file``, ``redis``, ``file-2`` for a second one), never by
  its path or address.

And, once, what computes (``mlxkv_compute_info``, labels only: the device,
shared-prefix attention's way, decode layers compiled of all, projection
sets fused, linear layers transposed -- :meth:`ModelInfo.summary
<mlxkv.actors.model_info.ModelInfo.summary>`'s figures), so a dashboard's
throughput comes with the way it was made.

Outcomes: ``stop`` and ``length`` (finished, as ``finish_reason``),
``disconnected`` (the client left; its generation was cancelled),
``invalid`` (4xx), ``overloaded`` and ``unavailable`` (503), ``failed`` (500).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlxkv.actors.model_info import ModelInfo
from mlxkv.cache.tiers.tier_stack import TierStackStatistics
from mlxkv.runtime_statistics import RuntimeStatistics
from mlxkv.server.admission import AdmissionStatistics
from mlxkv.server.chat import MemoryStatistics

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

#: The response's content type (prometheus-client's text format).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's metrics and the collector of the runtime's.

    Owns: a registry, the server's own counters and histogram in it, what
    computes (``info``, set once), and the latest runtime snapshot its
    collector reports.
    """

    def __init__(self, info: ModelInfo) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        compute = Info(
            "mlxkv_compute", "What computes: the device and what the runner chose for it.", registry=self.registry
        )
        compute.info(
            {
                "device": info.device,
                "prefix_attention": info.prefix_attention or "none",
                "compiled_layers": str(info.compiled_layers),
                "layers": str(len(info.cache_layers)),
                "fused_projections": str(info.fused_projections),
                "transposed_layers": str(info.transposed_layers),
            }
        )
        self.requests = Counter(
            "mlxkv_requests",
            "Generation requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "mlxkv_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "mlxkv_request_prompt_tokens",
            "Prompt tokens of generation requests.",
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "mlxkv_request_cached_tokens",
            "Prompt tokens of generation requests served from the cache (usage cached_tokens).",
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "mlxkv_request_generated_tokens",
            "Tokens generated for requests.",
            registry=self.registry,
        )
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)

    def render(
        self, stats: RuntimeStatistics, admission: AdmissionStatistics, memory: MemoryStatistics
    ) -> bytes:
        """The text exposition, with the runtime's figures from ``stats``."""
        self._snapshot.update(stats, admission, memory)
        return generate_latest(self.registry)


class _Snapshot(Collector):
    """Reports the runtime's, the admission's and the chat memory's latest figures."""

    def __init__(self) -> None:
        self._stats: Optional[RuntimeStatistics] = None
        self._admission: Optional[AdmissionStatistics] = None
        self._memory: Optional[MemoryStatistics] = None

    def update(
        self, stats: RuntimeStatistics, admission: AdmissionStatistics, memory: MemoryStatistics
    ) -> None:
        self._stats, self._admission, self._memory = stats, admission, memory

    def describe(self) -> list[Metric]:
        return []  # its metrics come and go with the snapshot

    def collect(self) -> Iterator[Metric]:
        stats, admission, memory = self._stats, self._admission, self._memory
        if stats is None or admission is None or memory is None:
            return
        index, pool, compute = stats.index, stats.allocator, stats.compute
        yield _counter(
            "mlxkv_prefix_cache_queries", "Prefix-index lookups of prompts.", index.num_lookups
        )
        yield _counter(
            "mlxkv_prefix_cache_hits", "Lookups that found cached blocks.", index.num_hits
        )
        yield _counter(
            "mlxkv_prefix_cache_hit_blocks", "Cached blocks those hits found.", index.num_hit_blocks
        )
        yield _counter(
            "mlxkv_prefix_waits",
            "Requests that waited for a prefix being computed.",
            index.num_waits,
        )
        blocks = GaugeMetricFamily(
            "mlxkv_kv_blocks", "KV blocks of the pool by state.", labels=["state"]
        )
        blocks.add_metric(["held"], pool.num_referenced)
        blocks.add_metric(["cached"], pool.num_cached)
        blocks.add_metric(["pool"], pool.num_blocks)
        yield blocks
        yield _counter("mlxkv_kv_blocks_stored", "Blocks computed and stored.", pool.num_stored)
        yield _counter(
            "mlxkv_kv_blocks_evicted", "Cached blocks evicted to make room.", pool.num_evictions
        )
        if compute is not None:
            yield _counter(
                "mlxkv_prompt_tokens_reused",
                "Prompt tokens not computed: rebuilt from cached blocks or a kept cache.",
                compute.num_cached_tokens,
            )
            yield _counter(
                "mlxkv_prompt_tokens_computed",
                "Prompt tokens run through the model.",
                compute.num_prefill_tokens,
            )
            yield _counter("mlxkv_decode_steps", "Decode model calls.", compute.num_decode_steps)
            yield _counter(
                "mlxkv_decode_rows",
                "Request-steps the decode calls served (/ decode steps = batch size).",
                compute.num_decode_rows,
            )
            batch = (
                compute.num_decode_rows / compute.num_decode_steps
                if compute.num_decode_steps
                else 0.0
            )
            yield _gauge(
                "mlxkv_decode_batch_size_mean", "Requests per decode call, on average.", batch
            )
            yield _gauge(
                "mlxkv_compute_live_requests",
                "Requests prefilling or decoding now.",
                compute.num_live,
            )
        if stats.tiers is not None:
            yield from _tier_metrics(stats.tiers)
        yield _gauge(
            "mlxkv_requests_running", "Requests holding an admission slot.", admission.num_running
        )
        yield _gauge(
            "mlxkv_requests_waiting",
            "Requests queued for an admission slot.",
            admission.num_waiting,
        )
        yield _gauge(
            "mlxkv_requests_max_running",
            "Admission slots (--max-concurrent).",
            admission.max_running,
        )
        yield _counter(
            "mlxkv_chat_turns_continued",
            "Chat prompts built on an earlier turn's exact tokens.",
            memory.num_continued,
        )


def _tier_metrics(tiers: TierStackStatistics) -> Iterator[Metric]:
    """The KV tiers below the pool: each tier's blocks by what happened to
    them, whether it answers, and the write-behind queue's drops."""
    blocks = CounterMetricFamily(
        "mlxkv_kv_tier_blocks", "Blocks each KV tier wrote, loaded, missed, dropped, found corrupt or evicted.",
        labels=["tier", "event"],
    )
    available = GaugeMetricFamily(
        "mlxkv_kv_tier_available", "Whether the tier's storage answered its last call (1) or not (0).",
        labels=["tier"],
    )
    for tier, label in zip(tiers.tiers, tier_labels(tier.name for tier in tiers.tiers)):
        for event, value in tier.counts():
            blocks.add_metric([label, event], value)
        available.add_metric([label], 1.0 if tier.available else 0.0)
    yield blocks
    yield available
    yield _counter(
        "mlxkv_kv_tier_queue_dropped",
        "Blocks not written behind because the write queue was full.",
        tiers.num_queue_dropped,
    )
    yield _counter("mlxkv_kv_tier_timeouts", "Tier calls cut off by the stack's timeout.", tiers.num_timeouts)
    yield _counter(
        "mlxkv_kv_tier_lookup_seconds",
        "Time prefix lookups in the KV tiers took: probing, reading, verifying and decoding blocks.",
        tiers.lookup_seconds,
    )


def tier_labels(names: Iterable[str]) -> list[str]:
    """Each tier's label: its kind (``file``, ``redis``), numbered from the second
    of a kind on (``file-2``); never its path or address, which a scrape
    would otherwise show to whoever may read /metrics."""
    labels, seen = [], collections.Counter[str]()
    for name in names:
        kind = name.partition("://")[0] if "://" in name else "tier"
        seen[kind] += 1
        labels.append(kind if seen[kind] == 1 else f"{kind}-{seen[kind]}")
    return labels


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
