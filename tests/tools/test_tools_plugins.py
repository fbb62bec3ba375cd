"""Toolset plugins: small packages (tests/plugins/) installed with pip into a directory the runner's
subprocess has on its path, found through the entry point group ``batch_runner.toolsets``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TESTS_DIR, build_wheel, read_jsonl, write_jsonl

PLUGINS = TESTS_DIR / "plugins"
BROKEN_WARNING = "warning: toolset plugin not loaded, its tools are not offered: plugin brokentools"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """wordtools (good) and brokentools (a bad schema), installed by pip into their own directory,
    from wheels built here (offline: no package index is reached)."""
    wheels = tmp_path_factory.mktemp("wheels")
    target = tmp_path_factory.mktemp("site")
    built = [str(build_wheel(PLUGINS / name, wheels)) for name in ("wordtools", "brokentools")]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), *built],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"pip could not install the test plugins:\n{done.stdout}\n{done.stderr}")
    return target


def runner(plugin_path: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin_path)])}
    return subprocess.run(
        [sys.executable, str(ROOT / "batch_runner.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def dist_file(tmp_path: Path, **dists: dict) -> Path:
    path = tmp_path / "dists.json"
    path.write_text(json.dumps({n: {"probabilities": p} for n, p in dists.items()}), "utf-8")
    return path


def test_plugin_toolset_runs_end_to_end(plugin_path, tmp_path):
    write_jsonl(tmp_path / "ds.jsonl", ["count these four words", "then shout [calls:2]"])
    dists = dist_file(tmp_path, words={"wordtools": 100}, mixed={"terminal": 100, "wordtools": 100})
    done = runner(
        plugin_path, "--dataset_file=ds.jsonl", "--batch_size=2", "--run_name=r", "--model=mock",
        f"--distribution_file={dists}", "--distribution=words", "--num_workers=2",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(BROKEN_WARNING) == 1  # reported once, by the runner, not by each worker
    records = {r["conversations"][1]["value"]: r for r in read_jsonl(tmp_path / "data/r/trajectories.jsonl")}
    assert len(records) == 2  # a plugin's tool is known: no record dropped as hallucinated
    counted = records["count these four words"]
    # The handler ran wc in the prompt's sandbox; the model quoted its answer.
    assert '"words": 4' in counted["conversations"][-1]["value"]
    assert counted["toolsets_used"] == ["wordtools"]
    assert counted["tool_stats"]["word_count"] == {"count": 1, "success": 1, "failure": 0}
    shouted = records["then shout [calls:2]"]
    assert shouted["tool_stats"]["shout"] == {"count": 1, "success": 1, "failure": 0}
    assert "THEN SHOUT" in shouted["conversations"][-1]["value"]
    for rec in records.values():  # every known tool in every record; the broken plugin's in none
        assert {"word_count", "shout", "terminal", "read_file"} <= set(rec["tool_stats"])
        assert "broken" not in rec["tool_stats"]
    stats = json.loads((tmp_path / "data/r/statistics.json").read_text("utf-8"))
    assert stats["tool_stats"]["word_count"]["count"] == 2  # [calls:2] calls word_count, then shout


def test_list_distributions_names_plugin_toolsets_and_broken_plugins(plugin_path, tmp_path):
    done = runner(plugin_path, "--list_distributions", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listing = done.stdout.split("Toolsets:\n", 1)[1]
    assert "  wordtools: plugin wordtools = wordtools:TOOLS (package batch-runner-wordtools)" in listing
    assert "    tools: word_count, shout" in listing
    assert "  brokentools: NOT LOADED: plugin brokentools = brokentools:TOOLS" in listing
    assert '\'parameters\' must be a JSON schema with "type": "object"' in listing


def test_a_distribution_naming_a_broken_plugin_stops_the_run(plugin_path, tmp_path):
    write_jsonl(tmp_path / "ds.jsonl", ["never runs"])
    dists = dist_file(tmp_path, broken={"terminal": 100, "brokentools": 50})
    done = runner(
        plugin_path, "--dataset_file=ds.jsonl", "--batch_size=1", "--run_name=r", "--model=mock",
        f"--distribution_file={dists}", "--distribution=broken",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        "--distribution=broken: toolset 'brokentools' comes from a plugin that cannot be loaded"
        in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


def test_without_the_plugin_installed_its_toolset_is_unknown(tmp_path):
    write_jsonl(tmp_path / "ds.jsonl", ["x"])
    dists = dist_file(tmp_path, words={"wordtools": 100})
    done = runner(
        tmp_path / "nothing", "--dataset_file=ds.jsonl", "--batch_size=1", "--run_name=r", "--model=mock",
        f"--distribution_file={dists}", "--distribution=words",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        f"--distribution_file {dists}: distribution 'words': field 'probabilities' names unknown toolset 'wordtools'"
        in done.stderr
    )


# ----------------------------------------------------------------------------- the definitions, checked


def _handler(ctx, args):
    return {"ok": True, "error": None}


@pytest.mark.parametrize(
    ("definition", "fragment"),
    [
        ({"name": "has space", "handler": _handler}, "'name' must be 1-64 letters"),
        ({"name": "x" * 65, "handler": _handler}, "'name' must be 1-64 letters"),
        ({"name": "t", "parameters": {"type": "array"}, "handler": _handler}, '"type": "object"'),
        (
            {
                "name": "t",
                "parameters": {"type": "object", "properties": {}, "required": ["a"]},
                "handler": _handler,
            },
            "'parameters.required' must list names declared",
        ),
        ({"name": "t", "handler": "not callable"}, "'handler' must be a function"),
        ({"name": "t", "description": 5, "handler": _handler}, "'description' must be a string"),
        (
            {"name": "t", "handler": _handler, "sandbox_network": "no"},
            "'sandbox_network' must be true or false",
        ),
    ],
)
def test_bad_tool_definitions_are_refused(definition, fragment):
    from batchrun.prompt.tools.plugins import tools_from

    with pytest.raises(ValueError, match=None) as info:
        tools_from("mine", [definition])
    assert fragment in str(info.value)


def test_a_plugin_tool_may_use_the_sandbox_network_unless_it_says_it_never_does():
    from batchrun.prompt.tools.plugins import tools_from
    from batchrun.prompt.tools.registry import needs_sandbox_network

    default, offline = tools_from(
        "mine",
        [{"name": "a", "handler": _handler}, {"name": "b", "handler": _handler, "sandbox_network": False}],
    )
    assert default.sandbox_network is True and offline.sandbox_network is False
    assert needs_sandbox_network([default, offline]) and not needs_sandbox_network([offline])


def test_a_handler_answer_that_is_not_a_json_object_is_an_error_the_model_sees():
    from batchrun.prompt.tools.plugins import tools_from
    from batchrun.prompt.tools.registry import check_arguments

    schema = {"type": "object", "properties": {"a": {"type": ["string", "null"]}}}
    lists, sets = tools_from(
        "mine",
        lambda: [
            {"name": "lists", "parameters": schema, "handler": lambda ctx, args: [1]},
            {"name": "sets", "parameters": schema, "handler": lambda ctx, args: {"s": {1}}},
        ],
    )
    assert lists.handler(None, {}) == {"error": "lists returned list, not a JSON object"}
    assert sets.handler(None, {})["error"].startswith("sets returned a value that is not JSON")
    assert check_arguments(lists, {"a": None}) == {"a": None}  # a list of types: any of them fits
    with pytest.raises(ValueError, match="argument 'a' must be string or null, got int"):
        check_arguments(lists, {"a": 3})


def test_a_worker_that_knows_other_tools_fails_its_prompts_naming_the_difference():
    from batchrun.prompt.attempt import RunTools, install_run_tools, run_prompt
    from batchrun.prompt.tools.catalog import known_tool_names
    from batchrun.protocol import PromptJob

    job = PromptJob(batch_num=0, prompt_index=0, prompt="p", toolsets=("terminal",))
    try:
        install_run_tools(RunTools(known_tools=(*known_tool_names(), "word_count")))
        outcome = run_prompt(job, settings=None, llm=None)  # fails before it needs either
    finally:
        install_run_tools(RunTools(known_tools=tuple(known_tool_names())))
    assert outcome.error_class == "tools"
    assert "this worker's tools differ from the runner's (missing: word_count; extra: -)" in outcome.error
