"""The Tinker service's training runs and checkpoints, per tenant: where they live on disk and what
the SDK's REST calls read and change (list runs and checkpoints, weights info, delete, TTL, publish,
copy).

Role: :class:`agentrl.tinker.service.TinkerService` maps ``tinker://`` paths to files through this
store and answers ``RestClient`` with its records. Layout under the state folder::

    <tenant>/<run folder>/run.json          the training run and its checkpoints' settings
    <tenant>/<run folder>/<name>.pt         tinker://<run>/weights/<name> (save_state)
    <tenant>/<run folder>/sampler/<name>/   tinker://<run>/sampler_weights/<name> (a peft folder)

A run folder is the training client's id with ``:`` as ``_``; ``run.json`` keeps the id itself.

Invariants:
- A tenant reads its own runs and checkpoints, and another tenant's checkpoint only while its owner
  has published it, and then only to load or sample it: deleting, publishing, TTLs and listing a
  run stay with the owner. Anything else is unknown (404), as elsewhere in the service.
- ``run.json`` is rewritten whole (a temporary file, then a rename): a crash leaves the old one.
  Its changes are serialised by one lock: the worker thread records a saved checkpoint while a
  route may publish or delete another of the same run.
- A checkpoint past its TTL is deleted by the first call that looks at the store after it expired
  (every route that reads a path or a listing): no call ever sees an expired checkpoint. The store
  keeps the soonest expiry it knows, so a look before then reads no file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentrl.tinker.trainer import ATTN, MLP
from agentrl.tinker.wire import BadRequest, NotFound

NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # a checkpoint's name, as save_state takes it
RUN_ID = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> the SDK's checkpoint_type
TTL_RANGE = (3600, 10 * 365 * 86400)  # the SDK's documented bounds: one hour to ten years


@dataclass(frozen=True)
class Ref:
    """One checkpoint: ``tinker://<run>/<kind>/<name>``."""

    run: str
    kind: str  # "weights" or "sampler_weights"
    name: str

    @property
    def path(self) -> str:
        return f"tinker://{self.run}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


def parse(path: Any, kinds: tuple[str, ...] = tuple(KINDS)) -> Ref:
    """``path`` as a checkpoint reference of one of ``kinds``, or BadRequest (no ``.``/``..``
    segments, nothing outside the names save_state accepts)."""
    parts = path[len("tinker://"):].split("/") if isinstance(path, str) and path.startswith("tinker://") \
        else []
    if len(parts) != 3 or parts[1] not in kinds or not RUN_ID.fullmatch(parts[0]) or \
            not NAME.fullmatch(parts[2]) or not parts[0].strip(".") or not parts[2].strip("."):
        shapes = " or ".join(f"tinker://<training client>/{k}/<name>" for k in kinds)
        raise BadRequest(f"{path!r} is not a checkpoint path of this service ({shapes})")
    return Ref(*parts)


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat()


