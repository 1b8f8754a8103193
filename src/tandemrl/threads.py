"""Blocking calls with a deadline: a call that may never return (a user's reward, torch's rendezvous with
a silent peer) runs in a daemon thread of its own, so the awaiting side can stop waiting, and neither the
event loop's shutdown nor the interpreter's exit waits for what was left behind."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


class Escaped(Exception):
    """A SystemExit or KeyboardInterrupt that a call raised in its daemon thread (`error`), handed to the
    waiter as an ordinary error: raised in the event loop as itself, it would end the loop."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        self.error = error


_ABANDONED: list[threading.Thread] = []  # threads whose waiter gave up; they run on (Python cannot stop a thread)


def still_running_abandoned(name: str) -> int:
    """How many threads named `name` whose waiter gave up (its deadline passed) are still running."""
    _ABANDONED[:] = [thread for thread in _ABANDONED if thread.is_alive()]
    return sum(thread.name == name for thread in _ABANDONED)


def in_daemon_thread(call: Callable[[], Any], *, name: str) -> asyncio.Future:
    """A future of `call()`, run in a daemon thread named `name`; bound the wait with asyncio.timeout (a
    thread whose waiter gave up is counted by `still_running_abandoned` until it ends)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(error: BaseException | None, result: Any) -> None:
        if not future.done():  # else the waiter gave up: the late outcome is dropped
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        try:
            outcome: tuple[BaseException | None, Any] = (None, call())
        except StopIteration:  # a future cannot hold one (set_exception refuses it): the waiter would wait its deadline
            outcome = (RuntimeError("raised StopIteration"), None)
        except Exception as error:  # noqa: BLE001 - handed to the awaiting task
            outcome = (error, None)
        except BaseException as error:  # SystemExit, KeyboardInterrupt raised by the call itself (signals reach the
            outcome = (Escaped(error), None)  # main thread only): it ended the thread, and the waiter waited its deadline
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    thread = threading.Thread(target=work, name=name, daemon=True)
    future.add_done_callback(lambda done: _ABANDONED.append(thread) if done.cancelled() else None)
    thread.start()
    return future
