"""A request whose client hangs up is cancelled: its generations are aborted, never run for nobody (and a
trainer that hangs up mid weight update has that update given up)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def until_done_or_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Awaits `work`; if the client hangs up first, cancels it (aborting its generations)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.create_task(disconnected(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
            work_task.add_done_callback(_retrieve)  # nobody awaits it now: its CancelledError is not an error
    if not work_task.done() or work_task.cancelled():  # the client hung up; a cancelled task is done a moment later
        return None
    return work_task.result()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def disconnected(request: Request) -> None:
    """Returns once the client hangs up (its request body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
