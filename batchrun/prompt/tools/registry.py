"""The tool registry: name, toolset, JSON schema and handler for every tool the agent can be offered.

The set of known tool names (used for normalised statistics and the hallucination filter)
is derived from this registry and never listed anywhere else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchrun.prompt.sandboxes.base import Sandbox
from batchrun.prompt.tools.config import NO_SETTINGS, ToolSettings

# The built-in toolsets, the one table of them: toolset NAME is module batchrun.prompt.tools.NAME,
# which batchrun.prompt.tools.catalog imports to register its tools.
TOOLSETS = ("web", "vision", "image_gen", "terminal", "file", "moa", "browser")

# A tool name as OpenAI function calling accepts it.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ToolContext:
    """What a handler may use: the prompt's sandbox and the run's limits."""

    sandbox: Sandbox
    tool_timeout_s: float = 180.0  # wall-clock limit of one tool call
    output_cap_bytes: int = 64 * 1024  # most bytes of command output shown to the model
    settings: ToolSettings = NO_SETTINGS  # the run's endpoint, run_dir and tool variables (optional toolsets)
    usage: Any = (
        None  # batchrun.prompt.llm.Usage of the prompt: model calls made by tools (vision, moa) count too
    )
    llm: Any = None  # the run's batchrun.prompt.llm.LLMClient: tools call their models through it
    # Per-prompt state a tool keeps between calls (e.g. the browser context); each value has a
    # close() method. Released by close_prompt_resources, which the runner calls in `finally`.
    resources: dict[str, Any] = field(default_factory=dict)


Handler = Callable[[ToolContext, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Tool:
    name: str
    toolset: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    handler: Handler
    # Other toolsets that include this tool, offered there only when its own toolset is configured
    # (web_search is in the browser toolset too, as in the reference, when a search provider is set).
    also_in: tuple[str, ...] = ()
    # False: the handler's far end checks the arguments against the schema itself (an MCP server
    # does, and may accept what this checker would not); here only "a JSON object" is required.
    check_schema: bool = True
    # False: the tool never runs anything in the prompt's sandbox that could use its network (it works
    # on the host, or only reads and writes files there). A prompt offered no tool that may gets no
    # network (the sandbox starts faster): only the command-running tools, and plugins' by default.
    sandbox_network: bool = True

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolArgumentError(ValueError):
    """The model passed arguments that do not fit the schema; shown to the model as an error."""


_REGISTRY: dict[str, Tool] = {}
_TOOLSET_CHECKS: dict[str, Callable[[ToolSettings], bool]] = {}
_TOOLSET_NEEDS: dict[str, str] = {}


# Toolsets beyond the built-ins, in the order they were added: plugins (entry points), then MCP
# servers. name -> where it comes from, for listings and messages.
_EXTRA_TOOLSETS: dict[str, str] = {}


def register(tool: Tool) -> Tool:
    for toolset in (tool.toolset, *tool.also_in):
        if toolset not in TOOLSETS and toolset not in _EXTRA_TOOLSETS:
            raise ValueError(f"tool {tool.name!r} names unknown toolset {toolset!r}")
    if tool.name in _REGISTRY:
        raise ValueError(f"tool {tool.name!r} registered twice")
    _REGISTRY[tool.name] = tool
    global _ORDERED
    _ORDERED = None
    return tool


def add_toolset(name: str, source: str, tools: list[Tool]) -> None:
    """Register a toolset beyond the built-ins with all its tools, or nothing (ValueError naming the clash)."""
    if name in TOOLSETS or name in _EXTRA_TOOLSETS:
        raise ValueError(
            f"toolset {name!r} is defined twice ({_EXTRA_TOOLSETS.get(name, 'built in')} and {source})"
        )
    names = [t.name for t in tools]  # the catalog loads the built-ins first (catalog.add_toolset)
    clash = sorted({n for n in names if n in _REGISTRY or names.count(n) > 1})
    if clash:
        raise ValueError(f"toolset {name!r} ({source}): tool name(s) {', '.join(clash)} already taken")
    _EXTRA_TOOLSETS[name] = source
    for tool in tools:
        register(tool)


def remove_toolsets(names: set[str]) -> None:
    """Forget extra toolsets and their tools (a new run in the same process configures its own)."""
    for name in names:
        _EXTRA_TOOLSETS.pop(name, None)
    for tool_name in [n for n, t in _REGISTRY.items() if t.toolset in names]:
        del _REGISTRY[tool_name]
    global _ORDERED
    _ORDERED = None


def toolset_names() -> list[str]:
    """Every toolset registered: the built-ins, then plugins and MCP servers in the order they were added."""
    return [*TOOLSETS, *_EXTRA_TOOLSETS]


_ORDERED: dict[str, Tool] | None = None


def ordered_tools() -> dict[str, Tool]:
    """The registered tools: built-in toolsets in TOOLSETS order, then the others in the order they were
    added, so the order never depends on which module was imported first (cached: read on every call)."""
    global _ORDERED
    if _ORDERED is None:
        order = {name: i for i, name in enumerate([*TOOLSETS, *_EXTRA_TOOLSETS])}
        _ORDERED = dict(sorted(_REGISTRY.items(), key=lambda item: order[item[1].toolset]))
    return _ORDERED


def toolset_source(name: str) -> str:
    """Where a toolset comes from ("built in", "plugin ...", "MCP server ...")."""
    return "built in" if name in TOOLSETS else _EXTRA_TOOLSETS.get(name, "unknown")


def register_toolset_check(
    toolset: str, is_configured: Callable[[ToolSettings], bool], needs: str = ""
) -> None:
    """Offer ``toolset`` only when ``is_configured(settings)`` holds (see batchrun/prompt/tools/config.py).

    The check may raise ``ToolConfigError`` (a ValueError) for a setting that is present but bad.
    ``needs`` says, for messages to the user, what makes the toolset available.
    """
    _TOOLSET_CHECKS[toolset] = is_configured
    _TOOLSET_NEEDS[toolset] = needs


def close_prompt_resources(ctx: ToolContext) -> None:
    """Release what the prompt's tools kept open (browser context, ...). Idempotent; never raises."""
    while ctx.resources:
        _, resource = ctx.resources.popitem()
        try:
            resource.close()
        except Exception:  # cleanup of one resource must not stop the others
            pass


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


