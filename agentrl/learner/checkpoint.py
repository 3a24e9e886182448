"""Checkpoints with torch.distributed.checkpoint (DCP), exact resume, and Hugging Face export.

Layout of ``checkpoint_dir``::

    step_000012/            one complete checkpoint (renamed from step_000012.tmp when complete)
      __0_0.distcp ...      DCP shards: {"model": ..., "optim": ...}, written by every rank
      .metadata
      rank_0.pt ...         per rank: RNG states (torch, CUDA, Python), scheduler state
      meta.json             step, policy version, batch_id of the batch trained at this step and
                            its sample ids, and the ids of samples of earlier batches trained into
                            these weights whose ack was refused; with several policies
                            each one's version and step count instead
    latest                  name of the newest complete checkpoint (replaced atomically)

Invariants:
- A checkpoint is visible only once complete: ranks write into ``<name>.tmp``, meet at a
  barrier, then rank 0 renames it and replaces ``latest``. A process killed mid-write leaves a
  ``.tmp`` folder that resume ignores (and the next save removes).
- A save that runs out of disk space (ENOSPC, EDQUOT) removes its ``.tmp`` folder, logs an error
  and returns None: the previous checkpoint stays the newest, whole and loadable, and training
  goes on (the next save tries again). Single process only: with several ranks the failure is
  raised, since the other ranks wait at the save's barrier.
- The checkpoint is written after the step's weights were published and before its batch is
  acknowledged; ``meta.json`` names that batch, so on resume the learner acks it again (the
  buffer's ack is idempotent) and releases every other lease: no batch trained into the restored
  weights is served again, and every batch trained after them is (docs/buffer.md). If that ack
  answers False (the buffer forgot the batch: it restarted, or the lease expired), the batch's
  samples come back in a new batch; ``batch_sample_ids`` (and ``trained_sample_ids`` for earlier
  refused acks) let the learner skip them there.
- Model and optimizer state are sharded (DCP reshards on load, so a checkpoint written by N
  ranks loads on M); one process without torchrun reads and writes the same format. With LoRA
  only the trainable adapters and their optimizer state are written (the base is the model's own).
- One save and one load over the policy set (:class:`agentrl.learner.policies.PolicySet`; a single
  policy is a set of one), each keeping the two layouts checkpoints have always had: one unnamed
  policy (``optim``, ``scheduler``, ``version`` in ``meta.json``); several policies on one base
  (one adapter each): every adapter, and each policy's optimizer (``optim/<policy>``), schedule
  (``schedulers/<policy>``), step count and version (``policies`` in ``meta.json``). The
  checkpoint's step is all policies' steps together. A checkpoint of one kind does not load into
  a set of the other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.learner.dist import Dist, full_state_dict, tied_names

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from agentrl.learner.lora import LoraConfig
    from agentrl.learner.policies import PolicySet

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    step: int
    version: int
    batch_id: str | None
    path: Path
    # samples of earlier batches in these weights whose ack was refused
    trained: list[str] = field(default_factory=list)
    batch_samples: list[str] = field(default_factory=list)  # the sample ids of batch_id
    next_policy: str | None = None  # several policies: the one the next pull asks first
    versions: dict[str | None, int] = field(default_factory=dict)  # each restored policy's (None: the one)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _options(model: torch.nn.Module) -> StateDictOptions:
    """DCP's state-dict options: a model with frozen parameters (LoRA's base) checkpoints only what
    trains (the adapters and their optimizer state); the frozen base is reloaded from the model, so
    loading such a state is not strict about the frozen keys (DCP's load fails on any trained key
    the checkpoint lacks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _trained(model: torch.nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
    """``msd`` without frozen parameters under any of their names (DCP keeps a head tied to a frozen
    embedding under the head's name)."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in msd.items() if k not in frozen} if frozen else msd


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = Path(checkpoint_dir)
    pointer = root / "latest"
    if pointer.exists():
        p = root / pointer.read_text().strip()
        if (p / "meta.json").exists():
            return p
    done = sorted(p for p in root.glob("step_*")
                  if not p.name.endswith(".tmp") and (p / "meta.json").exists())
    return done[-1] if done else None


def _begin(ctx: Dist, root: Path, name: str) -> Path:
    """A fresh ``<name>.tmp`` folder to write into (collective)."""
    tmp = root / f"{name}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    return tmp


def _commit(ctx: Dist, root: Path, tmp: Path, meta: dict[str, Any], keep: int) -> Path:
    """Once every rank wrote into ``tmp``: rank 0 adds ``meta.json``, renames it to its final
    name, replaces ``latest`` and removes checkpoints beyond ``keep`` (collective)."""
    name = tmp.name.removesuffix(".tmp")
    final = root / name
    ctx.barrier()
    if ctx.is_main:
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / "latest")
        if keep > 0:
            older = sorted(p for p in root.glob("step_*") if p.is_dir() and p != final)
            for old in older[:-(keep - 1) or None]:
                shutil.rmtree(old, ignore_errors=True)
    ctx.barrier()
    return final


def _no_space(e: BaseException) -> bool:
    """Whether ``e`` is, or wraps, a full disk (DCP wraps each rank's failure in a
    ``CheckpointException`` whose ``failures`` hold the original ones)."""
    from agentrl.buffer.disk import is_no_space

    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if is_no_space(x):
            return True
        todo += [x.__cause__, x.__context__]
        for f in (getattr(x, "failures", None) or {}).values():  # each an (exception, traceback)
            todo += [y for y in (f if isinstance(f, tuple) else (f,)) if isinstance(y, BaseException)]
    return False


def save_checkpoint(policies: PolicySet, checkpoint_dir: str | Path, *, batch_id: str | None, keep: int = 2,
                    batch_samples: Sequence[str] = (), trained: Sequence[str] = (),
                    next_policy: str | None = None) -> Path | None:
    """See :func:`_save`; on a full disk (single process) None, with the previous checkpoint kept."""
    root = Path(checkpoint_dir)
    try:
        return _save(policies, root, batch_id=batch_id, keep=keep, batch_samples=batch_samples,
                     trained=trained, next_policy=next_policy)
    except BaseException as e:
        if policies.ctx.world > 1 or not _no_space(e):
            raise
        for tmp in root.glob("step_*.tmp"):  # its space goes back
            shutil.rmtree(tmp, ignore_errors=True)
        (root / "latest.tmp").unlink(missing_ok=True)
        kept = latest_checkpoint(root)
        log.error("CHECKPOINT NOT SAVED at step %d: no space left on %s (%s). The newest checkpoint is "
                  "still %s; training goes on and the next checkpoint tries again. Free space there.",
                  policies.steps_done(), root, e, kept or "none")
        return None


def _save(policies: PolicySet, checkpoint_dir: str | Path, *, batch_id: str | None, keep: int = 2,
          batch_samples: Sequence[str] = (), trained: Sequence[str] = (),
          next_policy: str | None = None) -> Path:
    """Write a complete checkpoint of every policy of ``policies`` (collective: every rank calls
    it), named after the steps of all policies together. ``batch_samples``: the sample ids of
    ``batch_id``; ``trained``: ids of samples of earlier batches trained into these weights whose
    ack the buffer refused (both rank 0's); ``next_policy``: the policy the next pull asks first.

    One layout per kind of set, both as they always were: one unnamed policy keeps its optimizer
    at ``optim`` and its schedule at ``scheduler``; named policies keep every adapter, and each
    one's optimizer at ``optim/<policy>`` (once it has stepped: an optimizer without state would be
    given one by DCP's zero-gradient step, changing its later updates) and schedule at
    ``schedulers/<policy>``, their versions and step counts in ``meta.json``'s ``policies``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    ctx, model = policies.ctx, policies.model
    options = _options(model)
    root = Path(checkpoint_dir)
    step = policies.steps_done()
    tmp = _begin(ctx, root, f"step_{step:06d}")
    msd = _trained(model, get_model_state_dict(model, options=options))
    optimized = [p for p in policies if p.state.step > 0 or not policies.named]  # the same on every rank
    osd = {p.name: get_optimizer_state_dict(model, p.state.optimizer, options=options) for p in optimized}
    schedulers = {p.name: p.state.scheduler.state_dict() for p in policies}
    lora = dataclasses.asdict(policies.lora) if policies.lora is not None and policies.lora.enabled else None
    meta: dict[str, Any] = {"step": step}
    if policies.named:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        torch.save({"rng": _rng_state(), "schedulers": schedulers}, tmp / f"rank_{ctx.rank}.pt")
    else:
        (one,) = policies
        dcp.save({"model": msd, "optim": osd[None]}, checkpoint_id=str(tmp))
        torch.save({"rng": _rng_state(), "scheduler": schedulers[None]}, tmp / f"rank_{ctx.rank}.pt")
        meta["version"] = one.version
    meta |= {"batch_id": batch_id, "world": ctx.world, "batch_sample_ids": list(batch_samples),
             "trained_sample_ids": list(trained)}
    if policies.named:
        meta |= {"lora": lora, "next_policy": next_policy,
                 "policies": {p.name: {"version": p.version, "step": p.state.step,
                                       "optimized": p in optimized} for p in policies}}
    elif lora is not None:  # what the offline export rebuilds the adapters with
        meta["lora"] = lora
    final = _commit(ctx, root, tmp, meta, keep)
    if ctx.is_main:
        log.info("checkpoint %s (%s; batch %s)" if policies.named else "checkpoint %s (%s, batch %s)", final,
                 ", ".join(f"{p.name} at version {p.version}" if p.name else f"version {p.version}"
                           for p in policies), batch_id)
    return final


def load_checkpoint(policies: PolicySet, path: str | Path) -> Resumed:
    """Restore every policy of ``policies`` that ``path`` holds (weights or adapter, optimizer,
    schedule, step) and the RNG (collective); returns the checkpoint's batch bookkeeping and each
    restored policy's version. A named policy the checkpoint lacks starts fresh; one it holds that
    the set lacks is left. A checkpoint of one policy does not load into named ones, nor the other
    way round."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from agentrl.learner.lora import of_adapter

    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    ctx, model = policies.ctx, policies.model
    saved: dict[str | None, dict[str, Any]] = meta.get("policies") or {}
    if saved and not policies.named:
        raise SystemExit(f"{path} is a checkpoint of several policies ({', '.join(map(str, saved))}); this "
                         f"learner trains one: resume it with serve's same policies, or start a fresh "
                         f"checkpoint_dir")
    if policies.named and not saved:
        raise SystemExit(f"{path} is a checkpoint of one policy; this learner trains several "
                         f"({', '.join(policies.names)}): start a fresh checkpoint_dir")
    if not saved:  # one policy: its version and step are the checkpoint's
        saved = {None: {"version": meta["version"], "step": meta["step"], "optimized": True}}
    names = [p.name for p in policies if p.name in saved]
    if policies.named and (set(saved) - set(names) or set(policies.names) - set(names)):
        log.warning("checkpoint %s holds policies %s; resuming %s, fresh: %s", path, sorted(saved), names,
                    sorted(set(policies.names) - set(names)) or "none")
    options = _options(model)
    msd = _trained(model, get_model_state_dict(model, options=options))
    if policies.named:
        msd = {k: v for k, v in msd.items() if any(of_adapter(k, n) for n in names if n is not None)}
    optimized = [n for n in names if saved[n].get("optimized")]
    osd = {n: get_optimizer_state_dict(model, policies.of(n).state.optimizer, options=options)
           for n in optimized}
    dcp.load({"model": msd, "optim": osd if policies.named else osd[None]}, checkpoint_id=str(path))
    set_model_state_dict(model, msd, options=options)
    for n in optimized:
        set_optimizer_state_dict(model, policies.of(n).state.optimizer, osd[n], options=options)
    own = path / f"rank_{ctx.rank}.pt"
    extra = torch.load(own if own.exists() else path / "rank_0.pt", weights_only=False)
    schedulers = extra["schedulers"] if policies.named else {None: extra["scheduler"]}
    for n in names:
        policies.of(n).state.scheduler.load_state_dict(schedulers[n])
        policies.of(n).state.step = int(saved[n]["step"])
    _set_rng_state(extra["rng"])
    versions = {n: int(saved[n]["version"]) for n in names}
    if policies.named:
        log.info("resumed from %s: step %d, %s", path, meta["step"],
                 ", ".join(f"{n} at version {v}" for n, v in versions.items()))
    else:
        log.info("resumed from %s: step %d, version %d", path, meta["step"], meta["version"])
    return Resumed(step=int(meta["step"]), version=int(meta.get("version", 0)), batch_id=meta.get("batch_id"),
                   path=path, trained=list(meta.get("trained_sample_ids", [])),
                   batch_samples=list(meta.get("batch_sample_ids", [])), next_policy=meta.get("next_policy"),
                   versions=versions)


def save_hf(state_dict: dict[str, torch.Tensor], model_path: str, out: str | Path) -> Path:
    """Write ``state_dict`` as a normal Hugging Face folder: config, tokenizer, safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = tied_names(model)
    if unexpected or set(missing) - tied:
        raise ValueError(f"state dict does not fit {model_path}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    except (OSError, ValueError) as e:  # a model folder without a tokenizer is still a model
        log.warning("no tokenizer exported from %s: %s", model_path, e)
    return out


def export_hf(model: torch.nn.Module, ctx: Dist, model_path: str, out: str | Path,
              lora: LoraConfig | None = None, adapters: Sequence[str] = ()) -> Path | None:
    """Gather the (possibly sharded) policy and write it on rank 0 (collective). With ``lora`` (its
    rank > 0) the folder holds the merged model, and ``out/adapter`` the adapter alone (a peft folder).
    With ``adapters`` (several policies on one base) ``out/<policy>`` is each policy's adapter, a
    peft folder on ``model_path``; no merged model (one per policy would be the base N times)."""
    if adapters:
        from agentrl.learner.lora import save_adapter

        sd = full_state_dict(model, ctx, trainable_only=True)
        if ctx.is_main:
            for name in adapters:
                save_adapter(sd, lora, Path(out) / name, base_model=model_path, adapter=name)
        ctx.barrier()
        return Path(out) if ctx.is_main else None
    sd = full_state_dict(model, ctx)
    path = None
    if ctx.is_main:
        if lora is not None and lora.enabled:
            from agentrl.learner.lora import merged_state, save_adapter

            save_adapter(sd, lora, Path(out) / "adapter", base_model=model_path)
            sd = merged_state(sd, lora)
        path = save_hf(sd, model_path, out)
    ctx.barrier()
    return path


def export_checkpoint(checkpoint: str | Path, model_path: str, out: str | Path) -> Path:
    """Offline: turn a DCP checkpoint (any world size) into a Hugging Face folder, one process. A
    LoRA checkpoint (its meta.json names the adapters) holds only the adapters: they are loaded onto
    the base model from ``model_path`` and exported merged, with the adapter in ``out/adapter``."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    if meta.get("policies"):  # several policies: out/<policy>, each one's adapter
        from agentrl.learner.lora import LoraConfig, add_adapters, save_adapter

        lora, names = LoraConfig(**meta["lora"]), list(meta["policies"])
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model = add_adapters(base, lora, names=names)
        trains = {n for n, p in model.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in model.state_dict().items() if k in trains}
        dcp.load({"model": sd}, checkpoint_id=str(checkpoint))
        for name in names:
            save_adapter(sd, lora, Path(out) / name, base_model=model_path, adapter=name)
        return Path(out)
    if meta.get("lora"):
        from agentrl.learner.lora import LoraConfig, add_adapters, merged_state, save_adapter

        lora = LoraConfig(**meta["lora"])
        model = add_adapters(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), lora)
        trains = {n for n, p in model.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in model.state_dict().items() if k in trains}
        dcp.load({"model": sd}, checkpoint_id=str(checkpoint))
        model.load_state_dict(sd, strict=False)
        state = full_state_dict(model, Dist())
        save_adapter(state, lora, Path(out) / "adapter", base_model=model_path)
        return save_hf(merged_state(state, lora), model_path, out)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    skip = tied_names(model)
    sd = {k: v for k, v in model.state_dict().items() if k not in skip}
    dcp.load({"model": sd}, checkpoint_id=str(checkpoint))
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    return save_hf(full_state_dict(model, Dist()), model_path, out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m agentrl.learner.checkpoint",
                                description="Export a learner checkpoint as a Hugging Face folder.")
    p.add_argument("checkpoint", help="a step_* folder, or a checkpoint_dir (its latest checkpoint)")
    p.add_argument("model", help="the model folder or hub name the run started from (config, tokenizer)")
    p.add_argument("out")
    a = p.parse_args(argv)
    ckpt = Path(a.checkpoint)
    if not (ckpt / "meta.json").exists():
        found = latest_checkpoint(ckpt)
        if found is None:
            raise SystemExit(f"no complete checkpoint in {ckpt}")
        ckpt = found
    print(export_checkpoint(ckpt, a.model, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
