"""The per-sample versioned rollout buffer (see ``core`` for its invariants, ``docs/buffer.md``)."""

from typing import TYPE_CHECKING

from agentrl._lazy import lazy

if TYPE_CHECKING:
    from agentrl.buffer.codec import (
        Batch,
        CodecError,
        decode_batch,
        decode_sample,
        encode_batch,
        encode_sample,
    )
    from agentrl.buffer.config import BufferConfig
    from agentrl.buffer.core import Buffer
    from agentrl.buffer.http import BufferClient, BufferTransportError, add_buffer_routes
    from agentrl.buffer.sample import Sample

__getattr__, __dir__ = lazy(__name__, {
    "Batch": "agentrl.buffer.codec",
    "CodecError": "agentrl.buffer.codec",
    "decode_batch": "agentrl.buffer.codec",
    "decode_sample": "agentrl.buffer.codec",
    "encode_batch": "agentrl.buffer.codec",
    "encode_sample": "agentrl.buffer.codec",
    "BufferConfig": "agentrl.buffer.config",
    "Buffer": "agentrl.buffer.core",
    "BufferClient": "agentrl.buffer.http",
    "BufferTransportError": "agentrl.buffer.http",
    "add_buffer_routes": "agentrl.buffer.http",
    "Sample": "agentrl.buffer.sample",
})

__all__ = ["Batch", "Buffer", "BufferClient", "BufferConfig", "BufferTransportError", "CodecError", "Sample", "add_buffer_routes", "decode_batch", "decode_sample", "encode_batch", "encode_sample"]