class CheckpointStore:
    """The runs and checkpoints under ``root``; ``clock`` is wall time (a test may pass its own);
    ``on_remove(tenant, ref)`` hears of every checkpoint deleted or expired (the service takes
    sampler weights out of the engine)."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.time,
                 on_remove: Callable[[str, Ref], None] | None = None) -> None:
        self.root, self.clock, self.on_remove = Path(root), clock, on_remove
        self._lock = threading.RLock()  # every read-modify-write of a run.json
        self._soonest = float("-inf")  # no checkpoint expires before this (-inf: unknown, scan)

    # --- where things are ---------------------------------------------------------------------------

    def run_dir(self, tenant: str, run: str) -> Path:
        return self.root / tenant / run.replace(":", "_")

    def file(self, tenant: str, ref: Ref) -> Path:
        d = self.run_dir(tenant, ref.run)
        return d / f"{ref.name}.pt" if ref.kind == "weights" else d / "sampler" / ref.name

    def locate(self, tenant: str, ref: Ref) -> tuple[Path, str]:
        """(the checkpoint's file or folder, its owner) for reading by ``tenant``: its own, or a
        published one of another tenant; NotFound otherwise."""
        self.expire()
        own = self.file(tenant, ref)
        if own.exists():
            return own, tenant
        tenants = sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []
        for other in tenants:
            theirs = self.file(other, ref)
            if other != tenant and self._settings(other, ref).get("public") and theirs.exists():
                return theirs, other
        raise NotFound(f"no checkpoint {ref.path} for this API key")

    # --- run.json -----------------------------------------------------------------------------------

    def _read(self, tenant: str, run: str) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir(tenant, run) / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    def _write(self, tenant: str, run: str, record: dict[str, Any]) -> None:
        d = self.run_dir(tenant, run)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "run.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, d / "run.json")

    def _settings(self, tenant: str, ref: Ref) -> dict[str, Any]:
        return self._read(tenant, ref.run).get("checkpoints", {}).get(ref.checkpoint_id, {})

    def _change(self, tenant: str, ref: Ref, **settings: Any) -> None:
        with self._lock:
            record = self._read(tenant, ref.run)
            entry = record.setdefault("checkpoints", {}).setdefault(ref.checkpoint_id, {})
            entry.update(settings)
            self._write(tenant, ref.run, record)
            if settings.get("expires_at") is not None:
                self._soonest = min(self._soonest, settings["expires_at"])

    def record_run(self, tenant: str, run: str, *, base_model: str, rank: int, targets: list[str],
                   user_metadata: dict[str, Any] | None = None) -> None:
        """A training client exists (created, or created from a checkpoint)."""
        with self._lock:
            record = self._read(tenant, run)
            record.update(training_run_id=run, base_model=base_model, lora_rank=rank, targets=targets,
                          user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
                          created=record.get("created", self.clock()))
            self._write(tenant, run, record)

    def saved(self, tenant: str, ref: Ref, *, ttl_seconds: Any = None, user_metadata: Any = None) -> None:
        """A checkpoint was written: its TTL and metadata (a checkpoint written again starts afresh)."""
        expires = self.clock() + check_ttl(ttl_seconds) if ttl_seconds is not None else None
        meta = {str(k): str(v) for k, v in user_metadata.items()} if isinstance(user_metadata, dict) else None
        self._change(tenant, ref, public=False, expires_at=expires, user_metadata=meta, saved_at=self.clock())

    # --- what the SDK lists -------------------------------------------------------------------------

    def checkpoints(self, tenant: str, run: str) -> list[dict[str, Any]]:
        """The run's checkpoints as the SDK's ``Checkpoint``, oldest first (by when saved, then id)."""
        self.expire()
        d = self.run_dir(tenant, run)
        # a sampler folder still being written (``<name>.tmp``, a copy's ``.copying-*``) is not one yet
        found = [(Ref(run, "weights", p.name[:-3]), p) for p in d.glob("*.pt")] + \
            [(Ref(run, "sampler_weights", p.name), p) for p in (d / "sampler").glob("*")
             if p.is_dir() and not p.name.endswith(".tmp") and not p.name.startswith(".")]
        settings = self._read(tenant, run).get("checkpoints", {})
        out = []
        for ref, p in found:
            s = settings.get(ref.checkpoint_id, {})
            size = p.stat().st_size if p.is_file() else \
                sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            out.append({"checkpoint_id": ref.checkpoint_id, "checkpoint_type": KINDS[ref.kind],
                        "time": _iso(p.stat().st_mtime), "tinker_path": ref.path, "size_bytes": size,
                        "public": bool(s.get("public")), "user_metadata": s.get("user_metadata"),
                        "expires_at": _iso(s.get("expires_at")),
                        "_order": (s.get("saved_at", p.stat().st_mtime), ref.checkpoint_id)})
        out.sort(key=lambda c: c["_order"])
        for c in out:
            del c["_order"]
        return out

    def runs(self, tenant: str) -> list[str]:
        """The tenant's run ids that have a folder, oldest first."""
        base = self.root / tenant
        folders = [p for p in base.iterdir() if p.is_dir()] if base.is_dir() else []
        records = sorted((self._read(tenant, p.name) for p in folders), key=lambda r: r.get("created", 0))
        return [r["training_run_id"] for r in records if "training_run_id" in r]

    def run(self, tenant: str, run: str, last_request: float | None = None) -> dict[str, Any]:
        """The SDK's ``TrainingRun`` for one of the tenant's runs (NotFound: not one of its runs)."""
        record = self._read(tenant, run)
        if record.get("training_run_id") != run:
            raise NotFound(f"no training run {run!r} for this API key")
        cps = self.checkpoints(tenant, run)
        last = {t: next((c for c in reversed(cps) if c["checkpoint_type"] == t), None)
                for t in ("training", "sampler")}
        return {"training_run_id": run, "base_model": record["base_model"], "model_owner": tenant,
                "is_lora": True, "corrupted": False, "lora_rank": record["lora_rank"],
                "last_request_time": _iso(last_request or record.get("created")),
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": record.get("user_metadata") or None}

    def weights_info(self, tenant: str, ref: Ref) -> dict[str, Any]:
        """What a checkpoint is (the SDK's ``WeightsInfoResponse``), for its owner or a reader."""
        _, owner = self.locate(tenant, ref)
        record = self._read(owner, ref.run)
        targets = set(record.get("targets") or [])
        return {"base_model": record.get("base_model"), "is_lora": True, "lora_rank": record.get("lora_rank"),
                "train_attn": bool(targets & set(ATTN)), "train_mlp": bool(targets & set(MLP)),
                "train_unembed": "lm_head" in targets, "optimizer_config": {"type": "adam"}}

    # --- what the owner changes ---------------------------------------------------------------------

    def owned(self, tenant: str, ref: Ref) -> Path:
        """The file of one of ``tenant``'s own checkpoints (NotFound: none, or another's)."""
        self.expire()
        f = self.file(tenant, ref)
        if not f.exists():
            raise NotFound(f"no checkpoint {ref.path} for this API key")
        return f

    def delete(self, tenant: str, ref: Ref) -> None:
        f = self.owned(tenant, ref)
        self._remove(tenant, ref, f)

    def copy(self, tenant: str, ref: Ref, run: str, *, ttl_seconds: Any = None,
             project: str | None = None) -> Ref:
        """Checkpoint ``ref`` (``tenant``'s own, or one another tenant published) as a checkpoint of
        the same kind and name in ``tenant``'s new run ``run``, which records where it came from and
        no training client. Files are hard links where the file system allows (checkpoints are
        written whole and renamed, never changed in place, so a link is a copy), copies otherwise;
        the copy appears whole or not at all, and outlives its source."""
        if self._read(tenant, run):
            raise BadRequest(f"training run {run} exists already")
        src, owner = self.locate(tenant, ref)
        record = self._read(owner, ref.run)
        new = Ref(run, ref.kind, ref.name)
        dest = self.file(tenant, new)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # beside the run's checkpoints, under a name no listing reads (no .pt, not under sampler/)
        tmp = self.run_dir(tenant, run) / f".copying-{secrets.token_hex(4)}"
        try:
            if src.is_dir():
                shutil.copytree(src, tmp, copy_function=_link_or_copy)
            else:
                _link_or_copy(src, tmp)
            os.replace(tmp, dest)
        except FileNotFoundError:  # deleted or expired meanwhile
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise NotFound(f"no checkpoint {ref.path} for this API key") from None
        meta = {"copied_from": ref.path, **({"project_id": project} if project else {})}
        self.record_run(tenant, run, base_model=record.get("base_model", ""), rank=record.get("lora_rank", 0),
                        targets=list(record.get("targets") or []), user_metadata=meta)
        self.saved(tenant, new, ttl_seconds=ttl_seconds)
        return new

    def publish(self, tenant: str, ref: Ref, public: bool) -> None:
        self.owned(tenant, ref)
        self._change(tenant, ref, public=public)

    def set_ttl(self, tenant: str, ref: Ref, ttl_seconds: Any) -> None:
        self.owned(tenant, ref)
        expires = None if ttl_seconds is None else self.clock() + check_ttl(ttl_seconds)
        self._change(tenant, ref, expires_at=expires)

    def expire(self) -> list[Ref]:
        """Delete every checkpoint past its TTL; the ones deleted (sampler weights among them are the
        caller's to take out of the engine)."""
        now, gone, soonest = self.clock(), [], float("inf")
        if now < self._soonest:
            return gone
        with self._lock:
            for run_json in self.root.glob("*/*/run.json") if self.root.is_dir() else []:
                tenant = run_json.parent.parent.name
                try:
                    record = json.loads(run_json.read_text())
                except (OSError, ValueError):
                    continue
                run = record.get("training_run_id")
                if not isinstance(run, str) or self.run_dir(tenant, run) != run_json.parent:
                    continue  # not a run this store recorded: nothing of it is touched
                for cid, s in list(record.get("checkpoints", {}).items()):
                    if s.get("expires_at") is not None and s["expires_at"] <= now:
                        kind, _, name = cid.partition("/")
                        ref = Ref(run, kind, name)
                        self._remove(tenant, ref, self.file(tenant, ref))
                        gone.append(ref)
                    elif s.get("expires_at") is not None:
                        soonest = min(soonest, s["expires_at"])
            self._soonest = soonest
        return gone

    def _remove(self, tenant: str, ref: Ref, f: Path) -> None:
        with self._lock:
            if f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)
            record = self._read(tenant, ref.run)
            record.get("checkpoints", {}).pop(ref.checkpoint_id, None)
            self._write(tenant, ref.run, record)
        if self.on_remove is not None:
            self.on_remove(tenant, ref)


def _link_or_copy(src: Any, dst: Any) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def check_ttl(ttl_seconds: Any) -> int:
    lo, hi = TTL_RANGE
    if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool) or not lo <= ttl_seconds <= hi:
        raise BadRequest(f"ttl_seconds must be an integer from {lo} (an hour) to {hi} (ten years), or "
                         f"null for no expiry; got {ttl_seconds!r}")
    return ttl_seconds
