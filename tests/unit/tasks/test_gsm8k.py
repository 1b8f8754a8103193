"""The gsm8k task on literal rows and a local file: no hub access."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandemrl.rewards.base import load_reward_funcs, score
from tandemrl.tasks.gsm8k import RECIPE, SYSTEM_PROMPT, build_task, gsm8k_examples

ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nTotal 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A pen costs $1,200 / 100. How much?", "answer": "1200/100 = 12\n#### 12"},
]


def test_rows_become_chat_prompts_with_answer_and_solution() -> None:
    examples = gsm8k_examples(ROWS)
    assert examples[0].prompt == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": ROWS[0]["question"]},
    ]
    assert examples[0].columns == {"answer": ROWS[0]["answer"], "solution": "72"}
    assert [e.index for e in examples] == [0, 1] and examples[1].columns["solution"] == "12"
    assert "\\boxed{}" in SYSTEM_PROMPT


def test_rows_without_question_or_answer_say_the_fix() -> None:
    with pytest.raises(ValueError, match="row 1 of the GSM8K data lacks a 'question' string or an 'answer'"):
        gsm8k_examples([ROWS[0], {"question": "q"}])


def test_task_loads_a_local_jsonl_lazily(tmp_path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    task = build_task(str(path), limit=1)  # the file does not exist yet: building reads nothing
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    examples = task.load()
    assert len(examples) == 1 and examples[0].columns["solution"] == "72"


def test_task_rewards_score_a_correct_and_a_wrong_completion() -> None:
    task = build_task()
    example = gsm8k_examples(ROWS)[0]
    funcs = load_reward_funcs(task.reward_funcs)
    completions = ["48 + 24 = 72, so the answer is \\boxed{72}.", "The answer is 70."]
    columns = {k: [v, v] for k, v in example.columns.items()}
    totals, values = asyncio.run(score(funcs, task.reward_weights, [example.prompt] * 2, completions, columns))
    assert values == {"math_accuracy": [1.0, 0.0], "format": [1.0, 0.0]}
    assert totals == [pytest.approx(1.1), 0.0]


def test_recipe_defaults() -> None:
    task = build_task()
    assert task.name == "gsm8k" and task.reward_funcs == ["math_accuracy", "format"]
    assert task.recipe["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and task.recipe["num_generations"] == 8
    assert task.recipe is not RECIPE
