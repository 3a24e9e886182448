"""The learner's side of weight sync: one small interface, one implementation per transport.

Role: after each optimizer step the learner (rank 0) hands its transport the policy's full
weights and the new version; the transport gets them into serve's engines. Which transport runs
is ``LearnConfig.weights.transport`` (:mod:`agentrl.weights.config`), built by
:func:`make_transport`:

- :class:`HttpTransport` (``kind = "http"``, the default): safetensors bytes in checksummed
  chunks over HTTP (:func:`agentrl.weights.transfer.publish`); serve writes a file and the engines
  reload it. The weights are gathered in host memory.
- :class:`NcclTransport` (``kind = "nccl"``): a broadcast from the learner's GPU to every engine
  worker (:class:`agentrl.weights.nccl.NCCLWeightSender`). The weights are gathered on the GPU.
- :class:`AdapterTransport` (``kind = "adapter"``, LoRA): the adapter alone, over the same upload
  as HTTP; serve loads each version as its own vLLM adapter (:mod:`agentrl.weights.adapters`).
  The learner gathers only its trainable tensors for it.
- :class:`DeltaTransport` (``kind = "delta"``): what changed since the version the engines hold,
  in their dtype, over the HTTP chunks (:mod:`agentrl.weights.delta`); the full weights when
  there is no base or serve refuses the delta. Gathered in host memory.

Invariants:
- ``publish`` returns serve's result once the engines serve ``version`` (some may be named in
  ``failed``), or raises a :class:`~agentrl.weights.errors.WeightSyncError`:
  :class:`~agentrl.weights.errors.EnginesFailed` when serve got the weights but no engine took
  them (serve kept its previous version; publishing the next version is a fresh attempt), another
  :class:`~agentrl.weights.errors.WeightTransferError` when the transport itself failed.
- ``device`` says where the learner must gather the full weights before ``publish``; the state
  given to ``publish`` is the policy's full state dict (tied duplicates left out), on that device.
- Building a transport is cheap and touches neither torch nor the network; what a transport
  needs (CUDA, vLLM's CUDA build) is checked on first use and named in the error.

Room to grow: the interface says "here is version ``v`` of the policy", not "send a whole state
dict over HTTP". A delta transport keeps the state it last published and sends what changed. Each
transport is a config dataclass in :mod:`agentrl.weights.config`, a class here and an entry in
:data:`TRANSPORTS`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit

from agentrl.errors import ConfigError
from agentrl.weights.config import (
    TRANSPORT_KINDS,
    AdapterTransportConfig,
    DeltaTransportConfig,
    HttpTransportConfig,
    NcclTransportConfig,
)

if TYPE_CHECKING:
    from agentrl.learner.lora import LoraConfig
    from agentrl.weights.nccl import NCCLWeightSender

log = logging.getLogger(__name__)


class WeightTransport(Protocol):
    """How a new policy version travels from the learner to serve's engines."""

    device: Literal["cpu", "cuda"]  # where the learner gathers the full weights it passes to publish()

    async def publish(self, state: Mapping[str, Any], version: int,
                      policy: str | None = None) -> dict[str, Any]:
        """Get ``state`` into the engines as ``version`` of ``policy`` (None: the one policy of a
        run without named policies); serve's result (see the module's invariants). Named policies
        are LoRA adapters: only :class:`AdapterTransport` carries one, the others refuse it."""
        ...

    async def close(self) -> None:
        """Release what the transport holds (connections, a communicator); publish is not called after."""
        ...


def _one_policy(transport: WeightTransport, policy: str | None) -> None:
    """Refuse a named policy where the transport sends the whole model (it has one policy only)."""
    if policy is not None:
        raise ConfigError(f"{type(transport).__name__} sends the whole model, one policy; named policy "
                          f"{policy!r} is a LoRA adapter: set weights.transport.kind = \"adapter\"")


class HttpTransport:
    """Full weights as safetensors over serve's chunked, checksummed upload (gathered on the CPU)."""

    device: Literal["cpu", "cuda"] = "cpu"

    def __init__(self, cfg: HttpTransportConfig, serve_url: str, admin_token: str) -> None:
        self.cfg = cfg
        self.serve_url = serve_url.rstrip("/")
        self.admin_token = admin_token

    async def publish(self, state: Mapping[str, Any], version: int,
                      policy: str | None = None) -> dict[str, Any]:
        from agentrl.weights.transfer import publish, serialize_state_dict

        _one_policy(self, policy)
        # off the loop: it copies every tensor
        data = await asyncio.to_thread(serialize_state_dict, dict(state))
        c = self.cfg
        return await publish(data, version, self.serve_url, self.admin_token, timeout_s=c.timeout_s,
                             chunk_timeout_s=c.chunk_timeout_s, attempts=c.attempts,
                             chunk_bytes=c.chunk_bytes, parallel=c.parallel_chunks)

    async def close(self) -> None:
        pass  # each publish opens and closes its own connections


