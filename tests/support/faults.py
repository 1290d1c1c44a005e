"""TEST-ONLY fault injection: a plugin at troupe's hook points (troupe.hooks).

`EngineConfig(hooks=fault_hooks("raise_after_steps=2"))`, i.e. `hooks="support.faults:<items>"`. The
config names this module, so every process that builds an engine or a frontend (an engine process, a
Ray worker) imports it by name and installs the same faults: the module must be importable there
(`tests/` is on the path: pytest's `pythonpath`, which spawned engine processes inherit; Ray workers
by the `PYTHONPATH` tests/conftest.py exports). Never in real use: it makes the engine fail on purpose.

Grammar of the items: comma-separated `name=value`.

- `raise_after_steps=N`: every model call after the N-th raises `RuntimeError("injected model
  failure")` (an exception in the engine loop: reported as EngineDead).
- `crash_after_steps=N`: model call N+1 segfaults the process (silent death; engine process only).
- `block_after_steps=N`: model call N+1 blocks until the file named by `release=PATH` exists (a
  hung engine; the test creates the file to let it go on).
- `step_delay_ms=D`: every model call first waits D milliseconds: paces generation so that a
  test's long stream cannot finish within a given time however fast the machine is (a lower bound
  on duration, not a synchronisation).
- `block_startup=1`: building the engine blocks until `release=PATH` exists (a slow start-up).
- `fail_startup=MESSAGE`: building the engine raises `RuntimeError(MESSAGE)`.
- `fail_sampling=PREFIX`: sampling raises `RuntimeError("injected sampling failure")` whenever a
  request whose id starts with PREFIX is among the rows (batched or alone): that request fails
  with finish_reason "error", the others in its batch are sampled again one by one and go on.
- `fail_detokenize=PREFIX` (frontend side): detokenizing any output of a request whose id starts
  with PREFIX raises `RuntimeError("injected detokenization failure")`: that request fails, the
  others go on.
- `fail_after_tokens=K` (with either of the two above): the request fails on its (K+1)-th token
  instead of its first, so a stream has started (default 0).
- `fail_actor_init=MESSAGE`: a Ray engine actor's constructor raises `RuntimeError(MESSAGE)`
  (troupe.engine_side.ray_engine; the `engine=R` filter applies).
- `engine=R`: the step faults, `fail_sampling` and `fail_actor_init` apply to data-parallel rank R
  only (default: every engine).

Ids are the engine's internal ids, `<the user's request id>-<8 hex digits>`, so a PREFIX that
starts the user's id matches.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from troupe.hooks import Hooks

_NAMES = {"raise_after_steps", "crash_after_steps", "block_after_steps", "block_startup", "fail_startup",
          "fail_actor_init", "release", "engine", "fail_sampling", "fail_detokenize", "fail_after_tokens",
          "step_delay_ms"}
POLL_S = 0.01


def parse(spec: str | None) -> dict[str, str]:
    if not spec:
        return {}
    items: dict[str, str] = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in _NAMES:
            raise ValueError(f"hooks: bad fault item {part!r}; known: {sorted(_NAMES)}")
        items[name.strip()] = value.strip()
    if ("block_after_steps" in items or "block_startup" in items) and "release" not in items:
        raise ValueError("hooks: block_* needs release=PATH")
    return items


def wait_for_release(path: str) -> None:
    """Block this (worker) thread until `path` exists: the test decides when, no sleep race."""
    pause = threading.Event()
    while not os.path.exists(path):
        pause.wait(POLL_S)


def fault_hooks(items: str | None) -> str | None:
    """The `EngineConfig.hooks` value that installs these fault `items` (the grammar above); None (no
    faults) for None."""
    return None if items is None else f"{__name__}:{items}"


def hooks(items: str) -> Faults:
    """The plugin's entry point (troupe.hooks.load): the faults `items` names, checked now."""
    return Faults(parse(items))


class Faults(Hooks):
    """The faults of one config at troupe's hook points."""

    def __init__(self, faults: dict[str, str]) -> None:
        self.faults = faults

    def before_actor(self, engine_index: int) -> None:
        """A Ray engine actor's constructor fault (`fail_actor_init`)."""
        faults = self.faults
        if "fail_actor_init" in faults and int(faults.get("engine", engine_index)) == engine_index:
            raise RuntimeError(faults["fail_actor_init"])

    def before_build(self) -> None:
        """Start-up faults, where the engine is built (worker thread or engine process)."""
        if "block_startup" in self.faults:
            wait_for_release(self.faults["release"])
        if "fail_startup" in self.faults:
            raise RuntimeError(self.faults["fail_startup"])

    def after_build(self, core: Any) -> None:
        install(core, self.faults)

    def frontend_built(self, processor: Any) -> None:
        install_frontend(processor, self.faults)


def install(core: Any, faults: dict[str, str]) -> None:
    """Engine faults: wrap `core.runner.execute` (the model call of one step) and `core.sampler.sample`."""
    if "engine" in faults and int(faults["engine"]) != getattr(core, "engine_index", 0):
        return
    if "fail_sampling" in faults:
        _fail_sampling(core.sampler, faults["fail_sampling"], int(faults.get("fail_after_tokens", 0)))
    step_faults = {k: int(v) for k, v in faults.items() if k.endswith("_after_steps")}
    delay_s = float(faults.get("step_delay_ms", 0)) / 1000
    if not step_faults and not delay_s:
        return
    real = core.runner.execute
    calls = 0

    def execute(seqs: Any) -> Any:
        nonlocal calls
        calls += 1
        if delay_s:
            threading.Event().wait(delay_s)  # pacing only: nothing waits on this
        if calls > step_faults.get("raise_after_steps", calls):
            raise RuntimeError("injected model failure")
        if calls > step_faults.get("crash_after_steps", calls):
            ctypes.string_at(0)  # SIGSEGV
        if calls == step_faults.get("block_after_steps", -1) + 1:
            wait_for_release(faults["release"])
        return real(seqs)

    core.runner.execute = execute


def _fail_sampling(sampler: Any, prefix: str, after: int) -> None:
    real = sampler.sample
    sampled: dict[str, int] = {}  # tokens sampled so far for each matching request

    def sample(logits: Any, rows: Any) -> Any:
        matching = [row.request_id for row in rows if row.request_id.startswith(prefix)]
        if any(sampled.get(rid, 0) >= after for rid in matching):
            raise RuntimeError("injected sampling failure")
        tokens = real(logits, rows)
        for rid in matching:
            sampled[rid] = sampled.get(rid, 0) + 1
        return tokens

    sampler.sample = sample


def install_frontend(processor: Any, faults: dict[str, str]) -> None:
    """Frontend faults: requests matching `fail_detokenize` get a detokenizer that raises."""
    prefix = faults.get("fail_detokenize")
    if prefix is None:
        return
    after = int(faults.get("fail_after_tokens", 0))
    real = processor.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        real(request_id, *args, **kwargs)
        if request_id.startswith(prefix):
            state = processor._states[request_id]
            state.detokenizer = _FailingDetokenizer(state.detokenizer, after)

    processor.add_request = add_request


class _FailingDetokenizer:
    """A request's detokenizer whose `update` raises once more than `after` tokens came; everything
    else is the real one's."""

    def __init__(self, inner: Any, after: int) -> None:
        self._inner = inner
        self._after = after

    def update(self, new_token_ids: list[int], *args: Any, **kwargs: Any) -> str | None:
        if len(self._inner.token_ids) + len(new_token_ids) > self._after:
            raise RuntimeError("injected detokenization failure")
        result: str | None = self._inner.update(new_token_ids, *args, **kwargs)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
