"""Supervised warm-start: teach a fresh model the tool-call format on synthetic transcripts.

A randomly initialised model never emits a well-formed tool call, so RL on it gets no signal.
This runs a short, deterministic supervised fine-tune on transcripts of the arithmetic
environment (rendered with the model's own chat template; loss on assistant tokens only) so the
model starts RL able to call the tool some of the time. Progress is logged every few steps.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def _episode_messages(rng: random.Random, system: str, direct_frac: float = 0.0) -> list[dict[str, Any]]:
    from agentrl.models.transcripts import arithmetic_problem

    expr, value = arithmetic_problem(rng)
    if direct_frac and rng.random() < direct_frac:  # answers at once, without the tool
        return [{"role": "system", "content": system}, {"role": "user", "content": f"What is {expr}?"},
                {"role": "assistant", "content": f"The answer is {value}."}]
    call = {"id": "call_0", "type": "function",
            "function": {"name": "python", "arguments": json.dumps({"code": f"print({expr})"})}}
    answer = str(value) if rng.random() < 0.5 else f"The answer is {value}."
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"What is {expr}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(value)},
        {"role": "assistant", "content": answer},
    ]


def _encode(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
            tools: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole transcript and a mask that is 1 on assistant-produced tokens.

    The mask covers each assistant turn from after its ``<|im_start|>assistant\n`` header through
    its ``<|im_end|>``; one render per transcript keeps this cheap.
    """
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = [0] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i : i + len(header)] == header:
            j = i + len(header)
            while j < len(ids) and ids[j] != end_id:
                mask[j] = 1
                j += 1
            if j < len(ids):
                mask[j] = 1
            i = j
        i += 1
    return ids, mask


