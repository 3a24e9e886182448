"""``serve.scoring``: the scoring stage between an episode's end and the buffer (docs/scoring.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agentrl.errors import ConfigError

DEFAULT_RUBRIC = (
    "You grade an assistant's final answer to a task. Reply with one integer from 0 (wrong or no "
    "answer) to {scale} (fully correct), and nothing else.\n\nTask:\n{task}\n\nFinal answer:\n{answer}")

GROUP_RUBRIC = (
    "You grade several answers to the same task against each other. For each answer write one line "
    "'N: G', N the answer's number and G an integer from 0 (worst) to {scale} (best), and nothing else.\n\n"
    "Task:\n{task}\n\n{answers}")


@dataclass
class JudgeConfig:
    """An LLM judge: any OpenAI-compatible chat endpoint grades each episode's final answer."""

    url: str = ""
    """the endpoint's base URL, e.g. http://127.0.0.1:8001/v1; empty: no judge, or serve's own engine
    (engine)"""
    model: str = ""  # the model name to ask for at that endpoint (with engine: serve's model, by default)
    engine: bool = False
    """The judge is serve's own model on serve's first engine (the policy as it is now), asked
    straight at the engine with serve's engine key, never through the router, so its calls are not
    training data; ``url`` stays empty. Not with ``serve --ray`` (the engines are the cluster's)."""
    api_key_env: str = ""  # environment variable that holds the endpoint's key (empty: none sent)
    rubric: str = DEFAULT_RUBRIC
    """The grading prompt of pointwise mode; ``{task}`` (the task's prompt or question) and ``{answer}``
    (the episode's final reply) are filled in, and ``{scale}``. The judge's reply must be an integer
    from 0 to ``scale``."""
    mode: Literal["pointwise", "group"] = "pointwise"
    """pointwise: each episode graded alone. group: a group's episodes graded together, relative to
    each other (RULER-style), in one call once the whole group has finished."""
    group_rubric: str = GROUP_RUBRIC
    """The grading prompt of group mode; ``{task}`` and ``{answers}`` (each final reply, numbered from
    1) are filled in, and ``{scale}``. The reply must hold one line ``N: G`` per answer."""
    scale: int = 10  # the judge's top grade; its grade / scale is the judge's reward, in [0, 1]
    weight: float = 1.0  # the judge's weight in the episode's reward
    max_tokens: int = 8  # the judge's reply length (a grade is a few tokens)
    temperature: float = 0.0  # the judge's sampling temperature (0: the same grade for the same episode)
    choices_only: bool = False
    """A vLLM endpoint: constrain the judge's reply to the grades ``0`` .. ``scale`` (vLLM's
    ``structured_outputs`` choice), so a small judge always answers one. Other endpoints may refuse it."""


@dataclass
class TeacherConfig:
    """A teacher for on-policy distillation: any vLLM endpoint serving a model with the student's
    tokenizer scores the student's sampled tokens (``Sample.teacher_logprobs``; docs/scoring.md)."""

    url: str = ""
    """the endpoint's base URL, e.g. http://127.0.0.1:8002/v1; empty: no teacher, or one serve launches
    (model)"""
    model: str = ""
    """The model name to ask for at ``url``; without a ``url``, the model serve launches an engine of
    for the teacher (as ``serve.model``: a built-in name such as ``tiny-agent``, a folder, a hub
    name), which must share the student's tokenizer."""
    api_key_env: str = ""  # environment variable that holds the endpoint's key (empty: none sent)
    name: str = ""  # recorded on each scored sample (info["teacher"]); default: the model name
    weight: float = 0.0
    """the episode's teacher KL (mean log mu - log pi_teacher) in its reward (negative: a penalty); 0: none"""
    top_k: int = 0
    """Also keep the teacher's ``top_k`` most likely tokens and their logprobs at each position it
    scores (``Sample.teacher_topk_ids`` / ``_logprobs``; vLLM's prompt logprobs, at most the
    engine's ``max_logprobs``, 20 by default), for the forward KL ``learn.loss.distill_topk_coef``;
    0: the sampled token's logprob only."""
    lag: int = 0
    """Self-distillation: the teacher is the student's own policy this many versions back, on an
    engine serve launches for it (``url`` and ``model`` stay empty); 0: the teacher is ``url``."""
    every: int = 1  # self-distillation: the teacher advances in steps of this many versions

    @property
    def launched(self) -> bool:
        """serve launches an engine of ``model`` for this teacher (no ``url`` of its own, no ``lag``)."""
        return bool(self.model) and not self.url and not self.lag


