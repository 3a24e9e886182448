"""The Tinker SDK's wire formats: requests in, results out, as JSON or protobuf.

Role: :func:`read_forward_backward` turns a ``/api/v1/forward_backward`` body (the SDK's protobuf
message since about 0.30, zstd-compressed when the server asks for it; JSON before) into
:class:`Datum` lists the trainer reads; :func:`forward_backward_result` writes the per-datum
outputs back in the form the caller's ``Accept`` header asks for (protobuf ``ForwardBackwardOutput``
for the SDKs that ask, JSON otherwise). The protobuf schema is the SDK's own generated module
(``tinker.proto.tinker_public_pb2``): the service speaks exactly the messages the installed SDK
release writes.

Invariants:
- Every size is checked before it is used: the decompressed body is bounded (a zstd bomb stops at
  the bound), a tensor's bytes must be exactly its shape times its item size, dtypes are the two
  the public wire has (float32, int64), and only text chunks are model input here.
- A malformed request raises :class:`BadRequest` (a 400 in the SDK's error shape), never a 500.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.errors import AgentrlError

PROTO = "application/x-protobuf"
MAX_BODY_BYTES = 256 << 20  # a decompressed request body, at most
DTYPES = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}


class TinkerError(AgentrlError):
    """A Tinker request the service refuses: ``status`` is the HTTP status, ``category`` the SDK's
    error category (``user`` for the caller's mistake, ``server`` for ours)."""

    status = 500
    category = "server"


class BadRequest(TinkerError):
    status = 400
    category = "user"


class NotFound(TinkerError):
    status = 404
    category = "user"


class Busy(TinkerError):
    status = 429
    category = "server"


@dataclass
class Datum:
    tokens: list[int]  # the model input (text chunks, in order)
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # loss_fn_inputs, shaped


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool = False  # forward: outputs and loss, no gradient


def _pb() -> Any:
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # pragma: no cover - the tinker extra is part of the install
        raise TinkerError("the service needs the tinker SDK for its wire messages: pip install "
                          "'agentrl[tinker]'") from e
    return tinker_public_pb2


def decompress(body: bytes, encoding: str) -> bytes:
    """The body as sent, zstd-decoded when ``Content-Encoding: zstd`` (bounded by MAX_BODY_BYTES)."""
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise BadRequest(f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(MAX_BODY_BYTES + 1)
    except zstandard.ZstdError as e:
        raise BadRequest(f"the zstd body does not decode: {e}") from None
    if len(out) > MAX_BODY_BYTES:
        raise BadRequest(f"the decompressed body is over {MAX_BODY_BYTES >> 20} MiB")
    return out


def _shaped(flat: np.ndarray, shape: list[int], name: str) -> np.ndarray:
    if not shape:
        return flat
    if any(s < 0 for s in shape) or math.prod(shape) != flat.size:
        raise BadRequest(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold its {flat.size} values")
    return flat.reshape(shape)


def _tensor_from_proto(msg: Any, name: str) -> np.ndarray:
    pb = _pb()
    dtype = {pb.DTYPE_FLOAT32: DTYPES["float32"], pb.DTYPE_INT64: DTYPES["int64"]}.get(msg.dtype)
    if dtype is None:
        raise BadRequest(f"loss_fn_inputs[{name!r}]: dtype {msg.dtype} is not float32 or int64")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values, crow, col = (np.frombuffer(b, dtype=t) for b, t in ((csr.values, dtype), (csr.crow_indices,
                                                                    np.int64), (csr.col_indices, np.int64)))
        return _csr_dense(values, crow, col, shape, 0, f"loss_fn_inputs[{name!r}]")
    if len(msg.dense) % dtype.itemsize:
        raise BadRequest(f"loss_fn_inputs[{name!r}]: {len(msg.dense)} bytes are not whole {dtype} values")
    return _shaped(np.frombuffer(msg.dense, dtype=dtype).copy(), shape, name)


def _csr_dense(values: np.ndarray, crow: np.ndarray, col: np.ndarray, shape: list[int], pad: int,
               what: str) -> np.ndarray:
    """A sparse CSR matrix (``crow``: row pointers, ``col``: column of each value) as a dense
    ``shape`` array, ``pad`` where nothing is listed; BadRequest naming ``what`` if it is not one."""
    if len(shape) != 2 or crow.shape != (shape[0] + 1,) or col.shape != values.shape or crow[0] != 0 or \
            crow[-1] != values.size or (np.diff(crow) < 0).any() or \
            (col.size and (col.min() < 0 or col.max() >= shape[1])):
        raise BadRequest(f"{what}: an inconsistent sparse CSR tensor")
    dense = np.full(shape, pad, dtype=values.dtype)
    dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return dense


def _tokens_from_proto(chunks: Any) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk") if hasattr(chunk, "WhichOneof") else None
        if kind is not None and kind != "encoded_text":
            raise BadRequest(f"model input chunks of kind {kind!r} are not supported (text tokens only)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise BadRequest("an encoded_text chunk's bytes are not whole int32 tokens")
        tokens += np.frombuffer(raw, dtype=np.int32).tolist()
    return tokens


def _forward_backward_from_proto(body: bytes) -> ForwardBackward:
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise BadRequest(f"the body is not a ForwardBackwardRequest message: {e}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the newer map wins where both are set
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = [Datum(_tokens_from_proto(d.model_input),
                  {name: _tensor_from_proto(t, name) for name, t in d.loss_fn_inputs.items()})
            for d in msg.data]
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, config, data, bool(msg.forward_only))


def _tensor_from_json(obj: Any, name: str) -> np.ndarray:
    if isinstance(obj, list):  # a bare list: the SDK's own default dtype for the name
        obj = {"data": obj, "dtype": "int64" if name == "target_tokens" else "float32"}
    if not isinstance(obj, dict) or obj.get("dtype") not in DTYPES or not isinstance(obj.get("data"), list):
        raise BadRequest(f"loss_fn_inputs[{name!r}] must be a TensorData with data and a dtype of "
                         f"{sorted(DTYPES)}")
    try:
        flat = np.asarray(obj["data"], dtype=DTYPES[obj["dtype"]]).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise BadRequest(f"loss_fn_inputs[{name!r}]: {e}") from None
    shape = obj.get("shape") or []
    if not isinstance(shape, list) or not all(isinstance(s, int) for s in shape):
        raise BadRequest(f"loss_fn_inputs[{name!r}]: shape must be a list of integers")
    return _shaped(flat, shape, name)


def _tokens_from_json(model_input: Any) -> list[int]:
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise BadRequest("model_input must be an object with a list of chunks")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise BadRequest("model input chunks other than encoded_text are not supported "
                             "(text tokens only)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("an encoded_text chunk's tokens must be a list of integers")
        tokens += ids
    return tokens


def _forward_backward_from_json(req: Any) -> ForwardBackward:
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    fbi = req.get("forward_backward_input") or req.get("forward_input")
    if not isinstance(fbi, dict) or not isinstance(fbi.get("data"), list):
        raise BadRequest("forward_backward_input with a list of data is required")
    data = []
    for d in fbi["data"]:
        if not isinstance(d, dict):
            raise BadRequest("each datum must be an object")
        inputs = d.get("loss_fn_inputs") or {}
        if not isinstance(inputs, dict):
            raise BadRequest("loss_fn_inputs must be an object")
        data.append(Datum(_tokens_from_json(d.get("model_input")),
                          {str(k): _tensor_from_json(v, str(k)) for k, v in inputs.items()}))
    config = fbi.get("loss_fn_config") or {}
    if not isinstance(config, dict) or not all(isinstance(v, int | float | str) for v in config.values()):
        raise BadRequest("loss_fn_config must map names to numbers or strings")
    seq_id = req.get("seq_id") or 0
    if not isinstance(seq_id, int):
        raise BadRequest("seq_id must be an integer")
    return ForwardBackward(str(req.get("model_id", "")), seq_id, str(fbi.get("loss_fn", "")), dict(config),
                           data, "forward_input" in req)


def read_forward_backward(body: bytes, content_type: str, encoding: str = "") -> ForwardBackward:
    """A forward(-backward) request from its body, protobuf or JSON by ``content_type``."""
    body = decompress(body, encoding)
    if content_type.startswith(PROTO):
        return _forward_backward_from_proto(body)
    import orjson

    try:
        return _forward_backward_from_json(orjson.loads(body))
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None


def forward_backward_result(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float],
                            *, proto: bool) -> tuple[bytes, str]:
    """A ``ForwardBackwardOutput`` as (body, content type): the protobuf ``ArrayRecord`` layout (one
    batched tensor per field, byte offsets per datum) or the JSON of the SDK's older releases."""
    if not proto:
        import orjson

        out = {"loss_fn_output_type": "ArrayRecord", "metrics": metrics,
               "loss_fn_outputs": [{k: _tensor_json(v) for k, v in o.items()} for o in outputs]}
        return orjson.dumps(out), "application/json"
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        arrays = [o[name] for o in outputs]
        bt = record.fields[name]
        bt.dtype = pb.DTYPE_INT64 if arrays[0].dtype == np.int64 else pb.DTYPE_FLOAT32
        np_dtype = np.int64 if bt.dtype == pb.DTYPE_INT64 else np.float32
        parts = [np.ascontiguousarray(a, dtype=np_dtype).tobytes() for a in arrays]
        bt.data = b"".join(parts)
        bt.offsets = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64).tobytes()
        bt.trailing_shape.extend(list(arrays[0].shape[1:]))
    return msg.SerializeToString(), PROTO


MAX_TARGETS = 64  # target_prompt_logprobs' K, at most


def target_cells(obj: Any, rows: int, vocab: int) -> np.ndarray:
    """A sample request's ``target_prompt_logprobs`` (an int64 TensorData of shape ``[rows, K]``,
    dense or sparse CSR) as a dense int64 matrix, ``-1`` in every cell that asks for nothing; each id
    in the vocabulary."""
    name = "target_prompt_logprobs"
    if not isinstance(obj, dict) or obj.get("dtype") != "int64" or not isinstance(obj.get("data"), list):
        raise BadRequest(f"{name} must be a TensorData of int64 token ids")
    shape = obj.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in shape)) \
            or shape[0] != rows or not 1 <= shape[1] <= MAX_TARGETS:
        raise BadRequest(f"{name} must be 2-D, [len(prompt) - 1, K] = [{rows}, K] with K from 1 to "
                         f"{MAX_TARGETS}; got shape {shape!r}")
    try:
        values = np.asarray(obj["data"], dtype=np.int64).reshape(-1)
        crow, col = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
        if crow is None and col is None:
            if values.size != rows * shape[1]:
                raise BadRequest(f"{name}: shape {shape} does not hold its {values.size} values")
            dense = values.reshape(shape)
        else:
            dense = _csr_dense(values, np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64),
                               shape, -1, name)
    except (TypeError, ValueError, OverflowError) as e:
        raise BadRequest(f"{name}: {e}") from None
    if dense.size and (dense.min() < -1 or dense.max() >= vocab):
        raise BadRequest(f"{name}: a token id is outside the vocabulary [0, {vocab}) (and not -1)")
    return dense


