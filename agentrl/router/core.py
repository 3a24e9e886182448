"""The router's call path, independent of HTTP: validate, render, generate, derender, record.

Every completion goes render -> token-in generate -> derender on one engine, so the router holds
the exact prompt ids, sampled ids, behaviour logprobs and the weight version of every sampled token
(vLLM reports version spans over output indexes), with the sampling settings the engine applied and,
for a truncated call, the kept set of every token (:mod:`agentrl.router.sampling`). The built-in
agent loop calls :meth:`Router.chat`
in-process; HTTP clients reach the same methods through the server. Streaming calls
(:mod:`agentrl.router.streaming`) share the preparation and record the same :class:`CallRecord`.

``Router`` composes the parts of the path, each its own object or module: the session store and
its limits (:mod:`~agentrl.router.session_store`), policy naming and seed handling
(:mod:`~agentrl.router.request_rules`), the renderer choice and its calibration
(:mod:`~agentrl.router.renderers`), behaviour and kept-set capture (:mod:`~agentrl.router.behaviour`),
MoE expert capture (:mod:`~agentrl.router.experts`) and what a call leaves
(:mod:`~agentrl.router.call`). It imports no dialect: the wire protocols
(:mod:`agentrl.router.dialects`) translate onto :meth:`Router.chat` and :meth:`Router.complete`.

A chat call runs straight through (:meth:`Router.prepare_chat`, :meth:`Router._finish`): validate
-> pick the renderer, once (local when calibrated and it can render the body, else the engine's)
-> normalise the messages, once (to find the call it continues, and to record) -> render (the
whole conversation, or a continued call's new messages) -> generate -> derender -> record.

Retries: a call is retried on another engine only when the engine failed before anything was
returned to the client; a 4xx is never retried.

Session limits (:class:`~agentrl.router.session_store.SessionLimits`, set when a session is opened
for an external scaffold) refuse a call beyond the session's budget, and each call's ``max_tokens``
is capped, so a program that knows nothing of the episode's limits still keeps them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from agentrl.engines.pool import DEFAULT_POLICY, Engine, EnginePool
from agentrl.router.behaviour import BehaviourCapture
from agentrl.router.call import Prepared, completion_entry, record_call
from agentrl.router.chat_parity import (
    TokenText,
    blank_text,
    check_max_tokens,
    cut_at_stop,
    shown_choice,
    skips_special,
    tool_finish_reason,
)
from agentrl.router.errors import EngineError, InvalidRequest, RouterError
from agentrl.router.experts import ExpertCapture
from agentrl.router.metrics import RouterMetrics
from agentrl.router.render import LocalRenderer, Renderer, cap_to_room
from agentrl.router.renderers import Renderers
from agentrl.router.request_rules import SeedRule, default_policy, named_policy
from agentrl.router.session_store import SessionLimits, SessionStore
from agentrl.router.sessions import CallRecord, Completion, Session, SessionSummary, normalize_message
from agentrl.router.validate import validate_chat, validate_completion

__all__ = ["Prepared", "Router", "SessionLimits"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Router:
    def __init__(self, pool: EnginePool, *, model_name: str, eos_token_ids: set[int],
                 max_model_len: int, sessions_dir: Path | None = None, retries: int = 1,
                 model_dir: str | Path | None = None, render: str = "auto", ignore_seed: bool = False,
                 max_kept_tokens: int = 64, policies: Sequence[str] = (), serves_base: bool = False) -> None:
        """``render``: "auto" renders and derenders here when the model folder's tokenizer allows it
        and calibration against an engine agrees (else the engine's routes); "engine" always uses
        the engine's routes (three round trips per completion). ``ignore_seed``: drop requests'
        ``seed`` (counted as ``seeds_ignored``), for engines that crash on seeded requests.
        ``max_kept_tokens``: the largest kept set a recorded truncated call may sample from
        (:class:`~agentrl.router.sampling.Capture`; 0 refuses truncation without a top_k).
        ``policies``: named LoRA policies (serve.policies), the first the default: a request's
        ``model`` picks one. ``serves_base``: the engines serve LoRA adapters, so ``model: "base"``
        samples from the base weights (a frozen role); without it "base" is not a model here."""
        self._pool = pool
        self.model_name = model_name
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.retries = retries
        self.counters: dict[str, float] = {
            "calls": 0, "errors_4xx": 0, "errors_5xx": 0, "prompt_tokens": 0, "completion_tokens": 0,
            "continued": 0, "splits": 0, "retries": 0, "streams": 0, "streams_aborted": 0,
            "local_renders": 0, "engine_renders": 0, "local_derenders": 0, "engine_derenders": 0,
            "seeds_ignored": 0, "kept_captured": 0, "kept_bounded": 0, "kept_incomplete": 0,
            "routing_captured": 0, "routing_missing": 0,
        }
        self.policies = list(policies)
        self.serves_base = serves_base
        self.seeds = SeedRule(ignore_seed, self.counters)
        self.renderers = Renderers(pool, model_name=model_name, eos_token_ids=self.eos_token_ids,
                                   max_model_len=max_model_len, model_dir=model_dir, render=render,
                                   counters=self.counters)
        self.behaviour = BehaviourCapture(pool, self.counters, max_kept_tokens)
        self.experts: ExpertCapture | None = None  # an MoE model's routed-expert capture (capture_experts)
        self.store = SessionStore(sessions_dir)
        self.sessions: dict[str, Session] = self.store.sessions  # the store's own dict, not a copy
        self.metrics = RouterMetrics()
        self.metrics.watch(self)
        local = self.renderers.local
        # no prompt longer than this many characters can fit the context, however it tokenises; and no
        # body longer than this many bytes can carry such a prompt (a character is at most 6 bytes in
        # JSON, "\uXXXX"; 1 MiB for the structure around the text)
        self.max_prompt_chars = max_model_len * (local.max_token_chars if local is not None else 64)
        self.max_request_bytes = 6 * self.max_prompt_chars + (1 << 20)

    # -- the parts, by the names callers and tests read and set ----------------------------------
    @property
    def pool(self) -> EnginePool:
        return self._pool

    @pool.setter
    def pool(self, pool: EnginePool) -> None:
        """A pool set later (a test's second pool) is the one calibration and the processed-logprobs
        check call, as the router's own calls do; the engine renderer keeps the pool it was made with."""
        self._pool = self.renderers.pool = self.behaviour.pool = pool

    @property
    def ignore_seed(self) -> bool:
        return self.seeds.ignore

    @ignore_seed.setter
    def ignore_seed(self, ignore: bool) -> None:
        self.seeds.ignore = ignore

    @property
    def local(self) -> LocalRenderer | None:
        """The local renderer, None with ``render="engine"`` (or a model folder it cannot load)."""
        return self.renderers.local

    @property
    def engine_renderer(self) -> Renderer:
        return self.renderers.engine

    @property
    def token_text(self) -> TokenText | None:
        """The tokenizer's view of generated ids (special tokens, logprob token text), or None."""
        return self.renderers.token_text

    @property
    def render_state(self) -> str:
        """The local renderer's state: "unchecked" (not calibrated yet), "on", or "off"."""
        return self.renderers.state

    async def calibrate(self, engine: Engine) -> None:
        """Every check the call path would otherwise make on its first calls (:meth:`Renderers.calibrate`)."""
        await self.renderers.calibrate(engine)

    async def renderer_for(self, engine: Engine, body: dict[str, Any]) -> Renderer:
        return await self.renderers.for_call(engine, body)

    async def capture_experts(self) -> None:
        """Record the routed experts of every recorded call (an MoE model on engines with
        :mod:`agentrl.engines.routing`): bound on each engine now, and on each engine that rejoins."""
        if self.experts is None:
            self.experts = ExpertCapture(self.pool, self.counters)
        await self.experts.bind_all()

    async def routings(self, prep: Prepared, n: int) -> list[dict[str, Any] | None]:
        """The routed experts of a recorded call's ``n`` choices (all None when none are captured)."""
        request_id = prep.gen_req.get("request_id")
        if self.experts is None or prep.session is None or not request_id:
            return [None] * n
        return await self.experts.fetch(prep.engine, request_id, n)

    # -- sessions ---------------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None, limits: SessionLimits | None = None,
                     **meta: Any) -> Session:
        """The session ``session_id``, opened now unless it is open. ``meta["policy"]``: what its calls
        sample when their ``model`` names no policy (a name ``model`` could give: a named policy,
        ``"base"``, ``"<policy>:lag<k>"``)."""
        policy = meta.get("policy")
        if policy and self.named_policy({"model": policy})[1] is None:
            also = ", base, <policy>:lag<k> or <policy>:v<N>" if self.serves_base else ""
            raise InvalidRequest(f"a session's policy is one of the named policies {self.policies}"
                                 f"{also}, not {policy!r}",
                                 param="policy", code="invalid_policy")
        return self.store.open(session_id, limits, **meta)

    def get_session(self, session_id: str) -> Session:
        return self.store.get(session_id)

    def close_session(self, session_id: str) -> Session | None:
        self.pool.forget_session(session_id)
        return self.store.close(session_id)

    # -- the agent loop's chat-client seam (agentrl.rollout.protocols.ChatClient) -----------------
    async def begin(self, session_id: str, *, limits: SessionLimits | None = None, **meta: Any) -> None:
        """Open an episode's session (its calls are recorded; ``limits`` bound what it may spend)."""
        self.open_session(session_id, limits=limits, **meta)

    async def end(self, session_id: str) -> SessionSummary | None:
        """Close an episode's session: its samples and what it spent (None if it was never opened)."""
        session = self.store.sessions.get(session_id)
        summary = None if session is None else self.store.summary(session)
        self.close_session(session_id)
        await self.store.flush()  # the episode's log is complete once it is reported
        return summary

    async def flush_log(self) -> None:
        """Wait until every call recorded so far is in its session's log file."""
        await self.store.flush()

    def close(self) -> None:
        """Write the session log's queued records and stop its writer (an at-exit hook does it too)."""
        self.store.close_log()

    @staticmethod
    def _cap(sampling: dict[str, Any], cap: int) -> None:
        if cap:
            sampling["max_tokens"] = min(sampling.get("max_tokens") or cap, cap)

    # -- validation -------------------------------------------------------------------------------
    def named_policy(self, body: Any) -> tuple[Any, str | None]:
        """(``body`` with the served model's name in ``model``, the policy it named) when its
        ``model`` names one of the named policies; else (``body``, None)."""
        return named_policy(body, self.model_name, self.policies, base=self.serves_base)

    def policy_of(self, body: Any, session_default: str | None = None) -> tuple[Any, str]:
        """The call's policy and its body as the engines take it: a named policy when ``model``
        names one, else its session's (``session_default``, the ``policy`` of the session's meta: a
        role of an external multi-agent program), else the default (the first named policy, or the
        one unnamed policy)."""
        body, named = self.named_policy(body)
        if named is None and session_default:
            _, named = self.named_policy({"model": session_default})
        return body, named or default_policy(self.policies)

    def session_policy(self, session_id: str | None) -> str | None:
        """The policy a session's calls sample when their ``model`` names none (None: the default)."""
        session = self.store.sessions.get(session_id) if session_id else None
        return session.meta.get("policy") if session is not None else None

    def validate(self, body: Any) -> dict[str, Any]:
        return self.seeds.apply(validate_chat(body, self.model_name, self.max_prompt_chars))

    # -- the call path ----------------------------------------------------------------------------
    async def chat(self, body: Any, session_id: str | None = None, *, route: str = "chat") -> dict[str, Any]:
        """One chat completion through the pool, recorded in ``session_id`` when given (``route``
        labels its latency metric: the Responses and Messages APIs run as chat calls)."""
        async def once(engine: Engine, t0: float) -> dict[str, Any]:
            prep = await self.prepare_chat(engine, body, session_id, t0)
            return await self._finish(prep)
        return await self._counted(route, lambda: self.with_retries(session_id, once))

    async def complete(self, body: Any, session_id: str | None = None) -> dict[str, Any]:
        """One text completion (``/v1/completions``), token-exact and recorded like a chat call."""
        async def once(engine: Engine, t0: float) -> dict[str, Any]:
            prep = await self.prepare_completion(engine, body, session_id, t0)
            return await self._finish(prep)
        return await self._counted("completion", lambda: self.with_retries(session_id, once))

    async def _counted(self, route: str, fn: Callable[[], Awaitable[T]]) -> T:
        self.counters["calls"] += 1
        t0 = time.perf_counter()
        status = "200"
        try:
            return await fn()
        except RouterError as e:
            status = str(e.status)
            self.counters["errors_4xx" if e.status < 500 else "errors_5xx"] += 1
            raise
        finally:
            self.metrics.request_seconds.labels(route, status).observe(time.perf_counter() - t0)

    async def with_retries(self, session_id: str | None,
                           fn: Callable[[Engine, float], Awaitable[T]]) -> T:
        """Run ``fn`` on a picked engine; on an engine failure (nothing sent yet) try another one."""
        t0 = time.perf_counter()
        attempts = 1 + self.retries
        for attempt in range(attempts):
            try:
                engine = self.pool.pick(session_id)
            except EngineError:
                self.store.model_failure(session_id)
                raise
            try:
                return await fn(engine, t0)
            except EngineError as e:
                if attempt + 1 >= attempts:
                    self.store.model_failure(session_id)
                    raise
                self.counters["retries"] += 1
                log.warning("retrying a call after %s failed: %s", engine.name, e.message)
        raise AssertionError("unreachable")

    async def prepare_chat(self, engine: Engine, body: Any, session_id: str | None, t0: float) -> Prepared:
        # validate
        body, policy = self.policy_of(body, self.session_policy(session_id))
        body = self.validate(body)
        check_max_tokens(body, self.max_model_len)
        session = self.open_session(session_id) if session_id else None
        cap = self.store.admit(session)
        want_logprobs = bool(body.get("logprobs"))
        engine_body = dict(body, logprobs=True, stream=False)  # behaviour logprobs are always captured
        engine_body.pop("stream_options", None)
        if not want_logprobs:
            engine_body.pop("top_logprobs", None)
        # the renderer, once
        renderer = await self.renderers.for_call(engine, engine_body)
        # the messages normalised, once: to find the call this one continues, and to record
        messages = [normalize_message(m) for m in body["messages"]] if session is not None else None
        parent: CallRecord | None = None
        choice = 0
        if session is not None and messages is not None and session.records:
            parent, choice = session.find_parent(messages, policy) or (None, 0)
            if parent is not None:  # the same messages: record the parent's copies, not a second set
                messages[: len(parent.messages)] = parent.messages
        # render: the whole conversation, or a continued call's new messages
        prompt = await renderer.prompt(engine, engine_body, parent, choice, self.eos_token_ids)
        if session is not None and session.records:
            if prompt.continues:
                self.counters["continued"] += 1
            else:
                parent = None
                session.splits += 1
                self.counters["splits"] += 1
        self._check_length(prompt.ids)
        gen_req = renderer.generate_request(engine_body, prompt)
        self._cap(gen_req["sampling_params"], cap)
        prep = Prepared("chat", engine, body, gen_req, prompt.ids, session, parent, choice, want_logprobs, t0,
                        renderer, messages, policy=policy)
        await self.behaviour.prepare(prep, expert_ids=self.experts is not None)
        return prep

    async def prepare_completion(self, engine: Engine, body: Any, session_id: str | None,
                                 t0: float) -> Prepared:
        body, policy = self.policy_of(body, self.session_policy(session_id))
        body = self.seeds.apply(validate_completion(body, self.model_name))
        check_max_tokens(body, self.max_model_len)
        session = self.open_session(session_id) if session_id else None
        cap = self.store.admit(session)
        want_logprobs = body.get("logprobs") is not None
        engine_body = dict(body, stream=False, logprobs=body.get("logprobs") or 0)
        engine_body.pop("stream_options", None)
        rendered = await self.pool.call(engine, "/v1/completions/render", engine_body)
        gen_req = rendered[0] if isinstance(rendered, list) else rendered
        prompt_ids: list[int] = gen_req["token_ids"]
        self._cap(gen_req.setdefault("sampling_params", {}), cap)
        self._check_length(prompt_ids)
        cap_to_room(gen_req["sampling_params"], len(prompt_ids), self.max_model_len)
        prep = Prepared("completion", engine, body, gen_req, prompt_ids, session, None, 0, want_logprobs, t0,
                        policy=policy)
        await self.behaviour.prepare(prep, expert_ids=self.experts is not None)
        return prep

    async def _finish(self, prep: Prepared) -> dict[str, Any]:
        """Non-streaming: generate, derender, record."""
        engine = prep.engine
        gen = await self.pool.call(engine, "/inference/v1/generate", prep.gen_req)
        kept = [self.read_kept(prep, ch) for ch in gen["choices"]]  # trims the top logprobs to the client's
        chat = prep.kind == "chat"
        hidden = (
            self.token_text.special
            if chat and self.token_text and skips_special(prep.gen_req)
            else frozenset()
        )
        stripped = [shown_choice(ch, self.eos_token_ids, hidden) for ch in gen["choices"]]
        shown = dict(gen, choices=[ch for ch, _ in stripped])
        # logprobs in the chat route's shape are built here when the tokenizer is at hand (the
        # derender then needs none, and the local one takes the call)
        own_logprobs = chat and prep.want_logprobs and self.token_text is not None
        if prep.renderer is not None:
            body = {k: v for k, v in prep.body.items() if k not in ("logprobs", "top_logprobs")} \
                if own_logprobs else prep.body
            out = await prep.renderer.derender(engine, body, shown, prep.prompt_ids)
        else:
            out = await self.pool.call(engine, "/v1/completions/derender", {
                "generate_responses": [shown], "prompt_token_ids": [prep.prompt_ids],
                "prompt_tokens": [len(prep.prompt_ids)], "completion_request": prep.body})
        comps = []
        routings = await self.routings(prep, len(gen["choices"]))
        for ch, oc, (_, blank), ks, routing in zip(gen["choices"], out["choices"], stripped, kept, routings,
                                                   strict=True):
            if blank:
                blank_text(oc)
            text_end = cut_at_stop(oc, ch.get("stop_reason"))
            ids = ch.get("token_ids") or []
            entries = (ch.get("logprobs") or {}).get("content") or []
            lps = [c["logprob"] for c in entries]
            message = oc.get("message") if chat else {"role": "assistant", "content": oc.get("text")}
            comps.append(
                self.completion_entry(
                    engine,
                    ids,
                    lps,
                    ch.get("weight_versions"),
                    ch.get("finish_reason"),
                    ch.get("stop_reason"),
                    message,
                    ks,
                    routing,
                    adapter_version=prep.adapter_version,
                    text_end=text_end,
                )
            )
            if chat:
                oc["finish_reason"] = tool_finish_reason(prep.body, message, oc.get("finish_reason"))
            if own_logprobs:
                assert self.token_text is not None
                oc["logprobs"] = {
                    "content": self.token_text.entries(entries, int(prep.body.get("top_logprobs") or 0), [])
                }
            elif not prep.want_logprobs:
                oc["logprobs"] = None
            oc["token_ids"] = ids
        out["model"] = prep.policy if self.policies else self.model_name
        out["prompt_token_ids"] = prep.prompt_ids
        n_out = sum(len(c.token_ids) for c in comps)
        out["usage"] = {"prompt_tokens": len(prep.prompt_ids), "completion_tokens": n_out,
                        "total_tokens": len(prep.prompt_ids) + n_out}
        rec = self.record(prep, comps)
        if rec is not None:
            out["agentrl"] = {"session_id": rec.session_id, "call_index": rec.index, "parent": rec.parent,
                              "versions": [c.versions for c in comps], "sampling": rec.sampling}
        return out

    def read_kept(self, prep: Prepared, choice: dict[str, Any]) -> list[list[int]] | None:
        """A recorded truncated call's kept sets for ``choice`` (:meth:`BehaviourCapture.read_kept`)."""
        return self.behaviour.read_kept(prep, choice)

    def completion_entry(self, engine: Engine, ids: list[int], lps: list[float],
                         weight_versions: list[dict[str, Any]] | None, finish_reason: str | None,
                         stop_reason: int | str | None, message: dict[str, Any],
                         kept: list[list[int]] | None = None, routing: dict[str, Any] | None = None,
                         *, adapter_version: int | None = None, text_end: int | None = None) -> Completion:
        """One choice as captured (:func:`~agentrl.router.call.completion_entry`)."""
        return completion_entry(engine, ids, lps, weight_versions, finish_reason, stop_reason, message, kept,
                                routing, adapter_version=adapter_version, eos_token_ids=self.eos_token_ids,
                                text_end=text_end)

    def record(self, prep: Prepared, comps: list[Completion]) -> CallRecord | None:
        """Count the call's tokens and, in a session, write its record (as the call completes)."""
        self.counters["prompt_tokens"] += len(prep.prompt_ids)
        self.counters["completion_tokens"] += sum(len(c.token_ids) for c in comps)
        # the one unnamed policy's calls carry no name; the base weights and a lagged version do
        return record_call(prep, comps, prep.policy if self.policies or prep.policy != DEFAULT_POLICY else "")

    def _check_length(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)}", param="messages", code="context_length_exceeded")
