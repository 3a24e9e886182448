"""The deploy files parse, and their images, ports and commands agree with the CLI and the config.

Every ``agentrl ...`` command found in a Dockerfile, compose file, Kubernetes manifest or SLURM
script is parsed with ``agentrl.cli.parser()``, and its config file plus ``--a.b=value`` settings
are loaded with ``agentrl.config.load`` (image paths under /opt/agentrl map to this repository).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from agentrl import config as C
from agentrl.cli import parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
IMAGE_ROOT = "/opt/agentrl/"  # WORKDIR of the images: the repository's files live under it
YAMLS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))
DOCKERFILES = sorted(DEPLOY.rglob("Dockerfile*"))
DOCKERFILE_INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "EXPOSE", "VOLUME",
                           "ENTRYPOINT", "CMD", "LABEL", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "ONBUILD"}
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")", "\n"}
CONFIG_CLASSES = {"serve": C.ServeConfig, "learn": C.LearnConfig, "run": C.RunConfig}


# -- helpers ---------------------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments and blank lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word, rest.strip()))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return out


@dataclass
class Command:
    where: str
    argv: list[str]  # starting at the subcommand (after "agentrl" or "-m agentrl.cli")


def commands_in_tokens(tokens: list[str], where: str) -> list[Command]:
    """Every agentrl invocation in a token stream: after `agentrl` or `-m agentrl.cli`, up to a shell
    separator."""
    found = []
    for i, tok in enumerate(tokens):
        start = None
        if Path(tok).name == "agentrl" and (i == 0 or tokens[i - 1] not in ("-m",)):
            start = i + 1
        elif tok == "agentrl.cli" and i > 0 and tokens[i - 1] == "-m":
            start = i + 1
        if start is None:
            continue
        end = start
        while end < len(tokens) and tokens[end] not in SHELL_SEPARATORS:
            end += 1
        found.append(Command(where, tokens[start:end]))
    return found


def shell_tokens(text: str, env: dict[str, str]) -> list[str]:
    """Shell words of a script, with variables substituted from ``env`` (unknown ones: "x")."""
    text = re.sub(r"\\\n", " ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env.get(name, "x")

    text = re.sub(r"\$\{(\w+)[^}]*\}|\$(\w+)", sub, text)
    lex = shlex.shlex(text.replace("\n", " ; "), posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    return list(lex)


def script_defaults(text: str) -> dict[str, str]:
    """``VAR=${VAR:-default}`` lines of a shell script, as {VAR: default}."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\w+)=\$\{\1:-([^}]*)\}", text, re.M)}


def load_command(cmd: Command) -> tuple[argparse.Namespace, Any]:
    """Parse like ``agentrl.cli.main`` does and load the config a serve/learn/run/config command names."""
    args, extra = parser().parse_known_args(cmd.argv)
    bad = [x for x in extra if not x.startswith("--") or "=" not in x]
    assert not bad, f"{cmd.where}: `agentrl {' '.join(cmd.argv)}` has arguments the CLI rejects: {bad}"
    assert not any("admin_token=" in x for x in extra), f"{cmd.where}: an admin token on a command line"
    name = args.command_name if args.command == "config" else args.command
    if name not in CONFIG_CLASSES:
        return args, None
    path = getattr(args, "config", None)
    if path:
        if path.startswith(IMAGE_ROOT):
            path = path[len(IMAGE_ROOT):]
        path = ROOT / path
        assert path.exists(), f"{cmd.where}: config file {path} is not in the repository"
    if name == "learn" and getattr(args, "serve", None):
        extra = [f"serve={args.serve}", *extra]
    try:
        return args, C.load(CONFIG_CLASSES[name], path, extra)
    except C.ConfigError as e:
        raise AssertionError(f"{cmd.where}: `agentrl {' '.join(cmd.argv)}`: {e}") from None



def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def k8s_docs() -> list[dict[str, Any]]:
    return [
        d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d
    ]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "RayCluster":
        specs = [doc["spec"]["headGroupSpec"]] + doc["spec"].get("workerGroupSpecs", [])
        return [c for s in specs for c in s["template"]["spec"]["containers"]]
    if doc["kind"] == "Job":
        return doc["spec"]["template"]["spec"]["containers"]
    return []


def container_commands(c: dict[str, Any], where: str) -> list[Command]:
    """A container's command+args; a `bash -c SCRIPT` form is read as shell, a list as an argv."""
    argv = [*c.get("command", []), *c.get("args", [])]
    if len(argv) >= 3 and argv[0].endswith("sh") and argv[1].startswith("-"):
        script = " ".join(a for a in argv[2:] if a != "--")
        return commands_in_tokens(shell_tokens(script, {}), where)
    if argv and argv[0] in top_level_commands():
        argv = ["agentrl", *argv]  # the image's entry point runs `agentrl ARGS`
    return commands_in_tokens(argv, where)


