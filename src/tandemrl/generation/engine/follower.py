"""A tensor-parallel follower's side of the engine (parallel.py): its thread receives the leader's
messages and applies each under the engine's step lock, so every rank runs the same steps on the same
inputs; the follower's own calls (weights handed over, sleep, wake) wait for the leader's.

Invariant: a follower applies an update, sleep or wake exactly where its leader did, between the same two
steps; a message that fails here fails as it did on the leader, and this rank goes on following.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from tandemrl.generation.engine.parallel import from_wire

if TYPE_CHECKING:
    from tandemrl.generation.engine.sequence import Sequence

log = logging.getLogger(__name__)


class Follower:
    """A follower rank's thread and its waits. Reads and writes the engine's state under its step lock only
    (the parts of one engine share that lock and everything it guards)."""

    def __init__(self, engine: Any) -> None:  # the Engine it is part of (engine.py imports this module, not the reverse)
        self.engine = engine
        self.tp = engine.tp
        self.lost_leader = False  # the leader went silent or a message failed here: this rank stopped following
        self.following: dict[int, Sequence] = {}  # unfinished sequences by the leader's seq_id
        self._handed: queue.Queue = queue.Queue(maxsize=1)  # this rank's own weights for the leader's next update
        self._followed = threading.Condition()  # the leader's sleeps and wakes applied here, and those awaited
        self._num_applied = {"sleep": 0, "wake": 0}
        self._num_awaited = {"sleep": 0, "wake": 0}

    def run(self) -> None:
        """The thread: the leader's messages, each applied under the step lock, until it closes."""
        engine = self.engine
        with engine._on_device():
            try:
                while self._apply_one(*self.tp.receive()):
                    pass
            except Exception as error:  # noqa: BLE001 - a rank that cannot follow ends; Engine.follow() says so
                log.error("tensor-parallel rank %d stops following its leader: %s: %s", self.tp.rank, type(error).__name__, error)
                engine._closed = self.lost_leader = True
            finally:
                with self._followed:  # a caller waiting for the leader's sleep or wake waits no more
                    engine._closed = True
                    self._followed.notify_all()

    def _apply_one(self, kind: str, *args: Any) -> bool:
        engine = self.engine
        with engine._step_lock:
            if kind != "tick":
                engine._guarded(engine._finish_ahead)
                try:
                    {"update": self._update, "sleep": engine._sleep_now, "wake": lambda _: engine._wake_now()}[kind](args[0])
                except Exception as error:  # noqa: BLE001 - the leader's same call raised to its caller; this rank goes on
                    log.warning("tensor-parallel rank %d: %s failed as on the leader: %s: %s", self.tp.rank, kind, type(error).__name__, error)
                if kind in self._num_applied:
                    with self._followed:
                        self._num_applied[kind] += 1
                        self._followed.notify_all()
                return True
            wire, run, closed = args
            engine._apply([from_wire(event, self.following) for event in wire])
            if closed:
                engine._fail_all(RuntimeError("the engine was closed"))
                return False
            if run:
                engine._guarded(engine.step)
            return True

    def _update(self, version: int) -> None:
        if self.tp.broadcast_weights:
            self.engine._load_weights(self.tp.shared_weights(None, self.engine.device), version)
            return
        weights, done = self._handed.get(timeout=self.tp.timeout_s)
        try:
            self.engine._load_weights(weights, version)
        finally:
            done.set()

    def hand_over(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """This rank's own tensors, for the leader's next update (whose version they take); returns once
        they are loaded."""
        done = threading.Event()
        self._handed.put((weights, done), timeout=self.tp.timeout_s)
        if not done.wait(self.tp.timeout_s):
            raise TimeoutError(f"the tensor-parallel leader sent no weight update within {self.tp.timeout_s:g} s")

    def await_leader(self, kind: str) -> None:
        """Returns once the leader's next `kind` (sleep or wake) has been applied here (or the engine closed)."""
        with self._followed:
            if not self._followed.wait_for(lambda: self._num_applied[kind] > self._num_awaited[kind] or self.engine._closed, self.tp.timeout_s):
                raise TimeoutError(f"the tensor-parallel leader sent no {kind} within {self.tp.timeout_s:g} s")
            self._num_awaited[kind] += 1
