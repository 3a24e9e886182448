"""The FastAPI server: POST /reset, POST /step, GET /state, WS /ws (OpenEnv's create_app)."""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import GuessAction, GuessObservation
    from .number_guess_environment import NumberGuessEnvironment
except ImportError:
    from models import GuessAction, GuessObservation
    from server.number_guess_environment import NumberGuessEnvironment

app = create_app(NumberGuessEnvironment, GuessAction, GuessObservation, env_name="number_guess",
                 max_concurrent_envs=64)
