"""Secrets: serve's admin token and client API keys, from files and environment variables only.

A value given on a command line is visible to every user of the machine in the process list, so
configuration refuses secrets as ``--a.b=value`` settings (:func:`check_override`) and the commands
read them, in this order, from:

- the config file's own value (``admin_token`` / ``router.api_keys``: a file on disk, like a key file);
- the ``*_file`` setting (``admin_token_file``, ``router.api_keys_file``: one key per line);
- ``$AGENTRL_ADMIN_TOKEN``, then the file named by ``$AGENTRL_ADMIN_TOKEN_FILE``
  (``$AGENTRL_API_KEYS`` comma-separated / ``$AGENTRL_API_KEYS_FILE`` for client keys);
- ``RUN_DIR/admin_token`` (serve writes it, mode 0600, when it generated the token).

Only the standard library is used: the CLI imports this before anything heavy.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from agentrl.errors import AgentrlError

log = logging.getLogger(__name__)

SECRET_KEYS = frozenset({"admin_token", "api_keys", "api_key"})  # last part of a setting's name


class SecretError(AgentrlError, ValueError):
    """A secret was given where anyone could read it, or its file cannot be read."""


def check_override(key: str) -> None:
    """Refuse ``--...admin_token=...`` style settings: say which file/variable to use instead."""
    last = key.rsplit(".", 1)[-1]
    if last not in SECRET_KEYS:
        return
    if last == "admin_token":
        hint = (f"put it in a file and pass --{key}_file=FILE (mode 0600), or set $AGENTRL_ADMIN_TOKEN "
                "or $AGENTRL_ADMIN_TOKEN_FILE")
    else:
        hint = (f"put the keys in a file, one a line, and pass --{key.removesuffix('s')}s_file=FILE, or set "
                "$AGENTRL_API_KEYS (comma-separated) or $AGENTRL_API_KEYS_FILE")
    raise SecretError(f"--{key} is a secret and may not be given on the command line, where the process "
                      f"list shows it to every user; {hint}")


def read_secret_file(path: str | Path, what: str = "token") -> str:
    """The stripped contents of a secret file; warns when others can read it."""
    p = Path(path).expanduser()
    try:
        text = p.read_text().strip()
    except OSError as e:
        raise SecretError(f"cannot read the {what} file {p}: {e.strerror or e}") from None
    if not text:
        raise SecretError(f"the {what} file {p} is empty")
    try:
        if p.stat().st_mode & 0o077:
            log.warning("%s file %s is readable by other users; chmod 600 it", what, p)
    except OSError:
        pass
    return text


def find_secret(what: str, env: str, token_file: str = "", path: Path | None = None) -> str:
    """A secret from ``token_file``, ``$<env>``, the file ``$<env>_FILE`` names, or ``path`` when it
    exists, in that order; "" if none."""
    if token_file:
        return read_secret_file(token_file, what)
    if os.environ.get(env, "").strip():
        return os.environ[env].strip()
    if os.environ.get(f"{env}_FILE"):
        return read_secret_file(os.environ[f"{env}_FILE"], what)
    if path is not None and path.is_file():
        return read_secret_file(path, what)
    return ""


def find_admin_token(cfg_token: str = "", token_file: str = "", run_dir: str | Path | None = None) -> str:
    """The admin token from config, ``token_file``, the environment or ``run_dir/admin_token``; "" if none."""
    return cfg_token or find_secret("admin token", "AGENTRL_ADMIN_TOKEN", token_file,
                                    Path(run_dir) / "admin_token" if run_dir is not None else None)


def settle_admin_token(cfg_token: str, token_file: str, run_dir: Path) -> str:
    """Serve's admin token (found, or generated), written to ``run_dir/admin_token`` with mode 0600."""
    token = find_admin_token(cfg_token, token_file, run_dir) or secrets.token_urlsafe(24)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "admin_token"
    try:
        held = path.read_text().strip() if path.is_file() else None
    except OSError:
        held = None
    if held != token:  # a new file whole, or the old one stays (a full disk must not empty it)
        tmp = path.with_name(f".admin_token.{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    path.chmod(0o600)  # an older file may have had wider permissions
    return token


def find_api_keys(cfg_keys: list[str] | None = None, keys_file: str = "") -> list[str]:
    """Client API keys from config, ``keys_file`` (one a line, ``#`` comments), or the environment."""
    keys = list(cfg_keys or [])
    if keys_file:
        keys += _key_lines(read_secret_file(keys_file, "API keys"))
    if os.environ.get("AGENTRL_API_KEYS"):
        keys += [k.strip() for k in os.environ["AGENTRL_API_KEYS"].split(",") if k.strip()]
    if os.environ.get("AGENTRL_API_KEYS_FILE"):
        keys += _key_lines(read_secret_file(os.environ["AGENTRL_API_KEYS_FILE"], "API keys"))
    return list(dict.fromkeys(keys))


def find_client_key(
    key_file: str = "", env_names: tuple[str, ...] = ("AGENTRL_API_KEY", "OPENAI_API_KEY")
) -> str:
    """One client's API key (for ``agentrl eval``): ``key_file``, then the first set variable; "" if none."""
    if key_file:
        return read_secret_file(key_file, "API key")
    for name in env_names:
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    return ""


def _key_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
