"""Delta weight sync: only what changed since the version the engines hold, losslessly.

Role: both sides of ``weights.transport.kind = "delta"``. The learner's
:class:`~agentrl.weights.transports.DeltaTransport` keeps the state it last published, cast to
the engines' dtype (what the engines hold is what counts: bf16 engines hold bf16 casts of the
learner's fp32 master weights), encodes the next version against it (:func:`encode_delta`) and
sends it with the HTTP transport's checksummed chunks (:func:`agentrl.weights.transfer.publish`)
to ``POST /admin/weights/<v>/delta``. Serve (:func:`delta_installer`, run by
:meth:`agentrl.weights.transfer.WeightReceiver.commit`) rebuilds the full version from its stored
full weights of the base (:func:`apply_delta`) and writes it as ``weights/v<v>/model.safetensors``,
which the engines then reload like any full version.

The encoding is a safetensors file. Per changed tensor ``name`` either
``name::full`` (the whole new tensor, when that is smaller), or ``name::count`` (int32, changed
elements per block of 65,536 flat elements), ``name::offset`` (int16, each changed element's
index within its block, two's complement of 0..65535) and ``name::values`` (the new values, in
the tensor's dtype), in flat index order. Unchanged tensors are not in it. Its metadata names the
``format``, the ``base`` and new ``version``, and the ``digest`` (:func:`state_digest`) of the
whole new state. "Changed" is bitwise (a -0.0 that became 0.0 is a change), so applying the delta
to the base gives the new state bit for bit.

Invariants:
- A delta is applied only to its own base: the engines' current version, whose full weights serve
  stored (``updater.weights_path``); otherwise :class:`~agentrl.weights.errors.DeltaError`
  ("base_mismatch", answered 409) and the learner sends the full weights.
- Serve writes a version only if its rebuilt state hashes to the learner's digest ("digest_mismatch",
  400, otherwise); malformed input (names, shapes, dtypes, indices that do not fit the base) is a
  400 ("malformed_delta"), never a half-applied state.
- Every version serve writes is a full file, so an engine that returns, or a restarted serve, loads
  it as today.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.weights.errors import DeltaError

if TYPE_CHECKING:
    import torch

    from agentrl.weights.updates import EngineUpdater, PolicyUpdater

log = logging.getLogger(__name__)

FORMAT = "agentrl-delta/1"
BLOCK_BITS = 16  # changed elements are indexed within blocks of 2**16, so an offset fits 2 bytes
DTYPES = ("bfloat16", "float16", "float32")
_PARTS = ("full", "count", "offset", "values")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise DeltaError(f"dtype {name!r} is not one of {list(DTYPES)}")
    return getattr(torch, name)


def cast_state(state: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The state as the engines hold it: floating tensors cast to ``dtype`` (round to nearest even,
    as vLLM's load casts), on the CPU, contiguous; tied duplicates (one storage under two names,
    e.g. a tied LM head) kept once, under the first name, as the full path serialises them."""
    dt = torch_dtype(dtype)
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.data_ptr()
        if ptr in seen and t.numel():
            continue
        seen.add(ptr)
        t = t.detach().to("cpu")
        out[name] = (t.to(dt) if t.is_floating_point() else t).contiguous()
        if (
            out[name].data_ptr() == ptr
        ):  # already in dtype on the CPU: a copy, so later steps cannot change it
            out[name] = out[name].clone()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, flat (for a bitwise comparison)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(ints[t.element_size()])


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy())


def state_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 over every tensor, by sorted name: its name, dtype, shape and raw bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(_raw(t))
    return h.hexdigest()


@dataclass
class DeltaStats:
    """What one delta holds (reported in the publish result)."""

    tensors: int = 0  # tensors in the state
    changed_tensors: int = 0  # tensors with at least one changed element
    dense_tensors: int = 0  # of those, sent whole
    elements: int = 0
    changed_elements: int = 0
    bytes: int = 0  # the encoded delta

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "changed_fraction": self.changed_elements / max(1, self.elements)}


