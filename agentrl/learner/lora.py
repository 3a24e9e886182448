"""LoRA on the learner: adapters injected with peft, their weights as vLLM loads them, and merging.

Role: ``learn.lora.rank > 0`` trains low-rank adapters on the base model's linear layers instead
of every weight. :func:`add_adapters` injects them (peft's ``inject_adapter_in_model``, so the
model keeps its own class and module names: FSDP2 shards it per decoder layer as it does a plain
model) and freezes everything else; the optimizer then holds only adapter parameters
(:func:`agentrl.learner.step.build_state` takes the trainable ones). Publishing sends either the
adapter alone (:func:`adapter_state`, in peft's file layout, with :func:`adapter_config`: what
vLLM's ``/v1/load_lora_adapter`` and ``peft.PeftModel.from_pretrained`` read) or, for a transport
that moves full weights, the merged model (:func:`merged_state`, the base model's own names).

Invariants:
- The adapter's file names are peft's: ``base_model.model.<module>.lora_A.weight`` (the adapter
  name ``default`` left out); its config names the same rank, alpha, target modules and dropout
  as the learner trains with, so the engine computes ``W x + (alpha / r) B A x`` exactly as the
  learner does.
- Merging is ``W + (alpha / r) B A`` per adapted layer, in fp32; every other tensor is passed on
  under the base model's name. The merged state has exactly the base model's keys.
- Several named policies on one base (serve's ``policies``) are one adapter each on the same layers,
  named by the policy (``lora_A.<policy>.weight``); :func:`activate` makes one the only active
  adapter, and :func:`of_adapter` picks its tensors out of a state dict.
- Adapter dropout is a training-time setting; the learner's logprob passes (pi_old, the
  recomputation) see it only when it is non-zero, which is why its default is 0 (docs/learner.md).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.weights.adapters import ADAPTER, adapter_config, adapter_state, is_adapter_key

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALL_LINEAR",
    "LoraConfig",
    "activate",
    "adapter_config",
    "adapter_state",
    "add_adapters",
    "is_adapter_key",
    "keep_trainable",
    "merged_state",
    "of_adapter",
    "perturbed_model",
    "save_adapter",
]

log = logging.getLogger(__name__)

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """``learn.lora``: train low-rank adapters instead of every weight (rank 0: off)."""

    rank: int = 0  # r of every adapter; 0: full fine-tuning (no adapters)
    alpha: float = 16.0  # scale alpha / rank of the adapters' output
    dropout: float = 0.0  # dropout on the adapters' input while training (0: the logprobs are the sampler's)
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LINEAR))
    """Module names (the last part) that get an adapter; the default is every linear layer of a
    Llama/Qwen/Mistral decoder block (vLLM serves adapters on those)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        from agentrl.errors import ConfigError

        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"learn.lora: rank must be >= 0, alpha > 0 and dropout in [0, 1); got rank "
                              f"{self.rank}, alpha {self.alpha}, dropout {self.dropout}")
        if self.enabled and not self.target_modules:
            raise ConfigError(
                "learn.lora.target_modules is empty: name the linear layers that get an adapter"
            )


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, *, seed: int = 0,
                 names: Sequence[str] = (ADAPTER,)) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze every other parameter.

    peft initialises A randomly (Kaiming) and B at zero, so the adapted model starts as the base
    model, token for token. ``seed`` fixes A's initialisation (every rank draws the same).
    ``names``: one adapter per name on the same layers (several named policies on one base; the
    i-th drawn with ``seed + i``); every adapter is trainable, the last one is active
    (:func:`activate` chooses)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    if not names or len(set(names)) != len(names):
        raise ValueError(f"adapter names must be distinct and at least one; got {list(names)}")
    taken = {part for n, _ in model.named_modules() for part in n.split(".")}
    for name in names:
        # the name is a module-path part of every adapter key: it may not be one of the model's own
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or name in taken or name.startswith("lora_"):
            raise ValueError(f"adapter name {name!r}: use letters, digits, '_' or '-', and "
                             f"not a module name of the model (such as {sorted(taken)[:4]})")
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), bias="none")
    for i, name in enumerate(names):
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # peft warns that a second adapter is being added: that is what several policies are
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            torch.manual_seed(seed + i)
            model = inject_adapter_in_model(peft_cfg, model, adapter_name=name)
    adapted = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
        adapted += p.requires_grad
    if not adapted:
        raise ValueError(f"learn.lora.target_modules {cfg.target_modules} matched no module of "
                         f"{type(model).__name__}")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d, alpha %g on %s: %d trainable parameters of %d (%.2f%%)%s", cfg.rank, cfg.alpha,
             ",".join(cfg.target_modules), trainable, total, 100.0 * trainable / total,
             f" in {len(names)} adapters ({', '.join(names)})" if len(names) > 1 else "")
    return model


