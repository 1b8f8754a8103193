"""A tool task the tiny built-in policy learns on a CPU: the code to write is known only to a tool.

Every prompt is the same; each example hides one of five two-digit codes that only the `hint` tool
tells. `secret_reward` is the share of the last turn's characters spent on whole copies of the code, so
a policy that never calls the tool can expect 0.2 at best (it cannot know the code), and one that calls
it and copies what it reads reaches 1. The task is shaped so that copying is all a tiny transformer
has to learn: each code is one token of the tiny tokenizer (its BPE merged "01", "23", ...; a policy
asked for one digit learns to write the pair that holds it and stalls at half), only whole copies
count (the merge "42" straddles two codes), no digit appears elsewhere in the context (the prompt is
plain ChatML without the tool schemas, which a random-init model cannot read and which would make
the context five times longer), and the tool repeats the code, so it is a large share of what the
policy attends over. Partial credit makes the way there smooth: `digit_reward` (weight 0.2) pays any
digit, `tool_use` (0.2) a call that was answered.
A random-init model cannot write Hermes JSON by chance, so this task reads calls its own way: a turn
with a call mark in it calls `hint` (`--tool_call_parser tandemrl.tasks.lookup:MarkParser`, the plug-in
point a model with another call format uses), and the recipe stops a turn at a mark, because only a
turn that ends (rather than running out of tokens) gets an answer. Tool answers reach the policy as
the chat template's token delta (untrained context); rewards see the conversation. README ("Train an
agent with your MCP server") has the measured curve.
"""

from __future__ import annotations

import random
import string
from typing import Any

from tandemrl.rollout.chat import ToolCall
from tandemrl.tasks.base import Task
from tandemrl.tasks.synthetic import TINY_MODEL
from tandemrl.types import Example

CODES = ("01", "23", "45", "67", "89")  # each one token of the tiny tokenizer (its BPE merged these pairs)
HINT_REPEATS = 24  # the code, written this often, is a larger share of the context the policy attends over


PROMPT = "<|im_start|>user\nsecret:<|im_end|>\n<|im_start|>assistant\n"  # ChatML of one user turn, no tool schemas


def lookup_examples(num_examples: int = 3000, seed: int = 0) -> list[Example]:
    """Example: -> [Example(prompt=PROMPT, columns={"secret": "67"}, index=0), ...]"""
    rng = random.Random(seed)
    return [Example(prompt=PROMPT, columns={"secret": rng.choice(CODES)}, index=i) for i in range(num_examples)]


def hint(example: Example):  # noqa: ANN201 - no return hint: the tool's schema stays bare
    """Tells the secret."""
    return example.columns["secret"] * HINT_REPEATS


CALL_MARKS = ("?", "!", "#", "*")  # the recipe also stops a turn at any of them (a turn must end to call)


class MarkParser:
    """A turn with a call mark (`?`, `!`, `#` or `*`) in it calls `hint` (no arguments).

    Example: parse("ab?") -> [ToolCall(name="hint", arguments={})]; parse("abc") -> []
    """

    def parse(self, text: str) -> list[ToolCall]:
        return [ToolCall(name="hint", arguments={})] if any(mark in text for mark in CALL_MARKS) else []


def _last_turn(completion: Any) -> list[str]:
    """The non-space characters of the conversation's last assistant turn (a string is its own last turn)."""
    if not isinstance(completion, str):
        completion = next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")
    return [c for c in completion if not c.isspace()]


def secret_reward(prompts: list[Any], completions: list[Any], secret: list[str], **_: Any) -> list[float]:
    """Share of the last assistant turn's non-space characters spent on copies of the secret code; empty scores 0.

    Example: secret_reward([p], [[{"role": "assistant", "content": "?"}, {"role": "tool", "content": "6767"},
    {"role": "assistant", "content": "6767a"}]], secret=["67"]) -> [0.8]
    """
    scores = []
    for completion, code in zip(completions, secret):
        text = "".join(_last_turn(completion))
        scores.append(text.count(code) * len(code) / len(text) if text else 0.0)
    return scores


def digit_reward(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """Fraction of the last assistant turn's non-space characters that are digits (partial credit).

    Example: digit_reward([p], ["12ab"]) -> [0.5]
    """
    scores = []
    for completion in completions:
        chars = _last_turn(completion)
        scores.append(sum(c in string.digits for c in chars) / len(chars) if chars else 0.0)
    return scores


def build_task(data: str | None = None, split: str = "train") -> Task:
    if data:
        raise ValueError("the lookup task makes its own data; drop --dataset or pick another --task")
    return Task(
        name="lookup",
        description="write the digit only a tool knows: a multi-turn tool task the tiny model learns on a CPU",
        load=lookup_examples,
        reward_funcs=[
            "tandemrl.tasks.lookup:secret_reward", "tandemrl.tasks.lookup:digit_reward", "tandemrl.tasks.calculator:tool_use",
        ],
        reward_weights=[1.0, 0.2, 0.2],
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
            max_steps=200,
            learning_rate=2e-3,
            max_tokens_per_microbatch=1024,
            warmup_steps=0,
            temperature=1.0,
            loss_type="grpo",
            save_steps=50,
            log_completions_steps=25,
        ),
    )
