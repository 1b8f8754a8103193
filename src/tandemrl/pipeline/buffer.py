"""The rollout buffer: (S + 1) x P admission slots between the producers and the trainer.

Invariant (policy lag <= S): group j (0-based, in admission order) belongs to step j // P. It is admitted
only once a slot is free, and a slot is freed only after the weights trained on its group are live on the
generators. With (S + 1) x P slots, group j therefore waits for group j - (S + 1) P (step k - S - 1) to be
released, i.e. for version k - S to be live: every token of a group trained at step k was sampled by a
version >= k - S. S = 0 is the synchronous loop: a step's P groups are admitted only after the previous
step's weights are live.

The trainer takes groups in admission order, whatever order they complete in, so a run is a function of
its seed, not of timing.

Legend: P groups per step, S max staleness.
"""

from __future__ import annotations

import asyncio

from tandemrl.types import Group


class RolloutBuffer:
    """Admission slots and the finished groups waiting to be trained. Used from one event loop.

    Example (P = 2, S = 0): admit() -> 0, admit() -> 1, a third admit() waits; put(1, g1), put(0, g0);
    take(2) -> [g0, g1]; release(2) lets admissions 2 and 3 in.
    """

    def __init__(self, *, num_slots: int, first_index: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"a rollout buffer needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = num_slots
        self._next_admit = first_index
        self._next_take = first_index
        self._done: dict[int, Group] = {}
        self._error: BaseException | None = None
        self.waiting_for: range | None = None  # the admissions take() waits for, while it waits
        self._changed = asyncio.Event()

    async def admit(self) -> int:
        """Waits for a free slot and returns the admitted group's index; never yields when one is free
        (so a step's groups are admitted, and reach the generator, in one event-loop tick)."""
        while self._free == 0:
            self._changed.clear()
            await self._changed.wait()
        self._free -= 1
        self._next_admit += 1
        return self._next_admit - 1

    def put(self, index: int, group: Group) -> None:
        """Hands in the finished (generated and scored) group of admission `index`."""
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
        """Frees the slots of `num_groups` trained groups; call once their trained weights are live."""
        assert self._free + num_groups <= self.num_slots, "released more slots than were taken"
        self._free += num_groups
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