def _check_alike(base: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    if set(base) != set(new):
        missing, extra = sorted(set(base) - set(new)), sorted(set(new) - set(base))
        raise DeltaError("the new state's tensors differ from the base's "
                         f"(missing {missing[:5]}, new {extra[:5]})")
    for name, t in new.items():
        b = base[name]
        if b.shape != t.shape or b.dtype != t.dtype:
            raise DeltaError(
                f"{name}: {t.dtype} {list(t.shape)} against the base's {b.dtype} {list(b.shape)}"
            )


def encode_delta(base: Mapping[str, Any], new: Mapping[str, Any], base_version: int,
                 version: int) -> tuple[bytes, DeltaStats]:
    """The delta that turns ``base`` (version ``base_version``) into ``new`` (``version``), bit for bit."""
    import torch
    from safetensors.torch import save

    _check_alike(base, new)
    out: dict[str, Any] = {}
    stats = DeltaStats(tensors=len(new))
    for name in sorted(new):
        a, b = base[name], new[name]
        n = b.numel()
        stats.elements += n
        changed = _bits(a) != _bits(b)
        k = int(changed.sum())
        if k == 0:
            continue
        stats.changed_tensors += 1
        stats.changed_elements += k
        blocks = -(-n >> BLOCK_BITS) if n else 0
        if k * (2 + b.element_size()) + 4 * blocks >= n * b.element_size():
            out[f"{name}::full"] = b
            stats.dense_tensors += 1
            continue
        idx = changed.nonzero().flatten()
        out[f"{name}::count"] = torch.bincount(idx >> BLOCK_BITS, minlength=blocks).to(torch.int32)
        low = idx & 0xFFFF
        out[f"{name}::offset"] = (low - ((low & 0x8000) << 1)).to(torch.int16)  # 0..65535 as int16
        out[f"{name}::values"] = b.reshape(-1)[idx]
    floating = {str(t.dtype).removeprefix("torch.") for t in new.values() if t.is_floating_point()}
    if len(floating) > 1:
        raise DeltaError(f"the state mixes floating dtypes {sorted(floating)}; "
                         "cast it to the engines' (cast_state)")
    meta = {"format": FORMAT, "base": str(base_version), "version": str(version), "digest": state_digest(new),
            "dtype": floating.pop() if floating else ""}
    data = save(out, metadata=meta)
    stats.bytes = len(data)
    return data, stats


def delta_metadata(data: bytes) -> dict[str, str]:
    """The metadata of an encoded delta (its safetensors header's ``__metadata__``), checked."""
    if len(data) < 8:
        raise DeltaError(f"a delta of {len(data)} bytes has no safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise DeltaError(f"the delta's header says {size} bytes; the delta has {len(data) - 8} after it")
    try:
        header = json.loads(data[8 : 8 + size])
        meta = header["__metadata__"]
    except (ValueError, KeyError, TypeError):
        raise DeltaError("the delta's header is not safetensors JSON with __metadata__") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DeltaError(f"not an {FORMAT} delta (format "
                         f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    for key in ("base", "version", "digest"):
        if not isinstance(meta.get(key), str):
            raise DeltaError(f"the delta's metadata has no {key}")
    if not (meta["base"].isdigit() and meta["version"].isdigit()):
        raise DeltaError("the delta's base and version are not integers: "
                         f"{meta['base']!r}, {meta['version']!r}")
    return meta


def apply_delta(
    base: dict[str, Any], data: bytes, base_version: int, *, inplace: bool = False
) -> dict[str, Any]:
    """``base`` (version ``base_version``) with the delta ``data`` applied: the delta's version, bit
    for bit, checked against its digest. ``inplace``: change ``base``'s tensors (serve's own copy).

    Raises :class:`DeltaError`: "base_mismatch" when the delta is against another version,
    "malformed_delta" for anything that does not fit ``base``, "digest_mismatch" when the result
    is not the learner's state."""
    import torch
    from safetensors.torch import load

    meta = delta_metadata(data)
    if int(meta["base"]) != base_version:
        raise DeltaError(f"the delta is against version {meta['base']}; the engines hold {base_version}",
                         "base_mismatch")
    try:
        parts = load(data)
    except Exception as e:  # safetensors' own error type: a header that does not describe the bytes
        raise DeltaError(f"the delta's tensors cannot be read: {e}") from None
    by_name: dict[str, dict[str, Any]] = {}
    for key, t in parts.items():
        name, _, part = key.rpartition("::")
        if part not in _PARTS or name not in base:
            raise DeltaError(f"the delta names {key!r}, which is no part of a tensor of the base")
        by_name.setdefault(name, {})[part] = t
    out = base if inplace else dict(base)
    for name, p in by_name.items():
        b = base[name]
        if set(p) == {"full"}:
            full = p["full"]
            if full.shape != b.shape or full.dtype != b.dtype:
                raise DeltaError(f"{name}: the delta's whole tensor is {full.dtype} "
                                 f"{list(full.shape)}, the base's {b.dtype} {list(b.shape)}")
            out[name] = full.clone()
            continue
        if set(p) != {"count", "offset", "values"}:
            raise DeltaError(f"{name}: the delta has parts {sorted(p)}, not full or count + offset + values")
        count, offset, values = p["count"], p["offset"], p["values"]
        n = b.numel()
        blocks = -(-n >> BLOCK_BITS) if n else 0
        if count.dtype != torch.int32 or count.shape != (blocks,) or offset.dtype != torch.int16 \
                or offset.dim() != 1 or values.dtype != b.dtype or values.shape != offset.shape:
            raise DeltaError(f"{name}: count {count.dtype} {list(count.shape)}, offset {offset.dtype} "
                             f"{list(offset.shape)}, values {values.dtype} {list(values.shape)} do not fit "
                             f"{b.dtype} {list(b.shape)} ({blocks} blocks)")
        if bool((count < 0).any()) or int(count.sum()) != offset.numel():
            raise DeltaError(f"{name}: the block counts do not add up "
                             f"to the {offset.numel()} changed elements")
        idx = (
            torch.repeat_interleave(torch.arange(blocks, dtype=torch.int64), count.to(torch.int64))
            << BLOCK_BITS
        ) | (offset.to(torch.int64) & 0xFFFF)
        if idx.numel() and int(idx.max()) >= n:
            raise DeltaError(f"{name}: a changed element's index is beyond its {n} elements")
        t = b if inplace else b.clone()
        t.reshape(-1)[idx] = values
        out[name] = t
    digest = state_digest(out)
    if digest != meta["digest"]:
        raise DeltaError(f"the rebuilt version {meta['version']} does not match the learner's digest "
                         f"({digest[:12]} against {meta['digest'][:12]})", "digest_mismatch")
    return out


def load_weights(folder: Path) -> dict[str, Any]:
    """Every tensor of a weights folder's safetensors files (a full version serve stored)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    if not files:
        raise DeltaError(f"no safetensors file in {folder}", "base_mismatch")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def delta_installer(updater: EngineUpdater | PolicyUpdater, base_version: int,
                    digest: str) -> Callable[[Path, Path], None]:
    """How serve turns a staged delta into a full version's file (``install(staged, target)``), for
    :meth:`~agentrl.weights.transfer.WeightReceiver.commit`; it runs under the receiver's lock, so
    the engines' version cannot change meanwhile. ``base_version`` and ``digest`` are what the
    learner's commit said; the delta file must say the same."""

    def install(staged: Path, target: Path) -> None:
        from safetensors.torch import save_file

        if base_version != updater.version or not updater.weights_path:
            raise DeltaError(
                f"the delta is against version {base_version}; the engines hold version "
                f"{updater.version}{'' if updater.weights_path else ' (no full weights stored for it)'}",
                "base_mismatch",
            )
        data = staged.read_bytes()
        meta = delta_metadata(data)
        if meta["digest"] != digest or int(meta["base"]) != base_version:
            raise DeltaError("the delta's metadata (base, digest) differs from its commit's")
        base = load_weights(Path(updater.weights_path))
        if meta.get("dtype"):  # a base stored in another dtype (an fp32 full version) as the engines hold it
            dt = torch_dtype(meta["dtype"])
            base = {k: v.to(dt) if v.is_floating_point() and v.dtype != dt else v for k, v in base.items()}
        new = apply_delta(base, data, base_version, inplace=True)
        save_file(new, str(target))

    return install


def commit_fields(body: Mapping[str, Any]) -> tuple[int, str]:
    """The delta commit's ``base`` (a version) and ``digest``; DeltaError for anything else."""
    base, digest = body.get("base"), body.get("digest")
    if (
        not isinstance(base, int)
        or isinstance(base, bool)
        or base < 0
        or not isinstance(digest, str)
        or len(digest) != 64
    ):
        raise DeltaError("a delta commit needs base (the version it is against) and digest (64 hex digits)")
    return base, digest
