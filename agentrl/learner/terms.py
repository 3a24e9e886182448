"""Loss terms that features add beside the policy loss, each reading its sample section's tensor.

Role: the learner's side of a sample section (:mod:`agentrl.buffer.sections`). A feature that
carries a per-token signal declares the section (its field, validation, bytes and micro-batch
tensor) and, here, a term: a function of the micro-batch's policy logprobs, mask and the section's
tensor, registered with :func:`loss_term`. The training step adds every registered term whose
section the micro-batch carries to the loss; nothing in the step names a feature.

Invariants:
- A term runs only on micro-batches with at least one sample carrying its section (the others pay
  nothing); its tensor holds the section's ``fill`` on samples without it and past their ends.
- A term returns its loss in the sum form of the step's aggregation (:meth:`TermInputs.aggregate`,
  ``aggregate`` with denominator 1): the step divides the whole loss once by its denominator, so
  the term weighs the same however the batch is split over micro-batches and ranks.
- ``logp`` is the only input that carries gradient; a term's stats are detached 0-dim tensors or
  floats, reported as ``<term name>/<stat>`` (token-weighted means over the step's rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a feature's module registers its term without importing torch
    from torch import Tensor

    from agentrl.learner.masked import Agg


@dataclass(frozen=True)
class TermInputs:
    """What a term sees of one micro-batch (right-padded, [B, T-1]: position t predicts token t+1)."""

    logp: Tensor  # [B, T-1]: the policy's logprob of each next token, with gradient
    mask: Tensor  # [B, T-1] bool: the tokens the policy loss trains
    section: Tensor  # [B, T-1, ...]: the section's micro-batch tensor, on the step's device
    agg: Agg  # learn.loss.agg
    norm_tokens: float  # learn.loss's constant length, for seq-mean-token-sum-norm

    def aggregate(self, values: Tensor, where: Tensor) -> Tensor:
        """``values`` [B, T-1] reduced over ``where`` in the sum form of the step's aggregation."""
        from agentrl.learner.masked import aggregate

        return aggregate(values, where, self.agg, 1.0, self.norm_tokens)


Term = Callable[[TermInputs], "tuple[Tensor, dict[str, Any]]"]


@dataclass(frozen=True)
class Registered:
    section: str  # the section whose tensor the term reads
    term: Term


_TERMS: dict[str, Registered] = {}


def loss_term(name: str, section: str) -> Callable[[Term], Term]:
    """Decorator: add the term to every step's loss on micro-batches that carry ``section``."""
    def register(term: Term) -> Term:
        old = _TERMS.get(name)
        where = (term.__module__, term.__qualname__)
        if old is not None and (old.term.__module__, old.term.__qualname__) != where:
            raise ValueError(f"loss term {name!r} is already registered ({old.term.__module__})")
        _TERMS[name] = Registered(section, term)
        return term
    return register


def loss_terms() -> Mapping[str, Registered]:
    """The registered terms by name, in registration order."""
    return _TERMS
