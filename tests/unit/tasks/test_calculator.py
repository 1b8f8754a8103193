"""The calculator tool task: its tool, data and rewards on hand-written conversations."""

from __future__ import annotations

import pytest

from tandemrl.tasks import get_task
from tandemrl.tasks.calculator import answer_accuracy, calculator, calculator_examples, tool_use


def test_calculator_evaluates_arithmetic_only():
    assert calculator("4821 * 37 + 905") == "179282"
    assert calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calculator("__import__('os').system('true')")


def test_examples_carry_their_value():
    example = calculator_examples(3)[0]
    expression = example.prompt[-1]["content"].removeprefix("What is ").removesuffix("?")
    assert example.columns["answer"] == calculator(expression)


def test_rewards_read_the_whole_conversation():
    called = [
        {"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "so <answer>12</answer>"},
    ]
    failed = [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "error: unknown tool"}, {"role": "assistant", "content": "13"}]
    assert answer_accuracy([None] * 2, [called, failed], answer=["12", "12"]) == [1.0, 0.0]
    assert tool_use([None] * 2, [called, failed]) == [1.0, 0.0]
    assert get_task("calculator").recipe["tools"] == ("tandemrl.tasks.calculator:calculator",)
