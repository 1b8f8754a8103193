"""Multi-turn rollouts with a scripted generator: token-exact traces, loss mask token by token, limits."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from tandemrl.rollout.chat import ChatFormat, HermesParser, decoder_of
from tandemrl.rollout.env import ToolEnv
from tandemrl.rollout.run import MultiTurn, completion_text, completion_token_ids, play
from tandemrl.rollout.tools import ToolBox, python_tool
from tandemrl.types import Completion, Example, RolloutStatus, SamplingParams

CALL = '<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class ScriptedGenerator:
    """Answers turn k with script[k]; its version moves on after every turn; records every prompt."""

    def __init__(self, script: list[list[int]]):
        self.script, self.prompts, self.version = list(script), [], 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.prompts.append(list(prompt_ids))
        ids = self.script.pop(0)[: params.max_tokens]
        stopped = bool(ids) and ids[-1] in params.stop_token_ids
        version, self.version = self.version, self.version + 1
        return Completion(
            token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop" if stopped else "length", policy_versions=[version] * len(ids)
        )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def setup(tokenizer, script_texts: list[str], *, max_turns: int = 3, max_total_tokens: int = 1024):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = [encode(tokenizer, text) + [im_end] for text in script_texts]
    tool = python_tool(add)
    chat = ChatFormat(tokenizer, tools=[tool.schema])
    env = ToolEnv(ToolBox([tool], timeout_s=5), HermesParser())
    prompt = [{"role": "user", "content": "what is 2 + 3 + 4?"}]
    prompt_ids = tokenizer.apply_chat_template(prompt, tools=[tool.schema], add_generation_prompt=True, tokenize=True)["input_ids"]
    mt = MultiTurn(env=env, chat=chat, max_turns=max_turns, max_total_tokens=max_total_tokens)
    return ScriptedGenerator(script), mt, prompt, prompt_ids, script


def run(generator, mt, prompt, prompt_ids, tokenizer):
    example = Example(prompt=prompt)
    return asyncio.run(play(example, prompt_ids, generator=generator, params=SamplingParams(max_tokens=256), tokenizer=tokenizer, multi_turn=mt))


TEXTS = [CALL.format(a=2, b=3), CALL.format(a=5, b=4), "the answer is 9"]


def test_three_turns_are_token_exact_with_tool_output_as_context(tiny_tokenizer):
    generator, mt, prompt, prompt_ids, script = setup(tiny_tokenizer, TEXTS)
    rollout = run(generator, mt, prompt, prompt_ids, tiny_tokenizer)
    trace = rollout.trace
    # the whole trace is exactly what the template renders for the whole conversation: no drift
    conversation = prompt + [
        {"role": "assistant", "content": TEXTS[0]}, {"role": "tool", "content": "5"},
        {"role": "assistant", "content": TEXTS[1]}, {"role": "tool", "content": "9"},
        {"role": "assistant", "content": TEXTS[2]},
    ]
    rendered = tiny_tokenizer.apply_chat_template(conversation, tools=mt.env.tools, tokenize=False)
    assert trace.token_ids == encode(tiny_tokenizer, rendered.removesuffix("\n"))
    # token by token: sampled spans trained, everything else (prompt, tool answers, template) not
    expected_mask = [False] * len(prompt_ids)
    for k, turn in enumerate(rollout.turns):
        assert trace.token_ids[turn.start : turn.end] == script[k]  # sampled tokens kept verbatim
        expected_mask += [False] * (turn.start - len(expected_mask)) + [True] * (turn.end - turn.start)
    assert trace.loss_mask == expected_mask
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(trace.logprobs, trace.loss_mask))
    assert all((v >= 0) == m for v, m in zip(trace.policy_versions, trace.loss_mask))
    assert [t.policy_version for t in rollout.turns] == [0, 1, 2]  # each turn records its version
    # each turn's prompt is the whole trace so far (prefix reuse), and tool output is in context
    for k, turn in enumerate(rollout.turns):
        assert generator.prompts[k] == trace.token_ids[: turn.start]
    context = tiny_tokenizer.decode([t for t, m in zip(trace.token_ids, trace.loss_mask) if not m])
    assert "<tool_response>\n5\n</tool_response>" in context and "<tool_response>\n9\n</tool_response>" in context
    assert rollout.status is RolloutStatus.OK and rollout.finish_reason == "stop"
    assert [m["role"] for m in rollout.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert rollout.messages[0]["tool_calls"][0]["function"]["name"] == "add"
    # the conversation's text is decoded where it is shown, not at every rollout's end
    assert rollout.completion_text == ""
    assert completion_text(rollout, tiny_tokenizer) == tiny_tokenizer.decode(trace.token_ids[len(prompt_ids) :])
    assert completion_token_ids(rollout) == trace.token_ids[len(prompt_ids) :]  # what the console shows it from


def test_sampled_tokens_are_never_retokenised(tiny_tokenizer):
    """A non-canonical tokenisation (one token per character) stays as sampled."""
    generator, mt, prompt, prompt_ids, _ = setup(tiny_tokenizer, TEXTS)
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_char = [tiny_tokenizer.convert_tokens_to_ids(c) for c in TEXTS[0] if c != " "] + [im_end]
    assert all(i is not None and i != tiny_tokenizer.unk_token_id for i in by_char)
    generator.script[0] = by_char
    rollout = run(generator, mt, prompt, prompt_ids, tiny_tokenizer)
    first = rollout.turns[0]
    assert rollout.trace.token_ids[first.start : first.end] == by_char


def test_max_turns_truncates_a_rollout_still_calling_tools(tiny_tokenizer):
    generator, mt, prompt, prompt_ids, _ = setup(tiny_tokenizer, TEXTS[:2], max_turns=2)
    rollout = run(generator, mt, prompt, prompt_ids, tiny_tokenizer)
    assert len(rollout.turns) == 2 and rollout.status is RolloutStatus.TRUNCATED
    assert rollout.trace.loss_mask[-1]  # the unplayed tool answer is not appended


def test_max_total_tokens_bounds_the_conversation(tiny_tokenizer):
    generator, mt, prompt, prompt_ids, _ = setup(tiny_tokenizer, TEXTS, max_total_tokens=0)
    limit = len(prompt_ids) + 30
    mt = MultiTurn(env=mt.env, chat=mt.chat, max_turns=3, max_total_tokens=limit)
    rollout = run(generator, mt, prompt, prompt_ids, tiny_tokenizer)
    assert len(rollout.trace.token_ids) <= limit and rollout.status is RolloutStatus.TRUNCATED


@pytest.mark.parametrize("text, answer", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "raised TypeError"),
    ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "unknown tool 'mul'"),
    ("<tool_call>{not json</tool_call>", "malformed tool call"),
    ('<tool_call>["add"]</tool_call>', "malformed tool call"),
])
def test_bad_calls_become_the_tools_answer(tiny_tokenizer, text, answer):
    generator, mt, prompt, prompt_ids, _ = setup(tiny_tokenizer, [text, "sorry"])
    rollout = run(generator, mt, prompt, prompt_ids, tiny_tokenizer)
    assert rollout.status is RolloutStatus.OK and len(rollout.turns) == 2
    assert answer in rollout.messages[1]["content"]


# Qwen3-like: the last assistant turn gets an empty think block, earlier ones do not; no system role
QWEN3_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
    "{% elif m['role'] == 'assistant' and loop.last %}<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_templates_that_render_the_last_turn_differently_get_the_right_delta(tiny_tokenizer):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = QWEN3_LIKE
    generator, mt, prompt, prompt_ids, script = setup(tokenizer, TEXTS)
    rollout = run(generator, mt, prompt, prompt_ids, tokenizer)
    assert [m["role"] for m in rollout.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    trace, turns = rollout.trace, rollout.turns
    between = [tokenizer.decode(trace.token_ids[a.end : b.start]) for a, b in zip(turns, turns[1:])]
    assert between == [f"\n<|im_start|>user\n<tool_response>\n{v}\n</tool_response><|im_end|>\n<|im_start|>assistant\n" for v in (5, 9)]
    assert mt.chat.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # a turn that stopped otherwise (no <|im_end|> sampled) gets the whole closing as context
    assert tokenizer.decode(mt.chat.delta_ids([{"role": "tool", "content": "1"}], last_sampled_id=5)).startswith("<|im_end|>\n<|im_start|>user")


THINKING_SWITCH = QWEN3_LIKE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)


def test_chat_template_kwargs_reach_every_turns_render(tiny_tokenizer):
    """--chat_template_kwargs (Qwen3's enable_thinking) shape every turn's opening, not only the prompt's."""
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = THINKING_SWITCH
    tool = [{"role": "tool", "content": "5"}]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    off = ChatFormat(tokenizer, chat_template_kwargs={"enable_thinking": False}).delta_ids(tool, last_sampled_id=im_end)
    assert tokenizer.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = ChatFormat(tokenizer).delta_ids(tool, last_sampled_id=im_end)
    assert tokenizer.decode(plain).endswith("<|im_start|>assistant\n")
    assert off[: len(plain)] == plain


def test_a_repeated_answer_renders_once_and_each_answer_keeps_its_own_delta(tiny_tokenizer):
    """The delta of an answer seen before comes from the cache (no template render between turns), and
    equals a fresh render; another content, or a turn that did not sample <|im_end|>, is its own entry."""
    chat = ChatFormat(tiny_tokenizer)
    renders = []
    render = chat._render
    chat._render = lambda *args: renders.append(args) or render(*args)
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    seven = chat.delta_ids([{"role": "tool", "content": "7"}], last_sampled_id=im_end)
    again = chat.delta_ids([{"role": "tool", "content": "7"}], last_sampled_id=im_end)
    assert again == seven and len(renders) == 1
    again.append(0)  # a caller's list is its own
    assert chat.delta_ids([{"role": "tool", "content": "7"}], last_sampled_id=im_end) == seven
    eight = chat.delta_ids([{"role": "tool", "content": "8"}], last_sampled_id=im_end)
    unclosed = chat.delta_ids([{"role": "tool", "content": "7"}], last_sampled_id=5)
    assert len(renders) == 3 and eight != seven and unclosed[1:] == seven and tiny_tokenizer.decode(unclosed[:1]) == "<|im_end|>"
    assert ChatFormat(tiny_tokenizer).delta_ids([{"role": "tool", "content": "8"}], last_sampled_id=im_end) == eight


def test_the_tool_waits_of_a_groups_rollouts_overlap(tiny_tokenizer):
    """A slow tool is awaited by every rollout at once, not one conversation after another: every call of
    a turn starts before the first one returns (an ordered event log, so the test needs no clock)."""
    from tandemrl.rollout.group import play_group

    log = []

    async def slow(x: int) -> int:
        """Answers after a while.

        Args:
            x: Anything.
        """
        log.append(("start", x))
        await asyncio.sleep(0.2)
        log.append(("end", x))
        return x

    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    calls = [encode(tiny_tokenizer, '<tool_call>{"name": "slow", "arguments": {"x": %d}}</tool_call>' % turn) + [im_end] for turn in range(2)]

    class CallsTwice:
        version = 0

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
            turn = tiny_tokenizer.decode(prompt_ids).count("<tool_response>")
            ids = calls[turn] if turn < 2 else encode(tiny_tokenizer, "done") + [im_end]
            return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", policy_versions=[0] * len(ids))

    tool = python_tool(slow)
    mt = MultiTurn(env=ToolEnv(ToolBox([tool], timeout_s=5), HermesParser()), chat=ChatFormat(tiny_tokenizer, [tool.schema]),
                   max_turns=3, max_total_tokens=1024)
    group = asyncio.run(play_group(Example(prompt="p"), encode(tiny_tokenizer, "p"), generator=CallsTwice(), params=SamplingParams(max_tokens=64),
                                   group_size=16, tokenizer=tiny_tokenizer, seed=0, multi_turn=mt))
    assert [len(r.turns) for r in group.rollouts] == [3] * 16
    for turn in range(2):  # by turn: a rollout whose 0.2 s ended a moment before another's may start its next turn first
        events = [event for event, x in log if x == turn]
        assert events == ["start"] * 16 + ["end"] * 16, (turn, log)


def test_the_rollouts_decoder_decodes_as_the_tokenizer_does(tiny_tokenizer):
    ids = encode(tiny_tokenizer, "<|im_start|>assistant\nthe answer is 42<|im_end|>\n") + [5, 999]  # 999: out of vocab
    decode = decoder_of(tiny_tokenizer)
    assert decode is not tiny_tokenizer.decode  # the shortcut is taken for a plain transformers tokenizer
    for skip in (False, True):
        assert decode(ids, skip_special_tokens=skip) == tiny_tokenizer.decode(ids, skip_special_tokens=skip)
    assert decode(ids) == tiny_tokenizer.decode(ids)

    class Overriding(type(tiny_tokenizer)):
        def decode(self, token_ids, **kwargs):
            return "overridden"

    overriding = Overriding.__new__(Overriding)
    assert decoder_of(overriding)([1]) == "overridden"


class CachingScripted(ScriptedGenerator):
    """A scripted generator that says it keeps a prefix cache, idle between turns: the rollout warms it up."""

    caches_prefixes = True

    def __init__(self, script: list[list[int]]):
        super().__init__(script)
        self.warm_ups: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        if params.max_tokens == 1 and params.seed == 0:  # run.WARM_UP: answered without touching the script
            self.warm_ups.append(list(prompt_ids))
            return Completion(token_ids=[0], logprobs=[0.0], finish_reason="length", policy_versions=[self.version])
        return await super().generate(prompt_ids, params)

    def num_unfinished(self) -> int:
        return 0


def test_a_warm_up_prefills_the_next_turns_head_and_changes_no_token(tiny_tokenizer):
    """While the tool runs, a generator with a prefix cache gets the conversation + the head of the next
    delta that no answer changes: a prefix of the next turn's prompt. The trace is the one without warm-ups."""
    plain = run(*setup(tiny_tokenizer, TEXTS)[:4], tiny_tokenizer)
    generator, mt, prompt, prompt_ids, _ = setup(tiny_tokenizer, TEXTS)
    mt = dataclasses.replace(mt, warm_up=True)
    warm = CachingScripted(generator.script)
    rollout = run(warm, mt, prompt, prompt_ids, tiny_tokenizer)
    assert rollout.trace == plain.trace
    assert len(warm.warm_ups) == 2  # after turns 1 and 2; never after the last turn max_turns allows
    for warm_up, next_prompt in zip(warm.warm_ups, warm.prompts[1:]):
        assert next_prompt[: len(warm_up)] == warm_up and len(warm_up) < len(next_prompt)
        assert tiny_tokenizer.decode(warm_up).endswith("<|im_start|>user\n<tool_response>")


def test_warm_ups_keep_an_engines_tokens_and_move_prefill_work_before_the_answer(tiny_model_dir, tiny_tokenizer):
    """With the engine: the same tokens with and without warm-ups, and the next turns' prompts hit the cache further."""
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.rollout.group import play_group

    class Answers:
        async def step(self, example: Example, messages: list) -> list:
            await asyncio.sleep(0.02)
            return [{"role": "tool", "content": "the value is 4821"}]

    class Stopped:
        """The engine, every turn reported as stopped (a random model never closes its turn)."""

        version = 0

        def __init__(self, engine: Engine, warm: bool):
            self.engine, self.caches_prefixes = engine, warm

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
            return dataclasses.replace(await self.engine.generate(prompt_ids, params), finish_reason="stop")

        def num_unfinished(self) -> int:
            return self.engine.num_unfinished()

    chat = ChatFormat(tiny_tokenizer)
    mt = MultiTurn(env=Answers(), chat=chat, max_turns=3, max_total_tokens=512, warm_up=True)
    results = {}
    for warm in (True, False):
        engine = Engine(EngineConfig(device="cpu", max_num_seqs=16, max_model_len=512), model=_tiny_model(tiny_model_dir), tokenizer=tiny_tokenizer)
        params = SamplingParams(max_tokens=6, temperature=1.0)
        group = asyncio.run(play_group(Example(prompt="p"), encode(tiny_tokenizer, "a prompt"), generator=Stopped(engine, warm), params=params,
                                       group_size=4, tokenizer=tiny_tokenizer, seed=3, multi_turn=mt))  # fmt: skip
        assert [len(r.turns) for r in group.rollouts] == [3] * 4
        results[warm] = ([r.trace for r in group.rollouts], engine.stats()["engine/num_prefix_hit_tokens"])
        asyncio.run(engine.close())
    for warmed, cold in zip(*(results[warm][0] for warm in (True, False))):
        assert warmed.token_ids == cold.token_ids and warmed.loss_mask == cold.loss_mask
        assert max(abs(a - b) for a, b in zip(warmed.logprobs, cold.logprobs)) < 1e-4  # cached vs recomputed KV
    assert results[True][1] > results[False][1]


def _tiny_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def test_a_tool_answer_that_contains_the_delta_marker_is_context_like_any_other(tiny_tokenizer):
    """The stand-in marker the delta is cut after is model-reachable text (an unknown tool's name is echoed
    in its error answer): it is the tool's answer, never a crash of the rollout."""
    from tandemrl.rollout.chat import _MARK

    call = '<tool_call>{"name": "' + _MARK + '", "arguments": {}}</tool_call>'
    generator, mt, prompt, prompt_ids, _ = setup(tiny_tokenizer, [call, "sorry"])
    rollout = run(generator, mt, prompt, prompt_ids, tiny_tokenizer)
    assert rollout.status is RolloutStatus.OK and len(rollout.turns) == 2
    assert rollout.messages[1]["content"].startswith(f"error: unknown tool '{_MARK}'")
    first, second = rollout.turns
    between = tiny_tokenizer.decode(rollout.trace.token_ids[first.end : second.start])
    assert between == f"\n<|im_start|>user\n<tool_response>\n{rollout.messages[1]['content']}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_renders_an_assistant_message_twice_is_refused_at_start(tiny_tokenizer):
    # the delta is cut after the stand-in's marker: a template that repeats content is refused once, up front
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="content once"):
        ChatFormat(tokenizer)


