"""batchrun/storage.py on its own: durable appends, whole-file replacement, the streaming readers on
what a crash or a foreign writer leaves (torn lines, invalid UTF-8, huge lines), pid_alive and
read_json_file's messages. Real files in tmp_path; ``/dev/full`` stands in for a full disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
from helpers import wait_until

from batchrun.storage import (
    WriteError,
    append_jsonl,
    append_jsonl_line,
    batch_files,
    iter_jsonl,
    iter_jsonl_raw,
    pid_alive,
    read_json_file,
    remove_stale_temp_files,
    write_json_atomic,
    write_text_atomic,
    write_text_in_place,
)

DEV_FULL = Path("/dev/full")  # every write fails with ENOSPC, as on a full disk


def same(text: str) -> str:
    return text


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths os.fsync was called on (the real fsync still runs): durability cannot be seen otherwise."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


# ----------------------------------------------------------------------------- appends


def test_append_writes_one_redacted_utf8_line_per_record(tmp_path: Path):
    path = tmp_path / "out.jsonl"
    append_jsonl(path, {"text": "café ✓", "key": "sk-secret"}, lambda s: s.replace("sk-secret", "[REDACTED]"))
    append_jsonl(path, {"n": 2}, same)
    raw = lines_of(path)
    assert len(raw) == 2 and all(line.endswith(b"\n") for line in raw)
    assert "café ✓".encode() in raw[0]  # UTF-8 as it is, not \u escapes
    assert list(iter_jsonl(path)) == [{"text": "café ✓", "key": "[REDACTED]"}, {"n": 2}]


def test_append_fsyncs_the_file_it_wrote(tmp_path: Path, fsynced: list[str]):
    path = tmp_path / "out.jsonl"
    append_jsonl(path, {"n": 1}, same)
    assert str(path) in fsynced


def test_append_after_a_torn_line_closes_it_and_keeps_the_lines_before(tmp_path: Path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": 2, "cut": "mid-wri')  # a crash in the middle of a write
    append_jsonl(path, {"n": 3}, same)
    assert lines_of(path) == [b'{"n": 1}\n', b'{"n": 2, "cut": "mid-wri\n', b'{"n": 3}\n']
    assert list(iter_jsonl(path)) == [{"n": 1}, None, {"n": 3}]


def test_append_line_keeps_the_text_as_given_and_adds_one_newline(tmp_path: Path):
    path = tmp_path / "batch_0.jsonl"
    kept = '{"b": 1,  "a": "x"}'  # a kept sample: spacing and key order are not rewritten
    append_jsonl_line(path, kept + "\n")
    append_jsonl_line(path, kept)
    assert path.read_text("utf-8") == f"{kept}\n{kept}\n"


def test_a_failed_append_raises_write_error_naming_the_file():
    with pytest.raises(WriteError) as info:
        append_jsonl(DEV_FULL, {"n": 1}, same)
    assert isinstance(info.value, OSError) and info.value.path == DEV_FULL
    assert info.value.errno == 28 and str(info.value) == "cannot write /dev/full: No space left on device"


def test_an_append_into_a_missing_directory_raises_write_error(tmp_path: Path):
    path = tmp_path / "gone" / "out.jsonl"
    with pytest.raises(WriteError, match="cannot write .*gone/out.jsonl"):
        append_jsonl_line(path, "{}")


def test_a_record_with_a_lone_surrogate_is_written_and_reads_back_the_same(tmp_path: Path):
    path = tmp_path / "out.jsonl"
    append_jsonl(path, {"content": "odd \ud83d reply"}, same)
    assert list(iter_jsonl(path)) == [{"content": "odd \ud83d reply"}]


# ----------------------------------------------------------------------------- whole-file replacement


def test_atomic_write_replaces_the_file_whole_and_leaves_no_temp_file(tmp_path: Path):
    path = tmp_path / "status.json"
    path.write_text("old status", "utf-8")
    os.link(path, tmp_path / "old-inode")  # a reader that opened the old file keeps the old bytes
    write_text_atomic(path, "new status")
    assert path.read_text("utf-8") == "new status"
    assert (tmp_path / "old-inode").read_text("utf-8") == "old status"  # not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old-inode", "status.json"]


def test_atomic_write_fsyncs_the_file_and_its_directory(tmp_path: Path, fsynced: list[str]):
    write_text_atomic(tmp_path / "status.json", "{}")
    assert str(tmp_path) in fsynced  # the rename itself is durable
    assert any(Path(p).name.startswith(".status.json.") for p in fsynced)  # the content, before the rename


def test_a_reader_never_sees_a_half_written_state_file(tmp_path: Path):
    path = tmp_path / "status.json"
    versions = [("x" if i % 2 else "y") * 1_000_000 for i in range(2)]
    write_text_atomic(path, versions[0])
    seen: set[int] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(len(path.read_text("utf-8")))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(40):
            write_text_atomic(path, versions[i % 2])
    finally:
        done.set()
        reader.join()
    assert seen == {1_000_000}


def test_a_failed_atomic_write_raises_write_error_and_leaves_no_temp_file(tmp_path: Path):
    path = tmp_path / "status.json"
    path.mkdir()  # the rename onto a non-empty directory fails after the temp file is written
    (path / "keep").write_text("inside", "utf-8")
    with pytest.raises(WriteError, match="cannot write .*status.json"):
        write_text_atomic(path, "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]
    assert (path / "keep").read_text("utf-8") == "inside"


def test_an_interrupted_atomic_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Ctrl-C or SIGTERM (KeyboardInterrupt) in the middle of a state file's write: the old file stays whole
    and no ``.<name>.<pid>.tmp`` is left behind."""
    path = tmp_path / "statistics.json"
    path.write_text("old", "utf-8")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["statistics.json"]
    assert path.read_text("utf-8") == "old"


