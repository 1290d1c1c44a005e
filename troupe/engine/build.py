"""Building an EngineCore and describing it to the frontend: shared by the in-process engine side
(troupe.engine_side) and the engine process (troupe.engine.child).

`build_core` runs the config's hook points around the build (troupe.hooks: no-ops unless a plugin is
named, as tests' fault injection does) and turns any failure into
`EngineStartupError` with the traceback text. `ready_info` is the `EngineReady` an engine reports
once built (over the wire from a process, or directly in-process).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from troupe.config import EngineConfig
from troupe.errors import EngineStartupError
from troupe.hooks import load as load_hooks
from troupe.process.protocol import EngineReady

if TYPE_CHECKING:
    from troupe.core.engine_core import EngineCore

MakeCore = Callable[[EngineConfig], "EngineCore"]


def build_core(config: EngineConfig, make_core: MakeCore | None = None, engine_index: int = 0) -> EngineCore:
    """Build the EngineCore (blocking: on the engine's step thread, `core_actor.step_thread`) between the
    config's `before_build` and `after_build` hook points."""
    try:
        from troupe.core.engine_core import EngineCore  # torch: only where the engine runs

        hooks = load_hooks(config.hooks)
        hooks.before_build()
        core = (make_core or EngineCore)(config)
        core.engine_index = engine_index
        hooks.after_build(core)
        return core
    except Exception as exc:
        raise EngineStartupError.from_cause(exc, traceback.format_exc()) from exc


def ready_info(core: EngineCore, engine_index: int = 0) -> EngineReady:
    return EngineReady(engine_index=engine_index, pid=os.getpid(), limits=core.limits,
                       model_path=str(core.runner.model_path), num_blocks=core.runner.num_blocks,
                       block_size=core.runner.block_size)
