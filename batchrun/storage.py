"""Durable files: append-only JSONL with fsync, atomic JSON state, streaming readers.

A crash at any instant leaves every file readable: appends close a torn last line first (the torn
line stays invalid and every reader skips it), and state files are replaced whole by rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

from batchrun.sharegpt import parse_json


class WriteError(OSError):
    """A run file could not be written (disk full, read-only file system, ...): the run cannot go on.

    Carries the path and the system's reason, since a failed ``write``/``fsync`` names no file.
    """

    def __init__(self, path: Path, exc: OSError):
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))
        self.path = path

    def __str__(self) -> str:
        return f"cannot write {self.path}: {self.strerror}"


# Characters JSON leaves raw inside a string that Python's str.splitlines() (and other line readers,
# some editors) take for line ends: a record holding one (a model may write U+2028, or U+0085 from text
# decoded the wrong way) split into two torn lines for such a reader. They are written escaped: the same
# JSON value, on one line for every reader. (JSON escapes every other control character itself.)
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def json_line(obj: Any) -> str:
    """``obj`` as one line of JSON text (UTF-8 characters as they are, but the ones some readers take for
    line ends, escaped); no line end."""
    text = json.dumps(obj, ensure_ascii=False)
    # Looked for first: translate() with a table of strings costs ~20x the dumps itself (9 ms against
    # 0.4 ms for a 200 KB record), three searches ~2 us.
    if "\u2028" in text or "\u2029" in text or "\x85" in text:
        return text.translate(_LINE_BREAKS)
    return text


def append_jsonl(path: Path, obj: dict[str, Any], redact: Callable[[str], str]) -> None:
    """Append one record durably: a torn last line is closed first, then write + fsync.

    A failure (disk full, read-only) raises :class:`WriteError` and takes back what it wrote (the file is
    cut to its size before), so the file holds whole lines only, as before; a line torn by a writer
    killed outright is closed by the next append, so the lines before it stay intact.
    """
    try:
        data = redact(json_line(obj)).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a model may send one): escaped, the text is kept exactly
        data = redact(json.dumps(obj)).encode("utf-8")
    append_jsonl_bytes(path, data)


def append_jsonl_line(path: Path, line: str) -> None:
    """Append one line of JSON text as :func:`append_jsonl` does (a kept sample: written as it is)."""
    append_jsonl_bytes(path, line.encode("utf-8"))


def append_jsonl_bytes(path: Path, data: bytes) -> None:
    """Append one line, already UTF-8, as :func:`append_jsonl` does."""
    data = data.rstrip(b"\n") + b"\n"
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise WriteError(path, exc) from exc
    size = None
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # the torn line stays invalid and is skipped by every reader
        view = memoryview(data)
        while view:  # a write stops short when the disk fills; the next one says why
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError as exc:
        # A half-written line (disk full) would stay in the file, skipped and counted as torn by every
        # merge from then on, though nothing was killed: the file is cut back to what it held.
        if size is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        raise WriteError(path, exc) from exc
    finally:
        os.close(fd)


# The most a file a flag names (a config, a prompt) may hold: as much as a dataset line.
FLAG_FILE_MAX_BYTES = 32 * 1024 * 1024


def read_flag_bytes(path: str | Path) -> bytes:
    """The bytes of a file a flag names (--prefill_messages_file, --mcp_config, ...): a regular file of at
    most :data:`FLAG_FILE_MAX_BYTES`. ValueError saying ``<path>: cannot read: ...`` otherwise, for the
    caller to prefix with its flag: a FIFO no one writes to hung the run before it started, and
    ``/dev/zero`` filled the machine's memory until the kernel killed the runner (and others)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open does not wait
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{path}: cannot read: Is a directory") from None
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(
                f"{path}: cannot read: not a regular file (a pipe or a device is not read)"
            ) from None
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(FLAG_FILE_MAX_BYTES + 1)  # a /proc file says it holds 0 bytes: read, bounded
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if max(info.st_size, len(data)) > FLAG_FILE_MAX_BYTES:
        raise ValueError(f"{path}: cannot read: larger than {FLAG_FILE_MAX_BYTES >> 20} MiB")
    return data


def _text(data: bytes) -> str:
    """UTF-8 text with its newlines as ``open()`` reads them (the readers before read it so)."""
    return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def read_flag_file(path: str | Path) -> str:
    """The text of a file a flag names (see :func:`read_flag_bytes`); ValueError naming the path."""
    data = read_flag_bytes(path)
    try:
        return _text(data)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None


