"""Several named policies on one base model: ``Learner.run`` on the tiny model against a fake serve.

Each policy is its own LoRA adapter with its own optimizer, version and batches; the learner takes
them in turn, publishes only the trained policy's adapter (and names the policy), and a checkpoint
holds every adapter, optimizer and version, so a resumed run continues exactly. Without
``policies`` in serve's info the learner is the single-policy one it always was.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.buffer import Sample
from agentrl.config import LearnConfig
from agentrl.learner.lora import LoraConfig, activate, add_adapters, of_adapter
from agentrl.learner.trainer import learn, token_logprobs
from agentrl.weights.config import AdapterTransportConfig, WeightsConfig
from tests.conftest import RecordingSource
from tests.test_learner_packing import make_samples

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
IDS = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 8, 2, 11, 40, 6, 19, 4]])


def _batch(tag: str, seed: int) -> list[Sample]:
    """Two groups of two episodes, each group with a winner (a learning signal)."""
    return [replace(s, sample_id=f"{tag}{i}", episode_id=f"{tag}-e{i}", group_id=f"{tag}-g{i % 2}",
                    reward=float(i < 2)) for i, s in enumerate(make_samples(4, seed=seed))]


class TwoPolicies(RecordingSource):
    """serve with policies "a" and "b": fixed batches per policy (none for a policy not in
    ``batches``), serve's version of each settable; records pulls, publishes and acks."""

    def __init__(
        self, model: str, batches: dict[str, list[list[Sample]]], versions: dict[str, int] | None = None
    ) -> None:
        self.model, self.batches = model, batches
        self.served = dict(versions or {"a": 0, "b": 0})
        super().__init__()
        self.published: list[tuple[str, int, dict[str, torch.Tensor]]] = []
        self.pulled = {"a": 0, "b": 0}

    async def info(self) -> dict[str, Any]:
        return {"model_path": self.model, "version": 0, "batch_size": 4, "max_staleness": 4,
                "policies": {n: {"version": v, "max_staleness": 4} for n, v in self.served.items()}}

    async def get_batch(self, version: int, *, policy: str | None = None) -> tuple[str, list[Any]] | None:
        assert policy in ("a", "b")
        mine = self.batches.get(policy)
        if not mine:
            return None
        i = self.pulled[policy]
        self.pulled[policy] += 1
        self.events.append(("batch", policy, f"{policy}{i}", version))
        return f"{policy}{i}", [
            replace(s, sample_id=f"{policy}{i}-{s.sample_id}") for s in mine[i % len(mine)]
        ]

    async def publish(
        self, state: dict[str, Any], version: int, *, policy: str | None = None
    ) -> dict[str, Any]:
        assert policy is not None
        self.events.append(("publish", policy, version))
        self.published.append((policy, version, {k: v.clone() for k, v in state.items()}))
        self.served[policy] = version
        return {}


def _cfg(model: str, run_dir: Path, steps: int, **kw: Any) -> LearnConfig:
    kw.setdefault("lora", LORA)
    kw.setdefault("weights", WeightsConfig(transport=AdapterTransportConfig()))
    return LearnConfig(model=model, run_dir=str(run_dir), steps=steps, lr=1e-2, micro_batch_tokens=256,
                       metrics_port=-1, seed=3, **kw)


BATCHES = {"a": [_batch("x", 1), _batch("y", 2)], "b": [_batch("z", 3), _batch("w", 4)]}


def test_two_policies_train_in_turn_each_at_its_own_version_publishing_its_adapter_alone(
    tiny_model, tmp_path
):
    source = TwoPolicies(tiny_model, BATCHES)
    history = learn(_cfg(tiny_model, tmp_path, steps=4), source)

    assert [e for e in source.events if e[0] == "batch"] == [
        ("batch", "a", "a0", 0), ("batch", "b", "b0", 0), ("batch", "a", "a1", 1), ("batch", "b", "b1", 1)]
    assert [e for e in source.events if e[0] == "publish"] == [
        ("publish", "a", 1), ("publish", "b", 1), ("publish", "a", 2), ("publish", "b", 2)]
    layers = 2 * 2 * 2  # q and v of the tiny model's 2 layers, A and B each
    for policy, _, state in source.published:
        # its own adapter, nothing else
        assert len(state) == layers and all(of_adapter(k, policy) for k in state)
    assert [(r["step"], r["policy"], r["policy_step"], r["version"], r["batch_id"]) for r in history] == [
        (1, "a", 1, 1, "a0"), (2, "b", 1, 1, "b0"), (3, "a", 2, 2, "a1"), (4, "b", 2, 2, "b1")]
    rows = [json.loads(x) for x in (tmp_path / "learner.jsonl").read_text().splitlines()]
    assert [(r["policy"], r["version"]) for r in rows] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    # each policy's learning rate schedule and adapter moved on its own: b's first version is not a's
    a1, b1 = source.published[0][2], source.published[1][2]
    assert not any(torch.equal(a1[k], b1[k.replace(".a.", ".b.")]) for k in a1 if "lora_B" in k)


