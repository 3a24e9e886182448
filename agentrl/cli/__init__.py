"""The ``agentrl`` command. Parses and validates configuration first; heavy imports come after.

    agentrl run                      serve + learn on this machine (the quickstart)
    agentrl doctor [--before-setup] [--config F] [...]   what this machine lacks for agentrl run
    agentrl serve [--config F] [--ray ADDRESS] [--section.key=value ...]
    agentrl learn --serve URL [...]
    agentrl config show {serve,learn,run} [...]
    agentrl model build {tiny,tiny-tools}
    agentrl sandbox build
    agentrl envs list | show NAME | try NAME --endpoint URL
    agentrl status --serve URL [--admin-token-file F | --run-dir D] [--watch S] [--json]
    agentrl eval --env NAME --endpoint URL [--tasks N] [--split test] [--api-key-file F] [--out F]
    agentrl plot RUN_DIR [--out DIR]
    agentrl view RUN_DIR [--port P] [--host H] [--token-file F] [--model M]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import shutil
import signal
import sys
from typing import TYPE_CHECKING, TypeVar

from agentrl import config as C

if TYPE_CHECKING:
    from types import ModuleType

T = TypeVar("T")


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("aiohttp.access", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # progress lines (the learner's step line, ...) for people: on stdout, as they are
    progress = logging.getLogger("agentrl.progress")
    if not progress.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        progress.addHandler(handler)
        progress.propagate = False
        progress.setLevel(logging.INFO)


def _private_files() -> None:
    """Files serve, learn and run write (buffer log, sessions, weights, checkpoints, metrics) are the
    user's alone: mode 0600, folders 0700, whatever the shell's umask."""
    import os

    os.umask(0o077)


def _private_dir(path: str) -> None:
    """A run directory that already exists with wider permissions is narrowed to 0700."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir() and p.stat().st_mode & 0o077:
        p.chmod(0o700)


