"""Guess a number between 1 and 20 in six tries: an OpenEnv environment (server, typed models, client)."""

from .client import NumberGuessEnv
from .models import GuessAction, GuessObservation

__all__ = ["GuessAction", "GuessObservation", "NumberGuessEnv"]
