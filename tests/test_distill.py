"""On-policy distillation in the learner: the per-token advantage ``coef * (log pi_teacher - log mu)``,
the step's teacher-KL figure, and a student that trains on a teacher's logprobs moving towards it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentrl.config import LearnConfig  # noqa: E402
from agentrl.learner.advantages import distilled_advantages  # noqa: E402
from agentrl.learner.config import PGLoss  # noqa: E402
from agentrl.learner.dist import Dist, load_model  # noqa: E402
from agentrl.learner.packing import packed_logprobs, pad_batch  # noqa: E402
from agentrl.learner.step import build_state, eval_mode, teacher_stats, train_step  # noqa: E402
from tests.test_learner_packing import make_samples  # noqa: E402


def test_the_teacher_term_is_added_per_token_where_a_teacher_scored():
    adv = torch.tensor([1.0, -0.5])
    teacher = torch.tensor([[-1.0, float("nan"), -3.0], [float("nan"), -0.25, -2.0]])
    behaviour = torch.tensor([[-2.0, -1.0, -1.0], [-1.0, -0.5, -2.0]])
    got = distilled_advantages(adv, teacher, behaviour, coef=0.5)
    assert torch.allclose(got, torch.tensor([[1.5, 1.0, 0.0], [-0.5, -0.375, -0.5]]))
    alone = distilled_advantages(adv, teacher, behaviour, coef=2.0, with_reward=False)
    assert torch.allclose(alone, torch.tensor([[2.0, 0.0, -4.0], [0.0, 0.5, 0.0]]))


def test_the_steps_teacher_kl_is_the_mean_gap_over_trained_tokens_a_teacher_scored():
    s = make_samples(1, seed=1)[0]
    n = len(s.token_ids)
    teacher = np.full(n, np.nan, dtype=np.float32)
    generated = np.flatnonzero(s.loss_mask)
    teacher[generated[:3]] = s.logprobs[generated[:3]] - np.array([0.5, 1.0, 1.5], dtype=np.float32)
    s = replace(s, teacher_logprobs=teacher)
    mask = s.loss_mask.copy()
    stats = teacher_stats([s], [mask])
    assert stats["teacher_tokens"] == 3 and stats["teacher_kl"] == pytest.approx(1.0)
    mask[generated[0]] = 0  # a token the step does not train (e.g. a completion another sample trains)
    assert teacher_stats([s], [mask]) == {"teacher_kl": pytest.approx(1.25), "teacher_tokens": 2}
    assert teacher_stats(make_samples(2), [m.loss_mask for m in make_samples(2)]) == {}  # no teacher: nothing


def _logprobs(model, samples) -> list[np.ndarray]:
    with torch.no_grad(), eval_mode(model):
        lp = packed_logprobs(model, samples)  # [B, T-1]: position t predicts token t + 1
    return [np.concatenate([[0.0], lp[i, : len(s.token_ids) - 1].numpy()]) for i, s in enumerate(samples)]


def test_a_student_trained_on_a_teachers_logprobs_alone_moves_towards_the_teacher(tiny_model: str,
                                                                               tiny_tools_model: str) -> None:
    """The student (the tiny model) samples nothing here: its own logprobs stand as the behaviour
    (on-policy), the tiny-tools model (another set of weights, the same tokenizer) is the teacher,
    every reward is equal (no reward signal), and the distillation term alone trains it."""
    torch.manual_seed(0)
    student = load_model(tiny_model, Dist())
    teacher_model = load_model(tiny_tools_model, Dist())
    base = [replace(s, reward=1.0) for s in make_samples(8, seed=3)]
    cfg = LearnConfig(lr=3e-3, micro_batch_tokens=10_000, loss=PGLoss(correction="none", distill_coef=1.0,
                                                                       distill_reward=False))
    state = build_state(cfg, student, Dist())
    teacher = [np.where(s.loss_mask != 0, t, np.nan).astype(np.float32)
               for s, t in zip(base, _logprobs(teacher_model, base), strict=True)]

    def gap() -> float:  # mean |log pi_student - log pi_teacher| over the generated tokens
        own = _logprobs(state.model, base)
        return float(np.mean(np.concatenate([np.abs(o - t)[s.loss_mask != 0][1:]
                                             for s, o, t in zip(base, own, teacher, strict=True)])))

    before = gap()
    kls = []
    for step in range(1, 6):
        own = _logprobs(state.model, base)
        samples = [replace(s, logprobs=o.astype(np.float32), teacher_logprobs=t)
                   for s, o, t in zip(base, own, teacher, strict=True)]
        out = train_step(state, samples, cfg, step)
        assert out["updated"] and out["teacher_tokens"] > 0, out
        kls.append(out["teacher_kl"])
    after = gap()
    assert after < 0.8 * before, (before, after, kls)
    assert abs(kls[-1]) < abs(kls[0]), kls  # the reverse-KL estimate shrinks towards 0 as it learns


def test_pad_batch_carries_the_teacher_logprobs_shifted_like_the_behaviour():
    s = make_samples(1, seed=2)[0]
    teacher = np.where(s.loss_mask != 0, s.logprobs - 1.0, np.nan).astype(np.float32)
    t = pad_batch([replace(s, teacher_logprobs=teacher), make_samples(1, seed=4)[0]], 0)
    assert torch.equal(torch.isfinite(t["teacher"][0]), t["mask"][0] > 0)
    assert torch.allclose(t["teacher"][0][t["mask"][0] > 0], t["behaviour"][0][t["mask"][0] > 0] - 1.0)
    assert torch.isnan(t["teacher"][1]).all()  # no teacher


def test_flat_rewards_are_no_missing_signal_when_a_teacher_teaches():
    from agentrl.learner.signals import SignalWatch

    s = make_samples(2, seed=5)
    taught = [replace(x, teacher_logprobs=np.where(x.loss_mask != 0, -1.0, np.nan)) for x in s]
    assert not any(SignalWatch(1).observe(taught, 0.0, per_token_signal=True))
    # no teacher's term
    assert "flat_rewards" in SignalWatch(1).observe(taught, 0.0, per_token_signal=False)[0]


def test_the_top_k_forward_kl_is_the_teachers_renormalized_top_k_against_the_students_probabilities():
    from agentrl.learner.advantages import topk_forward_kl

    teacher = torch.tensor([[[-0.5, -1.5], [float("nan"), float("nan")]]])  # one scored position, one not
    student = torch.tensor([[[-1.0, -2.0], [-0.1, -0.2]]], requires_grad=True)
    kl, scored = topk_forward_kl(student, teacher)
    q = torch.softmax(torch.tensor([-0.5, -1.5]), -1)  # renormalized over the two
    expected = float((q * (q.log() - torch.tensor([-1.0, -2.0]))).sum())
    assert scored.tolist() == [[True, False]] and kl[0, 1] == 0.0
    assert kl[0, 0].item() == pytest.approx(expected, abs=1e-6) and expected > 0
    kl.sum().backward()
    assert torch.allclose(student.grad[0, 0], -q) and (student.grad[0, 1] == 0).all()  # -q_j d log pi(j)


def _with_teacher_topk(samples, teacher_model, k: int):
    """Each sample with the teacher model's top-k (ids and logprobs) at its generated positions, as
    the teacher scorer stores them (-1 / NaN elsewhere): computed here in fp32 by transformers."""
    out = []
    with torch.no_grad(), eval_mode(teacher_model):
        for s in samples:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long).unsqueeze(0)
            # row t predicts t + 1
            logp = torch.log_softmax(teacher_model(input_ids=ids).logits[0].float(), -1)
            top = logp[:-1].topk(k, dim=-1)
            top_ids = np.full((len(s.token_ids), k), -1, dtype=np.int32)
            top_lps = np.full((len(s.token_ids), k), np.nan, dtype=np.float32)
            top_ids[1:], top_lps[1:] = top.indices.numpy(), top.values.numpy()
            gen = s.loss_mask != 0
            top_ids[~gen], top_lps[~gen] = -1, np.nan
            sampled = np.concatenate([[np.nan], logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].numpy()])
            out.append(replace(s, teacher_logprobs=np.where(gen, sampled, np.nan).astype(np.float32),
                               teacher_topk_ids=top_ids, teacher_topk_logprobs=top_lps))
    return out


def test_the_packed_forward_gathers_the_students_log_softmax_at_the_teachers_top_k(
    tiny_model: str, tiny_tools_model: str
) -> None:
    from agentrl.learner.packing import packed_forward

    student, teacher_model = load_model(tiny_model, Dist()), load_model(tiny_tools_model, Dist())
    samples = _with_teacher_topk(make_samples(3, seed=6), teacher_model, k=4)
    with torch.no_grad(), eval_mode(student):
        got = packed_forward(student, samples, topk=True)
        for i, s in enumerate(samples):  # one sample at a time, unpacked
            ids = torch.as_tensor(s.token_ids, dtype=torch.long).unsqueeze(0)
            logp = torch.log_softmax(student(input_ids=ids).logits[0, :-1].float(), -1)
            top = torch.as_tensor(s.teacher_topk_ids[1:], dtype=torch.long)
            want = torch.where(top >= 0, logp.gather(-1, top.clamp(min=0)), torch.zeros(()))
            assert torch.allclose(got.topk[i, : len(s.token_ids) - 1], want, atol=1e-5)
    t = pad_batch(samples, 0)
    assert t["teacher_topk"].shape == (*t["mask"].shape, 4)
    assert torch.equal(torch.isfinite(t["teacher_topk"]).all(-1), t["mask"] > 0)


def test_a_student_trained_on_a_teachers_top_k_alone_moves_towards_the_teacher(tiny_model: str,
                                                                            tiny_tools_model: str) -> None:
    """As the reverse-KL test above, with the forward KL over the tiny-tools model's top-8 alone
    (``distill_topk_coef``, every reward equal): the step's ``distill/topk_kl`` falls."""
    torch.manual_seed(0)
    student = load_model(tiny_model, Dist())
    base = _with_teacher_topk([replace(s, reward=1.0) for s in make_samples(8, seed=3)],
                              load_model(tiny_tools_model, Dist()), k=8)
    cfg = LearnConfig(
        lr=3e-3, micro_batch_tokens=10_000, loss=PGLoss(correction="none", distill_topk_coef=1.0)
    )
    state = build_state(cfg, student, Dist())
    kls = []
    for step in range(1, 6):
        own = _logprobs(state.model, base)
        out = train_step(
            state,
            [replace(s, logprobs=o.astype(np.float32)) for s, o in zip(base, own, strict=True)],
            cfg,
            step,
        )
        assert out["updated"] and out["distill/topk_kl"] > 0, out
        kls.append(out["distill/topk_kl"])
    assert kls[-1] < 0.5 * kls[0], kls
