"""The LM head in chunks: the same logprobs, entropy, kept-set replay, teacher top-k terms and
gradients as the unchunked computation over the whole row's logits."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentrl.buffer.behaviour import Behaviour  # noqa: E402
from agentrl.learner.dist import Dist, load_model  # noqa: E402
from agentrl.learner.head import chunked_terms, full_entropy, full_terms  # noqa: E402
from agentrl.learner.replay import RowReplay  # noqa: E402
from tests.test_learner_packing import make_samples  # noqa: E402

TOL = 1e-5


def _random_plan(rows: int, vocab: int, targets: torch.Tensor, seed: int) -> RowReplay:
    """Temperatures, penalties and kept sets (holding their target) at random positions of a row."""
    g = torch.Generator().manual_seed(seed)
    temperature = 0.5 + torch.rand(rows, generator=g)
    kept_rows = torch.randperm(rows, generator=g)[: rows // 3].sort().values
    width = 40
    kept_ids = torch.randint(0, vocab, (kept_rows.shape[0], width), generator=g)
    kept_ids[:, 0] = targets[kept_rows]
    kept_valid = torch.arange(width)[None, :] < torch.randint(1, width, (kept_rows.shape[0], 1), generator=g)
    for r in range(kept_ids.shape[0]):  # a kept set holds each id once
        ids = list(dict.fromkeys(kept_ids[r, kept_valid[r]].tolist()))
        kept_ids[r, : len(ids)] = torch.tensor(ids)
        kept_valid[r] = torch.arange(width) < len(ids)
    pen = rows * 3
    pairs = torch.unique(torch.stack([torch.randint(0, rows, (pen,), generator=g),
                                      torch.randint(0, vocab, (pen,), generator=g)], 1), dim=0)
    params = torch.stack([torch.rand(pairs.shape[0], generator=g), torch.rand(pairs.shape[0], generator=g),
                          1.0 + torch.rand(pairs.shape[0], generator=g)], 1)
    return RowReplay(temperature=temperature, kept_rows=kept_rows, kept_ids=kept_ids, kept_valid=kept_valid,
                     pen_rows=pairs[:, 0].contiguous(), pen_cols=pairs[:, 1].contiguous(),
                     pen_count=torch.randint(0, 3, (pairs.shape[0],), generator=g).float(), pen_params=params)


def _objective(logp: torch.Tensor, entropy: torch.Tensor, topk: torch.Tensor, coef: tuple) -> torch.Tensor:
    """A scalar that weighs every per-position term differently, so each one's gradient counts."""
    return (coef[0] * logp).sum() + (coef[1] * entropy).sum() + (coef[2] * topk).sum()


@pytest.mark.parametrize("replayed", [False, True])
def test_a_chunked_large_vocabulary_head_gives_the_unchunked_terms_and_gradients(replayed: bool) -> None:
    torch.manual_seed(0)
    rows, hidden_size, vocab, k = 53, 16, 6000, 5
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) * 0.5).requires_grad_()
    bias = torch.randn(vocab).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    topk_ids = torch.randint(0, vocab, (rows, k))
    topk_ids[::4, 2:] = -1  # a teacher that scored fewer than k tokens, or none
    plan = _random_plan(rows, vocab, targets, seed=1) if replayed else RowReplay()
    coef = (torch.randn(rows), torch.randn(rows), torch.randn(rows, k))

    logits = torch.nn.functional.linear(hidden, weight, bias)
    want = full_terms(logits, targets, plan, topk_ids)
    want_entropy = full_entropy(logits, plan)  # with gradient: the reference for the entropy's
    assert torch.allclose(want.entropy, want_entropy)
    want_grads = torch.autograd.grad(
        _objective(want.logp, want_entropy, want.topk, coef), (hidden, weight, bias)
    )

    # 7 chunks, the last short
    got = chunked_terms(hidden, weight, bias, targets, plan, topk_ids, chunk_tokens=7)
    got_grads = torch.autograd.grad(_objective(got.logp, got.entropy, got.topk, coef), (hidden, weight, bias))

    assert (got.logp - want.logp).abs().max() < TOL
    assert (got.entropy - want_entropy).abs().max() < TOL
    assert (got.topk - want.topk).abs().max() < TOL
    assert bool((got.topk[::4, 2:] == 0).all())
    if replayed:  # the kept sets renormalise: those positions' logprobs differ from a plain log-softmax
        plain = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        assert bool((got.logp[plan.kept_rows] > plain[plan.kept_rows] + 1e-3).all())
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).abs().max() < TOL * max(1.0, float(w.abs().max()))


