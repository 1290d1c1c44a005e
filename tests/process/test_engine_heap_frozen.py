"""`troupe.engine.child.startup_heap_frozen`: what is alive when an engine starts serving leaves the cyclic collector's
generations until the engine stops; garbage from before is collected, not frozen; the way out unfreezes,
also when serving fails."""

from __future__ import annotations

import gc
import weakref

import pytest

from troupe.engine.child import startup_heap_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_live_objects_are_frozen_while_serving_and_garbage_is_not() -> None:
    assert gc.get_freeze_count() == 0
    alive = _Node()
    dead = weakref.ref(_Node())  # unreachable cycle, not collected yet
    with startup_heap_frozen():
        assert dead() is None  # collected on the way in, not frozen with the rest
        assert gc.get_freeze_count() > 0
        assert not _tracked(alive)  # in the permanent generation: full collections skip it
        made_later = _Node()
        assert _tracked(made_later)  # what the step loop makes is collected as usual
    assert gc.get_freeze_count() == 0
    assert _tracked(alive)


def test_unfrozen_when_serving_fails() -> None:
    with pytest.raises(RuntimeError, match="engine failed"), startup_heap_frozen():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("engine failed")
    assert gc.get_freeze_count() == 0
