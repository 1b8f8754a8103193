"""The order in which examples are drawn: shuffled epochs, reproducible from a seed and resumable.

Invariant: the sequence of indices depends only on (num_examples, seed, shuffle); epoch e is a permutation
shuffled with seed + e (with shuffle False: the dataset's order, every epoch), so a cursor restored from
`state_dict()` continues exactly where it stopped.
"""

from __future__ import annotations

import random
from typing import Any


class PromptCursor:
    """Deterministic shuffled epochs over `num_examples` examples.

    Example: PromptCursor(3, seed=0).take(4) -> a permutation of [0, 1, 2], then the first index of
    epoch 1's permutation; PromptCursor(3, shuffle=False).take(4) -> [0, 1, 2, 0] (TRL's shuffle_dataset false).
    """

    def __init__(self, num_examples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_examples < 1:
            raise ValueError(f"cannot draw prompts from {num_examples} examples; give a dataset with at least one row")
        self.num_examples = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # next index within the epoch's order
        self._order = self._shuffled(0)

    def take(self, k: int) -> list[int]:
        """The next `k` example indices, crossing into the next (reshuffled) epoch when one ends."""
        indices: list[int] = []
        while len(indices) < k:
            if self.position == self.num_examples:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            step = min(k - len(indices), self.num_examples - self.position)
            indices += self._order[self.position : self.position + step]
            self.position += step
        return indices

    @property
    def num_taken(self) -> int:
        """Indices handed out since the start: epoch * num_examples + position."""
        return self.epoch * self.num_examples + self.position

    def seek(self, num_taken: int) -> None:
        """Moves to the state after `num_taken` indices, e.g. to count only the groups actually trained."""
        self.epoch, self.position = divmod(num_taken, self.num_examples)
        self._order = self._shuffled(self.epoch)

    def state_dict(self, *, num_taken: int | None = None) -> dict[str, Any]:
        """The state now, or after the first `num_taken` indices (e.g. only the groups actually trained)."""
        epoch, position = (self.epoch, self.position) if num_taken is None else divmod(num_taken, self.num_examples)
        return {"epoch": epoch, "position": position, "seed": self.seed, "shuffle": self.shuffle, "num_examples": self.num_examples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_examples"] != self.num_examples:
            raise ValueError(
                f"the checkpoint's data cursor is over {state['num_examples']} examples, this dataset has "
                f"{self.num_examples}; resume with the same dataset and size limit"
            )
        # the checkpoint's order goes on, as its seed does (a checkpoint from before shuffle was kept: shuffled)
        self.seed, self.shuffle, self.epoch, self.position = state["seed"], state.get("shuffle", True), state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order
