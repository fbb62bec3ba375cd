"""batchrun/run/run_dir.py: one format_version, and the one place that reads or refuses a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import exit_code, requests, run, write_rows

from batchrun.run.run_dir import FORMAT_VERSION, check_run_dir
from batchrun.views import compare, export, report, score, status

PROMPTS = ["first task [calls:0]", "second task [calls:0]"]


def _finished_run(server, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A finished run whose samples are judged (so that every view, compare too, has work)."""
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": p, "answer": "done"} for p in PROMPTS])
    out = tmp_path / "data"
    run(server, dataset, out, scorer="includes")
    return dataset, out, out / "run"


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text("utf-8"))
    change(data)
    path.write_text(json.dumps(data), "utf-8")


def _declare(run_dir: Path, version) -> None:
    for name in ("run_manifest.json", "checkpoint.json"):
        _edit_json(run_dir / name, lambda d: d.update(format_version=version))


def _undeclare(run_dir: Path) -> None:
    for name in ("run_manifest.json", "checkpoint.json"):
        _edit_json(run_dir / name, lambda d: d.pop("format_version"))


def _views(run_dir: Path, tmp_path: Path) -> dict[str, list[str]]:
    """Each view's argv on ``run_dir``."""
    return {
        "status": [str(run_dir)],
        "report": [str(run_dir)],
        "export": [str(run_dir), "--format=sharegpt", f"--out={tmp_path / 'export'}"],
        "score": [str(run_dir), "--scorer=includes"],
        "compare": [str(run_dir), str(run_dir), f"--out={tmp_path / 'c.html'}"],
    }


MAINS = {
    "status": status.main,
    "report": report.main,
    "export": export.main,
    "score": score.main,
    "compare": compare.main,
}


def test_a_run_declares_its_format_in_the_manifest_and_the_checkpoint(server, tmp_path):
    _, _, run_dir = _finished_run(server, tmp_path)
    for name in ("run_manifest.json", "checkpoint.json"):
        assert json.loads((run_dir / name).read_text("utf-8"))["format_version"] == FORMAT_VERSION
    assert check_run_dir(run_dir) is None
    # the reference's checkpoint keys are all still there: the field is only added
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text("utf-8"))
    assert {"run_name", "completed_prompts", "batch_stats", "last_updated"} <= set(checkpoint)


def test_resume_refuses_a_directory_of_another_format_before_any_model_call(server, tmp_path, capsys):
    dataset, out, run_dir = _finished_run(server, tmp_path)
    (run_dir / "batch_0.jsonl").write_text("", "utf-8")  # work left, so a resume would call the model
    _declare(run_dir, FORMAT_VERSION + 1)
    before = requests(server)
    capsys.readouterr()
    assert exit_code(server, dataset, out, resume=True, scorer="includes") == 2
    err = capsys.readouterr().err
    assert str(run_dir) in err and f"format version {FORMAT_VERSION + 1}" in err
    assert f"reads format version {FORMAT_VERSION}" in err
    assert requests(server) == before


@pytest.mark.parametrize("view", sorted(MAINS))
def test_every_view_refuses_a_directory_of_another_format(server, tmp_path, capsys, view):
    _, _, run_dir = _finished_run(server, tmp_path)
    assert MAINS[view](_views(run_dir, tmp_path)[view]) == 0
    _declare(run_dir, "2")  # not this format's number, whatever its type
    capsys.readouterr()
    assert MAINS[view](_views(run_dir, tmp_path)[view]) == 2
    err = capsys.readouterr().err
    assert str(run_dir) in err and "format version '2'" in err


def test_a_directory_written_before_the_field_is_read_as_this_format(server, tmp_path, capsys):
    dataset, out, run_dir = _finished_run(server, tmp_path)
    _undeclare(run_dir)
    assert check_run_dir(run_dir) is None
    before = requests(server)
    run(server, dataset, out, resume=True, scorer="includes")
    assert requests(server) == before  # every prompt was found finished
    assert json.loads((run_dir / "run_manifest.json").read_text("utf-8"))["format_version"] == FORMAT_VERSION
    assert report.main([str(run_dir)]) == 0


def test_a_directory_written_before_the_field_in_a_form_no_reader_handles_is_refused(
    server, tmp_path, capsys
):
    dataset, out, run_dir = _finished_run(server, tmp_path)
    _undeclare(run_dir)
    _edit_json(run_dir / "statistics.json", lambda d: d.pop("runs"))  # as before the history existed
    form = "statistics.json without its runs history"
    problem = check_run_dir(run_dir)
    assert problem and form in problem and str(run_dir) in problem
    before = requests(server)
    capsys.readouterr()
    assert exit_code(server, dataset, out, resume=True, scorer="includes") == 2
    assert form in capsys.readouterr().err
    assert requests(server) == before
    assert report.main([str(run_dir)]) == 2


def test_an_empty_or_new_directory_is_readable(tmp_path):
    assert check_run_dir(tmp_path) is None  # nothing written yet: nothing to refuse
    (tmp_path / "run_manifest.json").write_text("{not json", "utf-8")
    assert check_run_dir(tmp_path) is None  # damage is the manifest check's to report
    (tmp_path / "run_manifest.json").write_text(json.dumps({"format_version": True}), "utf-8")
    assert "format version True" in (check_run_dir(tmp_path) or "")
