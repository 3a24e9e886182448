"""The batch feed: what the learner loop pulls, as typed values, and what it acknowledges.

Role: the loop's one view of its batch source. :meth:`BatchFeed.next` answers :class:`Batch` (samples
of one policy not trained yet) or :class:`Republish` (serve serves an older version of a policy than
the learner's), the same on every rank: rank 0 asks the source and broadcasts the answer, and a
failure there reaches every rank (:class:`Stop`) so that none waits in a collective for ever.
:meth:`BatchFeed.ack` acknowledges a trained batch.

Invariants (docs/learner.md, *Guards*):
- A sample is trained at most once. The ids of samples trained into the weights whose ack was not
  confirmed are remembered (in memory and in each checkpoint); they are taken out of a batch that
  brings them back, and a batch of nothing but such samples is acknowledged without a step.
- Several policies are asked in turn, each for a batch at its own version; one with nothing ready
  is passed over, and the next pull asks the policy after the one that had a batch.
- A serve that does not answer is waited for, up to ``batch_timeout_s`` (0: for ever), for batches
  and acks alike (an ack is idempotent); then its version is compared with the learner's before the
  next pull.
- While rank 0 waits on serve (a batch, an ack, serve's info), it tells the other ranks every
  ``heartbeat_s`` that it is alive (:class:`Wait`), so a wait of any length stays within
  torch.distributed's timeout, which then only catches a rank that hangs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from agentrl.errors import TransportError

if TYPE_CHECKING:
    from agentrl.buffer.sample import Sample
    from agentrl.learner.checkpoint import Resumed
    from agentrl.learner.config import LearnConfig
    from agentrl.learner.dist import Dist
    from agentrl.learner.policies import PolicySet
    from agentrl.learner.source import BatchSource

log = logging.getLogger(__name__)
progress = logging.getLogger("agentrl.progress")

SERVE_CHECK_S = 30.0  # while no batch comes, ask serve's version at most this often
REMEMBER_TRAINED = 1 << 16  # trained sample ids kept while their ack is unconfirmed
RETRY_S = 2.0  # pause before asking a serve that did not answer again
EMPTY_ROUND_S = 0.05  # several policies, none with a batch ready: pause before asking them all again
HEARTBEAT_S = 30.0  # rank 0 waiting on serve tells the other ranks it is alive this often

T = TypeVar("T")


@dataclass
class Batch:
    """Samples of one policy to train: those of ``batch_id`` not trained before (``before``)."""

    batch_id: str
    samples: list[Sample]
    policy: str | None = None
    before: list[str] = field(default_factory=list)

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]


@dataclass
class Republish:
    """Serve serves an older version of ``policy`` than the learner's: publish its weights again."""

    policy: str | None = None


@dataclass
class Wait:
    """Rank 0 is still waiting on serve: the other ranks wait on (a heartbeat, see ``heartbeat_s``)."""


@dataclass
class Stop:
    """Rank 0 could not go on (``reason``); every rank leaves."""

    reason: str


