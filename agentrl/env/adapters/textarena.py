"""TextArena games as agentrl environments: ``textarena:<game id>`` (e.g. ``textarena:TicTacToe-v0``).

The game is TextArena's own (``textarena.make`` with its default wrappers): its observations, its
move parsing and its rewards. Each seat the policy plays keeps its own chat (TextArena's standard
game prompt as the system message, then what the game shows that player: the new part of the
player's observation each turn, the move as the assistant's reply), so one player's calls extend
each other token for token and become that player's sample; the router keeps the two players'
chains apart. Both seats are the policy (``opponent="self"``, self-play) or one is a fixed opponent
(``opponent="random"``: a move picked from the moves the game lists; or ``"module:function"``, a
callable observation -> move, sync or async). With a fixed opponent the policy's seat alternates
with the task index, so it learns both sides.

Invariants: every policy call's sample gets the game's reward for the player who made it
(:attr:`~agentrl.env.base.Played.sample_rewards`); the episode's reward is the mean over the
policy's seats (0 for a zero-sum self-play game: the signal is in the per-seat samples). Game code
runs in a daemon thread, so a game that hangs is cut by the episode's wall clock.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import textarena
from textarena.agents.basic_agents import STANDARD_GAME_PROMPT
from textarena.envs.registration import ENV_REGISTRY

from agentrl.env.adapters import AdapterError
from agentrl.env.adapters._bounded import in_thread
from agentrl.env.base import Message, Model, Played, PlayingEnv, Reset

log = logging.getLogger(__name__)

TEST_SEED_OFFSET = 1 << 30
_MOVE = re.compile(r"\[[^\[\]\n]{1,40}\]")


def random_move(observation: str, rng: random.Random) -> str:
    """A move from the last line of ``observation`` that lists bracketed moves (``'[4]', '[5]'``)."""
    for line in reversed(observation.splitlines()):
        moves = _MOVE.findall(line)
        if moves and any(w in line.lower() for w in ("available", "valid", "legal", "possible", "moves")):
            return rng.choice(moves)
    moves = _MOVE.findall(observation)
    return rng.choice(moves) if moves else "[0]"


def _load_opponent(spec: str) -> Callable[..., Any] | None:
    if spec in ("self", "policy", ""):
        return None
    if spec == "random":
        return random_move
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"opponent must be 'self', 'random' or 'module:function', not {spec!r}")
    fn = getattr(importlib.import_module(module), attr)
    return lambda observation, rng: fn(observation)


class TextArenaEnv(PlayingEnv):
    """A TextArena game played by the policy, against itself or a fixed opponent.

    Args:
        num_players: seats at the table (default 2).
        opponent: "self" (every seat is the policy), "random", or "module:function".
        num_train / num_test: tasks (game seeds) per split; test seeds are disjoint from train seeds.
        system_prompt: the system message of every policy seat (default: TextArena's standard game prompt).
        make_kwargs: keyword arguments for ``textarena.make``.
    """

    game_id: str = ""  # set on the class registered for each name

    def __init__(
        self,
        num_players: int = 2,
        opponent: str = "self",
        num_train: int = 10_000,
        num_test: int = 100,
        system_prompt: str = STANDARD_GAME_PROMPT,
        make_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.num_players, self.opponent_spec = num_players, opponent
        self.opponent = _load_opponent(opponent)
        self.num_train, self.num_test = num_train, num_test
        self.system_prompt = system_prompt
        self.make_kwargs = dict(make_kwargs or {})
        self.game: Any = None
        self.task: dict[str, Any] = {}

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        offset, n = (0, self.num_train) if split == "train" else (TEST_SEED_OFFSET, self.num_test)
        for i in range(n):
            yield {"id": f"{split}-{i}", "seed": offset + i, "seat": i % self.num_players}

    def policy_seats(self, task: dict[str, Any]) -> set[int]:
        return (
            set(range(self.num_players))
            if self.opponent is None
            else {int(task.get("seat", 0)) % self.num_players}
        )

    async def reset(self, task: dict[str, Any]) -> Reset:
        self.task = task
        self.game = textarena.make(self.game_id, **self.make_kwargs)
        await in_thread(self.game.reset, num_players=self.num_players, seed=int(task["seed"]))
        _, observation = self.game.get_observation()
        return Reset(messages=[{"role": "system", "content": self.system_prompt},
                               {"role": "user", "content": str(observation)}])

    async def play(self, task: dict[str, Any], model: Model) -> Played:
        seats = self.policy_seats(task)
        rng = random.Random(int(task["seed"]))
        chats: dict[int, list[Message]] = {
            s: [{"role": "system", "content": self.system_prompt}] for s in seats
        }
        seen: dict[int, str] = {}
        owners: list[int] = []  # the seat behind each policy call, in call order
        moves, done = 0, False
        while not done:
            player, observation = self.game.get_observation()
            observation = str(observation)
            if player in seats:
                # The wrapped observation repeats the whole game so far: the chat gets what is new.
                prev = seen.get(player, "")
                new = observation[len(prev):] if prev and observation.startswith(prev) else observation
                seen[player] = observation
                chats[player].append({"role": "user", "content": new.strip() or observation})
                reply = await model.chat({"messages": list(chats[player])})
                owners.append(player)
                message = reply["choices"][0]["message"]
                action = str(message.get("content") or "")
                chats[player].append({"role": "assistant", "content": action})
            else:
                action = self.opponent(observation, rng)
                if inspect.isawaitable(action):
                    action = await action
            done, _info = await in_thread(self.game.step, str(action))
            moves += 1
        rewards, game_info = await in_thread(self.game.close)
        rewards = {int(k): float(v) for k, v in (rewards or {}).items()}
        mine = [rewards.get(s, 0.0) for s in sorted(seats)]
        info = {"game": self.game_id, "moves": moves, "rewards": {str(k): v for k, v in rewards.items()},
                "seats": sorted(seats), "game_info": _jsonable(game_info)}
        return Played(
            reward=sum(mine) / len(mine), sample_rewards=[rewards.get(p, 0.0) for p in owners], info=info
        )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def environment_class(rest: str) -> type[TextArenaEnv]:
    if rest not in ENV_REGISTRY:
        close = [n for n in sorted(ENV_REGISTRY) if rest.lower().split("-")[0] in n.lower()][:8]
        raise AdapterError(
            f"TextArena has no game {rest!r}"
            + (f" (close: {', '.join(close)})" if close else "")
            + f"; `agentrl envs list` shows its {len(ENV_REGISTRY)} game ids"
        )
    return type(f"TextArena_{re.sub(r'[^0-9A-Za-z_]', '_', rest)}", (TextArenaEnv,),
                {"game_id": rest, "__doc__": f"TextArena game {rest} (self-play or a fixed opponent)",
                 "__module__": __name__})


def offered() -> list[tuple[str, str]]:
    return [(f"textarena:{n}", "TextArena game") for n in sorted(ENV_REGISTRY)]