def test_a_policy_with_nothing_ready_is_passed_over_and_its_adapter_stays_as_it_was(tiny_model, tmp_path):
    source = TwoPolicies(tiny_model, {"a": BATCHES["a"]})  # b never has a batch
    learn(_cfg(tiny_model, tmp_path, steps=2, export_dir=str(tmp_path / "export")), source)
    # b was never published
    assert [e[1:] for e in source.events if e[0] == "publish"] == [("a", 1), ("a", 2)]

    # the export: one peft folder per policy; b's B is still zero (untrained), a's moved
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "export" / "a" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "export" / "b" / "adapter_model.safetensors"))
    # peft's names
    assert set(a) == set(b) and len(a) == 8 and all(".a." not in k and ".b." not in k for k in a)
    assert all(not v.any() for k, v in b.items() if "lora_B" in k)
    assert all(v.any() for k, v in a.items() if "lora_B" in k)
    assert json.loads((tmp_path / "export" / "b" / "adapter_config.json").read_text())["r"] == 4


def test_training_one_policy_changes_only_its_adapter_through_its_own_optimizer(tiny_model):
    from transformers import AutoModelForCausalLM

    from agentrl.learner.dist import Dist
    from agentrl.learner.step import build_state, train_step

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = add_adapters(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), LORA, names=["a", "b"]
    )
    cfg = _cfg(tiny_model, Path("unused"), steps=1)
    states = {
        n: build_state(
            cfg, model, Dist(), params=[p for k, p in model.named_parameters() if of_adapter(k, n)]
        )
        for n in ("a", "b")
    }
    ids_a = {id(p) for g in states["a"].optimizer.param_groups for p in g["params"]}
    ids_b = {id(p) for g in states["b"].optimizer.param_groups for p in g["params"]}
    assert len(ids_a) == len(ids_b) == 8 and not ids_a & ids_b  # one optimizer per adapter, disjoint

    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert activate(model, "a") == 4  # every LoRA layer
    stats = train_step(states["a"], _batch("x", 1), cfg, 0)
    assert stats["updated"] and states["a"].step == 1 and states["b"].step == 0
    after = model.state_dict()
    for k, v in after.items():
        if of_adapter(k, "a") and "lora_B" in k:
            assert not torch.equal(v, before[k]), k
        elif not of_adapter(k, "a"):
            assert torch.equal(v, before[k]), k  # b's adapter and the base: bit-identical
    assert states["a"].optimizer.state and not states["b"].optimizer.state
    # every adapter still trains
    assert all(p.requires_grad for k, p in model.named_parameters() if ".lora_" in k)

    with torch.no_grad():  # with b active the model is the base (b's B is zero); with a, it is not
        want = token_logprobs(base.eval(), IDS, torch.ones_like(IDS))
        activate(model, "b")
        assert torch.equal(token_logprobs(model.eval(), IDS, torch.ones_like(IDS)), want)
        activate(model, "a")
        assert (token_logprobs(model.eval(), IDS, torch.ones_like(IDS)) - want).abs().max() > 1e-4


