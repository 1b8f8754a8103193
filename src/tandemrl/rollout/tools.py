"""Tools the model may call, plain Python functions and MCP servers' tools alike, behind one ToolBox.

Invariant: `ToolBox.call` never raises on model output. A malformed call, an unknown tool, a tool's
exception or a timeout becomes the text the model reads back (one of STYLE.md's two broad excepts).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import re
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandemrl.plugins import load_object
from tandemrl.rollout.chat import ToolCall
from tandemrl.threads import Escaped, in_daemon_thread
from tandemrl.types import Example

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Tool:
    """One callable tool: its JSON schema (as chat templates take `tools=[...]`) and an async call, which
    gets the model's arguments and the rollout's dataset row (None outside a rollout)."""

    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    call: Callable[[dict[str, Any], Example | None], Awaitable[str]]


def python_tool(fn: Callable[..., Any]) -> Tool:
    """A Python function as a tool; its schema comes from type hints and a Google-style docstring
    (transformers' `get_json_schema`, what `apply_chat_template(tools=[fn])` uses). Sync functions run
    in a daemon thread of their own; a result that is not a string is sent as JSON.

    A parameter annotated `Example` is the tool's state, not the model's to give: it is left out of the
    schema and receives the rollout's dataset row (e.g. a secret the task keeps behind the tool, or the
    row's id in a sandbox), as verifiers' stateful tools and TRL's environments hand a row to a tool.
    """
    hidden = [name for name, hint in _type_hints(fn).items() if hint is Example]
    try:
        schema = _schema(fn, hidden)
    except Exception as error:  # transformers raises its own exception types for each docstring fault
        raise ValueError(f"tool {fn.__name__!r}: {error}; give every argument a type hint and an Args: line") from None

    is_async = inspect.iscoroutinefunction(fn)  # once: ~1.5 us a call, on the event loop between turns

    async def call(arguments: dict[str, Any], example: Example | None) -> str:
        arguments = {**arguments, **dict.fromkeys(hidden, example)}  # the row wins over a same-named argument
        if is_async:
            result = await fn(**arguments)
        else:
            result = await in_daemon_thread(functools.partial(fn, **arguments), name=f"tool-{fn.__name__}")
        return result if isinstance(result, str) else json.dumps(result)

    return Tool(name=schema["function"]["name"], schema=schema, call=call)


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an unresolvable hint is get_json_schema's to report, with its message
        return {}


def _schema(fn: Callable[..., Any], hidden: list[str]) -> dict[str, Any]:
    """get_json_schema of `fn` as the model sees it: without the `hidden` parameters."""
    from transformers.utils import get_json_schema

    if not hidden:
        return get_json_schema(fn)

    def shown() -> None:  # never called: it carries the signature, name and docstring get_json_schema reads
        return None

    signature = inspect.signature(fn)
    shown.__signature__ = signature.replace(parameters=[p for n, p in signature.parameters.items() if n not in hidden])
    shown.__annotations__ = {n: h for n, h in _type_hints(fn).items() if n not in hidden}
    shown.__name__, shown.__doc__ = fn.__name__, fn.__doc__
    return get_json_schema(shown)


def load_python_tools(specs: list[str]) -> list[Tool]:
    """Example: ["tandemrl.tasks.calculator:calculator"] -> [Tool(name="calculator", ...)]"""
    tools = []
    for spec in specs:
        fn = load_object(spec, what="tool")
        if not callable(fn):
            raise ValueError(f"tool '{spec}' is not a function; name a function after the colon")
        tools.append(python_tool(fn))
    return tools


class ToolBox:
    """The run's tools by name; calls them with a per-call deadline."""

    def __init__(self, tools: list[Tool], *, timeout_s: float):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; give each tool (and MCP server tool) a unique name")
            self.tools[tool.name] = tool
        self.timeout_s = timeout_s

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def call(self, call: ToolCall, example: Example | None = None) -> str:
        """The tool's answer, or the error the model should read (it starts with "error: ")."""
        return _encodable(await self._answer(call, example))

    async def _answer(self, call: ToolCall, example: Example | None) -> str:
        if call.error:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available: {', '.join(self.tools) or 'none'}"
        try:
            return await _within(tool.call(call.arguments, example), self.timeout_s)
        except TimeoutError:  # a sync tool's thread runs on to its end; its answer is dropped
            return f"error: tool {call.name!r} timed out after {self.timeout_s:g} s"
        except Exception as error:  # noqa: BLE001 - a tool's failure is the model's to read, never a crash
            log.debug("tool %s raised", call.name, exc_info=True)
            # SystemExit (sys.exit in wrapped script code, argparse on bad arguments) comes Escaped: it would end the run
            error = error.error if isinstance(error, Escaped) else error
            return f"error: tool {call.name!r} raised {type(error).__name__}: {error}"


async def _within(call: Awaitable[str], timeout_s: float) -> str:
    """`call`'s answer, or TimeoutError at `timeout_s`. The call runs as a task of its own (~10 us), cancelled
    and left behind at the deadline: awaited in place under asyncio.timeout, a tool that swallowed the cancel
    (a retry loop's broad except, a shielded clean-up) held its rollout as long as it liked."""
    task = asyncio.ensure_future(_exit_as_error(call))
    try:
        await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():  # past the deadline, or the rollout itself cancelled
            task.cancel()
            task.add_done_callback(lambda done: done.cancelled() or done.exception())  # its late outcome: never logged
    if not task.done():
        raise TimeoutError
    return task.result()


async def _exit_as_error(call: Awaitable[str]) -> str:
    try:
        return await call
    except SystemExit as error:  # raised out of a task, it would end the event loop
        raise Escaped(error) from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable(text: str) -> str:
    """`text` with each lone surrogate (JSON lets a model write "\\ud800"; a tool may echo it) as U+FFFD: no
    tokenizer encodes one, so the next turn's delta could not be built."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text
