"""A dataset row's identity, in one place: what makes two rows the same row, and what is derived from it.

A row is its prompt text, its ``image`` and ``cwd``, and its own run settings (``toolsets``, ``tools``,
``system``, ``max_turns``: the records' ``row_*`` fields). Resume, merge, ``--stop_after_passes`` and the
views find a row's samples by :func:`row_key` of these, computed the same way from a dataset row
(:func:`row_identity`), a saved record (:func:`record_row_key`) or a ``failed.jsonl`` / ``discarded.jsonl``
row (:func:`outcome_row_key`). A unit of work is a sample: (row key, sample index).

Two seeds are derived from a row, each a deliberate choice kept as it was when it was made, so that
earlier runs resume with the same draws:

- the toolset draw (:func:`toolset_rng`): the run's ``--seed``, the prompt text, the row's occurrence
  among identical texts and the sample index. Not the image, cwd or options: rows that differ only in
  those draw alike, as they did before those fields existed.
- the request seed (:func:`request_seed_base`, ``--seed_per_request``): the run's seed, the whole
  identity (text, image, cwd, options), the occurrence and the sample index; the loop adds the turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import TYPE_CHECKING, Any

from batchrun.record import (
    ROW_OPTION_FIELDS,
    identity_options,
    optional_text,
    row_option_fields,
    sample_index_of,
)
from batchrun.sharegpt import first_human

if TYPE_CHECKING:
    from batchrun.protocol import Outcome, PromptJob
    from batchrun.run.dataset import Row
    from batchrun.secrets import Redactor


def row_key(
    text: str, image: str | None = None, cwd: str | None = None, options: dict[str, Any] | None = None
) -> str:
    """A dataset row's identity: everything that defines how it runs, as hex.

    The prompt text, image and cwd, and the row's own settings (``options``: the ``row_*`` metadata
    fields, see ``batchrun.record.row_option_fields``). Two rows with the same text but another image,
    cwd, toolsets, tools, system prompt or max_turns are different rows for resume and merge. A field
    that is absent is ``None``: records of older versions match rows without them, and a row without
    settings of its own has the identity it had before those settings existed.
    """
    own = {k: v for k, v in (options or {}).items() if v is not None}
    payload = json.dumps(
        [text, image, cwd, own] if own else [text, image, cwd], ensure_ascii=False, sort_keys=True
    )
    return hashlib.blake2b(payload.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _options_of(fields: dict[str, Any]) -> dict[str, Any]:
    return identity_options(fields)


def record_row_key(record: dict[str, Any]) -> str:
    """The identity of the row a (valid) record came from; see :func:`valid_record`."""
    meta = record.get("metadata") or {}
    return row_key(
        first_human(record["conversations"]) or "",
        optional_text(meta.get("image")),
        optional_text(meta.get("cwd")),
        _options_of(meta),
    )


def record_sample(record: dict[str, Any]) -> tuple[str, int]:
    """(row identity, sample index) of a (valid) record: merge keeps one record per pair."""
    return record_row_key(record), sample_index_of(record.get("metadata") or {})


def outcome_row_key(row: dict[str, Any]) -> str:
    return row_key(
        row["prompt"], optional_text(row.get("image")), optional_text(row.get("cwd")), _options_of(row)
    )


def outcome_sample(row: dict[str, Any]) -> tuple[str, int]:
    """(row identity, sample index) of a (valid) discarded.jsonl or failed.jsonl row."""
    return outcome_row_key(row), sample_index_of(row)


def identity_fields(row: Row | Outcome, redact: Redactor) -> dict[str, Any]:
    """A row's identity fields as saved records hold them (secrets in image and cwd redacted there):
    image, cwd and the ``row_*`` fields of its own settings."""
    opts = row.options
    return {
        "image": None if row.image is None else redact(row.image),
        "cwd": None if row.cwd is None else redact(row.cwd),
        **row_option_fields(opts.toolsets, opts.tools, opts.system, opts.max_turns),
    }


def row_identity(row: Row | Outcome, redact: Redactor) -> str:
    """A row's identity (a dataset row's, or an outcome's) as saved records give it back: secrets in
    them were redacted there."""
    fields = identity_fields(row, redact)
    options = {k: fields[k] for k in ROW_OPTION_FIELDS}
    return row_key(redact(row.prompt), fields["image"], fields["cwd"], options)


def prompt_rng(seed: int, prompt: str, occurrence: int = 0) -> random.Random:
    """A Random fixed by (seed, prompt text, occurrence), so reruns and resumes draw the same toolsets.

    `occurrence` tells apart repeated copies of the same prompt text in one dataset. sha256
    rather than hash() keeps the result independent of PYTHONHASHSEED.
    """
    digest = hashlib.sha256(f"{seed}\0{occurrence}\0{prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def toolset_rng(seed: int, row: Row, sample_index: int) -> random.Random:
    """The toolset draw's Random for one sample, fixed by (seed, row text, occurrence, sample index).

    Sample 0 draws exactly what runs before samples existed drew, so their resumes offer the same.
    """
    if sample_index == 0:
        return prompt_rng(seed, row.prompt, row.occurrence)
    digest = hashlib.sha256(f"{seed}\0{row.occurrence}\0{sample_index}\0{row.prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def request_seed_base(run_seed: int, job: PromptJob) -> int:
    """The base of a sample's request seeds: fixed by the run's seed, the row's identity (text, image,
    cwd, own settings), its occurrence among identical rows and the sample index; the loop adds the turn."""
    payload = json.dumps(
        [
            run_seed,
            job.prompt,
            job.image,
            job.cwd,
            dataclasses.asdict(job.options),
            job.occurrence,
            job.sample_index,
        ],
        ensure_ascii=False,
        sort_keys=True,
    )
    return int.from_bytes(hashlib.sha256(payload.encode("utf-8", "surrogatepass")).digest()[:8], "big")
