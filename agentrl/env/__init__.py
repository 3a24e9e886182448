"""Environments: the API users write against, the registry, and tool schemas."""

from agentrl.env.base import Environment, Message, Reset, StepResult, ToolEnv
from agentrl.env.registry import UnknownEnvironmentError, environment, lookup, make, registered
from agentrl.env.tools import ToolCallError, tool, tool_schema

__all__ = [
    "Environment", "Message", "Reset", "StepResult", "ToolEnv", "ToolCallError",
    "UnknownEnvironmentError", "environment", "lookup", "make", "registered", "tool", "tool_schema",
]
