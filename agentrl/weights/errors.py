"""Errors of the weight-sync boundary: one root, :class:`WeightSyncError`, under agentrl's root.

- :class:`WeightTransferError` (learner side): the weights did not get to serve, or serve refused
  them; ``status`` is serve's HTTP status when it answered. :class:`EnginesFailed` under it: they
  arrived but no engine could load them (serve kept its previous version; the next version is a
  fresh attempt).
- :class:`WeightUpdateFailed` (serve side): no engine took a version; names every engine and why.
- :class:`DeltaRefused` (learner side, under :class:`WeightTransferError`): serve would not apply
  a delta (the engines do not hold its base, or it did not rebuild bit for bit); the delta
  transport sends the full weights instead. :class:`DeltaError` (serve side): why.
- :class:`WeightGroupStale` (serve side, NCCL): the weight-transfer group no longer matches the
  engines; the learner must re-form it.

Imports only :mod:`agentrl.errors`, so every module of the weight boundary may raise these.
"""

from __future__ import annotations

from typing import Any

from agentrl.errors import AgentrlError


class WeightSyncError(AgentrlError, RuntimeError):
    """A weight update did not reach the engines it was meant for.

    Still a RuntimeError, as both of its former roots were (like the sandbox's family).
    """


class WeightTransferError(WeightSyncError):
    """The learner's weights did not complete their way to serve (transport, checksum or engine failure)."""

    def __init__(self, message: str, status: int | None = None, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        # serve did not answer, or answered 5xx/429 (down, restarting): wait for it
        self.unreachable = unreachable


class EnginesFailed(WeightTransferError):
    """The weights arrived but no engine could load them (the message names each engine)."""


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


class DeltaRefused(WeightTransferError):
    """serve refused a delta (``code``: "base_mismatch", 409; "digest_mismatch" or "malformed_delta", 400)."""

    def __init__(self, message: str, status: int | None = None, code: str = "") -> None:
        super().__init__(message, status)
        self.code = code


class DeltaError(WeightSyncError, ValueError):
    """A delta that cannot be applied: ``code`` "base_mismatch" (it is against another version than
    the engines hold), "digest_mismatch" (the rebuilt weights differ from the learner's) or
    "malformed_delta" (names, shapes, dtypes or indices that do not fit the base)."""

    def __init__(self, message: str, code: str = "malformed_delta") -> None:
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> int:
        return 409 if self.code == "base_mismatch" else 400
