"""Counters and recent latencies of a sandbox pool (shared by the pool and the handles it gives out)."""

from __future__ import annotations

from collections import deque
from typing import Any


def _pct(xs: deque[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 3)


class PoolStats:
    """Counters and recent latencies (last 4096 of each) of one pool."""

    def __init__(self) -> None:
        self.created = self.destroyed = self.resets = self.reaped = 0
        self.acquires = self.warm_hits = self.exec_count = 0
        self.timeouts = self.oom_kills = self.infra_errors = 0
        self.exec_s: deque[float] = deque(maxlen=4096)
        self.acquire_s: deque[float] = deque(maxlen=4096)
        self.create_s: deque[float] = deque(maxlen=4096)

    def record_exec(self, seconds: float) -> None:
        self.exec_count += 1
        self.exec_s.append(seconds)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in vars(self).items() if isinstance(v, int)}
        for name in ("exec", "acquire", "create"):
            xs = getattr(self, f"{name}_s")
            out[f"{name}_p50_ms"] = _pct(xs, 0.5)
            out[f"{name}_p99_ms"] = _pct(xs, 0.99)
        return out
