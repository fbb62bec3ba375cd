"""The README tells the truth: every flag its commands use exists, and every file and state key a real
run writes is named there (a user reads the README, not the code, to know what a key holds)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from batchrun.config import RunConfig
from batchrun.views import compare, export, report, score, status
from tests.helpers import ROOT, run, write_rows

README = (ROOT / "README.md").read_text("utf-8")
VIEWS = {"score": score, "compare": compare, "export": export, "report": report, "status": status}


def fenced_commands() -> list[str]:
    """Every command line of the README's bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("python"):
                commands.append(line)
    return commands


def view_options(module, capsys) -> str:
    with pytest.raises(SystemExit):
        module.main(["--help"])
    return capsys.readouterr().out


def test_every_flag_of_the_readmes_commands_exists(capsys):
    commands = fenced_commands()
    assert len(commands) >= 10
    runner_flags = set(RunConfig.flag_names())
    for command in commands:
        flags = re.findall(r"(?<![\w-])--([a-z][\w-]*)", command)
        view = re.match(r"python (?:-m batchrun\.views\.(\w+)|batch_runner\.py (export)\b)", command)
        if view:
            options = view_options(VIEWS[view.group(1) or view.group(2)], capsys)
            unknown = [f for f in flags if f"--{f}" not in options]
        elif command.startswith("python batch_runner.py"):
            unknown = [f for f in flags if f not in runner_flags]
        else:
            continue
        assert not unknown, f"{command}: {unknown}"


def test_every_runner_flag_is_in_the_readmes_tables():
    tabled = set()
    for line in README.splitlines():
        if line.startswith("| `--"):
            tabled.update(re.findall(r"--(\w+)", line.split("|")[1]))
    assert set(RunConfig.flag_names()) == tabled


def keys(value, depth: int) -> set[str]:
    """The key names of a JSON object down to ``depth`` levels (lists: their first object)."""
    if isinstance(value, list):
        return keys(value[0], depth) if value else set()
    if not isinstance(value, dict) or depth == 0:
        return set()
    names = set(value)
    for name, inner in value.items():
        by_data = name.startswith(("by_", "tool_", "pass_at_k", "toolsets_", "batch_stats"))
        by_data |= (
            name in ("discarded", "failed") and isinstance(inner, dict) and "total" not in inner
        )  # this_run's: by reason, class
        if not by_data:
            names |= keys(inner, depth - 1)
    return names


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run with kept, partial, scored, discarded and failed samples and a bad dataset line."""
    tmp = tmp_path_factory.mktemp("readme")
    dataset = write_rows(
        tmp / "rows.jsonl",
        [
            {"prompt": "Plain [answer:4]", "answer": "4"},
            {"prompt": "Cut [truncate]", "answer": "4"},
            {"prompt": "Say hi [no_reasoning]"},
            {"prompt": "Fail [error:500]"},
        ],
    )
    with dataset.open("a") as f:
        f.write("not json\n")
    run(None, dataset, tmp, max_retries=0, budget_tokens=10**6)
    return tmp / "run"


def test_every_file_of_a_run_directory_is_listed(run_dir):
    listing = README.split("## Output\n", 1)[1].split("```", 2)[1]
    written = {p.name for p in run_dir.iterdir()}
    assert {"failed.jsonl", "discarded.jsonl", "status.json"} <= written
    for name in written:
        assert re.sub(r"_\d+\.", "_N.", name) in listing, name


@pytest.mark.parametrize(
    "name, depth",
    [("statistics.json", 3), ("status.json", 2), ("checkpoint.json", 1), ("run_manifest.json", 1)],
)
def test_every_state_key_is_named(run_dir, name, depth):
    state = json.loads((run_dir / name).read_text("utf-8"))
    missing = sorted(k for k in keys(state, depth) if not re.search(rf"`[^`]*\b{re.escape(k)}\b", README))
    assert not missing, f"{name}: {missing}"


@pytest.mark.parametrize("name", ["trajectories.jsonl", "discarded.jsonl", "failed.jsonl"])
def test_every_record_key_is_named(run_dir, name):
    rows = [json.loads(line) for line in (run_dir / name).read_text("utf-8").splitlines()]
    assert rows
    names = set().union(*(keys(row, 4) for row in rows))
    missing = sorted(k for k in names if not re.search(rf"`[^`]*\b{re.escape(k)}\b", README))
    assert not missing, f"{name}: {missing}"


def test_the_help_names_the_export_command_and_the_run_files():
    done = subprocess.run(
        [sys.executable, str(ROOT / "batch_runner.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "batch_runner.py export" in done.stdout  # the README's Exporting for training
    for name in ("discarded.jsonl", "failed.jsonl", "status.json", "run_manifest.json", "report.html"):
        assert name in done.stdout, name
    # Every exit code the README's list gives (the help left out 8, the refused key).
    listed = README.split("\nExit codes: ", 1)[1].split("\n\n", 1)[0]
    codes = re.findall(r"(?:^|; )(\d+) ", listed)
    assert codes[:2] == ["0", "2"] and "8" in codes, codes
    said = " ".join(done.stdout.split())
    for code in codes:
        assert re.search(rf"(?:codes: |, ){code} [a-z-]", said), code


@pytest.mark.parametrize("fmt", ["messages", "openai", "prompt_completion", "sharegpt", "rewards"])
def test_every_export_column_is_named(run_dir, tmp_path, fmt):
    assert (
        export.main([str(run_dir), f"--format={fmt}", f"--out={tmp_path / fmt}", "--include_discarded"]) == 0
    )
    rows = [json.loads(line) for f in (tmp_path / fmt).glob("*.jsonl") for line in f.open()]
    names = set().union(*(set(row) for row in rows))
    missing = sorted(k for k in names if not re.search(rf"`[^`]*\b{re.escape(k)}\b", README))
    assert not missing, f"{fmt}: {missing}"


def test_the_readme_says_an_agent_samples_completion_holds_the_tool_results(run_dir, tmp_path):
    """The README said prompt_completion lets a trainer compute the loss on the completion only; for an
    agent sample the completion holds the tool results too, so TRL's completion-only loss trains the
    model to write them. It says so now, and names the format that trains on the model's turns alone."""
    assert export.main([str(run_dir), "--format=prompt_completion", f"--out={tmp_path / 'pc'}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "pc" / "train.jsonl").read_text("utf-8").splitlines()]
    assert any(m["role"] == "tool" for row in rows for m in row["completion"])
    section = README.split("## Exporting for training\n", 1)[1].split("\n## ", 1)[0]
    entry = " ".join(re.search(r"^- `prompt_completion`:.*?(?=^- `)", section, re.M | re.S).group(0).split())
    assert "loss on the completion only" not in entry
    assert "the completion holds the tool results too" in entry
    assert "use `messages` with TRL's `assistant_only_loss=True`" in entry
    assert "`chosen` and `rejected` hold the tool results too" in " ".join(section.split())
