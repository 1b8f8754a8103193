"""The lookup tool task: the code hides behind the tool, the parser, and the rewards of the last turn."""

from __future__ import annotations

import asyncio

from tandemrl.rollout.chat import ChatFormat
from tandemrl.rollout.env import ToolsConfig, open_tool_env
from tandemrl.tasks import get_task
from tandemrl.tasks.tiny import build_tokenizer
from tandemrl.tasks.lookup import CODES, HINT_REPEATS, PROMPT, MarkParser, digit_reward, lookup_examples, secret_reward


def test_every_prompt_is_the_same_and_only_the_row_knows_the_code():
    examples = lookup_examples(100)
    assert {e.prompt for e in examples} == {PROMPT}
    assert {e.columns["secret"] for e in examples} == set(CODES)
    tokenizer = build_tokenizer()  # tandem:tiny's, as `tandem train` builds it (a saved copy reloads as Qwen2's, digit by digit)
    for code in CODES:  # one token each, also where the tool repeats it: copying is one token
        assert tokenizer(code * 3, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(code)] * 3


def test_no_digit_reaches_the_policy_but_through_the_tool():
    """The prompt and the template's turn markers hold no digit, so writing the secret means copying it."""
    tokenizer = build_tokenizer()
    recipe = get_task("lookup").recipe
    config = ToolsConfig(tools=recipe["tools"], tool_call_parser=recipe["tool_call_parser"], max_turns=recipe["max_turns"])

    async def schemas() -> list:
        async with open_tool_env(config) as env:
            return env.tools

    delta = ChatFormat(tokenizer, asyncio.run(schemas())).delta_ids([{"role": "tool", "content": ""}], last_sampled_id=None)
    assert not any(c.isdigit() for c in PROMPT + tokenizer.decode(delta))


def test_a_turn_with_a_call_mark_calls_hint_and_the_tool_answers_with_the_rows_code():
    assert [c.name for c in MarkParser().parse("ab?")] == ["hint"] and MarkParser().parse("ab") == []
    recipe = get_task("lookup").recipe
    config = ToolsConfig(tools=recipe["tools"], tool_call_parser=recipe["tool_call_parser"], max_turns=recipe["max_turns"])
    example = lookup_examples(1)[0]

    async def play() -> list:
        async with open_tool_env(config) as env:
            assert [t["function"]["name"] for t in env.tools] == ["hint"]
            assert env.tools[0]["function"]["parameters"]["properties"] == {}  # the row is not the model's to give
            return await env.step(example, [{"role": "assistant", "content": "#x"}])

    code = example.columns["secret"]
    assert asyncio.run(play()) == [{"role": "tool", "name": "hint", "content": code * HINT_REPEATS}]


def test_the_rewards_read_the_last_assistant_turn_only():
    called = [{"role": "assistant", "content": "67#"}, {"role": "tool", "content": "6767"}, {"role": "assistant", "content": "67a 5"}]
    assert secret_reward([None], [called], secret=["67"]) == [0.5]
    assert digit_reward([None], [called]) == [0.75]
    assert secret_reward([None, None], ["67", ""], secret=["67", "67"]) == [1.0, 0.0]  # single-turn: the text itself; empty: 0
    assert secret_reward([None], ["4242"], secret=["45"]) == [0.0]  # only whole copies count: "42" straddles two codes


def test_without_the_tool_no_answer_expects_more_than_one_fifth():
    """The bar a learned policy must pass: any fixed text scores at most 0.2 on average over the codes."""
    for text in ("0123456789", "6767", "4242", "67#", "abc"):
        mean = sum(secret_reward([None], [text], secret=[code])[0] for code in CODES) / len(CODES)
        assert mean <= 0.2