class BatchFeed:
    def __init__(self, cfg: LearnConfig, ctx: Dist, source: BatchSource | None, guards: Counter[str], *,
                 retry_s: float = RETRY_S, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.retry_s, self.heartbeat_s = retry_s, heartbeat_s
        self.source = source  # rank 0's; None on the other ranks
        self.guards = guards
        # rank 0: ids of samples trained into the weights whose batch's ack was not confirmed
        self.trained: OrderedDict[str, None] = OrderedDict()
        self.policies: PolicySet | None = None  # set once the policies are built (before any pull)
        self._turn = 0  # several policies: which one the next pull asks first (round robin)
        self._check_serve = False  # ask serve's version before the next pull

    # ------------------------------------------------------------------ the double-train guard (rank 0)

    def remember(self, ids: Iterable[str]) -> None:
        for i in ids:
            self.trained[i] = None
            self.trained.move_to_end(i)
        while len(self.trained) > REMEMBER_TRAINED:
            self.trained.popitem(last=False)

    def forget(self, ids: Iterable[str]) -> None:
        for i in ids:
            self.trained.pop(i, None)

    def check_serve(self) -> None:
        """Before the next pull, wait for serve and compare its versions with the learner's."""
        self._check_serve = True

    @property
    def next_policy(self) -> str | None:
        names = self._policies.names
        return names[self._turn] if names else None

    @property
    def _policies(self) -> PolicySet:
        assert self.policies is not None, "the feed's policies are set before it is used"
        return self.policies

    # ------------------------------------------------------------------ start

    async def resume(self, resumed: Resumed) -> None:
        """Go on from a checkpoint: its policy turn, its trained ids, its batch acknowledged again."""
        names = self._policies.names
        if resumed.next_policy in names:  # the turns go on where they were
            self._turn = names.index(resumed.next_policy)
        self.remember(resumed.trained)
        if self.source is not None and resumed.batch_id:
            acked = await self._ack(resumed.batch_id)
            log.info("re-acked checkpointed batch %s: %s", resumed.batch_id, acked)
            if not acked:  # the buffer forgot it: its samples come back, and are in these weights
                self.remember(resumed.batch_samples)

    async def release(self) -> None:
        """Return every lease of a previous learner to the pending samples."""
        if self.source is None:
            return
        released = await self._ride_out("release of a previous learner's leases", self.source.release)
        if released:
            log.info("released %d leased batch(es) of a previous learner", released)

    # ------------------------------------------------------------------ pull and ack

    async def next(self, since: float) -> Batch | Republish:
        """The next thing for the loop, on every rank (collective); :class:`Stop` raises SystemExit.
        Gives up ``batch_timeout_s`` after ``since`` (when the wait began, republishing included)."""
        source = self.source
        return await self.share(None if source is None else lambda: self._pull(source, since))

    async def share(self, make: Callable[[], Awaitable[T]] | None) -> T:
        """What rank 0's ``make()`` returns, on every rank (collective: the other ranks pass None).
        Rank 0 sends :class:`Wait` every ``heartbeat_s`` while it waits; its failure reaches the
        others as :class:`Stop`, which they raise as SystemExit."""
        ctx = self.ctx
        if make is None:
            got = ctx.broadcast_object(None)
            while isinstance(got, Wait):
                got = ctx.broadcast_object(None)
            if isinstance(got, Stop):
                raise SystemExit(f"rank 0 stopped: {got.reason}")
            return got
        return ctx.broadcast_object(await self._beating(make))

    async def _beating(self, make: Callable[[], Awaitable[T]]) -> T:
        """Rank 0: ``await make()``, telling the other ranks (waiting in :meth:`share`) every
        ``heartbeat_s`` that it is alive; a failure is passed on to them before it is raised."""
        task = asyncio.ensure_future(make())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.heartbeat_s)
                if done:
                    return task.result()
                self.ctx.broadcast_object(Wait())
        except BaseException as e:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.ctx.broadcast_object(Stop(str(e) or type(e).__name__))  # let the other ranks leave too
            raise

    async def ack(self, batch: Batch, updated: bool, more: bool = True) -> bool:
        """Acknowledge a trained batch (rank 0; True elsewhere). Refused: its samples come back, and
        those now in the weights (``updated``) are remembered so as not to train them again.
        ``more``: a pull follows on every rank, so the others wait in :meth:`next` while rank 0
        rides out the ack, and hear its heartbeat there; after the last step nobody listens."""
        if self.source is None:
            return True
        ack = self._ack(batch.batch_id)
        acked = await (self._beating(lambda: ack) if more else ack)
        if acked:
            self.forget(batch.before)
            return True
        self.guards["acks_rejected"] += 1
        self._check_serve = True
        if updated:
            self.remember(batch.sample_ids)
        progress.warning("WARNING: batch %s was not acknowledged (lease expired or serve restarted): "
                         "its samples will come back and are not trained again", batch.batch_id)
        return False

    async def _older_on_serve(self, source: BatchSource) -> Republish | None:
        """Republish when serve serves an older version of a policy than the learner's."""
        served = self._policies.served(await source.info())
        for policy in self._policies:
            serving, ours = served.get(policy.name, 0), policy.version
            if serving < ours:
                log.warning("serve serves %sversion %d, the learner is at %d (serve restarted?): "
                            "publishing the learner's weights again",
                            f"policy {policy.name} at " if policy.name else "", serving, ours)
                return Republish(policy.name)
        return None

    async def _pull(self, source: BatchSource, since: float) -> Batch | Republish:
        cfg, policies = self.cfg, self._policies
        names = policies.names
        checked = time.monotonic()
        while True:
            if policies.publishes and (self._check_serve or time.monotonic() - checked > SERVE_CHECK_S):
                self._check_serve, checked = False, time.monotonic()
                if (older := await self._older_on_serve(source)) is not None:
                    return older
            got, name = None, None
            order: list[str | None] = [*names[self._turn:], *names[:self._turn]] if names else [None]
            for name in order:
                policy = policies.of(name)
                try:
                    got = await source.get_batch(policy.version, **policy.kwargs)
                except TransportError as e:  # serve down (restarting?): ride it out, then ask its version
                    if not e.retryable:
                        raise
                    log.warning("no answer from serve for a batch (%s); waiting for it", e)
                    self._check_serve = True  # info() waits for serve to answer
                    await asyncio.sleep(self.retry_s)
                    got = None
                    break
                if got is not None:
                    break
            if got is not None:
                if name is not None:  # the next pull asks the next policy first
                    self._turn = (names.index(name) + 1) % len(names)
                batch_id, samples = got
                before = [s.sample_id for s in samples if s.sample_id in self.trained]
                if not before:
                    return Batch(batch_id, samples, name)
                fresh = [s for s in samples if s.sample_id not in self.trained]
                self.guards["samples_trained_before"] += len(before)
                log.warning("batch %s: %d of its %d samples were trained before (their ack was lost); not "
                            "training them again", batch_id, len(before), len(samples))
                if fresh:
                    return Batch(batch_id, fresh, name, before)
                acked = await self._ack(batch_id)
                self.guards["batches_trained_before"] += 1
                progress.warning("WARNING: batch %s held only samples trained before; acknowledged without a "
                                 "step (ack %s)", batch_id, acked)
                if acked:
                    self.forget(before)
                continue
            if names:
                await asyncio.sleep(EMPTY_ROUND_S)
            if cfg.batch_timeout_s and time.monotonic() - since > cfg.batch_timeout_s:
                raise SystemExit(f"no batch from {cfg.serve} within {cfg.batch_timeout_s:.0f} s")

    async def _ack(self, batch_id: str) -> bool:
        """``source.ack``, ridden out while serve does not answer (it is idempotent)."""
        source = self.source
        assert source is not None
        return bool(await self._ride_out(f"ack of batch {batch_id}", lambda: source.ack(batch_id)))

    async def _ride_out(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()``, tried again while serve does not answer, up to ``batch_timeout_s`` (0:
        for ever): a learner rides out a serve outage (a restart, a partition) instead of dying.
        Only for idempotent calls."""
        limit = self.cfg.batch_timeout_s
        deadline = time.monotonic() + limit
        while True:
            try:
                return await call()
            except TransportError as e:
                if not e.retryable or (limit and time.monotonic() > deadline):
                    raise
                log.warning("%s got no answer (%s); trying again", what, e)
                await asyncio.sleep(self.retry_s)
