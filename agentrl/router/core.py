"""The router's call path, independent of HTTP: validate, render, generate, derender, record.

Every chat completion goes render -> token-in generate -> derender on one engine, so the router
holds the exact prompt ids, sampled ids, behaviour logprobs and the weight version of every
sampled token (vLLM reports version spans over output indexes). The built-in agent loop calls
:meth:`Router.chat` in-process; HTTP clients reach the same method through the server.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

from agentrl.router.errors import EngineError, InvalidRequest, NotFound
from agentrl.router.pool import Engine, EnginePool, parse_version
from agentrl.router.sessions import CallRecord, Session, continued_prompt, normalize_message

log = logging.getLogger(__name__)

_ALLOWED_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _token_versions(choice: dict[str, Any], n: int) -> list[int]:
    versions = [0] * n
    for span in choice.get("weight_versions") or []:
        v = parse_version(span.get("version"))
        for i in range(max(0, span.get("start", 0)), min(n, span.get("end", n))):
            versions[i] = v
    return versions


class Router:
    def __init__(self, pool: EnginePool, *, model_name: str, eos_token_ids: set[int],
                 max_model_len: int, sessions_dir: Path | None = None, retries: int = 1) -> None:
        self.pool = pool
        self.model_name = model_name
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.sessions_dir = sessions_dir
        self.retries = retries
        self.sessions: dict[str, Session] = {}
        self.counters: dict[str, float] = {
            "calls": 0, "errors_4xx": 0, "errors_5xx": 0, "prompt_tokens": 0, "completion_tokens": 0,
            "continued": 0, "splits": 0, "retries": 0,
        }
        if sessions_dir is not None:
            sessions_dir.mkdir(parents=True, exist_ok=True)

    # -- sessions ---------------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None, **meta: Any) -> Session:
        sid = session_id or uuid.uuid4().hex
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
        return self.sessions.pop(session_id, None)

    # -- the call path ----------------------------------------------------------------------------
    def validate(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in (self.model_name, "default"):
            raise InvalidRequest(f"the model {model!r} does not exist; this endpoint serves "
                                 f"{self.model_name!r}", param="model", code="model_not_found", status=404)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty list of chat messages", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ALLOWED_ROLES:
                raise InvalidRequest(f"messages[{i}] must be an object with a role in {sorted(_ALLOWED_ROLES)}",
                                     param=f"messages[{i}]")
        if body.get("stream"):
            raise InvalidRequest("stream=true is not supported by this endpoint yet", param="stream")
        n = body.get("n", 1)
        if not isinstance(n, int) or n < 1 or n > 64:
            raise InvalidRequest("'n' must be an integer between 1 and 64", param="n")
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InvalidRequest(f"'{key}' must be a positive integer", param=key)
        t = body.get("temperature")
        if t is not None and (not isinstance(t, (int, float)) or t < 0 or t > 2):
            raise InvalidRequest("'temperature' must be a number between 0 and 2", param="temperature")
        body = dict(body)
        body["model"] = self.model_name
        return body

    async def chat(self, body: Any, session_id: str | None = None) -> dict[str, Any]:
        """One chat completion through the pool, recorded in ``session_id`` when given."""
        self.counters["calls"] += 1
        t0 = time.perf_counter()
        try:
            body = self.validate(body)
            session = self.open_session(session_id) if session_id else None
            attempts = 1 + self.retries
            for attempt in range(attempts):
                engine = self.pool.pick(session_id)
                try:
                    return await self._chat_on(engine, body, session, t0)
                except EngineError:
                    if attempt + 1 >= attempts:
                        raise
                    self.counters["retries"] += 1  # nothing was streamed: safe to retry elsewhere
            raise AssertionError("unreachable")
        except InvalidRequest:
            self.counters["errors_4xx"] += 1
            raise
        except EngineError:
            self.counters["errors_5xx"] += 1
            raise

    async def _chat_on(self, engine: Engine, body: dict[str, Any], session: Session | None,
                       t0: float) -> dict[str, Any]:
        want_logprobs = bool(body.get("logprobs"))
        engine_body = dict(body, logprobs=True)  # behaviour logprobs are always captured
        engine_body.pop("top_logprobs", None) if not want_logprobs else None
        gen_req = await self.pool.call(engine, "/v1/chat/completions/render", engine_body)
        full_ids: list[int] = gen_req["token_ids"]
        prompt_ids = full_ids
        parent: CallRecord | None = None
        choice = 0
        if session is not None and session.records:
            found = session.find_parent(body["messages"])
            if found is not None:
                parent, choice = found
                k = len(parent.messages) + 1
                base_body = dict(engine_body, messages=body["messages"][:k], add_generation_prompt=False)
                base = await self.pool.call(engine, "/v1/chat/completions/render", base_body)
                ids = continued_prompt(parent, choice, base["token_ids"], full_ids, self.eos_token_ids)
                if ids is None:
                    parent = None
                else:
                    prompt_ids = ids
            if parent is None:
                session.splits += 1
                self.counters["splits"] += 1
            else:
                self.counters["continued"] += 1
        self._check_length(prompt_ids, gen_req.get("sampling_params", {}))
        gen_req["token_ids"] = prompt_ids
        gen = await self.pool.call(engine, "/inference/v1/generate", gen_req)
        completion = await self.pool.call(engine, "/v1/chat/completions/derender", {
            "generate_response": gen, "prompt_token_ids": prompt_ids, "prompt_tokens": len(prompt_ids),
            "chat_request": body,
        })
        comps = []
        for ch, out in zip(gen["choices"], completion["choices"], strict=True):
            ids = ch.get("token_ids") or []
            lps = [c["logprob"] for c in ((ch.get("logprobs") or {}).get("content") or [])]
            if len(lps) != len(ids):
                raise EngineError(f"engine {engine.name} returned {len(lps)} logprobs for {len(ids)} tokens")
            if ch.get("finish_reason") == "stop" and ch.get("stop_reason") is None and ids:
                self.eos_token_ids.add(ids[-1])
            comps.append({"token_ids": ids, "logprobs": lps, "versions": _token_versions(ch, len(ids)),
                          "finish_reason": ch.get("finish_reason"), "message": out["message"]})
            if not want_logprobs:
                out["logprobs"] = None
            out["token_ids"] = ids
        self.counters["prompt_tokens"] += len(prompt_ids)
        self.counters["completion_tokens"] += sum(len(c["token_ids"]) for c in comps)
        completion["model"] = self.model_name
        completion["prompt_token_ids"] = prompt_ids
        if session is not None:
            rec = CallRecord(
                session_id=session.session_id, index=len(session.records),
                parent=parent.index if parent else None, choice=choice, prompt_ids=prompt_ids,
                completions=comps, engine=engine.name, latency_s=time.perf_counter() - t0,
                messages=[normalize_message(m) for m in body["messages"]],
            )
            session.record(rec)
            completion["agentrl"] = {"session_id": session.session_id, "call_index": rec.index,
                                     "parent": rec.parent, "versions": [c["versions"] for c in comps]}
        return completion

    def _check_length(self, prompt_ids: list[int], sampling: dict[str, Any]) -> None:
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)}", param="messages", code="context_length_exceeded")
        max_tokens = sampling.get("max_tokens")
        if max_tokens is None or len(prompt_ids) + max_tokens > self.max_model_len:
            sampling["max_tokens"] = self.max_model_len - len(prompt_ids)
