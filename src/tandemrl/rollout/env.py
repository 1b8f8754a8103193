"""The environment a multi-turn rollout talks to. It speaks messages; the runner keeps the tokens.

ToolEnv is the built-in one: it answers each tool call of the model's last turn and ends the
conversation when a turn makes none. `open_tool_env` opens MCP sessions once per run and closes them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from tandemrl.rollout.chat import ToolCallParser, build_parser
from tandemrl.rollout.tools import ToolBox, load_python_tools
from tandemrl.types import Example, Message


@dataclass(kw_only=True)
class ToolsConfig:
    """Multi-turn rollouts with tools. With neither --tools nor --mcp_config a rollout is one completion."""

    tools: tuple[str, ...] = ()
    """Python functions the model may call (module:function or file.py:function; type hints + docstring = schema)."""
    mcp_config: str = ""
    """JSON file of MCP servers whose tools the model may call, in the mcpServers format (stdio or url)."""
    tool_call_parser: str = "hermes"
    """How tool calls are read from the model's text: hermes (Qwen, Hermes <tool_call> JSON) or module:Class."""
    max_turns: int = 4
    """Assistant turns per rollout at most; a rollout still calling tools after them counts as truncated."""
    max_total_tokens: int = 2048
    """Tokens of a whole conversation (prompt, turns, tool answers) at most; past it the rollout is truncated."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call may take; then its answer to the model is a timeout error."""
    warm_up_turns: bool = False
    """While a tool runs and the engine has nothing else to run, prefill the head of the next turn that no
    answer changes (the turn's closing, the tool message's opening), so the next turn computes less (off:
    slower on the one GPU measurement, its extra requests' host work lands between turns)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"--max_turns must be >= 1, got {self.max_turns}")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"--tool_timeout_s must be > 0, got {self.tool_timeout_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.tools or self.mcp_config)


class Env(Protocol):
    """Answers a conversation. `tools`: the schemas shown to the model through the chat template."""

    tools: list[dict[str, Any]]

    async def step(self, example: Example, messages: list[Message]) -> list[Message]:
        """The messages the environment adds after the model's turn (`messages[-1]`); [] ends the rollout."""
        ...


class ToolEnv:
    """Calls the tools the model's last turn asks for, all at once; records the calls on that turn's
    message as `tool_calls` (OpenAI form), so rewards see the tool trace."""

    def __init__(self, toolbox: ToolBox, parser: ToolCallParser):
        self.toolbox, self.parser = toolbox, parser
        self.tools = toolbox.schemas

    async def step(self, example: Example, messages: list[Message]) -> list[Message]:
        calls = self.parser.parse(messages[-1]["content"])
        if not calls:
            return []
        messages[-1]["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls
        ]
        answers = await asyncio.gather(*(self.toolbox.call(c, example) for c in calls))
        return [{"role": "tool", "name": c.name, "content": a} for c, a in zip(calls, answers)]


@asynccontextmanager
async def open_tool_env(config: ToolsConfig) -> AsyncIterator[ToolEnv | None]:
    """The run's ToolEnv (None when no tools are configured); MCP sessions live as long as the block."""
    if not config.enabled:
        yield None
        return
    tools = load_python_tools(list(config.tools))
    parser = build_parser(config.tool_call_parser)
    if not config.mcp_config:
        yield ToolEnv(ToolBox(tools, timeout_s=config.tool_timeout_s), parser)
        return
    from tandemrl.rollout.mcp import McpServers, read_mcp_config

    servers = McpServers(read_mcp_config(config.mcp_config))
    try:
        tools += await servers.open()
        yield ToolEnv(ToolBox(tools, timeout_s=config.tool_timeout_s), parser)
    finally:
        await servers.close()
