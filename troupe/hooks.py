"""Hook points: the places where a plugin named in the config may step into building an engine or a
frontend. Production declares them and they do nothing; tests' fault injection is the plugin.

`EngineConfig.hooks` is `None` in real use, and `load(None)` is `NO_HOOKS`, whose points are no-ops.
Otherwise it is `"module[:argument]"`: `load` imports the module by name and calls its
`hooks(argument)`, which returns a `Hooks`. A name in the config, not an object, because the config
is what crosses to an engine process and a Ray worker (a closure could not be pickled): each process
that builds an engine or a frontend loads the plugin itself. troupe never imports a plugin statically;
the layering test forbids importing the test helpers from the package.

The points, in the order they run:

1. `before_actor(engine_index)`: a Ray engine actor's constructor (troupe.engine_side.ray_engine).
2. `before_build()`: where the engine is built (its step thread, in the frontend's process, an engine process
   or a Ray worker),
   before it is (troupe.engine.build).
3. `after_build(core)`: the built `EngineCore`, before it serves; a plugin may wrap its parts.
4. `frontend_built(processor)`: the frontend's `OutputProcessor`, once the tokenizer is set
   (troupe.actors.graph).

An exception from a point is the failure of what it runs in (a start-up error for 1-3).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from troupe.errors import InvalidInputError

if TYPE_CHECKING:
    from troupe.core.engine_core import EngineCore
    from troupe.output.processor import OutputProcessor


class Hooks:
    """The hook points; every one does nothing here. A plugin subclasses it and overrides some."""

    def before_actor(self, engine_index: int) -> None:
        """A Ray engine actor of data-parallel rank `engine_index` is being constructed."""

    def before_build(self) -> None:
        """The engine is about to be built (blocking: on the thread that will step it)."""

    def after_build(self, core: EngineCore) -> None:
        """`core` is built (its `engine_index` set) and has not stepped yet."""

    def frontend_built(self, processor: OutputProcessor) -> None:
        """The frontend's output processor has its tokenizer; no request has been added yet."""


NO_HOOKS = Hooks()


def check_spec(spec: object) -> None:
    """`EngineConfig.hooks` is None or `"module[:argument]"` with a dotted module name."""
    if spec is None:
        return
    module = spec.partition(":")[0] if isinstance(spec, str) else ""
    if not module or not all(part.isidentifier() for part in module.split(".")):
        raise InvalidInputError("hooks", f"must be None or 'module[:argument]' naming a module, got {spec!r}")


def load(spec: str | None) -> Hooks:
    """The hooks of the plugin `spec` names (imported here, by name), or `NO_HOOKS` for None."""
    if spec is None:
        return NO_HOOKS
    module_name, _, argument = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), "hooks", None)
    if not callable(factory):
        raise InvalidInputError("hooks", f"module {module_name!r} has no hooks(argument) function")
    hooks = factory(argument)
    if not isinstance(hooks, Hooks):
        raise InvalidInputError("hooks", f"{module_name}.hooks() returned {type(hooks).__name__}, not Hooks")
    return hooks
