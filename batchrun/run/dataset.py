"""The dataset: one JSONL file read once; each good line a :class:`Row`, each bad line a message.

A row's identity is everything that defines its run (its text, image and cwd: see
``batchrun.prompt.trajectory.row_key``); resume and the merge count finished rows by it, duplicates included.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

from batchrun.config import UsageError
from batchrun.record import ROW_RUN_FIELDS, row_fields_text, row_id_text


@dataclasses.dataclass(frozen=True)
class Row:
    index: int  # 0-based line number in the dataset file: stable whatever else is skipped
    prompt: str
    image: str | None
    cwd: str | None
    occurrence: int  # how many earlier rows hold the same prompt text
    row_fields: str | None = None  # the row's other fields (id, answer, ...) as JSON text; None when none
    row_id: str | None = None  # the row's ``id`` as a string, when it has one


def load_dataset(path: str, max_samples: int | None = None) -> tuple[list[Row], list[str]]:
    """Read the JSONL dataset. Bad lines are reported by number and skipped; no usable row is an error."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"dataset file not found: {path}")
    rows: list[Row] = []
    problems: list[str] = []
    seen: collections.Counter[str] = collections.Counter()
    with p.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            problem, row = _parse_line(raw, line_no, seen)
            if problem:
                problems.append(f"{path}:{line_no}: {problem}")
            elif row:
                rows.append(row)
    if not rows:
        detail = f" ({len(problems)} bad line(s); first: {problems[0]})" if problems else ""
        raise UsageError(f"dataset {path} has no usable rows{detail}")
    return rows, problems


def _parse_line(raw: bytes, line_no: int, seen: collections.Counter[str]) -> tuple[str | None, Row | None]:
    if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte order mark is harmless; accept it
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start})", None
    if not text.strip():
        return None, None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg} at column {exc.colno}", None
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}", None
    prompt = obj.get("prompt")
    if prompt is None:
        return "field 'prompt' is missing", None
    if not isinstance(prompt, str):
        return f"field 'prompt' must be a string, got {type(prompt).__name__}", None
    if not prompt.strip():
        return "field 'prompt' is empty", None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        return (
            "field 'prompt' holds an unpaired surrogate escape (\\ud800-\\udfff), not valid Unicode text",
            None,
        )
    image = obj.get("image") or obj.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        return "field 'image'/'docker_image' must be a non-empty string", None
    cwd = obj.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd):
        return "field 'cwd' must be an absolute path string", None
    extra = {k: v for k, v in obj.items() if k not in ROW_RUN_FIELDS}
    row = Row(
        index=line_no - 1,
        prompt=prompt,
        image=image,
        cwd=cwd,
        occurrence=seen[prompt],
        row_fields=row_fields_text(extra),
        row_id=row_id_text(extra),
    )
    seen[prompt] += 1
    return None, row
