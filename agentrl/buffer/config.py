"""Configuration of the rollout buffer: staleness bound and policy, groups, durability, leases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class BufferConfig:
    path: str | None = field(
        default=None, metadata={"derived": "run_dir (RUN_DIR/buffer) and buffer.durable"}
    )
    """Directory of the durable log (``<path>/buffer.log``); None keeps samples in memory only."""
    durable: bool = True
    """Keep the log on disk at ``path`` (under serve: RUN_DIR/buffer); false keeps samples in memory
    only, and a restart loses them."""
    batch_size: int = 16
    """Samples per batch (default for ``get_batch``) and the unit of the admission rule."""
    max_staleness: int = 2
    """Default bound on learner_version - sample.min_version for served samples."""
    stale_policy: Literal["drop", "keep_weighted"] = "drop"
    """drop: samples past ``max_staleness`` are dropped (reason "stale"). keep_weighted: samples are
    served up to ``loose_staleness`` and the learner down-weights them with its importance
    correction; past that they are dropped."""
    loose_staleness: int | None = None
    """The looser bound of keep_weighted (default 2 x max_staleness); ignored under drop."""
    group_size: int = field(default=1, metadata={"derived": "env.group_size"})
    """G: distinct episodes per group (GRPO). A group is complete when G distinct episode ids with its
    group id have arrived; an episode split into several samples counts once."""
    require_full_groups: bool = True
    """Serve groups whole (only when group_size > 1); otherwise samples are served one by one."""
    group_deadline_s: float | None = 600.0
    """A group still incomplete this long after its first member arrived is handled by
    ``partial_groups``. None waits forever (stragglers then pin the buffer; not recommended)."""
    partial_groups: Literal["serve", "drop"] = "serve"
    """What happens to a group that can no longer be completed (deadline, or a member dropped as
    stale): serve the members present as a partial group, or drop them (reason "partial_group")."""
    drop_errors: bool = False
    """Drop samples of failed episodes (reason "error") instead of keeping them as data."""
    drop_infrastructure_groups: bool = True
    """Drop a group one of whose episodes failed at an infrastructure boundary (an engine, the
    transport or a sandbox: error kinds model, transport, sandbox) when it closes, reason
    "infrastructure", counted in ``infrastructure_groups_dropped``: the failure says nothing about
    the policy, and the rest of the group would be compared against fewer members. The freed
    admission room lets the rollout play a new group. Grouped serving only."""
    drop_uniform_groups: bool = False
    """Dynamic sampling (DAPO): drop a group about to be served whose episodes all got the same
    reward (reason "uniform_group", counted in ``uniform_groups_dropped``): its advantages are all 0,
    it teaches nothing. Failed episodes' rewards are left out of the comparison (the learner does not
    train them). The freed admission room lets the rollout generate replacements, so batches stay
    full. Needs grouped serving (group_size > 1 and require_full_groups); otherwise it does nothing."""
    error_reward: float | None = 0.0
    """Reward stored for samples of failed episodes (None keeps what the producer set)."""
    sync: Literal["fsync", "flush"] = "fsync"
    """fsync: a put/ack returns after fdatasync (survives power loss). flush: after write(2)
    (survives a killed process, not a lost machine)."""
    min_free_mb: float = 256.0
    """Free space (MiB) the run directory's filesystem must keep (with a durable log at ``path``):
    under it, or once a write there failed with ENOSPC, admission control starts no new episode
    (``disk_full`` with its reason in the buffer's status, ``buffer_disk_full`` in /metrics, one
    warning in the log); finished episodes' puts wait in memory for the space. Serve resumes by
    itself once the free space is back (twice this after an ENOSPC). 0 reacts to ENOSPC only."""
    lease_s: float = 600.0
    """A served batch not acknowledged within this time is served again. Make it longer than a step."""
    max_poll_s: float = 60.0
    """Longest long-poll a learner may ask for."""
    max_pollers: int = 16
    """Concurrent long-polls beyond this get 429 with Retry-After (backpressure)."""
    compact_bytes: int = 256 << 20
    """Compact the log once it is this large and mostly consumed."""
    remember_ids: int = 1 << 18
    """How many consumed/dropped sample ids, acked batch ids and closed groups are remembered to make
    retried puts, retried acks and late group members exact (older ones are forgotten)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"buffer.batch_size must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"buffer.max_staleness must be >= 0, got {self.max_staleness}")
        if self.stale_policy not in ("drop", "keep_weighted"):
            raise ValueError("buffer.stale_policy must be 'drop' or "
                             f"'keep_weighted', got {self.stale_policy!r}")
        if self.partial_groups not in ("serve", "drop"):
            raise ValueError(f"buffer.partial_groups must be 'serve' or 'drop', got {self.partial_groups!r}")
        if self.sync not in ("fsync", "flush"):
            raise ValueError(f"buffer.sync must be 'fsync' or 'flush', got {self.sync!r}")
        if self.loose_staleness is None:
            self.loose_staleness = 2 * self.max_staleness
        if self.stale_policy == "keep_weighted" and self.loose_staleness < self.max_staleness:
            raise ValueError(
                f"buffer.loose_staleness ({self.loose_staleness}) must be >= buffer.max_staleness "
                f"({self.max_staleness}) under stale_policy='keep_weighted'; raise loose_staleness")
        if self.group_size < 1:
            raise ValueError(f"buffer.group_size must be >= 1, got {self.group_size}")
        if self.group_size > 1 and self.require_full_groups and self.batch_size % self.group_size:
            raise ValueError(
                f"buffer.batch_size ({self.batch_size}) must be a multiple of buffer.group_size "
                f"({self.group_size}) when require_full_groups is set")
        if self.lease_s <= 0 or self.max_poll_s <= 0 or self.max_pollers < 1:
            raise ValueError("buffer.lease_s and buffer.max_poll_s must be > 0 and max_pollers >= 1")
        if self.min_free_mb < 0:
            raise ValueError(f"buffer.min_free_mb must be >= 0, got {self.min_free_mb}")
        if self.remember_ids < 1:
            raise ValueError(f"buffer.remember_ids must be >= 1, got {self.remember_ids}")

    @property
    def grouped(self) -> bool:
        return self.require_full_groups and self.group_size > 1

    def bound(self, max_staleness: int) -> int:
        """The staleness past which a sample is never served, for a request with ``max_staleness``."""
        if self.stale_policy == "keep_weighted":
            return max(max_staleness, self.loose_staleness or 0)
        return max_staleness
