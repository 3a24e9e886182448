"""One learner step on a given list of samples: the learner's math, apart from any I/O.

Role: per-episode advantages and loss masks (:mod:`agentrl.learner.batch`), packed micro-batches,
logprob recomputation, the off-policy-corrected loss, gradient clipping and the AdamW + schedule
update. ``train_step`` takes samples and returns statistics; it never talks to serve, so tests
and benchmarks drive it on fixed batches.

A step is one optimizer update, or for the clipped kinds with ``minibatches`` x ``epochs`` > 1
that many updates over the batch, with ``pi_old`` the weights at the start of the step: one
no-grad pass in eval mode computes it first (decoupled PPO's ``proximal = "approx"`` interpolates
it instead, :func:`agentrl.learner.corrections.approx_proximal_logp`). The learning-rate schedule
counts steps (batches), not updates.

Invariants:
- Every rank receives the whole batch and computes the same advantages, masks and packed rows;
  rank r trains rows r, r + world, ... of each update. A rank with fewer rows runs a zero-weight
  dummy pass so all ranks make the same FSDP collectives.
- Each row's loss is taken in its sum form (``denominator = 1``) and the gradient is divided once
  by the update's global count of what the loss was taken over (tokens, or sequences, after
  every mask: tokens that MIS or the mismatch band drop leave the denominator), so the loss and
  gradient are the same for any world size and any micro-batching. FSDP averages gradients over
  ranks; each rank's loss is scaled by ``world`` to undo that.
- An update whose loss or gradient norm is not finite is not applied (gradients dropped, no
  optimizer step) and names the samples that caused it. A step none of whose updates was applied
  reports ``updated = False``: the weights did not change, the schedule and ``state.step`` did
  not advance, and the caller must not publish a new version.
- Reported statistics are global: summed (counts) or token-weighted (means) over all ranks,
  maxima by max; with several updates, averaged over them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agentrl.buffer.sample import Sample
from agentrl.env.base import MIX_TAG
from agentrl.learner.advantages import distilled_advantages, topk_forward_kl
from agentrl.learner.batch import TrainBatch, prepare
from agentrl.learner.config import LearnConfig, LossConfig
from agentrl.learner.dist import Dist, grad_norm_and_clip
from agentrl.learner.lora import LoraConfig
from agentrl.learner.masked import aggregate, masked_mean
from agentrl.learner.microbatch import TEACHER_TOPK, MicroBatch
from agentrl.learner.packing import pack, packed_forward, packed_logprobs, routing_replayed
from agentrl.learner.routing import ReplayStats
from agentrl.learner.terms import TermInputs, loss_terms

log = logging.getLogger(__name__)

NEEDS_OLD = ("ppo", "decoupled_ppo", "gspo", "cispo")  # kinds whose loss compares with pi_old


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ctx: Dist
    pad_id: int = 0
    step: int = 0  # steps that updated the weights (each published as one version)
    lora: LoraConfig | None = None  # when the model trains adapters (checkpoints record it)


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Multiplier of ``lr`` at step ``step`` (0-based): linear warm-up, then linear decay."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if not decay_steps:
        return 1.0
    done = min(1.0, (step - warmup_steps) / decay_steps)
    return 1.0 - (1.0 - min_ratio) * done


def build_state(cfg: LearnConfig, model: torch.nn.Module, ctx: Dist,
                params: Sequence[torch.nn.Parameter] | None = None) -> TrainState:
    """The optimizer and schedule over ``params`` (default: every parameter that trains; one
    policy's adapter when several policies share the model)."""
    # only what trains is in the optimizer (with LoRA: the adapters; the frozen base has no state)
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.decay_steps, cfg.min_lr_ratio))
    config = getattr(model, "config", None)
    pad_id = getattr(config, "pad_token_id", None)
    return TrainState(
        model=model,
        optimizer=opt,
        scheduler=sched,
        ctx=ctx,
        pad_id=pad_id if pad_id is not None else 0,
        lora=cfg.lora if cfg.lora.enabled else None,
    )


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) for a logprob pass, then back as it was."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _merge_stats(parts: list[list[tuple[float, dict[str, float]]]]) -> dict[str, float]:
    """Token-weighted means of per-row statistics; ``max`` keys by max."""
    out: dict[str, float] = {}
    for rank_rows in parts:
        for w, st in rank_rows:
            for k, v in st.items():
                if k.endswith("max"):
                    out[k] = max(out.get(k, -math.inf), v)
                else:
                    out[k] = out.get(k, 0.0) + w * v
    return out


