"""One cap on every tool result at the registry, and plugins that cannot shadow or block built-ins or
MCP servers (issue 25, item 6)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import read_jsonl, write_jsonl
from test_tools_plugins import PLUGINS, build_wheel, runner

from batchrun.prompt.tools.catalog import add_toolset, execute_tool_call
from batchrun.prompt.tools.registry import Tool, ToolContext, remove_toolsets, result_cap_bytes


def test_a_huge_tool_result_is_cut_at_the_registry_with_a_note():
    """A plugin's 50 MB result used to become a 52 MB record and go into every later request."""
    huge = "x" * (50 << 20)
    add_toolset(
        "hugetest",
        "test",
        [
            Tool(
                "huge_result",
                "hugetest",
                "big",
                {"type": "object", "properties": {}},
                lambda ctx, args: {"text": huge},
            )
        ],
    )
    try:
        ctx = ToolContext(sandbox=None)
        out = execute_tool_call("huge_result", "{}", ctx, {"huge_result"})
    finally:
        remove_toolsets({"hugetest"})
    assert len(out.encode()) <= result_cap_bytes(ctx)
    parsed = json.loads(out)
    assert parsed["truncated_result"].startswith('{"text": "xxx')
    assert "dropped" in parsed["note"] and f"{len(huge) + 12:,} bytes" in parsed["note"]


def test_a_small_result_is_left_as_it_is():
    add_toolset(
        "smalltest",
        "test",
        [
            Tool(
                "small_result",
                "smalltest",
                "s",
                {"type": "object", "properties": {}},
                lambda ctx, args: {"text": "hi"},
            )
        ],
    )
    try:
        out = execute_tool_call("small_result", "{}", ToolContext(sandbox=None), {"small_result"})
    finally:
        remove_toolsets({"smalltest"})
    assert json.loads(out) == {"text": "hi"}


@pytest.fixture(scope="module")
def clash_path(tmp_path_factory):
    wheels, target = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("site")
    wheel = build_wheel(PLUGINS / "clashtools", wheels)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return target


def test_a_plugin_named_like_a_built_in_is_ignored_and_the_built_in_runs(clash_path, tmp_path):
    write_jsonl(tmp_path / "ds.jsonl", ["use the shell once [calls:1]"])
    done = runner(
        clash_path, "--dataset_file=ds.jsonl", "--batch_size=1", "--run_name=r", "--model=mock",
        "--distribution=terminal_only", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "plugin terminal = clashtools:TOOLS (package batch-runner-clashtools): ignored" in done.stderr
    assert "plugin mcp:x = clashtools:TOOLS (package batch-runner-clashtools): ignored" in done.stderr
    assert "plugin clash = clashtools:CLASH (package batch-runner-clashtools): ignored" in done.stderr
    (rec,) = read_jsonl(tmp_path / "data/r/trajectories.jsonl")
    assert rec["tool_stats"]["terminal"]["success"] == 1  # the built-in ran
    assert "echo_text" not in rec["tool_stats"]  # nothing of the ignored plugins is known


def test_a_thread_that_asks_for_the_tools_while_another_loads_them_sees_them_all(monkeypatch):
    """A worker's first prompts make their first tool calls at once: one thread saw a half-made
    registry ("Unknown tool 'process'. Available tools: process") while another was loading it."""
    import threading
    import time

    from batchrun.prompt.tools import catalog, registry

    def slow_plugins(builtin: set[str]) -> None:
        time.sleep(0.3)
        marker = Tool("race_marker", "racetest", "m", {"type": "object", "properties": {}}, lambda c, a: {})
        registry.add_toolset("racetest", "test", [marker])

    monkeypatch.setattr(catalog, "_BUILTINS_LOADED", False)
    monkeypatch.setattr(catalog, "_BUILTINS_READY", False)
    monkeypatch.setattr(catalog, "load_plugins", slow_plugins)
    seen: dict[str, set[str]] = {}
    loader = threading.Thread(target=lambda: seen.update(first=set(catalog.all_tools())))
    try:
        loader.start()
        time.sleep(0.1)  # the loader is in the middle of it
        seen["second"] = set(catalog.all_tools())
        loader.join()
    finally:
        remove_toolsets({"racetest"})
    assert "race_marker" in seen["first"] and "race_marker" in seen["second"]