@dataclass
class ScoringConfig:
    """Scores each finished episode before its samples go to the buffer, off the agent loops'
    concurrency: the episode's reward becomes ``env_weight * (the environment's reward) + the
    weighted scorers``, each component kept by name in the samples' ``info["rewards"]``. A scorer
    that fails (times out, raises, or whose endpoint stays down) fails the episode with the error
    kind ``scoring``: its samples are not trained, never scored 0."""

    env_weight: float = 1.0  # the environment's own reward in the sum (0: scorers only)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)
    """Teachers chosen per environment: environment name -> a teacher at its own ``url`` (with
    ``model``, ``weight``, ``top_k``, ...), used for that environment's episodes instead of
    ``teacher`` (several teachers in one run of the ``mix`` environment); an environment named
    nowhere gets ``teacher``, or none."""
    scorers: dict[str, float] = field(default_factory=dict)
    """Scorers registered with ``@agentrl.scorer("name")`` (in ``env.import`` files), name -> weight."""
    concurrency: int = 16  # episodes scored at once; more wait for a slot (the agent loops do not)
    timeout_s: float = 60.0  # the most one scorer may take on one episode, its retries included
    retries: int = 3  # further tries of a judge call that failed in transport (no answer, 5xx, 429)
    group_wait_s: float = 1800.0
    """Group mode: how long a finished episode waits for the rest of its group (holding no scoring
    slot); past it the members present are graded together."""

    @property
    def enabled(self) -> bool:
        return bool(
            self.judge.url
            or self.judge.engine
            or self.teacher.url
            or self.teacher.model
            or self.teacher.lag
            or self.scorers
            or self.teachers
        )

    def check(self) -> None:
        if self.concurrency < 1:
            raise ConfigError("scoring.concurrency must be at least 1")
        if self.timeout_s <= 0:
            raise ConfigError("scoring.timeout_s must be positive")
        if self.retries < 0:
            raise ConfigError("scoring.retries must be at least 0")
        if self.judge.url and self.judge.engine:
            raise ConfigError("scoring.judge.url (a judge of your own) and "
                              "scoring.judge.engine (serve's own engine) exclude each other")
        if self.judge.url and not self.judge.model:
            raise ConfigError("scoring.judge.url is set: name the judge's model in scoring.judge.model")
        if self.teacher.url and not self.teacher.model:
            raise ConfigError("scoring.teacher.url is set: name the teacher's model in scoring.teacher.model")
        if not 0 <= self.teacher.top_k <= 20:
            raise ConfigError("scoring.teacher.top_k must be from 0 to 20 (vLLM's default max_logprobs)")
        if self.teacher.lag < 0 or self.teacher.every < 1:
            raise ConfigError("scoring.teacher.lag must be at least 0 and scoring.teacher.every at least 1")
        if self.teacher.lag and self.teacher.model and not self.teacher.url:
            raise ConfigError("scoring.teacher.lag (self-distillation: the teacher is "
                              "the student's own model) and scoring.teacher.model (a "
                              "model serve launches for the teacher) exclude each other")
        if self.teacher.lag and self.teacher.url:
            raise ConfigError("scoring.teacher.lag (self-distillation: serve launches the teacher) and "
                              "scoring.teacher.url (a teacher of your own) exclude each other")
        for env, t in self.teachers.items():
            if not (t.url and t.model) or t.lag:
                raise ConfigError(f"scoring.teachers.{env} needs a url and a model of its own (serve "
                                  "launches at most one teacher engine, scoring.teacher's), and no lag")
            if t.top_k != self.teacher.top_k:
                raise ConfigError(f"scoring.teachers.{env}.top_k ({t.top_k}) differs "
                                  f"from scoring.teacher.top_k ({self.teacher.top_k}): "
                                  "one run's teachers keep the same top-k")
        if self.judge.mode not in ("pointwise", "group"):
            raise ConfigError(f"scoring.judge.mode must be 'pointwise' or 'group', not {self.judge.mode!r}")
        if self.group_wait_s <= 0:
            raise ConfigError("scoring.group_wait_s must be positive")
        if self.judge.scale < 1:
            raise ConfigError("scoring.judge.scale must be at least 1")
