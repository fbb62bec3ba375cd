"""The run directory's format: the one place that decides whether a directory can be read.

Every run writes ``format_version`` (:data:`FORMAT_VERSION`) into ``run_manifest.json`` and
``checkpoint.json``. ``--resume`` and the views (status, report, export, score, compare) call
:func:`check_run_dir` first and stop with exit 2 on a directory of another version, naming it and
both versions, instead of misreading it.

A directory without the field was written before it existed. It is read as this format when it is
compatible: the forms its records may hold (no ``sample_index`` or ``row_*`` fields, null where
records now write ``""``, name lists where they now write JSON text; manifests without the keys added
since) are read by ``batchrun.record`` and ``batchrun.run.resume`` as documented there. It is refused
when it holds a form no reader handles any more: a ``statistics.json`` without its ``runs`` history
(the merge would lose the earlier invocations' totals).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchrun.sharegpt import parse_json

FORMAT_VERSION = 1  # the run directory's format: raise it when readers can no longer read what was written
FORMAT_FIELD = "format_version"
DECLARING_FILES = ("run_manifest.json", "checkpoint.json")  # the files that carry FORMAT_FIELD
LOCK_NAME = ".lock"  # held (flock) by the one process writing a run directory: its runner, or views.score


# The files only a run writes: a directory holding one holds a run. A batch file alone is a run killed
# before its first merge (and before its checkpoint), which the report still reads.
RUN_FILES = ("run_manifest.json", "checkpoint.json", "trajectories.jsonl", "status.json", "statistics.json")
BATCH_FILE = re.compile(r"batch_\d+\.jsonl")


def holds_run(directory: Path) -> bool:
    """Whether ``directory`` holds a run (one of :data:`RUN_FILES`, or a batch file): a view refuses to
    report on one that does not, and to write its own file into one that does."""
    if any((directory / name).is_file() for name in RUN_FILES):
        return True
    try:
        with os.scandir(directory) as entries:
            return any(BATCH_FILE.fullmatch(e.name) and e.is_file() for e in entries)
    except OSError:  # missing, not a directory, unreadable: the callers' own checks say so
        return False


class RunDirBusy(Exception):
    """The run directory's lock is held: a runner (or a re-scoring) is writing it. The message names it."""


def declared_version(run_dir: Path) -> Any:
    """The ``format_version`` the directory's manifest (else its checkpoint) declares; None: neither does."""
    for name in DECLARING_FILES:
        data = _read_json(run_dir / name)
        if isinstance(data, dict) and FORMAT_FIELD in data:
            return data[FORMAT_FIELD]
    return None


def check_run_dir(run_dir: Path) -> str | None:
    """Why this batch-runner cannot read ``run_dir`` (a problem to print, exit 2), or None when it can."""
    problem = _unreadable(run_dir)
    if problem:
        return problem
    version = declared_version(run_dir)
    if version is not None:
        if version == FORMAT_VERSION and not isinstance(version, bool):
            return None
        return (
            f"{run_dir} is a run directory of format version {version!r}; this batch-runner reads format "
            f"version {FORMAT_VERSION}. Read it with the batch-runner that wrote it, or start a new run"
        )
    form = _unreadable_form(run_dir)
    if form is None:
        return None
    return (
        f"{run_dir} was written before run directories had a {FORMAT_FIELD} (this batch-runner reads format "
        f"version {FORMAT_VERSION}), in a form it no longer reads: {form}. Read it with the batch-runner "
        "that wrote it, or start a new run"
    )


def _unreadable(run_dir: Path) -> str | None:
    """Why this user cannot read the directory or one of its run files (another user's run: the runner
    makes the directory mode 0700), or None. A view met it as a PermissionError traceback, or as a
    status.json that "is not a JSON object"."""
    try:
        names = os.listdir(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None  # said by each reader in its own words
    except PermissionError as exc:
        return _denied(run_dir, exc)
    for name in sorted(names):
        if not name.endswith((".json", ".jsonl")) or name.startswith("."):
            continue
        try:  # non-blocking: a FIFO planted under a run file's name would hang a plain open
            os.close(os.open(run_dir / name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except PermissionError as exc:
            return _denied(run_dir / name, exc)
        except OSError:
            continue  # gone meanwhile (a runner replaced it), or not a file: its reader says so
    return None


def _denied(path: Path, exc: OSError) -> str:
    try:
        uid = path.lstat().st_uid
    except OSError:
        uid = None
    owner = ""
    if uid is not None and uid != os.geteuid():
        try:
            owner = f", owned by {pwd.getpwuid(uid).pw_name}"
        except KeyError:
            owner = f", owned by uid {uid}"
    return (
        f"cannot read {path}: {exc.strerror or exc}{owner} (a run directory is its owner's alone: read it "
        "as that user, or have them give you a copy)"
    )


def _unreadable_form(run_dir: Path) -> str | None:
    """What a directory without ``format_version`` holds that no reader handles any more, or None."""
    stats = _read_json(run_dir / "statistics.json")
    if isinstance(stats, dict) and not isinstance(stats.get("runs"), list):
        return "statistics.json without its runs history"
    return None


def _read_json(path: Path) -> Any:
    try:
        return parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or damaged: the readers of that file say so themselves


def _owner(fd: int) -> str:
    with contextlib.suppress(OSError):
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip().split("\n")[0]
        if text:
            return text
    return "another process"


def runner_working(run_dir: Path) -> str | None:
    """Who holds the run directory's lock ("pid N on host"), while a runner or a re-scoring works in it;
    None when nothing does, or it cannot be told (no lock file, one this user cannot open). A probe: the
    lock file is never created, and never held past this call (a runner starting meanwhile is not refused)."""
    try:  # non-blocking: a FIFO planted under the name would hang a plain open
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _owner(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # releases the probe's shared lock
    return None


def in_use(run_dir: Path, view: str) -> str | None:
    """Why a view of the finished run (export, compare) cannot read ``run_dir`` now, or None: a runner
    (a --resume) is adding samples, so trajectories.jsonl is an earlier invocation's while discarded.jsonl
    and failed.jsonl grow."""
    owner = runner_working(run_dir)
    if owner is None or "(python -m batchrun.views." in owner:  # a re-scoring adds its own file only
        return None
    return (
        f"{run_dir} is in use by a running batch_runner ({owner}): its trajectories.jsonl is an earlier "
        f"invocation's, without the samples it is adding; {view} when it has ended "
        "(python -m batchrun.views.status shows its progress)"
    )


@contextlib.contextmanager
def holding(run_dir: Path, who: str) -> Iterator[None]:
    """Hold the run directory's lock as its runner does, for a view that writes into it: a runner cannot
    start there meanwhile (it exits 2 naming ``who``), and :class:`RunDirBusy` when one works there now.
    A lock file that cannot be opened (a read-only directory) is not held: the view's own writes fail there."""
    path = run_dir / LOCK_NAME
    made = not path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError:
        fd = None
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(f"{run_dir} is in use by a running batch_runner ({_owner(fd)})") from None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} ({who})\n".encode(), 0)
        try:
            yield
        finally:
            if made:  # unlinked while still held, as the runner does: no lock file left behind
                with contextlib.suppress(OSError):
                    path.unlink()
    finally:
        os.close(fd)
