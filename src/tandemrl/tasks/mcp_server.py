"""An example MCP server: the calculator task's tool over stdio (default) or streamable HTTP.

    python -m tandemrl.tasks.mcp_server                 # stdio: an mcpServers entry {"command": ..., "args": [...]}
    python -m tandemrl.tasks.mcp_server --port 8931     # HTTP: {"url": "http://127.0.0.1:8931/mcp"}

Copy it to serve your own tools: any function registered with `@server.tool()` reaches the model.
With --port 0 it picks a free port and prints the URL it serves on.
"""

from __future__ import annotations

import argparse
import socket

from tandemrl.tasks.calculator import calculator


def build_server():
    try:
        from mcp.server.mcpserver import MCPServer  # mcp 2.x
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as MCPServer
    server = MCPServer("tandem-calculator")
    server.tool()(calculator)
    return server


def serve_http(server, host: str, port: int) -> None:
    import anyio
    import uvicorn

    sock = socket.socket()
    sock.bind((host, port))
    sock.listen(128)  # before the URL is printed: a client may connect while uvicorn is still starting
    print(f"serving MCP on http://{host}:{sock.getsockname()[1]}/mcp", flush=True)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    anyio.run(lambda: uvicorn.Server(config).serve(sockets=[sock]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=None, help="serve streamable HTTP on this port (0 = any free one)")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    server = build_server()
    if args.port is None:
        server.run()  # stdio
    else:
        serve_http(server, args.host, args.port)


if __name__ == "__main__":
    main()
