"""The environment registry: decorator, entry points of installed distributions, duplicates, unknown names."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import agentrl
from agentrl.env.registry import (
    DuplicateEnvironmentError,
    UnknownEnvironmentError,
    failed_entry_points,
    lookup,
    make,
    registered,
    unregister,
)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def install_dist(root: Path, dist: str, module: str, source: str, entry_points: str) -> None:
    """A real installed distribution: a module plus a .dist-info with entry_points.txt on sys.path."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


class Echo(agentrl.Environment):
    def __init__(self, greeting: str = "hi") -> None:
        self.greeting = greeting

    def tasks(self, split: str = "train"):
        return [{"id": "0"}]

    async def reset(self, task):
        return agentrl.Reset(messages=[{"role": "user", "content": self.greeting}])

    async def step(self, message):
        return agentrl.StepResult(messages=[], terminated=True)


def test_the_decorator_registers_a_class_and_make_passes_config_to_it() -> None:
    name = unique("echo")
    cls = type("EchoCopy", (Echo,), {})
    assert agentrl.environment(name)(cls) is cls
    env = agentrl.make(name, greeting="hello")
    assert isinstance(env, cls) and env.greeting == "hello" and cls.env_name == name
    assert name in registered()
    unregister(name)


def test_a_factory_function_can_be_registered_too() -> None:
    name = unique("factory")

    @agentrl.environment(name)
    def build(greeting: str = "x") -> Echo:
        return Echo(greeting * 2)

    assert make(name, greeting="ab").greeting == "abab"
    unregister(name)


def test_a_second_object_under_a_taken_name_is_an_error_naming_both() -> None:
    name = unique("dup")
    first = type("First", (Echo,), {})
    agentrl.environment(name)(first)
    agentrl.environment(name)(first)  # the same object again is harmless
    with pytest.raises(DuplicateEnvironmentError, match=rf"{name}.*already registered by .*First.*Second"):
        agentrl.environment(name)(type("Second", (Echo,), {}))
    assert lookup(name) is first
    unregister(name)


def test_an_unknown_name_lists_registered_names_and_says_what_to_import_or_install() -> None:
    with pytest.raises(UnknownEnvironmentError) as e:
        make("no_such_env_anywhere")
    text = str(e.value)
    assert "unknown environment 'no_such_env_anywhere'" in text
    assert "arithmetic" in text and "guess_number" in text  # built-ins are listed
    assert "import" in text and "pip install" in text and "agentrl.environments" in text


def test_built_in_environments_are_found_by_name_without_importing_them_first() -> None:
    names = registered()
    for name in ("arithmetic", "coding", "shell", "guess_number"):
        assert name in names
        assert lookup(name).__module__ == f"environments.{name}"


def test_an_installed_package_registers_through_its_entry_point(tmp_path: Path, monkeypatch) -> None:
    name, module = unique("plugin"), unique("agentrl_plugin_mod")
    install_dist(tmp_path, dist=unique("agentrl_plugin_dist"), module=module, source="""
        import agentrl

        class PluginEnv(agentrl.Environment):
            def __init__(self, level: int = 1):
                self.level = level
            def tasks(self, split="train"):
                return [{"id": "0"}]
            async def reset(self, task):
                return agentrl.Reset(messages=[{"role": "user", "content": "plug"}])
            async def step(self, message):
                return agentrl.StepResult(messages=[], terminated=True)
        """, entry_points=f"""
        [agentrl.environments]
        {name} = {module}:PluginEnv
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module not in sys.modules
    env = make(name, level=3)  # nothing imported by hand: the entry point did it
    assert type(env).__name__ == "PluginEnv" and env.level == 3 and type(env).env_name == name
    assert name in registered()
    unregister(name)


def test_a_broken_entry_point_is_reported_in_the_unknown_name_error(tmp_path: Path, monkeypatch) -> None:
    name = unique("broken")
    install_dist(tmp_path, dist=unique("agentrl_broken_dist"), module=unique("agentrl_broken_mod"),
                 source="raise ImportError('this plug-in needs a package that is not installed')\n",
                 entry_points=f"[agentrl.environments]\n{name} = does_not_exist_mod:Env\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownEnvironmentError, match=rf"entry point {name} = does_not_exist_mod:Env failed"):
        lookup(name)
    assert any(k.startswith(name) for k in failed_entry_points())


def test_an_entry_point_that_clashes_with_a_registered_name_does_not_replace_it(
    tmp_path: Path, monkeypatch
) -> None:
    name, module = unique("clash"), unique("agentrl_clash_mod")
    mine = type("Mine", (Echo,), {})
    agentrl.environment(name)(mine)
    install_dist(tmp_path, dist=unique("agentrl_clash_dist"), module=module,
                 source="class Other:\n    pass\n", entry_points="[agentrl.environments]\n"
                                                                 f"{name} = {module}:Other\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registered()
    assert lookup(name) is mine
    assert "already registered" in failed_entry_points()[f"{name} = {module}:Other"]
    unregister(name)
