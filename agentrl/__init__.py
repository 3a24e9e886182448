"""agentrl: asynchronous reinforcement learning for multi-turn, tool-using language-model agents.

Importing this package is cheap: torch, vLLM and transformers load only where they are used.
"""

from agentrl.env import (
    Environment,
    MultiAgentEnv,
    Played,
    Reset,
    StepResult,
    TaskListEnv,
    ToolEnv,
    environment,
    make,
    registered,
    tool,
)
from agentrl.scoring.registry import scorer

__version__ = "0.1.0"
__all__ = [
    "Environment",
    "MultiAgentEnv",
    "Played",
    "Reset",
    "StepResult",
    "TaskListEnv",
    "ToolEnv",
    "environment",
    "make",
    "registered",
    "scorer",
    "tool",
]
