"""The per-sample versioned buffer: samples wait here until the learner has consumed them.

Role: the orchestrator ``put``s finished episodes' samples; the learner leases batches with
``get_batch(learner_version, max_staleness, ...)`` and ``ack``s each after its optimizer step.

Invariants:
- Durable before stored: a sample counts as produced only once its PUT record is in the log
  (flushed or fsynced per ``BufferConfig.sync``); an ack is logged the same way before it counts.
- Bounded staleness: no batch contains a sample with ``learner_version - min_version`` above the
  bound (``BufferConfig.bound``), including batches served again after a lease expired. Samples
  found past the bound are dropped, counted under reason "stale".
- Exactly-once consumption: a sample is in at most one lease at a time; it is consumed only by the
  ack of the batch that holds it; a batch whose lease expired (or was released, or which the buffer
  forgot by restarting) is never acked later and its samples are served again. Acks are
  idempotent. A put repeating a known sample id is ignored (counted as a duplicate), so producers
  may retry a put whose outcome they did not see.
- Accounting identity, at all times and across restarts:
  ``produced == consumed + sum(dropped_by_reason) + pending`` (pending includes leased samples).
- Groups (``group_size`` G > 1 with ``require_full_groups``): a group is served whole once G distinct
  episode ids have arrived (an episode split into several samples counts once, and all its
  samples travel with it). A group that can no longer complete (deadline passed, or a member
  dropped as stale) is served partial or dropped (reason "partial_group") per config; members
  arriving after their group was closed are dropped (reason "group_closed"), except further
  samples of an episode already in a group still waiting to be served, which join it.
- A group that lost a member to the infrastructure (``drop_infrastructure_groups``, on by default)
  is dropped when it closes (reason "infrastructure"); like the next rule, that frees admission
  room and the rollout plays a fresh group in its place.
- Dynamic sampling (``drop_uniform_groups``): a group about to be served whose episodes that did
  not fail all got the same reward is dropped instead (reason "uniform_group"); that frees
  admission room, so the rollout generates replacements and batches stay full.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agentrl.aio import to_the_end, wait_at_most
from agentrl.buffer.codec import (
    Batch,
    decode_sample,
    encode_batch_records,
    encode_with_prefix,
    gc_paused,
    read_header,
)
from agentrl.buffer.config import BufferConfig
from agentrl.buffer.disk import DiskFull, DiskGuard
from agentrl.buffer.journal import Acked, Dropped, Journal, Put, Record, Snapshot
from agentrl.buffer.log import HEADER_BYTES
from agentrl.buffer.sample import Sample
from agentrl.buffer.units import ARRIVAL, Bounded, Entry, Group, Lease, Unit
from agentrl.errors import INFRASTRUCTURE

log = logging.getLogger(__name__)

_NO_FLOOR = 1 << 62
_CLOSING = ("stale", "partial_group", "uniform_group", "infrastructure")  # drops that close their group


class Buffer:
    def __init__(self, cfg: BufferConfig) -> None:
        self.cfg = cfg
        self._entries: dict[str, Entry] = {}
        self._waiting: dict[str, Group] = {}
        self._ready: OrderedDict[str, Unit] = OrderedDict()
        self._ready_count = 0
        # No ready or waiting sample has a min_version (>= 0) below this, so a lease whose oldest
        # servable version is at most this needs no staleness scan (an O(pending) walk).
        self._version_floor = _NO_FLOOR
        self._leases: dict[str, Lease] = {}
        self._closed = Bounded(cfg.remember_ids)
        self._terminal = Bounded(cfg.remember_ids)  # sample id -> "consumed" | "dropped:<reason>"
        self._group_episodes = Bounded(cfg.remember_ids)  # group id -> the episode ids it has sent
        self._acked = Bounded(cfg.remember_ids)
        self._produced = 0
        self._consumed = 0
        self._dropped: Counter[str] = Counter()
        self._staleness: Counter[int] = Counter()
        self._live_bytes = 0
        self._counters: Counter[str] = Counter()
        self._pollers = 0
        self._learner_version = -1
        self._put_lock = asyncio.Lock()
        self._event = asyncio.Event()
        self._closed_flag = False
        self._journal: Journal | None = None
        self.disk: DiskGuard | None = None
        self._disk_waits_stopped = False
        if cfg.path is not None and cfg.durable:
            self._journal = Journal(cfg.path, cfg.sync)
            self.disk = DiskGuard(cfg.path, cfg.min_free_mb)
            self._recover()

    # ------------------------------------------------------------------ producer side

    async def put(self, samples: list[Sample]) -> int:
        """Store samples durably; returns how many were new (known sample ids are ignored).

        Put all samples of one episode in one call: group completeness is judged after each call.
        A put is never left half done: cancelled, it still finishes (its log write may already be
        under way in a thread) before the cancellation reaches the caller, so what the log holds the
        buffer serves.
        """
        return await to_the_end(self._put(samples))

    async def _put(self, samples: list[Sample]) -> int:
        async with self._put_lock:
            fresh: list[Sample] = []
            seen: set[str] = set()
            for s in samples:
                if s.sample_id in self._entries or s.sample_id in self._terminal or s.sample_id in seen:
                    self._counters["duplicates_ignored"] += 1
                    continue
                seen.add(s.sample_id)
                fresh.append(s)
            if not fresh:
                return 0
            entries = await self._write_when_room(fresh)
            drops: dict[str, list[str]] = {}
            touched: list[str] = []
            for e in entries:
                self._store(e)
                self._admit(e, drops, touched)
            for gid in touched:
                self._check_complete(gid, drops)
            await self._when_room(lambda: self._drop(drops))
        self._notify()
        return len(entries)

    async def _write_when_room(self, samples: list[Sample]) -> list[Entry]:
        """Write the samples' PUT; on a full disk keep them here and write them once space frees
        (the log is whole meanwhile: a torn append is cut back). Raises DiskFull only when serve
        stops first: the episodes' groups stay open in the task frontier and are played again."""
        while True:
            try:
                return await asyncio.to_thread(self._encode_and_write, samples, time.time())
            except DiskFull as e:
                self._no_space("writing a put", e)
                self._counters["puts_waiting_for_disk"] += 1
                await self._wait_for_disk(e)

    async def _when_room(self, write: Callable[[], None]) -> None:
        """``write()`` (a log write that changes no state when it fails), again once space frees."""
        while True:
            try:
                return write()
            except DiskFull as e:
                await self._wait_for_disk(e)

    async def _wait_for_disk(self, e: DiskFull) -> None:
        assert self.disk is not None
        while self.disk.full:
            if self._disk_waits_stopped or self._closed_flag:
                raise e
            await asyncio.sleep(self.disk.poll_s)

    def _no_space(self, what: str, e: DiskFull) -> None:
        if self.disk is not None:
            self.disk.no_space(f"{what} in buffer.log: {e.strerror}")

    def stop_disk_waits(self) -> None:
        """Serve is stopping: puts waiting for disk space give up (see :meth:`_write_when_room`)."""
        self._disk_waits_stopped = True

    def _encode_and_write(self, samples: list[Sample], now: float) -> list[Entry]:
        entries = []
        for s in samples:
            if (
                s.error is not None
                and self.cfg.error_reward is not None
                and s.reward != self.cfg.error_reward
            ):
                s = replace(s, reward=self.cfg.error_reward)
            payload, head = encode_with_prefix(s, prefix=ARRIVAL.pack(now))
            entries.append(Entry(s.sample_id, s.episode_id, s.group_id, head["min_version"], now, payload))
        if self._journal is not None:
            self._journal.put(entries)
        return entries

    def in_flight_allowance(self, in_flight: int) -> int:
        """How many more samples may be started now: keeps in_flight + buffered <= (max_staleness+1) x
        batch_size, where ``in_flight`` is the samples the producers' episodes in flight are expected
        to make (the orchestrator counts an episode as the mean a finished one made) and buffered
        counts unconsumed samples (leased ones too).
        """
        cap = (self.cfg.max_staleness + 1) * self.cfg.batch_size
        allowance = 0 if self.disk_full else max(0, cap - in_flight - self.pending)
        self._counters["admission_calls"] += 1
        if allowance == 0:
            self._counters["admission_refusals"] += 1
        return allowance

    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        """Wait until ``in_flight_allowance`` is positive (or the timeout); returns it."""
        deadline = time.monotonic() + timeout_s
        allowance = self.in_flight_allowance(in_flight)
        if allowance:
            return allowance
        self._counters["admission_waits"] += 1
        t0 = time.monotonic()
        try:
            while not allowance and not self._closed_flag:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await wait_at_most(self._event, left)
                allowance = self.in_flight_allowance(in_flight)
        finally:
            self._counters["admission_wait_ms"] += int(1000 * (time.monotonic() - t0))
        return allowance

    # ------------------------------------------------------------------ learner side

    async def get_batch(self, learner_version: int, max_staleness: int | None = None,
                        batch_size: int | None = None, timeout_s: float = 0.0) -> Batch | None:
        """Lease a batch of whole units (groups or samples) within the staleness bound, waiting up to
        ``timeout_s`` for one; None if none was ready. Samples as ``codec.decode_sample`` gives them."""
        lease = await self._lease_batch(learner_version, max_staleness, batch_size, timeout_s)
        if lease is None:
            return None
        with gc_paused():
            samples = [decode_sample(self._entries[i].record) for i in lease.ids]
        return Batch(lease.batch_id, samples, learner_version, self._batch_info(lease, max_staleness))

    async def get_batch_encoded(self, learner_version: int, max_staleness: int | None = None,
                                batch_size: int | None = None, timeout_s: float = 0.0) -> bytes | None:
        """Like ``get_batch`` but returns the batch already encoded for the wire (no decode)."""
        lease = await self._lease_batch(learner_version, max_staleness, batch_size, timeout_s)
        if lease is None:
            return None
        return encode_batch_records(lease.batch_id, learner_version,
                                    [self._entries[i].record for i in lease.ids],
                                    self._batch_info(lease, max_staleness))

    def _batch_info(self, lease: Lease, max_staleness: int | None) -> dict[str, Any]:
        ms = self.cfg.max_staleness if max_staleness is None else max_staleness
        return {"max_staleness": ms, "staleness_bound": self.cfg.bound(ms),
                "partial_groups": sum(u.partial for u in lease.units)}

    async def _lease_batch(self, learner_version: int, max_staleness: int | None, batch_size: int | None,
                           timeout_s: float) -> Lease | None:
        ms = self.cfg.max_staleness if max_staleness is None else max_staleness
        size = self.cfg.batch_size if batch_size is None else batch_size
        if size < 1 or ms < 0:
            raise ValueError(f"batch_size must be >= 1 and max_staleness >= 0 (got {size}, {ms})")
        deadline = time.monotonic() + min(max(timeout_s, 0.0), self.cfg.max_poll_s)
        self._learner_version = max(self._learner_version, learner_version)
        self._pollers += 1
        try:
            while True:
                event = self._event
                lease = self._try_lease(learner_version, self.cfg.bound(ms), size)
                if lease is not None or self._closed_flag:
                    return lease
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                wake = self._next_timer()
                if wake is not None:
                    left = min(left, max(wake - time.time(), 0.001))
                await wait_at_most(event, left)
        finally:
            self._pollers -= 1

    def _try_lease(self, learner_version: int, bound: int, size: int) -> Lease | None:
        now = time.time()
        self._expire_leases(now)
        drops: dict[str, list[str]] = {}
        self._expire_groups(now, drops)
        self._enforce_staleness(learner_version, bound, drops)
        self._drop(drops)
        if self._ready_count < size:
            return None
        units: list[Unit] = []
        count = 0
        while count < size:
            _, unit = self._ready.popitem(last=False)
            units.append(unit)
            count += len(unit.ids)
        self._ready_count -= count
        staleness: Counter[int] = Counter()
        for u in units:
            for i in u.ids:
                mv = self._entries[i].min_version
                staleness[learner_version - mv if mv >= 0 else 0] += 1
        lease = Lease(uuid.uuid4().hex, units, learner_version, now + self.cfg.lease_s, staleness)
        self._leases[lease.batch_id] = lease
        self._counters["batches_served"] += 1
        self._counters["samples_served"] += count
        self._counters["partial_groups_served"] += sum(u.partial for u in units)
        return lease

    def ack(self, batch_id: str) -> bool:
        """Mark a leased batch consumed (durably). True if acked now or before; False if the
        batch is unknown, e.g. its lease expired or was released and its samples will be re-served."""
        if batch_id in self._acked:
            return True
        lease = self._leases.get(batch_id)
        if lease is None:
            self._counters["acks_rejected"] += 1
            return False
        ids = lease.ids
        if self._journal is not None:
            try:
                self._journal.ack(Acked(batch_id, ids, lease.learner_version, dict(lease.staleness)))
            except DiskFull as e:  # not acked (the learner retries); the log is whole
                self._no_space("acknowledging a batch", e)
                raise
        del self._leases[batch_id]
        self._acked.add(batch_id)
        for i in ids:
            self._forget(i, "consumed")
        self._consumed += len(ids)
        self._staleness.update(lease.staleness)
        self._maybe_compact()
        self._notify()
        return True

    def release_leases(self) -> int:
        """Serve every leased batch again (a restarted learner calls this); returns how many."""
        n = len(self._leases)
        self._expire_leases(float("inf"))
        self._notify()
        return n

    # ------------------------------------------------------------------ state machine

    def _store(self, e: Entry) -> None:
        self._entries[e.sample_id] = e
        episodes = self._group_episodes.get(e.group_id)
        if episodes is None:
            self._group_episodes.add(e.group_id, [e.episode_id])
        elif e.episode_id not in episodes:
            episodes.append(e.episode_id)
        self._produced += 1
        self._live_bytes += len(e.payload) + HEADER_BYTES
        if 0 <= e.min_version < self._version_floor:
            self._version_floor = e.min_version

    def _forget(self, sample_id: str, state: str) -> None:
        e = self._entries.pop(sample_id)
        self._live_bytes -= len(e.payload) + HEADER_BYTES
        self._terminal.add(sample_id, state)

    def _admit(self, e: Entry, drops: dict[str, list[str]], touched: list[str],
               replay: bool = False) -> None:
        if self.cfg.drop_errors and not replay and self._is_error(e):
            drops.setdefault("error", []).append(e.sample_id)
            return
        if not self.cfg.grouped:
            self._push_ready(Unit("s:" + e.sample_id, [e.sample_id], {e.episode_id}))
            return
        gid = e.group_id
        if gid in self._closed:
            unit = self._ready.get("g:" + gid)
            if unit is not None and (replay or e.episode_id in unit.episodes):
                unit.ids.append(e.sample_id)
                unit.episodes.add(e.episode_id)
                self._ready_count += 1
            elif replay:  # its group was closed before the crash and this member not yet served
                self._push_ready(Unit("g:" + gid, [e.sample_id], {e.episode_id}, partial=True))
            else:
                drops.setdefault("group_closed", []).append(e.sample_id)
            return
        g = self._waiting.get(gid)
        if g is None:
            g = self._waiting[gid] = Group(gid, e.arrival)
        g.ids.append(e.sample_id)
        g.episodes.add(e.episode_id)
        touched.append(gid)

    def _is_error(self, e: Entry) -> bool:
        return read_header(e.record).get("error") is not None

    def _check_complete(self, gid: str, drops: dict[str, list[str]]) -> None:
        g = self._waiting.get(gid)
        if g is not None and len(g.episodes) >= self.cfg.group_size:
            del self._waiting[gid]
            self._closed.add(gid)
            self._counters["groups_completed"] += 1
            if not self._dropped_infrastructure(g.ids, drops) and not self._dropped_uniform(g.ids, drops):
                self._push_ready(Unit("g:" + gid, g.ids, g.episodes))

    def _dropped_infrastructure(self, ids: list[str], drops: dict[str, list[str]]) -> bool:
        """Under drop_infrastructure_groups, drop a group that lost a member to the infrastructure
        (an engine, the transport or a sandbox failed, :data:`agentrl.errors.INFRASTRUCTURE`): its
        other members' advantages would be measured against a smaller, biased group."""
        if not self.cfg.drop_infrastructure_groups or self.cfg.group_size < 2:
            return False
        if not any(read_header(self._entries[i].record).get("error_kind") in INFRASTRUCTURE for i in ids):
            return False
        drops.setdefault("infrastructure", []).extend(ids)
        self._counters["infrastructure_groups_dropped"] += 1
        return True

    def _dropped_uniform(self, ids: list[str], drops: dict[str, list[str]]) -> bool:
        """Under drop_uniform_groups, drop a group whose episodes that did not fail (the ones the
        learner trains) all got the same reward: its advantages are all 0 (DAPO's dynamic sampling)."""
        if not self.cfg.drop_uniform_groups:
            return False
        heads = [read_header(self._entries[i].record) for i in ids]
        if len({h["reward"] for h in heads if h.get("error") is None}) > 1:
            return False
        drops.setdefault("uniform_group", []).extend(ids)
        self._counters["uniform_groups_dropped"] += 1
        return True

    def _push_ready(self, unit: Unit, front: bool = False) -> None:
        self._ready[unit.key] = unit
        if front:
            self._ready.move_to_end(unit.key, last=False)
        self._ready_count += len(unit.ids)

    def _close_partial(self, key: str, ids: list[str], episodes: set[str], drops: dict[str, list[str]],
                       front: bool = False) -> None:
        """A group that can no longer complete: serve what is there, or drop it, per config."""
        if not ids or self._dropped_infrastructure(ids, drops) or self._dropped_uniform(ids, drops):
            return
        if self.cfg.partial_groups == "serve":
            self._push_ready(Unit(key, ids, episodes, partial=True), front=front)
        else:
            drops.setdefault("partial_group", []).extend(ids)

    def _expire_groups(self, now: float, drops: dict[str, list[str]]) -> None:
        if self.cfg.group_deadline_s is None:
            return
        while self._waiting:
            gid, g = next(iter(self._waiting.items()))
            if g.first_arrival + self.cfg.group_deadline_s > now:
                break
            del self._waiting[gid]
            self._closed.add(gid)
            self._counters["groups_past_deadline"] += 1
            self._close_partial("g:" + gid, g.ids, g.episodes, drops)

    def _enforce_staleness(self, learner_version: int, bound: int, drops: dict[str, list[str]]) -> None:
        oldest_ok = learner_version - bound
        if self._version_floor >= oldest_ok:
            return

        def stale(i: str) -> bool:
            mv = self._entries[i].min_version
            return 0 <= mv < oldest_ok

        for key in [k for k, u in self._ready.items() if any(stale(i) for i in u.ids)]:
            unit = self._ready.pop(key)
            self._ready_count -= len(unit.ids)
            bad = [i for i in unit.ids if stale(i)]
            drops.setdefault("stale", []).extend(bad)
            if self.cfg.grouped:
                rest = [i for i in unit.ids if not stale(i)]
                eps = {self._entries[i].episode_id for i in rest}
                self._close_partial(key, rest, eps, drops, front=True)
        for gid in [gid for gid, g in self._waiting.items() if any(stale(i) for i in g.ids)]:
            g = self._waiting.pop(gid)
            self._closed.add(gid)
            drops.setdefault("stale", []).extend(i for i in g.ids if stale(i))
            rest = [i for i in g.ids if not stale(i)]
            self._close_partial("g:" + gid, rest, {self._entries[i].episode_id for i in rest}, drops)
        ids = [i for u in self._ready.values() for i in u.ids] + [
            i for g in self._waiting.values() for i in g.ids
        ]
        self._version_floor = min(
            (mv for i in ids if (mv := self._entries[i].min_version) >= 0), default=_NO_FLOOR
        )

    def _expire_leases(self, now: float) -> None:
        expired = [b for b, lease in self._leases.items() if lease.deadline <= now]
        for b in reversed(expired):
            lease = self._leases.pop(b)
            for unit in reversed(lease.units):
                self._push_ready(unit, front=True)
                for i in unit.ids:
                    mv = self._entries[i].min_version
                    if 0 <= mv < self._version_floor:
                        self._version_floor = mv
            self._counters["leases_expired"] += 1
            log.warning("buffer: batch %s (%d samples) was not acknowledged in time; serving it again",
                        b, len(lease.ids))

    def _drop(self, drops: dict[str, list[str]]) -> None:
        if not any(drops.values()):
            return
        if self._journal is not None:
            try:
                self._journal.drop([Dropped(r, ids) for r, ids in drops.items() if ids])
            except DiskFull as e:  # the samples stay pending (counted), their drop not logged
                self._no_space("logging drops", e)
                raise
        for reason, ids in drops.items():
            for i in ids:
                gid = self._entries[i].group_id
                self._forget(i, "dropped:" + reason)
                if reason in _CLOSING:
                    self._closed.add(gid)
            self._dropped[reason] += len(ids)
        self._notify()

    def _next_timer(self) -> float | None:
        """Wall time of the next group deadline or lease expiry, if any."""
        times = [lease.deadline for lease in self._leases.values()]
        if self._waiting and self.cfg.group_deadline_s is not None:
            times.append(next(iter(self._waiting.values())).first_arrival + self.cfg.group_deadline_s)
        return min(times) if times else None

    def _notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    # ------------------------------------------------------------------ durability

    def _recover(self) -> None:
        assert self._journal is not None
        rec = self._journal.replay(self._apply)
        if rec.unreadable:
            self._counters["unreadable_records"] += rec.unreadable
        self._rebuild()
        self._counters.update(recovered_samples=len(self._entries),
                              corrupt_regions_skipped=rec.corrupt_regions,
                              corrupt_bytes_skipped=rec.skipped_bytes,
                              truncated_tail_bytes=rec.truncated_bytes,
                              orphan_log_ids=rec.orphan_ids)
        log.info("buffer: recovered %d pending samples from %s (produced %d, consumed %d, dropped %d)",
                 len(self._entries), self._journal.path, self._produced, self._consumed,
                 sum(self._dropped.values()))

    def _apply(self, record: Record) -> int:
        """Apply one journal record to the state; returns how many sample ids it named that are
        unknown (their PUT was lost to corruption: they are counted nowhere, which keeps the identity)."""
        if isinstance(record, Put):
            e = record.entry
            if e.sample_id not in self._entries and e.sample_id not in self._terminal:
                self._store(e)
            return 0
        if isinstance(record, Snapshot):
            self._load_snapshot(record)
            return 0
        known = [i for i in record.sample_ids if i in self._entries]
        acked = isinstance(record, Acked)
        for i in known:
            gid = self._entries[i].group_id
            if acked or record.reason in _CLOSING:
                self._closed.add(gid)
            self._forget(i, "consumed" if acked else "dropped:" + record.reason)
        if isinstance(record, Acked):
            self._consumed += len(known)
            self._acked.add(record.batch_id)
            self._learner_version = max(self._learner_version, record.learner_version)
            self._staleness.update(record.staleness)
        else:
            self._dropped[record.reason] += len(known)
        return len(record.sample_ids) - len(known)

    def _rebuild(self) -> None:
        """Regroup the recovered pending samples, in arrival order."""
        drops: dict[str, list[str]] = {}
        touched: list[str] = []
        for e in self._entries.values():
            self._admit(e, drops, touched, replay=True)
        for gid in dict.fromkeys(touched):
            self._check_complete(gid, drops)
        if self.cfg.grouped:
            for unit in self._ready.values():
                unit.partial = len(unit.episodes) < self.cfg.group_size
        self._drop(drops)

    def _snapshot(self) -> Snapshot:
        return Snapshot(self._produced - len(self._entries), self._consumed, dict(self._dropped),
                        dict(self._staleness), list(self._closed), list(self._terminal.items()),
                        list(self._acked), list(self._group_episodes.items()))

    def _load_snapshot(self, snap: Snapshot) -> None:
        self._produced += snap.produced
        self._consumed += snap.consumed
        self._dropped.update(snap.dropped)
        self._staleness.update(snap.staleness)
        for g in snap.closed:
            self._closed.add(g)
        for i, state in snap.terminal:
            self._terminal.add(i, state)
        for b in snap.acked:
            self._acked.add(b)
        for g, episodes in snap.group_episodes:
            self._group_episodes.add(g, episodes)

    def _maybe_compact(self) -> None:
        # Not while a put is between writing its records and admitting them: the rewrite would
        # leave out records of samples not yet in memory.
        if self._journal is None or self._put_lock.locked():
            return
        size = self._journal.size
        if size < self.cfg.compact_bytes or size < 2 * self._live_bytes:
            return
        try:
            self._journal.compact(self._snapshot(), self._entries.values())
        except DiskFull as e:  # the old log is whole; compaction waits for the space
            self._no_space("compacting", e)
            return
        self._counters["compactions"] += 1
        log.info("buffer: compacted log from %d to %d bytes", size, self._journal.size)

    # ------------------------------------------------------------------ observation

    async def group_progress(self, group_id: str) -> int:
        """How many of a group's episodes the buffer took (pending, served, consumed or dropped), or
        the group size once the group is closed (served, past its deadline, dropped): what a
        resumed rollout need not play again. Known for the last ``remember_ids`` groups, across
        restarts."""
        if group_id in self._closed:
            return self.cfg.group_size
        return len(self._group_episodes.get(group_id) or ())

    def stats(self) -> dict[str, Any]:
        pending = len(self._entries)
        leased = sum(len(lease.ids) for lease in self._leases.values())
        dropped = sum(self._dropped.values())
        return {
            "depth": self._ready_count,
            "produced": self._produced,
            "consumed": self._consumed,
            "dropped": dropped,
            "dropped_by_reason": dict(self._dropped),
            "pending": pending,
            "leased": leased,
            "leased_batches": len(self._leases),
            "waiting_groups": len(self._waiting),
            "waiting_group_samples": sum(len(g.ids) for g in self._waiting.values()),
            "identity_holds": self._produced == self._consumed + dropped + pending,
            "staleness_consumed": {str(k): v for k, v in sorted(self._staleness.items())},
            "pollers": self._pollers,
            "learner_version": self._learner_version,
            "log_bytes": self._journal.size if self._journal is not None else 0,
            **(self.disk.stats() if self.disk is not None else {}),
            **dict(self._counters),
        }

    def sample_state(self, sample_id: str) -> str | None:
        """"pending", "leased", "consumed", "dropped:<reason>", or None (unknown or forgotten)."""
        if sample_id in self._entries:
            leased = any(sample_id in u.ids for lease in self._leases.values() for u in lease.units)
            return "leased" if leased else "pending"
        return self._terminal.get(sample_id)

    @property
    def learner_version(self) -> int:
        """The newest version a learner has asked with (or acked at, before a restart); -1 if none."""
        return self._learner_version

    @property
    def pollers(self) -> int:
        return self._pollers

    @property
    def closed(self) -> bool:
        return self._closed_flag

    @property
    def disk_full(self) -> bool:
        """The run directory's disk is (nearly) full: admission starts nothing (:class:`DiskGuard`)."""
        return self.disk is not None and self.disk.full

    @property
    def pending(self) -> int:
        """Samples stored and not consumed yet (leased ones too): what admission counts."""
        return len(self._entries)

    def stream(self, policy: str | None) -> Buffer:
        """The buffer a learner's request for ``policy`` reads: this one when it names none (a
        serve of one policy); ValueError for a named one (see
        :class:`~agentrl.buffer.streams.PolicyBuffers`)."""
        if policy:
            raise ValueError(f"no policy {policy[:60]!r}: serve runs one "
                             "policy (set serve.policies to name several)")
        return self

    def changed(self) -> asyncio.Event:
        """An event set at the buffer's next change (a put, an ack, a drop, a release, close)."""
        return self._event

    def close(self) -> None:
        self._closed_flag = True
        self._notify()
        if self._journal is not None:
            self._journal.close()