def top_level_commands() -> set[str]:
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def entrypoint_agentrl_words() -> set[str]:
    text = (DEPLOY / "docker/entrypoint.sh").read_text()
    case = re.search(r'case "\$\{1:-\}" in\s*\n\s*(.+?)\)', text)
    assert case, "entrypoint.sh: no case on $1"
    return {w.strip().strip('"') for w in case.group(1).split("|")}


def all_commands() -> list[Command]:
    cmds: list[Command] = []
    for path in DOCKERFILES:
        for word, rest in dockerfile_instructions(path):
            if word == "CMD":
                cmds += commands_in_tokens(["agentrl", *json.loads(rest)], f"{path.name} CMD")
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml"):
        for name, svc in (yaml.safe_load(path.read_text())["services"]).items():
            if "command" in svc:
                cmds += commands_in_tokens(["agentrl", *svc["command"]], f"{path.name} {name}")
    for doc in k8s_docs():
        for c in containers(doc):
            cmds += container_commands(c, f"{doc['kind']} {doc['metadata']['name']}/{c['name']}")
    for path in sorted((DEPLOY / "slurm").glob("*")):
        text = path.read_text()
        cmds += commands_in_tokens(shell_tokens(text, script_defaults(text)), path.name)
    for path in [DEPLOY / "README.md", ROOT / "docs/operating.md"]:
        for block in re.findall(
            r"```(?:sh|bash|shell)?\n(.*?)```", path.read_text() if path.exists() else "", re.S
        ):
            for line in block.splitlines():
                toks = shell_tokens(line, {}) if line.strip() and not line.lstrip().startswith("#") else []
                cmds += commands_in_tokens(toks, f"{path.name}: {line.strip()}")
    return cmds


COMMANDS = all_commands()


def serve_port(where_prefix: str) -> int:
    ports = {cfg.router.port for cmd in COMMANDS if cmd.where.startswith(where_prefix)
             for _, cfg in [load_command(cmd)] if isinstance(cfg, C.ServeConfig)}
    assert len(ports) == 1, f"{where_prefix}: expected one serve command, found ports {ports}"
    return ports.pop()


def learn_urls(where_prefix: str) -> list[str]:
    return [cfg.serve for cmd in COMMANDS if cmd.where.startswith(where_prefix)
            for _, cfg in [load_command(cmd)] if isinstance(cfg, C.LearnConfig)]


# -- every file parses -----------------------------------------------------------------------------

def test_the_deploy_folder_has_images_compose_kubernetes_slurm_and_a_guide() -> None:
    for rel in (
        "docker/Dockerfile.serve",
        "docker/Dockerfile.learn",
        "docker/entrypoint.sh",
        "docker-compose.yml",
        "k8s/raycluster-serve.yaml",
        "k8s/learn-job.yaml",
        "slurm/agentrl.sbatch",
        "README.md",
    ):
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_every_yaml_file_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_dockerfile_parses_line_by_line(path: Path) -> None:
    instructions = dockerfile_instructions(path)
    words = [w for w, _ in instructions]
    assert set(words) <= DOCKERFILE_INSTRUCTIONS, set(words) - DOCKERFILE_INSTRUCTIONS
    assert set(words[:words.index("FROM")]) <= {"ARG"}, "only ARGs before FROM"
    for word, rest in instructions:
        if word in ("CMD", "ENTRYPOINT"):
            assert isinstance(json.loads(rest), list), f"{word} should be the exec (JSON) form"
        if word == "COPY":
            *sources, _dest = rest.split()
            for src in sources:
                if not src.startswith("--") and "*" not in src:
                    assert (ROOT / src).exists(), f"{path.name}: COPY {src} is not in the repository"
    args = {rest.split("=")[0] for w, rest in instructions if w == "ARG"}
    assert {"VARIANT", "BASE_IMAGE"} <= args, "CPU/GPU variants are chosen with build args"


def test_the_entry_point_runs_every_agentrl_subcommand() -> None:
    assert top_level_commands() <= entrypoint_agentrl_words()


def test_the_entry_point_reads_the_token_from_a_file() -> None:
    text = (DEPLOY / "docker/entrypoint.sh").read_text()
    assert "AGENTRL_ADMIN_TOKEN_FILE" in text and "export AGENTRL_ADMIN_TOKEN" in text


# -- commands agree with the CLI -------------------------------------------------------------------

def test_deploy_files_contain_serve_and_learn_commands() -> None:
    kinds = {(c.where.split()[0], c.argv[0]) for c in COMMANDS if c.argv}
    for where in ("Dockerfile.serve", "docker-compose.yml", "RayCluster", "agentrl.sbatch"):
        assert (where, "serve") in kinds, where
    for where in ("Dockerfile.learn", "docker-compose.yml", "Job", "agentrl.sbatch"):
        assert (where, "learn") in kinds, where


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.where}: {' '.join(c.argv)[:60]}")
def test_every_agentrl_command_parses_and_its_settings_are_valid_config_keys(cmd: Command) -> None:
    load_command(cmd)


