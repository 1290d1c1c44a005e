"""The `troupe` command's entry point: `main`'s exit code, with the heap frozen before interpreter
teardown (whose last collection would otherwise scan every object torch and the model made)."""

from __future__ import annotations

import gc
from importlib.metadata import entry_points

import pytest

from troupe import cli


def test_console_returns_mains_code_with_the_heap_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "main", lambda: 3)
    gc.unfreeze()
    try:
        assert cli.console() == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_troupe_command_is_console() -> None:
    (script,) = entry_points(group="console_scripts", name="troupe")
    assert script.value == "troupe.cli:console"