def _denominator(agg: str, tokens: float, sequences: float, norm_tokens: float) -> float:
    if agg == "token-mean":
        return tokens
    if agg == "seq-mean-token-sum-norm":
        return sequences * norm_tokens
    return sequences


def _offending(mb: MicroBatch, logp: torch.Tensor) -> list[str]:
    """The samples of a row whose loss was not finite: those with a non-finite logprob of the
    learner's, else of the engine's, on a counted token; else all of them."""
    m = mb.mask > 0
    for values in (logp.detach(), mb.behaviour):
        bad = ~torch.isfinite(torch.where(m, values, torch.zeros_like(values))).all(-1)
        if bool(bad.any()):
            return [mb.samples[i].sample_id for i in bad.nonzero().flatten().tolist()]
    return [s.sample_id for s in mb.samples]


def _dummy_pass(state: TrainState, backward: bool) -> None:
    """A zero-weight pass: keeps this rank's FSDP collectives in step with ranks that have a row."""
    ids = torch.full((1, 2), state.pad_id, dtype=torch.long, device=state.ctx.device)
    out = state.model(input_ids=ids, use_cache=False).logits.float().sum() * 0.0
    if backward:
        out.backward()


def _old_logprobs(state: TrainState, prep: TrainBatch, plan: list[list[list[int]]],
                  cfg: LearnConfig) -> dict[tuple[int, int], torch.Tensor]:
    """pi_old of every row this rank trains, keyed (minibatch, row): no grad, eval mode (no dropout)."""
    ctx = state.ctx
    out: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad(), eval_mode(state.model):
        for m, rows in enumerate(plan):
            mine = list(range(ctx.rank, len(rows), ctx.world))
            for i in range(math.ceil(len(rows) / ctx.world)):
                if i >= len(mine):
                    _dummy_pass(state, backward=False)
                    continue
                mb = MicroBatch.build([prep.samples[j] for j in rows[mine[i]]], device=ctx.device)
                with routing_replayed(state.model, mb, follow=cfg.routing_replay):
                    out[(m, mine[i])] = packed_logprobs(
                        state.model, mb, ctx.device, chunk_tokens=cfg.head_chunk_tokens
                    )
    return out


