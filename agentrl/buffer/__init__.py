"""The per-sample versioned rollout buffer (see ``core`` for its invariants, ``docs/buffer.md``)."""

from agentrl.buffer.codec import Batch, CodecError, decode_batch, decode_sample, encode_batch, encode_sample
from agentrl.buffer.config import BufferConfig
from agentrl.buffer.core import Buffer
from agentrl.buffer.http import BufferClient, BufferTransportError, add_buffer_routes
from agentrl.buffer.sample import Sample

__all__ = [
    "Batch",
    "Buffer",
    "BufferClient",
    "BufferConfig",
    "BufferTransportError",
    "CodecError",
    "Sample",
    "add_buffer_routes",
    "decode_batch",
    "decode_sample",
    "encode_batch",
    "encode_sample",
]
