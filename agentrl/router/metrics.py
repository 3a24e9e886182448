"""Prometheus exposition for the router, with ``prometheus_client``: one registry per process.

- :class:`RouterMetrics` holds a router's registry: its latency histograms (``prometheus_client``
  histograms, observed on the hot path) and a collector that reads its counters and engine gauges
  when scraped (the hot path only adds to a dict).
- :func:`exposition` is one ``/metrics`` answer: this process's registry, series a caller adds
  (serve's rollout, buffer and scoring, as ``{"name{labels}": value}``), and the expositions of
  other processes (serve's other router processes, each labelled with its index), merged into one
  family per name, so their series add up in one scrape.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from agentrl.router.core import Router

log = logging.getLogger(__name__)

# No `<name>_created` series: nobody reads them, and merged across processes they would repeat.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class _RouterCollector(Collector):
    """The router's counters (``Router.counters``) and its engine pool's gauges, read at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r = self.router
        for k, v in list(r.counters.items()):
            yield CounterMetricFamily(f"agentrl_router_{k}", f"The router's {k.replace('_', ' ')}.", value=v)
        yield GaugeMetricFamily("agentrl_policy_version", "The policy version the router's pool serves.",
                                value=r.pool.version)
        yield GaugeMetricFamily("agentrl_router_sessions", "Sessions the router holds.",
                                value=len(r.sessions))
        per_engine = (
            (GaugeMetricFamily, "agentrl_engine_healthy", "1 while the engine takes traffic.", "healthy"),
            (GaugeMetricFamily, "agentrl_engine_outstanding", "Calls the router has open on the engine.",
             "outstanding"),
            (GaugeMetricFamily, "agentrl_engine_version", "The policy version the engine holds.", "version"),
            (CounterMetricFamily, "agentrl_engine_served", "Calls the engine answered.", "served"),
            (CounterMetricFamily, "agentrl_engine_failures", "Calls to the engine that failed.", "failures"),
        )
        engines = list(r.pool.engines)
        for kind, name, help_text, attr in per_engine:
            family = kind(name, help_text, labels=["engine"])
            for e in engines:
                family.add_metric([e.name], float(getattr(e, attr)))
            yield family
        yield GaugeMetricFamily("agentrl_scrape_time_seconds", "When this exposition was made (unix time).",
                                value=time.time())


class RouterMetrics:
    """A router's registry: its histograms, and its counters and engine gauges as a collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.request_seconds = Histogram(
            "agentrl_router_request_seconds", "Time from request to full response, by route and status.",
            ("route", "status"), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_token_seconds = Histogram(
            "agentrl_router_time_to_first_token_seconds",
            "Streaming: time from request to the first generated tokens.", ("route",),
            buckets=LATENCY_BUCKETS, registry=self.registry)

    def watch(self, router: Router) -> None:
        """Add ``router``'s counters and engine gauges to this registry (once, by the router)."""
        self.registry.register(_RouterCollector(router))


_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def series_families(series: dict[str, float], prefix: str = "agentrl_") -> list[Metric]:
    """``{"name{label="value",...}": number}`` as metric families (``prefix`` before each name): a
    name ending in ``_total`` is a counter, any other a gauge. A key that is not a series name is
    skipped with a warning."""
    families: dict[str, Metric] = {}
    for key, value in series.items():
        m = _SERIES.match(key)
        if m is None or isinstance(value, bool) or not isinstance(value, int | float):
            log.warning("metrics: skipped a series that is not one: %r = %r", key, value)
            continue
        name = prefix + m.group(1)
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(2) or "")}
        counter = name.endswith("_total")
        family = families.get(name)
        if family is None:
            family = families[name] = Metric(name.removesuffix("_total") if counter else name, "",
                                             "counter" if counter else "gauge")
        family.add_sample(name, labels, float(value))
    return list(families.values())


def _labelled(families: Iterable[Metric], label: str, value: str) -> Iterator[Metric]:
    for f in families:
        out = Metric(f.name, f.documentation, f.type, f.unit)
        out.samples = [s._replace(labels={**s.labels, label: value}) for s in f.samples]
        yield out


class _Merged(Collector):
    def __init__(self, sources: list[Iterable[Metric]]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for source in self.sources:
            for f in source:
                have = families.get(f.name)
                if have is None:
                    families[f.name] = f
                elif have.type == f.type:
                    have.samples = [*have.samples, *f.samples]
                else:
                    log.warning("metrics: %s is a %s here and a %s elsewhere; the latter left out", f.name,
                                have.type, f.type)
        yield from families.values()


def exposition(router: Router, extra: dict[str, float] | None = None,
               others: Iterable[tuple[str, str, str]] = ()) -> bytes:
    """One ``/metrics`` answer in Prometheus' text format: ``router``'s registry, the ``extra``
    series (:func:`series_families`), and ``others``, each ``(label, value, exposition text)`` of
    another process, its series labelled ``label="value"``. An exposition that does not parse is
    left out with a warning."""
    sources: list[Iterable[Metric]] = [router.metrics.registry.collect(), series_families(extra or {})]
    for label, value, text in others:
        try:
            sources.append(_labelled(list(text_string_to_metric_families(text)), label, value))
        except ValueError as e:
            log.warning("metrics: the exposition of %s %s does not parse (%s); left out", label, value, e)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(sources))
    return generate_latest(registry)