def test_temp_files_of_dead_writers_are_removed_and_those_of_live_ones_kept(tmp_path: Path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    assert not pid_alive(pid)
    stale = [f".trajectories.jsonl.{pid}.tmp", f".statistics.json.{pid}.tmp"]
    for name in stale:
        (tmp_path / name).write_text("left by a killed runner", "utf-8")
    live = tmp_path / f".report.html.{os.getpid()}.tmp"  # a write in progress
    live.write_text("x", "utf-8")
    other = [".lock", "batch_0.jsonl", ".notes.tmp", f"x.{pid}.tmp"]  # not a temp file of ours
    for name in other:
        (tmp_path / name).write_text("keep", "utf-8")
    assert sorted(remove_stale_temp_files(tmp_path)) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, *other])


def test_json_atomic_is_indented_utf8_and_redacted(tmp_path: Path):
    path = tmp_path / "manifest.json"
    write_json_atomic(path, {"name": "café", "key": "sk-1"}, redact=lambda s: s.replace("sk-1", "[R]"))
    assert path.read_text("utf-8") == '{\n  "name": "café",\n  "key": "[R]"\n}'


def test_in_place_write_rewrites_the_same_file(tmp_path: Path):
    path = tmp_path / "status.json"
    path.write_text("a much longer old status", "utf-8")
    inode = path.stat().st_ino
    write_text_in_place(path, "failed")
    assert path.read_text("utf-8") == "failed" and path.stat().st_ino == inode


def test_a_failed_in_place_write_raises_write_error():
    with pytest.raises(WriteError, match="No space left on device"):
        write_text_in_place(DEV_FULL, "failed")


# ----------------------------------------------------------------------------- streaming readers


def test_reader_of_a_missing_file_or_a_directory_yields_nothing(tmp_path: Path):
    assert list(iter_jsonl(tmp_path / "none.jsonl")) == []
    assert list(iter_jsonl(tmp_path)) == []


def test_reader_marks_torn_invalid_and_non_object_lines_and_skips_blank_ones(tmp_path: Path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        b'{"n": 1}\n'
        b"\n   \n"  # blank lines are not records
        b"[1, 2]\n"  # JSON, but not a record
        b'"text"\n'
        b"not json\n"
        b'{"n": 2}\r\n'  # a foreign writer's line end
        b'{"n": 3, "cut'  # torn last line, no newline
    )
    assert list(iter_jsonl(path)) == [{"n": 1}, None, None, None, {"n": 2}, None]


