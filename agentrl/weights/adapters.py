"""LoRA adapters as one versioned upload: packed by the learner, unpacked by serve for vLLM.

Role: the adapter transport (``weights.transport.kind = "adapter"``) sends a LoRA policy version as
one safetensors file through the same checksummed chunked upload as full weights
(:func:`agentrl.weights.transfer.publish`, ``kind = "adapter"``). The file holds the adapter's
tensors under peft's names and, in its metadata, the adapter's ``adapter_config.json``; serve's
receiver unpacks it into ``weights/v<N>/`` (``adapter_model.safetensors`` and
``adapter_config.json``, a peft folder) and the engine updater loads that folder into every engine
as ``policy-v<N>`` (:meth:`agentrl.weights.updates.EngineUpdater.load_adapter`).

Invariants:
- An unpacked folder is exactly what was sent (the chunks' digests were checked before) plus the
  config from its metadata; a file that is not a LoRA adapter (no config, not peft's LORA type, a
  tensor that is not an adapter's) is refused with a ValueError naming why, and nothing is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.learner.lora import LoraConfig

ADAPTER = "default"  # peft's adapter name inside the learner's modules
PREFIX = "base_model.model."  # peft's prefix of every key in a saved adapter
CONFIG_KEY = "agentrl.adapter_config"  # safetensors metadata key holding adapter_config.json
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def adapter_state(state: dict[str, Any], adapter: str = ADAPTER) -> dict[str, Any]:
    """The tensors of adapter ``adapter`` in a (learner) state dict, under peft's saved names (a
    model with several named policies holds one adapter per policy; the others are left out)."""
    out = {}
    for k, v in state.items():
        if is_adapter_key(k) and f".{adapter}." in k:
            out[PREFIX + k.replace(f".{adapter}.", ".")] = v
    return out


def adapter_config(cfg: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json`` for ``cfg``: what peft and vLLM read beside the adapter's tensors."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "inference_mode": True, "base_model_name_or_path": base_model}


def pack_adapter(tensors: dict[str, Any], config: dict[str, Any]) -> bytes:
    """safetensors bytes of an adapter (``tensors`` under peft's names) with ``config`` in the metadata."""
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                metadata={CONFIG_KEY: json.dumps(config)})


def unpack_adapter(staged: Path, target: Path) -> dict[str, Any]:
    """Move the uploaded adapter file ``staged`` into the folder ``target`` as a peft adapter
    (its file and ``adapter_config.json``); returns the config. Raises ValueError for a file that
    is not a LoRA adapter."""
    from safetensors import safe_open

    try:
        with safe_open(str(staged), framework="pt") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
    except Exception as e:  # safetensors raises its own error types for a malformed header
        raise ValueError(f"not a safetensors file: {e}") from None
    raw = meta.get(CONFIG_KEY)
    if raw is None:
        raise ValueError(f"an adapter upload carries its adapter_config in the metadata key {CONFIG_KEY!r}")
    try:
        config = json.loads(raw)
    except ValueError:
        raise ValueError("the adapter's config in the metadata is not JSON") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA" or not int(config.get("r") or 0) > 0:
        raise ValueError(f"the adapter's config is not a LoRA config with r > 0: {str(config)[:200]}")
    odd = [k for k in keys if ".lora_A." not in k and ".lora_B." not in k]
    if not keys or odd:
        raise ValueError(f"an adapter holds only lora_A / lora_B tensors (found {odd[:3] or 'none'})")
    target.mkdir(parents=True, exist_ok=True)
    staged.rename(target / ADAPTER_FILE)
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return config
