"""The training side of the Tinker service: one base model, one LoRA adapter per training client.

Role: a Tinker ``create_lora_training_client`` becomes an adapter on the shared base (the same
multi-adapter machinery as serve's named policies, :mod:`agentrl.learner.lora`), with its own AdamW;
``forward_backward`` activates that adapter alone, computes each datum's target logprobs and the
named loss (:mod:`agentrl.tinker.losses`) and accumulates gradients into that adapter only;
``optim_step`` steps that adapter's optimizer with the request's Adam parameters.

Invariants:
- Every method runs on one thread (the service's worker): an activated adapter stays active for
  the whole call, and no two calls interleave on the model.
- An adapter is outside the graph while another is active, so two training clients on one base
  never change each other's weights, gradients or optimizer state.
- :meth:`Trainer.check` validates a whole request before anything runs (token ids within the
  vocabulary, lengths within the context, every input the loss needs in the targets' shape): a bad
  datum changes no gradient.
- Logprobs are fp32 log-softmax over the full vocabulary, the quantity vLLM reports for a sampled
  token; a fresh adapter (B = 0) gives the base model's logprobs exactly.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.learner.lora import LoraConfig, activate, add_adapters, keep_trainable, of_adapter
from agentrl.tinker.losses import LOSSES, NOT_YET
from agentrl.tinker.wire import BadRequest, ForwardBackward, NotFound

log = logging.getLogger(__name__)

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}  # the SDK's AdamParams defaults


@dataclass
class Adapter:
    name: str  # the adapter's name in the model (its module-path part)
    rank: int
    targets: list[str]
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0
    pending: bool = False  # gradients accumulated since the last optim_step
    extra: dict[str, Any] = field(default_factory=dict)


def _batches(lengths: list[int], budget: int) -> list[list[int]]:
    """The data's indices in order, grouped so each group's rows times its longest row fit ``budget``
    tokens (a datum longer than that is a group of its own)."""
    groups: list[list[int]] = []
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(n, *(lengths[j] for j in groups[-1])) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class Trainer:
    """``model_path`` in fp32 with adapters added as clients come (at most ``max_adapters``)."""

    def __init__(self, model_path: str, *, lora_alpha: float = 32.0, max_adapters: int = 16,
                 max_rank: int = 64, batch_tokens: int = 2048) -> None:
        from transformers import AutoModelForCausalLM

        from agentrl.learner.dropout import disable_dropout

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        disable_dropout(self.model)
        self.model.eval()  # no dropout anywhere; gradients flow all the same
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = self.model.config
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        self.arch = str((getattr(cfg, "architectures", None) or [type(self.model).__name__])[0])
        self.lora_alpha, self.max_adapters, self.max_rank = lora_alpha, max_adapters, max_rank
        self.batch_tokens = batch_tokens  # rows x padded width of one forward pass, at most
        self.adapters: dict[str, Adapter] = {}

    # --- checks (any thread: they read only what __init__ fixed) ---------------------------------

    def check_lora(self, rank: int, train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
        if not 1 <= rank <= self.max_rank:
            raise BadRequest(f"lora rank must be between 1 and {self.max_rank}; got {rank}")
        targets = (ATTN if train_attn else []) + (MLP if train_mlp else []) + \
            (["lm_head"] if train_unembed else [])
        if not targets:
            raise BadRequest("train_attn, train_mlp and train_unembed are all off: nothing would train")
        return targets

    def check(self, fb: ForwardBackward) -> None:
        """Refuse ``fb`` (BadRequest) unless every datum is well formed for its loss."""
        if fb.loss_fn in NOT_YET:
            raise BadRequest(f"loss_fn {fb.loss_fn!r} is not supported by this service yet; it runs "
                             f"{sorted(LOSSES)}")
        loss = LOSSES.get(fb.loss_fn)
        if loss is None:
            raise BadRequest(f"unknown loss_fn {fb.loss_fn!r}; this service runs {sorted(LOSSES)}")
        if not fb.data:
            raise BadRequest("no data: a forward_backward needs at least one datum")
        for i, d in enumerate(fb.data):
            n = len(d.tokens)
            if not 1 <= n <= self.context:
                raise BadRequest(f"datum {i}: {n} input tokens; between 1 and {self.context} are allowed")
            ids = np.asarray(d.tokens)
            if ids.min() < 0 or ids.max() >= self.vocab:
                raise BadRequest(f"datum {i}: a model input token id is outside the vocabulary "
                                 f"[0, {self.vocab})")
            t = d.inputs.get("target_tokens")
            if t is None:
                raise BadRequest(f"datum {i}: loss_fn_inputs has no target_tokens")
            if t.dtype != np.int64 or t.ndim not in (1, 2) or t.shape[0] != n:
                raise BadRequest(f"datum {i}: target_tokens must be int64 of shape ({n},) or ({n}, K); "
                                 f"got {t.dtype} {list(t.shape)}")
            if t.size and (t.min() < 0 or t.max() >= self.vocab):
                raise BadRequest(f"datum {i}: a target token id is outside the vocabulary [0, {self.vocab})")
            for name in (*loss.needs, *(("weights",) if "weights" in d.inputs else ())):
                x = d.inputs.get(name)
                if x is None:
                    raise BadRequest(f"datum {i}: loss {fb.loss_fn!r} needs loss_fn_inputs[{name!r}]")
                if x.shape != t.shape or not np.isfinite(x).all():
                    raise BadRequest(f"datum {i}: loss_fn_inputs[{name!r}] must be finite, of the shape "
                                     f"of target_tokens {list(t.shape)}; got {list(x.shape)}")
        for name in loss.options:
            value = fb.config.get(name)
            if value is not None and (isinstance(value, str) or not math.isfinite(value)):
                raise BadRequest(f"loss_fn_config[{name!r}] must be a finite number; got {value!r}")
        if "clip_low_threshold" in loss.options:
            lo, hi = fb.config.get("clip_low_threshold", 0.8), fb.config.get("clip_high_threshold", 1.2)
            if not 0 <= lo <= hi:
                raise BadRequest(f"clip thresholds must satisfy 0 <= low <= high; got {lo}, {hi}")

    def check_adam(self, params: dict[str, Any]) -> dict[str, float]:
        out = dict(ADAM_DEFAULTS)
        for k in out:
            v = params.get(k, out[k])
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise BadRequest(f"adam_params.{k} must be a finite number; got {v!r}")
            out[k] = float(v)
        if out["learning_rate"] < 0 or out["eps"] < 0 or out["weight_decay"] < 0 or \
                not (0 <= out["beta1"] < 1 and 0 <= out["beta2"] < 1):
            raise BadRequest(f"adam_params out of range (learning_rate, eps, weight_decay >= 0; betas in "
                             f"[0, 1)): {out}")
        return out

    # --- work (the worker thread only) ------------------------------------------------------------

    def create(self, rank: int, targets: list[str], seed: int | None) -> str:
        if len(self.adapters) >= self.max_adapters:  # the service counts first; this is the backstop
            raise BadRequest(f"this service holds {self.max_adapters} training clients at most")
        name = f"t{secrets.token_hex(6)}"
        cfg = LoraConfig(rank=rank, alpha=self.lora_alpha, target_modules=targets)
        add_adapters(self.model, cfg, seed=seed if seed is not None else secrets.randbelow(1 << 31),
                     names=[name])
        self.adapters[name] = Adapter(name, rank, targets)
        log.info("training client %s: LoRA rank %d on %s", name, rank, ",".join(targets))
        return name

    def adapter(self, name: str) -> Adapter:
        a = self.adapters.get(name)
        if a is None:
            raise NotFound(f"no training client {name!r}")
        return a

    def params(self, name: str) -> list[torch.nn.Parameter]:
        return [p for k, p in self.model.named_parameters() if of_adapter(k, name)]

    def forward_backward(self, name: str, fb: ForwardBackward) -> tuple[list[dict[str, np.ndarray]],
                                                                          dict[str, float]]:
        """Per-datum outputs (``logprobs``, ``elementwise_loss``) and ``loss:sum``; gradients add up in
        adapter ``name`` unless ``fb.forward_only``."""
        a = self.adapter(name)
        loss = LOSSES[fb.loss_fn]
        activate(self.model, name)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in fb.data]
        total = 0.0
        with torch.set_grad_enabled(not fb.forward_only):
            for rows in _batches([len(d.tokens) for d in fb.data], self.batch_tokens):
                width = max(len(fb.data[i].tokens) for i in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                for r, i in enumerate(rows):  # right-padded: a row's real tokens never see the padding
                    ids[r, :len(fb.data[i].tokens)] = torch.tensor(fb.data[i].tokens)
                    mask[r, :len(fb.data[i].tokens)] = 1
                padded = bool((mask == 0).any())
                logits = self.model(input_ids=ids, attention_mask=mask if padded else None).logits.float()
                lse = logits.logsumexp(-1)  # log-softmax at the targets only: no [T, V] copy
                batch_loss = logits.new_zeros(())
                for r, i in enumerate(rows):
                    d, n = fb.data[i], len(fb.data[i].tokens)
                    targets = torch.from_numpy(d.inputs["target_tokens"])
                    picked = logits[r, :n].gather(-1, targets.view(n, -1))
                    logp = (picked - lse[r, :n, None]).view(targets.shape)
                    x = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in d.inputs.items()
                         if k != "target_tokens"}
                    elementwise = loss.elementwise(logp, x, fb.config)
                    batch_loss = batch_loss + elementwise.sum()
                    outputs[i] = {"logprobs": logp.detach().numpy().astype(np.float32),
                                  "elementwise_loss": elementwise.detach().numpy().astype(np.float32)}
                if not fb.forward_only:
                    batch_loss.backward()
                total += float(batch_loss.detach())
        a.pending = a.pending or not fb.forward_only
        return outputs, {"loss:sum": total}

    def optim_step(self, name: str, adam: dict[str, float]) -> dict[str, float]:
        a = self.adapter(name)
        params = self.params(name)
        if a.optimizer is None:
            a.optimizer = torch.optim.AdamW(params, lr=adam["learning_rate"])
        for group in a.optimizer.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])
        clip = adam["grad_clip_norm"] if adam["grad_clip_norm"] > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if a.pending else 0.0
        a.optimizer.step()
        a.optimizer.zero_grad(set_to_none=True)
        a.steps, a.pending = a.steps + 1, False
        return {"grad_norm": norm, "learning_rate": adam["learning_rate"], "step": float(a.steps)}

    def save(self, name: str, dest: Path, *, optimizer: bool = True) -> None:
        """Adapter ``name``'s weights (and its optimizer state) to ``dest``, keyed without the adapter's
        own name so that any adapter of the same shape can load them; written to a temporary file
        and renamed, so a crash leaves the previous checkpoint or none, never half of one."""
        a = self.adapter(name)
        weights = {k.replace(f".{name}.", ".{adapter}."): p.detach().clone()
                   for k, p in self.model.named_parameters() if of_adapter(k, name)}
        state = {"weights": weights, "rank": a.rank, "targets": a.targets, "steps": a.steps,
                 "optimizer": a.optimizer.state_dict() if optimizer and a.optimizer is not None else None}
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, dest)

    @staticmethod
    def read(src: Path) -> dict[str, Any]:
        try:
            state = torch.load(src, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise NotFound(f"no checkpoint at {src.name}") from None
        except Exception as e:  # noqa: BLE001 - a damaged file is the caller's to hear about
            raise BadRequest(f"the checkpoint {src.name} does not load: {e}") from None
        return state

    def load(self, name: str, state: dict[str, Any], *, optimizer: bool) -> None:
        """``state`` (from :meth:`read`) into adapter ``name``, which must have its rank and targets;
        with ``optimizer``, the saved AdamW state too (else the optimizer starts afresh)."""
        a = self.adapter(name)
        if state["rank"] != a.rank or list(state["targets"]) != a.targets:
            raise BadRequest(f"the checkpoint is LoRA rank {state['rank']} on {state['targets']}; this "
                             f"training client is rank {a.rank} on {a.targets}")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, value in state["weights"].items():
                params[key.replace(".{adapter}.", f".{name}.")].copy_(value)
        for p in self.params(name):
            p.grad = None
        a.optimizer, a.pending, a.steps = None, False, int(state.get("steps", 0))
        if optimizer:
            if state.get("optimizer") is None:
                raise BadRequest("the checkpoint holds no optimizer state (saved before any optim_step)")
            a.optimizer = torch.optim.AdamW(self.params(name), lr=ADAM_DEFAULTS["learning_rate"])
            a.optimizer.load_state_dict(state["optimizer"])

    def export(self, name: str, dest: Path) -> Path:
        """Adapter ``name`` as a peft folder (what vLLM's ``/v1/load_lora_adapter`` loads), written
        to a temporary folder and renamed into ``dest``."""
        import shutil

        from agentrl.learner.lora import save_adapter

        a = self.adapter(name)
        state = {k: p.detach() for k, p in self.model.named_parameters() if of_adapter(k, name)}
        cfg = LoraConfig(rank=a.rank, alpha=self.lora_alpha, target_modules=a.targets)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(state, cfg, tmp, adapter=name)
        os.replace(tmp, dest)
        return dest

    def drop(self, name: str) -> None:
        """Remove adapter ``name`` (its weights, gradients and optimizer) from the model."""
        if self.adapters.pop(name, None) is None:
            return
        self._remove(name)
        log.info("training client %s freed", name)

    def _remove(self, name: str) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        with warnings.catch_warnings():  # peft notes another adapter becomes active (each call picks its own)
            warnings.filterwarnings("ignore", message=".*was active which is now deleted")
            for module in self.model.modules():
                if isinstance(module, BaseTunerLayer) and name in getattr(module, "lora_A", {}):
                    module.delete_adapter(name)
        getattr(self.model, "peft_config", {}).pop(name, None)
        keep_trainable(self.model)

    def score_prompt(self, adapter_dir: Path | None, prompt: list[int], targets: np.ndarray | None,
                     alt_k: int, temperature: float, seed: int | None
                     ) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray] | None]:
        """The prompt's next-token distributions under the base model (``adapter_dir`` None) or the
        sampler weights in the peft folder ``adapter_dir`` (loaded into a scratch adapter for this
        call only), and from them: the logprobs of ``targets`` (``[len(prompt) - 1, K]`` ids, row
        ``i`` scored at position ``i + 1``; ``-1`` asks nothing and gets 0.0), and ``alt_k`` draws per
        position, with replacement, at ``temperature`` (0: the most likely token), with the model's
        logprob of each. Logprobs are fp32 log-softmax over the full vocabulary, as ``forward``'s."""
        name = self._load_scratch(adapter_dir) if adapter_dir is not None else None
        try:
            with torch.no_grad():
                if name is not None:
                    activate(self.model, name)
                    logits = self.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
                else:
                    with self._base_only():
                        logits = self.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
        finally:
            if name is not None:
                self._remove(name)
        logp = logits.log_softmax(-1)  # row i: the distribution of prompt[i + 1]
        scored = None
        if targets is not None:
            t = torch.from_numpy(np.ascontiguousarray(targets, dtype=np.int64))
            scored = torch.where(t >= 0, logp.gather(-1, t.clamp(min=0)), 0.0).numpy().astype(np.float32)
        alt = None
        if alt_k:
            if temperature == 0:
                ids = logits.argmax(-1, keepdim=True).expand(-1, alt_k)
            else:
                gen = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(62))
                ids = torch.multinomial((logits / temperature).softmax(-1), alt_k, replacement=True,
                                        generator=gen)
            alt = ids.numpy().astype(np.int64), logp.gather(-1, ids).numpy().astype(np.float32)
        return scored, alt

    def _load_scratch(self, folder: Path) -> str:
        """The peft folder ``folder`` (sampler weights :meth:`export` wrote) as a new adapter of the
        model, under a scratch name the caller removes."""
        import json
        import re

        from safetensors.torch import load_file

        from agentrl.weights.adapters import ADAPTER_FILE, CONFIG_FILE, PREFIX

        try:
            config = json.loads((folder / CONFIG_FILE).read_text())
            tensors = load_file(str(folder / ADAPTER_FILE))
        except FileNotFoundError:
            raise NotFound(f"no sampler weights at {folder.name}") from None
        name = f"s{secrets.token_hex(6)}"
        cfg = LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                         target_modules=list(config["target_modules"]))
        add_adapters(self.model, cfg, names=[name])
        params = dict(self.model.named_parameters())
        try:
            with torch.no_grad():
                for key, value in tensors.items():
                    own = re.sub(r"\.(lora_[AB])\.", rf".\1.{name}.", key.removeprefix(PREFIX), count=1)
                    params[own].copy_(value)
        except Exception:
            self._remove(name)
            raise
        return name

    @contextlib.contextmanager
    def _base_only(self) -> Iterator[None]:
        """Every adapter off for the block: the base model's forward pass."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m in layers:
                m.enable_adapters(True)
            keep_trainable(self.model)
