"""GSM8K grade-school math (Cobbe et al. 2021): chat prompts, a \\boxed{} answer, math_accuracy + format.

Invariant: every Example keeps the dataset's full `answer` and adds `solution`, the final answer after
"####", which is what math_accuracy compares against.
"""

from __future__ import annotations

import functools
from typing import Any

from tandemrl.data.load import load_rows
from tandemrl.rewards.builtins import reference_answer
from tandemrl.tasks.base import Task
from tandemrl.types import Example

HUB_ID = "openai/gsm8k:main"
SYSTEM_PROMPT = (
    "Solve the math problem step by step. Show your reasoning, then give the final answer as a number "
    "in \\boxed{}, for example \\boxed{42}."
)
RECIPE: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "num_generations": 8,
    "max_prompt_length": 512,
    "max_completion_length": 512,
    "learning_rate": 1e-6,
    "beta": 0.0,
    "temperature": 1.0,
}


def gsm8k_examples(rows: list[dict[str, Any]]) -> list[Example]:
    """Rows with `question` and `answer` into chat-prompt Examples.

    Example: [{"question": "2+3?", "answer": "2+3=5 #### 5"}] -> Example(prompt=[system, {"role": "user",
    "content": "2+3?"}], columns={"answer": "2+3=5 #### 5", "solution": "5"}, index=0)
    """
    return [_example(row, i) for i, row in enumerate(rows)]


def load_gsm8k(data: str = HUB_ID, *, split: str = "train", limit: int | None = None) -> list[Example]:
    """GSM8K from the hub (default) or from a local .jsonl/.json/.parquet/saved dataset of the same columns."""
    return gsm8k_examples(load_rows(data, split=split, limit=limit))


def build_task(data: str | None = None, *, split: str = "train", limit: int | None = None) -> Task:
    """The gsm8k task; `data` replaces the hub dataset with a local one (question/answer columns)."""
    return Task(
        name="gsm8k",
        description="GSM8K grade-school math word problems; the final answer goes in \\boxed{}",
        load=functools.partial(load_gsm8k, data or HUB_ID, split=split, limit=limit),
        reward_funcs=["math_accuracy", "format"],
        reward_weights=[1.0, 0.1],  # correctness dominates; format only breaks ties early in training
        recipe=dict(RECIPE),
    )


def _example(row: dict[str, Any], index: int) -> Example:
    if not isinstance(row.get("question"), str) or row.get("answer") is None:
        raise ValueError(
            f"row {index} of the GSM8K data lacks a 'question' string or an 'answer'; give rows with both columns"
        )
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]
    columns = {k: v for k, v in row.items() if k != "question"}
    columns["solution"] = reference_answer(row["answer"])
    return Example(prompt=prompt, columns=columns, index=index)
