"""From a leased batch to what one step trains: the samples, their loss masks, their advantages.

Role: a pure function of the samples and the ``learn.loss`` settings (:func:`prepare`), computed
once per step and identically on every rank, so the step itself only packs, forwards and
backpropagates. Per-token fields may be numpy arrays or lists; no sample is modified.

Invariants:
- Advantages are per episode (:func:`agentrl.learner.advantages.episode_advantages`): an episode
  that became several samples counts once in its group's mean and std, and its samples share its
  advantage. In a multi-agent episode each role is its own episode for this (``info["role"]``): a
  role's samples compare with that role's in the group's other episodes, never with another
  role's. Samples of failed episodes, and samples with nothing generated after their first token,
  are neither trained nor part of any baseline.
- A completion that several samples of one episode contain (a call that two later calls extend:
  each sample is the chain of calls up to a leaf, ``sample.info["calls"]``) is trained once: in
  the first of those samples in batch order, masked out of the others
  (:func:`shared_completion_masks`).
- Truncated episodes follow ``learn.loss.overlong``: ``keep``; ``mask`` (not trained, still in
  their group's baseline: DAPO's overlong filtering); ``penalize`` (``overlong_penalty``
  subtracted from their reward before the advantages).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from agentrl.learner.advantages import episode_advantages, process_advantages

if TYPE_CHECKING:
    from agentrl.buffer.sample import Sample
    from agentrl.learner.config import LossConfig

__all__ = ["TrainBatch", "prepare", "shared_completion_masks", "usable_samples"]

log = logging.getLogger(__name__)


def usable_samples(samples: Sequence[Sample]) -> list[Sample]:
    """Samples that carry a gradient: no error, and at least one generated token after the first."""
    return [s for s in samples if s.error is None and len(s.token_ids) > 1
            and np.count_nonzero(np.asarray(s.loss_mask)[1:])]


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends (exclusive) of the runs of non-zero entries of ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], (mask != 0).astype(np.int8), [0]))))
    return edges[0::2], edges[1::2]


def shared_completion_masks(samples: Sequence[Sample]) -> tuple[list[np.ndarray], int]:
    """Loss masks (int32 copies) in which a completion shared by several samples counts once.

    Every run of generated tokens in a sample is one call's completion, in the order of the
    sample's call chain (``info["calls"]``, root first). Two samples of an episode share call k's
    completion when their chains agree up to k and their tokens agree up to the end of it (the
    tokens tell apart two choices of one call, which the chain does not name). The first sample
    keeps it; in the others its run is masked. Samples without a chain, or whose runs do not match
    their chain one to one (an empty completion), keep their mask. Returns the masks and the number
    of tokens masked.

    Known limit: two choices of one call that are identical token for token are trained once.
    """
    claimed: set[tuple[Hashable, ...]] = set()
    out: list[np.ndarray] = []
    masked = 0
    for s in samples:
        mask = np.array(s.loss_mask, dtype=np.int32)
        chain = list((s.info or {}).get("calls") or [])
        starts, ends = _runs(mask)
        if not chain or len(starts) != len(chain):
            out.append(mask)
            continue
        tokens = np.asarray(s.token_ids, dtype=np.int64)
        digest = hashlib.blake2b(digest_size=16)
        done = 0
        for k, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            digest.update(tokens[done:b].tobytes())  # the prefix up to the end of call k, incrementally
            done = b
            key = (s.group_id, s.episode_id, tuple(chain[: k + 1]), digest.copy().digest())
            if key in claimed:
                mask[a:b] = 0
                masked += b - a
            else:
                claimed.add(key)
        out.append(mask)
    return out, masked


@dataclass
class TrainBatch:
    samples: list[Sample]  # the samples that train: at least one counted token after the first
    masks: list[np.ndarray]  # their loss masks (int32, the samples' length) after every mask here
    advantages: Tensor  # [len(samples)] float32: their episodes' advantages
    candidates: int = 0  # usable samples before the shared-completion and overlong masks
    stats: dict[str, float] = field(default_factory=dict)
    process: list[np.ndarray | None] | None = None  # per sample, its tokens' process advantages (None: none)


def _role_key(s: Sample) -> str:
    info = s.info or {}
    return "" if info.get("advantage") == "team" else str(info.get("role") or "")


def role_advantages(adv: Tensor, samples: Sequence[Sample], rewards: Tensor) -> Tensor:
    """A multi-agent role's own settings (``env.roles.<role>``, carried on its samples' ``info``): with
    ``advantage: baseline`` the sample's reward minus the running baseline its episode saw
    (``info["baseline"]``) instead of the group's; ``loss_weight`` scales the advantage."""
    out = adv
    for i, s in enumerate(samples):
        info = s.info or {}
        baseline, weight = info.get("baseline"), info.get("loss_weight")
        if baseline is None and weight is None:
            continue
        if out is adv:
            out = adv.clone()
        if info.get("advantage") == "baseline" and baseline is not None:
            out[i] = float(rewards[i]) - float(baseline)
        if weight is not None:
            out[i] = out[i] * float(weight)
    return out


def prepare(samples: Sequence[Sample], loss: LossConfig) -> TrainBatch:
    """The step's inputs for ``samples`` under ``loss`` (a ``LossConfig``); see the module's invariants."""
    usable = usable_samples(samples)
    rewards = torch.tensor([float(s.reward) for s in usable], dtype=torch.float32)
    truncated = [bool(s.truncated) for s in usable]
    if loss.overlong == "penalize":
        rewards = rewards - loss.overlong_penalty * torch.tensor(truncated, dtype=torch.float32)
    # a multi-agent episode's roles each compare with the same role of the group's other episodes
    # (a role on the team reward with the team)
    roles = [_role_key(s) for s in usable]
    adv = episode_advantages(rewards, list(zip([s.episode_id for s in usable], roles, strict=True)),
                             list(zip([s.group_id for s in usable], roles, strict=True)),
                             normalize_std=loss.advantage_std)
    adv = role_advantages(adv, usable, rewards)
    masks, shared = shared_completion_masks(usable)
    if loss.overlong == "mask":
        for i, cut in enumerate(truncated):
            if cut:
                masks[i] = np.zeros_like(masks[i])
    keep = [i for i, m in enumerate(masks) if np.count_nonzero(m[1:])]
    stats = {
        "episodes": float(len({(s.group_id, s.episode_id) for s in usable})),
        "shared_tokens_masked": float(shared),
        "truncated_samples": float(sum(truncated)),
        "advantage_mean": float(adv.mean()) if len(adv) else 0.0,
        "advantage_std": float(adv.std()) if len(adv) > 1 else 0.0,
        "advantage_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
    }
    process = None
    if loss.process_coef and any(s.token_rewards is not None for s in usable):
        rtg = process_advantages([s.token_rewards for s in usable], [s.group_id for s in usable],
                                 normalize_std=loss.advantage_std)
        process = [rtg[i] for i in keep]
        trained = [r[m != 0] for r, m in zip(rtg, masks, strict=True) if r is not None]
        stats["process_advantage_abs_mean"] = (
            float(np.abs(np.concatenate(trained)).mean()) if trained else 0.0
        )
    return TrainBatch(
        [usable[i] for i in keep], [masks[i] for i in keep], adv[keep], len(usable), stats, process
    )
