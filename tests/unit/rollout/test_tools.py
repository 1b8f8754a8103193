"""Tools: schemas from Python functions, and every failure becomes the tool's answer (timeouts too)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandemrl.rollout.chat import HermesParser, ToolCall, build_parser
from tandemrl.rollout.tools import ToolBox, load_python_tools, python_tool
from tandemrl.tasks.calculator import calculator
from tandemrl.types import Example


async def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "done"


def slow_sync(seconds: float) -> str:
    """Sleeps in a thread.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def answer(box: ToolBox, call: ToolCall) -> str:
    return asyncio.run(box.call(call))


def test_schema_comes_from_type_hints_and_docstring():
    tool = python_tool(calculator)
    assert tool.name == "calculator"
    assert tool.schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert answer(ToolBox([tool], timeout_s=5), ToolCall(name="calculator", arguments={"expression": "4821 * 37 + 905"})) == "179282"


@pytest.mark.parametrize("fn", [slow, slow_sync])
def test_a_tool_past_its_timeout_answers_with_a_timeout_error(fn):
    box = ToolBox([python_tool(fn)], timeout_s=0.2)

    async def timed() -> tuple[str, float]:
        started = time.perf_counter()
        return await box.call(ToolCall(name=fn.__name__, arguments={"seconds": 1.0})), time.perf_counter() - started

    text, seconds = asyncio.run(timed())
    assert text == f"error: tool '{fn.__name__}' timed out after 0.2 s"
    assert seconds < 0.9  # the answer does not wait for the tool (a sync tool's thread runs on)
    assert answer(box, ToolCall(name=fn.__name__, arguments={"seconds": 0.0})) == "done"


async def stubborn(seconds: float) -> str:
    """Sleeps, and once more when cancelled (as a retry loop with a broad except, or a shielded clean-up, does).

    Args:
        seconds: How long.
    """
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await asyncio.sleep(seconds)
    return "done"


def test_an_async_tool_that_ignores_its_cancel_answers_at_its_timeout():
    """The call was awaited in place under asyncio.timeout: a tool that swallowed the cancel held its rollout
    for as long as it liked (here 3 s past a 0.2 s timeout), and its late answer was taken as a success."""
    box = ToolBox([python_tool(stubborn)], timeout_s=0.2)

    async def timed() -> tuple[str, float]:
        started = time.perf_counter()
        return await box.call(ToolCall(name="stubborn", arguments={"seconds": 3.0})), time.perf_counter() - started

    text, seconds = asyncio.run(timed())
    assert text == "error: tool 'stubborn' timed out after 0.2 s" and seconds < 1.5, (text, seconds)


def test_a_tool_that_raises_answers_with_the_error():
    text = answer(ToolBox([python_tool(calculator)], timeout_s=5), ToolCall(name="calculator", arguments={"expression": "__import__('os')"}))
    assert text.startswith("error: tool 'calculator' raised ValueError")


def test_a_function_without_documented_arguments_is_a_one_line_error():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="tool 'bare'"):
        python_tool(bare)


def test_tools_load_by_name_and_duplicates_are_refused():
    tools = load_python_tools(["tandemrl.tasks.calculator:calculator"])
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolBox(tools * 2, timeout_s=1)


def test_hermes_parser_reads_calls_and_never_raises():
    parser = HermesParser()
    text = 'x <tool_call>\n{"name": "a", "arguments": {"k": 1}}\n</tool_call> y <tool_call>{"name": "b", "arguments": "{\\"j\\": 2}"}</tool_call>'
    assert parser.parse(text) == [ToolCall(name="a", arguments={"k": 1}), ToolCall(name="b", arguments={"j": 2})]
    assert parser.parse("no calls") == []
    assert parser.parse("<tool_call>{\"name\": ")[0].error  # unterminated: still an answerable error
    assert parser.parse('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')[0].error
    assert isinstance(build_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match="unknown --tool_call_parser"):
        build_parser("nope")


def secret_of(example: Example, salt: str = "") -> str:
    """The row's secret.

    Args:
        salt: Appended to it.
    """
    return example.columns["secret"] + salt


def test_an_example_parameter_is_hidden_from_the_model_and_receives_the_rollouts_row():
    tool = python_tool(secret_of)
    assert tool.name == "secret_of" and list(tool.schema["function"]["parameters"]["properties"]) == ["salt"]
    assert "required" not in tool.schema["function"]["parameters"]  # salt has a default
    box, row = ToolBox([tool], timeout_s=5), Example(prompt="p", columns={"secret": "s3"})
    assert asyncio.run(box.call(ToolCall(name="secret_of", arguments={"salt": "!"}), row)) == "s3!"
    # the model cannot hand in a row of its own
    assert asyncio.run(box.call(ToolCall(name="secret_of", arguments={"example": {"columns": {}}}), row)) == "s3"


