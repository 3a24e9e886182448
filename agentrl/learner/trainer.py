"""``agentrl learn``: pull a batch, recompute logprobs, take an off-policy-corrected step, publish.

The loop never waits on a rollout barrier: it asks serve's buffer for a batch no older than
``max_staleness`` versions, trains on it, publishes the weights as version + 1 (engines load them
between two forward passes; in-flight requests continue), checkpoints when due, and only then
acknowledges the batch, so a learner killed mid-step has its batch served again. Per step it
prints one line and appends a JSON row to ``learner.jsonl`` (reward, version, staleness, loss,
importance weights, mismatch KL, tokens/s, wait fraction); the same numbers are served at the
learner's Prometheus ``/metrics`` and, when enabled, written to TensorBoard / W&B
(:mod:`agentrl.learner.metrics`).

Guards, so that no batch is trained wrong (docs/learner.md):
- A batch is trained at most once. An ack that answers False (the buffer forgot the batch: serve
  restarted, or the lease expired) means its samples will be served again in another batch: the
  learner remembers the ids it trained (in memory and in each checkpoint) and skips them when
  they come back; a batch of nothing but such samples is acknowledged without a step.
- Serve's engines serve the learner's weights: on start and on resume the learner publishes its
  weights when serve's version is not theirs, and whenever serve reports an older version than
  the learner's (a serve that restarted came back with its base weights at version 0) it
  publishes its current weights again before pulling on, so it never waits for samples that are
  all too stale.
- A step that did not update the weights (a non-finite loss or gradient norm, nothing to train)
  publishes nothing and does not advance the version; it is counted (``guards`` in each row)
  and logged with the offending samples' ids, and its batch is acknowledged.
- A serve that does not answer (restarting, cut off) is waited for, up to ``batch_timeout_s`` (0:
  for ever), for batches and acks alike (an ack is idempotent), instead of the learner dying with a
  trained batch; the other ranks hear from rank 0 meanwhile (:meth:`BatchFeed.share`).

Several named policies on one base model (serve's info lists ``policies``): one LoRA adapter,
optimizer, version and batch stream each; the loop asks them in turn (one with no batch ready is
passed over), trains the batch's policy with its adapter alone active, publishes that adapter
alone as the policy's next version, and checkpoints them all together (docs/learner.md, *Several
policies on one base model*).

The loop reads as stages, each its own object with a typed input and output: pull
(:class:`~agentrl.learner.feed.BatchFeed` answers a ``Batch`` or a ``Republish``), train
(:func:`~agentrl.learner.step.train_step`), publish, checkpoint (the
:class:`~agentrl.learner.policies.PolicySet`), ack (the feed), report
(:class:`~agentrl.learner.report.StepReport`); one policy is a set of one, so the loop has no branch
on named policies. Setup (model, policy set), resume and the start-version handshake are methods of
their own.

Under ``torchrun`` the same loop runs on every rank with an FSDP2-sharded model
(``agentrl.learner.dist``); rank 0 alone talks to serve and broadcasts each batch, every rank
trains its share of the packed rows (``agentrl.learner.step``), and the full weights are gathered
to rank 0 for publishing: in host memory for the HTTP transport, on the GPU for NCCL (the weight
transport is ``weights.transport``; the source says which device it wants). Without torchrun it
is one plain process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.learner.config import LearnConfig
from agentrl.learner.feed import HEARTBEAT_S, RETRY_S, Batch, BatchFeed, Republish
from agentrl.learner.packing import pad_batch, token_logprobs
from agentrl.learner.report import Reporter, StepReport

if TYPE_CHECKING:
    from agentrl.learner.dist import Dist
    from agentrl.learner.policies import PolicySet
    from agentrl.learner.source import BatchSource

__all__ = ["RETRY_S", "Learner", "learn", "pad_batch", "token_logprobs"]

log = logging.getLogger(__name__)
progress = logging.getLogger("agentrl.progress")


class Learner:
    def __init__(self, cfg: LearnConfig, source: BatchSource | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.source = source  # None: serve's (rank 0 only)
        self.checkpoint_dir = Path(cfg.checkpoint_dir or self.run_dir / "checkpoints")
        self.guards: Counter[str] = Counter()
        self.reporter = Reporter(cfg, self.run_dir)
        self.feed: BatchFeed | None = None

    @property
    def metrics_path(self) -> Path:
        return self.reporter.metrics_path

    @property
    def trained(self) -> OrderedDict[str, None]:
        """Rank 0: ids of samples trained into the weights whose batch's ack was not confirmed."""
        return self.feed.trained if self.feed is not None else OrderedDict()

    async def run(self) -> list[dict[str, Any]]:
        import torch

        from agentrl.learner.dist import init_dist
        from agentrl.learner.heap import map_large_blocks

        map_large_blocks()  # freed activations go back to the system (agentrl/learner/heap.py)
        cfg = self.cfg
        # rank 0's waits on serve send the others a heartbeat (BatchFeed.share): the timeout bounds
        # a step, a publish or a checkpoint, and catches a rank that hangs
        ctx = init_dist(timeout_s=cfg.dist_timeout_s)
        torch.manual_seed(cfg.seed + ctx.rank)
        source = None
        if ctx.is_main:
            self.reporter.open()
            if self.source is None:
                from agentrl.learner.source import ServeSource

                self.source = ServeSource(cfg)
            source = self.source
        # RETRY_S read here, so that a test can shorten the pause before asking serve again
        feed = self.feed = BatchFeed(cfg, ctx, source, self.guards, retry_s=RETRY_S,
                                     heartbeat_s=min(HEARTBEAT_S, cfg.dist_timeout_s / 4))
        try:
            info, model_path, policies = await self._setup(ctx, feed)
            feed.policies = policies
            await self._resume(policies, feed)
            await self._meet_serve(policies, info)
            await self._train(ctx, policies, feed)
            if cfg.export_dir:
                await asyncio.to_thread(policies.export, model_path, cfg.export_dir)
        finally:
            if source is not None:
                await source.close()
            self.reporter.close()
            ctx.close()
        return self.reporter.history

    # ------------------------------------------------------------------ setup, resume, handshake

    async def _setup(self, ctx: Dist, feed: BatchFeed) -> tuple[dict[str, Any], str, PolicySet]:
        """Serve's info, the model path, and the policy set serve's info asks for, on every rank."""
        from agentrl.learner.dist import load_model
        from agentrl.learner.policies import build_policies, check_policies

        cfg, source = self.cfg, feed.source
        info = await feed.share(None if source is None else source.info)
        publishes, weights_device = ctx.broadcast_object(
            (bool(source.publishes), source.weights_device if source.publishes else "cpu")
            if source is not None else None)
        if publishes and weights_device == "cuda" and ctx.device.type != "cuda":  # before any training
            raise SystemExit(f"agentrl learn: the weight transport (weights.transport.kind = "
                             f"{cfg.weights.transport.kind!r}) publishes from a CUDA device, and this "
                             f"learner runs on {ctx.device}: run it on a GPU, or set "
                             f"weights.transport.kind = \"http\"")
        model_path = cfg.model or info["model_path"]
        serving = int(info.get("version", 0))
        # several named policies on one base: one adapter, optimizer and version each
        names = list(info.get("policies") or {})
        if names:
            check_policies(cfg, names, publishes)
        log.info("loading %s (serve at policy version %d, %d process(es))", model_path, serving, ctx.world)
        model = load_model(model_path, ctx, precision=cfg.precision,
                           activation_checkpointing=cfg.activation_checkpointing, lora=cfg.lora,
                           seed=cfg.seed, adapters=names)
        policies = build_policies(cfg, model, ctx, names, source=source, publishes=publishes,
                                  weights_device=weights_device)
        return info, model_path, policies

    async def _resume(self, policies: PolicySet, feed: BatchFeed) -> None:
        """The latest checkpoint's weights, optimizers and batch bookkeeping (with ``resume``), then
        every lease of a previous learner released."""
        from agentrl.learner.checkpoint import latest_checkpoint

        cfg = self.cfg
        ckpt = latest_checkpoint(self.checkpoint_dir) if cfg.resume else None
        if cfg.resume and ckpt is None:
            log.warning("resume: no checkpoint in %s; starting fresh", self.checkpoint_dir)
        if ckpt is not None:
            await feed.resume(policies.load(ckpt))
        await feed.release()

    async def _meet_serve(self, policies: PolicySet, info: dict[str, Any]) -> None:
        """Each policy's start version; its weights published before the first pull where serve's
        version is not theirs (collective)."""
        served = policies.served(info)
        for policy in policies:
            policy.version, stale = start_version(policy.held, served[policy.name], policies.publishes)
            if stale:
                log.info("publishing %s as version %d (serve is at %d)", policy.weights, policy.version,
                         served[policy.name])
                await policies.publish(policy)
                self.guards["republished"] += 1

    # ------------------------------------------------------------------ the loop

    async def _train(self, ctx: Dist, policies: PolicySet, feed: BatchFeed) -> None:
        """Pull -> train -> publish -> checkpoint -> ack -> report, until ``steps`` steps were taken
        or ``max_minutes`` of training have passed."""
        from agentrl.learner.step import train_step

        cfg, guards = self.cfg, self.guards
        t_start = time.monotonic()
        wait_total = 0.0
        waiting_since: float | None = None
        more = self._more(ctx, policies, t_start)
        while more:
            # --- pull
            t0 = time.monotonic()
            waiting_since = waiting_since or t0
            got: Batch | Republish = await feed.next(waiting_since)
            if isinstance(got, Republish):
                await policies.publish(policies.of(got.policy))
                guards["republished"] += 1
                continue
            waiting_since = None
            t_got = time.monotonic()
            wait_total += t_got - t0
            policy = policies.of(got.policy)

            # --- train (the batch's policy alone active, with its optimizer)
            policies.activate(policy)
            stats = await asyncio.to_thread(train_step, policy.state, got.samples, cfg, policy.version)
            updated = bool(stats["updated"])

            # --- publish (only weights that changed get a version)
            t_pub = time.monotonic()
            sync: dict[str, Any] = {}
            if updated:
                policy.version += 1
                sync = await policies.publish(policy)
                if sync.get("unreachable"):
                    feed.check_serve()  # the next pull waits for serve and compares versions
            else:
                guards["steps_not_applied"] += 1
                guards[f"not_applied_{stats['skipped']}"] += 1

            # --- checkpoint
            t_ckpt = time.monotonic()
            if updated and cfg.checkpoint_every and policies.steps_done() % cfg.checkpoint_every == 0:
                await asyncio.to_thread(policies.save, self.checkpoint_dir, batch_id=got.batch_id,
                                        keep=cfg.keep_checkpoints, batch_samples=got.sample_ids,
                                        trained=list(feed.trained), next_policy=feed.next_policy)

            # --- ack
            more = self._more(ctx, policies, t_start)
            acked = await feed.ack(got, updated, more=more)

            # --- report
            if not ctx.is_main:
                continue
            if not updated:
                self.reporter.not_trained(got.batch_id, stats, policy.name, policy.version)
                continue
            now = time.monotonic()
            self.reporter.report(StepReport(
                step=policies.steps_done(), policy=policy.name, policy_step=policy.state.step,
                version=policy.version, time=time.time(), stats=stats, world=ctx.world, batch_id=got.batch_id,
                acked=acked, guards=dict(guards), wait_s=t_got - t0, train_s=t_pub - t_got,
                sync_s=t_ckpt - t_pub, checkpoint_s=now - t_ckpt,
                idle_fraction=wait_total / max(1e-9, now - t_start),
                engine_sync={k: v for k, v in sync.items() if k != "version"},
                warnings=self.reporter.signal_warnings(got.samples, stats)))

    def _more(self, ctx: Dist, policies: PolicySet, t_start: float) -> bool:
        """Whether another step follows: fewer than ``steps`` taken and, with ``max_minutes``, time
        left (rank 0's clock decides for every rank)."""
        cfg = self.cfg
        more = not cfg.steps or policies.steps_done() < cfg.steps
        if cfg.max_minutes:
            minutes = (time.monotonic() - t_start) / 60
            more = ctx.broadcast_object(more and minutes < cfg.max_minutes)
            if not more and ctx.is_main and minutes >= cfg.max_minutes:
                progress.info("learn.max_minutes: %.1f minutes of training have passed; stopping after "
                              "%d steps", minutes, policies.steps_done())
        return more


def start_version(held: int, serving: int, publishes: bool) -> tuple[int, bool]:
    """The version the learner's weights (``held``, those of its checkpoint, 0 for fresh ones) go
    by when serve is at ``serving``, and whether they must be published before the first pull."""
    if not publishes:
        return max(serving, held), False
    if held == serving:
        return held, False  # serve already serves these weights (its base ones at 0)
    # Serve restarted (older), or holds versions a dead learner published after its last
    # checkpoint, or another run's (newer): our weights get a number serve never had.
    return (held if held > serving else serving + 1), True


def learn(cfg: LearnConfig, source: BatchSource | None = None) -> list[dict[str, Any]]:
    return asyncio.run(Learner(cfg, source).run())
