"""The Tinker API's built-in losses, token by token, as its documentation defines them.

Role: ``forward_backward(data, loss_fn=NAME, loss_fn_config=...)`` names one of :data:`LOSSES`.
Each maps a datum's target logprobs under the training model (``logp``, the shape of its
``target_tokens``) and its ``loss_fn_inputs`` to an elementwise loss; the datum's loss is the sum,
and the request's loss (``loss:sum``) the sum over its data: Tinker normalises nothing, the caller
chooses by its weights and advantages.

Invariants:
- ``p`` is the training model, ``q`` the sampler (``logprobs`` in the inputs), ``A`` the
  ``advantages``; the ratio is ``exp(logp - q)``, computed per token.
- A loss names the inputs it needs (:attr:`Loss.needs`); every one must have the shape of
  ``target_tokens``, or the request is refused before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Config = Mapping[str, float | str]


@dataclass(frozen=True)
class Loss:
    needs: tuple[str, ...]  # loss_fn_inputs beyond target_tokens
    elementwise: Callable[[torch.Tensor, dict[str, torch.Tensor], Config], torch.Tensor]
    options: tuple[str, ...] = ()  # the loss_fn_config names it reads


def _number(config: Config, name: str, default: float) -> float:
    value = config.get(name, default)
    if isinstance(value, str):
        raise ValueError(f"loss_fn_config[{name!r}] must be a number, not {value!r}")
    return float(value)


def _cross_entropy(logp: torch.Tensor, x: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    # supervised: the negative log-likelihood of the targets, weighted (0 on prompt tokens)
    return -logp * x["weights"] if "weights" in x else -logp


def _importance_sampling(logp: torch.Tensor, x: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    return -torch.exp(logp - x["logprobs"]) * x["advantages"]


def _clip(config: Config) -> tuple[float, float]:
    lo, hi = _number(config, "clip_low_threshold", 0.8), _number(config, "clip_high_threshold", 1.2)
    if not 0 <= lo <= hi:
        raise ValueError(f"clip thresholds must satisfy 0 <= low <= high; got {lo}, {hi}")
    return lo, hi


def _ppo(logp: torch.Tensor, x: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    lo, hi = _clip(config)
    ratio = torch.exp(logp - x["logprobs"])
    a = x["advantages"]
    return -torch.minimum(ratio * a, ratio.clamp(lo, hi) * a)


def _cispo(logp: torch.Tensor, x: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    # the clipped ratio is a coefficient (no gradient through it) on the policy gradient
    lo, hi = _clip(config)
    ratio = torch.exp(logp - x["logprobs"]).clamp(lo, hi).detach()
    return -ratio * logp * x["advantages"]


def _gspo(logp: torch.Tensor, x: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    # GSPO-token: every token's ratio has the value of the sequence's (the geometric mean of the
    # per-token ratios over the tokens sequence_ratio_mask marks; 1 when it marks none) and the
    # gradient of the token's own logprob, clipped as ppo's
    lo, hi = _clip(config)
    marked = x["sequence_ratio_mask"] != 0
    log_ratio = (logp.detach() - x["logprobs"])[marked]
    seq = log_ratio.mean() if log_ratio.numel() else logp.new_zeros(())
    ratio = torch.exp(seq + logp - logp.detach())
    a = x["advantages"]
    return -torch.minimum(ratio * a, ratio.clamp(lo, hi) * a)


def _dro(logp: torch.Tensor, x: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    beta = _number(config, "beta", 0.05)
    return -(logp * x["advantages"] - 0.5 * beta * (logp - x["logprobs"]) ** 2)


LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss((), _cross_entropy),
    "importance_sampling": Loss(("logprobs", "advantages"), _importance_sampling),
    "ppo": Loss(("logprobs", "advantages"), _ppo, ("clip_low_threshold", "clip_high_threshold")),
    "cispo": Loss(("logprobs", "advantages"), _cispo, ("clip_low_threshold", "clip_high_threshold")),
    "gspo": Loss(("logprobs", "advantages", "sequence_ratio_mask"), _gspo,
                 ("clip_low_threshold", "clip_high_threshold")),
    "dro": Loss(("logprobs", "advantages"), _dro, ("beta",)),
}
NOT_YET = ("stable_reinforce", "custom")  # names the SDK knows that this service does not run yet
