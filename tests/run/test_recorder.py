"""batchrun/run/recorder.py: one writer per run directory; a run that cannot write stops cleanly (exit 4)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import exit_code, parse_line, read_jsonl, run, write_jsonl

from batchrun.cli import EXIT_CANNOT_WRITE
from batchrun.record import valid_record
from batchrun.sharegpt import first_human
from batchrun.views.status import format_status


def test_a_second_runner_on_the_same_run_directory_is_refused(server, tmp_path, capsys):
    """Two runners on one run directory would pay for and write the same prompts twice."""
    import fcntl

    dataset = write_jsonl(tmp_path / "d.jsonl", ["only once [calls:0]"])
    run_dir = tmp_path / "data" / "run"
    run_dir.mkdir(parents=True)
    with (run_dir / ".lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a live runner holds
        held.write("pid 4242 on elsewhere\n")
        held.flush()
        with pytest.raises(SystemExit) as info:
            run(server, dataset, tmp_path / "data")
        assert info.value.code == 2
        assert "in use by a running batch_runner" in capsys.readouterr().err
    assert server.stats()["requests"] == 0
    run(server, dataset, tmp_path / "data")  # the lock died with its holder: the run goes ahead
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 1


def test_a_new_run_directory_is_its_owners_alone_whatever_the_umask(tmp_path):
    """Under the usual umask 022 the run directory was 0755 and its files 0644: any user of the
    machine read every prompt's trajectory (and the rows' expected answers). A directory the user
    made beforehand keeps the mode they gave it."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["private [calls:0]"])
    old = os.umask(0o022)
    try:
        run(None, dataset, tmp_path / "data")
        shared = tmp_path / "data" / "shared"
        shared.mkdir(mode=0o750)
        run(None, dataset, tmp_path / "data", run_name="shared")
    finally:
        os.umask(old)
    assert (tmp_path / "data" / "run").stat().st_mode & 0o777 == 0o700
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1
    assert (tmp_path / "data").stat().st_mode & 0o777 == 0o755  # the parent, as the umask says
    assert shared.stat().st_mode & 0o777 == 0o750


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A real file system that fills up (root only); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.root
def test_disk_full_stops_with_exit_4_and_resume_gives_each_row_once(server, tmp_path, capsys):
    prompts = [f"row {i:02d} " + "lorem ipsum " * 300 for i in range(30)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    with small_tmpfs(tmp_path / "out", "96k") as out:
        run_dir = out / "run"
        assert exit_code(server, dataset, out, batch_size=50) == EXIT_CANNOT_WRITE
        err = capsys.readouterr().err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert f"cannot write {run_dir}" in line and "No space left on device" in line
        assert "Traceback" not in err
        status = json.loads((run_dir / "status.json").read_text("utf-8"))
        assert status["state"] == "failed" and "No space left on device" in status["error"]
        kept = [
            r
            for r in map(parse_line, (run_dir / "batch_0.jsonl").read_bytes().splitlines())
            if valid_record(r)
        ]
        assert 0 < len(kept) < 30
        # The append the disk could not hold took back what it wrote: no half line stays in the file,
        # to be skipped and counted as torn by every merge from then on (it was: invalid_lines 1).
        assert all(
            parse_line(raw) is not None for raw in (run_dir / "batch_0.jsonl").read_bytes().splitlines()
        )
        first_run = collections.Counter(server.stats()["requests_by_prompt"])

        subprocess.run(["mount", "-o", "remount,size=16m", str(out)], check=True)
        run(server, dataset, out, resume=True, batch_size=50)
        merged = read_jsonl(run_dir / "trajectories.jsonl")
        assert sorted(first_human(r["conversations"]) for r in merged) == sorted(prompts)
        again = collections.Counter(server.stats()["requests_by_prompt"]) - first_run
        assert not {first_human(r["conversations"]) for r in kept} & set(again)  # recorded rows never re-ran
        assert json.loads((run_dir / "status.json").read_text("utf-8"))["state"] == "finished"
        stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
        assert stats["dropped_at_merge"]["invalid_lines"] == 0
        assert stats["invalid_lines_skipped"]["batch_files"] == 0


@pytest.mark.root
def test_disk_full_during_the_merge_stops_with_exit_4_and_resume_gives_the_merged_file(
    server, tmp_path, capsys
):
    """Every outcome was recorded, and the disk filled up writing trajectories.jsonl's temp copy: the run
    ended with a traceback and exit 1 (the merge's OSError was no WriteError), not the clear stop every
    other write failure gets (exit 4, what to do, status.json saying so)."""
    prompts = [f"row {i:02d} " + "lorem ipsum " * 300 for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(server, dataset, tmp_path / "whole", batch_size=50)
    whole = tmp_path / "whole" / "run"
    before_merge = [*whole.glob("batch_*.jsonl"), *(whole / n for n in ("run_manifest.json", "status.json"))]
    before_merge += [whole / "checkpoint.json"] * 2  # and its temp copy while it is replaced
    pages = sum(-(-f.stat().st_size // 4096) * 4096 for f in before_merge) + 4096  # .lock
    merged_size = (whole / "trajectories.jsonl").stat().st_size
    assert merged_size > 64 * 1024  # the half of it the disk holds is more than any state file
    # Room for every file the run writes before its merge, and for half the merged file.
    with small_tmpfs(tmp_path / "out", f"{(pages + merged_size // 2) // 1024}k") as out:
        run_dir = out / "run"
        assert exit_code(server, dataset, out, batch_size=50) == EXIT_CANNOT_WRITE
        err = capsys.readouterr().err
        assert "Traceback" not in err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert f"cannot write {run_dir / 'trajectories.jsonl'}: No space left on device" in line
        assert not [f.name for f in run_dir.iterdir() if f.name.endswith(".tmp")]
        assert json.loads((run_dir / "status.json").read_text("utf-8"))["state"] == "failed"
        requests = server.stats()["requests"]

        subprocess.run(["mount", "-o", "remount,size=16m", str(out)], check=True)
        run(server, dataset, out, resume=True, batch_size=50)
        assert server.stats()["requests"] == requests  # every outcome was in: nothing ran again
        merged = read_jsonl(run_dir / "trajectories.jsonl")
        assert sorted(first_human(r["conversations"]) for r in merged) == sorted(prompts)


@pytest.mark.root
def test_an_output_directory_that_turns_read_only_stops_with_exit_4(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"row {i} [slow:0.2]" for i in range(12)])
    with small_tmpfs(tmp_path / "out", "16m") as out:
        run_dir = out / "run"
        import threading

        def make_read_only() -> None:
            # A read-only bind mount over the run directory: the runner's open lock file stays on the
            # writable mount below, every later write goes through the read-only one.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (run_dir / "batch_0.jsonl").exists():
                time.sleep(0.02)
            subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(run_dir)], check=True)

        thread = threading.Thread(target=make_read_only)
        thread.start()
        try:
            code = exit_code(server, dataset, out, num_workers=1, prompts_per_worker=2, batch_size=12)
        finally:
            thread.join()
        err = capsys.readouterr().err
        assert code == EXIT_CANNOT_WRITE
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error: cannot write")]
        assert str(run_dir) in line and "Read-only file system" in line
        assert "status.json could not say so either" in err and "Traceback" not in err
        subprocess.run(["umount", str(run_dir)], check=True)
        kept = [r for r in read_jsonl(run_dir / "batch_0.jsonl") if valid_record(r)]
        run(server, dataset, out, resume=True, batch_size=12)
        merged = read_jsonl(run_dir / "trajectories.jsonl")
        assert len(merged) == 12 and len({first_human(r["conversations"]) for r in merged}) == 12
        assert len(kept) >= 1


def test_an_output_dir_that_is_a_file_exits_2_before_anything_runs(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert exit_code(server, dataset, not_a_dir) == 2
    err = capsys.readouterr().err
    assert "--output_dir" in err and "not a directory" in err
    assert server.stats()["requests"] == 0


def test_status_shows_why_a_run_failed():
    status = {
        "run_name": "r",
        "state": "failed",
        "error": "cannot write /x/batch_0.jsonl: No space left on device",
    }
    text = format_status(status, now=time.time())
    assert "Run r: failed" in text
    assert "FAILED: cannot write /x/batch_0.jsonl: No space left on device" in text


def test_a_reply_holding_a_lone_surrogate_is_a_discard_kept_exactly_and_the_run_goes_on(tmp_path):
    """An endpoint may send a lone surrogate (escaped in its JSON). UTF-8 cannot carry it: the sample
    is discarded as unencodable_text, written escaped to discarded.jsonl with the text exactly as the
    model said it; the other samples are kept and the run's files load."""
    from helpers import ScriptedEndpoint

    def reply(text: str) -> dict:
        message = {"role": "assistant", "content": text}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    odd, plain = reply("odd \ud83d reply"), reply("a plain reply")

    def answer(call: dict, calls: list[dict]):
        body = call["body"] or {}
        text = json.dumps(body.get("messages", []))
        return 200, odd if "surrogate please" in text else plain

    dataset = write_jsonl(tmp_path / "d.jsonl", ["surrogate please", "plain please"])
    with ScriptedEndpoint(answer) as endpoint:
        run(None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key="sk-odd-test",
            num_workers=1, keep_no_reasoning=True)  # fmt: skip
    run_dir = tmp_path / "data" / "run"
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert [first_human(r["conversations"]) for r in kept] == ["plain please"]
    (row,) = read_jsonl(run_dir / "discarded.jsonl")
    assert row["reason"] == "unencodable_text"
    assert row["record"]["conversations"][-1]["value"].endswith("odd \ud83d reply")
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["discarded"]["by_reason"] == {"unencodable_text": 1}
    from batchrun.views.export import export_run

    result = export_run(run_dir, "messages", tmp_path / "export", include_discarded=True)
    assert sum(result.rows.values()) == 1 and "unencodable_text" in result.skipped_text()
