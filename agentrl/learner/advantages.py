"""Group-relative advantages (GRPO): the learner's only use of rewards.

Role: turn one scalar reward per episode into one advantage per episode by comparing each episode
with the other episodes of its group (the G rollouts of the same task), and hand each sample the
advantage of the episode it came from.

Invariants:
- Pure: no globals, no gradient (rewards are detached), output has the shape and floating dtype of
  the input rewards.
- A group whose rewards are all equal, and in particular a group of one, gets advantage exactly 0,
  never NaN: it carries no learning signal.
- An episode counts once in its group's mean and std however many samples it became (a chat
  template that is not prefix-stable, several choices per call, branching): its samples share
  its advantage.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["episode_advantages", "group_advantages", "group_index"]


def group_index(group_ids: Sequence[Hashable] | Tensor, n: int, device: torch.device | None = None) -> Tensor:
    """Map arbitrary group ids to dense indices 0..G-1 (long tensor of length ``n``)."""
    if isinstance(group_ids, Tensor):
        if group_ids.numel() != n:
            raise ValueError(f"group_ids has {group_ids.numel()} entries but rewards has {n}")
        _, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)
        return inverse.to(device)
    if len(group_ids) != n:
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {n}")
    codes: dict[Hashable, int] = {}
    dense = [codes.setdefault(g, len(codes)) for g in group_ids]
    return torch.tensor(dense, dtype=torch.long, device=device)


def group_advantages(
    rewards: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages: ``A_i = (r_i - mean_g) / (std_g + eps)``, or ``r_i - mean_g`` without std.

    ``std_g`` is the sample standard deviation (Bessel-corrected, as ``torch.std`` and most GRPO
    implementations compute it). Groups whose rewards are all equal get 0.

    rewards: [N] one reward per episode. group_ids: N hashables (e.g. the sample's group_id
    strings) or an [N] tensor. Returns [N].
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    n = rewards.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    idx = group_index(group_ids, n, rewards.device)
    num_groups = int(idx.max()) + 1

    # float64 so that the mean of equal rewards is exact enough for the equality test below
    r = rewards.detach().to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, idx, torch.ones_like(r))
    mean = zeros.index_add(0, idx, r) / count
    centered = r - mean[idx]
    if normalize_std:
        sq = zeros.index_add(0, idx, centered * centered)
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        adv = centered / (std[idx] + eps)
    else:
        adv = centered

    r_max = zeros.scatter_reduce(0, idx, r, reduce="amax", include_self=False)
    r_min = zeros.scatter_reduce(0, idx, r, reduce="amin", include_self=False)
    degenerate = (r_max == r_min)[idx]
    adv = torch.where(degenerate, torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


def episode_advantages(
    rewards: Tensor,
    episode_ids: Sequence[Hashable],
    group_ids: Sequence[Hashable],
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample GRPO advantages in which every episode counts once.

    rewards: [N] one per sample (the samples of one episode carry its reward; if they differ, the
    episode's reward is their mean). episode_ids, group_ids: N hashables. The episodes' rewards
    go through :func:`group_advantages` (one entry per episode, so an episode that became k
    samples does not weigh k times in its group's mean and std), and each sample gets its
    episode's advantage. Returns [N].
    """
    n = rewards.shape[0]
    if len(episode_ids) != n or len(group_ids) != n:
        raise ValueError(f"episode_ids ({len(episode_ids)}) and group_ids ({len(group_ids)}) must have one "
                         f"entry per reward ({n})")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if n == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    # an episode id is unique within its group; the pair is its key
    episode = group_index([(g, e) for g, e in zip(group_ids, episode_ids, strict=True)], n, rewards.device)
    count = int(episode.max()) + 1
    r = rewards.detach().to(torch.float64)
    zeros = torch.zeros(count, dtype=torch.float64, device=r.device)
    per_episode = zeros.index_add(0, episode, r) / zeros.index_add(0, episode, torch.ones_like(r))
    first = [None] * count
    for i, k in enumerate(episode.tolist()):
        if first[k] is None:
            first[k] = group_ids[i]
    adv = group_advantages(per_episode, first, normalize_std=normalize_std, eps=eps)
    return adv[episode].to(out_dtype)


