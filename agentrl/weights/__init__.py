"""Weight sync: moving the learner's weights into the engines, versioned.

- :mod:`agentrl.weights.config`: ``WeightsConfig`` and the transport variants (``weights.transport.kind``);
- :mod:`agentrl.weights.transports`: the learner's side, ``WeightTransport`` and ``make_transport``;
- :mod:`agentrl.weights.transfer`: the HTTP/file upload and serve's ``WeightReceiver`` routes;
- :mod:`agentrl.weights.nccl`: the NCCL broadcast (learner side);
- :mod:`agentrl.weights.adapters`: LoRA adapters packed for the upload and unpacked for vLLM;
- :mod:`agentrl.weights.delta`: deltas against the engines' version (both sides);
- :mod:`agentrl.weights.updates`: serve's ``EngineUpdater``, the choreography on the engines;
- :mod:`agentrl.weights.vllm_ext`: the vLLM worker extension the engines run;
- :mod:`agentrl.weights.errors`: ``WeightSyncError`` and its family.

The config and the errors import only the standard library; the rest (aiohttp, the router's
pool) loads on first use of its name here, so the config tree, which imports this package, keeps
``agentrl --help`` fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from agentrl.weights.config import (
    AdapterTransportConfig,
    DeltaTransportConfig,
    HttpTransportConfig,
    NcclTransportConfig,
    TransportConfig,
    WeightsConfig,
)
from agentrl.weights.errors import (
    DeltaError,
    DeltaRefused,
    EnginesFailed,
    WeightGroupStale,
    WeightSyncError,
    WeightTransferError,
    WeightUpdateFailed,
)

_LAZY = {
    "DeltaTransport": "agentrl.weights.transports",
    "EngineUpdater": "agentrl.weights.updates",
    "AdapterTransport": "agentrl.weights.transports",
    "HttpTransport": "agentrl.weights.transports",
    "NcclTransport": "agentrl.weights.transports",
    "WeightTransport": "agentrl.weights.transports",
    "make_transport": "agentrl.weights.transports",
    "WeightReceiver": "agentrl.weights.transfer",
    "publish": "agentrl.weights.transfer",
    "serialize_state_dict": "agentrl.weights.transfer",
}

__all__ = [
    "AdapterTransport",
    "AdapterTransportConfig",
    "DeltaError",
    "DeltaRefused",
    "DeltaTransport",
    "DeltaTransportConfig",
    "EngineUpdater",
    "EnginesFailed",
    "HttpTransport",
    "HttpTransportConfig",
    "NcclTransport",
    "NcclTransportConfig",
    "TransportConfig",
    "WeightGroupStale",
    "WeightReceiver",
    "WeightSyncError",
    "WeightTransferError",
    "WeightTransport",
    "WeightUpdateFailed",
    "WeightsConfig",
    "make_transport",
    "publish",
    "serialize_state_dict",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