def _update(
    state: TrainState,
    cfg: LearnConfig,
    prep: TrainBatch,
    rows: list[list[int]],
    old: dict[int, torch.Tensor],
    version: int,
    progress: float,
    norm_tokens: float,
) -> dict[str, Any]:
    """One optimizer update on ``rows`` (lists of indexes into ``prep.samples``); collective."""
    from agentrl.learner.corrections import approx_proximal_logp
    from agentrl.learner.losses import compute_loss

    ctx, model, loss_cfg = state.ctx, state.model, cfg.loss
    approx = getattr(loss_cfg, "proximal", "recompute") == "approx"
    weight_of = float(max(1, sum(int(np.count_nonzero(prep.masks[j][1:])) for r in rows for j in r)))
    mine = list(range(ctx.rank, len(rows), ctx.world))
    state.optimizer.zero_grad(set_to_none=True)
    loss_sum, tokens, sequences, bad_ids = 0.0, 0.0, 0.0, []
    routed = [0, 0, 0]  # MoE routing replay: tokens with a recorded routing, those the learner's own differed
    # from, and tokens of routed samples without a record (prefix-cache hits, the last sampled token)
    row_stats: list[tuple[float, dict[str, float]]] = []
    for i in range(math.ceil(len(rows) / ctx.world)):
        if i >= len(mine):
            _dummy_pass(state, backward=True)
            continue
        idx = rows[mine[i]]
        mb = MicroBatch.build([prep.samples[j] for j in idx], [prep.masks[j] for j in idx], ctx.device)
        row_routing = ReplayStats()
        topk = bool(loss_cfg.distill_topk_coef) and TEACHER_TOPK in mb.sections
        trained = mb.mask != 0
        # held through backward: a recompute replays too
        with routing_replayed(model, mb, stats=row_routing, follow=cfg.routing_replay):
            forward = packed_forward(model, mb, topk=topk, chunk_tokens=cfg.head_chunk_tokens)
            logp = forward.logp
            routed[0] += row_routing.tokens  # read now: a recompute in backward counts again
            routed[1] += row_routing.tokens_differed
            routed[2] += (
                sum(len(s.token_ids) for s in mb.samples if s.routing is not None) - row_routing.tokens
            )
            logp_old = old.get(mine[i])
            if approx:  # pi_prox at the step's start version, interpolated from this update's logprobs
                logp_old = approx_proximal_logp(mb.behaviour, logp.detach(), mb.versions,
                                                current_version=version + progress, proximal_version=version)
            loss, st = compute_loss(
                **loss_cfg.arguments(),
                logp=logp,
                logp_old=logp_old,
                logp_behaviour=mb.behaviour,
                advantages=_advantages(prep, idx, mb, loss_cfg),
                mask=mb.mask,
                denominator=1.0,
            )
            if topk:  # the forward KL over the teacher's top-k, in the loss's sum form beside it
                assert forward.topk is not None
                kl, scored = topk_forward_kl(forward.topk, mb.sections[TEACHER_TOPK])
                scored = scored & trained
                loss = loss + loss_cfg.distill_topk_coef * aggregate(
                    kl, scored, loss_cfg.agg, 1.0, norm_tokens
                )
                st["distill/topk_kl"] = masked_mean(kl.detach(), scored)
            loss = loss + _section_terms(mb, logp, trained, loss_cfg, norm_tokens, st)
            # the policy's entropy on the trained tokens, of the distribution each was sampled from
            st["entropy"] = masked_mean(forward.entropy.detach(), trained)
            (loss * ctx.world).backward()
        value = float(loss.detach())
        if not math.isfinite(value):
            bad_ids += _offending(mb, logp)
        loss_sum += value
        tokens += float(st.pop("loss/tokens"))
        sequences += float(st.pop("loss/sequences"))
        st.pop("loss/loss")
        row_stats.append((float(mb.mask.sum()) / weight_of, {k: float(v) for k, v in st.items()}))
    loss_sum, tokens, sequences, replayed, differed, own = ctx.all_reduce_sum(
        [loss_sum, tokens, sequences, *routed]
    )
    parts = ctx.all_gather_object((row_stats, bad_ids))
    stats = _merge_stats([p[0] for p in parts])
    bad_ids = [i for p in parts for i in p[1]]
    denominator = _denominator(loss_cfg.agg, tokens, sequences, norm_tokens)
    result: dict[str, Any] = {"stats": stats, "tokens": tokens, "sequences": sequences, "applied": False,
                              "grad_norm": 0.0, "loss": 0.0, "skipped": None, "offending": bad_ids,
                              "routing": (replayed, differed, own)}
    if bad_ids or not math.isfinite(loss_sum):
        result["skipped"] = "non_finite_loss"
    elif denominator <= 0:
        result["skipped"] = "nothing_to_train"  # every token masked: no gradient, and AdamW would still move
    else:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / denominator)
        grad_norm = grad_norm_and_clip(model, cfg.grad_clip)
        result["loss"], result["grad_norm"] = loss_sum / denominator, grad_norm
        if math.isfinite(grad_norm):
            state.optimizer.step()
            result["applied"] = True
        else:
            result["skipped"] = "non_finite_grad_norm"
            result["offending"] = [prep.samples[j].sample_id for r in rows for j in r]
    if not result["applied"]:
        state.optimizer.zero_grad(set_to_none=True)  # nothing of this update may reach a later one
    return result