def _fits(value: Any, kind: Any) -> bool:
    if kind == "null":
        return value is None
    py_type = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
    if py_type is None:  # a type this checker does not know: the handler judges
        return True
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):  # JSON Schema: 30.0 is an integer, 30.5 is not
        return value.is_integer()
    return isinstance(value, py_type)


def check_arguments(tool: Tool, args: Any) -> dict[str, Any]:
    """Validate the top level of ``args`` against the tool's schema: required keys, known keys, types."""
    if not isinstance(args, dict):
        raise ToolArgumentError(f"arguments of {tool.name} must be a JSON object, got {type(args).__name__}")
    if not tool.check_schema:
        return args
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in args]
    if missing:
        raise ToolArgumentError(f"{tool.name}: missing required argument(s): {', '.join(missing)}")
    unknown = [k for k in args if k not in props]
    if unknown:
        raise ToolArgumentError(
            f"{tool.name}: unknown argument(s): {', '.join(unknown)}; expected: {', '.join(props)}"
        )
    for key, value in args.items():
        spec = props[key] if isinstance(props[key], dict) else {}
        expected = spec.get("type")
        if expected is None or value is None and key not in tool.parameters.get("required", []):
            continue
        # A schema may allow several types (["string", "null"]); the value must fit one of them.
        kinds = expected if isinstance(expected, list) else [expected]
        if not any(_fits(value, kind) for kind in kinds):
            shown = " or ".join(str(k) for k in kinds)
            raise ToolArgumentError(
                f"{tool.name}: argument {key!r} must be {shown}, got {type(value).__name__}"
            )
        if isinstance(value, float) and "integer" in kinds and "number" not in kinds:
            args = {**args, key: int(value)}  # what the handler counts with
    return args


MIN_RESULT_CAP_BYTES = 256 * 1024  # above what the built-ins return (web extract: 5 pages x 20,000 chars)


def result_cap_bytes(ctx: ToolContext) -> int:
    """The one cap on every tool result, built-in, plugin or MCP: four times the command output cap,
    at least :data:`MIN_RESULT_CAP_BYTES`. A result goes into every later request of the prompt."""
    return max(MIN_RESULT_CAP_BYTES, 4 * ctx.output_cap_bytes)


def cap_result(text: str, ctx: ToolContext) -> str:
    """``text`` (a result's JSON) when it fits the cap; else its start, with a note of what was dropped."""
    cap = result_cap_bytes(ctx)
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= cap:
        return text
    kept = data[: cap - 512].decode("utf-8", "ignore")  # room for the note within the cap
    note = (
        f"tool result cut: {len(data):,} bytes, of which the first {len(kept.encode()):,} are kept and "
        f"{len(data) - len(kept.encode()):,} dropped (the cap on every tool result is {cap:,} bytes)"
    )
    return json.dumps({"truncated_result": kept, "note": note}, ensure_ascii=False)


def needs_sandbox_network(tools: list[Tool]) -> bool:
    """Whether any of ``tools`` may use the prompt's sandbox network (see ``Tool.sandbox_network``)."""
    return any(t.sandbox_network for t in tools)
