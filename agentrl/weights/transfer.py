"""HTTP/file weight transfer: the learner streams checksummed safetensors chunks to serve.

Learner side: :func:`publish` serialises the state dict (safetensors), sends it in chunks (a few
at once), each with its SHA-256 and byte offset, then commits with the chunk count, the size and
the SHA-256 of the chunks' digests in order. Serve side: :class:`WeightReceiver` verifies each
chunk and writes it at its offset in a staging file (so chunks may arrive in any order, and a
resent one just lands again), checks on commit that every chunk arrived and that the digests agree,
moves the file into ``weights/v<version>/`` and has the engine updater
(:class:`agentrl.weights.updates.EngineUpdater`) load it (pause(keep) -> reload -> reset prefix
cache -> set version -> resume). Every byte is hashed once on each side. Any mismatch is a 4xx the
learner can retry; nothing half-written is loaded. If the engines fail, the commit answers 502
with a ``weight_sync_error`` body naming each engine and why; the pool stays at its previous
version and the learner may publish the next one. The NCCL routes (``/admin/weights/nccl/...``)
drive the same choreography while the learner broadcasts (see :mod:`agentrl.weights.nccl`).
The learner reaches :func:`publish` through :class:`agentrl.weights.transports.HttpTransport`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.buffer.disk import is_no_space
from agentrl.weights.adapters import ADAPTER_FILE  # a LoRA version's folder holds it and its config
from agentrl.weights.errors import (
    DeltaError,
    DeltaRefused,
    EnginesFailed,
    WeightGroupStale,
    WeightTransferError,
    WeightUpdateFailed,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

    from agentrl.client import Answer, ServeClient
    from agentrl.weights.updates import EngineUpdater, PolicyUpdater

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 2**20
PARALLEL_CHUNKS = 3  # chunks in flight at once: serve hashes and writes one while the next arrives


LOADED = "loaded.json"  # written into a version's folder once an engine serves it


def _sync_error(e: WeightUpdateFailed) -> web.Response:
    return web.json_response(
        {
            "error": {
                "message": str(e),
                "type": "weight_sync_error",
                "param": None,
                "code": "engines_failed",
                "version": e.version,
                "engines": e.engines,
            }
        },
        status=502,
    )


class WeightReceiver:
    """Serve's end of weight sync: staged chunks, verified commits, one update at a time.

    ``updater`` is serve's :class:`~agentrl.weights.updates.EngineUpdater` (or a stand-in with
    its ``version``, ``weights_path`` and update methods); the routes drive it.
    """

    def __init__(self, root: Path, updater: EngineUpdater | PolicyUpdater, keep: int = 2,
                 max_bytes: int = 64 << 30, adapters_only: bool = False,
                 pinned: Iterable[int] = ()) -> None:
        """``max_bytes``: the largest upload a version may declare (a chunk's offset and length must
        fall inside the declared size, so no request can make serve write beyond it). ``pinned``: the
        versions a role plays at (``env.roles.<role>.version``), whose folders stay whatever comes
        after, so an engine that rejoins and a restarted serve load them again."""
        self.root = root
        self.updater = updater
        self.keep = keep
        self.pinned = frozenset(pinned)
        # awaited with each version the engines loaded, before the commit answers
        self.on_loaded: list[Any] = []
        self.max_bytes = max_bytes
        self.adapters_only = adapters_only  # a named LoRA policy's receiver: its adapters alone
        self._declared: dict[int, int] = {}  # version -> the total size its chunks declared
        # version -> {chunk index: (its SHA-256, offset, length)}
        self._staging: dict[int, dict[int, tuple[str, int, int]]] = {}
        self._lock = asyncio.Lock()
        self.last: dict[str, Any] = {}
        root.mkdir(parents=True, exist_ok=True)

    def _staging_path(self, version: int) -> Path:
        return self.root / f"v{version}.staging"

    async def chunk(
        self, version: int, index: int, offset: int, data: bytes, sha: str, total: int | None = None
    ) -> None:
        """Verify one chunk and write it at ``offset`` of the version's staging file (of ``total`` bytes)."""
        if index < 0 or offset < 0:
            raise web.HTTPBadRequest(reason=f"chunk {index} of version {version}: "
                                            f"bad index or offset {offset}")
        if total is not None:
            if not 0 <= total <= self.max_bytes:
                raise web.HTTPBadRequest(reason=f"version {version}: {total} bytes is beyond "
                                                f"the {self.max_bytes} a version may have")
            known = self._declared.get(version)
            if known is not None and known != total:
                raise web.HTTPBadRequest(reason=f"version {version}: chunks declare different sizes "
                                                f"({known} and {total})")
        limit = self.max_bytes if total is None else total
        if offset + len(data) > limit:
            raise web.HTTPBadRequest(reason=f"chunk {index} of version {version} ends at "
                                            f"{offset + len(data)}, beyond the declared {limit} bytes")
        # Hashing and writing run off the event loop: the router shares it, and a 16 MiB SHA-256
        # would stall every agent's call for tens of milliseconds per chunk.
        if await asyncio.to_thread(_sha256, data) != sha:
            raise web.HTTPBadRequest(reason=f"chunk {index} of version {version} failed its checksum")
        staged = self._staging.setdefault(version, {})
        try:
            await asyncio.to_thread(_write_at, self._staging_path(version), offset, data)
        except OSError as e:
            if not is_no_space(e):
                raise
            # A full disk: the version's staged bytes go (their space with them); the learner's
            # client retries a 5xx, and sends the version again once serve has the room.
            self._staging.pop(version, None)
            self._declared.pop(version, None)
            self._staging_path(version).unlink(missing_ok=True)
            log.warning("version %d: no space left for chunk %d in %s; its staged chunks are dropped",
                        version, index, self.root)
            raise web.HTTPInsufficientStorage(reason=f"version {version}: no space left on serve's run "
                                                     f"directory for chunk {index}") from None
        staged[index] = (sha, offset, len(data))
        if total is not None:  # an accepted chunk fixes the version's size
            self._declared[version] = total

    async def commit(self, version: int, sha: str, chunks: int, size: int, kind: str = "full",
                     install: Callable[[Path, Path], None] | None = None) -> dict[str, Any]:
        """Load the staged version once all ``chunks`` arrived and their digests, in order, hash to
        ``sha``. ``kind``: "full" (the model's weights, reloaded into the engines) or "adapter" (a
        LoRA adapter with its config in the file's metadata, loaded beside the versions before it).

        ``install(staged, target)``, when given, builds the version's ``model.safetensors`` from the
        staged bytes (a delta: :func:`agentrl.weights.delta.delta_installer`) under the update lock;
        by default the staged file is the version's file. What it raises leaves nothing behind."""
        if kind not in ("full", "adapter"):
            raise web.HTTPBadRequest(reason=f"version {version}: kind {kind!r} is not 'full' or 'adapter'")
        if self.adapters_only and kind != "adapter":
            raise web.HTTPBadRequest(reason=f"version {version}: this route takes a LoRA policy's adapters "
                                            f"(kind 'adapter'), not {kind!r}")
        staged = self._staging.get(version, {})
        if not 0 <= size <= self.max_bytes or chunks < 1:
            raise web.HTTPBadRequest(
                reason=f"version {version}: a commit of {chunks} chunks and {size} bytes"
            )
        declared = self._declared.get(version)
        if declared is not None and declared != size:
            raise web.HTTPBadRequest(reason=f"version {version}: the chunks declared "
                                            f"{declared} bytes, the commit {size}")
        missing = [i for i in range(chunks) if i not in staged]
        if missing:
            raise web.HTTPConflict(reason=f"version {version}: {chunks - len(missing)} "
                                          f"of {chunks} chunks received (missing "
                                          f"{missing[:5]}{'...' if len(missing) > 5 else ''})")
        self._staging.pop(version)
        self._declared.pop(version, None)
        path = self._staging_path(version)
        parts = [staged[i] for i in range(chunks)]
        ends = [o + n for _, o, n in parts]
        if [o for _, o, _ in parts] != [0, *ends[:-1]] or ends[-1] != size:  # chunks must tile the file
            path.unlink(missing_ok=True)
            raise web.HTTPBadRequest(reason=f"version {version}: the chunks do "
                                            f"not make one file of {size} bytes")
        if _digest_of(d for d, _, _ in parts) != sha:
            path.unlink(missing_ok=True)
            raise web.HTTPBadRequest(reason=f"version {version}: the chunks' digests do not match the commit")
        await asyncio.to_thread(os.truncate, path, size)  # an earlier, longer attempt may have left a tail
        async with self._lock:
            if version <= self.updater.version and self.updater.weights_path:
                raise web.HTTPConflict(reason=f"version {version} is not newer than {self.updater.version}")
            target = self.root / f"v{version}"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            if kind == "adapter":
                from agentrl.weights.adapters import unpack_adapter

                try:
                    await asyncio.to_thread(unpack_adapter, path, target)
                except ValueError as e:
                    shutil.rmtree(target, ignore_errors=True)
                    path.unlink(missing_ok=True)
                    raise web.HTTPBadRequest(reason=f"version {version}: {e}") from None
                except OSError as e:  # a full disk: no half adapter folder is left behind
                    shutil.rmtree(target, ignore_errors=True)
                    path.unlink(missing_ok=True)
                    if is_no_space(e):
                        raise web.HTTPInsufficientStorage(reason=f"version {version}: no space left on "
                                                                 "serve's run directory") from None
                    raise
            elif install is None:
                path.rename(target / "model.safetensors")
            else:
                try:
                    await asyncio.to_thread(install, path, target / "model.safetensors")
                except BaseException as e:
                    shutil.rmtree(target, ignore_errors=True)
                    if is_no_space(e):
                        raise web.HTTPInsufficientStorage(reason=f"version {version}: no space left on "
                                                                 "serve's run directory") from None
                    raise
                finally:
                    path.unlink(missing_ok=True)
            t0 = time.perf_counter()
            try:
                if kind == "adapter":
                    result = await self.updater.load_adapter(str(target), version)
                else:
                    result = await self.updater.update_weights(str(target), version)
            except WeightUpdateFailed:
                shutil.rmtree(target, ignore_errors=True)  # no engine serves it: never a join target
                raise
            result["sync_s"] = time.perf_counter() - t0
            try:
                (target / LOADED).write_text(json.dumps({"version": version, "sha": sha}))
            except OSError as e:
                if not is_no_space(e):
                    raise
                # The engines serve it; unmarked, a restart does not restore it (the learner then
                # publishes it again, serve's version being older): never a half version.
                (target / LOADED).unlink(missing_ok=True)
                log.warning("version %d is loaded, but no space was left to mark it loaded in %s: a "
                            "restart of serve would come back at the version before", version, target)
            self.last = result
            self._prune(version)
            for hook in self.on_loaded:
                await hook(version)
            log.info("policy version %d loaded into %d engine(s) in %.2f s", version,
                     sum("error" not in v for v in result["engines"].values()), result["sync_s"])
            return result

    def latest_loaded(self) -> tuple[int, Path] | None:
        """The newest version under ``root`` that engines loaded (a commit that completed), if any:
        what a restarted serve brings its engines back to."""
        found = []
        for p in self.root.glob("v*"):
            try:
                v = int(p.name[1:])
            except ValueError:
                continue
            if (p / LOADED).exists() and any((p / f).exists() for f in ("model.safetensors", ADAPTER_FILE)):
                found.append((v, p))
        return max(found) if found else None

    def pinned_loaded(self, below: int) -> list[tuple[int, Path]]:
        """The pinned versions older than ``below`` that engines loaded, oldest first: what a restarted
        serve loads beside the latest (which is restored last, so it is the policy's version)."""
        return [(v, self.root / f"v{v}") for v in sorted(self.pinned)
                if v < below and (self.root / f"v{v}" / LOADED).exists()]

    async def restore(self, version: int, path: Path) -> dict[str, Any]:
        """Load a version an earlier serve of this run directory published into the engines, before
        they take traffic, so a restarted serve carries on at the learner's version."""
        async with self._lock:
            t0 = time.perf_counter()
            if (path / ADAPTER_FILE).exists():
                result = await self.updater.load_adapter(str(path), version)
            else:
                result = await self.updater.update_weights(str(path), version)
            result["sync_s"] = time.perf_counter() - t0
            self.last = result
            log.info("restored policy version %d from %s in %.2f s", version, path, result["sync_s"])
            return result

    def _prune(self, version: int) -> None:
        keep = self.keep
        if getattr(self.updater, "adapters", None):
            # an adapter a request is still finishing on may be read again (an engine that dropped
            # it from its cache reloads it from its folder): twice the loaded window stays on disk
            keep = max(keep, 2 * self.updater.adapter_keep)
        for p in self.root.glob("v*"):
            try:
                v = int(p.name[1:].split(".")[0])
            except ValueError:
                continue
            if p.is_dir() and v <= version - keep and v not in self.pinned:
                shutil.rmtree(p, ignore_errors=True)
            elif p.suffix == ".staging" and v <= version:  # an upload that was never committed
                self._staging.pop(v, None)
                p.unlink(missing_ok=True)

    def add_routes(self, app: web.Application, require_admin: Callable[[web.Request], None],
                   prefix: str = "/admin/weights") -> None:
        """The upload routes under ``prefix``; a named policy's receiver (``adapters_only``) has
        chunks and commit alone, under ``/admin/policies/<policy>/weights``."""
        from agentrl.web import error_middleware

        if error_middleware not in app.middlewares:  # a bare app (tests, tools): the one error shape too
            app.middlewares.append(error_middleware)
        def new_version(request: web.Request) -> int:
            """The route's version: a positive integer newer than the engines' (a 4xx otherwise)."""
            text = request.match_info["version"]
            if not text.isdigit() or int(text) < 1:
                raise web.HTTPBadRequest(reason=f"a version is a positive integer, not {text[:40]!r}")
            version = int(text)
            if version <= self.updater.version:
                raise web.HTTPConflict(reason=f"version {version} is not newer than {self.updater.version}")
            return version

        def header_int(request: web.Request, name: str, required: bool) -> int | None:
            raw = request.headers.get(name)
            if raw is None and not required:
                return None
            if raw is None or not raw.isdigit():
                raise web.HTTPBadRequest(reason=f"a chunk needs an {name} header (a non-negative integer)")
            return int(raw)

        async def json_object(request: web.Request) -> dict[str, Any]:
            try:
                body = await request.json()
            except ValueError:
                raise web.HTTPBadRequest(reason="the body is not JSON") from None
            if not isinstance(body, dict):
                raise web.HTTPBadRequest(reason="the body must be a JSON object")
            return body

        async def put_chunk(request: web.Request) -> web.Response:
            require_admin(request)
            version = new_version(request)
            text = request.match_info["index"]
            if not text.isdigit():
                raise web.HTTPBadRequest(reason=f"a chunk index is a non-negative integer, not {text[:40]!r}")
            offset = header_int(request, "X-Offset", required=True)
            total = header_int(request, "X-Total-Bytes", required=False)
            assert offset is not None
            await self.chunk(
                version,
                int(text),
                offset,
                await _read_chunk(request),
                request.headers.get("X-Sha256", ""),
                total,
            )
            return web.json_response({"ok": True})

        async def commit(request: web.Request) -> web.Response:
            require_admin(request)
            version = new_version(request)
            body = await json_object(request)
            try:
                sha, chunks, size = str(body["chunks_sha256"]), int(body["chunks"]), int(body["bytes"])
                kind = str(body.get("kind", "full"))
            except (KeyError, TypeError, ValueError):
                raise web.HTTPBadRequest(reason="a commit needs chunks_sha256, chunks and bytes") from None
            try:
                result = await self.commit(version, sha, chunks, size, kind)
            except WeightUpdateFailed as e:
                return _sync_error(e)
            return web.json_response(result)

        async def commit_delta(request: web.Request) -> web.Response:
            """A delta against the engines' version (agentrl.weights.delta): 409 "base_mismatch" when
            they hold another, 400 when it is malformed or does not rebuild to the learner's digest."""
            require_admin(request)
            version = new_version(request)
            body = await json_object(request)
            from agentrl.web import error_response
            from agentrl.weights.delta import commit_fields, delta_installer

            try:
                sha, chunks, size = str(body["chunks_sha256"]), int(body["chunks"]), int(body["bytes"])
                base, digest = commit_fields(body)
            except (KeyError, TypeError, ValueError):
                raise web.HTTPBadRequest(reason="a delta commit needs chunks_sha256, "
                                                "chunks, bytes, base (the version it "
                                                "is against) and digest (64 hex digits)") from None
            try:
                result = await self.commit(
                    version, sha, chunks, size, install=delta_installer(self.updater, base, digest)
                )
            except DeltaError as e:
                return error_response(str(e), e.status, type="weight_sync_error", code=e.code)
            except WeightUpdateFailed as e:
                return _sync_error(e)
            return web.json_response(result)

        async def nccl_init(request: web.Request) -> web.Response:
            require_admin(request)
            body = await json_object(request)
            try:
                address, port = str(body["master_address"]), int(body["master_port"])
                per_engine = int(body.get("workers_per_engine", 1))
            except (KeyError, TypeError, ValueError):
                raise web.HTTPBadRequest(reason="an NCCL init needs master_address "
                                                "and master_port (an integer)") from None
            try:
                result = await self.updater.init_weight_transfer(
                    address, port, workers_per_engine=per_engine, packed=bool(body.get("packed", True)),
                    packed_buffer_size_bytes=body.get("packed_buffer_size_bytes"),
                    packed_num_buffers=body.get("packed_num_buffers"), world_size=body.get("world_size"))
            except WeightGroupStale as e:
                raise web.HTTPConflict(reason=str(e)) from None
            except WeightUpdateFailed as e:
                return _sync_error(e)
            return web.json_response(result)

        async def nccl_update(request: web.Request) -> web.Response:
            require_admin(request)
            version = new_version(request)
            body = await json_object(request)
            if not isinstance(body.get("update_info"), dict):
                raise web.HTTPBadRequest(reason="an NCCL update needs update_info "
                                                "(names, dtype_names, shapes)")
            async with self._lock:
                if version <= self.updater.version:
                    raise web.HTTPConflict(reason=f"version {version} is not newer "
                                                  f"than {self.updater.version}")
                try:
                    result = await self.updater.update_weights_nccl(version, body["update_info"])
                except WeightGroupStale as e:
                    raise web.HTTPConflict(reason=str(e)) from None
                except WeightUpdateFailed as e:
                    return _sync_error(e)
                self.last = result
            return web.json_response(result)

        app.router.add_put(prefix + "/{version}/chunks/{index}", put_chunk)
        app.router.add_post(prefix + "/{version}/commit", commit)
        if self.adapters_only:
            return
        app.router.add_post("/admin/weights/{version}/delta", commit_delta)
        app.router.add_post("/admin/weights/nccl/init", nccl_init)
        app.router.add_post("/admin/weights/nccl/{version}/update", nccl_update)