def test_a_resumed_learner_goes_on_with_every_policys_adapter_optimizer_and_version(tiny_model, tmp_path):
    whole = TwoPolicies(tiny_model, BATCHES)
    reference = learn(_cfg(tiny_model, tmp_path / "whole", steps=5), whole)

    cut = tmp_path / "cut"
    first = TwoPolicies(tiny_model, BATCHES)
    learn(_cfg(tiny_model, cut, steps=3, checkpoint_every=1), first)
    assert json.loads((cut / "checkpoints" / "step_000003" / "meta.json").read_text())["policies"] == {
        "a": {"version": 2, "step": 2, "optimized": True}, "b": {"version": 1, "step": 1, "optimized": True}}

    # serve restarted: its engines came back with no adapters, both policies at version 0
    again = TwoPolicies(tiny_model, BATCHES)
    again.pulled = dict(first.pulled)  # the batches it serves next are those the whole run got
    resumed = learn(_cfg(tiny_model, cut, steps=5, checkpoint_every=1, resume=True), again)
    # the checkpointed batch acked again, both adapters at the versions the learner holds, then b's turn
    assert again.events[:4] == [
        ("ack", "a1"),
        ("publish", "a", 2),
        ("publish", "b", 1),
        ("batch", "b", "b1", 1),
    ]
    assert [(r["step"], r["policy"], r["version"]) for r in resumed] == [(4, "b", 2), (5, "a", 3)]
    for got, want in zip(resumed, reference[3:], strict=True):
        assert (got["batch_id"], got["policy_step"], got["lr"]) == (
            want["batch_id"],
            want["policy_step"],
            want["lr"],
        )
        # one process on CPU: exactly
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])
    # the republished adapters are those the first run published last; the final ones are the whole run's
    assert all(torch.equal(again.published[0][2][k], first.published[2][2][k]) for k in first.published[2][2])
    assert all(torch.equal(again.published[1][2][k], first.published[1][2][k]) for k in first.published[1][2])
    for (p, v, got), (q, w, want) in zip(again.published[2:], whole.published[3:], strict=True):
        assert (p, v) == (q, w)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    # the offline export of the last checkpoint: each policy's adapter as it was last published
    from safetensors.torch import load_file

    from agentrl.learner.checkpoint import export_checkpoint, latest_checkpoint
    from agentrl.weights.adapters import adapter_state

    ckpt = latest_checkpoint(cut / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000005"
    export_checkpoint(ckpt, tiny_model, tmp_path / "export")
    for policy, _, state in again.published[-2:]:
        exported = load_file(str(tmp_path / "export" / policy / "adapter_model.safetensors"))
        want = adapter_state(state, adapter=policy)
        assert set(exported) == set(want) and all(torch.equal(exported[k], want[k]) for k in want)


def test_several_policies_need_lora_and_the_adapter_transport(tiny_model, tmp_path):
    source = TwoPolicies(tiny_model, BATCHES)
    with pytest.raises(SystemExit, match="learn.lora.rank"):
        learn(_cfg(tiny_model, tmp_path, steps=1, lora=LoraConfig()), source)
    with pytest.raises(SystemExit, match='weights.transport.kind = "adapter"'):
        learn(_cfg(tiny_model, tmp_path, steps=1, weights=WeightsConfig()), source)
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="not a module name"):  # it would be ambiguous in every adapter key
        add_adapters(
            AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), LORA, names=["mlp"]
        )


class OnePolicy(TwoPolicies):
    """serve of old: no ``policies`` in its info, and no ``policy`` keyword on its calls."""

    async def info(self) -> dict[str, Any]:
        return {"model_path": self.model, "version": self.served["a"]}

    async def get_batch(self, version: int) -> tuple[str, list[Any]] | None:  # type: ignore[override]
        return await super().get_batch(version, policy="a")

    async def publish(self, state: dict[str, Any], version: int) -> dict[str, Any]:  # type: ignore[override]
        self.events.append(("publish", version))
        self.published.append(("", version, dict(state)))
        self.served["a"] = version
        return {}


def test_without_policies_the_learner_trains_its_one_adapter_as_before(tiny_model, tmp_path):
    source = OnePolicy(tiny_model, BATCHES)
    history = learn(_cfg(tiny_model, tmp_path, steps=2), source)
    assert [e for e in source.events if e[0] == "publish"] == [("publish", 1), ("publish", 2)]
    assert all(len(s) == 8 and all(".lora_A.default." in k or ".lora_B.default." in k for k in s)
               for _, _, s in source.published)
    assert [(r["step"], r["version"]) for r in history] == [(1, 1), (2, 2)]
    assert all("policy" not in r for r in history)


