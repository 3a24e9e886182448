"""The per-sample versioned rollout buffer (see ``core`` for its invariants, ``docs/buffer.md``)."""

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "agentrl.buffer.codec": [
            "Batch",
            "CodecError",
            "decode_batch",
            "decode_sample",
            "encode_batch",
            "encode_sample",
        ],
        "agentrl.buffer.config": ["BufferConfig"],
        "agentrl.buffer.core": ["Buffer"],
        "agentrl.buffer.http": ["BufferClient", "BufferTransportError", "add_buffer_routes"],
        "agentrl.buffer.sample": ["Sample"],
        "agentrl.buffer.streams": ["PolicyBuffers"],
    },
)
