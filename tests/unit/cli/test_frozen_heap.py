"""frozen_heap: objects alive at its start are out of the collector's sight for the block, then back;
young collections are rarer inside it."""

from __future__ import annotations

import gc

import pytest

from tandemrl.cli import YOUNG_THRESHOLD, frozen_heap


class _Node:
    pass


def test_the_heap_is_frozen_inside_and_thawed_after_even_on_error():
    alive = [_Node() for _ in range(100)]
    assert gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    with pytest.raises(RuntimeError), frozen_heap():
        assert gc.get_freeze_count() >= len(alive)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *thresholds[1:])
        made_inside = _Node()
        assert any(o is made_inside for o in gc.get_objects())  # new objects are still collected
        assert not any(o is alive[0] for o in gc.get_objects())  # the frozen ones are not scanned
        raise RuntimeError("the block fails")
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    assert any(o is alive[0] for o in gc.get_objects())
