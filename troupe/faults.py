"""TEST-ONLY fault injection: `EngineConfig(fault_injection="...")`.

A plain string, so it crosses the process boundary inside the config (a closure could not be
pickled) and works the same in-process and in an engine process. Never set it in real use: it
makes the engine fail on purpose. `None` (the default) injects nothing.

Grammar: comma-separated `name=value` items.

- `raise_after_steps=N`: every model call after the N-th raises `RuntimeError("injected model
  failure")` (an exception in the engine loop: reported as EngineDead).
- `crash_after_steps=N`: model call N+1 segfaults the process (silent death; engine process only).
- `block_after_steps=N`: model call N+1 blocks until the file named by `release=PATH` exists (a
  hung engine; the test creates the file to let it go on).
- `block_startup=1`: building the engine blocks until `release=PATH` exists (a slow start-up).
- `fail_startup=MESSAGE`: building the engine raises `RuntimeError(MESSAGE)`.
- `fail_actor_init=MESSAGE`: a Ray engine actor's constructor raises `RuntimeError(MESSAGE)`
  (troupe.process.ray_engines; the `engine=R` filter applies).
- `engine=R`: the step faults above apply to data-parallel rank R only (default: every engine).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

_NAMES = {"raise_after_steps", "crash_after_steps", "block_after_steps", "block_startup", "fail_startup",
          "fail_actor_init", "release", "engine"}
POLL_S = 0.01


def parse(spec: str | None) -> dict[str, str]:
    if not spec:
        return {}
    items: dict[str, str] = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in _NAMES:
            raise ValueError(f"fault_injection: bad item {part!r}; known: {sorted(_NAMES)}")
        items[name.strip()] = value.strip()
    if ("block_after_steps" in items or "block_startup" in items) and "release" not in items:
        raise ValueError("fault_injection: block_* needs release=PATH")
    return items


def wait_for_release(path: str) -> None:
    """Block this (worker) thread until `path` exists: the test decides when, no sleep race."""
    pause = threading.Event()
    while not os.path.exists(path):
        pause.wait(POLL_S)


def before_build(spec: str | None) -> None:
    """Start-up faults; called where the engine is built (worker thread or engine process)."""
    faults = parse(spec)
    if "block_startup" in faults:
        wait_for_release(faults["release"])
    if "fail_startup" in faults:
        raise RuntimeError(faults["fail_startup"])


def before_actor(spec: str | None, engine_index: int) -> None:
    """A Ray engine actor's constructor fault (`fail_actor_init`)."""
    faults = parse(spec)
    if "fail_actor_init" in faults and int(faults.get("engine", engine_index)) == engine_index:
        raise RuntimeError(faults["fail_actor_init"])


def install(core: Any, spec: str | None) -> None:
    """Step faults: wrap `core.runner.execute` (the model call of one step)."""
    faults = parse(spec)
    step_faults = {k: int(v) for k, v in faults.items() if k.endswith("_after_steps")}
    if not step_faults or ("engine" in faults and int(faults["engine"]) != getattr(core, "engine_index", 0)):
        return
    real = core.runner.execute
    calls = 0

    def execute(seqs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > step_faults.get("raise_after_steps", calls):
            raise RuntimeError("injected model failure")
        if calls > step_faults.get("crash_after_steps", calls):
            ctypes.string_at(0)  # SIGSEGV
        if calls == step_faults.get("block_after_steps", -1) + 1:
            wait_for_release(faults["release"])
        return real(seqs)

    core.runner.execute = execute