def test_logprobs_alone_get_the_unchunked_gradient_and_no_grad_for_a_frozen_head() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(20, 8, requires_grad=True)
    weight = torch.randn(3000, 8)  # frozen, as under LoRA
    targets = torch.randint(0, 3000, (20,))
    plan = _random_plan(20, 3000, targets, seed=2)
    want = torch.autograd.grad(full_terms(hidden @ weight.T, targets, plan).logp.sum(), hidden)[0]
    got = chunked_terms(hidden, weight, None, targets, plan, chunk_tokens=6)
    assert got.topk is None
    (grad,) = torch.autograd.grad(got.logp.sum(), hidden)
    assert (grad - want).abs().max() < TOL


def _behaviour_samples(n: int, seed: int) -> list:
    """Samples whose completions were drawn at a temperature, with penalties and top-k kept sets."""
    rng = random.Random(seed)
    out = []
    for s in make_samples(n, seed=seed):
        tokens = np.asarray(s.token_ids)
        start = int(np.flatnonzero(np.asarray(s.loss_mask))[0])
        length = len(tokens) - start
        kept = [sorted({int(tokens[start + i]), *rng.sample(range(3, 200), 6)}) for i in range(length)]
        settings = {"temperature": rng.uniform(0.5, 1.5), "top_k": 7.0, "presence_penalty": 0.3,
                    "frequency_penalty": 0.2, "repetition_penalty": 1.2}
        out.append(
            replace(s, behaviour=Behaviour.from_calls(len(tokens), [(start, length, settings, kept)], tokens))
        )
    return out


def _with_topk(samples: list, k: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for s in samples:
        ids = rng.integers(0, 200, (len(s.token_ids), k))
        ids[np.asarray(s.loss_mask) == 0] = -1
        lps = np.where(ids >= 0, -rng.uniform(0.1, 5.0, ids.shape), np.nan).astype(np.float32)
        out.append(replace(s, teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    return out


def test_the_tiny_models_packed_forward_is_the_same_chunked_as_unchunked_with_its_tied_head(
    tiny_model: str,
) -> None:
    from agentrl.learner.packing import packed_forward

    model = load_model(tiny_model, Dist())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    samples = _with_topk(_behaviour_samples(5, seed=3), k=4, seed=4)

    def run(chunk: int) -> tuple:
        model.zero_grad(set_to_none=True)
        out = packed_forward(model, samples, topk=True, chunk_tokens=chunk)
        mask = torch.from_numpy(
            np.stack(
                [
                    np.pad(
                        np.asarray(s.loss_mask[1:], dtype=np.float32),
                        (0, out.logp.shape[1] - len(s.token_ids) + 1),
                    )
                    for s in samples
                ]
            )
        )
        # as the step's loss: the sampled tokens' logprobs and the top-k term (the entropy is a statistic)
        ((out.logp * mask).sum() + 0.1 * out.topk.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, grads

    want, want_grads = run(0)
    got, got_grads = run(9)
    assert (got.logp - want.logp).abs().max() < TOL
    assert (got.entropy - want.entropy).abs().max() < TOL
    assert (got.topk - want.topk).abs().max() < TOL
    assert set(got_grads) == set(want_grads) and "model.embed_tokens.weight" in got_grads
    for name, g in got_grads.items():
        assert (g - want_grads[name]).abs().max() < TOL * max(1.0, float(want_grads[name].abs().max())), name


def test_the_learner_maps_large_blocks_on_their_own_unless_the_environment_says_otherwise(monkeypatch):
    import platform

    from agentrl.learner.heap import map_large_blocks

    if platform.libc_ver()[0] != "glibc":
        pytest.fail("these machines run glibc; the setting is glibc's")
    assert map_large_blocks() is True
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")  # the user's own setting is left alone
    assert map_large_blocks() is False
