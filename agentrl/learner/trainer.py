"""``agentrl learn``: pull a batch, recompute logprobs, take an off-policy-corrected step, publish.

The loop never waits on a rollout barrier: it asks serve's buffer for a batch no older than
``max_staleness`` versions, trains on it, publishes the weights as version + 1 (engines load them
between two forward passes; in-flight requests continue), and only then acknowledges the batch, so
a learner killed mid-step has its batch served again. Per step it prints and logs (JSONL) the mean
reward, the policy version, the batch's staleness and the loss/importance-weight statistics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from agentrl.config import LearnConfig

log = logging.getLogger(__name__)


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any) -> Any:
    """log pi(token_t | tokens_<t) for t >= 1, shape [B, T-1] (fp32)."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def pad_batch(samples: list[Any], pad_id: int) -> dict[str, Any]:
    """Right-padded tensors; per-token fields shifted to align with next-token logprobs."""
    import torch

    width = max(len(s.token_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    behaviour = torch.zeros((b, width), dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behaviour[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        versions[i, :n] = torch.tensor(s.versions)
    # position t of the [B, T-1] logprob tensor predicts token t+1
    return {"input_ids": ids, "attention_mask": attn, "mask": mask[:, 1:], "behaviour": behaviour[:, 1:],
            "versions": versions[:, 1:]}


def micro_batches(samples: list[Any], max_tokens: int) -> list[list[int]]:
    """Indexes grouped so each group's padded size stays under ``max_tokens`` (longest first)."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].token_ids))
    groups: list[list[int]] = []
    for i in order:
        n = len(samples[i].token_ids)
        if groups and (len(groups[-1]) + 1) * len(samples[groups[-1][0]].token_ids) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    del n
    return groups


class Learner:
    def __init__(self, cfg: LearnConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.version = 0
        self.metrics_path = self.run_dir / "learner.jsonl"

    def _token(self) -> str:
        if self.cfg.admin_token:
            return self.cfg.admin_token
        if os.environ.get("AGENTRL_ADMIN_TOKEN"):
            return os.environ["AGENTRL_ADMIN_TOKEN"]
        p = self.run_dir / "admin_token"
        if p.exists():
            return p.read_text().strip()
        raise SystemExit("agentrl learn needs serve's admin token: set learn.admin_token, "
                         "$AGENTRL_ADMIN_TOKEN, or point learn.run_dir at serve's run directory")

    async def _serve_info(self, token: str) -> dict[str, Any]:
        import aiohttp

        deadline = time.monotonic() + self.cfg.batch_timeout_s
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            while True:
                try:
                    async with http.get(f"{self.cfg.serve}/admin/info", timeout=aiohttp.ClientTimeout(total=10)) as r:
                        if r.status == 200:
                            return await r.json()
                        raise SystemExit(f"serve at {self.cfg.serve} answered {r.status}: {await r.text()}")
                except (TimeoutError, aiohttp.ClientConnectionError):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"serve at {self.cfg.serve} did not answer") from None
                    log.info("waiting for serve at %s", self.cfg.serve)
                    await asyncio.sleep(2.0)

    async def run(self) -> list[dict[str, Any]]:
        import torch
        from transformers import AutoModelForCausalLM

        from agentrl.buffer import BufferClient

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        token = self._token()
        info = await self._serve_info(token)
        model_path = cfg.model or info["model_path"]
        self.version = int(info.get("version", 0))
        log.info("loading %s (policy version %d)", model_path, self.version)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model.train()
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        client = BufferClient(cfg.serve, token, timeout_s=60.0)
        history: list[dict[str, Any]] = []
        t_start = time.monotonic()
        wait_total = 0.0
        try:
            step = 0
            while not cfg.steps or step < cfg.steps:
                t0 = time.monotonic()
                batch = None
                while batch is None:
                    batch = await client.get_batch(self.version, cfg.max_staleness, cfg.batch_size, timeout_s=30.0)
                    if batch is None and time.monotonic() - t0 > cfg.batch_timeout_s:
                        raise SystemExit(f"no batch from {cfg.serve} within {cfg.batch_timeout_s:.0f} s")
                t_got = time.monotonic()
                wait_total += t_got - t0
                stats = await asyncio.to_thread(self._train_step, model, opt, batch.samples, pad_id)
                self.version += 1
                from agentrl.weights import publish, serialize_state_dict

                data = await asyncio.to_thread(serialize_state_dict, model.state_dict())
                t_pub = time.monotonic()
                sync = await publish(data, self.version, cfg.serve, token)
                await client.ack(batch.batch_id)
                step += 1
                now = time.monotonic()
                row = {"step": step, "version": self.version, "time": time.time(), **stats,
                       "wait_s": t_got - t0, "train_s": t_pub - t_got, "sync_s": now - t_pub,
                       "idle_fraction": wait_total / max(1e-9, now - t_start),
                       "engine_sync": {k: v for k, v in sync.items() if k != "version"}}
                history.append(row)
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
                print(f"step {step} | version {self.version} | reward {row['reward_mean']:.3f} | "
                      f"staleness mean {row['staleness_mean']:.2f} max {row['staleness_max']} | "
                      f"loss {row['loss']:+.4f} | samples {row['samples']} | tokens/s {row['tokens_per_s']:.0f} | "
                      f"wait {row['wait_s']:.1f}s train {row['train_s']:.1f}s sync {row['sync_s']:.1f}s", flush=True)
        finally:
            await client.close()
        return history

    def _train_step(self, model: Any, opt: Any, samples: list[Any], pad_id: int) -> dict[str, Any]:
        import torch

        from agentrl.learner.losses import compute_loss, group_advantages

        cfg = self.cfg
        t0 = time.monotonic()
        staleness = [self.version - s.min_version for s in samples if s.min_version >= 0]
        usable = [s for s in samples if s.error is None and s.token_ids and any(s.loss_mask)]
        rewards = torch.tensor([s.reward for s in usable], dtype=torch.float32)
        adv = group_advantages(rewards, [s.group_id for s in usable]) if usable else rewards
        total_tokens = sum(sum(s.loss_mask) for s in usable)
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        agg: dict[str, float] = {}
        for idx in micro_batches(usable, cfg.micro_batch_tokens):
            mb = [usable[i] for i in idx]
            t = pad_batch(mb, pad_id)
            logp = token_logprobs(model, t["input_ids"], t["attention_mask"])
            loss, st = compute_loss(cfg.loss, cfg.correction, logp=logp, logp_behaviour=t["behaviour"],
                                    advantages=adv[idx], mask=t["mask"], tis_cap=cfg.tis_cap,
                                    denominator=float(max(1, total_tokens)))
            loss.backward()
            loss_sum += float(loss)
            w = float(t["mask"].sum()) / max(1, total_tokens)
            for k, v in st.items():
                agg[k] = agg.get(k, 0.0) + w * float(v)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)) if usable else 0.0
        if usable:
            opt.step()
        seconds = time.monotonic() - t0
        return {
            "loss": loss_sum, "grad_norm": grad_norm, "samples": len(samples), "trained_samples": len(usable),
            "failed_samples": sum(s.error is not None for s in samples),
            "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
            "advantage_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
            "staleness_mean": sum(staleness) / max(1, len(staleness)), "staleness_max": max(staleness, default=0),
            "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
            "tokens": total_tokens, "tokens_per_s": total_tokens / max(1e-9, seconds), **agg,
        }


def learn(cfg: LearnConfig) -> list[dict[str, Any]]:
    return asyncio.run(Learner(cfg).run())
