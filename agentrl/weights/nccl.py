"""NCCL weight sync for GPU clusters: the learner broadcasts, serve drives each engine's update.

The learner (rank 0) and every engine worker (ranks 1..) form a communicator of their own through
vLLM's stateless process group, on its own rendezvous port; it is never the training process
group, so FSDP collectives and weight broadcasts cannot interleave. Per version:

1. the learner posts ``/admin/weights/nccl/<version>/update`` to serve with the parameters' names,
   dtypes and shapes;
2. serve, holding its update lock, pauses every member engine (``mode=keep``) and calls vLLM's
   ``/start_weight_update`` then ``/update_weights`` (the workers block in the receive);
3. meanwhile the learner broadcasts the tensors in packed buckets (vLLM's packed producer: the
   engine unpacks with the same bucket size, double-buffered);
4. serve calls ``/finish_weight_update``, resets the prefix cache (in-flight requests re-prefill
   under the new weights, none aborted), stamps the version and resumes, exactly as the file path.

Failure: a rank that dies mid-broadcast leaves the communicator unusable; serve's per-step timeouts
end the update, survivors are resumed, the group is dropped, and :meth:`NCCLWeightSender.publish`
raises (:class:`EnginesFailed` when serve says no engine took the version). The learner re-forms
the group (:meth:`connect`) with the engines that answer and carries on with the next version.
torch and vLLM are imported only when a sender connects, after :func:`require_nccl` has checked
that this process can be rank 0 at all. The learner uses this through
:class:`agentrl.weights.transports.NcclTransport` (``weights.transport.kind = "nccl"``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from agentrl.weights.errors import EnginesFailed, WeightTransferError
from agentrl.weights.transfer import _error_message

if TYPE_CHECKING:
    from agentrl.client import ServeClient

log = logging.getLogger(__name__)


NEEDS = ('the NCCL weight transport (weights.transport.kind = "nccl") broadcasts from the learner\'s GPU: '
         "it needs a CUDA device here and vLLM's CUDA build installed beside torch; without them use "
         'weights.transport.kind = "http"')


def require_nccl() -> None:
    """Raise :class:`WeightTransferError` saying what is missing unless this process can be rank 0.

    Checked before serve is asked to have its engines join, so a learner without CUDA fails at
    once and no engine waits in a rendezvous that will never come.
    """
    try:
        import torch
    except ImportError as e:
        raise WeightTransferError(f"{NEEDS} (torch does not import: {e})") from None
    if not torch.cuda.is_available():
        raise WeightTransferError(f"{NEEDS} (torch {torch.__version__} sees no CUDA device)")
    try:
        import vllm.distributed.weight_transfer.nccl_common  # noqa: F401
        import vllm.distributed.weight_transfer.packed_tensor  # noqa: F401
    except ImportError as e:
        raise WeightTransferError(f"{NEEDS} (vLLM's weight-transfer modules do not import: {e})") from None


def update_info(params: list[tuple[str, Any]]) -> dict[str, list]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` as a dict: names, dtype names and shapes, in send order."""
    return {"names": [n for n, _ in params], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in params],
            "shapes": [list(t.shape) for _, t in params]}