class NcclTransport:
    """A broadcast from the learner's GPU over a weight-transfer group of its own (gathered on the GPU).

    The group is formed on the first publish, and again on the publish after one that failed (an
    engine came or went, or a receive failed: the sender drops the group). A version serve refused
    raises: :class:`~agentrl.weights.errors.EnginesFailed` when no engine took it, a
    :class:`~agentrl.weights.errors.WeightTransferError` with status 409 when the group no longer
    matched the engines.
    """

    device: Literal["cpu", "cuda"] = "cuda"

    def __init__(self, cfg: NcclTransportConfig, serve_url: str, admin_token: str) -> None:
        self.cfg = cfg
        self.serve_url = serve_url.rstrip("/")
        self.admin_token = admin_token
        self.sender: NCCLWeightSender | None = None  # made on first publish

    def _sender(self) -> NCCLWeightSender:
        from agentrl.weights.nccl import NCCLWeightSender, require_nccl

        require_nccl()  # before anything else: a clear error, never a rendezvous that cannot complete
        if self.sender is None:
            c = self.cfg
            address = c.master_address or address_towards(self.serve_url)
            self.sender = NCCLWeightSender(self.serve_url, self.admin_token, address, c.master_port,
                                           workers_per_engine=c.workers_per_engine,
                                           packed_buffer_size_bytes=c.packed_buffer_bytes,
                                           packed_num_buffers=c.packed_buffers, timeout_s=c.timeout_s)
        return self.sender

    async def publish(self, state: Mapping[str, Any], version: int,
                      policy: str | None = None) -> dict[str, Any]:
        _one_policy(self, policy)
        return await self._sender().publish(state.items(), version)

    async def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class AdapterTransport:
    """A LoRA policy's adapter alone (gathered on the CPU: a few MB), as one upload of kind "adapter".

    ``publish`` gets the learner's trainable state (the adapter tensors under the learner's module
    names); they travel under peft's names with the adapter's config, which ``lora`` (the learner's
    :class:`agentrl.learner.lora.LoraConfig`) gives."""

    device: Literal["cpu", "cuda"] = "cpu"

    def __init__(self, cfg: AdapterTransportConfig, serve_url: str, admin_token: str,
                 lora: LoraConfig | None = None, base_model: str = "") -> None:
        self.cfg = cfg
        self.serve_url = serve_url.rstrip("/")
        self.admin_token = admin_token
        self.lora = lora
        self.base_model = base_model
        self.last_bytes = 0  # the size of the last version sent (what the learner reports)

    async def publish(self, state: Mapping[str, Any], version: int,
                      policy: str | None = None) -> dict[str, Any]:
        """``policy``: a named policy's adapter (the learner's adapter of that name, sent to that
        policy's routes); None: the one policy's (the learner's adapter ``default``)."""
        from agentrl.weights.adapters import ADAPTER, adapter_config, adapter_state, pack_adapter
        from agentrl.weights.transfer import publish

        if self.lora is None or not self.lora.enabled:
            raise ConfigError("weights.transport.kind = \"adapter\" needs learn.lora.rank > 0")
        tensors = adapter_state(dict(state), adapter=policy or ADAPTER)
        if not tensors:
            raise ValueError("the adapter transport was given no adapter tensors (is the model a LoRA one?)")
        data = await asyncio.to_thread(pack_adapter, tensors, adapter_config(self.lora, self.base_model))
        self.last_bytes = len(data)
        c = self.cfg
        result = await publish(data, version, self.serve_url, self.admin_token, timeout_s=c.timeout_s,
                               chunk_timeout_s=c.chunk_timeout_s, attempts=c.attempts,
                               chunk_bytes=c.chunk_bytes, parallel=1, kind="adapter", policy=policy)
        result.setdefault("bytes", len(data))
        return result

    async def close(self) -> None:
        pass


