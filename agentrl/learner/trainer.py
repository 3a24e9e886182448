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

Several named policies on one base model (serve's info lists ``policies``): one LoRA adapter,
optimizer, version and batch stream each; the loop asks them in turn (one with no batch ready is
passed over), trains the batch's policy with its adapter alone active, publishes that adapter
alone as the policy's next version, and checkpoints them all together (docs/learner.md, *Several
policies on one base model*).

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
from collections.abc import Iterable, Sequence
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
EMPTY_ROUND_S = 0.05  # several policies, none with a batch ready: pause before asking them all again


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
        # several named policies on one base (serve's info names them): each one's version, and
        # which policy the next pull asks first (round robin)
        self.versions: dict[str, int] = {}
        self._turn = 0

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

    def _version_of(self, policy: str | None) -> int:
        return self.version if policy is None else self.versions[policy]

    async def _older_on_serve(self, source: Any, names: list[str]) -> tuple[Any, ...] | None:
        """("republish", policy) when serve serves an older version of a policy than the learner's
        (policy None: the one policy of a single-policy run); None when it does not."""
        info = await source.info()
        served = {None: info} if not names else (info.get("policies") or {})
        for name in names or [None]:
            serving, ours = int(served.get(name, {}).get("version", 0)), self._version_of(name)
            if serving < ours:
                log.warning("serve serves %sversion %d, the learner is at %d (serve restarted?): publishing the "
                            "learner's weights again", f"policy {name} at " if name else "", serving, ours)
                return ("republish", name)
        return None

    async def _pull(self, source: Any, since: float, names: Sequence[str] = ()) -> tuple[Any, ...]:
        """The next batch with samples not trained yet: ("batch", id, samples, ids trained before,
        policy); or ("republish", policy) when serve serves an older version than the learner's.
        ``names``: several policies, asked in turn, each for a batch at its own version (a policy with
        nothing ready is passed over); none: one policy (None). Gives up ``batch_timeout_s`` after
        ``since`` (when the wait began, republishing included)."""
        cfg = self.cfg
        checked = time.monotonic()
        while True:
            if self.publishes and (self._check_serve or time.monotonic() - checked > SERVE_CHECK_S):
                self._check_serve, checked = False, time.monotonic()
                if (older := await self._older_on_serve(source, list(names))) is not None:
                    return older
            got, name = None, None
            order: list[str | None] = [*names[self._turn:], *names[:self._turn]] if names else [None]
            for name in order:
                try:
                    got = await (source.get_batch(self.version) if name is None
                                 else source.get_batch(self.versions[name], policy=name))
                except TransportError as e:  # serve down (restarting?): ride it out, then ask its version
                    if not e.retryable:
                        raise
                    log.warning("no answer from serve for a batch (%s); waiting for it", e)
                    self._check_serve = True  # info() waits for serve to answer
                    await asyncio.sleep(RETRY_S)
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
                    return ("batch", batch_id, samples, [], name)
                fresh = [s for s in samples if s.sample_id not in self.trained]
                self.guards["samples_trained_before"] += len(before)
                log.warning("batch %s: %d of its %d samples were trained before (their ack was lost); not "
                            "training them again", batch_id, len(before), len(samples))
                if fresh:
                    return ("batch", batch_id, fresh, before, name)
                acked = await self._ack(source, batch_id)
                self.guards["batches_trained_before"] += 1
                progress.warning("WARNING: batch %s held only samples trained before; acknowledged without a step "
                                 "(ack %s)", batch_id, acked)
                if acked:
                    self._forget(before)
                continue
            if names:
                await asyncio.sleep(EMPTY_ROUND_S)
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

        from agentrl.learner.heap import map_large_blocks

        map_large_blocks()  # freed activations go back to the system (agentrl/learner/heap.py)

        from agentrl.learner.checkpoint import (
            export_hf,
            latest_checkpoint,
            load_checkpoint,
            load_policies,
            save_checkpoint,
            save_policies,
        )
        from agentrl.learner.dist import checkpoint_layout, full_state_dict, init_dist, load_model
        from agentrl.learner.lora import activate, of_adapter
        from agentrl.learner.step import TrainState, build_state, train_step

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
            # several named policies on one base: one adapter, optimizer and version each
            names = list(info.get("policies") or {})
            if names:
                self._check_policies(names, publishes)
            log.info("loading %s (serve at policy version %d, %d process(es))", model_path, serving, ctx.world)
            model = load_model(model_path, ctx, precision=cfg.precision,
                               activation_checkpointing=cfg.activation_checkpointing, lora=cfg.lora, seed=cfg.seed,
                               adapters=names)
            states: dict[str | None, TrainState]
            if names:  # each optimizer over its own adapter's parameters alone
                states = {n: build_state(cfg, model, ctx, params=[p for k, p in model.named_parameters()
                                                                   if of_adapter(k, n)]) for n in names}
            else:
                states = {None: build_state(cfg, model, ctx)}
            state = next(iter(states.values()))

            def steps_done() -> int:  # every policy's steps together (cfg.steps counts these)
                return sum(s.step for s in states.values())

            adapter_only = cfg.weights.transport.kind == "adapter"

            async def publish(version: int, policy: str | None = None) -> dict[str, Any]:
                """Gather the weights (collective) and have rank 0 publish them as ``version``: with
                LoRA, the adapter alone for the adapter transport, else the merged model; with several
                policies, ``policy``'s adapter alone."""
                if not publishes:
                    return {}
                full = await asyncio.to_thread(full_state_dict, model, ctx, on_device=weights_device != "cpu",
                                               trainable_only=adapter_only)
                if policy is not None:
                    mine = {k: v for k, v in full.items() if of_adapter(k, policy)}
                    del full
                    return await source.publish(mine, version, policy=policy) if source is not None else {}
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
            held_by: dict[str, int] = {}  # the same, per policy
            ckpt = latest_checkpoint(self.checkpoint_dir) if cfg.resume else None
            if cfg.resume and ckpt is None:
                log.warning("resume: no checkpoint in %s; starting fresh", self.checkpoint_dir)
            if ckpt is not None:
                if names:
                    resumed, held_by = load_policies(states, ckpt)  # type: ignore[arg-type]
                    if resumed.next_policy in names:  # the turns go on where they were
                        self._turn = names.index(resumed.next_policy)
                else:
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
            if not names:
                self.version, stale = self._start_version(held, serving, publishes)
                if stale:
                    log.info("publishing the learner's weights as version %d (serve is at %d)", self.version, serving)
                    await publish(self.version)
                    self.guards["republished"] += 1
            for name in names:
                served = int(info["policies"][name].get("version", 0))
                self.versions[name], stale = self._start_version(held_by.get(name, 0), served, publishes)
                if stale:
                    log.info("publishing policy %s's adapter as version %d (serve is at %d)", name,
                             self.versions[name], served)
                    await publish(self.versions[name], name)
                    self.guards["republished"] += 1

            t_start = time.monotonic()
            wait_total = 0.0
            signals = SignalWatch(cfg.no_signal_steps) if cfg.no_signal_steps else None
            waiting_since: float | None = None
            while not cfg.steps or steps_done() < cfg.steps:
                # --- pull
                t0 = time.monotonic()
                waiting_since = waiting_since or t0
                got: Any = None
                if source is not None:
                    try:
                        got = await self._pull(source, waiting_since, names)
                    except BaseException as e:
                        ctx.broadcast_object(("stop", str(e)))  # let the other ranks leave too
                        raise
                got = ctx.broadcast_object(got)
                if got[0] == "stop":
                    raise SystemExit(f"rank 0 stopped: {got[1]}")
                if got[0] == "republish":
                    await publish(self._version_of(got[1]), got[1])
                    self.guards["republished"] += 1
                    continue
                _, batch_id, samples, before, name = got
                waiting_since = None
                t_got = time.monotonic()
                wait_total += t_got - t0

                # --- step (with several policies: this batch's policy's adapter alone active, and its optimizer)
                state = states[name]
                if name is not None:
                    activate(model, name)
                    # the gradients of another policy's last step are still there (a step clears its own
                    # optimizer's at its start): they would count in this step's norm and clipping
                    model.zero_grad(set_to_none=True)
                stats = await asyncio.to_thread(train_step, state, samples, cfg, self._version_of(name))

                # --- publish and checkpoint (only weights that changed get a version)
                t_pub = time.monotonic()
                sync: dict[str, Any] = {}
                if stats["updated"]:
                    if name is None:
                        self.version += 1
                    else:
                        self.versions[name] += 1
                    sync = await publish(self._version_of(name), name)
                    if sync.get("unreachable"):
                        self._check_serve = True  # the next pull waits for serve and compares versions
                else:
                    self.guards["steps_not_applied"] += 1
                    self.guards[f"not_applied_{stats['skipped']}"] += 1
                t_ckpt = time.monotonic()
                if stats["updated"] and cfg.checkpoint_every and steps_done() % cfg.checkpoint_every == 0:
                    if names:
                        await asyncio.to_thread(save_policies, states, self.checkpoint_dir,  # type: ignore[arg-type]
                                                versions=dict(self.versions), batch_id=batch_id,
                                                keep=cfg.keep_checkpoints, batch_samples=[s.sample_id for s in samples],
                                                trained=list(self.trained), next_policy=names[self._turn])
                    else:
                        await asyncio.to_thread(save_checkpoint, state, self.checkpoint_dir, version=self.version,
                                                batch_id=batch_id, keep=cfg.keep_checkpoints,
                                                batch_samples=[s.sample_id for s in samples],
                                                trained=list(self.trained))

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
                    progress.warning("WARNING: batch %s not trained (%s): no update, %sversion stays %d%s", batch_id,
                                     stats["skipped"], f"policy {name}'s " if name else "", self._version_of(name),
                                     f"; samples: {', '.join(ids)}" if ids else "")
                    continue
                now = time.monotonic()
                policy = {"policy": name, "policy_step": state.step} if name is not None else {}
                row = {"step": steps_done(), **policy, "version": self._version_of(name), "time": time.time(), **stats,
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
                        w.write(steps_done(), flat)
                progress.info(self._line(row))
            if cfg.export_dir:
                await asyncio.to_thread(export_hf, model, ctx, model_path, cfg.export_dir, cfg.lora, names)
        finally:
            if source is not None:
                await source.close()
            for w in writers:
                w.close()
            if metrics_server is not None:
                metrics_server.close()
            ctx.close()
        return history

    def _check_policies(self, names: list[str], publishes: bool) -> None:
        """Several policies on one base train one LoRA adapter each, sent by the adapter transport."""
        cfg = self.cfg
        if not cfg.lora.enabled:
            raise SystemExit(f"agentrl learn: serve has several policies ({', '.join(names)}), each trained as its own "
                             f"LoRA adapter on one base model: set learn.lora.rank > 0")
        if publishes and cfg.weights.transport.kind != "adapter":
            raise SystemExit(f"agentrl learn: serve has several policies ({', '.join(names)}); each is published as "
                             f"its adapter alone: set weights.transport.kind = \"adapter\" (it is "
                             f"{cfg.weights.transport.kind!r})")

    @staticmethod
    def _start_version(held: int, serving: int, publishes: bool) -> tuple[int, bool]:
        """The version the learner's weights (``held``, those of its checkpoint, 0 for fresh ones) go
        by when serve is at ``serving``, and whether they must be published before the first pull."""
        if not publishes:
            return max(serving, held), False
        if held == serving:
            return held, False  # serve already serves these weights (its base ones at 0)
        # Serve restarted (older), or holds versions a dead learner published after its last
        # checkpoint, or another run's (newer): our weights get a number serve never had.
        return (held if held > serving else serving + 1), True

    @staticmethod
    def _line(row: dict[str, Any]) -> str:
        policy = f"policy {row['policy']} | " if "policy" in row else ""
        return (f"step {row['step']} | {policy}version {row['version']} | reward {row['reward_mean']:.3f} | "
                f"staleness mean {row['staleness_mean']:.2f} max {row['staleness_max']} | "
                f"loss {row['loss']:+.4f} | is mean {row.get('is/mean', 1.0):.3f} | "
                f"kl {row.get('mismatch/kl_k3', 0.0):.2e} | samples {row['samples']} | "
                f"tokens/s {row['tokens_per_s']:.0f} | wait {row['wait_s']:.1f}s train {row['train_s']:.1f}s "
                f"sync {row['sync_s']:.1f}s")


def learn(cfg: LearnConfig, source: Any = None) -> list[dict[str, Any]]:
    return asyncio.run(Learner(cfg, source).run())