WORDS = "the quick brown fox jumps over 12345 lazy dogs; "


def test_a_multi_megabyte_tool_answer_ends_its_rollout_truncated_while_another_keeps_playing(tiny_tokenizer):
    """A 5 MB tool answer was tokenized whole on the event loop (~9 s here) before --max_total_tokens
    refused it, and every other rollout stalled meanwhile. Now it ends its rollout truncated (finish
    "length", the answer not played) and a rollout beside it plays its six turns within 3 s."""

    def dump() -> str:
        """Dumps a big file."""
        return (WORDS * (5_000_000 // len(WORDS) + 1))[:5_000_000]

    class Paced(ScriptedGenerator):  # a decode step's pace, so the rollouts interleave
        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
            await asyncio.sleep(0.02)
            return await super().generate(prompt_ids, params)

    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    tools = [python_tool(dump), python_tool(add)]
    mt = MultiTurn(env=ToolEnv(ToolBox(tools, timeout_s=30), HermesParser()), chat=ChatFormat(tiny_tokenizer, [t.schema for t in tools]),
                   max_turns=8, max_total_tokens=1024)  # fmt: skip
    dumps = Paced([encode(tiny_tokenizer, '<tool_call>{"name": "dump", "arguments": {}}</tool_call>') + [im_end]])
    adds = Paced([encode(tiny_tokenizer, CALL.format(a=i, b=1)) + [im_end] for i in range(5)] + [encode(tiny_tokenizer, "done") + [im_end]])
    prompt_ids = encode(tiny_tokenizer, "p")

    async def both() -> tuple:
        start, ticks, done = time.monotonic(), [], {}

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        async def timed(name: str, generator: Paced) -> Any:
            rollout = await play(Example(prompt="p"), prompt_ids, generator=generator, params=SamplingParams(max_tokens=256), tokenizer=tiny_tokenizer, multi_turn=mt)
            done[name] = time.monotonic() - start
            return rollout

        tick = asyncio.ensure_future(ticker())
        rollouts = await asyncio.gather(timed("dump", dumps), timed("add", adds))
        tick.cancel()
        return rollouts, done, max(b - a for a, b in zip(ticks, ticks[1:]))

    (big, beside), done, stall = asyncio.run(both())
    assert big.status is RolloutStatus.TRUNCATED and big.finish_reason == "length" and len(big.turns) == 1
    assert [m["role"] for m in big.messages] == ["assistant"] and big.trace.loss_mask[-1]  # the answer is not in the trace
    assert beside.status is RolloutStatus.OK and len(beside.turns) == 6 and beside.messages[-1]["content"] == "done"
    assert done["add"] < 3 and stall < 1, (done, stall)


def test_a_long_answers_delta_is_told_too_long_from_a_prefix_and_exact_at_the_limit(tiny_tokenizer):
    """Past LONG_ANSWER_CHARS the delta is measured from prefixes cut at word ends: over `most` tokens is None
    (the text never tokenized whole), at `most` the delta itself; a text with no word end is tokenized whole."""
    from tandemrl.rollout.chat import LONG_ANSWER_CHARS

    chat = ChatFormat(tiny_tokenizer)
    encoded = []
    encode_text = chat._encode
    chat._encode = lambda text: encoded.append(len(text)) or encode_text(text)
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for content in (WORDS * (2 * LONG_ANSWER_CHARS // len(WORDS)), "x" * (2 * LONG_ANSWER_CHARS)):
        answer = [{"role": "tool", "content": content}]
        ids = chat.delta_ids(answer, last_sampled_id=im_end)
        for most in (0, 100, len(ids) // 3, len(ids) - 1):
            encoded.clear()
            assert asyncio.run(chat.delta_within(answer, last_sampled_id=im_end, most=most)) is None, most
            if content.startswith(WORDS) and most < len(ids) // 8:
                assert max(encoded) < len(content) / 8, (most, encoded)  # a prefix told it
        assert asyncio.run(chat.delta_within(answer, last_sampled_id=im_end, most=len(ids))) == ids
        assert asyncio.run(chat.delta_within(answer, last_sampled_id=5, most=len(ids) + 1)) == chat.delta_ids(answer, last_sampled_id=5)
