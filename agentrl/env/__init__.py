"""Environments: the API users write against, the registry, tools, and task sources.

Importing this package stays cheap: gymnasium loads only with ``agentrl.env.gym``, Hugging Face
``datasets`` only when a dataset source is read.
"""

from agentrl.env.base import Environment, Message, Played, Reset, StepResult, TaskListEnv, ToolEnv
from agentrl.env.registry import (
    DuplicateEnvironmentError,
    UnknownEnvironmentError,
    UserCodeError,
    environment,
    import_user_code,
    lookup,
    make,
    registered,
    unregister,
)
from agentrl.env.roles import Agent, MultiAgentEnv
from agentrl.env.tasks import TaskSource, load_tasks
from agentrl.env.tools import ToolCallError, parse_tool_calls, tool, tool_schema

__all__ = [
    "Agent", "DuplicateEnvironmentError", "Environment", "Message", "MultiAgentEnv", "Played", "Reset",
    "StepResult", "TaskListEnv", "TaskSource",
    "ToolCallError", "ToolEnv", "UnknownEnvironmentError", "UserCodeError", "environment", "import_user_code",
    "load_tasks", "lookup", "make", "parse_tool_calls", "registered", "tool", "tool_schema", "unregister",
]
