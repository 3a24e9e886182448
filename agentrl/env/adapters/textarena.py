"""TextArena games as agentrl environments: ``textarena:<game id>`` (e.g. ``textarena:TicTacToe-v0``).

The game is TextArena's own (``textarena.make`` with its default wrappers): its observations, its
move parsing and its rewards. Each seat the policy plays keeps its own chat (TextArena's standard
game prompt as the system message, then what the game shows that player: the new part of the
player's observation each turn, the move as the assistant's reply), so one player's calls extend
each other token for token and become that player's sample; the router keeps the two players'
chains apart. Both seats are the policy (``opponent="self"``, self-play) or one is a fixed opponent
(``opponent="random"``: a move picked from the moves the game lists; or ``"module:function"``, a
callable observation -> move, sync or async). With a fixed opponent the policy's seat alternates
with the task index, so it learns both sides. The number of players is the game's own: the first
of 2, 1, 3, 4, ... that its ``reset`` accepts (TextArena's registry does not record it), unless
``num_players`` says.

Invariants: every policy call's sample gets the game's reward for the player who made it
(:attr:`~agentrl.env.base.Played.sample_rewards`); the episode's reward is the mean over the
policy's seats (0 for a zero-sum self-play game: the signal is in the per-seat samples). A random
opponent plays only moves the game lists: a game whose opening lists none is refused for
``"random"`` when the environment is built, and an episode the opponent loses by an invalid move
fails as an environment error instead of handing the policy a win it did not earn. With a fixed
opponent or one player, ``info["success"]`` says whether the policy won. Game code runs in a daemon
thread, so a game that hangs is cut by the episode's wall clock.

Seats as roles (``opponent="roles"``): every seat is a role of a multi-agent episode
(:class:`~agentrl.env.roles.MultiAgentEnv`), ``player_0``, ``player_1``, ..., so the run's
``env.roles`` binds each to the default policy, a named LoRA policy, the frozen base model or an
endpoint (a seat left unbound plays on the default policy). A seat's calls go through its role's
agent (its own router session); each role's reward is its seat's (``Played.role_rewards``), the
episode's reward is the mean over the trained seats, and ``info["success"]`` (whether every trained
seat won) is set when some seats train and the others do not. Seats do not swap with the task, so
a trained seat learns that seat's side only.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import random
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import textarena
from textarena.agents.basic_agents import STANDARD_GAME_PROMPT
from textarena.envs.registration import ENV_REGISTRY

from agentrl.env.adapters import AdapterError
from agentrl.env.adapters._bounded import in_thread
from agentrl.env.base import SUCCESS_KEY, Message, Model, Played, Reset
from agentrl.env.roles import Agent, MultiAgentEnv
from agentrl.errors import ConfigError, EnvironmentFailure

log = logging.getLogger(__name__)

TEST_SEED_OFFSET = 1 << 30
PLAYER_COUNTS = (2, 1, 3, 4, 5, 6, 8)  # tried in this order when the game's count is not given
ROLES = "roles"  # the opponent setting that makes every seat a role
_MOVE = re.compile(r"\[[^\[\]\n]{1,40}\]")
# "Available Moves: '[0]', '[1]'", "Valid moves: '[2, 3]'": the moves follow the colon on that line
_LISTING = re.compile(r"\b(?:available|valid|legal|possible)\s+(?:moves|actions)\b[^:\n]*:(.*)", re.I)


def listed_moves(observation: str) -> list[str]:
    """The bracketed moves of the last line of ``observation`` that lists moves; [] when none does.

    Only the text after the listing's colon counts, so a role tag (``[GAME]``, ``[Player 0]``) or a
    move quoted in the rules is never taken for a legal move."""
    for line in reversed(observation.splitlines()):
        listing = _LISTING.search(line)
        if listing and (moves := _MOVE.findall(listing.group(1))):
            return moves
    return []


def random_move(observation: str, rng: random.Random) -> str:
    """One of the moves the observation lists (:func:`listed_moves`)."""
    moves = listed_moves(observation)
    if not moves:
        raise ConfigError(
            "opponent 'random' found no list of valid moves in the observation; use opponent 'self' "
            "(self-play) or 'module:function' (a player of your own) for this game"
        )
    return rng.choice(moves)


@functools.lru_cache(maxsize=256)
def _opening(game_id: str, make_json: str, num_players: int | None) -> tuple[int, str | None]:
    """The game's number of players and its first player's opening observation, from one reset.

    ``num_players`` None: the first of :data:`PLAYER_COUNTS` the game's reset accepts (TextArena
    checks the count in reset, with an assert or a ValueError, and records it nowhere else). A reset
    that accepts none gives (2, None): the episode's own reset then raises the game's error."""
    for n in (num_players,) if num_players else PLAYER_COUNTS:
        game = textarena.make(game_id, **json.loads(make_json))
        try:
            game.reset(num_players=n, seed=0)
        except Exception:  # the game's own check of the count, whatever it raises
            log.debug("TextArena %s refused %d players", game_id, n, exc_info=True)
            continue
        return n, str(game.get_observation()[1])
    return num_players or 2, None


def seat_role(seat: int) -> str:
    """The role that plays ``seat`` with ``opponent="roles"``."""
    return f"player_{seat}"


def _load_opponent(spec: str) -> Callable[..., Any] | None:
    if spec in ("self", "policy", "", ROLES):
        return None
    if spec == "random":
        return random_move
    module, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"opponent must be 'self', 'roles', 'random' or 'module:function', not {spec!r}")
    fn = getattr(importlib.import_module(module), attr)
    return lambda observation, rng: fn(observation)


class TextArenaEnv(MultiAgentEnv):
    """A TextArena game played by the policy, against itself or a fixed opponent, or by one role per
    seat (a multi-agent environment only with ``opponent="roles"``: otherwise it declares no roles).

    Args:
        num_players: seats at the table (default: the game's own, see the module's docstring).
        opponent: "self" (every seat is the policy), "roles" (every seat a role, bound by the run's
            ``env.roles``), "random", or "module:function".
        num_train / num_test: tasks (game seeds) per split; test seeds are disjoint from train seeds.
        system_prompt: the system message of every policy seat (default: TextArena's standard game prompt).
        make_kwargs: keyword arguments for ``textarena.make``.
    """

    game_id: str = ""  # set on the class registered for each name

    def __init__(
        self,
        num_players: int | None = None,
        opponent: str = "self",
        num_train: int = 10_000,
        num_test: int = 100,
        system_prompt: str = STANDARD_GAME_PROMPT,
        make_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.opponent_spec = opponent
        self.opponent = _load_opponent(opponent)
        self.num_train, self.num_test = num_train, num_test
        self.system_prompt = system_prompt
        self.make_kwargs = dict(make_kwargs or {})
        self.num_players, opening = _opening(
            self.game_id, json.dumps(self.make_kwargs, sort_keys=True), num_players
        )
        unlisted = opening is not None and not listed_moves(opening)  # None: a reset that raises
        if opponent == "random" and self.num_players > 1 and unlisted:
            # a game that lists moves lists them from its first turn: without a list, a random move
            # is most often invalid, and the policy would win by the opponent's forfeit
            raise ConfigError(
                f"opponent 'random' needs a game that lists its valid moves, and TextArena's "
                f"{self.game_id} shows none; use opponent 'self' (self-play) or 'module:function' "
                "(a player of your own, observation -> move)"
            )
        self.roles = tuple(map(seat_role, range(self.num_players))) if opponent == ROLES else ()
        self.game: Any = None
        self.task: dict[str, Any] = {}

    @classmethod
    def declared_roles(cls, config: Mapping[str, Any]) -> tuple[str, ...]:
        if config.get("opponent") != ROLES:
            return ()
        make_json = json.dumps(dict(config.get("make_kwargs") or {}), sort_keys=True)
        return tuple(map(seat_role, range(_opening(cls.game_id, make_json, config.get("num_players"))[0])))

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
        if self.roles:  # seats as roles: MultiAgentEnv.play hands play_roles one agent per seat
            return await super().play(task, model)
        seats = self.policy_seats(task)
        rewards, owners, info = await self._game(task, {s: model for s in seats})
        mine = [rewards.get(s, 0.0) for s in sorted(seats)]
        info["seats"] = sorted(seats)
        if self.opponent is not None or self.num_players == 1:  # in self-play the policy wins every game
            info[SUCCESS_KEY] = all(rewards.get(s, 0.0) >= 1.0 for s in seats)  # TextArena's win is 1
        return Played(
            reward=sum(mine) / len(mine), sample_rewards=[rewards.get(p, 0.0) for p in owners], info=info
        )

    async def play_roles(self, task: dict[str, Any], agents: Mapping[str, Agent]) -> Played:
        players = {s: agents[seat_role(s)] for s in range(self.num_players)}
        rewards, _owners, info = await self._game(task, players)
        # an agent bound to the frozen base or an endpoint says so; a seat that trains is "the policy's"
        trained = [s for s, agent in players.items() if getattr(agent, "trained", True)]
        scored = [rewards.get(s, 0.0) for s in trained or players]
        info["seats"] = trained
        if trained and (len(trained) < self.num_players or self.num_players == 1):
            info[SUCCESS_KEY] = all(rewards.get(s, 0.0) >= 1.0 for s in trained)
        return Played(reward=sum(scored) / len(scored), info=info,
                      role_rewards={seat_role(s): rewards.get(s, 0.0) for s in players})

    async def _game(self, task: dict[str, Any],
                    players: Mapping[int, Model]) -> tuple[dict[int, float], list[int], dict[str, Any]]:
        """Play the game ``reset`` set up: a seat in ``players`` moves by its model's reply in the
        seat's own chat, any other seat by the fixed opponent. Returns each seat's reward, the seat
        behind each model call (in call order) and the episode's info."""
        rng = random.Random(int(task["seed"]))
        chats: dict[int, list[Message]] = {
            s: [{"role": "system", "content": self.system_prompt}] for s in players
        }
        seen: dict[int, str] = {}
        owners: list[int] = []  # the seat behind each model call, in call order
        moves, done = 0, False
        while not done:
            player, observation = self.game.get_observation()
            observation = str(observation)
            if player in players:
                # The wrapped observation repeats the whole game so far: the chat gets what is new.
                prev = seen.get(player, "")
                new = observation[len(prev):] if prev and observation.startswith(prev) else observation
                seen[player] = observation
                chats[player].append({"role": "user", "content": new.strip() or observation})
                reply = await players[player].chat({"messages": list(chats[player])})
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
        forfeits = [p for p, g in (game_info or {}).items() if p not in players and g.get("invalid_move")]
        if forfeits:
            raise EnvironmentFailure(
                f"the {self.opponent_spec} opponent (player {forfeits[0]}) lost {self.game_id} by an invalid "
                "move: a win the policy did not earn, so the episode is not scored"
            )
        return rewards, owners, {"game": self.game_id, "moves": moves,
                                 "rewards": {str(k): v for k, v in rewards.items()},
                                 "game_info": _jsonable(game_info)}


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
                {"game_id": rest, "__doc__": f"TextArena game {rest} (self-play, opponent or roles)",
                 "__module__": __name__})


def offered() -> list[tuple[str, str]]:
    return [(f"textarena:{n}", "TextArena game") for n in sorted(ENV_REGISTRY)]
