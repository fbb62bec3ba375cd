"""Tools the agent can call, one module per toolset, all registered in :mod:`batchrun.prompt.tools.registry`."""

from batchrun.prompt.tools.catalog import (
    all_tools,
    available_toolsets,
    execute_tool_call,
    known_tool_names,
    tools_for_toolsets,
)
from batchrun.prompt.tools.registry import TOOLSETS, Tool, ToolContext

__all__ = [
    "TOOLSETS",
    "Tool",
    "ToolContext",
    "all_tools",
    "available_toolsets",
    "execute_tool_call",
    "known_tool_names",
    "tools_for_toolsets",
]
