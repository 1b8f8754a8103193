"""Arithmetic that wants a calculator: the built-in tool task (multi-turn rollouts with a Python tool).

A prompt asks for a product and sum of 3-4 digit numbers, which a 0.5B model gets wrong by mental
arithmetic but right through the `calculator` tool. Rewards see the whole conversation: `answer_accuracy`
(the last turn's <answer>, or its last number, equals the value) and `tool_use` (a tool answered
without error), weighted 1.0 and 0.2. The same tool served over MCP is tasks/mcp_server.py.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from tandemrl.tasks.base import Task
from tandemrl.types import Example

SYSTEM_PROMPT = (
    "You can call a calculator. Call it for every computation, then give the final result as "
    "<answer>NUMBER</answer>."
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "4821 * 37 + 905".
    """
    return _format(_eval(ast.parse(expression, mode="eval").body))


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / // % and parentheses are allowed")


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def calculator_examples(num_examples: int = 2000, seed: int = 0) -> list[Example]:
    """Example: -> [Example(prompt=[system, {"role": "user", "content": "What is 4821 * 37 + 905?"}],
    columns={"answer": "179282"}, index=0), ...]"""
    rng = random.Random(seed)
    examples = []
    for i in range(num_examples):
        a, b, c = rng.randint(100, 9999), rng.randint(11, 99), rng.randint(100, 9999)
        expression = f"{a} * {b} + {c}"
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {expression}?"}]
        examples.append(Example(prompt=prompt, columns={"answer": calculator(expression)}, index=i))
    return examples


def _final_text(completion: Any) -> str:
    """The last assistant turn's text (conversational form), or the completion itself (a string)."""
    if isinstance(completion, str):
        return completion
    turns = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return turns[-1] if turns else ""


def answer_accuracy(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the final turn's <answer> (or, lacking one, its last number) equals the value.

    Example: answer_accuracy([p], [[{"role": "assistant", "content": "<answer>12</answer>"}]], answer=["12"]) -> [1.0]
    """
    scores = []
    for completion, expected in zip(completions, answer):
        text = _final_text(completion)
        tagged = re.findall(r"<answer>\s*(-?[\d,.]+)\s*</answer>", text)
        numbers = tagged or re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        scores.append(float(bool(numbers) and numbers[-1].replace(",", "") == expected))
    return scores


def tool_use(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """1.0 when at least one tool call of the conversation was answered without an error."""
    return [
        float(not isinstance(c, str) and any(m.get("role") == "tool" and not str(m.get("content")).startswith("error:") for m in c))
        for c in completions
    ]


def build_task(data: str | None = None, split: str = "train") -> Task:
    if data:
        raise ValueError("the calculator task makes its own data; drop --dataset or pick another --task")
    return Task(
        name="calculator",
        description="arithmetic with a calculator tool: multi-turn rollouts, rewards on the final answer",
        load=calculator_examples,
        reward_funcs=["tandemrl.tasks.calculator:answer_accuracy", "tandemrl.tasks.calculator:tool_use"],
        reward_weights=[1.0, 0.2],
        recipe=dict(
            # the tiny built-in policy never emits a <tool_call> by chance, so learning needs a model that
            # knows the Hermes format: Qwen2.5-0.5B-Instruct (GPU) is the bar this recipe is written for
            model="Qwen/Qwen2.5-0.5B-Instruct",
            tools=("tandemrl.tasks.calculator:calculator",),
            max_turns=3,
            max_total_tokens=1024,
            max_prompt_length=512,
            max_completion_length=256,
            num_prompts_per_step=16,
            num_generations=8,
            max_steps=200,
            learning_rate=1e-6,
            beta=0.0,
            temperature=1.0,
        ),
    )
