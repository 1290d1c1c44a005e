"""The hook points (troupe.hooks): no-ops without a plugin, a plugin loaded by the module name the
config gives, and `build_core` calling its points around the build in order."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from troupe.config import EngineConfig
from troupe.engine.build import build_core
from troupe.errors import EngineStartupError, InvalidInputError
from troupe.hooks import NO_HOOKS, Hooks, load


class Recorder(Hooks):
    def __init__(self, argument: str) -> None:
        self.argument = argument
        self.events: list[Any] = []

    def before_build(self) -> None:
        self.events.append("before_build")
        if self.argument == "fail":
            raise RuntimeError("refused by the plugin")

    def after_build(self, core: Any) -> None:
        self.events.append(("after_build", core.engine_index))


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> list[Recorder]:
    """A plugin module `recording_plugin` (in sys.modules, so importable by name); the hooks it made."""
    made: list[Recorder] = []

    def hooks(argument: str) -> Recorder:
        made.append(Recorder(argument))
        return made[-1]

    module = types.ModuleType("recording_plugin")
    module.hooks = hooks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "recording_plugin", module)
    return made


def test_without_a_plugin_every_point_does_nothing() -> None:
    """`hooks=None` (every real use) loads `NO_HOOKS`, whose points return without touching anything."""
    assert load(None) is NO_HOOKS and EngineConfig().hooks is None
    core = object()
    assert NO_HOOKS.before_actor(0) is None and NO_HOOKS.before_build() is None
    assert NO_HOOKS.after_build(core) is None and NO_HOOKS.frontend_built(core) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["", ":items", "not a module", "a..b", 3])
def test_a_malformed_spec_is_refused_by_the_config(spec: Any) -> None:
    """The config names the field and the form it wants."""
    with pytest.raises(InvalidInputError, match=r"hooks: must be None or 'module\[:argument\]'"):
        EngineConfig(hooks=spec)


def test_a_module_that_is_no_plugin_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module without `hooks()`, or whose `hooks()` returns something else than `Hooks`, is an error
    naming it; a module that does not exist fails to import."""
    monkeypatch.setitem(sys.modules, "no_plugin", types.ModuleType("no_plugin"))
    with pytest.raises(InvalidInputError, match="module 'no_plugin' has no hooks"):
        load("no_plugin")
    wrong = types.ModuleType("wrong_plugin")
    wrong.hooks = lambda argument: object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wrong_plugin", wrong)
    with pytest.raises(InvalidInputError, match="returned object, not Hooks"):
        load("wrong_plugin:x")
    with pytest.raises(ModuleNotFoundError):
        load("troupe_no_such_plugin")


def test_build_core_calls_the_points_around_the_build(plugin: list[Recorder]) -> None:
    """The argument after the colon reaches the plugin; `before_build` runs before the core is made,
    `after_build` gets it with its engine index set."""
    made_cores: list[Any] = []

    def make_core(config: EngineConfig) -> Any:
        assert plugin[0].events == ["before_build"]
        made_cores.append(types.SimpleNamespace())
        return made_cores[-1]

    core = build_core(EngineConfig(hooks="recording_plugin:some argument"), make_core, engine_index=2)
    assert core is made_cores[0] and plugin[0].argument == "some argument"
    assert plugin[0].events == ["before_build", ("after_build", 2)]


def test_a_failing_point_is_a_startup_error_and_nothing_is_built(plugin: list[Recorder]) -> None:
    """An exception from `before_build` fails the start-up with its text; the core is never made."""
    def make_core(config: EngineConfig) -> Any:
        raise AssertionError("built despite the failing hook")

    with pytest.raises(EngineStartupError, match="refused by the plugin"):
        build_core(EngineConfig(hooks="recording_plugin:fail"), make_core)
    assert plugin[0].events == ["before_build"]


def test_the_fault_plugin_refuses_an_unknown_item() -> None:
    """The tests' fault plugin checks its items when it is loaded (docs/multiprocess.md lists them)."""
    with pytest.raises(ValueError, match="bad fault item 'bogus=1'"):
        load("support.faults:bogus=1")
    assert load("support.faults:raise_after_steps=2").faults == {"raise_after_steps": "2"}  # type: ignore[attr-defined]
