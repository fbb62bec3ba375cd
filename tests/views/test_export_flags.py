"""The exporter's stop-reason flags refuse a name no record can have, before anything is written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import run, write_rows

from batchrun.prompt import loop
from batchrun.record import STOP_REASONS
from batchrun.views import export

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"id": "a", "prompt": "Say 42 [calls:1] [answer:42]", "answer": "42"},
    {"id": "b", "prompt": "Keep going forever [loop]"},  # partial: stops at --max_turns
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("flags")
    run(None, write_rows(tmp / "d.jsonl", ROWS), tmp / "data", max_turns=2)
    return tmp / "data" / "run"


@pytest.mark.parametrize("fmt", ["openai", "messages", "preference", "rewards"])
@pytest.mark.parametrize(
    "flag",
    ["--exclude_stop_reasons=truncatd", "--stop_reasons=final_answr", "--stop_reasons=final_answer,nosuch"],
)
def test_an_unknown_stop_reason_is_refused_naming_the_flag_the_value_and_the_reasons(
    run_dir, tmp_path, capsys, fmt, flag
):
    """--exclude_stop_reasons=truncatd exited 0, its list replacing the default: the truncated and
    invalid_tool_calls samples went into the training data; --stop_reasons=final_answr exited 1,
    "nothing to export". Both are typos: exit 2, nothing written."""
    out = tmp_path / "ex"
    assert export.main([str(run_dir), f"--format={fmt}", f"--out={out}", flag]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    name, bad = flag[2:].split("=")
    typo = bad.split(",")[-1]
    assert line.startswith(f"error: --{name}: unknown stop reason {typo}; the stop reasons are ")
    assert all(reason in line for reason in STOP_REASONS)
    assert not out.exists()


def test_a_stop_reason_only_the_run_s_records_hold_is_accepted(run_dir, tmp_path, capsys):
    """The set is not closed: a record another version wrote may hold a reason this one does not know.
    A name the runs' records hold is accepted (and filters as any other); one neither knows is refused."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    path = copy / "trajectories.jsonl"
    records = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    records[0]["metadata"]["stop_reason"] = "older_reason"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    out = tmp_path / "ex"
    assert export.main([str(copy), "--format=openai", f"--out={out}", "--stop_reasons=older_reason"]) == 0
    assert [json.loads(line)["stop_reason"] for line in (out / "train.jsonl").read_text().splitlines()] == [
        "older_reason"
    ]
    capsys.readouterr()
    assert export.main([str(copy), "--format=openai", f"--out={tmp_path / 'b'}", "--stop_reasons=olde"]) == 2
    assert "older_reason" in capsys.readouterr().err  # the valid names include the run's own


def test_known_stop_reasons_no_sample_has_are_accepted(run_dir, tmp_path):
    """A valid reason the run happens not to hold is no typo: the filters run as before."""
    argv = [str(run_dir), "--format=openai", "--exclude_stop_reasons=refusal,unknown"]
    assert export.main([*argv, f"--out={tmp_path / 'a'}"]) == 0
    assert (
        export.main(
            [str(run_dir), "--format=openai", "--stop_reasons=content_filter", f"--out={tmp_path / 'b'}"]
        )
        == 1
    )


def test_the_stop_reasons_are_those_the_loop_writes():
    """STOP_REASONS (what the flags are checked against) holds every reason the agent loop sets."""
    source = Path(loop.__file__).read_text("utf-8")
    written = {
        name
        for line in source.splitlines()
        if re.search(r"\b(stop_reason|bounded)\b.*=", line)
        for name in re.findall(r'"([a-z_]+)"', line)
    }
    assert {"final_answer", "max_turns", "prompt_budget", "context_limit"} <= written
    assert written | set(loop.REPLY_DISCARDS) <= set(STOP_REASONS)
    assert len(STOP_REASONS) == len(set(STOP_REASONS))
