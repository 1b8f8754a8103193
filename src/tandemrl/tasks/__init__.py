"""Built-in tasks by name. Each entry imports its module only when asked for, so the registry is cheap.

To add a task: write tasks/<name>.py with `build_task(**options) -> Task` and add one line to TASKS.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tandemrl.tasks.base import Task


def _lazy(module: str) -> Callable[..., Task]:
    """A builder that imports `module` on first use and calls its `build_task`."""

    def build(**options: Any) -> Task:
        return importlib.import_module(module).build_task(**options)

    return build


TASKS: dict[str, Callable[..., Task]] = {
    "calculator": _lazy("tandemrl.tasks.calculator"),
    "gsm8k": _lazy("tandemrl.tasks.gsm8k"),
    "lookup": _lazy("tandemrl.tasks.lookup"),
    "synthetic": _lazy("tandemrl.tasks.synthetic"),
}


def get_task(name: str, **options: Any) -> Task:
    """The task registered as `name`, built with `options` (e.g. gsm8k's `data="local.jsonl"`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; use one of {', '.join(sorted(TASKS))}")
    return TASKS[name](**options)


__all__ = ["TASKS", "Task", "get_task"]
