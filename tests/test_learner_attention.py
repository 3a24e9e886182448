"""Attention over a packed row one sample at a time (``agentrl.learner.attention``): the same
logits and gradients as transformers' sdpa with its block-diagonal mask, on the three model
families the project trains (Qwen2, Qwen3-MoE, Llama/SmolLM2); a padded batch still gets its
padding mask."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM  # noqa: E402

from agentrl.learner.attention import PACKED, use_packed_attention  # noqa: E402
from agentrl.models import resolve_model  # noqa: E402

TOL = 1e-5
LENGTHS = (37, 5, 64, 1, 22)  # a one-token sample included: its own span of one


def _row(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return ids, pos


def _pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32)
    assert base.config._attn_implementation == "sdpa"
    packed = copy.deepcopy(base)
    assert use_packed_attention(packed) and packed.config._attn_implementation == PACKED
    return base, packed


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "smollm2"])
def test_a_packed_row_gives_sdpas_logits_and_gradients(name: str) -> None:
    """Logits within fp32 rounding (relative to their scale: SmolLM2's 30 layers reach |logit| ~ 25),
    gradients too on the tiny models (SmolLM2's 135M are the logits' check only, for time)."""
    base, packed = _pair(name)
    ids, pos = _row(base.config.vocab_size, seed=len(name))
    grads_too = name != "smollm2"
    outs = []
    for model in (base, packed):
        with torch.set_grad_enabled(grads_too):
            logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits
        grads = {}
        if grads_too:
            (logits.log_softmax(-1) * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outs.append((logits.detach(), grads))
    (ref, ref_grads), (got, got_grads) = outs
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() < TOL * scale
    assert ref_grads.keys() == got_grads.keys() and (ref_grads or not grads_too)
    for n, g in ref_grads.items():
        assert ((got_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() < 1e-4, n
    # and attention never crossed samples: changing the first sample leaves the others as they were
    ids2 = ids.clone()
    ids2[0, : LENGTHS[0]] = (ids2[0, : LENGTHS[0]] + 1) % base.config.vocab_size
    with torch.no_grad():
        other = packed(input_ids=ids2, position_ids=pos, attention_mask=None, use_cache=False).logits
    assert (other[0, LENGTHS[0]:] - got[0, LENGTHS[0]:]).abs().max().item() < TOL * scale
    assert (other[0, : LENGTHS[0]] - got[0, : LENGTHS[0]]).abs().max().item() > 1e-3


def test_a_right_padded_batch_keeps_its_padding_mask() -> None:
    base, packed = _pair("tiny")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, base.config.vocab_size, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        ref = base(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = packed(input_ids=ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()
    assert (got[keep] - ref[keep]).abs().max().item() < TOL