def of_adapter(key: str, name: str) -> bool:
    """Whether parameter ``key`` (the learner's module names) belongs to adapter ``name``: its
    ``lora_A`` / ``lora_B`` (or embedding) weight under that adapter's name."""
    return re.search(rf"\.lora_(?:A|B|embedding_A|embedding_B)\.{re.escape(name)}(?:\.|$)", key) is not None


def activate(model: torch.nn.Module, name: str) -> int:
    """Make adapter ``name`` the only active one in every LoRA layer of ``model``: the forward
    pass computes the base plus that adapter alone. Returns how many layers it set.

    peft's ``set_adapter`` also freezes the other adapters (requires_grad False); that is undone
    here, on purpose: every adapter stays trainable, so checkpoints (which keep what trains) hold
    them all, and under FSDP2 an adapter's unsharded parameter keeps the requires_grad it had when
    first gathered. An inactive adapter is outside the graph: it gets no gradient, and its own
    optimizer is not stepped."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = 0
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter(name)
            layers += 1
    keep_trainable(model)
    return layers


def keep_trainable(model: torch.nn.Module) -> None:
    """Every adapter of ``model`` trainable again: peft freezes the adapters it switches away from
    (``set_adapter``, ``enable_adapters``, ``delete_adapter``); :func:`activate` says why they stay
    trainable."""
    for key, p in model.named_parameters():
        if is_adapter_key(key):
            p.requires_grad_(True)


def perturbed_model(model_dir: str, cfg: LoraConfig, *, seed: int, b_std: float) -> torch.nn.Module:
    """``model_dir`` in fp32, dropout off, with ``cfg``'s adapters whose B is drawn from
    N(0, ``b_std``) (seeded) instead of zero: a policy as it is some steps into training, for checks
    that an adapter changes what the engine computes exactly as it changes the learner's model
    (parity tests, the sync benchmark). In eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.learner.dropout import disable_dropout

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    disable_dropout(model)
    model = add_adapters(model, cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    return model.eval()


def merged_state(state: dict[str, Any], cfg: LoraConfig) -> dict[str, Any]:
    """``state`` (the learner's, with adapters) as the base model's state with each adapter
    merged in: ``W + (alpha / r) B A`` under ``W``'s own name."""
    import torch

    out: dict[str, Any] = {}
    lora: dict[str, dict[str, Any]] = {}
    for k, v in state.items():
        if is_adapter_key(k):
            module, kind = k.split(".lora_")[0], k.split(".lora_")[1][0]  # "A" or "B"
            lora.setdefault(module, {})[kind] = v
        else:
            out[k.replace(".base_layer.", ".")] = v
    for module, ab in lora.items():
        key = f"{module}.weight"
        if key not in out or set(ab) != {"A", "B"}:
            raise ValueError(f"adapter of {module} does not fit the state (has {sorted(ab)}; base weight "
                             f"{'found' if key in out else 'missing'})")
        base = out[key]
        delta = (ab["B"].to(torch.float32) @ ab["A"].to(torch.float32)) * cfg.scale
        out[key] = (base.to(torch.float32) + delta.to(base.device)).to(base.dtype)
    return out


def save_adapter(state: dict[str, Any], cfg: LoraConfig, out: str | Path, base_model: str = "",
                 adapter: str = ADAPTER) -> Path:
    """Write adapter ``adapter`` of ``state`` as a peft folder (``adapter_config.json`` and
    ``adapter_model.safetensors``), which ``PeftModel.from_pretrained`` and vLLM load."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mine = {k: v for k, v in state.items() if of_adapter(k, adapter)}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter_state(mine, adapter=adapter).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base_model), indent=2))
    return out
