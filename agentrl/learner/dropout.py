"""Dropout off in a model the learner trains: its logprobs must be those of the policy the engine
sampled from, which runs without dropout. Used when the learner loads a model
(:func:`agentrl.learner.dist.load_model`) and by LoRA's helpers (:mod:`agentrl.learner.lora`); it
imports neither, so they do not import each other."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0 (``nn.Dropout`` modules and the float
    ``*dropout`` / ``*pdrop`` attributes transformers' attention reads); returns how many were
    non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p > 0
            module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and (name.endswith("dropout") or name.endswith("pdrop")):
                changed += value > 0
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    if changed:
        log.info(
            "dropout off in %d place(s): the learner's logprobs are those of the sampling policy", changed
        )
    return changed
