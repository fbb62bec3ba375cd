"""--resume: which rows are finished (by their content, duplicates counted), and whether the settings still match.

A row is finished when a batch file holds a trajectory of it, or (unless ``--rerun_discarded``)
``discarded.jsonl`` holds a discard of it. Failures are not finished: they run again. The
manifest (``run_manifest.json``) records the settings that define the data; a resume with other
values would mix two datasets and is refused unless ``--force_resume``.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from batchrun.config import RunConfig, UsageError
from batchrun.prompt.trajectory import (
    outcome_row_key,
    record_row_key,
    row_key,
    valid_outcome_row,
    valid_record,
)
from batchrun.protocol import Outcome
from batchrun.run.dataset import Row
from batchrun.secrets import Redactor
from batchrun.storage import batch_files, iter_jsonl

# Settings that define what the data is; a resume with other values would mix two datasets.
MANIFEST_KEYS = (
    "model",
    "distribution",
    "max_turns",
    "seed",
    "reasoning_effort",
    "reasoning_disabled",
    "endpoint_dialect",  # how the reasoning controls were sent decides whether they took effect
    "sandbox",
    "keep_no_reasoning",
    "keep_invalid_tool_calls",
    "keep_empty_answers",
    "ephemeral_system_prompt_sha256",  # hashes, never the text: both are secrets (see Redactor)
    "prefill_sha256",
    "distribution_probabilities",  # a --distribution_file may give a name other numbers
    "known_tools",  # the columns of tool_stats (plugins, MCP servers): records must keep one schema
)


def build_manifest(config: RunConfig) -> dict[str, Any]:
    """The run's data-defining settings, as run_manifest.json records them."""
    return {
        "model": config.model,
        "distribution": config.distribution,
        "max_turns": config.max_turns,
        "seed": config.seed,
        "reasoning_effort": config.reasoning_effort,
        "reasoning_disabled": config.reasoning_disabled,
        "endpoint_dialect": config.endpoint_dialect,
        "sandbox": config.backend,
        "keep_no_reasoning": config.keep_no_reasoning,
        "keep_invalid_tool_calls": config.keep_invalid_tool_calls,
        "keep_empty_answers": config.keep_empty_answers,
        **config.secret_hashes(),
        **config.tool_sources_manifest(),
        "dataset_file": config.dataset_file,
        "dataset_sha256": _file_sha256(config.dataset_file),
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
    }


def read_manifest(path: Path) -> dict[str, Any]:
    """The first run's settings; a damaged file stops the resume instead of silently skipping the check."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        old, problem = None, str(exc)
    else:
        problem = f"a JSON {type(old).__name__}"
    if not isinstance(old, dict):
        raise UsageError(
            f"{path} is not a settings object ({problem}); the resume cannot check its settings. "
            "Restore it, or remove it to resume without the check"
        )
    return old


def check_manifest(old: dict[str, Any], new: dict[str, Any], *, force: bool) -> dict[str, Any]:
    """The manifest to keep for a resume: refused when data-defining settings changed, unless forced.

    With ``force`` the earlier settings go into the manifest's ``history``, so the data says it holds both.
    """
    # A key that a manifest of an older version lacks cannot be compared: it is recorded from now on.
    changed = [k for k in MANIFEST_KEYS if k in old and old.get(k) != new.get(k)]
    history = old.get("history") if isinstance(old.get("history"), list) else []
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        if not force:
            original = " ".join(_flag(k, old.get(k)) for k in changed)
            raise UsageError(
                f"--resume with settings that differ from the first run ({detail}) would mix two datasets; "
                f"resume with the original settings ({original}), or add --force_resume to mix them deliberately"
            )
        print(f"warning: resuming with changed settings ({detail}), as forced", file=sys.stderr)
        history = [
            *history,
            {
                "replaced_at": dt.datetime.now().isoformat(timespec="seconds"),
                "settings": {k: old.get(k) for k in MANIFEST_KEYS if k in old},
            },
        ]
    if old.get("dataset_sha256") != new.get("dataset_sha256"):
        print(
            "note: the dataset file changed since the first run; rows are matched by their content",
            file=sys.stderr,
        )
    kept = {**new, "created": old.get("created", new.get("created"))}
    if history:
        kept["history"] = history
    return kept


def row_identity(row: Row | Outcome, redact: Redactor) -> str:
    """A row's identity (a dataset row's, or an outcome's) as saved records give it back: secrets in
    them were redacted there."""
    image = None if row.image is None else redact(row.image)
    cwd = None if row.cwd is None else redact(row.cwd)
    return row_key(redact(row.prompt), image, cwd)


def unfinished(rows: list[Row], done: collections.Counter[str], redact: Redactor) -> list[Row]:
    """The rows left once each finished outcome has taken one row of its identity (duplicates count)."""
    done = collections.Counter(done)
    left = []
    for row in rows:
        key = row_identity(row, redact)
        if done[key] > 0:
            done[key] -= 1
        else:
            left.append(row)
    return left


def scan_finished(run_dir: Path, *, rerun_discarded: bool) -> collections.Counter[str]:
    """Row identity -> number of finished outcomes (trajectories, and discards unless re-run).
    Lines of the wrong shape are skipped, as torn lines are."""
    done: collections.Counter[str] = collections.Counter()
    for _, path in batch_files(run_dir):
        for rec in iter_jsonl(path):
            if valid_record(rec):
                done[record_row_key(rec)] += 1
    add_discards(run_dir, done, rerun_discarded=rerun_discarded)
    return done


def add_discards(run_dir: Path, done: collections.Counter[str], *, rerun_discarded: bool) -> None:
    """Discarded prompts count as finished unless --rerun_discarded (they cost money to redo)."""
    discards = run_dir / "discarded.jsonl"
    if discards.exists() and not rerun_discarded:
        for rec in iter_jsonl(discards):
            if valid_outcome_row(rec, "reason"):
                done[outcome_row_key(rec)] += 1


def resume_filter(rows: list[Row], run_dir: Path, redact: Redactor, *, rerun_discarded: bool) -> list[Row]:
    """Keep the rows with no finished outcome yet, counting duplicates per identity (text, image, cwd)."""
    todo = unfinished(rows, scan_finished(run_dir, rerun_discarded=rerun_discarded), redact)
    print(f"Resume: {len(rows) - len(todo)} prompt(s) already finished, {len(todo)} to run")
    return todo


def resume_command(argv: list[str] | None = None) -> str:
    """The command that continues this run; the API key is left out (it comes from the environment)."""
    args, skip_next = [], False
    for arg in sys.argv[1:] if argv is None else argv:
        if skip_next:
            skip_next = False
            continue
        if arg in ("--api_key", "--api-key"):
            skip_next = True  # "--api_key KEY" is two arguments
            continue
        if not arg.startswith(("--resume", "--api_key=", "--api-key=")):
            args.append(shlex.quote(arg))
    return " ".join(["python", "batch_runner.py", *args, "--resume"])


def _flag(name: str, value: Any) -> str:
    """A manifest setting as the command-line flag that reproduces it."""
    if name.endswith("_sha256"):  # the text itself is a secret and is not stored
        flag = {"prefill_sha256": "prefill_messages_file"}.get(name, name.removesuffix("_sha256"))
        return f"--{flag}=<the original, sha256 {value[:12]}...>" if value else f"(no --{flag})"
    if isinstance(value, bool):
        return f"--{name}" if value else f"--{name}=False"
    return f"--{name}={shlex.quote(str(value))}"


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
