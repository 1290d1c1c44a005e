"""A hook plugin (`EngineConfig(hooks="support.thread_probe:")`) that fails every step run on another
thread than the one that built the engine's core: an engine builds and steps on one thread, so that its
torch ops keep one OpenMP thread team (troupe.engine.core_actor, "One thread for all of an engine's torch
work"). A failed step is the engine's death, which the test sees as its request's error."""

from __future__ import annotations

import threading
from typing import Any

from troupe.hooks import Hooks


def hooks(argument: str) -> Hooks:
    return ThreadProbe()


class ThreadProbe(Hooks):
    def after_build(self, core: Any) -> None:
        built = threading.current_thread().name
        built_id = threading.get_ident()
        real_step = core.step

        def step() -> Any:
            if threading.get_ident() != built_id:
                here = threading.current_thread().name
                raise RuntimeError(f"stepped on thread {here!r}, built on {built!r}")
            return real_step()

        core.step = step
