"""Batching what arrives in one event-loop tick: the calls a caller makes together (a GRPO group, a
step's prompts) reach the backend together, so it batches them as one, whatever the thread timing;
and the way back (Outbox): a backend thread's results of one step reach each loop in one wake-up.

Invariant: the items added during one tick of a loop are handed over in one call, on that loop, once
the tick's other callbacks ran; loops never share a batch. Results put in the outbox are set on their
futures in the order they were put, all of one flush in one callback of their loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

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


class Outbox:
    """Futures of other threads' event loops, resolved in one `call_soon_threadsafe` per loop and flush
    (one a result was one wake-up of the loop each: a syscall and a thread switch, 512 at the end of a
    step where 512 requests finish). `put` and `flush` are called from one thread at a time.

    Example: put(L, f1, a); put(L, f2, b); flush() -> one callback on L sets f1 to a, then f2 to b.
    """

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any]]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any) -> None:
        """`result` is set on `future` at the next flush (raised by it when an exception)."""
        self._pending.setdefault(loop, []).append((future, result))

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, results in pending.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody is waiting
                loop.call_soon_threadsafe(_resolve_all, results)


def _resolve_all(results: list[tuple[asyncio.Future, Any]]) -> None:
    for future, result in results:
        if future.done():
            continue
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)
