"""Build the sandbox images defined under the repository's top-level `sandbox/` folder.

`sandbox/base/build.sh TAG` makes the base image without any registry (debootstrap + docker import);
every other `sandbox/<name>/Dockerfile` is a task image built FROM it as `agentrl/<name>:latest`, and
every other `sandbox/<name>/build.sh` makes `agentrl/<name>:latest` its own way (e.g. `swe`: the base
recipe with more Debian packages, which a Dockerfile could not install without a network).

:func:`build_context_image` builds any other folder the same way (an ecosystem's task, e.g. a Harbor
task's `environment/`): offline, with its Dockerfile's `FROM` lines pointed at the local base image
(no registry is reachable) and optional lines appended.

Invariant: an image is rebuilt only when its definition changed: task images carry the hash of
their build context (and Dockerfile text) and base image id as the label `agentrl.context`; the
base script is itself idempotent.
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from agentrl.sandbox.types import SandboxError

log = logging.getLogger(__name__)

BASE_TAG = "agentrl/base:bookworm"
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "sandbox"


def context_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _image_label(tag: str, label: str) -> str | None:
    r = subprocess.run(["docker", "image", "inspect", "-f", f'{{{{index .Config.Labels "{label}"}}}}', tag],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def _run(argv: list[str], progress: Callable[[str], None], stdin: str | None = None) -> None:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.PIPE if stdin is not None else None)
    assert proc.stdout is not None
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-20:]
        progress(line)
    if proc.wait() != 0:
        raise SandboxError(f"{' '.join(argv[:3])} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def build_images(progress: Callable[[str], None] | None = None, root: Path | str | None = None,
                 force: bool = False) -> list[str]:
    """Build the base image and every task image under `root` (default: the repo's `sandbox/`),
    skipping those that are up to date. Returns the tags built or found up to date."""
    say = progress or (lambda line: log.info("%s", line))
    root = Path(root) if root else DEFAULT_ROOT
    tags = []
    base_script = root / "base" / "build.sh"
    if base_script.exists():
        _run(["bash", str(base_script), BASE_TAG], say)
        tags.append(BASE_TAG)
    for script in sorted(root.glob("*/build.sh")):
        if script != base_script and not (script.parent / "Dockerfile").exists():
            tag = f"agentrl/{script.parent.name}:latest"
            _run(["bash", str(script), tag], say)  # idempotent, like the base script
            tags.append(tag)
    for dockerfile in sorted(root.glob("*/Dockerfile")):
        folder = dockerfile.parent
        tag = f"agentrl/{folder.name}:latest"
        # The base image's id is part of the hash: a rebuilt base rebuilds the task images.
        base_id = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", BASE_TAG],
                                 capture_output=True, text=True).stdout.strip()
        digest = hashlib.sha256(f"{context_hash(folder)}:{base_id}".encode()).hexdigest()[:16]
        if not force and _image_label(tag, "agentrl.context") == digest:
            say(f"[sandbox] {tag} is up to date")
        else:
            say(f"[sandbox] building {tag}")
            _run(["docker", "build", "--network", "none", "--label", f"agentrl.context={digest}",
                  "-t", tag, str(folder)], lambda line: say(f"[sandbox]   {line}"))
            say(f"[sandbox] built {tag}")
        tags.append(tag)
    return tags


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)


def rewrite_from(dockerfile: str, base: str = BASE_TAG) -> str:
    """``dockerfile`` with every ``FROM`` that names an image (not an earlier stage) set to ``base``:
    registry images cannot be pulled here, the local base image stands in for them."""
    stages: set[str] = set()
    out = []
    for line in dockerfile.splitlines():
        m = _FROM.match(line)
        if m:
            head, flags, image, rest = m.groups()
            stage = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            if image.lower() not in stages:
                line = f"{head}{flags}{base}{rest}"
            if stage:
                stages.add(stage.group(1).lower())
        out.append(line)
    return "\n".join(out) + "\n"


def build_context_image(context: Path | str, tag: str, dockerfile: str, *, base: str = BASE_TAG,
                        progress: Callable[[str], None] | None = None, force: bool = False) -> str:
    """Build ``context`` with ``dockerfile`` (text; its FROM lines pointed at ``base``) as ``tag``,
    without network; skipped when the context, the Dockerfile and the base image are unchanged."""
    say = progress or (lambda line: log.info("%s", line))
    text = rewrite_from(dockerfile, base)
    base_id = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", base],
                             capture_output=True, text=True).stdout.strip()
    if not base_id:
        raise SandboxError(f"the base image {base} is not built: run `agentrl sandbox build` first")
    folder = Path(context)
    digest = hashlib.sha256(f"{context_hash(folder)}:{text}:{base_id}".encode()).hexdigest()[:16]
    if not force and _image_label(tag, "agentrl.context") == digest:
        say(f"[sandbox] {tag} is up to date")
        return tag
    say(f"[sandbox] building {tag} from {folder}")
    _run(["docker", "build", "--network", "none", "--label", f"agentrl.context={digest}", "-t", tag,
          "-f", "-", str(folder)], lambda line: say(f"[sandbox]   {line}"), stdin=text)
    return tag
