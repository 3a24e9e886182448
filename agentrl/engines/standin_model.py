"""The stand-in engine's throughput model (:mod:`agentrl.engines.standin`): a scheduler that admits
requests into a KV cache of ``kv_tokens``, gives the running ones equal shares of ``tokens_per_s``
in steps of at least ``step_s`` (plus ``prefill_s_per_token`` per prompt token admitted), preempts
the newest when the cache overflows, and samples pseudo-random tokens with logprobs and the weight
version of the moment.

Invariants: a running sequence's KV is its prompt plus its output; ``kv_used`` is their sum after
every admission and step; a preempted sequence keeps its output, goes back to the front of the
queue and is prefilled again (prompt and output) when readmitted; nothing is generated while
``paused``. A step costs one sleep and a few Python operations per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

MASKED = -9999.0  # what vLLM's generate route sends for a -inf logprob (a token top-k/top-p masked)


@dataclass
class StandinConfig:
    """The throughput model and the sampler of one stand-in engine."""

    tokens_per_s: float = 2000.0  # decode tokens per second, shared equally by the running requests
    kv_tokens: int = 200_000  # KV cache capacity in tokens (prompt + output of the running requests)
    prefill_s_per_token: float = 0.0  # engine time per prompt token admitted (and re-admitted)
    max_running: int = 256  # vLLM's max_num_seqs: more wait
    step_s: float = 0.01  # the shortest engine step (longer steps batch more tokens per wake-up)
    eos_probability: float = 0.0  # the chance each sampled token ends the sequence (with an eos)
    seed: int = 0


@dataclass
class Sequence:
    """One choice of a generate request, as the scheduler sees it."""

    prompt_len: int
    max_tokens: int
    rng: random.Random
    logprobs: int | None  # top logprobs per token (None: no logprobs at all)
    top_k: int
    ignore_eos: bool
    stop_token_ids: frozenset[int]
    index: int = 0
    stream: bool = False  # the handler sends each step's tokens (else it waits for the finish)
    ids: list[int] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    credit: float = 0.0  # fractional tokens earned and not yet produced
    prefilled: bool = False
    preemptions: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # shared by a request's sequences

    @property
    def kv(self) -> int:
        return self.prompt_len + len(self.ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Throughput:
    """The scheduler: admits waiting sequences while the KV cache has room, then runs steps that
    hand each running sequence its share of ``tokens_per_s``; preempts the newest when the cache
    overflows. Counters feed ``/metrics``."""

    def __init__(self, config: StandinConfig, vocab: list[int], eos_ids: list[int]) -> None:
        self.config = config
        self.vocab = vocab
        self.eos_ids = eos_ids or [vocab[0]]
        self.version = "default"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused = False
        self.counters = {"preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                         "stop": 0, "length": 0, "abort": 0}
        self.kv_used = 0  # KV tokens the running sequences hold
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="standin-scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)
        self._wake.set()

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop sequences whose client went away (or a pause in mode abort)."""
        for s in seqs:
            if s.done:
                continue
            self._finish(s, "abort")
            if s in self.running:
                self.running.remove(s)
                self.kv_used -= s.kv
            with contextlib.suppress(ValueError):
                self.waiting.remove(s)

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self._wake.set()

    def reset_prefix_cache(self) -> None:
        """vLLM's reset with ``reset_running_requests``: the running sequences prefill again."""
        for s in self.running:
            s.prefilled = False

    async def _loop(self) -> None:
        while True:
            if self.paused or not (self.running or self.waiting):
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = self._admit()
            await asyncio.sleep(self.config.step_s + prefill * self.config.prefill_s_per_token)
            if self.paused:  # a pause(keep) that came during the step: its tokens wait for the resume
                continue
            self._step()

    def _admit(self) -> int:
        """Admit waiting sequences (FIFO) while there is room; the prompt tokens to prefill this step."""
        used = self.kv_used
        while self.waiting and len(self.running) < self.config.max_running:
            s = self.waiting[0]
            if self.running and used + s.kv + 1 > self.config.kv_tokens:
                break  # (a sequence alone is admitted whatever its size, as nothing else can free room)
            self.waiting.popleft()
            self.running.append(s)
            used += s.kv
        self.kv_used = used
        prefill = 0
        for s in self.running:
            if not s.prefilled:
                s.prefilled = True
                prefill += s.kv
                self.counters["prompt_tokens"] += s.kv
        return prefill

    def _step(self) -> None:
        self.counters["steps"] += 1
        share = self.config.tokens_per_s * self.config.step_s / max(1, len(self.running))
        used, finished = 0, False
        for s in self.running:
            s.credit += share
            made = int(s.credit)
            s.credit -= made
            for _ in range(made):
                self._sample(s)
                if s.done:
                    finished = True
                    break
            if s.done:
                continue
            used += s.kv
            if made and s.stream:  # a plain request wakes its handler only when it finishes
                s.changed.set()
        if finished:
            self.running = [s for s in self.running if not s.done]
        # Over capacity: preempt the newest (vLLM's recompute preemption: it frees its KV, keeps its
        # output and prefills it all again when readmitted).
        while used > self.config.kv_tokens and len(self.running) > 1:
            s = self.running.pop()
            used -= s.kv
            s.prefilled = False
            s.preemptions += 1
            self.counters["preemptions"] += 1
            self.waiting.appendleft(s)
        self.kv_used = used

    def _sample(self, s: Sequence) -> None:
        rng = s.rng
        n = len(s.ids) + 1
        if not s.ignore_eos and rng.random() < self.config.eos_probability:
            token = self.eos_ids[0]
        else:
            token = self.vocab[rng.randrange(len(self.vocab))]
        s.ids.append(token)
        if s.logprobs is not None:
            s.entries.append(self._entry(rng, token, s.logprobs, s.top_k))
        if s.spans and s.spans[-1]["version"] == self.version:
            s.spans[-1]["end"] = n
        else:
            s.spans.append({"version": self.version, "start": n - 1, "end": n})
        self.counters["generation_tokens"] += 1
        if token in s.stop_token_ids:
            self._finish(s, "stop")
            s.stop_reason = token
        elif token in self.eos_ids and not s.ignore_eos:
            self._finish(s, "stop")
        elif n >= s.max_tokens:
            self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        self.counters[reason] += 1
        s.changed.set()

    def _entry(self, rng: random.Random, token: int, n: int, top_k: int) -> dict[str, Any]:
        """A logprobs entry: the sampled token first (rank 1), then made-up runners-up. Under top-k,
        the kept ranks' probabilities sum to 1 and the others are masked, as processed logprobs are."""
        if n == 0:  # the common case (the router asks for no top logprobs): the sampled token alone
            lp = 0.0 if top_k == 1 else math.log(rng.uniform(0.2, 0.95))
            return {"token_id": token, "logprob": lp, "rank": 1,
                    "top_logprobs": [{"token_id": token, "logprob": lp, "rank": 1}]}
        shown = n
        kept = min(shown, top_k) if top_k > 0 else shown
        weights = [0.5 ** i for i in range(kept)]
        mass = 1.0 if 0 < top_k <= shown else rng.uniform(0.2, 0.95)  # top-k kept all the mass shown
        total = sum(weights)
        lps = [math.log(mass * w / total) for w in weights] + [MASKED] * (shown - kept)
        ids = [token]
        while len(ids) < shown:
            other = self.vocab[rng.randrange(len(self.vocab))]
            if other not in ids:
                ids.append(other)
        top = [{"token_id": t, "logprob": lp, "rank": r + 1}
               for r, (t, lp) in enumerate(zip(ids, lps, strict=True))]
        return {"token_id": token, "logprob": lps[0], "rank": 1, "top_logprobs": top}
