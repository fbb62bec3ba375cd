"""Toolsets from installed packages, through the entry point group ``batch_runner.toolsets``.

An entry point's name is the toolset's name; its object is a list of tool definitions (or a
function without arguments returning one). A definition is a mapping with ``name``,
``description``, ``parameters`` (the JSON schema of the arguments object) and ``handler``, or the
OpenAI function format ``{"type": "function", "function": {name, description, parameters}}``
plus ``handler``. The handler is called as ``handler(ctx, args)`` with the prompt's
:class:`~batchrun.prompt.tools.registry.ToolContext` (``ctx.sandbox.run(...)``, the limits) and the
checked arguments, and returns a JSON-serialisable dict, exactly like a built-in tool's.

Plugins load in every process that touches the registry, the same way, so the parent and its
workers know the same tools. A plugin that fails to import or defines a bad tool is left out and
its problem kept (:func:`plugin_problems`); the runner reports it once at start.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

from batchrun.prompt.tools.registry import TOOL_NAME, TOOLSETS, Tool, add_toolset

GROUP = "batch_runner.toolsets"
# A plugin toolset's name: no ':' (MCP toolsets are "mcp:<server>"), usable as a JSON key and a flag value.
TOOLSET_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")

_PROBLEMS: dict[str, str] = {}  # toolset name -> why its plugin is not loaded
_LOADED: dict[str, str] = {}  # toolset name -> its source ("plugin <entry point> from <distribution>")
_IGNORED: dict[str, str] = {}  # toolset name -> why the plugin was ignored (it would shadow or block another)
RESERVED_PREFIXES = ("mcp:",)  # toolset names of configured MCP servers
RESERVED_TOOL_PREFIXES = ("mcp__",)  # tool names of MCP servers' tools


def _collision(name: str, tools: list[Tool], builtin: set[str]) -> str | None:
    """Why a plugin would shadow or block a built-in or an MCP server (None: it would not); ``builtin``:
    the built-in tools' names."""
    if name in TOOLSETS:
        return f"its toolset name {name!r} is a built-in toolset's"
    if name.startswith(RESERVED_PREFIXES):
        return f"its toolset name {name!r} is reserved for --mcp_config servers"
    taken = sorted({t.name for t in tools if t.name in builtin or t.name.startswith(RESERVED_TOOL_PREFIXES)})
    if taken:
        return f"its tool name(s) {', '.join(taken)} are built-in or reserved for MCP servers"
    return None


def load_plugins(builtin: set[str]) -> None:
    """Load every plugin toolset of the environment (once per process; called by the catalog after the
    built-ins, whose tool names are ``builtin``)."""
    for ep in sorted(plugin_entry_points(), key=lambda e: e.name):
        source = f"plugin {ep.name} = {ep.value}" + (f" (package {ep.dist.name})" if ep.dist else "")
        early = _collision(ep.name, [], builtin)  # by its name alone: its code is not even loaded
        if early:
            _IGNORED[ep.name] = f"{source}: ignored: {early}"
            continue
        if ep.name in _LOADED or ep.name in _PROBLEMS:
            _PROBLEMS[ep.name] = f"{source}: the toolset name {ep.name!r} is defined by two plugins"
            continue
        try:
            if not TOOLSET_NAME.fullmatch(ep.name):
                raise ValueError(
                    "the entry point's name is the toolset's name: letters, digits, '_', '.', '-', at most 64"
                )
            tools = tools_from(ep.name, ep.load())
            collision = _collision(ep.name, tools, builtin)
            if collision:
                _IGNORED[ep.name] = f"{source}: ignored: {collision}"
                continue
            add_toolset(ep.name, source, tools)
        except Exception as exc:  # any failure of third-party code: reported, the run decides
            _PROBLEMS[ep.name] = f"{source}: {type(exc).__name__}: {exc}"
        else:
            _LOADED[ep.name] = source


@functools.cache
def plugin_entry_points() -> tuple[metadata.EntryPoint, ...]:
    """The group's entry points, scanned once per process (a worker inherits its forkserver's scan)."""
    return tuple(metadata.entry_points(group=GROUP))


def plugin_problems() -> dict[str, str]:
    """Plugin toolsets that could not be loaded here: name -> the problem, naming the plugin (as loaded so
    far: ``catalog.plugin_problems`` loads them first)."""
    return dict(_PROBLEMS)


def ignored_plugins() -> dict[str, str]:
    """Plugin toolsets ignored because they would shadow or block a built-in or an MCP server: name -> why."""
    return dict(_IGNORED)


def loaded_plugins() -> dict[str, str]:
    """Plugin toolsets loaded here: name -> where it comes from."""
    return dict(_LOADED)


def tools_from(toolset: str, obj: Any) -> list[Tool]:
    """The plugin object (a list of definitions, or a function returning one) as checked Tools."""
    if callable(obj) and not isinstance(obj, (list, tuple)):
        obj = obj()
    if not isinstance(obj, (list, tuple)) or not obj:
        raise ValueError(f"expected a non-empty list of tool definitions, got {type(obj).__name__}")
    return [_tool(toolset, i, d) for i, d in enumerate(obj)]


def _tool(toolset: str, index: int, definition: Any) -> Tool:
    where = f"tool {index}"
    if isinstance(definition, Tool):
        definition = {
            "name": definition.name,
            "description": definition.description,
            "parameters": definition.parameters,
            "handler": definition.handler,
            "sandbox_network": definition.sandbox_network,
        }
    if not isinstance(definition, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(definition).__name__}")
    handler = definition.get("handler")
    spec: Mapping[str, Any] = definition
    if definition.get("type") == "function" and isinstance(definition.get("function"), Mapping):
        spec = definition["function"]
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ValueError(f"{where}: 'name' must be 1-64 letters, digits, '_' or '-', got {name!r}")
    where = f"tool {name!r}"
    description = spec.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"{where}: 'description' must be a string")
    check_parameters(spec.get("parameters", {"type": "object", "properties": {}}), where)
    if not callable(handler):
        raise ValueError(f"{where}: 'handler' must be a function handler(ctx, args) -> dict")
    sandbox_network = definition.get("sandbox_network", True)
    if not isinstance(sandbox_network, bool):
        raise ValueError(f"{where}: 'sandbox_network' must be true or false, got {sandbox_network!r}")
    return Tool(
        name=name,
        toolset=toolset,
        description=description,
        parameters=dict(spec.get("parameters") or {"type": "object", "properties": {}}),
        handler=_checked_result(name, handler),
        sandbox_network=sandbox_network,
    )


def check_parameters(schema: Any, where: str) -> None:
    """A tool's arguments schema must be a JSON object schema the model and the checker can read."""
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ValueError(f'{where}: \'parameters\' must be a JSON schema with "type": "object"')
    props = schema.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(v, Mapping) for v in props.values()):
        raise ValueError(f"{where}: 'parameters.properties' must map each argument to its schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) and r in props for r in required):
        raise ValueError(f"{where}: 'parameters.required' must list names declared in 'properties'")


def _checked_result(name: str, handler: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """A plugin's answer must be a dict, like a built-in's; anything else is an error the model sees."""

    def call(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
        result = handler(ctx, args)
        if not isinstance(result, dict):
            return {"error": f"{name} returned {type(result).__name__}, not a JSON object"}
        try:
            json.dumps(result)
        except (TypeError, ValueError) as exc:
            return {"error": f"{name} returned a value that is not JSON: {exc}"}
        return result

    call.__wrapped__ = handler  # type: ignore[attr-defined]
    return call
