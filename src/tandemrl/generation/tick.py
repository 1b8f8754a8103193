"""Batching what arrives in one event-loop tick: the calls a caller makes together (a GRPO group, a
step's prompts) reach the backend together, so it batches them as one, whatever the thread timing.

Invariant: the items added during one tick of a loop are handed over in one call, on that loop, once
the tick's other callbacks ran; loops never share a batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TickBatcher(Generic[T]):
    """`add` items during a tick; `hand_over(items)` is called once per tick with all of them.

    Example: three `add`s in one tick of loop L -> one hand_over([a, b, c]) on L.
    """

    def __init__(self, hand_over: Callable[[list[T]], None]):
        self._hand_over = hand_over
        self._pending: dict[asyncio.AbstractEventLoop, list[T]] = {}

    def add(self, item: T) -> None:
        loop = asyncio.get_running_loop()
        pending = self._pending.setdefault(loop, [])
        pending.append(item)
        if len(pending) == 1:
            loop.call_soon(self._flush, loop)

    def discard(self, item: T) -> bool:
        """Takes back an item of the running loop's tick not handed over yet; False if it was."""
        pending = self._pending.get(asyncio.get_running_loop(), [])
        if not any(i is item for i in pending):
            return False
        pending[:] = [i for i in pending if i is not item]
        return True

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self._hand_over(self._pending.pop(loop, []))
