"""The learner's process group and model sharding: one process, or many under torchrun with FSDP2.

Role: start ``torch.distributed`` when torchrun set ``WORLD_SIZE`` (gloo on CPU, NCCL on GPU),
load the model with transformers and shard it with ``fully_shard`` per decoder layer plus the
root; gather the full weights for publishing and export; move Python objects from rank 0.

Invariants:
- Without torchrun nothing distributed is started: the model is a plain module, every helper
  here is the identity, and the learner behaves as a single process always has.
- Under torchrun every rank makes the same sequence of collective calls; only rank 0 talks to
  serve, and the others receive what it got through ``broadcast_object``.
- Parameters stay fp32 (the optimizer's master weights); ``precision="bf16"`` only changes the
  compute dtype of the decoder layers' forward/backward, gradients are reduced in fp32. The root
  (embeddings, final norm, LM head) computes in fp32 even then, so the logits, and the log-softmax
  the learner takes over them, are fp32: bf16 keeps 8 significant bits, so a logit of 16 would be
  off by up to 0.03 and the token's logprob with it (MiniMax-M1 traced its train/inference
  mismatch to the LM head's precision and moved that to fp32).
- Dropout is switched off at load (:func:`disable_dropout`): the policy's logprobs must be those
  of the distribution the engine samples from, which has none; the training passes stay in
  training mode only so that activation checkpointing (which transformers gates on it) works.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from agentrl.learner.dropout import disable_dropout

if TYPE_CHECKING:
    from agentrl.learner.lora import LoraConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    distributed: bool = False  # a process group exists and the model is FSDP2-sharded

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def all_gather_object(self, obj: T) -> list[T]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def init_dist(timeout_s: float = 1800.0) -> Dist:
    """Join torchrun's process group if there is one; otherwise a single-process context."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        return Dist(device=torch.device("cuda") if cuda else torch.device("cpu"))
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # rank 0 may wait a long time for a batch while the others sit in a broadcast
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    log.info("rank %d of %d on %s", rank, world, device)
    return Dist(rank=rank, world=world, local_rank=local_rank, device=device, distributed=True)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a transformers causal LM (Llama, Qwen2, Mistral, ...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"cannot find decoder layers in {type(model).__name__} (expected model.model.layers)"
        )
    return list(layers)


def load_model(model_path: str, ctx: Dist, *, precision: str = "auto", activation_checkpointing: bool = False,
               lora: LoraConfig | None = None, seed: int = 0,
               adapters: Sequence[str] = ()) -> torch.nn.Module:
    """fp32 model from a local folder or hub name; sharded with FSDP2 under torchrun. ``lora``
    (a :class:`agentrl.learner.lora.LoraConfig` with rank > 0): LoRA adapters are injected first
    and only they are trainable (the frozen base is sharded like the rest); ``adapters`` names one
    adapter per policy (empty: the one adapter of a single policy)."""
    from transformers import AutoModelForCausalLM

    from agentrl.learner.attention import use_packed_attention

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    use_packed_attention(model)  # a packed row's samples attend one at a time: no [N, N] mask
    disable_dropout(model)  # before the adapters: their own dropout is learn.lora.dropout
    if lora is not None and lora.enabled:
        from agentrl.learner.lora import add_adapters

        model = add_adapters(model, lora, seed=seed, **({"names": list(adapters)} if adapters else {}))
        if activation_checkpointing:
            # a frozen embedding would leave checkpointed layers without grads
            model.enable_input_require_grads()
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    bf16 = precision == "bf16" or (precision == "auto" and ctx.device.type == "cuda")
    if not ctx.distributed:
        if bf16:
            log.warning("precision bf16 needs FSDP2 (run under torchrun); training in fp32")
        return model.to(ctx.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by backward: keep them gathered
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    # embeddings, final norm, (tied) lm_head: in fp32 whatever the layers compute in, so the
    # logits are fp32 (the norm's fp32 weight promotes the last layer's bf16 output)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                 reduce_dtype=torch.float32))
    return model


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another parameter under a second name (e.g. a tied lm_head)."""
    unique = {n for n, _ in model.named_parameters()}
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - unique


def full_state_dict(
    model: torch.nn.Module, ctx: Dist, *, on_device: bool = False, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """Unsharded weights on rank 0 (empty elsewhere); tied duplicates left out. Collective.

    In host memory by default (what the HTTP transport serialises). ``on_device``: on the
    learner's device (``ctx.device``, a GPU for the NCCL transport, which broadcasts from there);
    under FSDP2 each parameter is all-gathered in turn, in the same order on every rank, and only
    rank 0 keeps the result, so the other ranks never hold more than one full tensor.
    """
    skip = tied_names(model)
    if trainable_only:  # LoRA: the adapters alone, never the frozen base
        skip |= {n for n, p in model.named_parameters() if not p.requires_grad}
    if not ctx.distributed:
        where = ctx.device if on_device else "cpu"
        return {k: v.detach().to(where) for k, v in model.state_dict().items() if k not in skip}
    if on_device:
        out: dict[str, torch.Tensor] = {}
        for k, v in model.state_dict().items():
            if k in skip:
                continue
            full = v.full_tensor() if hasattr(v, "full_tensor") else v  # a DTensor shard: all-gather it
            if ctx.is_main:
                out[k] = full.detach().to(ctx.device)
            del full
        return out
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                              ignore_frozen_params=trainable_only))
    return {k: v for k, v in sd.items() if k not in skip} if ctx.is_main else {}


def checkpoint_layout(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's module names) in the layout of its checkpoint files, which is what an
    engine loads: the same for most models; a transformers MoE model holds its experts fused
    ([experts, ...] tensors) and saves them one by one (``experts.0.gate_proj.weight``, ...), as
    ``save_pretrained`` does. Empty stays empty (ranks other than 0)."""
    if not state:
        return state
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state))


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float) -> float:
    """Global L2 norm of the gradients (over all shards), clipped to ``max_norm`` when positive."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
