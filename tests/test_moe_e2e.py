"""An MoE model trains end to end: ``agentrl run`` on the tiny MoE (agentrl.models.moe) for three
learner steps, with routing replay.

The straggler environment's episodes last two to four turns with a tool wait of about 4 s in each.
The first (max_staleness + 1) batches of episodes start at once; once the learner has trained on
the first, new episodes start at version 1 while it trains steps 2 and 3 on the buffered ones
(seconds each on this model), so those episodes run across the next weight updates (partial
rollouts) unless a step takes longer than a whole episode. The test reads what the run left: every
step trained through the engines' recorded experts and reports its routing disagreement; some
episodes carry tokens of two policy versions; and each recorded call's tokens of its version are
reproduced by the learner's weights of that version (its checkpoints) routed through the call's
recorded experts: to float rounding for a call that ran wholly under its version, closely (all such
tokens together) for one that may have run across an update. So the published MoE
weights, the per-token versions and the routing all say what the engine ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import straggler_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _policy(model_dir: str, run_dir: Path, version: int, scratch: Path):
    """The learner's policy of ``version``: the model folder itself at 0, else the learner's
    checkpoint of that version exported as a Hugging Face folder, read by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.learner.checkpoint import export_checkpoint

    folder = Path(model_dir)
    if version > 0:
        (ckpt,) = [p for p in (run_dir / "checkpoints").glob("step_*")
                   if json.loads((p / "meta.json").read_text())["version"] == version]
        folder = export_checkpoint(ckpt, model_dir, scratch / f"v{version}")
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def test_agentrl_run_trains_the_tiny_moe_through_the_engines_recorded_experts(tmp_path: Path) -> None:
    import numpy as np
    import torch

    from agentrl.buffer.sample import Sample
    from agentrl.learner.packing import packed_logprobs, routing_replayed
    from agentrl.models import resolve_model
    from agentrl.router.sessions import CallRecord, Session, chain_routing

    model_dir = resolve_model("tiny-moe")
    run_dir = tmp_path / "run"
    steps = straggler_run(run_dir, "--serve.model=tiny-moe", "--learn.checkpoint_every=1",
                          "--learn.keep_checkpoints=0", latency_median_s=4.0, max_keys=3, max_turns=4,
                          max_tokens=48, steps=3)

    # every step trained through recorded experts; at matching precision they rarely differ from the learner's
    # own
    assert len(steps) == 3
    for s in steps:
        assert s["routing_replayed_tokens"] > 0 and 0.0 <= s["routing_disagreement"] < 0.2, s

    sessions = []
    for path in sorted((run_dir / "sessions").glob("*.jsonl")):
        records = [CallRecord.from_dict(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]
        sessions.append(Session(path.stem, records=records))
    samples = [s for session in sessions for s in session.samples()]
    spanning = [s for s in samples if len(set(s.versions[s.loss_mask != 0].tolist())) > 1]
    assert spanning, "no episode ran across a weight update"
    for s in spanning:  # a partial rollout: older tokens first, then newer, never back
        generated = s.versions[s.loss_mask != 0]
        assert (np.diff(generated) >= 0).all(), generated.tolist()

    # each call as the engine ran it: its tokens of its (last) version, through that version's weights
    # and the experts of the call's chain (positions it took from the prefix cache were computed before).
    # A call that started after the learner logged the version (it logs once serve has loaded it), or
    # at version 0, ran wholly under it and is held to float rounding, token by token. One that started
    # before may have run across the update (re-prefilled under the new weights; a token-level check of
    # that on the engine alone is test_moe_routing's in-flight test): its tokens are held together, not
    # one call at a time. A CI run once saw such a call's first new-version token 0.026 off and the
    # next one exact (a single token, not reproduced since; see docs/learner.md).
    published = {s["version"]: s["time"] for s in steps}
    policies: dict[int, object] = {}
    exact, close, close_diffs = 0, 0, []
    for session in sessions:
        by_index = {r.index: r for r in session.records}
        for rec in session.records:
            chain = [rec]
            while chain[-1].parent is not None:
                chain.append(by_index[chain[-1].parent])
            comp = rec.completions[0]
            if not comp.token_ids or comp.routing is None:
                continue
            version = max(comp.versions)
            ids = rec.prompt_ids + comp.token_ids
            n, start = len(ids), len(rec.prompt_ids)
            calls = [c.completions[0] for c in reversed(chain)]  # one choice per call
            routing = chain_routing(
                n, [c.routing for c in calls], [max(c.versions, default=None) for c in calls]
            )
            mask = [0] * start + [int(v == version) for v in comp.versions]
            sample = Sample(
                ids,
                mask,
                [0.0] * start + comp.logprobs,
                [-1] * start + comp.versions,
                episode_id="e",
                group_id="g",
                env="straggler",
                reward=0.0,
                routing=routing,
            )
            if version not in policies:
                policies[version] = _policy(model_dir, run_dir, version, tmp_path)
            with torch.no_grad(), routing_replayed(policies[version], [sample]):
                learner = packed_logprobs(policies[version], [sample])[0]
            keep = torch.from_numpy(sample.loss_mask[1:] != 0)
            diff = (learner[keep] - torch.from_numpy(sample.logprobs[1:])[keep]).abs()
            where = (rec.session_id, rec.index, version, float(diff.mean()), float(diff.max()))
            if version == 0 or rec.created - rec.latency_s > published[version]:
                assert diff.mean() < 1e-3 and diff.max() < 1e-2, where
                exact += 1
            else:
                close_diffs.append(diff)
                close += 1
    if close_diffs:  # garbage experts are off by tenths of a nat on most tokens
        together = torch.cat(close_diffs)
        assert together.mean() < 1e-2 and (together < 1e-2).float().mean() > 0.9, together.tolist()
    assert exact >= 12 and exact + close >= 24 and len(policies) >= 2, (exact, close, sorted(policies))