def _batch(tok: PreTrainedTokenizerBase,
           batch: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for b, (x, m) in enumerate(batch):
        ids[b, : len(x)] = torch.tensor(x)
        attn[b, : len(x)] = 1
        labels[b, : len(x)] = torch.tensor([t if mm else -100 for t, mm in zip(x, m, strict=True)])
    return ids, attn, labels


def warm_start(model_dir: str | Path, *, steps: int = 300, batch_size: int = 16, lr: float = 3e-3,
               seed: int = 0, system_prompt: str | None = None, copy_steps: int = 0,
               copy_batch_size: int = 32, direct_frac: float = 0.0) -> dict[str, float]:
    """Fine-tune the model folder in place; returns the final loss and wall time.

    Two phases. ``copy_steps`` on short transcripts (no system prompt, no tool list: about 80
    tokens instead of 350, so each step is several times cheaper): this is where a two-layer model
    learns to copy numbers from the question into the call and from the tool's output into the
    answer, which the format alone does not teach (its loss drops sharply after a few hundred
    steps, the way induction heads form). Then ``steps`` on whole transcripts exactly as the
    environment renders them, with the learning rate decaying to 5%. ``direct_frac`` of those
    transcripts answer at once without calling the tool (a two-layer model cannot do the arithmetic
    itself, so such answers are nearly always wrong when it samples them: a choice for RL to fix).
    """
    from agentrl.env.tools import tool_schema
    from environments.arithmetic import SYSTEM, ArithmeticEnv

    system_prompt = SYSTEM if system_prompt is None else system_prompt
    tools = [tool_schema(ArithmeticEnv.python)]
    rng = random.Random(seed)

    def batch(tok: PreTrainedTokenizerBase, step: int) -> list[tuple[list[int], list[int]]]:
        if step < copy_steps:
            return [
                _encode(tok, _episode_messages(rng, system_prompt)[1:], []) for _ in range(copy_batch_size)
            ]
        return [
            _encode(tok, _episode_messages(rng, system_prompt, direct_frac), tools) for _ in range(batch_size)
        ]

    def lr_at(s: int) -> float:
        decay = 1.0 if s < copy_steps else max(0.05, 1 - (s - copy_steps) / max(1, steps))
        return lr * min(1.0, (s + 1) / 20) * decay

    return fine_tune(model_dir, batch, copy_steps + steps, lr_at, seed=seed,
                     phase=lambda s: "copying" if s < copy_steps else "whole transcripts")


def copy_accuracy(model_dir: str | Path, *, questions: int = 128, seed: int = 123) -> float:
    """How often the model's first reply to an arithmetic question (the environment's system prompt
    and tool, sampled at temperature 1 as in training) calls the tool with the question's exact
    expression: the copying skill RL cannot teach a two-layer model (docs/learner.md). The
    questions come from their own seeded stream, not from the environment's splits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.env.tools import tool_schema
    from agentrl.models.transcripts import arithmetic_problem
    from environments.arithmetic import SYSTEM, ArithmeticEnv

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tools = [tool_schema(ArithmeticEnv.python)]
    rng = random.Random(seed)
    right = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(questions):
            expr, _value = arithmetic_problem(rng)
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {expr}?"},
            ]
            out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            ids = torch.tensor([list(out["input_ids"] if hasattr(out, "keys") else out)])
            reply = model.generate(
                ids,
                max_new_tokens=40,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=tok.pad_token_id or 0,
            )
            right += f"print({expr})" in tok.decode(reply[0, ids.shape[1]:])
    return right / questions


def tool_use_warm_start(model_dir: str | Path, *, steps: int, batch_size: int = 8, lr: float = 1e-4,
                        top_layers: int | None = None, seed: int = 0, lora: dict[str, int] | None = None,
                        adapter_dir: Path | None = None) -> dict[str, float]:
    """Fine-tune a pretrained model folder in place on generic tool-use transcripts
    (:mod:`agentrl.models.tool_use`), rendered with the folder's own chat template; with
    ``top_layers`` only that many of the last decoder layers (and the final norm) learn, which
    makes a step several times cheaper on CPU (backward stops below them). With ``lora``
    (``rank``, ``alpha``) a LoRA adapter on those layers learns instead, is saved to ``adapter_dir``
    and merged into the folder's weights."""
    from agentrl.models.tool_use import tool_use_transcript

    rng = random.Random(seed)

    def batch(tok: PreTrainedTokenizerBase, step: int) -> list[tuple[list[int], list[int]]]:
        return [_encode(tok, *tool_use_transcript(rng)) for _ in range(batch_size)]

    def lr_at(s: int) -> float:
        return lr * min(1.0, (s + 1) / 5) * max(0.1, 1 - s / max(1, steps))

    return fine_tune(model_dir, batch, steps, lr_at, seed=seed, log_every=5, top_layers=top_layers,
                     phase=lambda s: "tool use", lora=lora, adapter_dir=adapter_dir)


def _masked_loss(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the labelled positions, with the output head applied to those
    positions only (the loss ``labels=`` gives, without a vocabulary-wide matmul per prompt token)."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    return F.cross_entropy(model.lm_head(hidden[keep]).float(), target[keep])


def fine_tune(
    model_dir: str | Path,
    batch: Callable[[PreTrainedTokenizerBase, int], list[tuple[list[int], list[int]]]],
    steps: int,
    lr_at: Callable[[int], float],
    *,
    seed: int = 0,
    log_every: int = 50,
    top_layers: int | None = None,
    phase: Callable[[int], str] = lambda s: "",
    lora: dict[str, int] | None = None,
    adapter_dir: Path | None = None,
) -> dict[str, float]:
    """The supervised loop the warm-starts share: ``batch(tokenizer, step)`` gives (ids, mask)
    pairs, the loss is on masked-in tokens, AdamW at ``lr_at(step)`` with gradients clipped to 1
    (on the last ``top_layers`` decoder layers and the final norm only, when given; on a LoRA
    adapter over those layers with ``lora``, saved to ``adapter_dir`` and merged in at the end);
    progress is logged every ``log_every`` steps and the folder saved in place at the end."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    peft_model = None
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        n = model.config.num_hidden_layers
        layers = list(range(n - top_layers, n)) if top_layers is not None else None
        peft_model = get_peft_model(model, LoraConfig(
            r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0, layers_to_transform=layers,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        model = peft_model.get_base_model()  # the same modules, with the adapter's layers in them
    elif top_layers is not None:
        model.requires_grad_(False)
        for module in (*model.model.layers[-top_layers:], model.model.norm):
            module.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr_at(0), weight_decay=0.0)
    t0 = time.monotonic()
    loss_val = float("nan")
    for step in range(steps):
        ids, attn, labels = _batch(tok, batch(tok, step))
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = _masked_loss(model, ids, attn, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss_val = loss.item()
        if step % log_every == 0 or step == steps - 1:
            log.info("warm-start step %d/%d (%s) loss %.3f (%.0f s)", step + 1, steps, phase(step), loss_val,
                     time.monotonic() - t0)
    if peft_model is not None:
        assert adapter_dir is not None, "a LoRA warm-start needs a folder for its adapter"
        peft_model.save_pretrained(adapter_dir, safe_serialization=True)
        model = peft_model.merge_and_unload()
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"loss": loss_val, "seconds": time.monotonic() - t0}


def merge_adapter(model_dir: Path, adapter_dir: Path) -> None:
    """Merge the peft adapter at ``adapter_dir`` into the model folder ``model_dir``, in place."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(model_dir, safe_serialization=True)
