"""Teacher logprobs for on-policy distillation: a teacher model scores the tokens the student sampled.

For each sample of a finished episode the teacher is given the sample's exact token ids (prompt,
completions and tool outputs, as the student saw them) on vLLM's completions route, with
``prompt_logprobs: 0``: one forward pass that returns, at each position, the teacher's logprob of
the token that is there. The logprobs of the positions the student generated (its loss mask) are
kept on the sample (``Sample.teacher_logprobs``, NaN elsewhere) and the learner's distillation
term uses them (``learn.loss.distill_coef``, :func:`agentrl.learner.advantages.distilled_advantages`).

The teacher must share the student's tokenizer: the same ids must mean the same text. It runs as
a scorer of the scoring stage (bounded by ``scoring.timeout_s``, transport-only retries); its
value for the episode is the mean of ``log mu - log pi_teacher`` over the tokens it scored (the
reverse-KL estimate), which ``scoring.teacher.weight`` (default 0) adds to the reward, so a teacher
whose endpoint fails fails the episode (kind ``scoring``) instead of training it without its term.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.scoring.config import TeacherConfig

if TYPE_CHECKING:
    from agentrl.rollout.episode import EpisodeResult


class Teacher:
    """``await teacher(task, episode)``: the teacher's logprobs put on each of the episode's samples;
    returns the episode's mean ``log mu - log pi_teacher`` over them."""

    def __init__(self, cfg: TeacherConfig, *, timeout_s: float, retries: int, url: str = "", key: str = "",
                 version: Callable[[], int] | None = None) -> None:
        """``url``, ``key``: the endpoint and its key when not ``cfg``'s (self-distillation's teacher
        engine); ``version``: the teacher's policy version now, recorded on each scored sample."""
        from agentrl.client import ServeClient

        self.cfg, self.version = cfg, version
        key = key or (os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else "")
        self.model = "teacher" if url else cfg.model  # an engine serve launched serves the name "teacher"
        self.client = ServeClient(url or cfg.url, key, timeout_s=timeout_s, retries=retries, backoff_s=0.5)

    async def __call__(self, task: dict[str, Any], episode: EpisodeResult) -> float:
        gaps = []
        who: dict[str, Any] = {"name": self.cfg.name or self.cfg.model or self.model}
        if self.version is not None:
            # before the calls: a version that changes mid-episode is not mixed
            who["version"] = self.version()
        for s in episode.samples:
            mask = s.loss_mask != 0
            mask[0] = False  # the first token has no context to be predicted from
            if not mask.any():
                continue
            teacher, top_ids, top_lps = await self.logprobs([int(t) for t in s.token_ids], self.cfg.top_k)
            teacher[~mask] = math.nan
            s.teacher_logprobs = teacher
            if self.cfg.top_k:
                top_ids[~mask], top_lps[~mask] = -1, math.nan
                s.teacher_topk_ids, s.teacher_topk_logprobs = top_ids, top_lps
            s.info["teacher"] = dict(who)
            gaps.append(s.logprobs[mask] - teacher[mask])
        return float(np.concatenate(gaps).mean()) if gaps else 0.0

    async def logprobs(
        self, token_ids: list[int], top_k: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The teacher's log p(token_t | tokens_<t) at each position (NaN at 0), float32; with
        ``top_k``, also its ``top_k`` most likely tokens at each position and their logprobs,
        [positions, top_k] in rank order (-1 and NaN at 0), else [positions, 0]."""
        body = {"model": self.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": top_k}
        reply = await self.client.json("POST", "/completions", json=body)
        try:
            rows = reply["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"the teacher answered no prompt logprobs: {str(reply)[:300]}") from None
        if not isinstance(rows, list) or len(rows) != len(token_ids):
            raise ValueError(f"the teacher gave {len(rows) if isinstance(rows, list) else rows!r} "
                             f"prompt logprobs for {len(token_ids)} tokens")
        out = np.full(len(token_ids), math.nan, dtype=np.float32)
        top_ids = np.full((len(token_ids), top_k), -1, dtype=np.int32)
        top_lps = np.full((len(token_ids), top_k), math.nan, dtype=np.float32)
        for t in range(1, len(token_ids)):
            row = rows[t] if isinstance(rows[t], dict) else {}
            entry = row.get(str(token_ids[t]))
            if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), (int, float)):
                raise ValueError(f"the teacher's prompt logprobs hold no logprob of token {token_ids[t]} at "
                                 f"position {t}: {str(rows[t])[:200]}")
            out[t] = entry["logprob"]
            if top_k:
                top_ids[t], top_lps[t] = _top(row, top_k, t)
        return out, top_ids, top_lps

    async def close(self) -> None:
        await self.client.close()


def _top(row: dict[str, Any], k: int, t: int) -> tuple[list[int], list[float]]:
    """The ``k`` entries of ranks 1..k of one position's prompt logprobs (vLLM adds the token that is
    there when it ranks lower), as ids and logprobs in rank order."""
    try:
        ranked = sorted((int(e["rank"]), int(tok), float(e["logprob"])) for tok, e in row.items()
                        if isinstance(e, dict) and isinstance(e.get("rank"), int) and 1 <= e["rank"] <= k)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"the teacher's top-{k} prompt logprobs at "
                         f"position {t} are malformed: {str(row)[:200]}") from None
    ranked = ranked[:k]  # a tie with the k-th can rank the token that is there within k too
    if len(ranked) < k or not all(math.isfinite(lp) for *_, lp in ranked):
        raise ValueError(f"the teacher gave {len(ranked)} of the top {k} prompt logprobs at position {t}: "
                         f"{str(row)[:200]}")
    return [tok for _, tok, _ in ranked], [lp for *_, lp in ranked]
