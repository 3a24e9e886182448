"""``agentrl learn``: pull a batch, recompute logprobs, take an off-policy-corrected step, publish.

The loop never waits on a rollout barrier: it asks serve's buffer for a batch no older than
``max_staleness`` versions, trains on it, publishes the weights as version + 1 (engines load them
between two forward passes; in-flight requests continue), checkpoints when due, and only then
acknowledges the batch, so a learner killed mid-step has its batch served again. Per step it
prints one line and appends a JSON row to ``learner.jsonl`` (reward, version, staleness, loss,
importance weights, mismatch KL, tokens/s, wait fraction); the same numbers are served at the
learner's Prometheus ``/metrics`` and, when enabled, written to TensorBoard / W&B
(:mod:`agentrl.learner.metrics`).

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
from pathlib import Path
from typing import Any

from agentrl.learner.config import LearnConfig
from agentrl.learner.packing import pad_batch, token_logprobs
from agentrl.learner.signals import SignalWatch

__all__ = ["Learner", "learn", "pad_batch", "token_logprobs"]

log = logging.getLogger(__name__)
# one line per step, for people (the CLI shows this logger's messages as they are, without a prefix)
progress = logging.getLogger("agentrl.progress")


class Learner:
    def __init__(self, cfg: LearnConfig, source: Any = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.version = 0
        self.metrics_path = self.run_dir / "learner.jsonl"
        self.source = source  # a BatchSource; None: serve's (rank 0 only)
        self.checkpoint_dir = Path(cfg.checkpoint_dir or self.run_dir / "checkpoints")

    async def _pull(self, source: Any) -> tuple[str, list[Any]]:
        cfg = self.cfg
        t0 = time.monotonic()
        while True:
            got = await source.get_batch(self.version)
            if got is not None:
                return got
            if time.monotonic() - t0 > cfg.batch_timeout_s:
                raise SystemExit(f"no batch from {cfg.serve} within {cfg.batch_timeout_s:.0f} s")

    async def run(self) -> list[dict[str, Any]]:
        import torch

        from agentrl.learner.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
        from agentrl.learner.dist import full_state_dict, init_dist, load_model
        from agentrl.learner.step import build_state, train_step

        cfg = self.cfg
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
            if publishes and weights_device == "cuda" and ctx.device.type != "cuda":  # before any training
                raise SystemExit(f"agentrl learn: the weight transport (weights.transport.kind = "
                                 f"{cfg.weights.transport.kind!r}) publishes from a CUDA device, and this learner "
                                 f"runs on {ctx.device}: run it on a GPU, or set weights.transport.kind = \"http\"")
            model_path = cfg.model or info["model_path"]
            self.version = int(info.get("version", 0))
            log.info("loading %s (policy version %d, %d process(es))", model_path, self.version, ctx.world)
            model = load_model(model_path, ctx, precision=cfg.precision,
                               activation_checkpointing=cfg.activation_checkpointing)
            state = build_state(cfg, model, ctx)
            ckpt = latest_checkpoint(self.checkpoint_dir) if cfg.resume else None
            if cfg.resume and ckpt is None:
                log.warning("resume: no checkpoint in %s; starting fresh", self.checkpoint_dir)
            if ckpt is not None:
                resumed = load_checkpoint(state, ckpt)
                # serve may already hold a newer version from the run that died: never reuse a number
                self.version = max(self.version, resumed.version)
                if source is not None and resumed.batch_id:
                    acked = await source.ack(resumed.batch_id)
                    log.info("re-acked checkpointed batch %s: %s", resumed.batch_id, acked)
            if source is not None:
                released = await source.release()
                if released:
                    log.info("released %d leased batch(es) of a previous learner", released)
            t_start = time.monotonic()
            wait_total = 0.0
            signals = SignalWatch(cfg.no_signal_steps) if cfg.no_signal_steps else None
            while not cfg.steps or state.step < cfg.steps:
                t0 = time.monotonic()
                got: Any = None
                if source is not None:
                    try:
                        got = await self._pull(source)
                    except BaseException as e:
                        ctx.broadcast_object(("stop", str(e)))  # let the other ranks leave too
                        raise
                got = ctx.broadcast_object(got)
                if isinstance(got, tuple) and got and got[0] == "stop":
                    raise SystemExit(f"rank 0 stopped: {got[1]}")
                batch_id, samples = got
                t_got = time.monotonic()
                wait_total += t_got - t0
                stats = await asyncio.to_thread(train_step, state, samples, cfg, self.version)
                self.version += 1
                t_pub = time.monotonic()
                sync: dict[str, Any] = {}
                if publishes:
                    full = await asyncio.to_thread(full_state_dict, model, ctx, on_device=weights_device != "cpu")
                    if source is not None:
                        sync = await source.publish(full, self.version)
                    del full
                t_ckpt = time.monotonic()
                if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                    await asyncio.to_thread(save_checkpoint, state, self.checkpoint_dir, version=self.version,
                                            batch_id=batch_id, keep=cfg.keep_checkpoints)
                if source is not None:
                    await source.ack(batch_id)
                now = time.monotonic()
                if ctx.is_main:
                    row = {"step": state.step, "version": self.version, "time": time.time(), **stats,
                           "world": ctx.world, "batch_id": batch_id,
                           "wait_s": t_got - t0, "train_s": t_pub - t_got, "sync_s": t_ckpt - t_pub,
                           "checkpoint_s": now - t_ckpt, "idle_fraction": wait_total / max(1e-9, now - t_start),
                           "engine_sync": {k: v for k, v in sync.items() if k != "version"}}
                    row["wait_fraction"] = row["idle_fraction"]
                    if signals is not None and (warned := signals.observe(samples, stats["advantage_std"])):
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
                await asyncio.to_thread(export_hf, model, ctx, model_path, cfg.export_dir)
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