MAX_CHUNK_BYTES = 64 << 20


async def _read_chunk(request: web.Request) -> bytes:
    """A chunk's body, up to :data:`MAX_CHUNK_BYTES` (the app's own body limit is for chat requests,
    far smaller than a weight chunk; this route has its own)."""
    if request.content_length is not None and request.content_length > MAX_CHUNK_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_CHUNK_BYTES, actual_size=request.content_length)
    data = bytearray()
    async for piece in request.content.iter_chunked(1 << 20):
        data += piece
        if len(data) > MAX_CHUNK_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_CHUNK_BYTES, actual_size=len(data))
    return bytes(data)


def _error_message(text: str) -> str:
    import json

    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:2000]


DELTA_REFUSALS = ("base_mismatch", "digest_mismatch", "malformed_delta")


def _error_code(body: object) -> str | None:
    """The ``code`` of serve's one error shape in a body, if any."""
    try:
        code = json.loads(body).get("error", {}).get("code")  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        return None
    return code if isinstance(code, str) else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _digest_of(chunk_digests: Iterable[str]) -> str:
    """The commit's checksum: SHA-256 of the chunks' hex digests, in order."""
    h = hashlib.sha256()
    for d in chunk_digests:
        h.update(d.encode())
    return h.hexdigest()


def _write_at(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    finally:
        os.close(fd)


def serialize_state_dict(state: dict[str, Any]) -> bytes:
    """safetensors bytes of a (CPU, contiguous) state dict; tied weights are saved once."""
    from safetensors.torch import save

    seen: dict[int, str] = {}
    out = {}
    for name, t in state.items():
        ptr = t.data_ptr()
        if ptr in seen:  # tied (e.g. lm_head = embed_tokens): vLLM ties them again on load
            continue
        seen[ptr] = name
        out[name] = t.detach().to("cpu").contiguous()
    return save(out)


async def _await_commit(http: ServeClient, send: Awaitable[Answer], version: int, policy: str | None,
                        every_s: float) -> Answer | None:
    """The commit's answer (``send``); None once serve, asked on another connection every
    ``every_s``, serves ``version``: the answer was lost. A serve that then does not answer at all
    ends the wait as a no-answer (:class:`TransportError` without a status)."""
    from agentrl.errors import TransportError

    task = asyncio.ensure_future(send)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            try:
                info = await http.json("GET", "/admin/info", timeout_s=10.0, retries=0)
            except TransportError as e:
                if not e.retryable:
                    continue  # serve answers but has no such route: wait for the commit's own answer
                raise TransportError(f"commit of version {version}: no answer in {every_s:.0f} s, and serve "
                                     f"does not answer /admin/info either ({e})") from None
            serving = info.get("version", 0) if policy is None else \
                (info.get("policies") or {}).get(policy, {}).get("version", 0)
            if isinstance(serving, int) and serving >= version:
                log.warning("version %d: serve serves it, but the commit's answer was lost", version)
                return None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def publish(data: bytes, version: int, serve_url: str, admin_token: str, *,
                  timeout_s: float = 600.0, chunk_timeout_s: float | None = None, attempts: int = 3,
                  chunk_bytes: int = CHUNK_BYTES,
                  parallel: int = PARALLEL_CHUNKS, kind: str = "full", commit_route: str = "commit",
                  commit_fields: dict[str, Any] | None = None, policy: str | None = None) -> dict[str, Any]:
    """Send serialised weights to serve as ``version`` and wait until engines serve them.

    ``policy``: a named LoRA policy's adapter (multi-LoRA), sent to that policy's routes
    (``/admin/policies/<policy>/weights``) and numbered by its own versions.

    ``commit_route`` and ``commit_fields``: a delta (:mod:`agentrl.weights.delta`) commits to
    ``delta`` with its base and digest; serve's refusal of one is :class:`DeltaRefused`, at once.

    Each chunk and the commit go through serve's one client (:class:`~agentrl.client.ServeClient`:
    connection errors, timeouts and 5xx retried, never a 4xx). A conflict (409: a chunk serve has
    not got, e.g. after a restart) sends the whole version again, up to ``attempts`` times; engines
    that could not load it are :class:`EnginesFailed` (sending again would not help).

    ``timeout_s`` bounds the commit (which waits for the engines), ``chunk_timeout_s`` (default
    ``timeout_s``) each chunk's request: a chunk cut by the network (a partition that blackholes
    the connection) is sent again after it, on a new connection. When no try got an answer, or a
    try that got none may have committed (a 409 "not newer" after one: the commit's answer was
    lost), the error is ``unreachable``: the learner then compares serve's version with its own.

    While the commit's answer is awaited, serve is asked for its version on another connection
    every ``chunk_timeout_s``: a commit whose answer a partition swallowed returns as soon as serve
    is seen serving the version (``answer_lost``), and one whose serve does not answer at all is
    given up as a no-answer, instead of either waiting out ``timeout_s``."""
    from agentrl.client import ServeClient
    from agentrl.errors import TransportError

    view = memoryview(data)  # chunks are views: no copy of the whole payload
    offsets = list(range(0, len(data), chunk_bytes)) or [0]
    chunks = [view[o : o + chunk_bytes] for o in offsets]
    # off the loop: the learner's loop serves other work
    chunk_shas = await asyncio.to_thread(lambda: [_sha256(c) for c in chunks])
    commit = {
        "chunks_sha256": _digest_of(chunk_shas),
        "chunks": len(chunks),
        "bytes": len(data),
        "kind": kind,
        **(commit_fields or {}),
    }
    last_error: Exception | None = None
    unanswered = False  # a try got no answer: what serve did with it is unknown
    route = f"/admin/policies/{policy}/weights" if policy else "/admin/weights"
    async with ServeClient(serve_url, admin_token, timeout_s=timeout_s, retries=2, backoff_s=0.5) as http:
        slots = asyncio.Semaphore(max(1, parallel))

        async def put(i: int) -> None:
            async with slots:
                await http.request("PUT", f"{route}/{version}/chunks/{i}", data=chunks[i],
                                   timeout_s=chunk_timeout_s or timeout_s,
                                   headers={"X-Sha256": chunk_shas[i], "X-Offset": str(offsets[i]),
                                            "X-Total-Bytes": str(len(data))})

        for attempt in range(attempts):
            try:
                sends = [asyncio.ensure_future(put(i)) for i in range(len(chunks))]
                try:
                    await asyncio.gather(*sends)
                finally:  # one failed: stop the rest before trying again
                    for t in sends:
                        t.cancel()
                    await asyncio.gather(*sends, return_exceptions=True)
                got = await _await_commit(
                    http, http.request("POST", f"{route}/{version}/{commit_route}", json=commit, accept={502},
                                       retries=0),
                    version, policy, chunk_timeout_s or timeout_s)
                if got is None:  # serve serves the version: the commit's answer was lost
                    return {"version": version, "engines": {}, "failed": [], "answer_lost": True}
                text = got.body.decode(errors="replace")
                if got.status == 502:
                    if "weight_sync_error" in text:
                        # The engines failed, not the transfer: sending again would not help. The
                        # pool kept its previous version, so the learner can publish the next one.
                        raise EnginesFailed(_error_message(text), 502)
                    raise TransportError(f"commit answered 502: {_error_message(text)}", status=502)
                result = got.json()
                if result.get("failed"):
                    log.error("version %d: engines %s failed and were taken out: %s", version,
                              result["failed"], {n: result["engines"][n] for n in result["failed"]})
                return result
            except EnginesFailed:
                raise
            except TransportError as e:
                last_error = e
                unanswered = unanswered or e.status is None
                code = _error_code(e.body)
                if code in DELTA_REFUSALS:  # the delta cannot be applied: sending it again would not help
                    raise DeltaRefused(
                        f"serve refused the delta for version {version}: {e}", e.status, code
                    ) from None
                if e.status is not None and 400 <= e.status < 500 and e.status != 409:
                    break  # a 4xx other than a conflict will not be fixed by retrying
                log.warning("weight publish attempt %d failed: %s", attempt + 1, e)
                await asyncio.sleep(1.0 * (attempt + 1))
    raise WeightTransferError(f"could not publish version {version}: {last_error}",
                              getattr(last_error, "status", None),
                              unreachable=isinstance(last_error, TransportError) and (
                                  last_error.retryable or (unanswered and last_error.status == 409)))
