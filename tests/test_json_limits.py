"""JSON that Python's reader cannot take (an integer of more than 4300 digits: a ValueError that is no
JSONDecodeError; nesting past the recursion limit: a RecursionError), from every outside source: a
dataset line, a flag's file, a saved batch line on resume, an endpoint's body, a tool call's arguments.
Each is a bad input named where it is, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, read_jsonl, run, stats_of, write_jsonl

from batchrun.sharegpt import parse_json, strict_json

DEEP = "[" * 100_000 + "]" * 100_000
BIG = "1" + "0" * 5000


@pytest.mark.parametrize(
    ("text", "said"), [(DEEP, "nested too deeply"), (BIG, "more than 4300 digits")], ids=["deep", "big"]
)
def test_parse_json_refuses_with_a_value_error(text, said):
    for reader in (parse_json, strict_json):
        with pytest.raises(ValueError, match=said):
            reader(text)


def test_dataset_lines_too_deep_or_too_long_a_number_are_skipped_naming_the_line(tmp_path, capsys):
    ds = tmp_path / "d.jsonl"
    ds.write_text(
        f'{{"prompt": "deep", "x": {DEEP}}}\n{{"prompt": "big", "x": {BIG}}}\n{DEEP}\n{{"prompt": "fine"}}\n'
    )
    out = tmp_path / "data"
    run(None, ds, out)
    err = capsys.readouterr().err
    for line, said in (
        (1, "JSON nested too deeply"),
        (2, "a number of more than"),
        (3, "JSON nested too deeply"),
    ):
        assert f"{ds}:{line}: invalid JSON: {said}" in err, err
    assert [r["conversations"][1]["value"] for r in read_jsonl(out / "run" / "trajectories.jsonl")] == [
        "fine"
    ]


def test_a_flag_file_too_deep_exits_2_naming_the_flag(tmp_path):
    ds = write_jsonl(tmp_path / "d.jsonl", ["x"])
    prefill = tmp_path / "prefill.json"
    prefill.write_text(DEEP)
    dist = tmp_path / "dist.json"
    dist.write_text(f'{{"d": {{"terminal": {BIG}}}}}')
    for flag, path in (("--prefill_messages_file", prefill), ("--distribution_file", dist)):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={ds}", "--batch_size=1",
             "--run_name=r", "--model=mock", f"--output_dir={tmp_path / 'data'}", f"{flag}={path}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "data" / "r").exists()


def test_resume_and_the_views_over_batch_lines_too_deep_or_too_long_a_number(tmp_path):
    ds = write_jsonl(tmp_path / "d.jsonl", ["a", "b", "c"])
    out = tmp_path / "data"
    run(None, ds, out)
    run_dir = out / "run"
    with open(run_dir / "batch_0.jsonl", "a") as f:
        f.write(f'{DEEP}\n{{"x": {BIG}}}\n{{"conversations": {"[" * 3000 + "]" * 3000}}}\n')
    run(None, ds, out, resume=True)
    stats = stats_of(run_dir)
    assert stats["trajectories"] == 3 and stats["dropped_at_merge"]["invalid_lines"] == 3, stats
    report = subprocess.run(
        [sys.executable, "-m", "batchrun.views.report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr


def test_tool_call_arguments_too_deep_are_an_invalid_call_not_a_crash():
    from batchrun.prompt.tools.catalog import execute_tool_call
    from batchrun.prompt.tools.registry import ToolContext

    ctx = ToolContext(sandbox=None, tool_timeout_s=5.0, output_cap_bytes=4096)
    for args in (f'{{"command": "echo", "x": {DEEP}}}', f'{{"command": "echo", "timeout": {BIG}}}'):
        said = json.loads(execute_tool_call("terminal", args, ctx, {"terminal"}))
        assert said["error"].startswith("Invalid JSON in arguments of terminal"), said


def test_a_dataset_line_past_32_mib_is_skipped_unread(tmp_path, capsys):
    from batchrun.run import dataset

    ds = tmp_path / "d.jsonl"
    with open(ds, "w") as f:
        f.write(
            '{"prompt": "first"}\n{"prompt": "'
            + "x" * (dataset.MAX_LINE_BYTES + 10)
            + '"}\n{"prompt": "last"}'
        )
    rows, problems = dataset.load_dataset(str(ds))
    assert [r.prompt for r in rows] == ["first", "last"]
    assert problems == [f"{ds}:2: longer than 32 MiB (skipped unread)"]


def test_dataset_lines_are_read_strictly(tmp_path):
    """A key named twice (which did the user mean?), NaN or Infinity (strict readers of the records,
    which keep the row's fields, refuse them), a cwd no file system takes: bad lines, named."""
    from batchrun.run import dataset

    ds = tmp_path / "d.jsonl"
    long_cwd = "/" + "a" * 300
    ds.write_text(
        '{"prompt": "a", "prompt": "b"}\n{"prompt": "c", "x": NaN}\n{"prompt": "d", "x": -Infinity}\n'
        f'{{"prompt": "e", "cwd": "{long_cwd}"}}\n{{"prompt": "ok"}}\n'
    )
    rows, problems = dataset.load_dataset(str(ds))
    assert [r.prompt for r in rows] == ["ok"]
    assert problems == [
        f"{ds}:1: invalid JSON: 'prompt' is defined twice",
        f"{ds}:2: invalid JSON: NaN is not a JSON number",
        f"{ds}:3: invalid JSON: -Infinity is not a JSON number",
        f"{ds}:4: field 'cwd' is too long a path (at most 4095 bytes, each name at most 255)",
    ]
