"""A tiny Qwen2-architecture model built offline and deterministically, for tests and fallbacks.

The tokenizer is a byte-level BPE trained on a corpus generated here (chat markup, tool calls,
arithmetic, a little English); the chat template is ChatML and renders tools, assistant tool calls
and tool results (``chat_template.jinja`` beside this file). Same seed, same bytes: the builder
is deterministic so that tests and caches can rely on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (not special) so they survive detokenisation and the engine's tool parser sees them.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
BUILD_VERSION = "1"

_WORDS = (
    "the a an of to and in is it that was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know answer number compute "
    "result python tool call function value total sum product difference question please reply"
).split()


def _corpus(rng: random.Random, n: int) -> list[str]:
    from agentrl.models.transcripts import arithmetic_transcript_text

    lines: list[str] = []
    for _ in range(n):
        lines.append(arithmetic_transcript_text(rng))
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))).capitalize() + ".")
        lines.append(f"print({rng.randint(0, 999)} {rng.choice('+-*')} {rng.randint(0, 999)})")
    return lines


def _train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed), 1500), trainer=trainer)
    tok.add_tokens(ADDED_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = TEMPLATE_PATH.read_text()
    return fast


def tiny_recipe(
    *, seed: int = 0, vocab_size: int = 2048, hidden_size: int = 128, num_layers: int = 2
) -> dict:
    """The stamp a tiny model folder built with these settings carries (``agentrl_recipe.json``)."""
    return {
        "build_version": BUILD_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "template_sha": hashlib.sha256(TEMPLATE_PATH.read_bytes()).hexdigest()[:16],
    }


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 2,
    overwrite: bool = False,
) -> Path:
    """Build the tiny model folder at ``out_dir`` (skips if already built with the same recipe)."""
    out = Path(out_dir)
    recipe = tiny_recipe(seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers)
    stamp = out / "agentrl_recipe.json"
    if not overwrite and stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    log.info("building tiny model in %s", out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = _train_tokenizer(vocab_size, seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "agentrl_recipe.json").write_text(json.dumps(recipe))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