def distilled_advantages(advantages: Tensor, teacher: Tensor, behaviour: Tensor, coef: float,
                         with_reward: bool = True) -> Tensor:
    """Per-token advantages for on-policy distillation: ``[B]`` episode advantages (or nothing, when
    not ``with_reward``) plus ``coef * (log pi_teacher - log mu)`` on each token a teacher scored.

    ``teacher``, ``behaviour``: [B, T] the teacher's and the sampling policy's logprobs of the
    sampled tokens (NaN in ``teacher`` where no teacher scored). ``log mu - log pi_teacher`` is the
    sampled token's one-sample estimate of the reverse KL ``KL(pi || pi_teacher)`` (the student's
    own tokens, as in on-policy distillation), so its negative, used as the token's advantage in the
    policy gradient, moves the student towards the teacher where the student sampled. Tokens no
    teacher scored keep their reward advantage (0 without ``with_reward``). Returns [B, T]."""
    scored = torch.isfinite(teacher)
    gap = torch.where(scored, teacher - behaviour, torch.zeros_like(teacher))
    base = (
        advantages.to(teacher.dtype).unsqueeze(-1).expand_as(teacher)
        if with_reward
        else torch.zeros_like(teacher)
    )
    return base + coef * gap


def topk_forward_kl(student: Tensor, teacher: Tensor) -> tuple[Tensor, Tensor]:
    """On-policy distillation over the teacher's top-k: at each position a teacher scored, the
    forward KL ``sum_j q_j (log q_j - log pi(j))`` from ``q``, the teacher's top-k probabilities
    renormalized over those k tokens, to the student's whole-vocabulary probabilities ``pi`` of the
    same tokens. It is never negative (the student's k probabilities sum to at most 1) and its
    gradient, ``-sum_j q_j grad log pi(j)``, raises the student's probability of the teacher's
    likely tokens at each position the student visited, sampled or not.

    ``student``, ``teacher``: [B, T, k] logprobs (the teacher's NaN where it did not score).
    Returns the KL [B, T] (0 where unscored) and where the teacher scored [B, T] (bool)."""
    scored = torch.isfinite(teacher).all(-1)
    log_q = torch.log_softmax(torch.where(scored.unsqueeze(-1), teacher, torch.zeros_like(teacher)), dim=-1)
    kl = (log_q.exp() * (log_q - student.to(log_q.dtype))).sum(-1)
    return torch.where(scored, kl, torch.zeros_like(kl)), scored


def process_advantages(token_rewards: Sequence[np.ndarray | None], group_ids: Sequence[Hashable],
                       normalize_std: bool = True, eps: float = 1e-6) -> list[np.ndarray | None]:
    """Process supervision for GRPO (DeepSeekMath, Shao et al. 2024): each step reward (a finite
    entry of a sample's ``token_rewards``, on a turn's last token) is normalized by the mean and
    standard deviation of every step reward in its group; a token's advantage is the sum of the
    normalized step rewards at or after it (its return-to-go). A group whose step rewards are all
    equal gives 0, as GRPO's outcome advantages do. Samples without token rewards get None.
    Returns, per sample, a float32 array over its tokens."""
    pooled: dict[Hashable, list[np.ndarray]] = {}
    for r, g in zip(token_rewards, group_ids, strict=True):
        if r is not None:
            pooled.setdefault(g, []).append(r[np.isfinite(r)].astype(np.float64))
    stats: dict[Hashable, tuple[float, float] | None] = {}
    for g, parts in pooled.items():
        steps = np.concatenate(parts)
        if steps.size == 0 or steps.max() == steps.min():
            stats[g] = None  # no comparison to make: no signal
            continue
        std = float(steps.std(ddof=1)) if steps.size > 1 else 0.0
        stats[g] = (float(steps.mean()), std + eps if normalize_std else 1.0)
    out: list[np.ndarray | None] = []
    for r, g in zip(token_rewards, group_ids, strict=True):
        if r is None:
            out.append(None)
            continue
        z = np.zeros(len(r), dtype=np.float64)
        if (st := stats[g]) is not None:
            finite = np.isfinite(r)
            z[finite] = (r[finite] - st[0]) / st[1]
        out.append(np.cumsum(z[::-1])[::-1].astype(np.float32))
    return out