def _section_terms(mb: MicroBatch, logp: torch.Tensor, mask: torch.Tensor, loss_cfg: LossConfig,
                   norm_tokens: float, stats: dict[str, Any]) -> torch.Tensor | float:
    """The sum of the registered loss terms whose section this micro-batch carries (0.0: none),
    their stats added to ``stats`` (agentrl.learner.terms)."""
    total: torch.Tensor | float = 0.0
    for name, registered in loss_terms().items():
        tensor = mb.sections.get(registered.section)
        if tensor is None:
            continue
        value, st = registered.term(TermInputs(logp, mask, tensor, loss_cfg.agg, norm_tokens))
        total = total + value
        stats.update({f"{name}/{k}": v for k, v in st.items()})
    return total


def _minibatches(n: int, count: int) -> list[list[int]]:
    """``count`` contiguous slices of range(n) (groups arrive contiguous: they stay mostly whole)."""
    return [part.tolist() for part in np.array_split(np.arange(n), min(count, n)) if len(part)] if n else []


def train_step(
    state: TrainState, samples: Sequence[Sample], cfg: LearnConfig, version: int
) -> dict[str, Any]:
    """One step on ``samples`` (the whole batch, identical on every rank); global stats."""
    loss_cfg = cfg.loss
    t0 = time.monotonic()
    staleness = [version - s.min_version for s in samples if s.min_version >= 0]
    prep = prepare(samples, loss_cfg)
    n = len(prep.samples)
    # the loss sees mask[1:] (the first token is never predicted)
    counted = [int(np.count_nonzero(m[1:])) for m in prep.masks]
    norm_tokens = float(getattr(loss_cfg, "norm_tokens", 0) or max(counted, default=1))
    epochs = int(getattr(loss_cfg, "epochs", 1))
    parts = _minibatches(n, int(getattr(loss_cfg, "minibatches", 1)))
    plan = [[[part[j] for j in row] for row in pack([len(prep.samples[j].token_ids) for j in part],
                                                      cfg.micro_batch_tokens)] for part in parts]
    updates = epochs * len(plan)
    recompute = (
        loss_cfg.kind in NEEDS_OLD
        and updates > 1
        and getattr(loss_cfg, "proximal", "recompute") == "recompute"
    )
    old = _old_logprobs(state, prep, plan, cfg) if recompute else {}
    lr = state.scheduler.get_last_lr()[0]
    done: list[dict[str, Any]] = []
    for _ in range(epochs):
        for m, rows in enumerate(plan):
            mine = {i: v for (mm, i), v in old.items() if mm == m}
            done.append(_update(state, cfg, prep, rows, mine, version, len(done) / updates, norm_tokens))
    applied = [u for u in done if u["applied"]]
    skipped = [u for u in done if not u["applied"]]
    offending = sorted({i for u in skipped for i in u["offending"]})
    if offending:
        log.warning(
            "step at version %d: %d of %d update(s) not applied (%s); samples: %s",
            version,
            len(skipped),
            len(done),
            ", ".join(sorted({u["skipped"] for u in skipped})),
            ", ".join(offending),
        )
    if applied:
        state.scheduler.step()
        state.step += 1
    stats = _average([u["stats"] for u in (applied or done)])
    seconds = time.monotonic() - t0
    out: dict[str, Any] = {
        "updated": bool(applied),
        "updates": len(applied),
        "updates_skipped": len(skipped),
        "skipped": None if applied else (skipped[0]["skipped"] if skipped else "nothing_to_train"),
        "loss": sum(u["loss"] for u in applied) / max(1, len(applied)),
        "grad_norm": sum(u["grad_norm"] for u in applied) / max(1, len(applied)),
        "grad_norm_max": max((u["grad_norm"] for u in applied), default=0.0),
        "lr": lr,
        "samples": len(samples),
        "trained_samples": n,
        "usable_samples": prep.candidates,
        "failed_samples": sum(s.error is not None for s in samples),
        "reward_mean": sum(float(s.reward) for s in samples) / max(1, len(samples)),
        **prep.stats,
        "staleness_mean": sum(staleness) / max(1, len(staleness)),
        "staleness_max": max(staleness, default=0),
        "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
        "tokens": sum(counted),
        "packed_rows": sum(len(rows) for rows in plan),
        "tokens_per_s": sum(counted) / max(1e-9, seconds),
        "step_s": seconds,
        **stats,
        "loss/tokens": done[0]["tokens"] if done else 0.0,
        "loss/sequences": done[0]["sequences"] if done else 0.0,
    }
    once = done[:len(plan)]  # the first epoch's updates: every sample once
    replayed = sum(u["routing"][0] for u in once)
    if replayed:  # an MoE model trained through the engines' recorded experts
        out["routing_replayed_tokens"] = replayed
        out["routing_own_tokens"] = sum(u["routing"][2] for u in once)  # no record: the learner routed them
        # tokens whose own routing differed
        out["routing_disagreement"] = sum(u["routing"][1] for u in once) / replayed
    by_env = reward_by_env(samples)
    if by_env:  # a mix: each environment's mean reward in the batch too
        out["reward_by_env"] = by_env
    out.update(teacher_stats(prep.samples, prep.masks))
    if offending:
        out["offending_sample_ids"] = offending
    return out


