"""HTTP/file weight transfer: the learner streams checksummed safetensors chunks to serve.

Learner side: :func:`publish` serialises the state dict (safetensors), sends it in chunks, each with
its SHA-256, then commits with the whole file's SHA-256 and the policy version. Serve side:
:class:`WeightReceiver` appends chunks in order to a staging file, verifies the whole on commit,
moves it into ``weights/v<version>/`` and asks the engine pool to load it (pause(keep) -> reload ->
reset prefix cache -> set version -> resume). Any mismatch is a 4xx the learner can retry; nothing
half-written is loaded. If the engines fail, the commit answers 502 with a ``weight_sync_error``
body naming each engine and why; the pool stays at its previous version and the learner may publish
the next one. The NCCL routes (``/admin/weights/nccl/...``) drive the same choreography while the
learner broadcasts (see :mod:`agentrl.weights.nccl`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agentrl.weights.errors import WeightGroupStale, WeightUpdateFailed

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 2**20


class WeightTransferError(RuntimeError):
    """A weight update did not complete (transport, checksum or engine failure)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _sync_error(e: WeightUpdateFailed) -> web.Response:
    return web.json_response({"error": {"message": str(e), "type": "weight_sync_error", "param": None,
                                        "code": "engines_failed", "version": e.version, "engines": e.engines}},
                             status=502)


class WeightReceiver:
    """Serve's end of weight sync: staged chunks, verified commits, one update at a time."""

    def __init__(self, root: Path, pool: Any, keep: int = 2) -> None:
        self.root = root
        self.pool = pool
        self.keep = keep
        self._staging: dict[int, tuple[Path, int, Any]] = {}  # version -> (path, next chunk, sha)
        self._lock = asyncio.Lock()
        self.last: dict[str, Any] = {}
        root.mkdir(parents=True, exist_ok=True)

    async def chunk(self, version: int, index: int, data: bytes, sha: str) -> None:
        # Hashing and writing run off the event loop: the router shares it, and a 16 MiB SHA-256
        # would stall every agent's call for tens of milliseconds per chunk.
        if await asyncio.to_thread(_sha256, data) != sha:
            raise web.HTTPBadRequest(reason=f"chunk {index} of version {version} failed its checksum")
        if index == 0:
            path = self.root / f"v{version}.staging"
            path.unlink(missing_ok=True)
            self._staging[version] = (path, 0, hashlib.sha256())
        if version not in self._staging or self._staging[version][1] != index:
            raise web.HTTPConflict(reason=f"chunk {index} of version {version} arrived out of order; restart at 0")
        path, _, total = self._staging[version]
        await asyncio.to_thread(_append, path, data, total)
        self._staging[version] = (path, index + 1, total)

    async def commit(self, version: int, sha: str, chunks: int) -> dict[str, Any]:
        staged = self._staging.pop(version, None)
        if staged is None or staged[1] != chunks:
            raise web.HTTPConflict(reason=f"version {version}: {0 if staged is None else staged[1]} of "
                                          f"{chunks} chunks received")
        path, _, total = staged
        if total.hexdigest() != sha:
            path.unlink(missing_ok=True)
            raise web.HTTPBadRequest(reason=f"version {version}: the weights failed their checksum")
        async with self._lock:
            if version <= self.pool.version and self.pool.weights_path:
                raise web.HTTPConflict(reason=f"version {version} is not newer than {self.pool.version}")
            target = self.root / f"v{version}"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            path.rename(target / "model.safetensors")
            t0 = time.perf_counter()
            try:
                result = await self.pool.update_weights(str(target), version)
            except WeightUpdateFailed:
                shutil.rmtree(target, ignore_errors=True)  # no engine serves it: never a join target
                raise
            result["sync_s"] = time.perf_counter() - t0
            self.last = result
            self._prune(version)
            log.info("policy version %d loaded into %d engine(s) in %.2f s", version,
                     sum("error" not in v for v in result["engines"].values()), result["sync_s"])
            return result

    def _prune(self, version: int) -> None:
        for p in self.root.glob("v*"):
            try:
                v = int(p.name[1:].split(".")[0])
            except ValueError:
                continue
            if p.is_dir() and v <= version - self.keep:
                shutil.rmtree(p, ignore_errors=True)

    def add_routes(self, app: web.Application, require_admin: Any) -> None:
        async def put_chunk(request: web.Request) -> web.Response:
            require_admin(request)
            version, index = int(request.match_info["version"]), int(request.match_info["index"])
            await self.chunk(version, index, await request.read(), request.headers.get("X-Sha256", ""))
            return web.json_response({"ok": True})

        async def commit(request: web.Request) -> web.Response:
            require_admin(request)
            body = await request.json()
            try:
                result = await self.commit(int(request.match_info["version"]), body["sha256"], int(body["chunks"]))
            except WeightUpdateFailed as e:
                return _sync_error(e)
            return web.json_response(result)

        async def nccl_init(request: web.Request) -> web.Response:
            require_admin(request)
            body = await request.json()
            try:
                result = await self.pool.init_weight_transfer(
                    body["master_address"], int(body["master_port"]),
                    workers_per_engine=int(body.get("workers_per_engine", 1)), packed=bool(body.get("packed", True)),
                    packed_buffer_size_bytes=body.get("packed_buffer_size_bytes"),
                    packed_num_buffers=body.get("packed_num_buffers"), world_size=body.get("world_size"))
            except WeightGroupStale as e:
                raise web.HTTPConflict(reason=str(e)) from None
            except WeightUpdateFailed as e:
                return _sync_error(e)
            return web.json_response(result)

        async def nccl_update(request: web.Request) -> web.Response:
            require_admin(request)
            version = int(request.match_info["version"])
            body = await request.json()
            async with self._lock:
                if version <= self.pool.version:
                    raise web.HTTPConflict(reason=f"version {version} is not newer than {self.pool.version}")
                try:
                    result = await self.pool.update_weights_nccl(version, body["update_info"])
                except WeightGroupStale as e:
                    raise web.HTTPConflict(reason=str(e)) from None
                except WeightUpdateFailed as e:
                    return _sync_error(e)
                self.last = result
            return web.json_response(result)

        app.router.add_put("/admin/weights/{version}/chunks/{index}", put_chunk)
        app.router.add_post("/admin/weights/{version}/commit", commit)
        app.router.add_post("/admin/weights/nccl/init", nccl_init)
        app.router.add_post("/admin/weights/nccl/{version}/update", nccl_update)


