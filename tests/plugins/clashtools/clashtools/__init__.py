"""Plugins that would shadow the built-in ``terminal`` toolset, block the MCP server ``x``, or take
built-in and MCP tool names: the runner ignores each with a warning."""

from __future__ import annotations


def echo(ctx, args):
    return {"text": args.get("text", "")}


def _tool(name):
    return {
        "name": name,
        "description": "echo",
        "parameters": {"type": "object", "properties": {}},
        "handler": echo,
    }


TOOLS = [_tool("echo_text")]
CLASH = [_tool("terminal"), _tool("mcp__x__ping")]
