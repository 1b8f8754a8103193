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
