"""One optimizer step on a given list of samples: the learner's math, apart from any I/O.

Role: advantages, packed micro-batches, logprob recomputation, the off-policy-corrected loss,
gradient clipping and the AdamW + schedule step. ``train_step`` takes samples and returns
statistics; it never talks to serve, so tests and benchmarks drive it on fixed batches.

Invariants:
- Every rank receives the whole batch and computes the same advantages and the same packed rows;
  rank r trains rows r, r + world, ... A rank with fewer rows runs a zero-weight dummy pass so
  all ranks make the same FSDP collectives.
- The loss normaliser is the global count of trained tokens of the batch (``denominator``), so
  the summed loss and gradient are the same for any world size and any micro-batching. FSDP
  averages gradients over ranks; each rank's loss is scaled by ``world`` to undo that.
- Reported loss and statistics are global: summed (loss) or token-weighted (means) over all
  ranks, maxima by max.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agentrl.learner.config import LearnConfig
from agentrl.learner.dist import Dist, grad_norm_and_clip
from agentrl.learner.packing import pack, packed_logprobs, pad_batch

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ctx: Dist
    pad_id: int = 0
    step: int = 0  # optimizer steps taken


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warm-up, then linear decay."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if not decay_steps:
        return 1.0
    done = min(1.0, (step - warmup_steps) / decay_steps)
    return 1.0 - (1.0 - min_ratio) * done


def build_state(cfg: LearnConfig, model: torch.nn.Module, ctx: Dist) -> TrainState:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.decay_steps, cfg.min_lr_ratio))
    config = getattr(model, "config", None)
    pad_id = getattr(config, "pad_token_id", None)
    return TrainState(model=model, optimizer=opt, scheduler=sched, ctx=ctx, pad_id=pad_id if pad_id is not None else 0)


def usable_samples(samples: Sequence[Any]) -> list[Any]:
    """Samples that carry a gradient: no error, and at least one generated token after the first."""
    return [s for s in samples if s.error is None and len(s.token_ids) > 1 and np.count_nonzero(s.loss_mask[1:])]


def _merge_stats(parts: list[list[tuple[float, dict[str, float]]]]) -> dict[str, float]:
    """Token-weighted means of per-row statistics; ``max`` keys by max, ``tokens`` by sum."""
    out: dict[str, float] = {}
    for rank_rows in parts:
        for w, st in rank_rows:
            for k, v in st.items():
                if k.endswith("max"):
                    out[k] = max(out.get(k, -math.inf), v)
                elif k.endswith("tokens") or k == "loss/loss":
                    out[k] = out.get(k, 0.0) + v
                else:
                    out[k] = out.get(k, 0.0) + w * v
    return out


def train_step(state: TrainState, samples: Sequence[Any], cfg: LearnConfig, version: int) -> dict[str, Any]:
    """One optimizer step on ``samples`` (the whole batch, identical on every rank); global stats."""
    from agentrl.learner.losses import compute_loss, group_advantages

    ctx, model = state.ctx, state.model
    t0 = time.monotonic()
    staleness = [version - s.min_version for s in samples if s.min_version >= 0]
    usable = usable_samples(samples)
    rewards = torch.tensor([s.reward for s in usable], dtype=torch.float32)
    adv = group_advantages(rewards, [s.group_id for s in usable]) if usable else rewards
    # the loss sees mask[:, 1:] (the first token is never predicted)
    total_tokens = sum(int(np.count_nonzero(s.loss_mask[1:])) for s in usable)
    rows = pack([len(s.token_ids) for s in usable], cfg.micro_batch_tokens)
    passes = math.ceil(len(rows) / ctx.world) if rows else 0
    mine = rows[ctx.rank::ctx.world]
    state.optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    row_stats: list[tuple[float, dict[str, float]]] = []
    for i in range(passes):
        if i >= len(mine):  # keep the collectives in step with the other ranks
            ids = torch.full((1, 2), state.pad_id, dtype=torch.long, device=ctx.device)
            (model(input_ids=ids, use_cache=False).logits.float().sum() * 0.0).backward()
            continue
        idx = mine[i]
        mb = [usable[j] for j in idx]
        t = pad_batch(mb, state.pad_id)
        logp = packed_logprobs(model, mb, ctx.device)
        loss, st = compute_loss(**cfg.loss.arguments(), logp=logp, logp_behaviour=t["behaviour"].to(ctx.device),
                                advantages=adv[idx].to(ctx.device), mask=t["mask"].to(ctx.device),
                                denominator=float(max(1, total_tokens)))
        (loss * ctx.world).backward()
        loss_sum += float(loss.detach())
        row_stats.append((float(t["mask"].sum()) / max(1, total_tokens), {k: float(v) for k, v in st.items()}))
    grad_norm = grad_norm_and_clip(model, cfg.grad_clip) if usable else 0.0
    lr = state.scheduler.get_last_lr()[0]
    if usable:
        state.optimizer.step()
        state.scheduler.step()
    state.step += 1
    (loss_sum,) = ctx.all_reduce_sum([loss_sum])
    agg = _merge_stats(ctx.all_gather_object(row_stats))
    seconds = time.monotonic() - t0
    return {
        "loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "samples": len(samples), "trained_samples": len(usable),
        "failed_samples": sum(s.error is not None for s in samples),
        "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
        "advantage_mean": float(adv.mean()) if len(adv) else 0.0,
        "advantage_std": float(adv.std()) if len(adv) > 1 else 0.0,
        "advantage_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
        "staleness_mean": sum(staleness) / max(1, len(staleness)), "staleness_max": max(staleness, default=0),
        "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
        "tokens": total_tokens, "packed_rows": len(rows),
        "tokens_per_s": total_tokens / max(1e-9, seconds), "step_s": seconds, **agg,
    }
