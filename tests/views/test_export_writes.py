"""What the exporter leaves on disk when it cannot write (a full disk, a read-only --out) or has nothing
to write: one line naming the file and the cause, exit code 2 as the other views' write errors, no
partial file, and an earlier export in --out as it was."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run, write_rows

from batchrun.views import export

REPO = Path(__file__).resolve().parents[2]
# The fake model answers 42: row "flip" fails on sample 0 and passes on sample 1 (a preference pair).
ROWS = [
    {"id": "flip", "prompt": "Say 42, try 0 [calls:1] [answers:42|41]", "answer": "42"},
    {"id": "right", "prompt": "Say 7 [calls:1] [answer:7]", "answer": "7"},
    {"id": "other", "prompt": "Say 42 again [calls:2] [answer:42]", "answer": "42"},
]
FORMATS = ["openai", "preference", "rewards"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("writes")
    run(None, write_rows(tmp / "d.jsonl", ROWS), tmp / "data", samples_per_prompt=2, seed_per_request=True)
    return tmp / "data" / "run"


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file in ``directory`` (temp files included) with its bytes; {} when it does not exist."""
    if not directory.exists():
        return {}
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


class FullDisk:
    """A file on a disk with ``room[0]`` bytes left (shared by the files open on it): a write puts
    what fits, then raises ENOSPC, as ``write`` does on a full disk."""

    def __init__(self, fh, room: list[int]):
        self._fh, self._room = fh, room

    def write(self, data):
        if len(data) > self._room[0]:
            self._fh.write(data[: self._room[0]])
            self._fh.flush()
            self._room[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room[0] -= len(data)
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def fill_disk(monkeypatch, disk: Path, room: int) -> None:
    """Files opened for writing under ``disk`` share ``room`` bytes (the narrowest seam: ``Path.open``,
    which the split files and the card are written through)."""
    real_open = Path.open
    left = [room]

    def open_(self, mode="r", *args, **kwargs):
        fh = real_open(self, mode, *args, **kwargs)
        if any(m in mode for m in "wax") and Path(disk) in Path(self).parents:
            return FullDisk(fh, left)
        return fh

    monkeypatch.setattr(Path, "open", open_)


def _sizes(run_dir: Path, fmt: str, tmp: Path) -> tuple[int, int]:
    """(bytes of the split files, bytes of the card) of a whole export of ``fmt``."""
    assert export.main([str(run_dir), f"--format={fmt}", f"--out={tmp}", "--test_fraction=0.5"]) == 0
    card = (tmp / "README.md").stat().st_size
    return sum(p.stat().st_size for p in tmp.iterdir()) - card, card


@pytest.mark.parametrize("where", ["split", "card"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_disk_is_one_line_and_leaves_no_partial_file_nor_directory(
    run_dir, tmp_path, monkeypatch, capsys, fmt, where
):
    """A full disk gave a traceback (exit 1) and left train.jsonl cut mid-line, without a card."""
    splits, _ = _sizes(run_dir, fmt, tmp_path / "whole")
    room = splits // 3 if where == "split" else splits + 10  # the disk fills in a split file, or in the card
    disk = tmp_path / "disk"
    disk.mkdir()
    fill_disk(monkeypatch, disk, room)
    out = disk / "new" / "ex"
    capsys.readouterr()
    code = export.main([str(run_dir), f"--format={fmt}", f"--out={out}", "--test_fraction=0.5"])
    err = capsys.readouterr().err
    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith(f"error: cannot write {out}/") and line.endswith(": No space left on device")
    assert line.split(": ")[1].endswith("README.md" if where == "card" else ".jsonl")
    assert list(disk.iterdir()) == []  # no file, no temp file, not the directories it made


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_disk_leaves_an_earlier_export_as_it_was(run_dir, tmp_path, monkeypatch, capsys, fmt):
    """With --overwrite, the earlier export's split files were deleted before the new ones were written:
    a failed export lost both. Every file goes to a temp file first, renamed into place at the end."""
    out = tmp_path / "ex"
    assert export.main([str(run_dir), "--format=openai", f"--out={out}", "--stop_reasons=final_answer"]) == 0
    before = snapshot(out)
    splits, _ = _sizes(run_dir, fmt, tmp_path / "whole")
    fill_disk(monkeypatch, tmp_path, splits // 2)
    code = export.main(
        [str(run_dir), f"--format={fmt}", f"--out={out}", "--overwrite", "--test_fraction=0.5"]
    )
    assert code == 2 and "No space left on device" in capsys.readouterr().err
    assert snapshot(out) == before


@pytest.mark.parametrize("fmt", ["messages", *FORMATS])
def test_nothing_to_export_changes_nothing_on_disk(run_dir, tmp_path, capsys, fmt):
    """preference and rewards deleted an earlier export's train.jsonl (its card left pointing at the missing
    file), or made an empty --out and its parents, before finding they had no row to write."""
    out = tmp_path / "ex"
    assert export.main([str(run_dir), "--format=sharegpt", f"--out={out}", "--test_fraction=0.5"]) == 0
    before = snapshot(out)
    assert set(before) == {"README.md", "train.jsonl", "test.jsonl"}
    none = "--stop_reasons=max_turns"  # a stop reason no sample of the run has
    assert export.main([str(run_dir), f"--format={fmt}", f"--out={out}", "--overwrite", none]) == 1
    assert snapshot(out) == before
    fresh = tmp_path / "new" / "deeper"
    assert export.main([str(run_dir), f"--format={fmt}", f"--out={fresh}", none]) == 1
    assert not (tmp_path / "new").exists()
    assert "error: " in capsys.readouterr().err


def test_a_new_export_replaces_the_earlier_one_s_split_files(run_dir, tmp_path):
    """Split files of an earlier export that this one does not write (a test split, the other format's
    files) are removed once the new files are in place, as before."""
    out = tmp_path / "ex"
    assert export.main([str(run_dir), "--format=openai", f"--out={out}", "--test_fraction=0.5"]) == 0
    assert export.main([str(run_dir), "--format=rewards", f"--out={out}", "--overwrite"]) == 0
    assert sorted(snapshot(out)) == ["README.md", "train.jsonl"]


# ----------------------------------------------------------------------------- a real full disk, read-only --out


def _in_mount_namespace(script: str) -> subprocess.CompletedProcess:
    """``script`` (bash) in a private mount namespace, where it may mount a tmpfs or a read-only bind."""
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", script],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def _need_mounts(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command")
    done = _in_mount_namespace(f"mount -t tmpfs -o size=16k tmpfs {probe}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount here (needs root in a mount namespace): {done.stderr.strip()[:200]}")


@pytest.mark.parametrize("fmt", ["openai", "parquet", "rewards"])
def test_a_real_full_disk_and_a_read_only_out(run_dir, tmp_path, fmt):
    """On a 12 KB tmpfs, and into an empty --out bind-mounted read-only (which failed in the unlink
    of the earlier export's files, EROFS, with a traceback): one line, exit 2, nothing left."""
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    _need_mounts(tmp_path)
    disk, ro = tmp_path / "disk", tmp_path / "ro"
    disk.mkdir()
    ro.mkdir()
    cmd = f"{sys.executable} -m batchrun.views.export {run_dir} --format={fmt}"
    ext = "parquet" if fmt == "parquet" else "jsonl"
    done = _in_mount_namespace(
        f"mount -t tmpfs -o size=12k tmpfs {disk} && {cmd} --out={disk}/ex; echo rc=$? >&2; ls -A {disk} >&2"
    )
    assert done.stderr.splitlines() == [
        f"error: cannot write {disk}/ex/train.{ext}: No space left on device",
        "rc=2",
    ], done.stderr  # ls printed nothing: no file, no directory
    done = _in_mount_namespace(f"mount --bind -o ro {ro} {ro} && {cmd} --out={ro}")
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: cannot write {ro}/train.{ext}: Read-only file system\n"


def test_an_export_killed_outright_does_not_leave_the_next_a_directory_not_empty(run_dir, tmp_path, capsys):
    """A SIGKILLed export left .train.jsonl.<pid>.tmp in --out: no export's file, but the next export was
    refused ("not empty") until --overwrite. A temp file of a process that is gone is removed; one of a
    live process (an export under way) stays, and the directory is then not empty."""
    out = tmp_path / "ex"
    out.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (out / f".train.jsonl.{int(dead.stdout)}.tmp").write_text('{"torn": ', "utf-8")
    assert export.main([str(run_dir), "--format=openai", f"--out={out}"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "train.jsonl"]
    # Another program's file of that shape is none of the export's: it stays (the directory is not empty).
    foreign = tmp_path / "ex3"
    foreign.mkdir()
    (foreign / f".notes.txt.{int(dead.stdout)}.tmp").write_text("mine", "utf-8")
    assert export.main([str(run_dir), "--format=openai", f"--out={foreign}"]) == 2
    assert (foreign / f".notes.txt.{int(dead.stdout)}.tmp").read_text("utf-8") == "mine"
    live = tmp_path / "ex2"
    live.mkdir()
    (live / f".train.jsonl.{os.getpid()}.tmp").write_text("", "utf-8")
    capsys.readouterr()
    assert export.main([str(run_dir), "--format=openai", f"--out={live}"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_an_export_refuses_a_run_killed_before_its_merge_as_its_out(run_dir, tmp_path, capsys):
    """--out naming a run that holds batch files only (killed before its merge: no trajectories.jsonl,
    manifest or checkpoint among the files the check knew): with --overwrite the export went in beside them."""
    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(next(run_dir.glob("batch_*.jsonl")), killed / "batch_0.jsonl")
    assert export.main([str(run_dir), "--format=openai", f"--out={killed}", "--overwrite"]) == 2
    assert "is a run directory" in capsys.readouterr().err
    assert sorted(p.name for p in killed.iterdir()) == ["batch_0.jsonl"]


def test_a_place_a_file_cannot_go_leaves_the_earlier_export_whole(run_dir, tmp_path, capsys):
    """A directory where the card (renamed last) goes: the split files were renamed into place first,
    then the card's rename failed, leaving the new splits beside what was there. Each place is looked at
    before any rename."""
    out = tmp_path / "ex"
    assert export.main([str(run_dir), "--format=openai", f"--out={out}"]) == 0
    (out / "README.md").unlink()
    (out / "README.md").mkdir()
    (out / "README.md" / "x").write_text("", "utf-8")
    before = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
    capsys.readouterr()
    code = export.main(
        [str(run_dir), "--format=openai", f"--out={out}", "--overwrite", "--test_fraction=0.5"]
    )
    assert code == 2
    assert "README.md" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()} == before


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_an_export_under_way_keeps_another_out_of_its_directory(run_dir, tmp_path, capsys):
    """Two exports with --overwrite at one --out each renamed their files into place: the directory could
    end with one's splits beside the other's card. An export holds --out's lock (flock on the directory)
    from its creation to its last rename; another is refused, before the runs are read and at its writes,
    and nothing in the directory changes. The lock leaves no file: once it is free, the export runs."""
    out = tmp_path / "ex"
    assert export.main([str(run_dir), "--format=openai", f"--out={out}", "--test_fraction=0.5"]) == 0
    before = snapshot(out)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        capsys.readouterr()
        assert export.main([str(run_dir), "--format=rewards", f"--out={out}", "--overwrite"]) == 2
        busy = (
            f"error: another export is writing to {out} now; wait for it to end, or name another directory\n"
        )
        assert capsys.readouterr().err == busy
        # The lock taken after the checks, before the writes: refused there, and the files it made removed.
        result = export.ExportResult(out)
        with pytest.raises(export.ExportError, match="another export is writing"):
            export.write_dataset(
                out,
                iter([("train", {"a": 1})]),
                result,
                ext="jsonl",
                open_writer=export.JsonlWriter,
                nothing=lambda: "nothing",
                card=lambda: "card",
            )
        fresh = out / "deeper"
        fresh.mkdir()
        holder2 = subprocess.Popen(
            [sys.executable, "-c", _HOLD_LOCK, str(fresh)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder2.stdout.readline() == "held\n"
            assert export.main([str(run_dir), "--format=openai", f"--out={fresh}"]) == 2
            assert list(fresh.iterdir()) == []
        finally:
            holder2.communicate("")
        fresh.rmdir()
        assert snapshot(out) == before
    finally:
        holder.communicate("")
    assert export.main([str(run_dir), "--format=rewards", f"--out={out}", "--overwrite"]) == 0
    assert sorted(snapshot(out)) == ["README.md", "train.jsonl"]


def test_exports_at_one_out_at_once_leave_one_export_whole(run_dir, tmp_path):
    """Two real exports started together at one --out, with --overwrite, again and again: each ends in
    exit 0 or in the lock's refusal, and the directory holds one export's files, never a mix."""
    out = tmp_path / "ex"
    cmd = [sys.executable, "-m", "batchrun.views.export", str(run_dir), f"--out={out}", "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    alone = {}
    for flags in (("--format=openai", "--test_fraction=0.5"), ("--format=sharegpt",)):
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([*cmd, *flags], check=True, env=env, capture_output=True)
        alone[flags] = snapshot(out)
    assert alone[("--format=openai", "--test_fraction=0.5")] != alone[("--format=sharegpt",)]
    for _ in range(6):  # the code before the lock mixed them within 1-3 rounds
        procs = [
            subprocess.Popen(
                [*cmd, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for flags in alone
        ]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 or "another export is writing to" in err, err
        assert snapshot(out) in list(alone.values())
