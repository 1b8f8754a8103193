"""The task registry: lazy builders, options, and the unknown-name error."""

from __future__ import annotations

import re

import pytest

from tandemrl.tasks import TASKS, get_task
from tandemrl.tasks.base import Task


def test_gsm8k_is_registered_and_builds_without_loading() -> None:
    assert "gsm8k" in TASKS
    task = get_task("gsm8k")
    assert isinstance(task, Task) and task.name == "gsm8k"


def test_options_reach_the_builder(tmp_path) -> None:
    task = get_task("gsm8k", data=str(tmp_path / "local.jsonl"), split="test", limit=3)
    assert task.load.args == (str(tmp_path / "local.jsonl"),)
    assert task.load.keywords == {"split": "test", "limit": 3}


def test_unknown_task_lists_the_names() -> None:
    names = ", ".join(sorted(TASKS))
    with pytest.raises(ValueError, match=f"^{re.escape(f'unknown task {chr(39)}nope{chr(39)}; use one of {names}')}$"):
        get_task("nope")


def test_task_checks_weights_against_functions() -> None:
    with pytest.raises(ValueError, match="has 1 reward weights for 2 reward functions"):
        Task(name="t", description="d", load=list, reward_funcs=["format", "length"], reward_weights=[1.0], recipe={})