def _tensor_json(a: np.ndarray) -> dict[str, Any]:
    return {"data": a.reshape(-1).tolist(), "dtype": str(a.dtype), "shape": list(a.shape)}


def _tensor_proto(msg: Any, a: np.ndarray) -> None:
    pb = _pb()
    msg.dtype = pb.DTYPE_INT64 if a.dtype == np.int64 else pb.DTYPE_FLOAT32
    msg.shape.extend(list(a.shape))
    msg.dense = np.ascontiguousarray(a, dtype=np.int64 if a.dtype == np.int64 else np.float32).tobytes()


def sample_result(result: Any, *, proto: bool) -> tuple[bytes, str]:
    """A ``SampleResponse`` (from :class:`agentrl.tinker.sampler.SampleResult`) as (body, content
    type): protobuf, tokens as int32 and logprobs as float32 bytes, or the JSON of older SDKs."""
    if not proto:
        import orjson

        def rows(topk: list[list[tuple[int, float]]]) -> list[Any]:
            return [[(t, max(lp, MASK_LOGPROB)) for t, lp in row] or None for row in topk]

        sequences = []
        for s in result.sequences:
            seq: dict[str, Any] = {"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs}
            if s.topk is not None:
                seq["topk_logprobs"] = rows(s.topk)
            sequences.append(seq)
        out: dict[str, Any] = {"type": "sample", "sequences": sequences}
        if result.prompt_logprobs is not None:
            out["prompt_logprobs"] = [None if math.isnan(x) else x for x in result.prompt_logprobs]
        if result.topk_prompt is not None:
            out["topk_prompt_logprobs"] = rows(result.topk_prompt)
        if result.target_prompt is not None:
            out["target_prompt_logprobs"] = _tensor_json(result.target_prompt)
        if result.alt_tokens is not None:
            out["prompt_alt_tokens"] = {"tokens": _tensor_json(result.alt_tokens[0]),
                                        "logprobs": _tensor_json(result.alt_tokens[1])}
        return orjson.dumps(out), "application/json"
    pb = _pb()
    msg = pb.SampleResponse()
    for s in result.sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if s.stop_reason == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if s.topk is not None:
            _topk_message(seq.topk_sampled_logprobs, s.topk)
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(result.prompt_logprobs, dtype=np.float32).tobytes()
    if result.topk_prompt:
        _topk_message(msg.topk_prompt_logprobs, result.topk_prompt)
    if result.target_prompt is not None:
        _tensor_proto(msg.target_prompt_logprobs, result.target_prompt)
    if result.alt_tokens is not None:
        _tensor_proto(msg.prompt_alt_tokens.tokens, result.alt_tokens[0])
        _tensor_proto(msg.prompt_alt_tokens.logprobs, result.alt_tokens[1])
    return msg.SerializeToString(), PROTO


MASK_LOGPROB = -99999.0  # the SDK's filler of a top-k matrix (with token id 0); -inf is sent as it too


def _topk_message(msg: Any, topk: list[list[tuple[int, float]]]) -> None:
    """Per-position top-k lists as the SDK's dense ``TopkLogprobs`` (length x k, int32 ids and
    float32 logprobs), short rows filled with (0, MASK_LOGPROB): an all-filler row reads back None."""
    k = max((len(row) for row in topk), default=0)
    ids = np.zeros((len(topk), k), dtype=np.int32)
    lps = np.full((len(topk), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(topk):
        for j, (t, lp) in enumerate(row):
            ids[i, j], lps[i, j] = t, max(lp, MASK_LOGPROB)
    msg.length, msg.k = len(topk), k
    msg.token_ids, msg.logprobs = ids.tobytes(), lps.tobytes()