class DeltaTransport:
    """Deltas against the version the engines hold, in their dtype (see :mod:`agentrl.weights.delta`).

    The transport keeps the state it last published (cast to ``dtype``) and its version. A publish
    sends the delta against it; the first publish, every ``full_every``-th version, a version not
    newer than the base, and a delta serve refused (the engines hold another version: a serve that
    restarted without restoring, an update that failed; a digest or format mismatch) send the full
    weights, in ``dtype``, through the HTTP upload. The base moves only once serve answered that
    the engines serve the version; after a failure other than :class:`EnginesFailed` (serve kept
    the base) it is dropped, so the next publish is full. ``last`` describes the latest publish.
    """

    device: Literal["cpu", "cuda"] = "cpu"

    def __init__(self, cfg: DeltaTransportConfig, serve_url: str, admin_token: str) -> None:
        self.cfg = cfg
        self.serve_url = serve_url.rstrip("/")
        self.admin_token = admin_token
        self.dtype: str | None = None if cfg.dtype == "auto" else cfg.dtype
        self.base: dict[str, Any] | None = None
        self.base_version = -1
        self.since_full = 0  # versions published since the last full one
        self.last: dict[str, Any] = {}

    async def _engine_dtype(self) -> str:
        """``dtype``, or with "auto" the engines' as serve reports it (``engine_dtype`` in /admin/info)."""
        if self.dtype is None:
            from agentrl.client import ServeClient
            from agentrl.weights.delta import DTYPES

            async with ServeClient(self.serve_url, self.admin_token, timeout_s=30.0) as http:
                info = await http.json("GET", "/admin/info")
            named = {"float": "float32", "half": "float16", "bf16": "bfloat16"}
            reported = str(info.get("engine_dtype", ""))
            dtype = named.get(reported, reported)
            if dtype not in DTYPES:
                raise ConfigError("weights.transport.dtype = 'auto': serve reports the "
                                  f"engines' dtype as {reported or 'nothing'!r}; set "
                                  f"weights.transport.dtype to one of {list(DTYPES)}")
            self.dtype = dtype
        return self.dtype

    async def publish(self, state: Mapping[str, Any], version: int,
                      policy: str | None = None) -> dict[str, Any]:
        from agentrl.weights import delta
        from agentrl.weights.errors import DeltaRefused, EnginesFailed, WeightTransferError
        from agentrl.weights.transfer import publish, serialize_state_dict

        _one_policy(self, policy)
        c = self.cfg
        send = {"timeout_s": c.timeout_s, "chunk_timeout_s": c.chunk_timeout_s, "attempts": c.attempts,
                "chunk_bytes": c.chunk_bytes, "parallel": c.parallel_chunks}
        new = await asyncio.to_thread(delta.cast_state, state, await self._engine_dtype())
        why_full = (
            "no base"
            if self.base is None
            else "not newer than the base"
            if version <= self.base_version
            else "full_every"
            if c.full_every and self.since_full + 1 >= c.full_every
            else ""
        )
        try:
            if not why_full:
                assert self.base is not None
                data, stats = await asyncio.to_thread(
                    delta.encode_delta, self.base, new, self.base_version, version
                )
                try:
                    result = await publish(
                        data,
                        version,
                        self.serve_url,
                        self.admin_token,
                        commit_route="delta",
                        commit_fields={
                            "base": self.base_version,
                            "digest": delta.delta_metadata(data)["digest"],
                        },
                        **send,
                    )
                    self.last = {"kind": "delta", "base": self.base_version, **stats.as_dict()}
                except DeltaRefused as e:
                    log.warning("version %d: %s; sending the full weights", version, e)
                    why_full = f"refused ({e.code})"
            if why_full:
                data = await asyncio.to_thread(serialize_state_dict, new)
                result = await publish(data, version, self.serve_url, self.admin_token, **send)
                self.last = {"kind": "full", "why": why_full, "bytes": len(data)}
        except EnginesFailed:
            raise  # serve kept the base version: the next delta is against it still
        except WeightTransferError:
            self.base = None  # what serve holds is unknown now: the next publish is full
            raise
        self.base, self.base_version = new, version
        self.since_full = 0 if self.last["kind"] == "full" else self.since_full + 1
        return {**result, "transport": self.last}

    async def close(self) -> None:
        self.base = None


TRANSPORTS: dict[str, Callable[..., WeightTransport]] = {
    "http": HttpTransport,
    "nccl": NcclTransport,
    "adapter": AdapterTransport,
    "delta": DeltaTransport,
}


def make_transport(
    cfg: HttpTransportConfig | NcclTransportConfig | AdapterTransportConfig | DeltaTransportConfig,
    serve_url: str,
    admin_token: str,
    *,
    lora: LoraConfig | None = None,
    base_model: str = "",
) -> WeightTransport:
    """The learner's transport for ``weights.transport`` (``cfg``), publishing to serve at ``serve_url``;
    ``lora`` / ``base_model``: what the adapter transport describes its adapters with."""
    kind = getattr(cfg, "kind", None)
    build = TRANSPORTS.get(kind)  # type: ignore[arg-type]
    if build is None:
        raise ConfigError(f"weights.transport.kind: {kind!r} is not one of {list(TRANSPORT_KINDS)}")
    if kind == "adapter":
        return build(cfg, serve_url, admin_token, lora, base_model)
    return build(cfg, serve_url, admin_token)


def address_towards(url: str) -> str:
    """This host's address on its route to ``url``'s host (what a peer there can reach us at).

    A UDP socket's connect sends nothing; it only picks the outgoing interface. Falls back to the
    host name's address when there is no route.
    """
    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