def test_serve_source_asks_for_and_publishes_a_policy_with_its_own_staleness_bound():
    from agentrl.learner.source import ServeSource

    calls: list[tuple[Any, ...]] = []

    class Client:
        async def get_batch(self, *args: Any, **kw: Any) -> None:
            calls.append(("get_batch", args, kw))

    class Transport:
        async def publish(self, state: dict[str, Any], version: int, **kw: Any) -> dict[str, Any]:
            calls.append(("publish", version, kw))
            return {}

    class Http:
        async def json(self, *args: Any, **kw: Any) -> dict[str, Any]:
            return {
                "model_path": "m",
                "version": 0,
                "batch_size": 8,
                "max_staleness": 2,
                "policies": {
                    "a": {"version": 3, "max_staleness": 5},
                    "b": {"version": 0, "max_staleness": 1},
                },
            }

    source = ServeSource.__new__(ServeSource)
    source.cfg = LearnConfig(policy_wait_s=7.5)
    source.http, source.client, source.transport = Http(), Client(), Transport()
    source.batch_size, source.max_staleness, source.policy_staleness, source._told = None, None, {}, True

    async def go() -> None:
        await source.info()
        await source.get_batch(3, policy="a")
        await source.get_batch(0, policy="b")
        await source.get_batch(7)
        await source.publish({}, 4, policy="a")
        await source.publish({}, 8)

    asyncio.run(go())
    assert calls == [("get_batch", (3, 5, 8), {"timeout_s": 7.5, "policy": "a"}),
                     ("get_batch", (0, 1, 8), {"timeout_s": 7.5, "policy": "b"}),
                     ("get_batch", (7, 2, 8), {"timeout_s": 30.0}),
                     ("publish", 4, {"policy": "a"}), ("publish", 8, {})]


def _fsdp_run(model: str, run_dir: str, steps: int, resume: bool) -> dict[str, Any]:
    """The learner with the fake serve on rank 0 (what torchrun runs): rows and published adapters."""
    source = TwoPolicies(model, BATCHES)
    if resume:
        source.pulled = {"a": 2, "b": 1}
    history = learn(_cfg(model, Path(run_dir), steps=steps, checkpoint_every=1, resume=resume), source)
    return {"world": history[0]["world"] if history else 0,
            "rows": [(r["step"], r["policy"], r["version"], r["loss"], r["grad_norm"]) for r in history],
            "published": [(p, v, {k: t.tolist() for k, t in s.items()}) for p, v, s in source.published]}


@pytest.mark.slow
def test_two_policies_under_two_fsdp_processes_train_and_resume_like_one_process(tiny_model, tmp_path):
    """FSDP2 (gloo, 2 processes): switching the active adapter between steps trains each policy as
    one process does, and the sharded checkpoint of both adapters and optimizers resumes."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    single = json.loads(json.dumps(_fsdp_run(tiny_model, str(tmp_path / "single"), steps=5, resume=False)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    out = {}
    for resume, steps in ((False, 3), (True, 5)):  # killed after step 3 (its checkpoint), resumed to 5
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(__file__)), tiny_model, str(tmp_path / "sharded"), str(steps), str(int(resume))]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        out[resume] = json.loads([x for x in run.stdout.splitlines() if x.startswith("{")][-1])
    assert out[False]["world"] == out[True]["world"] == 2 and single["world"] == 1
    rows = out[False]["rows"] + out[True]["rows"]
    assert [r[:3] for r in rows] == [r[:3] for r in single["rows"]]
    for got, want in zip(rows, single["rows"], strict=True):
        assert got[3] == pytest.approx(want[3], rel=1e-4, abs=1e-7) and got[4] == pytest.approx(
            want[4], rel=1e-4
        )
    # the resumed run republished both adapters (serve came back at 0), then b's and a's next versions
    published = out[False]["published"] + out[True]["published"][2:]
    assert [p[:2] for p in published] == [p[:2] for p in single["published"]]
    for (_, _, got), (_, _, want) in zip(published, single["published"], strict=True):
        assert set(got) == set(want)
        assert max((torch.tensor(got[k]) - torch.tensor(want[k])).abs().max().item() for k in want) < 1e-5


if __name__ == "__main__":
    import os
    import sys

    result = _fsdp_run(sys.argv[1], sys.argv[2], steps=int(sys.argv[3]), resume=sys.argv[4] == "1")
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
