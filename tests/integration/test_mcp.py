"""MCP round trips against real server processes (the example server, tasks/mcp_server.py): stdio and
streamable HTTP, opened once, tools listed and called, sessions closed."""

from __future__ import annotations

import asyncio
import contextlib
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


@contextlib.contextmanager
def http_server(tmp_path):
    """The example server over streamable HTTP; yields the path of a servers.json naming it."""
    proc = subprocess.Popen([*SERVER, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ})
    try:
        line, deadline = "", time.monotonic() + 60
        while "serving MCP on" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        url = re.search(r"(http://\S+)", line).group(1)
        (tmp_path / "servers.json").write_text(json.dumps({"mcpServers": {"calc": {"url": url}}}))
        yield str(tmp_path / "servers.json")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_http_server_round_trip(tmp_path):
    with http_server(tmp_path) as servers:
        names, ok, bad = asyncio.run(round_trip(ToolsConfig(mcp_config=servers)))
    assert names == ["calculator"] and ok == "179282" and bad.startswith("error:")


def test_a_run_over_an_http_server_prints_no_http_request_lines(tmp_path, tiny_model_dir):
    """The MCP client's HTTP library (httpx2) and its session logged every request at INFO on the console."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} * 3 + 1"}) + "\n" for a in range(2)))
    tiny = ["--num_prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "4", "--max_prompt_length", "32"]
    with http_server(tmp_path) as servers:
        result = subprocess.run(
            [sys.executable, "-m", "tandemrl", "train", "--model", tiny_model_dir, "--dataset", str(tmp_path / "data.jsonl"),
             "--reward_funcs", "length", "--mcp_config", servers, "--max_total_tokens", "64", "--max_steps", "1",
             "--output_dir", str(tmp_path / "run"), *tiny],
            capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "HTTP Request" not in output and " INFO mcp." not in output, output


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
