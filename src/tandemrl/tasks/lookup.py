"""A tool task the tiny built-in policy plays on a CPU: which characters to write is behind a tool.

Every prompt is the same, `secret:`; each example hides a class (digits, lowercase or uppercase) that
only the `hint` tool tells. The reward is the fraction of the last turn's characters in that class, so
a policy that never calls the tool can expect 1/3 at best (it cannot know the class), and one that
calls it and writes what it reads can reach 1. `tool_use` (weight 0.2) pays a call that was answered.
A random-init model cannot write Hermes JSON by chance, so this task reads calls its own way: a turn
with a call mark in it calls `hint` (`--tool_call_parser tandemrl.tasks.lookup:MarkParser`, the plug-in
point a model with another call format uses), and the recipe stops a turn at a mark, because only a
turn that ends (rather than running out of tokens) gets an answer. It exercises the whole multi-turn
path: tool schemas through the chat template, tool answers as untrained context, rewards on the
conversation. Measured on a CPU, the tiny policy learns to call the tool within ~40 steps but not, in
150 steps, to write what it reads (README: "Train an agent with your MCP server").
"""

from __future__ import annotations

import random
from typing import Any

from tandemrl.rollout.chat import ToolCall
from tandemrl.tasks.base import Task
from tandemrl.tasks.synthetic import CLASSES, TINY_MODEL, char_class_reward
from tandemrl.types import Example


def lookup_examples(num_examples: int = 3000, seed: int = 0) -> list[Example]:
    """Example: -> [Example(prompt=[{"role": "user", "content": "secret:"}], columns={"char_class": "digits"}, index=0), ...]"""
    rng = random.Random(seed)
    names = sorted(CLASSES)
    return [
        Example(prompt=[{"role": "user", "content": "secret:"}], columns={"char_class": rng.choice(names)}, index=i)
        for i in range(num_examples)
    ]


def hint(example: Example):  # noqa: ANN201 - no return hint: the schema in every prompt stays short
    """Names the characters to write."""
    name = example.columns["char_class"]
    return f"{name}: {CLASSES[name]}"


CALL_MARKS = ("?", "!", "#", "*")  # the recipe also stops a turn at any of them (a turn must end to call)


class MarkParser:
    """A turn with a call mark (`?`, `!`, `#` or `*`) in it calls `hint` (no arguments).

    Example: parse("ab?") -> [ToolCall(name="hint", arguments={})]; parse("abc") -> []
    """

    def parse(self, text: str) -> list[ToolCall]:
        return [ToolCall(name="hint", arguments={})] if any(mark in text for mark in CALL_MARKS) else []


def last_turn_class_reward(prompts: list[Any], completions: list[Any], char_class: list[str], **_: Any) -> list[float]:
    """char_class_reward of the conversation's last assistant turn.

    Example: last_turn_class_reward([p], [[{"role": "assistant", "content": "?"}, {"role": "tool", "content": "digits"},
    {"role": "assistant", "content": "123"}]], char_class=["digits"]) -> [1.0]
    """
    last = [
        c if isinstance(c, str) else next((m.get("content") or "" for m in reversed(c) if m.get("role") == "assistant"), "")
        for c in completions
    ]  # a single-turn completion (run without the tool) is its own last turn
    return char_class_reward(prompts, last, char_class)


def build_task(data: str | None = None, split: str = "train") -> Task:
    if data:
        raise ValueError("the lookup task makes its own data; drop --dataset or pick another --task")
    return Task(
        name="lookup",
        description="write the characters a tool names: a multi-turn tool task the tiny model plays on a CPU",
        load=lookup_examples,
        reward_funcs=["tandemrl.tasks.lookup:last_turn_class_reward", "tandemrl.tasks.calculator:tool_use"],
        reward_weights=[1.0, 0.2],
        recipe=dict(
            model=TINY_MODEL,
            tools=("tandemrl.tasks.lookup:hint",),
            tool_call_parser="tandemrl.tasks.lookup:MarkParser",
            generation_kwargs={"stop": list(CALL_MARKS)},
            max_turns=2,
            max_total_tokens=400,
            max_prompt_length=320,
            max_completion_length=8,
            num_prompts_per_step=16,
            num_generations=8,
            max_steps=150,
            learning_rate=1e-3,
            max_tokens_per_microbatch=1024,
            warmup_steps=0,
            temperature=1.0,
            loss_type="grpo",
            save_steps=50,
            log_completions_steps=25,
        ),
    )