class EnginesFailed(WeightTransferError):
    """The weights arrived but no engine could load them (the message names each engine)."""


def _error_message(text: str) -> str:
    import json

    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:2000]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _append(path: Path, data: bytes, total: Any) -> None:
    with open(path, "ab") as f:
        f.write(data)
    total.update(data)


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


async def publish(data: bytes, version: int, serve_url: str, admin_token: str, *,
                  timeout_s: float = 600.0, attempts: int = 3) -> dict[str, Any]:
    """Send serialised weights to serve as ``version`` and wait until engines serve them."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    sha = await asyncio.to_thread(_sha256, data)  # off the loop: the learner's loop serves other work
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    chunk_shas = await asyncio.to_thread(lambda: [_sha256(c) for c in chunks])
    last_error: Exception | None = None
    async with aiohttp.ClientSession(headers=headers) as http:
        for attempt in range(attempts):
            try:
                for i, c in enumerate(chunks):
                    async with http.put(f"{serve_url}/admin/weights/{version}/chunks/{i}", data=c,
                                        headers={"X-Sha256": chunk_shas[i]},
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                        if r.status != 200:
                            raise WeightTransferError(f"chunk {i}: {r.status} {await r.text()}", r.status)
                async with http.post(f"{serve_url}/admin/weights/{version}/commit",
                                     json={"sha256": sha, "chunks": len(chunks)},
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    if r.status == 502 and "weight_sync_error" in (text := await r.text()):
                        # The engines failed, not the transfer: sending again would not help. The
                        # pool kept its previous version, so the learner can publish the next one.
                        raise EnginesFailed(_error_message(text), r.status)
                    if r.status != 200:
                        raise WeightTransferError(f"commit: {r.status} {await r.text()}", r.status)
                    result = await r.json()
                    if result.get("failed"):
                        log.error("version %d: engines %s failed and were taken out: %s", version,
                                  result["failed"], {n: result["engines"][n] for n in result["failed"]})
                    return result
            except EnginesFailed:
                raise
            except (TimeoutError, aiohttp.ClientError, WeightTransferError) as e:
                last_error = e
                status = getattr(e, "status", None)
                if status is not None and 400 <= status < 500 and status != 409:
                    break  # a 4xx other than a conflict will not be fixed by retrying
                log.warning("weight publish attempt %d failed: %s", attempt + 1, e)
                await asyncio.sleep(1.0 * (attempt + 1))
    raise WeightTransferError(f"could not publish version {version}: {last_error}")
