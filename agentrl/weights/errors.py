"""Errors of the weight-sync boundary, each naming the engines it concerns.

Kept free of router imports so the engine pool can raise them without an import cycle.
"""

from __future__ import annotations

from typing import Any


class WeightSyncError(RuntimeError):
    """A weight update did not reach the engines it was meant for."""


class WeightUpdateFailed(WeightSyncError):
    """No engine took ``version``; ``engines`` maps each engine's name to its error and URL.

    The pool stays at its previous version; the learner may publish the next version.
    """

    def __init__(self, version: int, engines: dict[str, Any], what: str | None = None) -> None:
        self.version = version
        self.engines = engines
        detail = "; ".join(f"{name}: {info.get('error', info)}" for name, info in engines.items())
        super().__init__(f"{what or f'weight update to version {version} failed on every engine'}: {detail}")


class WeightGroupStale(WeightSyncError):
    """The NCCL weight-transfer group no longer matches the engines; the learner must re-form it."""
