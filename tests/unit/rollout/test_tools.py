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
