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
- A serve that does not answer (restarting) is waited for, up to ``batch_timeout_s``, for batches
  and acks alike (an ack is idempotent), instead of the learner dying with a trained batch.

Under ``torchrun`` the same loop runs on every rank with an FSDP2-sharded model
(``agentrl.learner.dist``); rank 0 alone talks to serve and broadcasts each batch, every rank
trains its share of the packed rows (``agentrl.learner.step``), and the full weights are gathered
to rank 0 for publishing: in host memory for the HTTP transport, on the GPU for NCCL (the weight
transport is ``weights.transport``; the source says which device it wants). Without torchrun it
is one plain process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentrl.errors import TransportError
from agentrl.learner.config import LearnConfig
from agentrl.learner.packing import pad_batch, token_logprobs
from agentrl.learner.signals import SignalWatch

__all__ = ["Learner", "learn", "pad_batch", "token_logprobs"]

log = logging.getLogger(__name__)
# one line per step, for people (the CLI shows this logger's messages as they are, without a prefix)
progress = logging.getLogger("agentrl.progress")

SERVE_CHECK_S = 30.0  # while no batch comes, ask serve's version at most this often
REMEMBER_TRAINED = 1 << 16  # trained sample ids kept while their ack is unconfirmed
RETRY_S = 2.0  # pause before asking a serve that did not answer again


