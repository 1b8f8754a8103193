"""The lookup tool task: the class hides behind the tool, the parser, and the reward of the last turn."""

from __future__ import annotations

import asyncio

from tandemrl.rollout.env import ToolsConfig, open_tool_env
from tandemrl.tasks import get_task
from tandemrl.tasks.synthetic import CLASSES
from tandemrl.tasks.lookup import MarkParser, last_turn_class_reward, lookup_examples


def test_every_prompt_is_the_same_and_only_the_row_knows_the_class():
    examples = lookup_examples(30)
    assert {str(e.prompt) for e in examples} == {str([{"role": "user", "content": "secret:"}])}
    assert {e.columns["char_class"] for e in examples} == {"digits", "lowercase", "uppercase"}


def test_a_turn_with_a_call_mark_calls_hint_and_the_tool_answers_with_the_rows_class():
    assert [c.name for c in MarkParser().parse("ab?")] == ["hint"] and MarkParser().parse("ab") == []
    recipe = get_task("lookup").recipe
    config = ToolsConfig(tools=recipe["tools"], tool_call_parser=recipe["tool_call_parser"], max_turns=recipe["max_turns"])
    example = lookup_examples(1)[0]

    async def play() -> list:
        async with open_tool_env(config) as env:
            assert [t["function"]["name"] for t in env.tools] == ["hint"]
            assert env.tools[0]["function"]["parameters"]["properties"] == {}  # the row is not the model's to give
            return await env.step(example, [{"role": "assistant", "content": "#x"}])

    name = example.columns["char_class"]
    assert asyncio.run(play()) == [{"role": "tool", "name": "hint", "content": f"{name}: {CLASSES[name]}"}]


def test_the_reward_reads_the_last_assistant_turn_only():
    called = [{"role": "assistant", "content": "#"}, {"role": "tool", "content": "digits"}, {"role": "assistant", "content": "12a4"}]
    assert last_turn_class_reward([None, None], [called, [{"role": "assistant", "content": "AB"}]], char_class=["digits", "uppercase"]) == [0.75, 1.0]
    assert last_turn_class_reward([None], ["ab"], char_class=["lowercase"]) == [1.0]  # single-turn: the text itself
