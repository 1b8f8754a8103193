"""The tools of MCP servers (stdio and streamable HTTP, through the official `mcp` SDK), opened once a run.

`--mcp_config servers.json` uses the usual `mcpServers` format:
    {"mcpServers": {"calc": {"command": "python", "args": ["server.py"], "env": {...}},
                    "search": {"url": "http://127.0.0.1:8931/mcp", "headers": {"Authorization": "..."}}}}
Invariant: `McpServers.open` and `close` run in one task (the SDK's anyio task groups demand it); tool
calls from any task of that event loop reuse the open sessions.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from tandemrl.rollout.tools import Tool
from tandemrl.types import Example

OPEN_TIMEOUT_S = 60.0  # a server's start, initialize and tool list at most; past it the run stops with one line


def read_mcp_config(path: str) -> dict[str, dict[str, Any]]:
    """{server name: its entry}. Example: {"mcpServers": {"calc": {"command": "python"}}} -> {"calc": {...}}"""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--mcp_config {path}: no such file; give a JSON file with an mcpServers object")
    try:
        servers = json.loads(Path(path).read_text()).get("mcpServers")
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"--mcp_config {path}: not a JSON object ({error}); write {{\"mcpServers\": {{...}}}}") from None
    if not isinstance(servers, dict) or not servers:
        raise ValueError(f"--mcp_config {path}: needs a non-empty \"mcpServers\" object")
    for name, entry in servers.items():
        if not isinstance(entry, dict) or ("command" in entry) == ("url" in entry):
            raise ValueError(f"--mcp_config {path}: server {name!r} needs either \"command\" (stdio) or \"url\" (HTTP)")
    return servers


class McpServers:
    """Sessions with every configured server; `open` returns their tools, `close` ends them all."""

    def __init__(self, servers: dict[str, dict[str, Any]]):
        self.servers = servers
        self._stack = AsyncExitStack()

    async def open(self) -> list[Tool]:
        """Raises OSError naming the server that cannot be opened (TimeoutError: silent past OPEN_TIMEOUT_S)."""
        tools = []
        for name, entry in self.servers.items():
            try:
                async with asyncio.timeout(OPEN_TIMEOUT_S):
                    session = await self._session(entry)
                    listed = await session.list_tools()
            except BaseException as error:
                failure = None
                try:
                    await self.close()
                except Exception as closing:  # a transport's task group raises its failure when it closes
                    failure = closing
                if isinstance(error, TimeoutError):
                    raise TimeoutError(f"MCP server {name!r} did not answer within {OPEN_TIMEOUT_S:g} s (start, initialize, "
                                       "list tools); check that its command or url serves MCP") from None
                if isinstance(error, Exception):
                    failure = error
                elif not (isinstance(error, asyncio.CancelledError) and failure):  # a transport's failure cancels this
                    raise  # task from its task group, then is the group's error on close; any other cancel is not ours
                raise ConnectionError(f"MCP server {name!r} could not be opened: {_cause(failure)}") from failure
            tools += [_tool(session, t) for t in listed.tools]
        return tools

    async def close(self) -> None:
        await self._stack.aclose()

    async def _session(self, entry: dict[str, Any]) -> Any:
        from mcp import ClientSession

        if "command" in entry:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(command=entry["command"], args=entry.get("args", []), env=entry.get("env"), cwd=entry.get("cwd"))
            streams = await self._stack.enter_async_context(stdio_client(params))
        else:
            streams = await self._stack.enter_async_context(_http_client(entry["url"], entry.get("headers")))
        session = await self._stack.enter_async_context(ClientSession(streams[0], streams[1]))
        await session.initialize()
        return session


def _http_client(url: str, headers: dict[str, str] | None) -> Any:
    """The SDK's streamable HTTP transport: mcp 2 takes an HTTP client for headers, mcp 1 the headers."""
    try:
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client
    except ImportError:  # mcp 1.x
        from mcp.client.streamable_http import streamablehttp_client

        return streamablehttp_client(url, headers=headers)
    return streamable_http_client(url, http_client=create_mcp_http_client(headers=headers) if headers else None)


def _cause(error: BaseException) -> str:
    """One line: the first leaf of an exception group, as "Type: message"."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _tool(session: Any, listed: Any) -> Tool:
    parameters = _field(listed, "input_schema", "inputSchema")
    schema = {"type": "function", "function": {"name": listed.name, "description": listed.description or "", "parameters": parameters}}

    async def call(arguments: dict[str, Any], example: Example | None) -> str:  # an MCP tool is stateless here
        result = await session.call_tool(listed.name, arguments)
        text = "\n".join(c.text if getattr(c, "type", "") == "text" else c.model_dump_json() for c in result.content)
        return f"error: {text}" if _field(result, "is_error", "isError") else text

    return Tool(name=listed.name, schema=schema, call=call)


def _field(model: Any, name: str, v1_name: str) -> Any:
    """mcp 2 names fields in snake case, mcp 1 in camel case."""
    return getattr(model, name) if hasattr(model, name) else getattr(model, v1_name)
