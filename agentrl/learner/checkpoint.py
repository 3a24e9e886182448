"""Checkpoints with torch.distributed.checkpoint (DCP), exact resume, and Hugging Face export.

Layout of ``checkpoint_dir``::

    step_000012/            one complete checkpoint (renamed from step_000012.tmp when complete)
      __0_0.distcp ...      DCP shards: {"model": ..., "optim": ...}, written by every rank
      .metadata
      rank_0.pt ...         per rank: RNG states (torch, CUDA, Python), scheduler state
      meta.json             step, policy version, batch_id of the batch trained at this step and
                            its sample ids, and the ids of samples of earlier batches trained into
                            these weights whose ack was refused
    latest                  name of the newest complete checkpoint (replaced atomically)

Invariants:
- A checkpoint is visible only once complete: ranks write into ``<name>.tmp``, meet at a
  barrier, then rank 0 renames it and replaces ``latest``. A process killed mid-write leaves a
  ``.tmp`` folder that resume ignores (and the next save removes).
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
from typing import Any

import torch

from agentrl.learner.dist import Dist, full_state_dict, tied_names
from agentrl.learner.step import TrainState

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    step: int
    version: int
    batch_id: str | None
    path: Path
    trained: list[str] = field(default_factory=list)  # samples of earlier batches in these weights, ack refused
    batch_samples: list[str] = field(default_factory=list)  # the sample ids of batch_id


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


def _options(model: torch.nn.Module) -> Any:
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
    done = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / "meta.json").exists())
    return done[-1] if done else None


def save_checkpoint(state: TrainState, checkpoint_dir: str | Path, *, version: int, batch_id: str | None,
                    keep: int = 2, batch_samples: Sequence[str] = (), trained: Sequence[str] = ()) -> Path:
    """Write a complete checkpoint of ``state`` (collective: every rank calls it). ``batch_samples``:
    the sample ids of ``batch_id``; ``trained``: ids of samples of earlier batches trained into these
    weights whose ack the buffer refused (both rank 0's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ctx = state.ctx
    root = Path(checkpoint_dir)
    name = f"step_{state.step:06d}"
    tmp, final = root / f"{name}.tmp", root / name
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    msd, osd = get_state_dict(state.model, state.optimizer, options=_options(state.model))
    msd = _trained(state.model, msd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    torch.save({"rng": _rng_state(), "scheduler": state.scheduler.state_dict()}, tmp / f"rank_{ctx.rank}.pt")
    ctx.barrier()
    if ctx.is_main:
        meta = {"step": state.step, "version": version, "batch_id": batch_id, "world": ctx.world,
                "batch_sample_ids": list(batch_samples), "trained_sample_ids": list(trained)}
        if state.lora is not None:  # what the offline export rebuilds the adapters with
            meta["lora"] = dataclasses.asdict(state.lora)
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / "latest")
        if keep > 0:
            for old in sorted(p for p in root.glob("step_*") if p.is_dir() and p != final)[:-(keep - 1) or None]:
                shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s (version %d, batch %s)", final, version, batch_id)
    ctx.barrier()
    return final


def load_checkpoint(state: TrainState, path: str | Path) -> Resumed:
    """Restore model, optimizer, scheduler, step and RNG from ``path`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    options = _options(state.model)
    msd, osd = get_state_dict(state.model, state.optimizer, options=options)
    msd = _trained(state.model, msd)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
    set_state_dict(state.model, state.optimizer, model_state_dict=msd, optim_state_dict=osd, options=options)
    own = path / f"rank_{state.ctx.rank}.pt"
    extra = torch.load(own if own.exists() else path / "rank_0.pt", weights_only=False)
    state.scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    state.step = int(meta["step"])
    log.info("resumed from %s: step %d, version %d", path, meta["step"], meta["version"])
    return Resumed(step=int(meta["step"]), version=int(meta["version"]), batch_id=meta.get("batch_id"), path=path,
                   trained=list(meta.get("trained_sample_ids", [])), batch_samples=list(meta.get("batch_sample_ids", [])))


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


def export_hf(model: torch.nn.Module, ctx: Dist, model_path: str, out: str | Path, lora: Any = None
              ) -> Path | None:
    """Gather the (possibly sharded) policy and write it on rank 0 (collective). With ``lora`` (its
    rank > 0) the folder holds the merged model, and ``out/adapter`` the adapter alone (a peft folder)."""
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
    if meta.get("lora"):
        from agentrl.learner.lora import LoraConfig, add_adapters, merged_state, save_adapter

        lora = LoraConfig(**meta["lora"])
        model = add_adapters(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), lora)
        sd = {k: v for k, v in model.state_dict().items() if k in {n for n, p in model.named_parameters() if p.requires_grad}}
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
