"""`heap.freeze_startup_heap`: start-up's garbage collected, the survivors out of the collector's
passes, later objects collected as before, and `thaw_heap` handing the frozen ones back."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from pagekeeper_engine.heap import freeze_startup_heap, thaw_heap


class Node:
    """A tracked object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[weakref.ref[Node], weakref.ref[Node]]:
    """Two nodes that only reference each other: garbage only a collection frees."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a), weakref.ref(b)


def is_walked(obj: object) -> bool:
    """Whether a collection pass would walk `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def thawed() -> Iterator[None]:
    thaw_heap()
    yield
    thaw_heap()


@pytest.mark.usefixtures("thawed")
def test_start_up_garbage_is_collected_and_the_survivors_frozen() -> None:
    dead = cycle()
    kept = Node()
    assert is_walked(kept)
    frozen = freeze_startup_heap("test")
    # Nothing joins the frozen set after the freeze, but frozen objects a refcount frees (the
    # log call's, another thread's) leave it: the count can only fall.
    assert 0 < gc.get_freeze_count() <= frozen
    assert dead[0]() is None and dead[1]() is None  # freed before the freeze, not kept in it
    assert not is_walked(kept)


@pytest.mark.usefixtures("thawed")
def test_objects_made_after_the_freeze_are_collected_as_before() -> None:
    freeze_startup_heap("test")
    later = cycle()
    assert later[0]() is not None
    gc.collect()
    assert later[0]() is None and later[1]() is None


@pytest.mark.usefixtures("thawed")
def test_a_frozen_cycle_waits_for_the_thaw() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    refs = weakref.ref(a), weakref.ref(b)
    freeze_startup_heap("test")
    del a, b
    gc.collect()
    assert refs[0]() is not None  # frozen: no pass walks it
    thaw_heap()
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