def test_serve_outside_loopback_only_where_another_machine_or_container_must_reach_it() -> None:
    for cmd in COMMANDS:
        _, cfg = load_command(cmd)
        if isinstance(cfg, C.ServeConfig) and not cmd.where.startswith(("README", "operating")):
            assert cfg.router.host == "0.0.0.0", (f"{cmd.where}: learn in another "
                                                  "container/node cannot reach serve")
            assert not cfg.admin_token


# -- ports and images agree ------------------------------------------------------------------------

def test_dockerfile_serve_exposes_the_router_port() -> None:
    exposed = {int(p.split("/")[0]) for w, rest in dockerfile_instructions(DEPLOY / "docker/Dockerfile.serve")
               if w == "EXPOSE" for p in rest.split()}
    assert C.ServeConfig().router.port in exposed
    assert serve_port("Dockerfile.serve") in exposed


def test_compose_publishes_serve_port_on_loopback_and_learn_uses_it() -> None:
    port = serve_port("docker-compose.yml")
    svc = compose()["services"]
    mappings = [str(m).rsplit(":", 2) for m in svc["serve"]["ports"]]
    assert any(int(m[-1]) == port for m in mappings)
    assert all(len(m) == 3 and m[0] == "127.0.0.1" for m in mappings), "publish on the host's loopback only"
    for url in learn_urls("docker-compose.yml"):
        u = urlparse(url)
        assert (u.hostname, u.port) == ("serve", port)
    assert f":{port}/health" in " ".join(svc["serve"]["healthcheck"]["test"])


def test_compose_images_are_built_from_the_matching_dockerfiles() -> None:
    c = compose()
    for name, svc in c["services"].items():
        role = svc["image"].split(":")[0]
        assert role in ("agentrl/serve", "agentrl/learn"), name
        if "build" in svc:
            assert svc["build"]["dockerfile"].endswith("Dockerfile." + role.split("/")[1])
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()


def test_compose_hands_the_admin_token_to_both_sides_as_a_secret_file() -> None:
    c = compose()
    secret = c["secrets"]["admin_token"]["file"]
    assert not Path(secret).is_absolute()
    for name in ("serve", "learn"):
        svc = c["services"][name]
        assert "admin_token" in svc["secrets"]
        assert svc["environment"]["AGENTRL_ADMIN_TOKEN_FILE"] == "/run/secrets/admin_token"
        assert any(str(v).endswith(":/runs") for v in svc["volumes"]), "the shared run volume"


def test_kubernetes_learn_job_reaches_the_kuberay_head_service_on_the_serve_port() -> None:
    docs = {d["kind"]: d for d in k8s_docs()}
    cluster, job = docs["RayCluster"], docs["Job"]
    port = serve_port("RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert port in {p["containerPort"] for p in head["ports"]}
    assert head["readinessProbe"]["httpGet"]["port"] == port
    urls = learn_urls("Job")
    assert urls
    for url in urls:
        u = urlparse(url)
        assert (u.hostname, u.port) == (f"{cluster['metadata']['name']}-head-svc", port)
    learn = job["spec"]["template"]["spec"]["containers"][0]
    assert "torchrun" in learn["args"] and "command" not in learn, "args keep the image's entry point"


def test_kubernetes_images_match_their_roles_and_tokens_come_from_a_secret() -> None:
    for doc in k8s_docs():
        for c in containers(doc):
            env = {e["name"]: e for e in c.get("env", [])}
            if c["image"].startswith("agentrl/"):
                role = "learn" if doc["kind"] == "Job" else "serve"
                assert c["image"].split(":")[0] == f"agentrl/{role}"
                if role == "learn" or c["name"] == "ray-head":
                    token = env.get("AGENTRL_ADMIN_TOKEN") or env.get("AGENTRL_ADMIN_TOKEN_FILE")
                    assert token, f"{c['name']}: no admin token"
                    assert "value" not in env.get("AGENTRL_ADMIN_TOKEN", {}), "the token belongs in a Secret"


def test_slurm_learn_reaches_serve_on_its_port() -> None:
    port = serve_port("agentrl.sbatch")
    urls = learn_urls("agentrl.sbatch")
    assert urls and all(urlparse(u).port == port for u in urls)


def test_the_guide_names_the_images_ports_and_token_files() -> None:
    text = (DEPLOY / "README.md").read_text()
    for word in ("agentrl/serve", "agentrl/learn", str(C.ServeConfig().router.port), "admin_token",
                 "AGENTRL_ADMIN_TOKEN_FILE", "/runs", "6379", "8265"):
        assert word in text, word
