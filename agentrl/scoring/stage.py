"""The scoring stage: each finished episode's scorers, bounded, before its samples go to the buffer.

The orchestrator hands an episode here once its agent loop is done, outside the loops' concurrency
(:class:`~agentrl.rollout.orchestrator.Orchestrator`): a slow scorer holds a scoring slot, never an
agent loop. Each scorer call is bounded by ``timeout_s`` (its retries included); a judge retries
only what failed in transport. An episode a scorer failed on is failed with the error kind
``scoring`` (its samples are kept as data and not trained), never given a reward of 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.env.base import MIX_TAG
from agentrl.errors import AgentrlError, ConfigError, TransportError
from agentrl.scoring.config import JudgeConfig, ScoringConfig
from agentrl.scoring.registry import Scorer, Splitter, get_scorer, splitter_of, whole_turn

if TYPE_CHECKING:
    from agentrl.buffer.sample import Sample
    from agentrl.rollout.episode import EpisodeResult
    from agentrl.scoring.teacher import Teacher

log = logging.getLogger(__name__)

_GRADE = re.compile(r"-?\d+")
_LINE = re.compile(r"^\s*(?:answer\s*)?(\d+)\s*[:.)=-]\s*(-?\d+)", re.IGNORECASE)


def _turn_spans(samples: list[Sample]) -> list[tuple[int, int, int]]:
    """(sample index, start, end) of each generated turn: the runs of a nonzero loss mask, sample
    after sample, in order."""
    spans = []
    for i, s in enumerate(samples):
        generated = np.concatenate([[False], np.asarray(s.loss_mask) != 0, [False]])
        edges = np.flatnonzero(generated[1:] != generated[:-1])  # run starts and ends, alternately
        spans += [(i, int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    return spans


def generated_turns(episode: EpisodeResult) -> list[list[int]]:
    """The token ids of each turn the model generated in ``episode``, in order: what a per-turn
    scorer returns one reward for (decode them with the served model's tokenizer)."""
    return [episode.samples[i].token_ids[a:b].tolist() for i, a, b in _turn_spans(episode.samples)]


def _segment_spans(samples: list[Sample], split: Splitter) -> list[tuple[int, int, int]]:
    """(sample index, start, end) of each segment: every generated turn cut at the end offsets
    ``split`` gives for it (the turn's end always one). Raises ValueError on offsets that are not
    increasing whole numbers within the turn."""
    spans = []
    for i, a, b in _turn_spans(samples):
        ends = split(samples[i].token_ids[a:b].tolist())
        if not isinstance(ends, list | tuple) or not all(isinstance(e, int) and not isinstance(e, bool)
                                                         for e in ends):
            raise ValueError(f"the splitter must return a list of token offsets, not {str(ends)[:200]}")
        if list(ends) != sorted(set(ends)) or (ends and not 1 <= ends[0] <= ends[-1] <= b - a):
            raise ValueError(f"the splitter's offsets {list(ends)[:20]} are not increasing within the turn's "
                             f"{b - a} tokens")
        if not ends or ends[-1] != b - a:
            ends = [*ends, b - a]
        starts = [0, *ends[:-1]]
        spans += [(i, a + lo, a + hi) for lo, hi in zip(starts, ends, strict=True)]
    return spans


def generated_segments(episode: EpisodeResult, split: Splitter) -> list[list[int]]:
    """The token ids of each segment of the turns the model generated in ``episode``, in order, as
    ``split`` cuts them (:func:`~agentrl.scoring.registry.split_text`, ...): what a scorer
    registered with that ``split`` returns one reward for."""
    return [episode.samples[i].token_ids[a:b].tolist() for i, a, b in _segment_spans(episode.samples, split)]


def place_turn_rewards(samples: list[Sample], rewards: Any, weight: float,
                       split: Splitter = whole_turn) -> float:
    """A process scorer's ``rewards`` (times ``weight``), one per segment (per generated turn unless
    ``split`` cuts the turns finer), added to the samples' ``token_rewards`` on the last token of
    each segment. The generated turns are the runs of a nonzero loss mask, sample after sample, in
    order (an episode split into several samples has its turns in order across them). Returns the
    rewards' mean. Raises ValueError when the rewards are not finite numbers, one per segment."""
    if not isinstance(rewards, list | tuple) or not all(isinstance(r, int | float) and math.isfinite(r)
                                                         for r in rewards):
        raise ValueError(f"a process scorer must return a list of finite numbers, not {str(rewards)[:200]}")
    ends = [(i, b - 1) for i, _, b in _segment_spans(samples, split)]
    if len(ends) != len(rewards):
        what = "generated turns" if split is whole_turn else "segments"
        raise ValueError(f"returned {len(rewards)} rewards for the episode's {len(ends)} {what}")
    for (i, p), r in zip(ends, rewards, strict=True):
        s = samples[i]
        if s.token_rewards is None:
            s.token_rewards = np.full(len(s.token_ids), np.nan, dtype=np.float32)
        s.token_rewards[p] = (0.0 if np.isnan(s.token_rewards[p]) else s.token_rewards[p]) + weight * float(r)
    return float(np.mean(rewards)) if len(rewards) else 0.0


class ScoringFailure(AgentrlError):
    """One scorer could not score one episode (the message says which and why); ``outage`` when
    its endpoint could not be reached or answered 5xx / 429 after its retries."""

    def __init__(self, message: str, *, outage: bool = False) -> None:
        super().__init__(message)
        self.outage = outage


def task_text(task: dict[str, Any]) -> str:
    """What a judge is shown of the task: its prompt or question, else the whole task."""
    for key in ("prompt", "question", "problem", "instruction"):
        if isinstance(task.get(key), str):
            return task[key]
    return json.dumps(task, default=str)


def _fill(template: str, **fields: str) -> str:
    """``{name}`` placeholders filled in, and nothing else touched (a rubric may hold other braces)."""
    for name, value in fields.items():
        template = template.replace("{" + name + "}", value)
    return template


class Judge:
    """An LLM judge over any OpenAI-compatible chat endpoint. Pointwise: the rubric with the task
    and one episode's final answer, one integer grade back. Group (RULER-style): the group rubric
    with every member's answer numbered, one ``N: G`` line per answer back. A grade over ``scale``
    is the reward."""

    def __init__(self, cfg: JudgeConfig, *, timeout_s: float, retries: int,
                 endpoint: tuple[str, str, str] | None = None) -> None:
        """``endpoint``: (base URL, key, model) when not ``cfg``'s (serve's own engine: ``cfg.engine``)."""
        from agentrl.client import ServeClient

        self.cfg = cfg
        url, key, model = endpoint or (
            cfg.url,
            os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else "",
            cfg.model,
        )
        self.model = cfg.model or model
        self.client = ServeClient(url, key, timeout_s=timeout_s, retries=retries, backoff_s=0.5)
        grades = "|".join(str(g) for g in range(cfg.scale, -1, -1))  # longest first: 10 before 1
        self._grades = f"(?:{grades})"

    async def __call__(self, task: dict[str, Any], episode: EpisodeResult) -> float:
        c = self.cfg
        prompt = _fill(
            c.rubric, task=task_text(task), answer=episode.answer or "(no answer)", scale=str(c.scale)
        )
        text = await self._ask(prompt, {"choice": [str(g) for g in range(c.scale + 1)]}, c.max_tokens)
        found = _GRADE.search(text)
        grade = int(found.group()) if found else None
        if grade is None or not 0 <= grade <= c.scale:
            raise ValueError(f"the judge's reply {text[:200]!r} is not a grade from 0 to {c.scale}")
        return grade / c.scale

    async def grade_group(self, task: dict[str, Any], answers: list[str]) -> list[float]:
        c = self.cfg
        listed = "\n\n".join(f"Answer {i}:\n{a or '(no answer)'}" for i, a in enumerate(answers, start=1))
        prompt = _fill(c.group_rubric, task=task_text(task), answers=listed, scale=str(c.scale))
        pattern = "\n".join(f"{i}: {self._grades}" for i in range(1, len(answers) + 1))
        text = await self._ask(prompt, {"regex": pattern}, c.max_tokens * len(answers))
        grades: dict[int, int] = {}
        for line in text.splitlines():
            if m := _LINE.match(line):
                grades.setdefault(int(m.group(1)), int(m.group(2)))
        if sorted(grades) != list(range(1, len(answers) + 1)) or not all(
            0 <= g <= c.scale for g in grades.values()
        ):
            raise ValueError(f"the judge's reply {text[:300]!r} is not one line 'N: G' (G "
                             f"from 0 to {c.scale}) for each of the {len(answers)} answers")
        return [grades[i] / c.scale for i in range(1, len(answers) + 1)]

    async def _ask(self, prompt: str, structured: dict[str, Any], max_tokens: int) -> str:
        c = self.cfg
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens, "temperature": c.temperature}
        if c.choices_only:
            body["structured_outputs"] = structured
        reply = await self.client.json("POST", "/chat/completions", json=body)
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"the judge answered no chat completion: {str(reply)[:300]}") from None

    async def close(self) -> None:
        await self.client.close()