def test_sync_tools_hung_past_their_timeout_keep_nothing_else_waiting():
    """A sync tool's thread runs on past its timeout; hung ones (more than any pool has workers) must not hold
    up another tool's call nor the run's own worker threads (generation, weight sync use asyncio.to_thread)."""
    import threading

    release = threading.Event()

    def stuck(x: int) -> str:
        """Blocks until the test ends.

        Args:
            x: Anything.
        """
        release.wait(30)
        return "late"

    box = ToolBox([python_tool(stuck), python_tool(slow_sync)], timeout_s=0.3)

    async def scenario() -> tuple[list[str], str, str]:
        hung = await asyncio.gather(*(box.call(ToolCall(name="stuck", arguments={"x": i})) for i in range(40)))
        quick = await box.call(ToolCall(name="slow_sync", arguments={"seconds": 0.0}))
        async with asyncio.timeout(2):
            own = await asyncio.to_thread(lambda: "ran")
        return hung, quick, own

    try:
        hung, quick, own = asyncio.run(scenario())
    finally:
        release.set()
    assert set(hung) == {"error: tool 'stuck' timed out after 0.3 s"}
    assert quick == "done" and own == "ran"


def test_a_sync_tool_hung_past_its_timeout_does_not_keep_the_process_from_exiting():
    import subprocess
    import sys

    script = (
        "import asyncio, time\n"
        "from tandemrl.rollout.chat import ToolCall\n"
        "from tandemrl.rollout.tools import ToolBox, python_tool\n"
        "def hang(x: int) -> str:\n"
        "    '''Hangs.\n\n    Args:\n        x: Anything.\n    '''\n"
        "    time.sleep(120)\n"
        "print(asyncio.run(ToolBox([python_tool(hang)], timeout_s=0.2).call(ToolCall(name='hang', arguments={'x': 1}))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "error: tool 'hang' timed out after 0.2 s"


def test_a_sync_tool_that_raises_stop_iteration_answers_at_once_with_the_error():
    """An exhausted next() in a tool is an exception like any other, not a silent wait for the timeout."""

    def first(items: list[int]) -> int:
        """The first item.

        Args:
            items: The items.
        """
        return next(iter(items))

    box = ToolBox([python_tool(first)], timeout_s=2)
    started = time.perf_counter()
    text = answer(box, ToolCall(name="first", arguments={"items": []}))
    assert text.startswith("error: tool 'first' raised") and "StopIteration" in text
    assert time.perf_counter() - started < 1
    assert answer(box, ToolCall(name="first", arguments={"items": [3]})) == "3"


def quits(code: int) -> str:
    """Exits as a script does (argparse on a bad argument, sys.exit in wrapped code).

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


async def quits_async(code: int) -> str:
    """Exits, from a coroutine.

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


@pytest.mark.parametrize("fn", [quits, quits_async])
def test_a_tool_that_calls_sys_exit_answers_with_the_error_and_ends_nothing(fn):
    box = ToolBox([python_tool(fn)], timeout_s=2)
    assert answer(box, ToolCall(name=fn.__name__, arguments={"code": 2})) == f"error: tool '{fn.__name__}' raised SystemExit: 2"


@pytest.mark.parametrize("body", [
    '{"name": "a", "arguments": {"x": 1' + "0" * 5000 + "}}",  # past int's 4300-digit limit: a ValueError, not a JSONDecodeError
    '{"name": "a", "arguments": "{\\"x\\": 1' + "0" * 5000 + '}"}',  # the same inside arguments written as a string
    "[" * 100_000,  # nesting past the recursion limit: a RecursionError
], ids=["long-int", "long-int-in-string-arguments", "deep-nesting"])
def test_hermes_parser_answers_json_the_decoder_refuses_with_an_error(body):
    """A degenerate turn (a run of digits or brackets) is model output like any other: an answerable error."""
    (call,) = HermesParser().parse(f"<tool_call>{body}</tool_call>")
    assert call.error.startswith("malformed tool call") and "\n" not in call.error


def echo(text: str) -> str:
    """Says the text back, as a search tool says its query back ("no results for ...").

    Args:
        text: Anything.
    """
    return f"no results for {text}"


def test_an_answer_with_a_lone_surrogate_reaches_the_next_turn_as_valid_text(tiny_tokenizer):
    """JSON lets the model write "\\ud800", a lone surrogate no tokenizer encodes: an echoing tool's answer
    carries it into the next turn's delta, which must still render (U+FFFD in its place)."""
    from tandemrl.rollout.chat import ChatFormat

    (call,) = HermesParser().parse('<tool_call>{"name": "echo", "arguments": {"text": "x\\ud800y \\ud83d\\ude00"}}</tool_call>')
    text = answer(ToolBox([python_tool(echo)], timeout_s=5), call)
    assert text == "no results for x\ufffdy \U0001F600"
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    delta = ChatFormat(tiny_tokenizer).delta_ids([{"role": "tool", "content": text}], last_sampled_id=im_end)
    assert tiny_tokenizer.decode(delta).startswith(f"\n<|im_start|>user\n<tool_response>\n{text}\n")
