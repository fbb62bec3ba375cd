"""The tool registry: name, toolset, JSON schema and handler for every tool the agent can be offered.

The set of known tool names (used for normalised statistics and the hallucination filter)
is derived from this registry and never listed anywhere else.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchrun.prompt.sandboxes.base import Sandbox, SandboxError

TOOLSETS = ("web", "vision", "image_gen", "terminal", "file", "moa", "browser")  # the built-in toolsets

# A tool name as OpenAI function calling accepts it.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ToolContext:
    """What a handler may use: the prompt's sandbox and the run's limits."""

    sandbox: Sandbox
    tool_timeout_s: float = 180.0  # wall-clock limit of one tool call
    output_cap_bytes: int = 64 * 1024  # most bytes of command output shown to the model
    extra: dict[str, Any] = field(default_factory=dict)  # per-run settings of optional toolsets
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

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolArgumentError(ValueError):
    """The model passed arguments that do not fit the schema; shown to the model as an error."""


_REGISTRY: dict[str, Tool] = {}
_TOOLSET_CHECKS: dict[str, Callable[[dict[str, Any]], bool]] = {}
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
    all_tools()  # the built-ins first, so a clash with one of their names is seen
    names = [t.name for t in tools]
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
    """Every toolset known here: the built-ins, then plugins and MCP servers in the order they were added."""
    all_tools()
    return [*TOOLSETS, *_EXTRA_TOOLSETS]


def toolset_source(name: str) -> str:
    """Where a toolset comes from ("built in", "plugin ...", "MCP server ...")."""
    return "built in" if name in TOOLSETS else _EXTRA_TOOLSETS.get(name, "unknown")


def register_toolset_check(
    toolset: str, is_configured: Callable[[dict[str, Any]], bool], needs: str = ""
) -> None:
    """Offer ``toolset`` only when ``is_configured(extra)`` holds (see batchrun/prompt/tools/config.py).

    The check may raise ``ToolConfigError`` (a ValueError) for a setting that is present but bad.
    ``needs`` says, for messages to the user, what makes the toolset available.
    """
    _TOOLSET_CHECKS[toolset] = is_configured
    _TOOLSET_NEEDS[toolset] = needs


def toolset_needs(toolset: str) -> str:
    """What makes ``toolset`` available (empty when nothing is needed or nothing is known)."""
    all_tools()  # the checks register with their tools
    if not any(t.toolset == toolset for t in _REGISTRY.values()):
        return "no tool of this toolset is installed"
    return _TOOLSET_NEEDS.get(toolset, "")


BUILTIN_TOOL_MODULES = tuple(
    f"batchrun.prompt.tools.{m}" for m in ("terminal", "file", "web", "vision", "image_gen", "moa", "browser")
)


def _load_builtin_tools() -> None:
    # Importing the modules registers their tools; done once, on first use.
    for module in BUILTIN_TOOL_MODULES:
        importlib.import_module(module)


_BUILTINS_LOADED = False


_ORDERED: dict[str, Tool] | None = None


def all_tools() -> dict[str, Tool]:
    global _BUILTINS_LOADED
    # A flag, not "registry empty": importing one tool module directly must not hide the others.
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        _load_builtin_tools()
        # Plugins after the built-ins, in every process alike (parent, forkserver workers, Ray actors).
        from batchrun.prompt.tools.plugins import load_plugins

        load_plugins()
    global _ORDERED
    if _ORDERED is None:  # cached: this is called on every tool call
        # Built-in toolsets in TOOLSETS order, then the others in the order they were added, so the
        # order never depends on which module was imported first.
        order = {name: i for i, name in enumerate([*TOOLSETS, *_EXTRA_TOOLSETS])}
        _ORDERED = dict(sorted(_REGISTRY.items(), key=lambda item: order[item[1].toolset]))
    return dict(_ORDERED)


def known_tool_names() -> list[str]:
    """Every tool name the runner knows, sorted: the columns of tool_stats in every record."""
    return sorted(all_tools())


def available_toolsets(extra: dict[str, Any] | None = None) -> set[str]:
    """Toolsets that have a tool here and whose configuration is present.

    ``extra`` is what the runner puts in ``ToolContext.extra`` (the run's endpoint, run_dir, ...).
    Raises ``ToolConfigError`` (a ValueError naming the variable) for a bad setting.
    """
    extra = extra or {}
    present = {t.toolset for t in all_tools().values()}
    return {ts for ts in present if ts not in _TOOLSET_CHECKS or _TOOLSET_CHECKS[ts](extra)}


def tools_for_toolsets(toolsets: list[str], extra: dict[str, Any] | None = None) -> list[Tool]:
    """The tools offered for the given toolsets, in registry order.

    A tool that belongs to another toolset as well (``also_in``) comes with it only when its own
    toolset is configured under ``extra`` (the run's ``ToolContext.extra``; None: this environment).
    """
    wanted = set(toolsets)
    return [
        t
        for t in all_tools().values()
        if t.toolset in wanted or (wanted.intersection(t.also_in) and _configured(t.toolset, extra))
    ]


def _configured(toolset: str, extra: dict[str, Any] | None) -> bool:
    check = _TOOLSET_CHECKS.get(toolset)
    try:
        return check is None or bool(check(extra or {}))
    except ValueError:  # a bad setting: the run's preflight reports it; here the tool is just not offered
        return False


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
    return args


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
        parsed = json.loads(arguments) if arguments and arguments.strip() else {}
    except json.JSONDecodeError as exc:
        return json.dumps({"error": f"Invalid JSON in arguments of {name}: {exc.msg} at position {exc.pos}"})
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