def unique_params(named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Named tensors with tied ones sent once (vLLM ties lm_head to the embedding again)."""
    seen: set[int] = set()
    out = []
    for name, t in named:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append((name, t.detach()))
    return out


class NCCLWeightSender:
    """Learner side of the NCCL path (rank 0). ``await connect()`` once, ``await publish()`` per version."""

    def __init__(self, serve_url: str, admin_token: str, master_address: str, master_port: int, *,
                 workers_per_engine: int = 1, packed_buffer_size_bytes: int = 256 * 2**20,
                 packed_num_buffers: int = 2, timeout_s: float = 600.0) -> None:
        self.serve_url = serve_url.rstrip("/")
        self.admin_token = admin_token
        self.master_address = master_address
        self.master_port = master_port
        self.workers_per_engine = workers_per_engine
        self.buffer_bytes = packed_buffer_size_bytes
        self.num_buffers = packed_num_buffers
        self.timeout_s = timeout_s
        self.group: Any = None
        self.world_size = 0

    def _client(self, timeout_s: float) -> ServeClient:
        from agentrl.client import ServeClient

        # no retries: a collective call that failed half-way is answered by re-forming the group
        return ServeClient(self.serve_url, self.admin_token, timeout_s=timeout_s, retries=0)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from agentrl.errors import TransportError

        async with self._client(self.timeout_s) as http:
            try:
                got = await http.request("POST", path, json=body, accept={502})
            except TransportError as e:
                raise WeightTransferError(f"{path}: {e.message}", e.status) from None
        text = got.body.decode(errors="replace")
        if got.status == 502:
            if "weight_sync_error" in text:  # serve answered: no engine took it
                raise EnginesFailed(f"{path}: {_error_message(text)}", 502)
            raise WeightTransferError(f"{path}: 502 {_error_message(text)}", 502)
        return got.json()

    async def _engines_answering(self) -> int:
        async with self._client(30.0) as http:
            data = await http.json("GET", "/admin/engines")
        return sum(1 for e in data["engines"] if e.get("healthy"))

    async def connect(self) -> dict[str, Any]:
        """Form the weight-transfer group: serve has its engines join while we open rank 0."""
        require_nccl()
        import torch
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        self.close()
        for attempt in range(3):
            world = 1 + await self._engines_answering() * self.workers_per_engine
            join = asyncio.create_task(self._post("/admin/weights/nccl/init", {
                "master_address": self.master_address, "master_port": self.master_port, "world_size": world,
                "workers_per_engine": self.workers_per_engine, "packed": True,
                "packed_buffer_size_bytes": self.buffer_bytes, "packed_num_buffers": self.num_buffers}))
            device = torch.cuda.current_device()
            opening = asyncio.create_task(asyncio.to_thread(
                stateless_init_process_group, self.master_address, self.master_port, 0, world, device))
            done, _ = await asyncio.wait({join, opening}, return_when=asyncio.FIRST_EXCEPTION)
            if join in done and join.exception() is not None:
                err = join.exception()
                opening.cancel()  # the thread stays blocked in the rendezvous until its store times out
                if isinstance(err, WeightTransferError) and err.status == 409 and attempt < 2:
                    log.warning("engines changed while forming the weight group (%s); retrying", err)
                    continue
                raise WeightTransferError(f"could not form the NCCL weight group: {err}")
            self.group = await opening
            result = await join
            self.world_size = world
            log.info("NCCL weight group formed: %d ranks, members %s", world, result["members"])
            return result
        raise WeightTransferError("could not form the NCCL weight group: engines kept changing")

    async def publish(self, named_params: Iterable[tuple[str, Any]], version: int) -> dict[str, Any]:
        """Broadcast ``named_params`` (CUDA tensors, full not sharded) as ``version``; return serve's
        result."""
        if self.group is None:
            await self.connect()
        params = unique_params(named_params)
        serve = asyncio.create_task(self._post(f"/admin/weights/nccl/{version}/update",
                                               {"update_info": update_info(params)}))
        failed = threading.Event()
        send = asyncio.create_task(asyncio.to_thread(self._broadcast, params, failed))
        done, _ = await asyncio.wait({serve, send}, return_when=asyncio.FIRST_EXCEPTION)
        if serve in done and serve.exception() is not None:
            # serve refused or the engines failed: the broadcast may never be received, so the
            # communicator is abandoned (its thread ends when NCCL does) and re-formed next time.
            failed.set()
            self.group = None
            err = serve.exception()
            status = getattr(err, "status", None)
            failed = EnginesFailed if isinstance(err, EnginesFailed) else WeightTransferError
            raise failed(f"version {version} was not loaded: {err}", status)
        await send
        return await serve

    def _broadcast(self, params: list[tuple[str, Any]], failed: threading.Event) -> None:
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        def items() -> Iterator[tuple[str, Any]]:
            for name, t in params:
                if failed.is_set():
                    raise WeightTransferError("serve gave up on this version")
                yield name, t

        packed_nccl_broadcast_producer(
            iterator=items(),
            group=self.group,
            src=0,
            post_iter_func=lambda x: x[1],
            buffer_size_bytes=self.buffer_bytes,
            num_buffers=self.num_buffers,
        )
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.destroy()
            except Exception as e:  # a broken communicator may not tear down cleanly
                log.warning("destroying the weight group: %s", e)
            self.group = None
