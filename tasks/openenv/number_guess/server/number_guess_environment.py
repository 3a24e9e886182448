"""The game: a secret number from 1 to 20, higher/lower hints, reward 1 for a hit within six guesses."""

import random
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import GuessAction, GuessObservation
except ImportError:
    from models import GuessAction, GuessObservation

MAX_GUESSES = 6


class NumberGuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True  # each WebSocket session gets its own instance

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, 20)
        return GuessObservation(message="I picked a number from 1 to 20. Guess it.",
                                guesses_left=MAX_GUESSES, done=False, reward=0.0)

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        if action.guess == self._secret:
            return GuessObservation(
                message=f"{action.guess} is right!", guesses_left=left, done=True, reward=1.0
            )
        hint = "higher" if action.guess < self._secret else "lower"
        return GuessObservation(message=f"{action.guess} is wrong; the number is {hint}.", guesses_left=left,
                                done=left <= 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
