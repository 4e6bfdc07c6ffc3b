"""Prometheus metrics of one app, on its own CollectorRegistry (never the global one, so
two apps in one process — tests — never share counters), and the recent decode rate the
web page shows.

Counters and histograms move as turns run; the engine's gauges (requests running and
waiting, slots, experts per tier) are read from the engine at scrape time.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..runtime.api import StartupReport, TurnStats
from ..runtime.engine_api import EngineAPI

TIERS = ("disk", "ram", "device")  # EMAP's 2-bit tier: 0 disk, 1 host RAM, 2 device
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class EngineCollector:
    """The engine's state as gauges, read when Prometheus scrapes."""

    def __init__(self, engine: EngineAPI):
        self.engine = engine

    def describe(self):
        return []  # the names are fixed; no need to collect at registration

    def collect(self):
        stats = self.engine.statistics()
        yield _gauge("motet_requests_running", "Requests holding a KV slot.", stats.running)
        yield _gauge("motet_requests_waiting", "Requests queued for a KV slot.", stats.waiting)
        yield _gauge("motet_kv_slots_busy", "KV slots in use.", stats.running)
        yield _gauge("motet_kv_slots_total", "KV slots.", stats.slots_total)
        yield _gauge("motet_prefix_store_bytes", "Host RAM holding prefixes pushed out of the KV slots.",
                     stats.prefix_store_bytes)
        experts = GaugeMetricFamily("motet_experts", "Experts per memory tier.", labels=["tier"])
        for tier, count in zip(TIERS, experts_per_tier(self.engine.expert_state().emap)):
            experts.add_metric([tier], count)
        yield experts
        yield from startup_metrics(self.engine.startup())
        split = self.engine.health().split  # motet serve --split
        if split is not None:
            for name, kind, doc, value in split.metrics():
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, doc, value=value)


def startup_metrics(report: StartupReport | None):
    """Time to ready and the executables it took (what a mux child did not say is left out)."""
    if report is None:
        return
    yield _gauge("motet_time_to_ready_seconds", "From the engine's start to ready: loading the model, "
                 "then compiling and running every shape it serves.", report.ready_s)
    if report.compiled is not None and report.from_cache is not None:  # said together
        executables = GaugeMetricFamily("motet_startup_executables", "Executables the engine needed while "
                                        "starting, by where they came from.", labels=["source"])
        executables.add_metric(["compiled"], report.compiled)
        executables.add_metric(["cache"], report.from_cache)
        yield executables
    if report.compiles_after_ready is not None:
        yield _gauge("motet_executables_after_ready", "Executables needed since the engine was ready "
                     "(a shape warm-up missed: a request waited on the compiler).", report.compiles_after_ready)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def experts_per_tier(emap: bytes) -> tuple[int, int, int]:
    """How many experts sit on disk, in host RAM, on the device (EMAP bytes: tier << 6)."""
    counts = [0, 0, 0]
    for byte in emap:
        tier = byte >> 6
        if tier < 3:
            counts[tier] += 1
    return counts[0], counts[1], counts[2]


class Metrics:
    def __init__(self, engine: EngineAPI):
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("motet_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("motet_generation_tokens", "Tokens generated.", registry=r)
        self.cache_queries = Counter(
            "motet_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r)
        self.cache_hits = Counter(
            "motet_prefix_cache_hits", "Prompt tokens whose KV a slot already held.", registry=r)
        self.tokens_copied = Counter(
            "motet_prefix_tokens_copied", "Of the prefix cache's hits, prompt tokens copied from another slot.",
            registry=r)
        self.tokens_computed = Counter(
            "motet_prompt_tokens_computed", "Prompt tokens read by a prefill (not found in any slot).", registry=r)
        self.ttft = Histogram("motet_time_to_first_token_seconds",
                              "From request to first token, queueing included.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("motet_inter_token_latency_seconds", "Between tokens of a stream.",
                             buckets=ITL_BUCKETS, registry=r)
        self.requests = Counter("motet_requests", "Requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        r.register(EngineCollector(engine))

    def observe_turn(self, stats: TurnStats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.emitted_tokens)
        self.cache_queries.inc(stats.prompt_tokens)
        self.tokens_copied.inc(stats.copied_tokens)
        self.tokens_computed.inc(stats.prompt_tokens - stats.reused_tokens)
        self.cache_hits.inc(stats.reused_tokens)
        self.requests.labels(stats.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RecentRate:
    """Events per second over the last `window_s` seconds (the caller passes the time)."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.times: deque[float] = deque()

    def add(self, now: float) -> None:
        self.times.append(now)
        self._forget(now)

    def rate(self, now: float) -> float:
        self._forget(now)
        return len(self.times) / self.window_s

    def _forget(self, now: float) -> None:
        while self.times and self.times[0] <= now - self.window_s:
            self.times.popleft()
