"""What the benchmarks share: a free loopback port and one percentile convention.

Benchmarks run as scripts (``python benchmarks/x.py``), so this module is imported as ``common``
(the script's own folder is on ``sys.path``).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence


def free_port() -> int:
    """A port nobody listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q`` in [0, 1]) of ``xs``: the value at index
    ``min(n - 1, floor(q * n))`` of the sorted values; NaN for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]
