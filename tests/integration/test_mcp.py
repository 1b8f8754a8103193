"""MCP round trips against real server processes (the example server, tasks/mcp_server.py): stdio and
streamable HTTP, opened once, tools listed and called, sessions closed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tandemrl.rollout.chat import ToolCall
from tandemrl.rollout.env import ToolsConfig, open_tool_env

pytest.importorskip("mcp")
SERVER = [sys.executable, "-m", "tandemrl.tasks.mcp_server"]


def environ() -> dict[str, str]:
    return {k: os.environ[k] for k in ("PYTHONPATH", "PATH", "HOME") if k in os.environ}


async def round_trip(config: ToolsConfig) -> tuple[list[str], str, str]:
    async with open_tool_env(config) as env:
        names = [t["function"]["name"] for t in env.tools]
        ok, bad = await asyncio.gather(
            env.toolbox.call(ToolCall(name="calculator", arguments={"expression": "4821 * 37 + 905"})),
            env.toolbox.call(ToolCall(name="calculator", arguments={"expression": "import os"})),
        )
    return names, ok, bad


def test_stdio_server_round_trip(tmp_path):
    servers = {"mcpServers": {"calc": {"command": SERVER[0], "args": SERVER[1:], "env": environ()}}}
    (tmp_path / "servers.json").write_text(json.dumps(servers))
    names, ok, bad = asyncio.run(round_trip(ToolsConfig(mcp_config=str(tmp_path / "servers.json"))))
    assert names == ["calculator"] and ok == "179282" and bad.startswith("error:")


def test_http_server_round_trip(tmp_path):
    proc = subprocess.Popen([*SERVER, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ})
    try:
        line, deadline = "", time.monotonic() + 60
        while "serving MCP on" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        url = re.search(r"(http://\S+)", line).group(1)
        (tmp_path / "servers.json").write_text(json.dumps({"mcpServers": {"calc": {"url": url}}}))
        names, ok, bad = asyncio.run(round_trip(ToolsConfig(mcp_config=str(tmp_path / "servers.json"))))
        assert names == ["calculator"] and ok == "179282" and bad.startswith("error:")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_bad_config_is_a_one_line_error(tmp_path):
    (tmp_path / "servers.json").write_text(json.dumps({"mcpServers": {"calc": {"args": []}}}))
    with pytest.raises(ValueError, match="needs either \"command\""):
        asyncio.run(round_trip(ToolsConfig(mcp_config=str(tmp_path / "servers.json"))))


def open_within(servers: dict, seconds: float) -> None:
    from tandemrl.rollout.mcp import McpServers

    async def go() -> None:
        async with asyncio.timeout(seconds):  # the test's own deadline: a hang fails, never stalls the suite
            mcp = McpServers(servers)
            await mcp.open()
            await mcp.close()

    asyncio.run(go())


def children() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE}


def test_a_server_that_never_answers_is_one_clear_error_within_the_open_deadline(monkeypatch):
    from tandemrl.rollout import mcp

    monkeypatch.setattr(mcp, "OPEN_TIMEOUT_S", 1.0, raising=False)
    before = children()
    silent = {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"], "env": environ()}
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="MCP server 'mute' did not answer within 1 s"):
        open_within({"mute": silent}, 10)
    assert time.monotonic() - started < 8
    assert children() == before  # the silent server is ended, not left behind


@pytest.mark.parametrize("entry", [
    {"url": "http://127.0.0.1:9/mcp"},  # nothing listens there
    {"command": sys.executable, "args": ["-c", "pass"]},  # exits before it speaks MCP
], ids=["unreachable-url", "exits-at-once"])
def test_a_server_that_cannot_be_opened_is_a_one_line_error_naming_it(entry):
    with pytest.raises(OSError, match="^MCP server 'calc' ") as raised:  # cli prints an OSError as one line
        open_within({"calc": entry}, 20)
    assert "\n" not in str(raised.value)
