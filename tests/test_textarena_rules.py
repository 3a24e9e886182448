"""TextArena's rewards mean what they say (#41): a fixed opponent never hands the policy a win it did
not earn, and a game's number of players is the game's own. With ``opponent="roles"`` each seat is
a role (#36), played by what the run binds to it, and scored with its own seat's reward.

The games are written here (TextArena ``Env`` subclasses registered under test ids), so each case
is exactly the one named: a race whose observations list no moves, the same race listing its moves
on the ``[GAME]`` line, and a one-player game.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
import textarena as ta
from textarena.envs import DEFAULT_WRAPPERS
from textarena.envs.registration import ENV_REGISTRY, register

from agentrl.env import make
from agentrl.errors import ConfigError
from agentrl.rollout.config import EpisodeLimits, RoleBinding
from agentrl.rollout.episode import run_episode
from agentrl.router.sessions import SessionSummary
from tests.test_env_adapters import play

MOVES = ("[step]", "[wait]")


class Race(ta.Env):
    """Two players; ``[step]`` moves you one square, ``[wait]`` stays; the first on square 3 wins.
    Any other move loses at once (no error allowance), so a forfeit is never hidden by a retry."""

    def __init__(self, list_moves: bool) -> None:
        self.list_moves = list_moves

    def reset(self, num_players: int, seed: int | None = None) -> None:
        self.state = ta.TwoPlayerState(num_players=num_players, seed=seed, error_allowance=0)
        self.state.reset(game_state={"at": [0, 0]}, player_prompt_function=lambda player_id, game_state: (
            f"You are Player {player_id} in a race to square 3. Reply '[step]' to move one square."))
        self._show()

    def _show(self) -> None:
        at = self.state.game_state["at"]
        listing = f" Available Moves: {', '.join(repr(m) for m in MOVES)}" if self.list_moves else ""
        self.state.add_observation(message=f"Squares: {at[0]} and {at[1]}.{listing}",
                                   observation_type=ta.ObservationType.GAME_BOARD)

    def step(self, action: str) -> tuple[bool, dict[str, Any]]:
        me = self.state.current_player_id
        move = re.search(r"\[[a-z]+\]", action)
        if move is None or move.group(0) not in MOVES:
            self.state.set_invalid_move(reason=f"{action!r} is not a move")
        elif move.group(0) == "[step]":
            self.state.game_state["at"][me] += 1
            if self.state.game_state["at"][me] == 3:
                self.state.set_winner(player_id=me, reason=f"Player {me} reached square 3")
        self._show()
        return self.state.step()


class Solo(ta.Env):
    """One player, who wins by saying ``[done]``."""

    def reset(self, num_players: int, seed: int | None = None) -> None:
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={}, player_prompt_function=lambda player_id, game_state: "Say [done].")

    def step(self, action: str) -> tuple[bool, dict[str, Any]]:
        if "[done]" in action:
            self.state.set_outcome(reward=1.0, reason="done")
        else:
            self.state.set_invalid_move(reason="say [done]")
        return self.state.step()


for game_id, entry, kwargs in (("AgentrlRace-v0", Race, {"list_moves": False}),
                               ("AgentrlRaceListed-v0", Race, {"list_moves": True}),
                               ("AgentrlSolo-v0", Solo, {})):
    if game_id not in ENV_REGISTRY:
        register(game_id, entry_point=entry, default_wrappers=DEFAULT_WRAPPERS, **kwargs)


def forfeit(observation: str) -> str:
    """An opponent that plays the role tag, as the old random opponent often did."""
    return "[GAME]"


def test_a_random_opponent_is_refused_for_a_game_that_lists_no_moves() -> None:
    with pytest.raises(ConfigError, match="lists its valid moves.*opponent 'self'.*'module:function'"):
        make("textarena:AgentrlRace-v0", opponent="random")
    assert make("textarena:AgentrlRace-v0").num_players == 2  # self-play is still there


def test_a_random_opponent_plays_only_the_moves_the_game_lists() -> None:
    env_config = {"opponent": "random"}
    tasks = list(make("textarena:AgentrlRaceListed-v0", **env_config).tasks("train"))[:8]
    episodes = [play("textarena:AgentrlRaceListed-v0", task, "[step]", env_config) for task in tasks]
    for task, ep in zip(tasks, episodes, strict=True):
        assert ep.error is None and ep.terminated, ep.error
        assert not ep.info["game_info"][str(1 - task["seat"])]["invalid_move"]  # every win was a race won
    results = [ep.info["success"] for ep in episodes]
    assert results == [ep.reward == 1.0 for ep in episodes]
    assert True in results  # the policy, always stepping, wins its races


def test_an_opponent_that_forfeits_fails_the_episode_instead_of_scoring_a_win() -> None:
    task = next(iter(make("textarena:AgentrlRaceListed-v0").tasks("train")))
    ep = play("textarena:AgentrlRaceListed-v0", task, "[step]",
              {"opponent": "tests.test_textarena_rules:forfeit"})
    assert ep.error_kind == "environment" and "did not earn" in ep.error and ep.reward == 0.0


def test_a_one_player_game_plays_by_name() -> None:
    env = make("textarena:AgentrlSolo-v0")
    assert env.num_players == 1
    task = next(iter(env.tasks("test")))
    ep = play("textarena:AgentrlSolo-v0", task, "[done]")
    assert ep.error is None and ep.terminated, ep.error
    assert ep.reward == 1.0 and ep.info["success"] is True
    assert make("textarena:TicTacToe-v0").num_players == 2  # a two-player game keeps two


# -- seats as roles (#36) --------------------------------------------------------------------------

class Stepping:
    """A chat client that always answers ``[step]``; it records (session, body) per call."""

    model_name = "m"

    def __init__(self) -> None:
        self.bodies: list[tuple[str | None, dict[str, Any]]] = []

    async def begin(self, session_id: str, **meta: Any) -> None:
        pass

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        self.bodies.append((session_id, body))
        return {"choices": [{"message": {"role": "assistant", "content": "[step]"}, "finish_reason": "stop"}],
                "agentrl": {"session_id": session_id, "call_index": len(self.bodies) - 1, "versions": [[0]]}}

    async def end(self, session_id: str) -> SessionSummary | None:
        return SessionSummary(session_id, [])


def play_seats(roles: dict[str, RoleBinding]) -> tuple[Any, Stepping]:
    client, game = Stepping(), "textarena:AgentrlRaceListed-v0"
    task = next(iter(make(game, opponent="roles").tasks("train")))
    ep = asyncio.run(run_episode(client, game, task, group_id="g", env_config={"opponent": "roles"},
                                 roles=roles, limits=EpisodeLimits(max_turns=12)))
    return ep, client


def test_each_seat_plays_through_its_roles_agent_and_gets_its_seats_reward() -> None:
    assert make("textarena:AgentrlRaceListed-v0", opponent="roles").roles == ("player_0", "player_1")
    assert make("textarena:AgentrlRaceListed-v0").roles == ()  # self-play stays one agent
    ep, client = play_seats({"player_1": RoleBinding(frozen=True)})
    assert ep.error is None and ep.terminated, ep.error
    # both step every turn: player 0 moves first and reaches square 3 first
    assert ep.info["rewards"] == {"0": 1.0, "1": -1.0} and ep.info["moves"] == 5
    assert ep.info["role_rewards"] == {"player_0": 1.0, "player_1": -1.0}
    sessions = [s for s, _ in client.bodies]
    assert sessions == [f"{ep.episode_id}.player_{i % 2}" for i in range(5)]
    assert {b.get("model") for s, b in client.bodies if s.endswith(".player_1")} == {"base"}
    assert all("model" not in b for s, b in client.bodies if s.endswith(".player_0"))
    # the trained seat won: success and the episode's reward are its side's
    assert ep.info["success"] is True and ep.reward == 1.0 and ep.info["seats"] == [0]
    graph = ep.info["graph"]["nodes"]
    assert [(n["role"], n["trained"]) for n in graph] == [("player_0", True), ("player_1", False)] * 2 + [
        ("player_0", True)]


def test_with_every_seat_trained_success_is_not_defined() -> None:
    ep, _ = play_seats({})
    assert ep.error is None and "success" not in ep.info and ep.reward == 0.0  # (1 - 1) / 2


def test_seats_as_roles_are_declared_to_the_start_time_check() -> None:
    from agentrl.serve.build import check_declared_roles
    from agentrl.serve.config import ServeConfig

    cfg = ServeConfig()
    cfg.env.name, cfg.env.config = "textarena:AgentrlRaceListed-v0", {"opponent": "roles"}
    cfg.env.roles = {"player_1": RoleBinding(endpoint="http://x/v1")}
    check_declared_roles(cfg)
    cfg.env.roles = {"player_2": RoleBinding()}
    with pytest.raises(ConfigError, match=r"its roles: \['player_0', 'player_1'\]"):
        check_declared_roles(cfg)
    cfg.env.config, cfg.env.roles = {}, {"player_1": RoleBinding()}
    with pytest.raises(ConfigError, match="not a multi-agent environment"):
        check_declared_roles(cfg)
