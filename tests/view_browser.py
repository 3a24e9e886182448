"""Test helper: Debian's Chromium, driven by the ``playwright`` Python package (which talks to an
installed browser and downloads none), for the web view's tests and its documentation screenshots.

:func:`chromium` starts one headless browser with the flags this machine needs (no sandbox as
root; no background networking, component updates or sync, which would try the closed network);
:class:`Console` collects what a page logs as an error (console errors, uncaught exceptions,
failed requests), so a test can say "no console errors".

``python -m tests.view_browser BASE_URL RUN_DIR OUT.png [EPISODE_ID]`` takes the README's screenshots
of a view (serve's or ``agentrl view``'s; its run page, or an episode's page) with the token from
RUN_DIR/view_token.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or (
        ("/usr/bin/chromium") if os.path.exists("/usr/bin/chromium") else None
    )


def need_browser() -> str:
    """The Chromium binary; a test without one is skipped on a developer's machine and fails in CI
    (where scripts/setup.sh installs it), so a green CI cannot hide a missing browser."""
    path = chromium_path()
    try:
        import playwright  # noqa: F401
    except ImportError:
        path = None
    if path is None:
        msg = "needs Debian's chromium and the playwright package (bash scripts/setup.sh installs both)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@contextmanager
def chromium(path: str | None = None) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # a generous bound: on a loaded 2-core machine (load average 45 seen) a start took over 3 minutes
        browser = p.chromium.launch(executable_path=path or need_browser(), args=FLAGS, headless=True,
                                    timeout=600_000)
        try:
            yield browser
        finally:
            browser.close()


class Console:
    """Errors a page reported: console.error lines, uncaught exceptions, failed requests."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.recording = True
        page.on("console", lambda m: self._add(f"console: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self._add(f"pageerror: {e}"))
        page.on("requestfailed", lambda r: self._add(f"requestfailed: {r.url} {r.failure}"))

    def _add(self, error: str) -> None:
        if self.recording:
            self.errors.append(error)

    def stop(self) -> None:
        """Record nothing more: before the test closes the page, whose refresh in flight then fails."""
        self.recording = False


def wait_for(page: Any, js: str, timeout_s: float = 240.0) -> Any:
    """Poll a JS expression in the page until it is truthy (bounded); returns its value. (Passed as a
    function: the view's Content-Security-Policy rightly forbids evaluating strings. An expression
    that throws fails the wait at once, so it must be safe before the page has drawn anything.)

    The bound is generous: CI runs these tests niced beside vLLM engines, and an episode page's first
    request loads the tokenizer, which took over 60 s there once. A wait that runs out says what the
    page's status line showed (an error the page caught, or the last progress it reported)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        handle = page.wait_for_function(f"() => ({js})", timeout=timeout_s * 1000, polling=200)
    except PlaywrightTimeout as e:
        try:
            status = page.evaluate("(document.getElementById('status') || {}).textContent || ''")
        except Exception as err:  # the page may be gone: say that instead
            status = f"(unreadable: {err})"
        raise AssertionError(f"{js!r} not true after {timeout_s:.0f} s at {page.url}; "
                             f"the page's status line: {status!r}") from e
    return handle.json_value()  # the value that met the wait, not a later one


@contextmanager
def agentrl_view(run_dir: Path, model: str = "", timeout_s: float = 120.0) -> Iterator[str]:
    """``agentrl view RUN_DIR --port 0`` as a child process; yields its base URL (http://127.0.0.1:P)."""
    cmd = [sys.executable, "-m", "agentrl.cli", "view", str(run_dir), "--port", "0"] + (
        ["--model", model] if model else []
    )
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AGENTRL_VIEW_TOKEN", "AGENTRL_ADMIN_TOKEN"))
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            try:
                seen.append(lines.get(timeout=timeout_s))
            except queue.Empty:
                raise AssertionError("agentrl view did not say where it listens: " + "".join(seen)) from None
            m = re.search(r"agentrl view: .* at (http://127\.0\.0\.1:\d+)/view/\s", seen[-1])
            if m:
                break
        yield m.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


POINTS = "[...document.querySelectorAll('[data-points]')].reduce((n, e) => n + Number(e.dataset.points), 0)"


def shoot(base: str, run_dir: Path, out: Path, episode: str | None = None, sample_only: bool = False) -> Path:
    """A screenshot of a view's run page, or of one episode's page (hovering its first trained token),
    or of only its first sample's tokens (hovering the last trained one)."""
    token = (run_dir / "view_token").read_text().strip()
    out.parent.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
        console = Console(page)
        page.goto(f"{base}/view/?token={token}")
        wait_for(page, POINTS + " > 0")
        if episode:
            page.goto(f"{base}/view/episode/{episode}")
            wait_for(page, "document.body.dataset.ready === '1'")
            (page.locator("#sample-0 .tok.t").last if sample_only else page.locator(".tok.t").first).hover()
        page.wait_for_timeout(500)
        if sample_only:
            # the hover read-out above the tokens, where the shot of the card can show it
            page.evaluate("() => { const t = document.getElementById('tooltip'); t.style.position = 'static';"
                          " document.querySelector('#sample-0 .tokens').before(t); }")
            page.locator("#sample-0").screenshot(path=str(out))
        else:
            page.screenshot(path=str(out), full_page=True)
        if console.errors:
            raise AssertionError(f"console errors: {console.errors}")
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    print(shoot(args[0].rstrip("/"), Path(args[1]), Path(args[2]), args[3] if len(args) > 3 else None,
                sample_only="--sample" in args[4:]))
