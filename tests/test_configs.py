"""Every shipped example config parses into its typed tree; bad keys and types are named in the error."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from agentrl import config as C

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*") if p.suffix in (".toml", ".yaml", ".yml"))


def config_class_for(path: Path) -> type:
    """The command a config file is for, from its name: *serve* -> serve, *learn* -> learn, else run."""
    name = path.name
    if "serve" in name:
        return C.ServeConfig
    if "learn" in name:
        return C.LearnConfig
    return C.RunConfig


def test_there_are_examples_for_one_machine_two_machines_and_a_cluster() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in EXAMPLES}
    assert "examples/quickstart.toml" in names
    assert {"examples/two-machine/serve.toml", "examples/two-machine/learn.toml"} <= names
    assert any(n.startswith("examples/cluster/") and "serve" in n for n in names)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_example_config_parses(path: Path) -> None:
    cfg = C.load(config_class_for(path), path)
    # and it survives the TOML round trip that `agentrl run` uses to hand serve its section
    assert C.build(type(cfg), tomllib.loads(C.to_toml(cfg))) == cfg


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_example_names_a_registered_environment(path: Path) -> None:
    from agentrl.env import registered
    from agentrl.env.registry import lookup

    cfg = C.load(config_class_for(path), path)
    serve = cfg.serve if isinstance(cfg, C.RunConfig) else cfg
    if isinstance(serve, C.ServeConfig):
        # a registered name, or an ecosystem's prefix:name (agentrl.env.adapters) that resolves
        assert serve.env.name in registered() or (
            ":" in serve.env.name and lookup(serve.env.name) is not None
        )


def test_the_two_machine_pair_agrees_on_batch_size_and_staleness() -> None:
    serve = C.load(C.ServeConfig, ROOT / "examples/two-machine/serve.toml")
    learn = C.load(C.LearnConfig, ROOT / "examples/two-machine/learn.toml")
    assert (serve.buffer.batch_size, serve.buffer.max_staleness) == (learn.batch_size, learn.max_staleness)
    assert serve.router.host != "127.0.0.1", "two machines: serve must listen beyond loopback"
    assert not serve.admin_token and not learn.admin_token, "tokens never live in shipped files"


def test_the_cluster_pair_agrees_on_batch_size_and_staleness() -> None:
    serves = [p for p in EXAMPLES if "cluster" in p.parts and config_class_for(p) is C.ServeConfig]
    learns = [p for p in EXAMPLES if "cluster" in p.parts and config_class_for(p) is C.LearnConfig]
    for s in serves:
        serve = C.load(C.ServeConfig, s)
        for lp in learns:
            learn = C.load(C.LearnConfig, lp)
            assert (serve.buffer.batch_size, serve.buffer.max_staleness) == (
                learn.batch_size,
                learn.max_staleness,
            )


def test_an_unknown_key_in_a_file_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[serve.engine]\ncount = 1\ncuont = 2\n")
    with pytest.raises(C.ConfigError, match=r"serve\.engine\.cuont"):
        C.load(C.RunConfig, path)


def test_an_unknown_key_in_a_yaml_file_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("router:\n  port: 8000\n  hots: 0.0.0.0\n")
    with pytest.raises(C.ConfigError, match=r"router\.hots"):
        C.load(C.ServeConfig, path)


def test_a_wrong_type_in_a_file_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[serve.buffer]\nbatch_size = "sixteen"\n')
    with pytest.raises(C.ConfigError, match=r"serve\.buffer\.batch_size"):
        C.load(C.RunConfig, path)


def test_a_value_outside_a_literal_is_named_with_the_choices() -> None:
    with pytest.raises(C.ConfigError, match=r"correction.*tis"):
        C.load(C.LearnConfig, None, ["--loss.correction=sometimes"])


def test_a_wrong_type_in_an_override_is_named_in_the_error() -> None:
    with pytest.raises(C.ConfigError, match=r"serve\.engine\.count"):
        C.load(C.RunConfig, None, ["--serve.engine.count=many"])


def test_an_unknown_override_is_named_with_the_known_keys_beside_it() -> None:
    with pytest.raises(C.ConfigError, match=r"unknown setting serve\.env\.nmae.*serve\.env\.name"):
        C.load(C.RunConfig, None, ["--serve.env.nmae=shell"])


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load(C.ServeConfig, tmp_path / "nope.toml")

