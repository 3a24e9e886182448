"""Typed action and observation of the number-guessing environment."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """One guess."""

    guess: int = Field(..., description="Your guess, an integer from 1 to 20")


class GuessObservation(Observation):
    """What the player sees after a guess (or at the start)."""

    message: str = Field(default="", description="The game's answer to the last guess")
    guesses_left: int = Field(default=6, description="Guesses left")
