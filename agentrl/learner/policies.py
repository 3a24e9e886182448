"""The policy set: the policies one learner trains, a single policy being a set of one.

Role: everything the learner loop would otherwise branch on per policy. A :class:`Policy` is its
name (None for the one unnamed policy of a single-policy run), its optimizer and schedule (its
:class:`~agentrl.learner.step.TrainState`), its version, and how its weights are published: the
model's full weights in the engines' layout, the LoRA-merged model, the adapter alone (adapter
transport), or one named policy's adapter alone. :class:`PolicySet` holds them over one model and
answers the loop's calls the same way for one policy and for several: ``of`` (the policy of a
batch), ``activate`` (before a step), ``publish``, ``save`` / ``load`` (one checkpoint of the
whole set, :mod:`agentrl.learner.checkpoint`), ``export``.

Invariants:
- Named policies share one base model, each with its own LoRA adapter and an optimizer over that
  adapter's parameters alone; a step trains the batch's policy with its adapter alone active.
- ``publish`` is collective (every rank gathers its shard); rank 0 alone hands the weights to the
  source. It publishes nothing when the source does not take weights.
- A policy's ``version`` advances only when a step updated its weights; ``held`` is the version of
  the weights it started from (its checkpoint's, 0 for fresh weights).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from agentrl.learner.checkpoint import Resumed
    from agentrl.learner.config import LearnConfig
    from agentrl.learner.dist import Dist
    from agentrl.learner.lora import LoraConfig
    from agentrl.learner.source import BatchSource
    from agentrl.learner.step import TrainState

log = logging.getLogger(__name__)

Layout = Callable[[dict[str, Any]], dict[str, Any]]  # gathered weights -> what the source publishes


@dataclass
class Policy:
    name: str | None  # None: the one policy of a single-policy run
    state: TrainState
    layout: Layout  # the gathered weights as this policy publishes them
    version: int = 0
    held: int = 0  # the version of the weights it started from (its checkpoint's; 0 fresh)

    @property
    def kwargs(self) -> dict[str, str]:
        """What the source's ``get_batch`` and ``publish`` are told of this policy (nothing: the one)."""
        return {} if self.name is None else {"policy": self.name}

    @property
    def weights(self) -> str:
        """These weights, in a sentence."""
        return "the learner's weights" if self.name is None else f"policy {self.name}'s adapter"


class PolicySet:
    """The policies of one learner over one (possibly sharded) model."""

    def __init__(self, policies: Sequence[Policy], model: torch.nn.Module, ctx: Dist, *, lora: LoraConfig,
                 source: BatchSource | None, publishes: bool, weights_device: str,
                 adapter_only: bool) -> None:
        self.policies = list(policies)
        self.model, self.ctx, self.lora = model, ctx, lora
        self.source, self.publishes = source, publishes
        self.on_device = weights_device != "cpu"
        self.adapter_only = adapter_only
        self._by_name = {p.name: p for p in self.policies}

    def __iter__(self) -> Iterator[Policy]:
        return iter(self.policies)

    def __len__(self) -> int:
        return len(self.policies)

    @property
    def named(self) -> bool:
        return self.policies[0].name is not None

    @property
    def names(self) -> list[str]:
        """The named policies' names, in serve's order (none for a single unnamed policy)."""
        return [p.name for p in self.policies if p.name is not None]

    def of(self, name: str | None) -> Policy:
        return self._by_name[name]

    def steps_done(self) -> int:
        """Every policy's steps together (``steps`` and ``checkpoint_every`` count these)."""
        return sum(p.state.step for p in self.policies)

    def served(self, info: dict[str, Any]) -> dict[str | None, int]:
        """The version serve serves of each policy, from its info."""
        if not self.named:
            return {None: int(info.get("version", 0))}
        served = info.get("policies") or {}
        return {n: int(served.get(n, {}).get("version", 0)) for n in self.names}

    def activate(self, policy: Policy) -> None:
        """Before ``policy``'s step: a named policy's adapter alone active, no stale gradients."""
        if policy.name is None:
            return
        from agentrl.learner.lora import activate

        activate(self.model, policy.name)
        # the gradients of another policy's last step are still there (a step clears its own
        # optimizer's at its start): they would count in this step's norm and clipping
        self.model.zero_grad(set_to_none=True)

    async def publish(self, policy: Policy) -> dict[str, Any]:
        """Gather the weights (collective) and have rank 0 publish them as ``policy.version``."""
        if not self.publishes:
            return {}
        from agentrl.learner.dist import full_state_dict

        full = await asyncio.to_thread(full_state_dict, self.model, self.ctx, on_device=self.on_device,
                                       trainable_only=self.adapter_only)
        state = policy.layout(full)
        del full
        source = self.source
        sync = await source.publish(state, policy.version, **policy.kwargs) if source is not None else {}
        del state
        return sync

    def save(self, checkpoint_dir: str | Path, *, batch_id: str | None, keep: int,
             batch_samples: Sequence[str], trained: Sequence[str], next_policy: str | None) -> Path | None:
        """One checkpoint of every policy (collective)."""
        from agentrl.learner.checkpoint import save_checkpoint

        return save_checkpoint(self, checkpoint_dir, batch_id=batch_id, keep=keep,
                               batch_samples=batch_samples, trained=trained, next_policy=next_policy)

    def load(self, path: str | Path) -> Resumed:
        """Restore every policy the checkpoint at ``path`` holds (collective); each one's ``held``
        is its checkpoint's version."""
        from agentrl.learner.checkpoint import load_checkpoint

        resumed = load_checkpoint(self, path)
        for p in self.policies:
            p.held = resumed.versions.get(p.name, 0)
        return resumed

    def export(self, model_path: str, out: str | Path) -> Path | None:
        """The trained policy as a Hugging Face folder (collective); named policies as adapters."""
        from agentrl.learner.checkpoint import export_hf

        return export_hf(self.model, self.ctx, model_path, out, self.lora, self.names)


