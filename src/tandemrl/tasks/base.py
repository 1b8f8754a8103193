"""A built-in task: where its examples come from, how completions are rewarded, and its recipe.

Invariant: building a Task loads nothing; data is read only when `load()` is called, so listing or
resolving tasks is instant and works offline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandemrl.types import Example


@dataclass(kw_only=True)
class Task:
    """Data + rewards + recipe of one task. Written by its module in tasks/, read by cli/ only."""

    name: str
    description: str
    load: Callable[[], list[Example]]
    """Reads the task's examples (may download them)."""
    reward_funcs: list[str]
    """Names for `rewards.load_reward_funcs`."""
    reward_weights: list[float] | None = None
    """One weight per reward function; None = 1.0 each."""
    recipe: dict[str, Any]
    """Defaults for CLI config fields (e.g. {"model": ..., "learning_rate": ...}); flags override them."""
    lora_recipe: dict[str, Any] = field(default_factory=dict)
    """Defaults over `recipe` with LoRA (--lora_r) on the recipe's own model; flags override them too."""

    def __post_init__(self) -> None:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"task {self.name!r} has {len(self.reward_weights)} reward weights for "
                f"{len(self.reward_funcs)} reward functions; give one weight per function"
            )