def test_reader_reads_a_complete_last_line_without_its_newline(tmp_path: Path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": 2}')
    assert list(iter_jsonl(path)) == [{"n": 1}, {"n": 2}]


def test_invalid_utf8_spoils_only_its_own_line(tmp_path: Path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"n": 1}\n{"text": "\xff\xfe bad"}\n{"n": 3}\n')
    assert list(iter_jsonl(path)) == [{"n": 1}, None, {"n": 3}]


def test_an_encoded_surrogate_is_invalid_utf8_and_its_line_is_marked(tmp_path: Path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"text": "\xed\xa0\x80"}\n')
    assert list(iter_jsonl(path)) == [None]


def test_raw_reader_gives_each_line_byte_for_byte_with_its_record(tmp_path: Path):
    lines = [b'{"b":1,  "a":"caf\xc3\xa9"}\n', b"torn {\n", b'{"n": 2}']
    path = tmp_path / "batch_0.jsonl"
    path.write_bytes(b"".join(lines))
    assert list(iter_jsonl_raw(path)) == [
        (lines[0], {"b": 1, "a": "café"}),
        (lines[1], None),
        (lines[2], {"n": 2}),
    ]


def test_a_huge_line_is_read_whole(tmp_path: Path):
    big = "z" * (12 << 20)  # 12 MiB of text in one record (a long tool output)
    path = tmp_path / "out.jsonl"
    append_jsonl(path, {"n": 1}, same)
    append_jsonl(path, {"out": big}, same)
    append_jsonl(path, {"n": 3}, same)
    records = list(iter_jsonl(path))
    assert [len(r.get("out", "")) for r in records] == [0, len(big), 0] and records[2] == {"n": 3}


def test_reader_streams_rather_than_loading_the_file(tmp_path: Path):
    path = tmp_path / "many.jsonl"
    line = json.dumps({"pad": "p" * 1000}) + "\n"
    with path.open("w", encoding="utf-8") as fh:
        fh.write(line * 8_000)  # about 8 MB
    tracemalloc.start()
    try:
        count = sum(1 for rec in iter_jsonl(path) if rec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 8_000
    assert peak < 2 << 20  # a reader that loads the file first peaks above 8 MB


def test_batch_files_are_found_in_numeric_order_and_others_ignored(tmp_path: Path):
    for name in ["batch_10.jsonl", "batch_2.jsonl", "batch_0.jsonl", "batch_x.jsonl", "batch_3.jsonl.tmp"]:
        (tmp_path / name).write_text("", "utf-8")
    assert [(n, p.name) for n, p in batch_files(tmp_path)] == [
        (0, "batch_0.jsonl"),
        (2, "batch_2.jsonl"),
        (10, "batch_10.jsonl"),
    ]


# ----------------------------------------------------------------------------- pid_alive


def test_pid_alive_for_this_process_and_init():
    assert pid_alive(os.getpid()) and pid_alive(1)


@pytest.mark.parametrize("pid", [0, -1, True, "123", 12.0, None])
def test_pid_alive_refuses_what_is_not_a_pid(pid):
    assert not pid_alive(pid)


def test_a_reaped_child_is_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


def test_a_zombie_counts_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:

        def zombie() -> bool:
            with open(f"/proc/{child.pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] == "Z"

        assert wait_until(zombie, timeout_s=10, step_s=0.02)
        assert not pid_alive(child.pid)  # still in the process table, but gone
    finally:
        child.wait()


# ----------------------------------------------------------------------------- read_json_file


def test_read_json_file_returns_any_json_value(tmp_path: Path):
    path = tmp_path / "f.json"
    path.write_text('[{"a": "é"}]', "utf-8")
    assert read_json_file(path) == [{"a": "é"}]
    assert read_json_file(str(path)) == [{"a": "é"}]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.json", r": cannot read: No such file or directory$"),
        (lambda d: d, r": cannot read: Is a directory$"),
        (lambda d: _write(d / "bad.json", b"{not json"), r": not valid JSON: Expecting property name"),
        (lambda d: _write(d / "latin1.json", b'{"a": "\xe9"}'), r": not valid JSON: 'utf-8' codec"),
        (lambda d: _write(d / "empty.json", b""), r": not valid JSON: Expecting value"),
    ],
)
def test_read_json_file_errors_name_the_path_and_the_reason(tmp_path: Path, make, message):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=message) as info:
        read_json_file(path)
    assert str(info.value).startswith(f"{path}: ")
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no traceback noise


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
