"""Prometheus text exposition for the router: counters, engine gauges and latency histograms.

No client library: the format is small, and the hot path only does a bisect and two additions
per observation.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrl.router.core import Router

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class Histogram:
    """A labelled histogram with fixed buckets (seconds)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name = name
        self.help = help_text
        self.buckets = buckets
        self._series: dict[tuple[tuple[str, str], ...], list[float]] = {}  # counts..., sum, count

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = [0.0] * (len(self.buckets) + 2)
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):  # above the last bucket: counted in +Inf (the total) only
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, s in self._series.items():
            base = ",".join(f'{k}="{v}"' for k, v in key)
            sep = "," if base else ""
            cum = 0.0
            for b, c in zip(self.buckets, s, strict=False):
                cum += c
                out.append(f'{self.name}_bucket{{{base}{sep}le="{b:g}"}} {cum:g}')
            out.append(f'{self.name}_bucket{{{base}{sep}le="+Inf"}} {s[-1]:g}')
            lab = f"{{{base}}}" if base else ""
            out.append(f"{self.name}_sum{lab} {s[-2]:.6f}")
            out.append(f"{self.name}_count{lab} {s[-1]:g}")
        return out


class RouterMetrics:
    """The router's histograms (its counters live on :class:`~agentrl.router.core.Router`)."""

    def __init__(self) -> None:
        self.request_seconds = Histogram("agentrl_router_request_seconds",
                                         "Time from request to full response, by route and status.")
        self.first_token_seconds = Histogram("agentrl_router_time_to_first_token_seconds",
                                             "Streaming: time from request to the first generated tokens.")

    def histograms(self) -> list[Histogram]:
        return [self.request_seconds, self.first_token_seconds]


def metrics_text(router: Router, extra: dict[str, float] | None = None) -> str:
    lines = []
    for k, v in router.counters.items():
        lines.append(f"agentrl_router_{k}_total {v}")
    lines.append(f"agentrl_policy_version {router.pool.version}")
    lines.append(f"agentrl_router_sessions {len(router.sessions)}")
    for e in router.pool.engines:
        lab = f'{{engine="{e.name}"}}'
        lines += [f"agentrl_engine_healthy{lab} {int(e.healthy)}", f"agentrl_engine_outstanding{lab} "
                                                                   f"{e.outstanding}",
                  f"agentrl_engine_version{lab} {e.version}", f"agentrl_engine_served_total{lab} {e.served}",
                  f"agentrl_engine_failures_total{lab} {e.failures}"]
    for h in router.metrics.histograms():
        lines += h.lines()
    for k, v in (extra or {}).items():
        lines.append(f"agentrl_{k} {v}")
    lines.append(f"agentrl_scrape_time_seconds {time.time():.3f}")
    return "\n".join(lines) + "\n"