class Learner:
    def __init__(self, cfg: LearnConfig, source: Any = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.version = 0
        self.metrics_path = self.run_dir / "learner.jsonl"
        self.source = source  # a BatchSource; None: serve's (rank 0 only)
        self.checkpoint_dir = Path(cfg.checkpoint_dir or self.run_dir / "checkpoints")
        # rank 0: ids of samples trained into the weights whose batch's ack was not confirmed
        self.trained: OrderedDict[str, None] = OrderedDict()
        self.guards: Counter[str] = Counter()
        self.publishes = False
        self._check_serve = False  # ask serve's version before the next pull

    # ------------------------------------------------------------------ the double-train guard (rank 0)

    def _remember(self, ids: Iterable[str]) -> None:
        for i in ids:
            self.trained[i] = None
            self.trained.move_to_end(i)
        while len(self.trained) > REMEMBER_TRAINED:
            self.trained.popitem(last=False)

    def _forget(self, ids: Iterable[str]) -> None:
        for i in ids:
            self.trained.pop(i, None)

    async def _pull(self, source: Any, since: float) -> tuple[Any, ...]:
        """The next batch with samples not trained yet: ("batch", id, samples, ids trained before);
        or ("republish",) when serve serves an older version than the learner's. Gives up
        ``batch_timeout_s`` after ``since`` (when the wait began, republishing included)."""
        cfg = self.cfg
        checked = time.monotonic()
        while True:
            if self.publishes and (self._check_serve or time.monotonic() - checked > SERVE_CHECK_S):
                self._check_serve, checked = False, time.monotonic()
                serving = int((await source.info()).get("version", 0))
                if serving < self.version:
                    log.warning("serve serves version %d, the learner is at %d (serve restarted?): publishing "
                                "the learner's weights again", serving, self.version)
                    return ("republish",)
            try:
                got = await source.get_batch(self.version)
            except TransportError as e:  # serve down (restarting?): ride it out, then ask its version
                if not e.retryable:
                    raise
                log.warning("no answer from serve for a batch (%s); waiting for it", e)
                self._check_serve = True  # info() waits for serve to answer
                await asyncio.sleep(RETRY_S)
                got = None
            if got is not None:
                batch_id, samples = got
                before = [s.sample_id for s in samples if s.sample_id in self.trained]
                if not before:
                    return ("batch", batch_id, samples, [])
                fresh = [s for s in samples if s.sample_id not in self.trained]
                self.guards["samples_trained_before"] += len(before)
                log.warning("batch %s: %d of its %d samples were trained before (their ack was lost); not "
                            "training them again", batch_id, len(before), len(samples))
                if fresh:
                    return ("batch", batch_id, fresh, before)
                acked = await self._ack(source, batch_id)
                self.guards["batches_trained_before"] += 1
                progress.warning("WARNING: batch %s held only samples trained before; acknowledged without a step "
                                 "(ack %s)", batch_id, acked)
                if acked:
                    self._forget(before)
                continue
            if time.monotonic() - since > cfg.batch_timeout_s:
                raise SystemExit(f"no batch from {cfg.serve} within {cfg.batch_timeout_s:.0f} s")

    async def _ack(self, source: Any, batch_id: str) -> bool:
        """``source.ack``, ridden out while serve does not answer (it is idempotent)."""
        return bool(await self._ride_out(f"ack of batch {batch_id}", lambda: source.ack(batch_id)))

    async def _ride_out(self, what: str, call: Any) -> Any:
        """``await call()``, tried again while serve does not answer, up to ``batch_timeout_s``: a
        learner rides out a serve outage (a restart) instead of dying. Only for idempotent calls."""
        deadline = time.monotonic() + self.cfg.batch_timeout_s
        while True:
            try:
                return await call()
            except TransportError as e:
                if not e.retryable or time.monotonic() > deadline:
                    raise
                log.warning("%s got no answer (%s); trying again", what, e)
                await asyncio.sleep(RETRY_S)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> list[dict[str, Any]]:
        import torch

        from agentrl.learner.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
        from agentrl.learner.dist import checkpoint_layout, full_state_dict, init_dist, load_model
        from agentrl.learner.step import build_state, train_step

        cfg = self.cfg
        # --- setup
        ctx = init_dist(timeout_s=cfg.batch_timeout_s + 600.0)
        torch.manual_seed(cfg.seed + ctx.rank)
        source = None
        metrics_server: Any = None
        writers: list[Any] = []
        if ctx.is_main:
            from dataclasses import asdict as to_dict

            from agentrl.learner.metrics import make_writers, start_metrics_server

            self.run_dir.mkdir(parents=True, exist_ok=True)
            writers = make_writers(cfg, self.run_dir, to_dict(cfg))  # a missing extra fails before training
            metrics_server = start_metrics_server(cfg, self.run_dir)
            if self.source is None:
                from agentrl.learner.source import ServeSource

                self.source = ServeSource(cfg)
            source = self.source
        history: list[dict[str, Any]] = []
        try:
            info = ctx.broadcast_object(await source.info() if source is not None else None)
            publishes, weights_device = ctx.broadcast_object(
                (bool(source.publishes), source.weights_device if source.publishes else "cpu")
                if source is not None else None)
            self.publishes = publishes
            if publishes and weights_device == "cuda" and ctx.device.type != "cuda":  # before any training
                raise SystemExit(f"agentrl learn: the weight transport (weights.transport.kind = "
                                 f"{cfg.weights.transport.kind!r}) publishes from a CUDA device, and this learner "
                                 f"runs on {ctx.device}: run it on a GPU, or set weights.transport.kind = \"http\"")
            model_path = cfg.model or info["model_path"]
            serving = int(info.get("version", 0))
            log.info("loading %s (serve at policy version %d, %d process(es))", model_path, serving, ctx.world)
            model = load_model(model_path, ctx, precision=cfg.precision,
                               activation_checkpointing=cfg.activation_checkpointing, lora=cfg.lora, seed=cfg.seed)
            state = build_state(cfg, model, ctx)
            adapter_only = cfg.weights.transport.kind == "adapter"

            async def publish(version: int) -> dict[str, Any]:
                """Gather the weights (collective) and have rank 0 publish them as ``version``: with
                LoRA, the adapter alone for the adapter transport, else the merged model."""
                if not publishes:
                    return {}
                full = await asyncio.to_thread(full_state_dict, model, ctx, on_device=weights_device != "cpu",
                                               trainable_only=adapter_only)
                if cfg.lora.enabled and not adapter_only:
                    from agentrl.learner.lora import merged_state

                    full = merged_state(full, cfg.lora) if full else full
                if not adapter_only:
                    full = checkpoint_layout(model, full)  # the names the engines load (MoE experts one by one)
                sync = await source.publish(full, version) if source is not None else {}
                del full
                return sync

            # --- resume
            held = 0  # the version whose weights the learner holds
            ckpt = latest_checkpoint(self.checkpoint_dir) if cfg.resume else None
            if cfg.resume and ckpt is None:
                log.warning("resume: no checkpoint in %s; starting fresh", self.checkpoint_dir)
            if ckpt is not None:
                resumed = load_checkpoint(state, ckpt)
                held = resumed.version
                self._remember(resumed.trained)
                if source is not None and resumed.batch_id:
                    acked = await self._ack(source, resumed.batch_id)
                    log.info("re-acked checkpointed batch %s: %s", resumed.batch_id, acked)
                    if not acked:  # the buffer forgot it: its samples come back, and are in these weights
                        self._remember(resumed.batch_samples)
            if source is not None:
                released = await self._ride_out("release of a previous learner's leases", source.release)
                if released:
                    log.info("released %d leased batch(es) of a previous learner", released)

            # --- bring serve to the learner's weights before the first pull
            if not publishes:
                self.version = max(serving, held)
            elif held == serving:
                self.version = held  # serve already serves these weights (its base ones at 0)
            else:
                # Serve restarted (older), or holds versions a dead learner published after its last
                # checkpoint, or another run's (newer): our weights get a number serve never had.
                self.version = held if held > serving else serving + 1
                log.info("publishing the learner's weights as version %d (serve is at %d)", self.version, serving)
                await publish(self.version)
                self.guards["republished"] += 1

            t_start = time.monotonic()
            wait_total = 0.0
            signals = SignalWatch(cfg.no_signal_steps) if cfg.no_signal_steps else None
            waiting_since: float | None = None
            while not cfg.steps or state.step < cfg.steps:
                # --- pull
                t0 = time.monotonic()
                waiting_since = waiting_since or t0
                got: Any = None
                if source is not None:
                    try:
                        got = await self._pull(source, waiting_since)
                    except BaseException as e:
                        ctx.broadcast_object(("stop", str(e)))  # let the other ranks leave too
                        raise
                got = ctx.broadcast_object(got)
                if got[0] == "stop":
                    raise SystemExit(f"rank 0 stopped: {got[1]}")
                if got[0] == "republish":
                    await publish(self.version)
                    self.guards["republished"] += 1
                    continue
                _, batch_id, samples, before = got
                waiting_since = None
                t_got = time.monotonic()
                wait_total += t_got - t0

                # --- step
                stats = await asyncio.to_thread(train_step, state, samples, cfg, self.version)

                # --- publish and checkpoint (only weights that changed get a version)
                t_pub = time.monotonic()
                sync: dict[str, Any] = {}
                if stats["updated"]:
                    self.version += 1
                    sync = await publish(self.version)
                    if sync.get("unreachable"):
                        self._check_serve = True  # the next pull waits for serve and compares versions
                else:
                    self.guards["steps_not_applied"] += 1
                    self.guards[f"not_applied_{stats['skipped']}"] += 1
                t_ckpt = time.monotonic()
                if stats["updated"] and cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                    await asyncio.to_thread(save_checkpoint, state, self.checkpoint_dir, version=self.version,
                                            batch_id=batch_id, keep=cfg.keep_checkpoints,
                                            batch_samples=[s.sample_id for s in samples], trained=list(self.trained))

                # --- ack
                acked = True
                if source is not None:
                    acked = await self._ack(source, batch_id)
                    if acked:
                        self._forget(before)
                    else:
                        self.guards["acks_rejected"] += 1
                        self._check_serve = True
                        if stats["updated"]:
                            self._remember(s.sample_id for s in samples)
                        progress.warning("WARNING: batch %s was not acknowledged (lease expired or serve restarted): "
                                         "its samples will come back and are not trained again", batch_id)

                # --- log
                if not ctx.is_main:
                    continue
                if not stats["updated"]:
                    ids = stats.get("offending_sample_ids", [])
                    progress.warning("WARNING: batch %s not trained (%s): no update, version stays %d%s", batch_id,
                                     stats["skipped"], self.version, f"; samples: {', '.join(ids)}" if ids else "")
                    continue
                now = time.monotonic()
                row = {"step": state.step, "version": self.version, "time": time.time(), **stats,
                       "world": ctx.world, "batch_id": batch_id, "acked": acked, "guards": dict(self.guards),
                       "wait_s": t_got - t0, "train_s": t_pub - t_got, "sync_s": t_ckpt - t_pub,
                       "checkpoint_s": now - t_ckpt, "idle_fraction": wait_total / max(1e-9, now - t_start),
                       "engine_sync": {k: v for k, v in sync.items() if k != "version"}}
                row["wait_fraction"] = row["idle_fraction"]
                distilled = cfg.loss.distill_coef > 0 or cfg.loss.distill_topk_coef > 0
                per_token = (distilled and stats.get("teacher_tokens", 0) > 0) or \
                    stats.get("process_advantage_abs_mean", 0.0) > 0
                if signals is not None and (warned := signals.observe(samples, stats["advantage_std"], per_token)):
                    row["warnings"] = warned
                    for w in warned:
                        progress.warning("WARNING: %s", w)
                history.append(row)
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
                if metrics_server is not None:
                    metrics_server.update(row)
                if writers:
                    from agentrl.learner.metrics import flatten

                    flat = flatten({k: v for k, v in row.items() if k not in ("time", "step")})
                    for w in writers:
                        w.write(state.step, flat)
                progress.info(self._line(row))
            if cfg.export_dir:
                await asyncio.to_thread(export_hf, model, ctx, model_path, cfg.export_dir, cfg.lora)
        finally:
            if source is not None:
                await source.close()
            for w in writers:
                w.close()
            if metrics_server is not None:
                metrics_server.close()
            ctx.close()
        return history

    @staticmethod
    def _line(row: dict[str, Any]) -> str:
        return (f"step {row['step']} | version {row['version']} | reward {row['reward_mean']:.3f} | "
                f"staleness mean {row['staleness_mean']:.2f} max {row['staleness_max']} | "
                f"loss {row['loss']:+.4f} | is mean {row.get('is/mean', 1.0):.3f} | "
                f"kl {row.get('mismatch/kl_k3', 0.0):.2e} | samples {row['samples']} | "
                f"tokens/s {row['tokens_per_s']:.0f} | wait {row['wait_s']:.1f}s train {row['train_s']:.1f}s "
                f"sync {row['sync_s']:.1f}s")


def learn(cfg: LearnConfig, source: Any = None) -> list[dict[str, Any]]:
    return asyncio.run(Learner(cfg, source).run())