def check_policies(cfg: LearnConfig, names: list[str], publishes: bool) -> None:
    """Several policies on one base train one LoRA adapter each, sent by the adapter transport."""
    if not cfg.lora.enabled:
        raise SystemExit(f"agentrl learn: serve has several policies ({', '.join(names)}), each trained as "
                         f"its own LoRA adapter on one base model: set learn.lora.rank > 0")
    if publishes and cfg.weights.transport.kind != "adapter":
        raise SystemExit(f"agentrl learn: serve has several policies ({', '.join(names)}); each is published "
                         f"as its adapter alone: set weights.transport.kind = \"adapter\" (it is "
                         f"{cfg.weights.transport.kind!r})")


def _layout(cfg: LearnConfig, model: torch.nn.Module, name: str | None) -> Layout:
    """How a policy's gathered weights are published: a named policy's adapter alone; with LoRA
    the adapters alone for the adapter transport, else the merged model; the names the engines load
    (MoE experts one by one) for a whole model."""
    from agentrl.learner.dist import checkpoint_layout
    from agentrl.learner.lora import merged_state, of_adapter

    if name is not None:
        return lambda full: {k: v for k, v in full.items() if of_adapter(k, name)}
    if cfg.weights.transport.kind == "adapter":
        return lambda full: full
    if cfg.lora.enabled:
        return lambda full: checkpoint_layout(model, merged_state(full, cfg.lora) if full else full)
    return lambda full: checkpoint_layout(model, full)


def build_policies(cfg: LearnConfig, model: torch.nn.Module, ctx: Dist, names: list[str], *,
                   source: BatchSource | None, publishes: bool, weights_device: str) -> PolicySet:
    """The set serve's info asks for: one policy per name (each optimizer over its own adapter's
    parameters alone), or one unnamed policy over every parameter that trains."""
    from agentrl.learner.lora import of_adapter
    from agentrl.learner.step import build_state

    if names:
        policies = [Policy(n, build_state(cfg, model, ctx, params=[p for k, p in model.named_parameters()
                                                                    if of_adapter(k, n)]),
                           _layout(cfg, model, n)) for n in names]
    else:
        policies = [Policy(None, build_state(cfg, model, ctx), _layout(cfg, model, None))]
    return PolicySet(policies, model, ctx, lora=cfg.lora, source=source, publishes=publishes,
                     weights_device=weights_device, adapter_only=cfg.weights.transport.kind == "adapter")
