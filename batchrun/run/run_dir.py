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

from pathlib import Path
from typing import Any

from batchrun.sharegpt import parse_json

FORMAT_VERSION = 1  # the run directory's format: raise it when readers can no longer read what was written
FORMAT_FIELD = "format_version"
DECLARING_FILES = ("run_manifest.json", "checkpoint.json")  # the files that carry FORMAT_FIELD


def declared_version(run_dir: Path) -> Any:
    """The ``format_version`` the directory's manifest (else its checkpoint) declares; None: neither does."""
    for name in DECLARING_FILES:
        data = _read_json(run_dir / name)
        if isinstance(data, dict) and FORMAT_FIELD in data:
            return data[FORMAT_FIELD]
    return None


def check_run_dir(run_dir: Path) -> str | None:
    """Why this batch-runner cannot read ``run_dir`` (a problem to print, exit 2), or None when it can."""
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
