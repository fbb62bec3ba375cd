"""A small MCP server for the tests, written with the SDK's server API.

    python tools_server.py stdio [--pid-file PATH] [--stubborn [--escaping-child]]
    python tools_server.py http PORT

Tools: ``echo`` (its text back, with the server's secret-free marker), ``add``, ``count`` (calls seen
by this server process: per-session state), ``fail`` (an error result), ``nap`` (slow), ``crash`` (the process exits).
"""

from __future__ import annotations

import asyncio
import os
import sys

try:  # mcp 2.x
    from mcp.server.mcpserver import MCPServer as Server
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as Server

server = Server("tools")
_calls = {"n": 0}


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return f"echo from pid {os.getpid()}: {text}"


@server.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


@server.tool()
def count() -> str:
    """How many times this tool was called in this server process."""
    _calls["n"] += 1
    return f"call {_calls['n']} in pid {os.getpid()}"


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"failing on purpose: {reason}")


@server.tool()
async def nap(seconds: int) -> str:
    """Sleeps five times the given seconds (without blocking the server's other calls)."""
    await asyncio.sleep(seconds * 5)
    return "rested"


@server.tool()
def crash() -> str:
    """Ends the server process at once."""
    os._exit(3)


if __name__ == "__main__":
    print(f"tools server starting with token {os.environ.get('TOOLS_TOKEN', '-')}", file=sys.stderr)
    if "--pid-file" in sys.argv:
        with open(sys.argv[sys.argv.index("--pid-file") + 1], "a") as fh:
            fh.write(f"{os.getpid()}\n")
    stubborn = "--stubborn" in sys.argv  # ignores SIGTERM and its stdin's end; has a child in its group
    if stubborn:
        import signal
        import subprocess

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children = [subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL)]
        if "--escaping-child" in sys.argv:  # one more, in a session of its own: out of the group's reach
            children.append(
                subprocess.Popen(["sleep", "3601"], stdin=subprocess.DEVNULL, start_new_session=True)
            )
        with open(sys.argv[sys.argv.index("--pid-file") + 1], "a") as fh:
            fh.write("".join(f"{child.pid}\n" for child in children))
    if os.environ.get("TOOLS_FAIL_START"):
        sys.exit("refusing to start: TOOLS_FAIL_START is set")
    if sys.argv[1] == "http":
        port = int(sys.argv[2])
        try:
            server.run("streamable-http", host="127.0.0.1", port=port)
        except TypeError:  # mcp 1.x: host and port are settings
            server.settings.host, server.settings.port = "127.0.0.1", port
            server.run("streamable-http")
    else:
        server.run("stdio")
        while stubborn:  # stdin ended: a well-behaved server exits here, this one does not
            import time

            time.sleep(1)
