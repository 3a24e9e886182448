"""One buffer stream per named policy (multi-LoRA): the samples of each policy wait in their own buffer.

Role: with ``serve.policies`` (several LoRA policies on one base model, each chosen per call by the
request's ``model``), every policy has its own version counter, so its samples' staleness is
counted against its own learner version and bounded by its own ``max_staleness``.
:class:`PolicyBuffers` keeps one :class:`~agentrl.buffer.core.Buffer` per policy (its own log
under ``<buffer path>/<policy>``) and offers the rollout side the one buffer's interface: a sample
goes to the stream its ``info["policy"]`` names (the first policy when it names none), and
admission counts every stream against the sum of their bounds. The learner's routes take a
``policy`` and reach that stream alone (:meth:`stream`).

Invariants: a sample is stored in exactly one stream; a batch holds one policy's samples only;
a lease id is unique across streams, so an ack reaches the stream that leased it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.buffer.config import BufferConfig
from agentrl.buffer.core import Buffer
from agentrl.buffer.sample import POLICY_KEY, Sample

if TYPE_CHECKING:
    from agentrl.buffer.codec import Batch


class PolicyBuffers:
    """One :class:`Buffer` per policy behind the single buffer's interface (see the module)."""

    def __init__(self, cfg: BufferConfig, staleness: dict[str, int]) -> None:
        """``staleness``: policy -> its max_staleness (config order; the first is the default)."""
        if not staleness:
            raise ValueError("PolicyBuffers needs at least one policy")
        self.cfg = cfg
        self.streams: dict[str, Buffer] = {}
        for name, bound in staleness.items():
            path = None if cfg.path is None else str(Path(cfg.path) / name)
            self.streams[name] = Buffer(dataclasses.replace(cfg, path=path, max_staleness=bound))
        self.default = next(iter(self.streams))

    def stream(self, policy: str | None) -> Buffer:
        """The named policy's buffer (the default policy's for None or ""); ValueError for a name
        serve does not run."""
        if not policy:
            return self.streams[self.default]
        try:
            return self.streams[policy]
        except KeyError:
            raise ValueError(f"no policy {policy[:60]!r}: serve runs {', '.join(self.streams)}") from None

    # -- the rollout side ------------------------------------------------------------------------
    async def put(self, samples: list[Sample]) -> int:
        by_policy: dict[str, list[Sample]] = {}
        for s in samples:
            name = s.info.get(POLICY_KEY)  # the router names it; none: the default policy's
            by_policy.setdefault(name if name in self.streams else self.default, []).append(s)
        stored = 0
        for name, part in by_policy.items():
            stored += await self.streams[name].put(part)
        return stored

    def in_flight_allowance(self, in_flight: int) -> int:
        """Samples that may be started now: ``in_flight`` (the samples the episodes in flight are
        expected to make, one per trained role's policy) plus every stream's unconsumed samples stay
        within the sum of the streams' bounds ((max_staleness + 1) x batch_size each)."""
        if any(b.disk_full for b in self.streams.values()):  # see agentrl.buffer.disk
            return 0
        cap = sum((b.cfg.max_staleness + 1) * b.cfg.batch_size for b in self.streams.values())
        held = sum(b.pending for b in self.streams.values())
        return max(0, cap - in_flight - held)

    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            allowance = self.in_flight_allowance(in_flight)
            left = deadline - time.monotonic()
            if allowance or left <= 0 or any(b.closed for b in self.streams.values()):
                return allowance
            # any stream's change (a consumed batch, a drop) may make room
            waits = [asyncio.ensure_future(b.changed().wait()) for b in self.streams.values()]
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def group_progress(self, group_id: str) -> int:
        """The most any stream took of the group (each stream sees the episodes that called its policy)."""
        return max([await b.group_progress(group_id) for b in self.streams.values()])

    # -- the learner side ------------------------------------------------------------------------
    async def get_batch(
        self,
        learner_version: int,
        max_staleness: int | None = None,
        batch_size: int | None = None,
        timeout_s: float = 0.0,
        policy: str | None = None,
    ) -> Batch | None:
        return await self.stream(policy).get_batch(learner_version, max_staleness, batch_size, timeout_s)

    def ack(self, batch_id: str) -> bool:
        return any(b.ack(batch_id) for b in self.streams.values())

    def release_leases(self) -> int:
        return sum(b.release_leases() for b in self.streams.values())

    @property
    def pollers(self) -> int:
        return sum(b.pollers for b in self.streams.values())

    def stats(self) -> dict[str, Any]:
        """The streams' counters summed (``identity_holds`` when it holds in every stream; the
        default stream's ``learner_version``), with each stream's own under ``policies``."""
        per = {name: b.stats() for name, b in self.streams.items()}
        out: dict[str, Any] = {}
        for st in per.values():
            for k, v in st.items():
                if isinstance(v, bool):
                    out[k] = out.get(k, True) and v
                elif isinstance(v, int | float):
                    out[k] = out.get(k, 0) + v
                elif isinstance(v, dict):
                    merged = out.setdefault(k, {})
                    for kk, vv in v.items():
                        merged[kk] = merged.get(kk, 0) + vv
        out["learner_version"] = per[self.default]["learner_version"]
        if any("disk_full" in st for st in per.values()):  # one filesystem: any stream's guard says
            out["disk_full"] = int(any(st.get("disk_full") for st in per.values()))
            out["disk_full_reason"] = next((r for st in per.values() if (r := st.get("disk_full_reason"))),
                                           None)
            out["disk_free_mb"] = min((st["disk_free_mb"] for st in per.values()
                                       if st.get("disk_free_mb") is not None), default=None)
        out["policies"] = per
        return out

    def stop_disk_waits(self) -> None:
        for b in self.streams.values():
            b.stop_disk_waits()

    def close(self) -> None:
        for b in self.streams.values():
            b.close()