def read_json_file(path: str | Path) -> Any:
    """A small JSON file the user named (a flag's file); ValueError saying ``<path>: cannot read`` or
    ``<path>: not valid JSON``, for the caller to prefix with its flag."""
    data = read_flag_bytes(path)
    try:
        return parse_json(_text(data))
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object file the runner wrote (status.json, statistics.json, the manifest); None when it is
    absent, unreadable, damaged or holds no object: its readers say so themselves."""
    try:
        obj = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def write_json_atomic(path: Path, obj: Any, redact: Callable[[str], str] | None = None) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    write_text_atomic(path, redact(text) if redact else text)


def not_a_file(path: Path) -> str:
    """Why ``path``, which is no regular file, cannot be read as one: for messages."""
    return "a directory" if path.is_dir() else "not a regular file" if path.exists() else "not found"


def temp_path(path: Path) -> Path:
    """The temp file a write of ``path`` by this process goes through (``.<name>.<pid>.tmp``, beside it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def cannot_write(path: Path) -> str | None:
    """Why a write of ``path`` (through its temp file: :func:`write_text_atomic`) fails now, or None: the
    temp file is made and removed, so a long job learns before it starts (a judge's re-scoring paid for
    every call, then a read-only run directory, or a name too long for the filesystem, refused them)."""
    tmp = temp_path(path)
    try:
        with tmp.open("w", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    discard_temp(tmp)
    return None


def discard_temp(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` whole (temp file, fsync, rename); raises :class:`WriteError`, leaving no temp file
    (nor when Ctrl-C or SIGTERM interrupts it)."""
    write_parts_atomic(path, (text,))


def write_parts_atomic(path: Path, parts: Iterable[str]) -> None:
    """:func:`write_text_atomic` of the text ``parts`` make, written as they come (never held whole)."""
    tmp = temp_path(path)
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for part in parts:
                fh.write(part)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        discard_temp(tmp)
        raise WriteError(path, exc) from exc
    except BaseException:
        discard_temp(tmp)
        raise


_TEMP_NAME = re.compile(r"\.(.+)\.(\d+)\.tmp")


def remove_stale_temp_files(directory: Path, names: Collection[str] | None = None) -> list[str]:
    """Remove the temp files (``.<name>.<pid>.tmp``) that writers killed outright (SIGKILL, power loss)
    left in ``directory``: a merge's is a whole copy of trajectories.jsonl. A file whose pid is alive
    may be a write in progress (a view writing report.html) and stays. ``names``: only the temp files of
    these (a directory not the runner's own, an export's --out, may hold other programs' files of that
    shape). Returns the names removed."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.fullmatch(entry.name)
        if m is None or (names is not None and m.group(1) not in names) or pid_alive(int(m.group(2))):
            continue
        try:
            if entry.is_file() and not entry.is_symlink():
                entry.unlink()
                removed.append(entry.name)
        except OSError:
            pass
    return removed


def write_text_in_place(path: Path, text: str) -> None:
    """Last resort when an atomic write failed for lack of space: truncating first frees the old
    content's blocks for the new one. Not atomic; used only for the final ``failed`` status."""
    try:
        with path.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise WriteError(path, exc) from exc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A line that may hold a partial record (``"partial": true`` as any JSON writer spaces it; a model's
# text cannot make it: its quotes are escaped). Lines without it need not be parsed to be left out.
PARTIAL_LINE = re.compile(rb'"partial"\s*:\s*true')


def iter_jsonl(path: Path, only: re.Pattern[bytes] | None = None) -> Iterator[dict[str, Any] | None]:
    """Stream a JSONL file; yields None for a torn or invalid line. A missing file yields nothing.
    ``only``: the lines it finds nothing in are skipped unparsed."""
    if not path.is_file():
        return
    if only is None:
        for _, obj in iter_jsonl_raw(path):
            yield obj
        return
    with path.open("rb") as fh:
        for raw in fh:
            if only.search(raw) is not None:
                yield _parse_line(raw)


def iter_jsonl_raw(path: Path) -> Iterator[tuple[bytes, dict[str, Any] | None]]:
    """Stream a JSONL file as (line bytes, parsed object or None when torn/invalid)."""
    for _, raw, obj in iter_jsonl_at(path):
        yield raw, obj


def iter_jsonl_at(path: Path) -> Iterator[tuple[int, bytes, dict[str, Any] | None]]:
    """:func:`iter_jsonl_raw` with each line's byte offset in the file (:func:`read_line_at` reads it again)."""
    offset = 0
    with path.open("rb") as fh:
        for raw in fh:
            at, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            yield at, raw, _parse_line(raw)


def read_line_at(path: Path, offset: int) -> tuple[bytes, dict[str, Any] | None]:
    """The line of a JSONL file at ``offset`` (from :func:`iter_jsonl_at`), and its object as there."""
    with path.open("rb") as fh:
        fh.seek(offset)
        raw = fh.readline()
    return raw, _parse_line(raw)


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    try:
        # Strict UTF-8 first: json.loads of bytes would let an encoded surrogate through.
        obj = parse_json(raw.decode("utf-8"))
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def batch_files(run_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for p in run_dir.glob("batch_*.jsonl"):
        m = re.fullmatch(r"batch_(\d+)\.jsonl", p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def pid_alive(pid: Any) -> bool:
    """Whether a process of this host is alive (a zombie counts as dead)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a pid beyond any this host can have
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
