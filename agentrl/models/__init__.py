"""Model folders: the built-in tiny model and where models are cached."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Where agentrl caches models and other build products (``$AGENTRL_HOME``)."""
    return Path(os.environ.get("AGENTRL_HOME", Path.home() / ".cache" / "agentrl"))


def resolve_model(name: str) -> str:
    """Turn a model name from config into something transformers/vLLM load.

    ``"tiny"`` builds (once) and returns the project's tiny model; a local folder is returned as is;
    anything else is passed through as a hub name.
    """
    if name == "tiny":
        from agentrl.models.tiny import build_tiny_model

        return str(build_tiny_model(home() / "models" / "tiny"))
    return name
