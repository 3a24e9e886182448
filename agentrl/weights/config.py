"""How ``agentrl learn`` publishes its weights: ``LearnConfig.weights`` and its transport variants.

``weights.transport`` is a tagged union: each variant is a dataclass whose ``kind`` field (a
one-value ``Literal``) names it, and whose other fields are that transport's own settings
(``[weights.transport] kind = "nccl"`` in a config file). :func:`agentrl.weights.transports.make_transport`
builds the learner's transport from it. A new transport (a delta against the engines' version, a
LoRA adapter) is one more dataclass in :data:`TransportConfig` and one entry in that builder.

This module imports only the standard library: the config tree loads without torch or aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class HttpTransportConfig:
    """Full weights as checksummed safetensors chunks over HTTP; serve writes them to
    ``weights/v<version>/`` and every engine reloads that file (also what a returning engine loads)."""

    kind: Literal["http"] = "http"
    chunk_bytes: int = 16 * 2**20  # bytes per chunk (each with its own SHA-256 and offset)
    parallel_chunks: int = 3  # chunks in flight at once: serve hashes and writes one while the next arrives
    attempts: int = 3  # tries of one version's upload (connection errors, 5xx, 409); a 4xx is not retried
    timeout_s: float = 600.0  # limit for the commit (which waits for the engines to load the version)
    chunk_timeout_s: float = 60.0
    """limit per chunk request: an upload cut by the network (a partition) is sent again after this"""


@dataclass
class NcclTransportConfig:
    """The learner's GPU broadcasts the weights to every engine worker over a communicator of their
    own (never the training process group); serve drives each engine's receive. Needs CUDA and
    vLLM's CUDA build on the learner and the engines."""

    kind: Literal["nccl"] = "nccl"
    master_address: str = ""
    """address the engines reach the learner's rank 0 at; empty: this host's, on its route to serve"""
    master_port: int = 29600  # rendezvous port of the weight-transfer group (not the training group's port)
    workers_per_engine: int = 1
    """worker processes per engine (its tensor-parallel size), each a rank of the group"""
    packed_buffer_bytes: int = 256 * 2**20
    """bytes per broadcast bucket (the engines unpack with the same size)"""
    packed_buffers: int = 2  # buckets in flight at once (double-buffered)
    timeout_s: float = 600.0  # limit per call to serve (forming the group; one version's receive)


@dataclass
class AdapterTransportConfig:
    """LoRA (``learn.lora.rank > 0``): only the adapter travels, over the same checksummed chunked
    upload as full weights; every engine loads it as its own adapter (``policy-v<N>``) beside the
    versions before it, with no pause, and new requests go to the newest. serve's engines need
    LoRA on (``engine.lora_rank`` >= the adapter's rank; ``agentrl run`` sets it)."""

    kind: Literal["adapter"] = "adapter"
    chunk_bytes: int = 16 * 2**20  # bytes per chunk (an adapter is usually one chunk)
    attempts: int = 3  # tries of one version's upload (connection errors, 5xx, 409); a 4xx is not retried
    timeout_s: float = 600.0  # limit for the commit (which waits for the engines to load the version)
    chunk_timeout_s: float = 60.0
    """limit per chunk request: an upload cut by the network (a partition) is sent again after this"""


@dataclass
class DeltaTransportConfig:
    """Only what changed since the version the engines hold, losslessly, in the engines' dtype
    (:mod:`agentrl.weights.delta`): changed elements' indices and values, or a whole tensor when
    most of it changed, over the HTTP transport's checksummed chunks. Serve rebuilds the full
    version from its stored weights, checks it bit for bit against the learner's digest and writes
    ``weights/v<version>/`` as a full version. The first publish, and any refused or failed delta,
    sends the full weights (in ``dtype``). Pays off with bf16 engines: at small learning rates only
    a few percent of bf16 elements change per step, while nearly every fp32 element does."""

    kind: Literal["delta"] = "delta"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """The dtype the engines hold (serve's engine.dtype): "auto" asks serve (/admin/info)."""
    full_every: int = 0  # send the full weights every N versions (0: only when a delta cannot be applied)
    chunk_bytes: int = 16 * 2**20  # bytes per chunk (each with its own SHA-256 and offset)
    parallel_chunks: int = 3  # chunks in flight at once
    attempts: int = 3  # tries of one version's upload (connection errors, 5xx, missing chunks)
    timeout_s: float = 600.0  # limit for the commit (which waits for the engines to load the version)
    chunk_timeout_s: float = 60.0
    """limit per chunk request: an upload cut by the network (a partition) is sent again after this"""

    def __post_init__(self) -> None:
        if self.full_every < 0:
            raise ValueError("weights.transport.full_every must be 0 (full weights only when needed) or more")


# by ``kind``
TransportConfig = HttpTransportConfig | NcclTransportConfig | AdapterTransportConfig | DeltaTransportConfig
TRANSPORT_KINDS: tuple[str, ...] = ("http", "nccl", "adapter", "delta")


@dataclass
class WeightsConfig:
    """Weight sync from the learner to serve's engines."""

    transport: HttpTransportConfig | NcclTransportConfig | AdapterTransportConfig | DeltaTransportConfig = (
        field(default_factory=HttpTransportConfig)
    )
    """How a version travels to the engines: kind = "http" (the default), "nccl", "adapter" (LoRA) or
    "delta", each with its own settings."""
