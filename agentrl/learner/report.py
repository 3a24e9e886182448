"""The learner's report of each step: one typed row, written everywhere a step is seen.

Role: :class:`StepReport` is what a step that updated the weights reports (the step's own stats
from :func:`agentrl.learner.step.train_step`, the policy and its version, the batch, the guards'
counts, where the time went); :class:`Reporter` (rank 0) writes it as one JSON row of
``learner.jsonl``, the gauges of the learner's ``/metrics``, the TensorBoard / W&B writers and the
one progress line people read, and keeps the rows ``learn`` returns. It also says, loudly, what
was not trained, and watches for batches without a learning signal.

Invariants: a row's keys and their order are those ``learner.jsonl`` has always had
(``policy`` and ``policy_step`` only for a named policy; ``warnings`` only when there are some);
every sink gets the same row.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.buffer.disk import append_line
from agentrl.learner.signals import SignalWatch

if TYPE_CHECKING:
    from agentrl.buffer.sample import Sample
    from agentrl.learner.config import LearnConfig
    from agentrl.learner.metrics import MetricsServer, Writer

log = logging.getLogger(__name__)
# one line per step, for people (the CLI shows this logger's messages as they are, without a prefix)
progress = logging.getLogger("agentrl.progress")


@dataclass
class StepReport:
    step: int  # every policy's steps together
    policy: str | None  # None: the one policy of a single-policy run
    policy_step: int
    version: int
    time: float
    stats: dict[str, Any]  # train_step's (loss, reward, staleness, importance weights, ...)
    world: int
    batch_id: str
    acked: bool
    guards: dict[str, int]
    wait_s: float
    train_s: float
    sync_s: float
    checkpoint_s: float
    idle_fraction: float
    engine_sync: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """The ``learner.jsonl`` row."""
        policy = {"policy": self.policy, "policy_step": self.policy_step} if self.policy is not None else {}
        row = {"step": self.step, **policy, "version": self.version, "time": self.time, **self.stats,
               "world": self.world, "batch_id": self.batch_id, "acked": self.acked, "guards": self.guards,
               "wait_s": self.wait_s, "train_s": self.train_s, "sync_s": self.sync_s,
               "checkpoint_s": self.checkpoint_s, "idle_fraction": self.idle_fraction,
               "engine_sync": self.engine_sync, "wait_fraction": self.idle_fraction}
        if self.warnings:
            row["warnings"] = list(self.warnings)
        return row


def line(row: dict[str, Any]) -> str:
    """The progress line of a row."""
    policy = f"policy {row['policy']} | " if "policy" in row else ""
    return (f"step {row['step']} | {policy}version {row['version']} | reward {row['reward_mean']:.3f} | "
            f"staleness mean {row['staleness_mean']:.2f} max {row['staleness_max']} | "
            f"loss {row['loss']:+.4f} | is mean {row.get('is/mean', 1.0):.3f} | "
            f"kl {row.get('mismatch/kl_k3', 0.0):.2e} | samples {row['samples']} | "
            f"tokens/s {row['tokens_per_s']:.0f} | wait {row['wait_s']:.1f}s train {row['train_s']:.1f}s "
            f"sync {row['sync_s']:.1f}s")


class Reporter:
    """Rank 0's sinks of step reports (open them with :meth:`open`, before training)."""

    def __init__(self, cfg: LearnConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.metrics_path = run_dir / "learner.jsonl"
        self.history: list[dict[str, Any]] = []
        self.writers: list[Writer] = []
        self.server: MetricsServer | None = None
        self.signals = SignalWatch(cfg.no_signal_steps) if cfg.no_signal_steps else None

    def open(self) -> None:
        from agentrl.learner.metrics import make_writers, start_metrics_server

        self.run_dir.mkdir(parents=True, exist_ok=True)
        # a missing extra fails here, before training
        self.writers = make_writers(self.cfg, self.run_dir, asdict(self.cfg))
        self.server = start_metrics_server(self.cfg, self.run_dir)

    def signal_warnings(self, samples: Sequence[Sample], stats: dict[str, Any]) -> list[str]:
        """Warnings of batches without a learning signal (``no_signal_steps``), said as they come."""
        if self.signals is None:
            return []
        loss = self.cfg.loss
        distilled = loss.distill_coef > 0 or loss.distill_topk_coef > 0
        per_token = (distilled and stats.get("teacher_tokens", 0) > 0) or \
            stats.get("process_advantage_abs_mean", 0.0) > 0
        warned = self.signals.observe(list(samples), stats["advantage_std"], per_token) or []
        for w in warned:
            progress.warning("WARNING: %s", w)
        return list(warned)

    def report(self, report: StepReport) -> None:
        row = report.row()
        self.history.append(row)
        # a full disk skips the row whole (logged): the step itself stands
        append_line(self.metrics_path, json.dumps(row, default=str))
        if self.server is not None:
            self.server.update(row)
        if self.writers:
            from agentrl.learner.metrics import flatten

            flat = flatten({k: v for k, v in row.items() if k not in ("time", "step")})
            for w in self.writers:
                w.write(report.step, flat)
        progress.info(line(row))

    @staticmethod
    def not_trained(batch_id: str, stats: dict[str, Any], policy: str | None, version: int) -> None:
        ids = stats.get("offending_sample_ids", [])
        progress.warning("WARNING: batch %s not trained (%s): no update, %sversion stays %d%s", batch_id,
                         stats["skipped"], f"policy {policy}'s " if policy else "", version,
                         f"; samples: {', '.join(ids)}" if ids else "")

    def close(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()
