"""``agentrl tinker``: the Tinker API over HTTP, for the official ``tinker`` SDK and programs on it.

Role: the SDK reaches this service by ``base_url`` and an API key (``X-API-Key``). It fetches the
client config, opens a session (heartbeats keep it), creates LoRA training clients on the served
base model (:mod:`~agentrl.tinker.trainer`), submits ``forward_backward`` / ``optim_step`` /
``save_state`` / ``load_state``, publishes an adapter for sampling and samples it
(:mod:`~agentrl.tinker.sampler`). Each submission answers at once with a request id (a future), and
the SDK polls ``/api/v1/retrieve_future`` until the result is there. All model work runs on one
worker thread, in the order it arrived (the SDK submits one client's requests in its own order,
one turn at a time); engine calls run on the event loop.

Invariants:
- A key is a tenant: its sessions, training clients, futures and checkpoints (a folder of its own
  under ``state_dir``) are its own. Another key's id is answered as unknown (404), never as
  forbidden, so ids are not probed.
- A request is validated before it is queued: a malformed body, an unknown loss, token ids outside
  the vocabulary, shapes that disagree, an oversized body: a 4xx in the SDK's error shape
  (``{"error", "category"}``), and nothing runs. Work that fails while running answers its future
  with the same shape (``category`` ``server``).
- Work is bounded: at most ``max_queued`` requests wait for the worker (more: 429, which the SDK
  retries with backoff); a finished result is kept ``result_ttl_s`` for its retrieval.
- A retrieval waits at most ``poll_s`` and then answers ``try_again`` (the SDK polls again).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from agentrl.tinker.checkpoints import CheckpointStore, Ref, check_ttl, parse
from agentrl.tinker.sampler import Sampler
from agentrl.tinker.trainer import Trainer
from agentrl.tinker.wire import (
    PROTO,
    BadRequest,
    Busy,
    NotFound,
    TinkerError,
    forward_backward_result,
    read_forward_backward,
    sample_result,
    target_cells,
)

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20  # a request body as sent (compressed or not)
MAX_ALT_TOKENS = 64  # prompt_alt_tokens_k, at most


@dataclass
class Job:
    tenant: str
    future: asyncio.Future[Any]
    done_at: float = 0.0
    kind: str = ""


@dataclass
class Model:
    tenant: str
    model_id: str  # "<session id>:train:<n>", as the SDK names a training client
    adapter: str  # the trainer's name for its adapter
    rank: int
    targets: list[str]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    last_request: float = field(default_factory=time.time)  # wall time of its last request


@dataclass
class SamplingSession:
    tenant: str
    model_path: str | None  # the sampler_weights path it samples, None for the base model
    clients: int = 0  # clients that joined it (the SDK numbers each one's requests apart)
    session: str | None = None  # the session that created it, if one did




def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(message: str, status: int, category: str = "user") -> web.Response:
    return _json({"error": message, "category": category, "detail": message}, status)


class TinkerService:
    """The routes, the tenants' state and the worker; :meth:`app` builds the aiohttp application."""

    def __init__(self, trainer: Trainer, *, base_model: str, model_path: str, keys: list[str],
                 state_dir: Path, sampler: Sampler | None = None, aliases: tuple[str, ...] = (),
                 max_queued: int = 64, poll_s: float = 20.0, result_ttl_s: float = 600.0,
                 session_ttl_s: float = 300.0) -> None:
        if not keys:
            raise ValueError("the Tinker service needs at least one API key")
        self.trainer, self.base_model, self.model_path = trainer, base_model, model_path
        self.state_dir = Path(state_dir)
        self.store = CheckpointStore(self.state_dir, on_remove=self._removed)  # runs and checkpoints
        self.names = {base_model, model_path, *aliases}
        self.tenants = {k: hashlib.sha256(k.encode()).hexdigest()[:12] for k in keys}
        self.max_queued, self.poll_s, self.result_ttl_s = max_queued, poll_s, result_ttl_s
        self.sessions: dict[str, str] = {}  # session id -> tenant
        self.seen: dict[str, float] = {}  # session id -> its last heartbeat (monotonic)
        self.held = 0  # training clients that exist or are being created (the worker may lag)
        self._held_lock = threading.Lock()
        self.session_ttl_s = session_ttl_s
        self.models: dict[str, Model] = {}
        self.jobs: dict[str, Job] = {}
        self.queued = 0
        self.tasks: set[asyncio.Future[None]] = set()
        self.sampler = sampler
        self.published: dict[str, tuple[str, str]] = {}  # sampler_weights path -> (tenant, engine model)
        self._loading: dict[str, asyncio.Future[str]] = {}  # sampler weights being loaded again
        # (tenant, X-Idempotency-Key) -> the copy_weights answer (a retried request gets the same copy)
        self._copies: collections.OrderedDict[tuple[str, str], asyncio.Future[Ref]] = \
            collections.OrderedDict()
        self.sampling_sessions: dict[str, SamplingSession] = {}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-worker")

    # --- plumbing ---------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if request.path != "/api/v1/healthz":
            key = request.headers.get("X-API-Key", "")
            tenant = next((t for k, t in self.tenants.items() if secrets.compare_digest(k, key)), None)
            if tenant is None:
                return _error("missing or unknown API key (X-API-Key)", 401)
            request["tenant"] = tenant
        try:
            return await handler(request)
        except TinkerError as e:
            return _error(str(e), e.status, e.category)
        except web.HTTPRequestEntityTooLarge:
            return _error(f"the body is over {MAX_BODY >> 20} MiB", 413)
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(e.reason or "request refused", e.status)
            raise
        except Exception:  # noqa: BLE001 - answer in the SDK's shape and keep serving
            log.exception("tinker: %s %s failed", request.method, request.path)
            return _error("internal error (see the service's log)", 500, "server")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _session(self, request: web.Request, session_id: Any, seq: Any) -> str:
        """The model id a session's ``seq``-th training client gets (the SDK computes the same)."""
        if not isinstance(session_id, str) or self.sessions.get(session_id) != request["tenant"]:
            raise NotFound(f"no session {session_id!r} for this API key")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise BadRequest("model_seq_id must be a non-negative integer")
        model_id = f"{session_id}:train:{seq}"
        if model_id in self.models:
            raise BadRequest(f"training client {model_id} exists already")
        return model_id

    def _model(self, request: web.Request, model_id: Any) -> Model:
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None or m.tenant != request["tenant"]:
            raise NotFound(f"no training client {model_id!r} for this API key")
        m.last_request = time.time()
        return m

    def _removed(self, tenant: str, ref: Ref) -> None:
        """A checkpoint was deleted or expired: sampler weights leave the engine too."""
        published = self.published.pop(ref.path, None) if ref.kind == "sampler_weights" else None
        if published is not None and self.sampler is not None:
            task = asyncio.ensure_future(self.sampler.unload(published[1]))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _submit(self, request: web.Request, kind: str, work: Callable[[], Any] | None,
                model_id: str | None = None, then: Callable[[Any], Awaitable[Any]] | None = None,
                extra: dict[str, Any] | None = None) -> web.Response:
        """Queue ``work`` for the worker (model work, in arrival order) and then ``then`` on the event
        loop with its result (engine calls); answer the future's id now."""
        if self.queued >= self.max_queued:
            raise Busy(f"the service is busy: {self.queued} requests are queued (at most "
                       f"{self.max_queued}); retry later")
        self._expire()
        loop = asyncio.get_running_loop()
        request_id = f"{kind}-{secrets.token_hex(8)}"
        job = Job(request["tenant"], loop.create_future(), kind=kind)
        self.jobs[request_id] = job
        self.queued += 1

        async def run() -> None:
            try:
                result = await loop.run_in_executor(self.worker, work) if work is not None else None
                if then is not None:
                    result = await then(result)
                job.future.set_result(result)
            except Exception as e:  # noqa: BLE001 - every failure answers the future
                if not isinstance(e, TinkerError):
                    log.error("tinker: a %s request failed: %r", kind, e, exc_info=e)
                job.future.set_exception(e)
            finally:
                self.queued -= 1
                job.done_at = time.monotonic()

        self.tasks.add(task := asyncio.ensure_future(run()))
        task.add_done_callback(self.tasks.discard)
        return _json({"request_id": request_id, **({"model_id": model_id} if model_id else {}),
                      **(extra or {})})

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, j in self.jobs.items() if j.done_at and now - j.done_at > self.result_ttl_s]:
            del self.jobs[rid]

    # --- routes -----------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def client_config(self, request: web.Request) -> web.Response:
        # API keys (no JWT exchange), plain httpx transport, uncompressed protobuf forward_backward,
        # one chunk per turn: the SDK then submits a client's requests strictly in order
        return _json({"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                      "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": False,
                      "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                      "sample_join_sampling_session": False, "fwdbwd_max_chunk_bytes_count": MAX_BODY // 2})

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return _json({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def capabilities(self, request: web.Request) -> web.Response:
        model = {"model_name": self.base_model, "max_context_length": self.trainer.context,
                 "trainable": True, "sampleable": self.sampler is not None}
        return _json({"supported_models": [model]})

    async def create_session(self, request: web.Request) -> web.Response:
        await self._body(request)
        session_id = f"s-{secrets.token_hex(8)}"
        self.sessions[session_id] = request["tenant"]
        self.seen[session_id] = time.monotonic()
        return _json({"type": "create_session", "session_id": session_id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if self.sessions.get(body.get("session_id")) != request["tenant"]:
            raise NotFound(f"no session {body.get('session_id')!r} for this API key")
        self.seen[body["session_id"]] = time.monotonic()
        return _json({"type": "session_heartbeat"})

    def _hold(self) -> Callable[[], None]:
        """Take a place for a new training client, or refuse with a 4xx; returns its release."""
        with self._held_lock:
            if self.held >= self.trainer.max_adapters:
                raise BadRequest(f"this service holds {self.trainer.max_adapters} training clients at most "
                                 "(a session's clients are freed once it stops heartbeating)")
            self.held += 1

        def release() -> None:
            with self._held_lock:
                self.held -= 1

        return release

    def _reap(self) -> None:
        """End the sessions that stopped heartbeating ``session_ttl_s`` ago (the SDK beats every
        10 s while its program runs)."""
        now = time.monotonic()
        for sid in [s for s, t in self.seen.items() if now - t > self.session_ttl_s]:
            self._end(sid, f"no heartbeat for over {self.session_ttl_s:.0f} s")

    def _end(self, sid: str, why: str) -> None:
        """End session ``sid``: its training clients' adapters and optimizers are freed (after the
        work already queued, since the worker runs in order; their saved checkpoints stay)."""
        gone = [mid for mid in self.models if mid.startswith(f"{sid}:train:")]
        for mid in gone:
            self.worker.submit(self.trainer.drop, self.models.pop(mid).adapter)
            with self._held_lock:
                self.held -= 1
        del self.sessions[sid], self.seen[sid]
        log.info("tinker: session %s ended (%s); freed %d training clients", sid, why, len(gone))

    async def finish_session(self, request: web.Request) -> web.Response:
        """``ServiceClient.close()`` (and leaving its ``with`` block) reports the program's end:
        the session ends now rather than a session TTL later."""
        body = await self._body(request)
        sid = request.match_info["session_id"]
        if self.sessions.get(sid) != request["tenant"]:
            raise NotFound(f"no session {sid!r} for this API key")
        reason = body.get("reason") if isinstance(body.get("reason"), dict) else {}
        self._end(sid, f"finished by the client: {reason.get('type', 'unknown')}")
        return _json({})

    async def telemetry(self, request: web.Request) -> web.Response:
        await request.read()  # the SDK's own telemetry: accepted, not kept
        return _json({"status": "accepted"})

    async def create_model(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._reap()
        model_id = self._session(request, body.get("session_id"), body.get("model_seq_id"))
        if body.get("base_model") not in self.names:
            raise BadRequest(f"base_model {body.get('base_model')!r} is not served here; this service "
                             f"trains {self.base_model!r}")
        lora = body.get("lora_config")
        if not isinstance(lora, dict):
            raise BadRequest("lora_config is required: this service trains LoRA adapters only")
        rank, seed = lora.get("rank"), lora.get("seed")
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(seed, int | None):
            raise BadRequest("lora_config.rank (and seed, when given) must be integers")
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer {optimizer!r} is not supported; this service steps AdamW")
        targets = self.trainer.check_lora(rank, *(bool(lora.get(f"train_{part}", True))
                                                  for part in ("attn", "mlp", "unembed")))
        tenant, metadata = request["tenant"], body.get("user_metadata") or {}
        release = self._hold()

        def work() -> dict[str, Any]:
            try:
                name = self.trainer.create(rank, targets, seed)
            except BaseException:
                release()
                raise
            self.models[model_id] = Model(tenant, model_id, name, rank, targets,
                                          metadata if isinstance(metadata, dict) else {})
            self.store.record_run(tenant, model_id, base_model=self.base_model, rank=rank, targets=targets,
                                  user_metadata=self.models[model_id].user_metadata)
            return {"type": "create_model", "model_id": model_id}

        return self._submit(request, "create_model", work, model_id)

    async def get_info(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        m = self._model(request, body.get("model_id"))
        return _json({"type": "get_info", "model_id": m.model_id, "is_lora": True, "lora_rank": m.rank,
                      "model_name": self.base_model, "optimizer_config": {"type": "adamw"},
                      "model_data": {"arch": self.trainer.arch, "model_name": self.base_model,
                                     "tokenizer_id": self.model_path}})

    async def forward_backward(self, request: web.Request) -> web.Response:
        fb = read_forward_backward(await request.read(), request.content_type or "",
                                   request.headers.get("Content-Encoding", ""))
        if request.path.endswith("/forward"):
            fb.forward_only = True
        m = self._model(request, fb.model_id)
        self.trainer.check(fb)
        # the result's format (protobuf or JSON) is chosen at retrieval, by the poll's Accept header
        return self._submit(request, "forward" if fb.forward_only else "forward_backward",
                            lambda: self.trainer.forward_backward(m.adapter, fb), m.model_id)

    async def optim_step(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        m = self._model(request, body.get("model_id"))
        params = body.get("adam_params", body.get("optim_params", body.get("optimizer_params", {})))
        if not isinstance(params, dict) or params.get("type", "adam") not in ("adam", "adamw"):
            raise BadRequest(f"optimizer params {params!r}: this service steps AdamW (adam_params)")
        adam = self.trainer.check_adam(params)
        return self._submit(request, "optim_step",
                            lambda: {"metrics": self.trainer.optim_step(m.adapter, adam)}, m.model_id)

    async def save_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        m = self._model(request, body.get("model_id"))
        name = body.get("path") or f"step-{secrets.token_hex(4)}"
        ref = parse(f"tinker://{m.model_id}/weights/{name}", ("weights",))
        dest, ttl, metadata = self.store.file(m.tenant, ref), body.get("ttl_seconds"), \
            body.get("user_metadata")
        if ttl is not None:
            check_ttl(ttl)
        if dest.exists() and not body.get("overwrite"):
            raise BadRequest(f"checkpoint {ref.path} exists; pass overwrite=True to replace it")

        def work() -> dict[str, Any]:
            self.trainer.save(m.adapter, dest)
            self.store.saved(m.tenant, ref, ttl_seconds=ttl, user_metadata=metadata)
            return {"type": "save_weights", "path": ref.path}

        return self._submit(request, "save_weights", work, m.model_id)

    async def load_weights(self, request: web.Request) -> web.Response:
        """Into an existing training client (``model_id``), or into a new one that the load creates
        (``session_id`` + ``model_seq_id``: the SDK's create_training_client_from_state), whose LoRA
        shape is the checkpoint's."""
        body = await self._body(request)
        tenant, optimizer = request["tenant"], bool(body.get("optimizer"))
        ref = parse(body.get("path"), ("weights",))
        src, _ = self.store.locate(tenant, ref)  # its own, or one another key published
        path = ref.path
        if body.get("model_id") is not None:
            m = self._model(request, body.get("model_id"))

            def into_existing() -> dict[str, Any]:
                self.trainer.load(m.adapter, self.trainer.read(src), optimizer=optimizer)
                return {"type": "load_weights", "path": path, "model_id": m.model_id}

            return self._submit(request, "load_weights", into_existing, m.model_id)
        self._reap()
        model_id = self._session(request, body.get("session_id"), body.get("model_seq_id"))
        if body.get("base_model") not in (None, *self.names):
            raise BadRequest(f"base_model {body.get('base_model')!r} is not served here")
        metadata = body.get("user_metadata") or {}
        release = self._hold()

        def into_new() -> dict[str, Any]:
            try:
                state = self.trainer.read(src)
                name = self.trainer.create(int(state["rank"]), list(state["targets"]), None)
            except BaseException:
                release()
                raise
            self.models[model_id] = Model(tenant, model_id, name, int(state["rank"]), list(state["targets"]),
                                          metadata if isinstance(metadata, dict) else {})
            self.store.record_run(tenant, model_id, base_model=self.base_model, rank=int(state["rank"]),
                                  targets=list(state["targets"]),
                                  user_metadata=self.models[model_id].user_metadata)
            self.trainer.load(name, state, optimizer=optimizer)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return self._submit(request, "load_weights", into_new, model_id)

    # --- sampling ---------------------------------------------------------------------------------

    def _sampler_path(self, tenant: str, base_model: Any, model_path: Any) -> str | None:
        """The ``sampler_weights`` path a sampling request names (None: the base model), once this
        key may read it (its own, or one another key published) and it is still on disk, whether
        the engine has it loaded or not."""
        if model_path:
            if not isinstance(model_path, str):
                raise NotFound(f"no sampler weights {model_path!r} for this API key")
            published = self.published.get(model_path)
            if published is None or published[0] != tenant:
                self.store.locate(tenant, parse(model_path, ("sampler_weights",)))
            return model_path
        if base_model not in self.names:
            raise BadRequest(f"base_model {base_model!r} is not served here; this service samples "
                             f"{self.base_model!r}")
        return None

    async def _engine_model(self, tenant: str, path: str | None) -> str:
        """The engine's name for what a request samples: "base", or the adapter of sampler weights
        ``path``. Weights saved before this service (re)started are on disk but not in its engine:
        the first request that samples them loads them (requests that meet meanwhile share that
        load)."""
        if path is None:
            return "base"
        if path in self.published:
            return self.published[path][1]
        loading = self._loading.get(path)
        if loading is None:
            loading = self._loading[path] = asyncio.ensure_future(self._load_again(tenant, path))
            loading.add_done_callback(lambda _: self._loading.pop(path, None))
        return await asyncio.shield(loading)

    async def _load_again(self, tenant: str, path: str) -> str:
        assert self.sampler is not None
        ref = parse(path, ("sampler_weights",))
        folder, owner = self.store.locate(tenant, ref)
        name = f"loaded-{secrets.token_hex(4)}"
        log.info("agentrl tinker: loading sampler weights %s into the engine (saved before this start)", path)
        await self.sampler.publish(name, folder)
        if not folder.exists():  # deleted or expired while it loaded
            await self.sampler.unload(name)
            raise NotFound(f"sampler weights {path} were deleted, expired or unpublished")
        self.published[path] = (owner, name)
        return name

    def _new_sampling_session(self, tenant: str, model_path: str | None, session: str | None = None) -> str:
        sid = f"ss-{secrets.token_hex(8)}"
        self.sampling_sessions[sid] = SamplingSession(tenant, model_path, session=session)
        return sid

    def _sampling_session(self, request: web.Request, sid: Any) -> SamplingSession:
        session = self.sampling_sessions.get(sid) if isinstance(sid, str) else None
        if session is None or session.tenant != request["tenant"]:
            raise NotFound(f"no sampling session {sid!r} for this API key")
        return session

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        """Publish a training client's adapter to the sampling engine: under ``path`` (a sampler
        checkpoint the SDK names) or, without one, as a new sampling session's model."""
        body = await self._body(request)
        m = self._model(request, body.get("model_id"))
        if self.sampler is None:
            raise BadRequest("this service was started without sampling (--no-sampling)")
        name = body.get("path") or f"snapshot-{secrets.token_hex(4)}"
        ref = parse(f"tinker://{m.model_id}/sampler_weights/{name}", ("sampler_weights",))
        path, ttl, metadata = ref.path, body.get("ttl_seconds"), body.get("user_metadata")
        if ttl is not None:
            check_ttl(ttl)
        folder = self.store.file(m.tenant, ref)
        if path in self.published or folder.exists():  # this start's, or one saved before it
            raise BadRequest(f"sampler weights {path} exist already")
        engine_name = f"{m.adapter}-{secrets.token_hex(4)}"
        sampler, tenant, named = self.sampler, m.tenant, bool(body.get("path"))

        async def publish(exported: Path) -> dict[str, Any]:
            await sampler.publish(engine_name, exported)
            self.published[path] = (tenant, engine_name)
            self.store.saved(tenant, ref, ttl_seconds=ttl, user_metadata=metadata)
            if named:
                return {"type": "save_weights_for_sampler", "path": path}
            return {"type": "save_weights_for_sampler", "path": path,
                    "sampling_session_id": self._new_sampling_session(tenant, path)}

        return self._submit(request, "save_weights_for_sampler",
                            lambda: self.trainer.export(m.adapter, folder), m.model_id, then=publish)

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        sid = body.get("session_id")
        if not isinstance(sid, str) or self.sessions.get(sid) != request["tenant"]:
            raise NotFound(f"no session {sid!r} for this API key")
        path = self._sampler_path(request["tenant"], body.get("base_model"), body.get("model_path"))
        sid = self._new_sampling_session(request["tenant"], path, sid)
        return _json({"type": "create_sampling_session", "sampling_session_id": sid})

    async def join_sampling_session(self, request: web.Request) -> web.Response:
        session = self._sampling_session(request, (await self._body(request)).get("sampling_session_id"))
        session.clients += 1
        return _json({"type": "join_sampling_session", "client_counter": session.clients})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sid = request.match_info["sampler_id"]
        session = self._sampling_session(request, sid)
        return _json({"sampler_id": sid, "base_model": self.base_model, "model_path": session.model_path})

    async def asample(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if self.sampler is None:
            raise BadRequest("this service was started without sampling (--no-sampling)")
        sid, tenant = body.get("sampling_session_id"), request["tenant"]
        if sid is not None:
            path = self._sampling_session(request, sid).model_path
            if path is not None:
                try:
                    self._sampler_path(tenant, None, path)
                except NotFound:
                    raise NotFound(f"sampler weights {path} were deleted, expired or unpublished") from None
        else:
            path = self._sampler_path(tenant, body.get("base_model"), body.get("model_path"))
        prompt = _prompt_tokens(body.get("prompt"), self.trainer.vocab)
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise BadRequest(f"num_samples must be an integer from 1 to 64; got {n!r}")
        topk = body.get("topk_prompt_logprobs") or 0
        if not isinstance(topk, int) or isinstance(topk, bool) or not 0 <= topk <= 20:
            raise BadRequest(f"topk_prompt_logprobs must be an integer from 0 to 20; got {topk!r}")
        topk_sample = body.get("topk_sample_logprobs") or 0
        if not isinstance(topk_sample, int) or isinstance(topk_sample, bool) or not 0 <= topk_sample <= 20:
            raise BadRequest(f"topk_sample_logprobs must be an integer from 0 to 20; got {topk_sample!r}")
        want_prompt = bool(body.get("prompt_logprobs"))
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None:
            if not want_prompt:
                raise BadRequest("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
            if not isinstance(last_n, int) or isinstance(last_n, bool) or not 1 <= last_n <= len(prompt) - 1:
                raise BadRequest(f"prompt_logprobs_last_n must be an integer from 1 to {len(prompt) - 1} "
                                 f"(the prompt's length - 1); got {last_n!r}")
        alt_k = body.get("prompt_alt_tokens_k") or 0
        if not isinstance(alt_k, int) or isinstance(alt_k, bool) or not 0 <= alt_k <= MAX_ALT_TOKENS:
            raise BadRequest(f"prompt_alt_tokens_k must be an integer from 0 to {MAX_ALT_TOKENS}; "
                             f"got {alt_k!r}")
        targets = body.get("target_prompt_logprobs")
        if targets is not None:
            targets = target_cells(targets, len(prompt) - 1, self.trainer.vocab)
        from agentrl.tinker.sampler import _vllm_params

        params = body.get("sampling_params") or {}
        vllm = _vllm_params(params, n, len(prompt), self.sampler.max_model_len)  # refused now, not later
        sampler, loop = self.sampler, asyncio.get_running_loop()

        async def sample(_: Any) -> Any:
            model = await self._engine_model(tenant, path)
            out = await sampler.sample(model, prompt, n, params, prompt_logprobs=want_prompt,
                                       topk_prompt=topk, topk_sample=topk_sample, last_n=last_n)
            if targets is not None or alt_k:  # on the training side's copy of the same weights
                folder = None if path is None else \
                    self.store.locate(tenant, parse(path, ("sampler_weights",)))[0]
                out.target_prompt, out.alt_tokens = await loop.run_in_executor(
                    self.worker, self.trainer.score_prompt, folder, prompt, targets, alt_k,
                    vllm["temperature"], vllm.get("seed"))
            return out

        ids = [f"seq-{secrets.token_hex(6)}" for _ in range(n)]
        return self._submit(request, "sample", None, then=sample, extra={"sample_sequence_ids": ids})

    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rid = body.get("request_id")
        job = self.jobs.get(rid) if isinstance(rid, str) else None
        if job is None or job.tenant != request["tenant"]:
            raise NotFound(f"no request {rid!r} for this API key (finished results are kept "
                           f"{self.result_ttl_s:.0f} s)")
        try:
            result = await asyncio.wait_for(asyncio.shield(job.future), self.poll_s)
        except TimeoutError:
            return _json({"type": "try_again", "request_id": rid, "queue_state": "active"})
        except TinkerError as e:
            return _json({"error": str(e), "category": e.category})
        except Exception as e:  # noqa: BLE001 - the work failed: the future says so
            return _json({"error": f"{type(e).__name__}: {e}", "category": "server"})
        if job.kind in ("forward", "forward_backward"):
            outputs, metrics = result
            data, content_type = forward_backward_result(outputs, metrics,
                                                         proto=PROTO in request.headers.get("Accept", ""))
            return web.Response(body=data, content_type=content_type)
        if job.kind == "sample":
            data, content_type = sample_result(result, proto=PROTO in request.headers.get("Accept", ""))
            return web.Response(body=data, content_type=content_type)
        return _json(result)

    # --- training runs, checkpoints and sessions (the SDK's RestClient) ----------------------------

    def _page(self, request: web.Request, items: list[Any], key: str) -> web.Response:
        try:
            limit = int(request.query.get("limit", 20))
            offset = int(request.query.get("offset", 0))
        except ValueError:
            raise BadRequest("limit and offset must be integers") from None
        if not 1 <= limit <= 1000 or offset < 0:
            raise BadRequest("limit must be from 1 to 1000 and offset at least 0")
        return _json({key: items[offset:offset + limit],
                      "cursor": {"offset": offset, "limit": limit, "total_count": len(items)}})

    def _run(self, tenant: str, run: str) -> dict[str, Any]:
        m = self.models.get(run)
        return self.store.run(tenant, run, m.last_request if m is not None and m.tenant == tenant else None)

    def _ref(self, request: web.Request) -> Ref:
        info = request.match_info
        return parse(f"tinker://{info['run']}/{info['kind']}/{info['name']}")

    async def list_training_runs(self, request: web.Request) -> web.Response:
        tenant = request["tenant"]
        return self._page(request, [self._run(tenant, r) for r in self.store.runs(tenant)], "training_runs")

    async def get_training_run(self, request: web.Request) -> web.Response:
        return _json(self._run(request["tenant"], request.match_info["run"]))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        run = request.match_info["run"]
        self._run(request["tenant"], run)  # one of this key's runs, or 404
        return _json({"checkpoints": self.store.checkpoints(request["tenant"], run)})

    async def list_user_checkpoints(self, request: web.Request) -> web.Response:
        tenant = request["tenant"]
        every = [c for r in self.store.runs(tenant) for c in self.store.checkpoints(tenant, r)]
        return self._page(request, sorted(every, key=lambda c: c["time"], reverse=True), "checkpoints")

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        self.store.delete(request["tenant"], self._ref(request))
        return _json({})

    async def publish_checkpoint(self, request: web.Request) -> web.Response:
        self.store.publish(request["tenant"], self._ref(request), request.method == "POST")
        return _json({})

    async def set_checkpoint_ttl(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.store.set_ttl(request["tenant"], self._ref(request), body.get("ttl_seconds"))
        return _json({})

    async def copy_weights(self, request: web.Request) -> web.Response:
        """``RestClient.copy_weights`` / ``ServiceClient.copy_weights``: a checkpoint this key may read
        (its own, or one published) copied into a new training run of this key, which keeps it when
        the source is deleted, unpublished or expires. The run is the session's slot ``model_seq_id``
        or, given a ``destination_project_id``, a run of its own that records the project. The SDK
        sends one ``X-Idempotency-Key`` for a call and all its retries: they get one copy."""
        body = await self._body(request)
        tenant = request["tenant"]
        if request.headers.get("X-Tinker-Weights-Access-Token"):
            raise BadRequest("weights access tokens are not used here: another key's checkpoint is readable "
                             "once its owner publishes it")
        ref = parse(body.get("source_path"))
        ttl, sid = body.get("ttl_seconds"), body.get("session_id")
        project = body.get("destination_project_id")
        if ttl is not None:
            check_ttl(ttl)
        if sid is not None:
            run = self._session(request, sid, body.get("model_seq_id"))
        elif isinstance(project, str) and 0 < len(project) <= 128:
            run = f"copy-{secrets.token_hex(6)}"
        else:
            raise BadRequest("copy_weights needs a destination_project_id (up to 128 characters), or a "
                             "session_id and a model_seq_id")
        key = (tenant, request.headers.get("X-Idempotency-Key", "")[:100])
        done = self._copies.get(key) if key[1] else None
        if done is None:
            done = asyncio.ensure_future(asyncio.to_thread(self.store.copy, tenant, ref, run, ttl_seconds=ttl,
                                                           project=project if sid is None else None))
            if key[1]:
                self._copies[key] = done
                while len(self._copies) > 10_000:
                    self._copies.popitem(last=False)
        try:
            new = await asyncio.shield(done)
        except TinkerError:
            self._copies.pop(key, None)  # refused: a retry may try again
            raise
        log.info("tinker: %s copied to %s", ref.path, new.path)
        return _json({"tinker_path": new.path})

    async def weights_info(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return _json(self.store.weights_info(request["tenant"], parse(body.get("tinker_path"))))

    async def list_sessions(self, request: web.Request) -> web.Response:
        mine = [sid for sid, tenant in self.sessions.items() if tenant == request["tenant"]]
        return self._page(request, mine, "sessions")

    async def get_session(self, request: web.Request) -> web.Response:
        sid = request.match_info["session_id"]
        if self.sessions.get(sid) != request["tenant"]:
            raise NotFound(f"no session {sid!r} for this API key")
        return _json({"training_run_ids": [mid for mid in self.models if mid.startswith(f"{sid}:train:")],
                      "sampler_ids": [k for k, v in self.sampling_sessions.items() if v.session == sid]})

    async def unknown(self, request: web.Request) -> web.Response:
        return _error(f"{request.method} {request.path} is not a route of this service", 404)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._middleware])
        r = app.router
        r.add_get("/api/v1/healthz", self.healthz)
        r.add_post("/api/v1/client/config", self.client_config)
        r.add_post("/api/v1/client/dynamic_config", self.dynamic_config)
        r.add_get("/api/v1/get_server_capabilities", self.capabilities)
        r.add_post("/api/v1/create_session", self.create_session)
        r.add_post("/api/v1/session_heartbeat", self.heartbeat)
        r.add_post("/api/v1/sessions/{session_id}/finish", self.finish_session)
        r.add_post("/api/v1/telemetry", self.telemetry)
        r.add_post("/api/v1/create_model", self.create_model)
        r.add_post("/api/v1/get_info", self.get_info)
        r.add_post("/api/v1/forward_backward", self.forward_backward)
        r.add_post("/api/v1/forward", self.forward_backward)
        r.add_post("/api/v1/optim_step", self.optim_step)
        r.add_post("/api/v1/save_weights", self.save_weights)
        r.add_post("/api/v1/load_weights", self.load_weights)
        r.add_post("/api/v1/save_weights_for_sampler", self.save_weights_for_sampler)
        r.add_post("/api/v1/create_sampling_session", self.create_sampling_session)
        r.add_post("/api/v1/join_sampling_session", self.join_sampling_session)
        r.add_post("/api/v1/asample", self.asample)
        r.add_get("/api/v1/samplers/{sampler_id}", self.get_sampler)
        r.add_post("/api/v1/retrieve_future", self.retrieve_future)
        r.add_get("/api/v1/training_runs", self.list_training_runs)
        r.add_get("/api/v1/training_runs/{run}", self.get_training_run)
        r.add_get("/api/v1/training_runs/{run}/checkpoints", self.list_checkpoints)
        checkpoint = "/api/v1/training_runs/{run}/checkpoints/{kind}/{name}"
        r.add_delete(checkpoint, self.delete_checkpoint)
        r.add_post(checkpoint + "/publish", self.publish_checkpoint)
        r.add_delete(checkpoint + "/publish", self.publish_checkpoint)
        r.add_put(checkpoint + "/ttl", self.set_checkpoint_ttl)
        r.add_get("/api/v1/checkpoints", self.list_user_checkpoints)
        r.add_post("/api/v1/weights_info", self.weights_info)
        r.add_post("/api/v1/copy_weights", self.copy_weights)
        r.add_get("/api/v1/sessions", self.list_sessions)
        r.add_get("/api/v1/sessions/{session_id}", self.get_session)
        r.add_route("*", "/{tail:.*}", self.unknown)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        if self.sampler is not None:
            await self.sampler.close()
        self.worker.shutdown(wait=True, cancel_futures=True)


def _prompt_tokens(prompt: Any, vocab: int) -> list[int]:
    """A sample request's prompt (a ModelInput of text chunks) as token ids, each in the vocabulary."""
    from agentrl.tinker.wire import _tokens_from_json

    tokens = _tokens_from_json(prompt)
    if not tokens:
        raise BadRequest("the prompt is empty")
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise BadRequest(f"a prompt token id is outside the vocabulary [0, {vocab})")
    return tokens


def read_keys(keys_file: str) -> list[str]:
    """API keys from ``keys_file`` (one a line, ``#`` comments), ``$AGENTRL_TINKER_KEYS``
    (comma-separated) or the file ``$AGENTRL_TINKER_KEYS_FILE`` names."""
    from agentrl.credentials import find_secret

    text = find_secret("Tinker API keys", "AGENTRL_TINKER_KEYS", keys_file)
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    keys = [k.strip() for line in lines for k in line.split(",") if k.strip()]
    for k in keys:
        if not k.startswith("tml-"):
            raise ValueError(f"a Tinker API key must start with 'tml-' (the SDK refuses others); "
                             f"the key file has one beginning {k[:4]!r}")
    return keys


async def run_service(model: str, host: str, port: int, keys_file: str, *, state_dir: str = "",
                      lora_alpha: float = 32.0, sampling: bool = True, engine_port: int = 8950,
                      max_clients: int = 16, session_ttl_s: float = 300.0,
                      ready: Callable[[str], None] | None = None) -> None:
    """Load ``model`` (a built-in name or a folder), then serve the Tinker API until cancelled."""
    from agentrl.models import resolve_model

    path = str(Path(resolve_model(model)))
    keys = read_keys(keys_file)
    log.info("agentrl tinker: loading %s", path)
    trainer = await asyncio.to_thread(Trainer, path, lora_alpha=lora_alpha, max_adapters=max_clients)
    from agentrl.models import home

    state = Path(state_dir).expanduser() if state_dir else home() / "tinker"
    sampler = Sampler(path, state / "engine", port=engine_port) if sampling else None
    service = TinkerService(trainer, base_model=model, model_path=path, keys=keys, state_dir=state,
                            sampler=sampler, session_ttl_s=session_ttl_s)
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    url = f"http://{host}:{bound}"
    log.info("agentrl tinker: serving %s at %s (%d API keys); point the SDK at it with "
             "ServiceClient(base_url=%r)", model, url, len(keys), url)
    if ready is not None:
        ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
