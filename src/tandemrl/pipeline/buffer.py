"""The rollout buffer between the producer and the trainer: rounds of groups admitted in order.

Invariant (policy lag <= S + K - 1): group j (0-based, in admission order) belongs to step j // P. Groups
are admitted a generation round at a time (K = --steps_per_generation steps; K = 1: one step), and a
round whose first step is a is admitted only once every group before group (a - S) P is released, i.e.
once the weights trained on step a - S - 1 (version a - S) are live on the generators. Its last step
is at most a + K - 1, so every token of a group trained at step k was sampled by a version
>= k - S - (K - 1). S = 0, K = 1 is the synchronous loop: a step's P groups are admitted only after the
previous step's weights are live.

The trainer takes groups in admission order, whatever order they complete in, so a run is a function of
its seed, not of timing.

Legend: P groups per step, S max staleness, K steps per generation round.
"""

from __future__ import annotations

import asyncio

from tandemrl.types import Group


class RolloutBuffer:
    """Admission of rounds and the finished groups waiting to be trained. Used from one event loop.

    `lead` is S x P: how many groups past the released ones a round may start.
    Example (P = 2, S = 0, so lead 0): admit(2) -> range(0, 2); a second admit(2) waits; put(1, g1),
    put(0, g0); take(2) -> [g0, g1]; release(2) lets range(2, 4) in.
    """

    def __init__(self, *, lead: int, first_index: int = 0) -> None:
        if lead < 0:
            raise ValueError(f"a rollout buffer's lead is >= 0 groups, got {lead}")
        self.lead = lead
        self._released = first_index  # groups before this index are trained and their weights live
        self._next_admit = first_index
        self._next_take = first_index
        self._done: dict[int, Group] = {}
        self._error: BaseException | None = None
        self.waiting_for: range | None = None  # the admissions take() waits for, while it waits
        self._changed = asyncio.Event()

    async def admit(self, num_groups: int) -> range:
        """Waits until the next round may start, then admits its `num_groups` groups and returns their
        indices; never yields when it may start (so a round's groups reach the generator in one tick)."""
        while self._next_admit - self._released > self.lead:
            self._changed.clear()
            await self._changed.wait()
        self._next_admit += num_groups
        return range(self._next_admit - num_groups, self._next_admit)

    def put(self, index: int, group: Group | None) -> None:
        """Hands in the finished (generated and scored) group of admission `index` (None: another rank's)."""
        assert self._next_take <= index < self._next_admit and index not in self._done, f"group {index} put twice or never admitted"
        self._done[index] = group
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """A producer's group raised (not a rollout error: those are data): the next take() raises it."""
        self._error = self._error or error
        self._changed.set()

    async def take(self, num_groups: int) -> list[Group]:
        """The next `num_groups` groups in admission order, once all of them are finished."""
        wanted = range(self._next_take, self._next_take + num_groups)
        self.waiting_for = wanted
        try:
            while not all(i in self._done for i in wanted):
                if self._error is not None:
                    raise self._error
                self._changed.clear()
                await self._changed.wait()
        finally:
            self.waiting_for = None
        self._next_take += num_groups
        return [self._done.pop(i) for i in wanted]

    def release(self, num_groups: int) -> None:
        """Marks the next `num_groups` taken groups trained; call once their trained weights are live."""
        assert self._released + num_groups <= self._next_take, "released more groups than were taken"
        self._released += num_groups
        self._changed.set()

    def has(self, index: int) -> bool:
        return index in self._done

    @property
    def num_in_flight(self) -> int:
        """Admitted groups not yet taken by the trainer (generating or finished)."""
        return self._next_admit - self._next_take

    @property
    def num_ready(self) -> int:
        """Finished groups waiting for the trainer."""
        return len(self._done)
