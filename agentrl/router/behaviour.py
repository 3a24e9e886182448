"""Behaviour capture: making a recorded call's logprobs those of the distribution the engine really
samples from, and reading each token's kept set where the vocabulary is truncated.

For every call, the sampling settings the engine applies are read from its generate request, and a
LoRA policy's call is pinned to the newest adapter of that policy on its engine. For a call in a
session (a training call): non-neutral sampling is refused on an engine whose logprobs are raw
(checked once per engine: it must run with ``--logprobs-mode processed_logprobs``); a truncated
vocabulary (top-k / top-p / min-p) samples with a bounded top_k (``max_kept_tokens``) so that every
token's kept set can be read from the top logprobs (:class:`~agentrl.router.sampling.Capture`); and
with MoE capture on, the call gets its own request id, by which its routed experts are fetched.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from agentrl.engines.config import BASE_POLICY
from agentrl.engines.pool import Engine, EnginePool
from agentrl.router.call import Prepared
from agentrl.router.errors import EngineError
from agentrl.router.sampling import Capture, applied, check_processed, neutral, truncates

log = logging.getLogger(__name__)


class BehaviourCapture:
    def __init__(self, pool: EnginePool, counters: dict[str, float], max_kept_tokens: int) -> None:
        self.pool = pool
        self.counters = counters
        self.max_kept_tokens = max_kept_tokens
        self._processed: dict[str, bool] = {}  # engine name -> whether it reports processed logprobs

    async def prepare(self, prep: Prepared, *, expert_ids: bool) -> None:
        """Read the call's sampling as the engine will apply it (its generate request's params); for a
        recorded call, make sure its logprobs will be the behaviour distribution's, and where the
        vocabulary is truncated, ask for what reading each token's kept set needs. ``expert_ids``:
        give a recorded call its own request id (MoE capture fetches its routing by it)."""
        sp = prep.gen_req["sampling_params"]
        prep.sampling = applied(sp)
        adapter = prep.engine.adapter(prep.policy)
        if (
            adapter is not None
        ):  # a LoRA policy: the newest version of it this engine holds, for the whole call
            prep.gen_req["model"], prep.adapter_version = adapter
        elif prep.policy == BASE_POLICY or ":" in prep.policy:
            # the base weights by name ("base"), or an earlier or pinned version of a policy that
            # does not exist yet: version 0, not the stamp the engine's weights carry (LoRA serve
            # stamps the default policy's newest version there)
            prep.adapter_version = 0
        if prep.session is None:
            return
        if expert_ids:
            prep.gen_req["request_id"] = (
                f"{prep.gen_req.get('request_id') or 'agentrl'}-{uuid.uuid4().hex[:12]}"
            )
        if not neutral(prep.sampling):
            await self._check_processed(prep.engine, prep.prompt_ids, prep.gen_req.get("model"))
        if truncates(prep.sampling):
            top_k = prep.sampling["top_k"]
            prep.capture = Capture.plan(sp, prep.sampling, max_kept=self.max_kept_tokens)
            if top_k != prep.sampling["top_k"]:
                if not self.counters["kept_bounded"]:
                    log.warning("a training call truncates the vocabulary "
                                "with top_k %d (top_p %g, min_p %g): it "
                                "samples with top_k %d (router.max_kept_tokens) "
                                "so each token's kept set can be recorded; "
                                "the bound is recorded and returned", top_k, prep.sampling["top_p"],
                                prep.sampling["min_p"], self.max_kept_tokens)
                self.counters["kept_bounded"] += 1

    async def _check_processed(self, engine: Engine, prompt_ids: list[int], model: str | None) -> None:
        """Refuse to record non-neutral sampling from an engine whose logprobs are raw (checked once)."""
        ok = self._processed.get(engine.name)
        if ok is None:
            ok = self._processed[engine.name] = await check_processed(self.pool, engine, prompt_ids, model)
            if not ok:
                log.error("engine %s reports raw logprobs: training "
                          "calls with non-neutral sampling are refused",
                          engine.name)
        if not ok:
            raise EngineError(f"engine {engine.name} reports raw logprobs, which ignore temperature, "
                              "penalties and top-k/top-p: start it with --logprobs-mode processed_logprobs")

    def read_kept(self, prep: Prepared, choice: dict[str, Any]) -> list[list[int]] | None:
        """A recorded truncated call's kept sets for ``choice`` (its top logprobs trimmed to the
        client's); None for other calls."""
        if prep.capture is None:
            return None
        before = prep.capture.incomplete
        kept = prep.capture.read(choice)
        self.counters["kept_captured"] += len(kept)
        if prep.capture.incomplete > before:
            if not self.counters["kept_incomplete"]:
                log.warning("a kept set held more than the call's top_k %d ids (ties at the "
                            "boundary): recorded as far as seen, counted as kept_incomplete", prep.capture.k)
            self.counters["kept_incomplete"] += prep.capture.incomplete - before
        return kept