@dataclass
class _Group:
    """A group's episodes on their way to a group judge: complete once ``expected`` have arrived
    (failed ones included); the one judge call's grades are shared by the members."""

    expected: int
    arrived: list[EpisodeResult] = field(default_factory=list)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    call: asyncio.Future | None = None  # the judge's call, made once for the members present
    graded: list[str] = field(default_factory=list)  # episode ids in the order the judge saw them


class ScoringStage:
    """``await stage(task, episode)``: score the episode in place (its reward and its samples'), or
    fail it with kind ``scoring``. At most ``concurrency`` episodes are scored at once."""

    def __init__(self, cfg: ScoringConfig, scorers: dict[str, tuple[Scorer, float]] | None = None, *,
                 group_size: int = 1, teacher: Teacher | None = None, env_name: str = "",
                 judge_endpoint: tuple[str, str, str] | None = None) -> None:
        """``teacher``: the teacher scorer when it is not ``cfg.teacher.url``'s (self-distillation's).
        ``judge_endpoint``: (base URL, key, model) of serve's own engine, for ``cfg.judge.engine``.
        ``env_name``: the run's environment, an episode's own unless its task names one (a mix:
        :data:`~agentrl.env.base.MIX_TAG`); ``cfg.teachers`` are chosen by it."""
        cfg.check()
        self.cfg, self.group_size, self.env_name = cfg, group_size, env_name
        # Scorers for one environment's episodes only (a teacher of scoring.teachers): name -> environment
        self.env_of: dict[str, str] = {}
        self.group_judge: Judge | None = None
        self._own: list[Any] = []  # the scorers made here, each with an HTTP client to close
        if scorers is None:
            scorers = {name: (get_scorer(name), weight) for name, weight in cfg.scorers.items()}
            if cfg.judge.engine and judge_endpoint is None:
                raise ConfigError("scoring.judge.engine: the judge is serve's own engine, which agentrl "
                                  "serve names (not with serve --ray, whose engines are the cluster's)")
            if cfg.judge.url or cfg.judge.engine:
                judge = Judge(
                    cfg.judge, timeout_s=cfg.timeout_s, retries=cfg.retries, endpoint=judge_endpoint
                )
                self._own.append(judge)
                if cfg.judge.mode == "group":
                    self.group_judge = judge
                    scorers["judge"] = (self._graded_in_group, cfg.judge.weight)
                else:
                    scorers["judge"] = (judge, cfg.judge.weight)
            if teacher is None and cfg.teacher.url:
                from agentrl.scoring.teacher import Teacher

                teacher = Teacher(cfg.teacher, timeout_s=cfg.timeout_s, retries=cfg.retries)
            if teacher is not None:
                self._own.append(teacher)
                scorers["teacher"] = (teacher, cfg.teacher.weight)
            for env, tcfg in cfg.teachers.items():
                from agentrl.scoring.teacher import Teacher

                own = Teacher(tcfg, timeout_s=cfg.timeout_s, retries=cfg.retries)
                self._own.append(own)
                scorers[f"teacher:{env}"] = (own, tcfg.weight)
                self.env_of[f"teacher:{env}"] = env
        self.scorers = scorers
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._groups: dict[str, _Group] = {}  # group mode: groups some of whose members are still playing
        self._member_of: dict[str, _Group] = {}  # episode id -> its group, until its grade is read
        self.outage = 0  # episodes in a row a scorer's endpoint was down for (the orchestrator backs off)
        self.counters: dict[str, int] = {"scored": 0, "failed": 0, "timeouts": 0, "waiting": 0, "scoring": 0,
                                         "waiting_for_group": 0}
        self.per_scorer: dict[str, dict[str, float]] = {
            name: {"calls": 0, "failures": 0, "seconds": 0.0, "reward_sum": 0.0} for name in scorers}

    async def __call__(self, task: dict[str, Any], episode: EpisodeResult,
                       members: int | None = None) -> None:
        """Score ``episode``; ``members``: how many episodes its group plays here (a group judge
        waits for them; default the configured group size)."""
        group = self._arrive(episode, members) if self.group_judge is not None else None
        if episode.error is not None:  # a failed episode is not trained: nothing to score
            return
        scorers = self._for(task.get(MIX_TAG) or self.env_name)
        c = self.counters
        if group is not None:
            await self._whole(group)
        c["waiting"] += 1
        entered = False
        try:
            async with self._slots:
                c["waiting"] -= 1
                entered = True
                c["scoring"] += 1
                try:
                    outcomes = await asyncio.gather(*(self._one(name, fn, task, episode)
                                                      for name, (fn, _) in scorers.items()),
                                                    return_exceptions=True)
                finally:
                    c["scoring"] -= 1
        finally:
            if not entered:
                c["waiting"] -= 1
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            for f in failures:
                if not isinstance(f, ScoringFailure):
                    raise f  # cancellation, or a bug of the stage itself
            c["failed"] += 1
            self.outage = self.outage + 1 if any(f.outage for f in failures) else 0
            message = "ScoringError: " + "; ".join(str(f) for f in failures)
            log.warning("episode %s dropped from its group: %s", episode.episode_id, message)
            episode.fail("scoring", message[:2000])
            for s in episode.samples:
                s.error, s.error_kind = episode.error, "scoring"
            return
        values = dict(zip(scorers, outcomes, strict=True))
        c["scored"] += 1
        self.outage = 0
        episode.reward = self._combine(episode.reward, values, episode.info)
        for s in episode.samples:
            s.reward = self._combine(s.reward, values, s.info)

    def _for(self, env: str) -> dict[str, tuple[Scorer, float]]:
        """The scorers of an episode of ``env``: a teacher of ``scoring.teachers`` scores its own
        environment's episodes only, and the run's ``teacher`` those of the others."""
        return {name: s for name, s in self.scorers.items()
                if self.env_of.get(name, env) == env and not (name == "teacher" and env in self.cfg.teachers)}

    # -- group mode: a group's members graded together, in one judge call ----------------------------
    def _arrive(self, episode: EpisodeResult, members: int | None) -> _Group:
        gid = episode.group_id
        group = self._groups.get(gid)
        if group is None:
            group = self._groups[gid] = _Group(expected=members or self.group_size)
        group.arrived.append(episode)
        if episode.error is None:
            self._member_of[episode.episode_id] = group
        if len(group.arrived) >= group.expected:
            group.complete.set()
            del self._groups[gid]
        return group

    async def _whole(self, group: _Group) -> None:
        """Wait (holding no scoring slot) until the group's other members have finished, at most
        ``group_wait_s``; then the members present are graded together."""
        self.counters["waiting_for_group"] += 1
        try:
            async with asyncio.timeout(self.cfg.group_wait_s):
                await group.complete.wait()
        except TimeoutError:
            if not group.complete.is_set():
                gid = group.arrived[0].group_id
                log.warning(
                    "group %s: %d of %d episodes after %.0f s; grading those",
                    gid,
                    len(group.arrived),
                    group.expected,
                    self.cfg.group_wait_s,
                )
                group.complete.set()
                if self._groups.get(gid) is group:
                    del self._groups[gid]
        finally:
            self.counters["waiting_for_group"] -= 1

    async def _graded_in_group(self, task: dict[str, Any], episode: EpisodeResult) -> float:
        group = self._member_of.pop(episode.episode_id)
        if group.call is None:  # the first member here asks the judge for the whole group
            assert self.group_judge is not None
            group.graded = [e.episode_id for e in group.arrived if e.error is None]
            answers = [e.answer for e in group.arrived if e.error is None]
            group.call = asyncio.ensure_future(self.group_judge.grade_group(task, answers))
        grades = await asyncio.shield(group.call)  # one member's timeout leaves the call to the others
        return grades[group.graded.index(episode.episode_id)]

    def _combine(self, env_reward: float, values: dict[str, float], info: dict[str, Any]) -> float:
        """The outcome reward: the environment's and each scorer's by weight (a process scorer's
        rewards are on the samples' tokens; its value here, their mean, is kept by name only)."""
        info["rewards"] = {"env": env_reward, **values}
        total = self.cfg.env_weight * env_reward
        for name, value in values.items():
            fn, weight = self.scorers[name]
            if splitter_of(fn) is None:  # an outcome scorer
                total += weight * value
        return total

    async def _one(self, name: str, fn: Scorer, task: dict[str, Any], episode: EpisodeResult) -> float:
        stats = self.per_scorer[name]
        stats["calls"] += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                got = await fn(task, episode)
            split = splitter_of(fn)
            if split is not None:  # a process scorer: its rewards go on its segments' last tokens
                value = place_turn_rewards(episode.samples, got, self.scorers[name][1], split)
            else:
                value = float(got)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except TimeoutError:
            stats["failures"] += 1
            self.counters["timeouts"] += 1
            raise ScoringFailure(f"{name} took longer than {self.cfg.timeout_s:g} s") from None
        except asyncio.CancelledError:
            raise
        except TransportError as e:
            stats["failures"] += 1
            raise ScoringFailure(f"{name}: {e}"[:1000], outage=e.retryable) from None
        except Exception as e:
            stats["failures"] += 1
            raise ScoringFailure(f"{name}: {type(e).__name__}: {e}"[:1000]) from None
        finally:
            stats["seconds"] += time.monotonic() - t0
        stats["reward_sum"] += value
        return value

    def status(self) -> dict[str, Any]:
        return {
            **self.counters,
            "outage": self.outage,
            "scorers": {n: dict(s) for n, s in self.per_scorer.items()},
        }

    async def close(self) -> None:
        for client in self._own:  # the judge's and the teacher's HTTP clients
            await client.close()
