"""The tool catalog: the built-in toolsets loaded from one table (registry.TOOLSETS), then the plugins,
then MCP servers' toolsets as the run adds them; what is offered, known and available; one call run.

:mod:`batchrun.prompt.tools.registry` is the data structure (a leaf: it imports no tool); this module
loads into it, so nothing imports in a circle.
"""

from __future__ import annotations

import importlib
import json
import threading

from batchrun.prompt.sandboxes.base import SandboxError
from batchrun.prompt.tools import plugins, registry
from batchrun.prompt.tools.config import NO_SETTINGS, ToolSettings
from batchrun.prompt.tools.plugins import load_plugins
from batchrun.prompt.tools.registry import (
    _REGISTRY,
    _TOOLSET_CHECKS,
    _TOOLSET_NEEDS,
    TOOLSETS,
    Tool,
    ToolArgumentError,
    ToolContext,
    cap_result,
    check_arguments,
)
from batchrun.sharegpt import strict_arguments


def toolset_needs(toolset: str) -> str:
    """What makes ``toolset`` available (empty when nothing is needed or nothing is known)."""
    all_tools()  # the checks register with their tools
    if not any(t.toolset == toolset for t in _REGISTRY.values()):
        return "no tool of this toolset is installed"
    return _TOOLSET_NEEDS.get(toolset, "")


def builtin_module(toolset: str) -> str:
    """The module of built-in ``toolset``; importing it registers its tools."""
    return f"batchrun.prompt.tools.{toolset}"


# Loading has begun: a plugin's add_toolset, on the loading thread, must not start it again.
_BUILTINS_LOADED = False
_BUILTINS_READY = False  # loading has ended: other threads see every tool
_LOADING = threading.RLock()


def all_tools() -> dict[str, Tool]:
    global _BUILTINS_LOADED, _BUILTINS_READY
    # A flag, not "registry empty": importing one tool module directly must not hide the others.
    # Threads that come while another loads wait for it: prompts driven from several threads (the
    # API, a harness) saw a registry half made ("Unknown tool 'process'. Available tools: process").
    # A runner's workers load it before their prompts start (worker._warm_up).
    if not _BUILTINS_READY:
        with _LOADING:
            if not _BUILTINS_LOADED:
                _BUILTINS_LOADED = True
                # Importing a toolset's module registers its tools; each built-in toolset NAME is in
                # module batchrun.prompt.tools.NAME (the one table is registry.TOOLSETS).
                for toolset in TOOLSETS:
                    importlib.import_module(builtin_module(toolset))
                # Plugins after the built-ins, in every process alike (parent, forkserver workers, Ray
                # actors), told the built-ins' tool names, which no plugin may take.
                load_plugins({t.name for t in _REGISTRY.values() if t.toolset in TOOLSETS})
                _BUILTINS_READY = True
    return dict(registry.ordered_tools())


def add_toolset(name: str, source: str, tools: list[Tool]) -> None:
    """Register a toolset beyond the built-ins (an MCP server's), once the built-ins are loaded, so a
    clash with one of their names is seen (ValueError naming it)."""
    all_tools()
    registry.add_toolset(name, source, tools)


def toolset_names() -> list[str]:
    """Every toolset known here: the built-ins, then plugins and MCP servers in the order they were added."""
    all_tools()
    return registry.toolset_names()


def known_tool_names() -> list[str]:
    """Every tool name the runner knows, sorted: the columns of tool_stats in every record."""
    return sorted(all_tools())


def available_toolsets(settings: ToolSettings = NO_SETTINGS) -> set[str]:
    """Toolsets that have a tool here and whose configuration is present.

    ``settings`` are the run's (what the runner puts in ``ToolContext.settings``).
    Raises ``ToolConfigError`` (a ValueError naming the variable) for a bad setting.
    """
    present = {t.toolset for t in all_tools().values()}
    return {ts for ts in present if ts not in _TOOLSET_CHECKS or _TOOLSET_CHECKS[ts](settings)}


def tools_for_toolsets(toolsets: list[str], settings: ToolSettings = NO_SETTINGS) -> list[Tool]:
    """The tools offered for the given toolsets, in registry order.

    A tool that belongs to another toolset as well (``also_in``) comes with it only when its own
    toolset is configured under ``settings`` (the run's ``ToolContext.settings``; default: this environment).
    """
    wanted = set(toolsets)
    return [
        t
        for t in all_tools().values()
        if t.toolset in wanted or (wanted.intersection(t.also_in) and _configured(t.toolset, settings))
    ]


def _configured(toolset: str, settings: ToolSettings) -> bool:
    check = _TOOLSET_CHECKS.get(toolset)
    try:
        return check is None or bool(check(settings))
    except ValueError:  # a bad setting: the run's preflight reports it; here the tool is just not offered
        return False


def execute_tool_call(name: str, arguments: str, ctx: ToolContext, offered: set[str]) -> str:
    """Run one tool call the model made and return its result as a JSON string.

    Whatever the model did wrong (unknown or not-offered tool, arguments that are not JSON or do
    not fit the schema, a handler that raises) becomes ``{"error": ...}`` for the model to see.
    Only infrastructure failure (:class:`SandboxError`) propagates and fails the prompt.
    """
    tools = all_tools()
    tool = tools.get(name)
    if tool is None or name not in offered:
        return json.dumps(
            {"error": f"Unknown tool '{name}'. Available tools: {', '.join(sorted(offered)) or 'none'}"}
        )
    try:
        parsed = strict_arguments(arguments) if arguments and arguments.strip() else {}
    except json.JSONDecodeError as exc:
        return json.dumps({"error": f"Invalid JSON in arguments of {name}: {exc.msg} at position {exc.pos}"})
    except ValueError as exc:  # NaN or Infinity, a key given twice: not run, as the saved sample says
        return json.dumps({"error": f"Invalid JSON in arguments of {name}: {exc}"})
    try:
        args = check_arguments(tool, parsed)
        result = tool.handler(ctx, args)
    except SandboxError:
        raise
    except ToolArgumentError as exc:
        return json.dumps({"error": str(exc)})
    except Exception as exc:  # a handler bug or an unexpected input is still only an observation
        return cap_result(json.dumps({"error": f"{name} failed: {type(exc).__name__}: {exc}"}), ctx)
    return cap_result(json.dumps(result, ensure_ascii=False), ctx)


def plugin_problems() -> dict[str, str]:
    """Plugin toolsets that could not be loaded here: name -> the problem, naming the plugin."""
    all_tools()
    return plugins.plugin_problems()


def ignored_plugins() -> dict[str, str]:
    """Plugin toolsets ignored because they would shadow or block a built-in or an MCP server: name -> why."""
    all_tools()
    return plugins.ignored_plugins()


def loaded_plugins() -> dict[str, str]:
    """Plugin toolsets loaded here: name -> where it comes from."""
    all_tools()
    return plugins.loaded_plugins()