def _load(cls: type[T], args: argparse.Namespace, extra: list[str]) -> T:
    try:
        return C.load(cls, args.config, extra)
    except C.ConfigError as e:
        raise SystemExit(f"agentrl: configuration error: {e}") from None


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    if args.ray:
        extra = [f"ray.address={args.ray}", *extra]
    if args.endpoint_only:
        extra = ["endpoint_only=true", *extra]
    cfg = _load(C.ServeConfig, args, extra)
    _setup_logging(args.verbose)
    _private_files()
    _private_dir(cfg.run_dir)
    import asyncio

    from agentrl.serve.app import serve_forever
    from agentrl.serve.local import EngineFailed

    try:
        asyncio.run(serve_forever(cfg))
    except KeyboardInterrupt:  # a second Ctrl-C while shutting down
        print(f"agentrl serve: interrupted; kept {cfg.run_dir}", file=sys.stderr, flush=True)
        return 130
    except EngineFailed as e:  # its engines died and could not be relaunched: nothing left to serve
        print(f"agentrl serve: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        from agentrl.buffer.disk import is_no_space

        if not is_no_space(e):
            raise
        # while serving, a full disk pauses admission (buffer.min_free_mb); before it serves, nothing can
        # start: its token, config and logs need room
        free = shutil.disk_usage(cfg.run_dir).free / (1 << 20)
        print(f"agentrl serve: no space left in {cfg.run_dir} ({free:.1f} MiB free) to start in: "
              f"{e.strerror}{f' ({e.filename})' if e.filename else ''}; free some space and start it again",
              file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_learn(args: argparse.Namespace, extra: list[str]) -> int:
    if args.serve:
        extra = [f"serve={args.serve}", *extra]
    cfg = _load(C.LearnConfig, args, extra)
    _setup_logging(args.verbose)
    _private_files()
    _private_dir(cfg.run_dir)
    from agentrl.learner.trainer import learn

    learn(cfg)
    return 0


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = _load(C.RunConfig, args, extra)
    _setup_logging(args.verbose)
    _private_files()
    _private_dir(cfg.serve.run_dir)
    import logging as _logging

    _logging.getLogger("agentrl.progress").info("agentrl run: %s on %s, run directory %s", cfg.serve.model,
                                                cfg.serve.env.name, cfg.serve.run_dir)
    from agentrl.cli.run import run

    try:
        return run(cfg)
    except KeyboardInterrupt:
        # serve and its engines were stopped on the way out (run's finally); say what is kept
        print(f"agentrl run: interrupted; kept {cfg.serve.run_dir} (logs, buffer, metrics, checkpoints)",
              file=sys.stderr, flush=True)
        return 130


def cmd_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    """Check this machine for what ``agentrl run`` uses, as configured (--config and --section.key=value,
    as agentrl run takes them): one line per check, ok, warning or missing, with the fix. Exits 1
    when something required is missing. Needs only the standard library: before scripts/setup.sh,
    run it as `python3 -m agentrl.cli doctor --before-setup`."""
    cfg = _load(C.RunConfig, args, extra)
    from agentrl.cli.doctor import main as doctor_main

    return doctor_main(cfg, before_setup=args.before_setup)


def cmd_config_show(args: argparse.Namespace, extra: list[str]) -> int:
    cls = {"serve": C.ServeConfig, "learn": C.LearnConfig, "run": C.RunConfig}[args.command_name]
    print(C.to_toml(_load(cls, args, extra), docs=True), end="")
    return 0


def cmd_model_build(args: argparse.Namespace, extra: list[str]) -> int:
    _setup_logging(args.verbose)
    from pathlib import Path

    from agentrl.models import recipe_stamp, resolve_model

    path = resolve_model(args.name, rebuild=args.rebuild)
    if args.ship:
        from agentrl.models.shipped import ship

        print(
            f"shipped {args.name} in {ship(args.name, Path(path), recipe_stamp(args.name))}", file=sys.stderr
        )
    print(path)
    return 0


def cmd_sandbox_build(args: argparse.Namespace, extra: list[str]) -> int:
    _setup_logging(args.verbose)
    from agentrl.sandbox import build_images

    for tag in build_images(progress=print):
        print(tag)
    return 0


def _import_user_code(args: argparse.Namespace, command: str) -> None:
    """``--import MODULE_OR_FILE`` (repeatable): the user's environments, before names are looked up."""
    from agentrl.env import UserCodeError, import_user_code

    for spec in getattr(args, "imports", None) or []:
        try:
            import_user_code(spec)
        except UserCodeError as e:
            raise SystemExit(f"agentrl {command}: {e}") from None


def cmd_envs(args: argparse.Namespace, extra: list[str]) -> int:
    from agentrl.env import UnknownEnvironmentError
    from agentrl.env import cli as env_cli

    _import_user_code(args, "envs")
    try:
        return _envs(args, env_cli)
    except UnknownEnvironmentError as e:
        raise SystemExit(f"agentrl envs: {e}") from None
    except C.ConfigError as e:
        raise SystemExit(f"agentrl envs: configuration error: {e}") from None


def _envs(args: argparse.Namespace, env_cli: ModuleType) -> int:
    if args.action == "list":
        return env_cli.list_envs()
    import json

    try:
        config = json.loads(args.env_config)
    except ValueError as e:
        raise C.ConfigError(f"--config is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise C.ConfigError(f"--config must be a JSON object of keyword arguments, not {args.env_config!r}")
    if args.action == "show":
        return env_cli.show_env(args.name, **config)
    _setup_logging(args.verbose)
    from agentrl.rollout.tryout import try_env

    return try_env(args.name, args.endpoint, model=args.model, max_turns=args.max_turns,
                   max_tokens=args.max_tokens, temperature=args.temperature, env_config=config)


def _no_settings(command: str, extra: list[str]) -> None:
    if extra:
        raise SystemExit(f"agentrl {command}: takes no --section.key=value settings (got {extra})")


def cmd_status(args: argparse.Namespace, extra: list[str]) -> int:
    """Ask a running serve for its status. The admin token is read from --admin-token-file,
    $AGENTRL_ADMIN_TOKEN, or RUN_DIR/admin_token (never a command-line value)."""
    _no_settings("status", extra)
    from agentrl.cli.status import StatusError, main

    try:
        return main(args.serve, args.admin_token_file, args.run_dir, as_json=args.json, watch_s=args.watch,
                    timeout_s=args.timeout)
    except StatusError as e:
        raise SystemExit(f"agentrl status: {e}") from None
    except KeyboardInterrupt:
        return 130


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    """Run an environment's held-out tasks through the built-in agent loop against an
    OpenAI-compatible endpoint (serve's router at URL/v1, vLLM, or any OpenAI API). Success: the
    environment ended the episode and declared it a success (info["success"]: an exact answer, a won
    game), or, where it declares nothing, with reward above --success-reward; the mean reward
    (partial credit) is reported beside. The API key comes from
    --api-key-file, $AGENTRL_API_KEY or $OPENAI_API_KEY (never a command-line value)."""
    _no_settings("eval", extra)
    _setup_logging(args.verbose)
    env_config = {}
    if args.env_config:
        import json

        try:
            env_config = json.loads(args.env_config)
        except ValueError as e:
            raise SystemExit(f"agentrl eval: --env-config is not a JSON object: {e}") from None
    from agentrl.credentials import SecretError
    from agentrl.env.registry import UnknownEnvironmentError
    from agentrl.rollout.config import EpisodeLimits
    from agentrl.rollout.evaluate import main as eval_main

    _import_user_code(args, "eval")
    limits = EpisodeLimits(max_turns=args.max_turns, max_tokens=args.max_tokens, temperature=args.temperature)
    try:
        return eval_main(args.env, args.endpoint, out=args.out, api_key_file=args.api_key_file or "",
                         tasks=args.tasks, split=args.split, env_config=env_config, model=args.model,
                         limits=limits, concurrency=args.concurrency, success_reward=args.success_reward)
    except (UnknownEnvironmentError, SecretError) as e:
        raise SystemExit(f"agentrl eval: {e}") from None


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    """Read learner.jsonl, episodes.jsonl and serve_metrics.jsonl and write PNG charts (reward,
    staleness, importance weights, throughput, learner idle time, sandbox latency)."""
    _no_settings("plot", extra)
    _setup_logging(args.verbose)
    from agentrl.plot import plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        raise SystemExit(f"agentrl plot: {e}") from None
    for path in paths:
        print(path)
    return 0


def cmd_view(args: argparse.Namespace, extra: list[str]) -> int:
    """Serve the web view of a run directory (live or finished) on its own: the charts, the episode
    browser and each episode's tokens with loss mask, versions and logprobs. serve shows the same
    view at its URL/view/. Opened with the run's view token (RUN_DIR/view_token, made if missing)
    or its admin token: the command prints the file to read it from, never the token."""
    _no_settings("view", extra)
    _setup_logging(args.verbose)
    import asyncio

    from agentrl.credentials import SecretError
    from agentrl.view import run_view

    try:
        asyncio.run(run_view(args.run_dir, args.host, args.port, args.token_file or "", args.model or ""))
    except (FileNotFoundError, PermissionError, SecretError, OSError) as e:
        raise SystemExit(f"agentrl view: {e}") from None
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_tinker(args: argparse.Namespace, extra: list[str]) -> int:
    """Serve the Tinker API (the official ``tinker`` SDK's routes) on a model of this machine: LoRA
    training clients with forward_backward and optim_step on agentrl's learner parts. API keys
    (each a tenant, starting with ``tml-``) come from --keys-file or $AGENTRL_TINKER_KEYS(_FILE);
    programs reach it with ``tinker.ServiceClient(base_url=URL, api_key=KEY)`` (docs/tinker.md)."""
    _no_settings("tinker", extra)
    _setup_logging(args.verbose)
    import asyncio

    from agentrl.credentials import SecretError
    from agentrl.tinker.service import run_service

    try:
        asyncio.run(run_service(args.model, args.host, args.port, args.keys_file or "",
                                state_dir=args.state_dir or "", lora_alpha=args.lora_alpha,
                                sampling=not args.no_sampling, engine_port=args.engine_port,
                                max_clients=args.max_clients, session_ttl_s=args.session_ttl))
    except (SecretError, ValueError, OSError) as e:
        raise SystemExit(f"agentrl tinker: {e}") from None
    except KeyboardInterrupt:
        return 0
    return 0


# `agentrl eval`'s defaults are the config tree's (one definition, shared with agentrl run's evaluation)
EVAL = C.EvalConfig()
LIMITS = C.EpisodeLimits()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl", description="Asynchronous RL for tool-using LLM agents. "
                                "Settings: --config FILE (TOML/YAML) and --section.key=value overrides.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", help="TOML or YAML file")
        return sp

    sv = with_config(sub.add_parser("serve", help="engines, router, agent loops, sandboxes and buffer"))
    sv.add_argument("--ray", metavar="ADDRESS", help="place engines and rollout workers as "
                                                     "actors on this Ray cluster (\"auto\": the "
                                                     "local one; same as --ray.address=ADDRESS)")
    sv.add_argument("--endpoint-only", action="store_true", help="engines, router, buffer and weight "
                                                                 "routes, but no agent loops, sandboxes "
                                                                 "or rollout workers: episodes come "
                                                                 "from outside, from programs that "
                                                                 "open sessions (POST /admin/sessions), "
                                                                 "call /sessions/<id>/v1 and put the "
                                                                 "scored samples into the buffer "
                                                                 "(POST /buffer/samples), as "
                                                                 "agentrl.rollout.remote does (same "
                                                                 "as --endpoint_only=true)")
    sv.set_defaults(fn=cmd_serve)
    sp = with_config(sub.add_parser("learn", help="the trainer; pulls batches from serve"))
    sp.add_argument("--serve", help="serve's URL, e.g. http://HOST:8000")
    sp.set_defaults(fn=cmd_learn)
    with_config(sub.add_parser("run", help="serve and learn on this machine")).set_defaults(fn=cmd_run)
    dp = with_config(sub.add_parser("doctor", help="what this machine has and lacks "
                                                   "for agentrl run, and how to get it",
                                    description=cmd_doctor.__doc__))
    dp.add_argument("--before-setup", action="store_true", help="what scripts/setup.sh installs or builds "
                                                                "(Debian packages, .venv's packages, the "
                                                                "Docker engine, the sandbox image, the "
                                                                "model) is a warning, not missing; packages "
                                                                "are looked up in the checkout's .venv")
    dp.set_defaults(fn=cmd_doctor)

    cp = sub.add_parser("config", help="inspect configuration")
    csub = cp.add_subparsers(dest="action", required=True)
    show = with_config(csub.add_parser("show", help="print the resolved config as TOML"))
    show.add_argument("command_name", choices=["serve", "learn", "run"])
    show.set_defaults(fn=cmd_config_show)

    mp = sub.add_parser("model", help="built-in models")
    msub = mp.add_subparsers(dest="action", required=True)
    mb = msub.add_parser("build", help="put a built-in model in the cache (the project's shipped build where "
                         "there is one, else built here) and print its folder")
    mb.add_argument("name", choices=["tiny", "tiny-tools", "tiny-moe", "tiny-arith", "tiny-agent", "smollm2",
                                     "smollm2-tools", "smollm2-moe"])
    mb.add_argument("--rebuild", action="store_true",
                    help="build it here from its recipe, whatever the cache and the shipped files hold")
    mb.add_argument("--ship", action="store_true",
                    help="then copy it into agentrl/models/shipped/ (a deliberate commit: it replaces "
                         "the shipped build)")
    mb.set_defaults(fn=cmd_model_build)

    sbp = sub.add_parser("sandbox", help="sandbox images")
    sbsub = sbp.add_subparsers(dest="action", required=True)
    sbsub.add_parser(
        "build", help="build the sandbox images under sandbox/ (skips up-to-date ones)"
    ).set_defaults(fn=cmd_sandbox_build)

    ep = sub.add_parser("envs", help="registered environments")
    esub = ep.add_subparsers(dest="action", required=True)
    def with_import(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--import", dest="imports", action="append", metavar="MODULE_OR_FILE",
                        help="import this module (my_envs) or file (./my_env.py) first, "
                             "so the environments it registers are known (repeatable)")
        return sp

    with_import(esub.add_parser("list", help="list registered environments")).set_defaults(fn=cmd_envs)
    es = with_import(esub.add_parser("show", help="show an environment's tools and an example opening"))
    es.add_argument("name")
    es.add_argument("--config", dest="env_config", default="{}", metavar="JSON",
                    help='the environment\'s keyword arguments as JSON (as '
                         'env.config), e.g. \'{"envs": {"guess_number": {}}}\'')
    es.set_defaults(fn=cmd_envs)
    et = with_import(esub.add_parser("try", help="play one episode against an "
                                                 "OpenAI-compatible endpoint, turn by turn"))
    et.add_argument("name")
    et.add_argument("--endpoint", required=True, help="base URL ending in /v1, e.g. http://127.0.0.1:8000/v1")
    et.add_argument("--model", default="", help="model name (default: the endpoint's first model)")
    et.add_argument("--max-turns", type=int, default=6)
    et.add_argument("--max-tokens", type=int, default=256)
    et.add_argument("--temperature", type=float, default=1.0)
    et.add_argument("--config", dest="env_config", default="{}", metavar="JSON",
                    help="the environment's keyword arguments as JSON (as env.config)")
    et.set_defaults(fn=cmd_envs)

    st = sub.add_parser("status", help="engines, versions, episodes in flight, buffer, sandboxes, throughput",
                        description=cmd_status.__doc__)
    st.add_argument("--serve", default="http://127.0.0.1:8000", help="serve's URL (default: %(default)s)")
    st.add_argument("--admin-token-file", help="file holding serve's admin token")
    st.add_argument(
        "--run-dir", default="runs/latest", help="serve's run directory, for its admin_token file"
    )
    st.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="refresh every SECONDS")
    st.add_argument("--json", action="store_true", help="print the raw status JSON")
    st.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for serve")
    st.set_defaults(fn=cmd_status)

    ev = sub.add_parser("eval", help="success rate and reward on held-out "
                                     "tasks, with 95%% confidence intervals",
                        description=cmd_eval.__doc__)
    ev.add_argument("--env", required=True, help="a registered environment (agentrl envs list)")
    with_import(ev)
    ev.add_argument("--endpoint", required=True, help="OpenAI base URL ending in /v1, "
                                                      "e.g. http://127.0.0.1:8000/v1")
    ev.add_argument("--tasks", type=int, default=EVAL.tasks,
                    help="how many tasks, from the start of the split (default: %(default)s)")
    ev.add_argument("--split", default="test", help="task split: test (alias heldout) "
                                                    "or train (default: %(default)s)")
    ev.add_argument("--env-config", default="", help="environment keyword arguments as a JSON object")
    ev.add_argument("--model", default="", help="model name (default: the endpoint's first model)")
    ev.add_argument("--api-key-file", help="file holding the endpoint's API key")
    ev.add_argument("--max-turns", type=int, default=LIMITS.max_turns)
    ev.add_argument("--max-tokens", type=int, default=LIMITS.max_tokens, help="completion tokens "
                                                                              "per model call")
    ev.add_argument("--temperature", type=float, default=EVAL.temperature,
                    help="sampling temperature (default: %(default)s, "
                         "as the agent acts in training; 0: greedy)")
    ev.add_argument("--concurrency", type=int, default=EVAL.concurrency, help="episodes in flight")
    ev.add_argument("--success-reward", type=float, default=EVAL.success_reward,
                    help="an episode succeeds above this reward, where its environment "
                         "declares no success of its own")
    ev.add_argument("--out", help="JSON result file (default: runs/eval/ENV-SPLIT-TIME.json)")
    ev.set_defaults(fn=cmd_eval)

    pp = sub.add_parser("plot", help="PNG charts of a run directory's logs", description=cmd_plot.__doc__)
    pp.add_argument("run_dir", help="a run directory, e.g. runs/latest")
    pp.add_argument("--out", help="where to write the PNGs (default: RUN_DIR/plots)")
    pp.set_defaults(fn=cmd_plot)

    tp = sub.add_parser("tinker", help="a Tinker-compatible training service (the tinker SDK's API)",
                        description=cmd_tinker.__doc__)
    tp.add_argument("--model", default="smollm2", help="built-in model name or folder (default: %(default)s)")
    tp.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    tp.add_argument("--port", type=int, default=8900, help="port (default: %(default)s; 0: a free one)")
    tp.add_argument("--keys-file", help="file of API keys, one a line (default: $AGENTRL_TINKER_KEYS, "
                                        "comma-separated, or the file $AGENTRL_TINKER_KEYS_FILE names)")
    tp.add_argument("--state-dir", help="where save_state writes checkpoints, a folder per API key "
                                        "(default: ~/.cache/agentrl/tinker)")
    tp.add_argument("--engine-port", type=int, default=8950,
                    help="port of the vLLM engine that samples, started on the first sampling call "
                         "(default: %(default)s)")
    tp.add_argument("--no-sampling", action="store_true",
                    help="train only: no sampling engine, sampling calls are refused")
    tp.add_argument("--max-clients", type=int, default=16,
                    help="training clients held at once, all keys together (default: %(default)s)")
    tp.add_argument("--session-ttl", type=float, default=300.0,
                    help="seconds without a heartbeat after which a session's training clients are "
                         "freed; the SDK beats every 10 s (default: %(default)s)")
    tp.add_argument("--lora-alpha", type=float, default=32.0,
                    help="LoRA alpha of every training client's adapter (default: %(default)s)")
    tp.set_defaults(fn=cmd_tinker)

    vp = sub.add_parser("view", help="a web view of a run directory: live charts, episodes, tokens",
                        description=cmd_view.__doc__)
    vp.add_argument("run_dir", help="a run directory, e.g. runs/latest")
    vp.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    vp.add_argument("--port", type=int, default=8800, help="port (default: %(default)s; 0: a free one)")
    vp.add_argument("--token-file", help="file holding the view token (default: RUN_DIR/view_token, "
                    "$AGENTRL_VIEW_TOKEN or $AGENTRL_VIEW_TOKEN_FILE)")
    vp.add_argument("--model", help="model folder or name for the token text "
                                    "(default: serve_config.json's model)")
    vp.set_defaults(fn=cmd_view)
    return p


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr (serve.log's or learn's output)
    # and the process goes on: what a process that makes no progress is doing, without stopping it
    with contextlib.suppress(ValueError, AttributeError, OSError):  # not the main thread; no SIGUSR1
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    args, extra = parser().parse_known_args(argv)
    bad = [x for x in extra if not x.startswith("--") or "=" not in x]
    if bad:
        raise SystemExit(f"agentrl: unrecognised arguments {bad}; settings look like --section.key=value")
    return args.fn(args, extra)


if __name__ == "__main__":
    sys.exit(main())