def reward_by_env(samples: Sequence[Sample]) -> dict[str, float]:
    """The mean reward of each environment's samples in a batch of a mix (by their ``mix_env``);
    empty when no sample names one."""
    sums: dict[str, list[float]] = {}
    for s in samples:
        name = s.info.get(MIX_TAG)
        if name:
            sums.setdefault(str(name), []).append(float(s.reward))
    return {name: sum(v) / len(v) for name, v in sorted(sums.items())}


def _advantages(prep: TrainBatch, idx: list[int], mb: MicroBatch, loss_cfg: LossConfig) -> torch.Tensor:
    """The advantages of one packed row's samples: [B] episode advantages, or [B, T-1] per token
    once a teacher's term (``distill_coef``) or process rewards (``prep.process``) add to them."""
    behaviour = mb.behaviour
    advantages = prep.advantages[idx].to(behaviour.device)
    if loss_cfg.distill_coef:  # the teacher's term where a teacher scored
        advantages = distilled_advantages(advantages, mb.teacher, behaviour, loss_cfg.distill_coef,
                                          loss_cfg.distill_reward)
    if prep.process is not None:  # each token's return-to-go of its group's normalized step rewards
        process = torch.zeros_like(behaviour)
        for row, j in enumerate(idx):
            if (r := prep.process[j]) is not None:
                process[row, : len(r) - 1] = torch.from_numpy(r[1:])  # position t predicts token t + 1
        base = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        advantages = base + loss_cfg.process_coef * process
    return advantages


def teacher_stats(samples: Sequence[Sample], masks: Sequence[np.ndarray]) -> dict[str, float]:
    """On-policy distillation's progress over the trained tokens a teacher scored: ``teacher_kl``,
    the mean of ``log mu - log pi_teacher`` (the reverse KL from the policy that sampled to the
    teacher, estimated on the sampled tokens), and ``teacher_tokens``; with a teacher of known
    versions (self-distillation), the oldest and newest, ``teacher_version_min`` / ``_max``. Empty
    when no teacher scored."""
    gaps, versions = [], []
    for s, m in zip(samples, masks, strict=True):
        if s.teacher_logprobs is not None:
            keep = (m != 0) & np.isfinite(s.teacher_logprobs)
            gaps.append(s.logprobs[keep] - s.teacher_logprobs[keep])
            if isinstance(v := (s.info.get("teacher") or {}).get("version"), int):
                versions.append(v)
    if not gaps:
        return {}
    gap = np.concatenate(gaps)
    out: dict[str, float] = {
        "teacher_kl": float(gap.mean()) if gap.size else 0.0,
        "teacher_tokens": int(gap.size),
    }
    if versions:
        out["teacher_version_min"], out["teacher_version_max"] = min(versions), max(versions)
    return out


def _average(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per-update statistics averaged over updates (``max`` keys by max)."""
    out: dict[str, float] = {}
    for st in parts:
        for k, v in st.items():
            out[k] = max(out.get(k, -math.inf), v) if k.endswith("max") else out.get(k, 0.0) + v / len(parts)
    return out
