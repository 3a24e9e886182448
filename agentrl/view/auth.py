"""Who may open the view: a token once, then a cookie that is not the token.

A browser cannot send ``Authorization`` when a person opens a link, so the view accepts the token
in one of two ways and answers with a cookie:

- ``GET /view/...?token=T`` (a link to paste): right token -> ``303`` to the same address without
  ``token`` and a ``Set-Cookie``; the address the page then shows, bookmarks and sends as a
  referrer carries no token;
- ``POST /view/login`` with a form field ``token`` (the login page, for a token typed in; it never
  enters an address or the history).

The cookie is ``v1.<expiry>.<HMAC-SHA256>`` under a key made at random when the view starts: it
opens the view's pages and read-only routes only (serve's admin routes read the
``Authorization`` header, never cookies), it cannot be turned back into the token, and it lapses
after ``max_age_s`` or when the process restarts. It is ``HttpOnly`` (page scripts cannot read
it), ``SameSite=Strict`` (another site's page cannot make the browser send it), ``Path=/view``, and
``Secure`` when the request came over TLS. Scripts may send ``Authorization: Bearer T`` instead.

Invariants: tokens are compared in constant time, each of them every time; no response body,
redirect ``Location`` or log line contains a token (aiohttp's access log, if the hosting app keeps
one, has ``token=`` blanked); a view with no token refuses to be built.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable
from pathlib import Path

from aiohttp import web

from agentrl.credentials import find_secret, read_secret_file
from agentrl.web import bearer

log = logging.getLogger(__name__)

COOKIE = "agentrl_view"
PREFIX = "/view"
_TOKEN_IN_URL = re.compile(r"([?&]token=)[^&\s\"']*")
# where a login may send the browser: a path of the view, nothing that could leave it
_SAFE_NEXT = re.compile(r"^/view(/[A-Za-z0-9/_.\-]*)?(\?[A-Za-z0-9_.\-=&%+]*)?$")


class ViewAuth:
    """The tokens that open the view, and the cookie it hands out for them."""

    def __init__(self, tokens: Iterable[str], max_age_s: int = 12 * 3600) -> None:
        self._tokens = [t.encode() for t in dict.fromkeys(tokens) if t]
        if not self._tokens:
            raise ValueError("the view needs at least one token (the admin token or a view token)")
        self.max_age_s = max_age_s
        self._key = secrets.token_bytes(32)

    def token_ok(self, given: str | None) -> bool:
        if not given:
            return False
        g = given.encode()
        ok = False
        for t in self._tokens:  # no early exit: the time taken does not say which token matched
            ok |= hmac.compare_digest(g, t)
        return ok

    def _sign(self, expiry: int) -> str:
        return hmac.new(self._key, f"v1.{expiry}".encode(), hashlib.sha256).hexdigest()

    def cookie(self, now: float | None = None) -> str:
        expiry = int((now if now is not None else time.time()) + self.max_age_s)
        return f"v1.{expiry}.{self._sign(expiry)}"

    def cookie_ok(self, value: str | None, now: float | None = None) -> bool:
        parts = (value or "").split(".")
        if len(parts) != 3 or parts[0] != "v1" or not parts[1].isdigit():
            return False
        expiry = int(parts[1])
        if not hmac.compare_digest(parts[2].encode(), self._sign(expiry).encode()):
            return False
        return expiry > (now if now is not None else time.time())

    def authorized(self, request: web.Request) -> bool:
        """The view's cookie, or a token in ``Authorization: Bearer``."""
        return self.cookie_ok(request.cookies.get(COOKIE)) or self.token_ok(bearer(request))

    def set_cookie(self, response: web.StreamResponse, request: web.Request) -> None:
        response.set_cookie(COOKIE, self.cookie(), max_age=self.max_age_s, path=PREFIX, httponly=True,
                            samesite="Strict", secure=request.secure)


def safe_next(target: str | None) -> str:
    """``target`` when it is an address inside the view, else the view's front page."""
    if target and _SAFE_NEXT.match(target) and "//" not in target and ".." not in target:
        return target
    return PREFIX + "/"


def without_token(request: web.Request) -> str:
    """The request's path and query with ``token`` taken out."""
    query = [(k, v) for k, v in request.query.items() if k != "token"]
    url = request.rel_url.with_query(query) if query else request.rel_url.with_query(None)
    return str(url)


class RedactTokens(logging.Filter):
    """Blanks ``token=...`` in access-log lines: the app the view is mounted on may log requests, and
    the first request of a browser carries the token in its query."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "token=" in record.msg:
            record.msg = _TOKEN_IN_URL.sub(r"\1<redacted>", record.msg)
        if record.args and any(
            "token=" in str(a) for a in (record.args if isinstance(record.args, tuple) else ())
        ):
            record.args = tuple(_TOKEN_IN_URL.sub(r"\1<redacted>", a) if isinstance(a, str) else a
                                for a in record.args)  # type: ignore[union-attr]
        return True


def redact_access_log() -> None:
    """Install :class:`RedactTokens` on aiohttp's access logger, once."""
    access = logging.getLogger("aiohttp.access")
    if not any(isinstance(f, RedactTokens) for f in access.filters):
        access.addFilter(RedactTokens())


def view_token_source(run_dir: Path, token_file: str = "") -> str:
    """Where :func:`view_token` takes the token from, for a message (a file or a variable's name)."""
    if token_file:
        return token_file
    if os.environ.get("AGENTRL_VIEW_TOKEN", "").strip():
        return "$AGENTRL_VIEW_TOKEN"
    return os.environ.get("AGENTRL_VIEW_TOKEN_FILE") or str(run_dir / "view_token")


def view_token(run_dir: Path, token_file: str = "") -> str:
    """The run's read-only view token: ``token_file``, ``$AGENTRL_VIEW_TOKEN``, ``$AGENTRL_VIEW_TOKEN_FILE``,
    ``RUN_DIR/view_token``, or a new one written there (mode 0600). "" when none can be had (a run
    directory we may not write)."""
    path = run_dir / "view_token"
    found = find_secret("view token", "AGENTRL_VIEW_TOKEN", token_file, path)
    if found:
        return found
    token = secrets.token_urlsafe(24)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process wrote it first: use theirs
        return read_secret_file(path, "view token")
    except OSError as e:
        log.warning("could not write a view token to %s (%s); only the admin token opens the view", path, e)
        return ""
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token
