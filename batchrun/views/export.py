"""Export a run's trajectories for trainers: chat messages for templates, OpenAI messages, TRL's
prompt/completion, ShareGPT, or Parquet.

    python -m batchrun.views.export data/<run_name> [data/<other_run> ...] --out=DIR \
        --format=messages|openai|prompt_completion|sharegpt|parquet [--reasoning=field|think|drop] \
        [--no-include_partial] [--stop_reasons=a,b | --exclude_stop_reasons=a,b] [--include_discarded] \
        [--dedup] [--test_fraction=0.1 --seed=0] [--overwrite]

Each sample becomes one row; the Hermes text markup is taken apart, so a call is in ``tool_calls`` only
(never repeated in ``content``), reasoning is in ``reasoning_content``, and a tool entry becomes one
``tool`` message per ``tool_call_id``. The record's system entry is the function-calling preamble
around the tool list, so it is not exported as a message; a row's own ``system`` prompt, saved before
the preamble, is exported as the first (``system``) message.

* ``messages``: for Hugging Face chat templates (``tokenizer.apply_chat_template(row["messages"],
  tools=row["tools"])``): tool-call ``arguments`` are JSON objects, as transformers' templates expect
  (Qwen2.5's and Hermes-3's apply ``tojson`` to them: a string would come out double-encoded), and
  ``tools`` is a list of OpenAI tool objects (``[]`` when none).
* ``openai``: the API's own shapes (``arguments`` as JSON strings; ``tools`` as one JSON string), keys
  that do not apply left out, so each message validates as the ``openai`` package's message types.
* ``prompt_completion``: TRL's conversational prompt/completion layout: ``prompt`` holds the system and
  user messages, ``completion`` everything the model and the tools said after them; messages as in
  ``messages``. This said "loss on the completion only": an agent sample's completion holds the tool
  results too, which a completion-only loss trains the model to write. ``messages`` with TRL's
  ``assistant_only_loss=True`` trains on the model's turns alone.
* ``sharegpt``: the record's own ``conversations`` (Hermes convention, system entry included) without
  the structured ``tool_calls``.
* ``parquet``: the ``openai`` rows in one typed Arrow schema (every message key present, null where it
  does not apply).

``--reasoning``: ``field`` (``reasoning_content``), ``think`` (folded back into ``content`` as
``<think>...</think>``, for templates that ignore ``reasoning_content``), ``drop``. The scored formats
(``preference``, ``rewards``: :mod:`batchrun.views.export_scored`) apply it, the stop-reason filters and
``--dedup`` too, and refuse ``--only_passed`` and ``--min_score``.

What is exported by default: every kept sample, partial ones included, except those whose stop reason
is a model fault (``invalid_tool_calls``) or whose last reply the length limit cut (``truncated``); ``--stop_reasons`` keeps only the reasons named,
``--exclude_stop_reasons`` leaves out those named instead of the default (a note on stderr names the default
reasons it now exports). ``--include_discarded`` adds the
samples in ``discarded.jsonl`` with their ``discard_reason``: an ``ambiguous_markup`` sample's assistant
turns carry their text unsplit (reasoning and words are not cut where the markup is ambiguous; with
``--reasoning`` field or drop, one warning line on stderr counts those exported), an
``invalid_tool_call`` sample's calls keep their raw arguments in ``raw_arguments``. ``--dedup`` leaves out
samples whose conversation is byte-identical to one exported before (within and across the runs given).

Every row carries ``run_name``, ``prompt_index``, ``sample_index``, ``stop_reason``, ``completed``,
``partial``, ``model``, ``served_model``, ``row_id``, ``row_fields``, ``usage``, ``toolsets_used`` and
``discard_reason``, built in one function (:func:`_row`). Column types are chosen so that
``datasets.load_dataset`` reads every file; the card's ``dataset_info`` states the features of the
fixed-schema formats. An export with nothing to write is an error (exit code 1, saying what was left
out and why) that writes nothing: ``datasets`` cannot load a dataset of no rows from JSONL or Parquet.

The train/test split is a pure function of (seed, prompt text): the same seed gives the same split
on every export, a resumed run's new rows do not move old ones, and two samples of the same prompt
always land in the same split. A ``README.md`` dataset card beside the files names the splits, so
``hf upload <user>/<repo> DIR --repo-type=dataset`` (or ``huggingface-cli upload``) publishes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from batchrun.identity import is_index
from batchrun.record import (
    STOP_REASONS,
    USAGE,
    conform_score,
    features_yaml,
    metadata_typed,
    normalize_metadata,
)
from batchrun.run.run_dir import check_run_dir, holds_run, in_use
from batchrun.sharegpt import (
    first_human,
    offered_tools,
)
from batchrun.storage import WriteError, remove_stale_temp_files, temp_path
from batchrun.views.export_rows import (
    _PARQUET_MESSAGE,
    BUSY,
    EXPORT_FILES,
    ExportError,
    ExportOptions,
    ExportResult,
    JsonlWriter,
    NothingToExport,
    _all_samples,
    _full_message,
    holds_invalid_call,
    invalid_calls_warning,
    out_busy,
    sample_digest,
    sample_messages,
    score_columns,
    split_of,
    split_prompt_completion,
    stop_reason_left_out,
    stop_reasons_in,
    sync_close,
    template_messages,
    unsplit_warning,
    write_dataset,
)
from batchrun.views.export_rows import (
    apply_reasoning as apply_reasoning,  # importable from here, as before
)
from batchrun.views.export_rows import (
    to_openai_messages as to_openai_messages,  # importable from here, as before
)
from batchrun.views.flags import ViewParser

FORMATS = ("messages", "openai", "prompt_completion", "sharegpt", "parquet")
TEMPLATE_FORMATS = ("messages", "prompt_completion")  # arguments as objects, tools as a list
REASONING_MODES = ("field", "think", "drop")
# Stop reasons whose kept sample is not exported unless asked: a model's fault (``invalid_tool_calls``), or
# a last reply cut by the length limit (``truncated``): a trainer's chat template closes that reply with its
# end-of-turn token, so the model would learn to stop mid-sentence (it was exported by default before).
DEFAULT_EXCLUDED_STOP_REASONS = frozenset({"invalid_tool_calls", "truncated"})
# Formats that group a row's samples by their scores (batchrun.views.export_scored): JSONL only.
SCORED_FORMATS = ("preference", "rewards")
PARQUET_ROWS_PER_GROUP = 1000


def _row(
    record: dict[str, Any], discard_reason: str | None, run_name: str, opts: ExportOptions
) -> dict[str, Any]:
    """One export row: the sample in the format's layout, then the columns every format carries.

    Every column is added here (the scoring columns too), so each format has the same ones.
    """
    conversations = record["conversations"]
    system = next((t["value"] for t in conversations if t.get("from") == "system"), "")
    tools = offered_tools(system)
    messages = sample_messages(record, discard_reason, opts.reasoning)  # also checks that it parses back
    row: dict[str, Any]
    if opts.fmt == "sharegpt":
        row = {"conversations": [{"from": t["from"], "value": t["value"]} for t in conversations]}
    elif opts.fmt == "openai":
        row = {"messages": messages}
    elif opts.fmt == "messages":
        row = {"messages": template_messages(messages)}
    elif opts.fmt == "prompt_completion":
        prompt, completion = split_prompt_completion(template_messages(messages))
        row = {"prompt": prompt, "completion": completion}
    else:
        row = {"messages": [_full_message(m) for m in messages]}
    row["tools"] = tools if opts.fmt in TEMPLATE_FORMATS else json.dumps(tools, ensure_ascii=False)
    meta = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    if not metadata_typed(meta):  # what the recorder wrote is typed already: read as it is
        meta = normalize_metadata(meta)
    index = record.get("prompt_index")
    row.update(
        run_name=run_name,
        prompt_index=index if is_index(index) else None,
        sample_index=meta["sample_index"],
        stop_reason=meta["stop_reason"],
        completed=bool(record.get("completed")),
        partial=bool(record.get("partial")),
        model=meta["model"],
        # The model that answered, and the dataset row's id and other fields: join back to ground truth.
        served_model=meta["served_model"],
        row_id=meta["row_id"],
        row_fields=meta["row_fields"],
        usage=meta["usage"],
        toolsets_used=[str(t) for t in record.get("toolsets_used") or []],
        # "" for a kept sample, not null: a file of kept samples only would give the column the null
        # type, and datasets then cannot read it together with one holding reasons (in either order).
        discard_reason=discard_reason or "",
        **typed_score_columns(record),
    )
    return row


def wanted(record: dict[str, Any], discard_reason: str | None, opts: ExportOptions) -> str | None:
    """Why a sample is not exported (a ``skipped`` reason), or None to export it."""
    if discard_reason == "unencodable_text":  # UTF-8 cannot carry its text: no loadable file could
        return "unencodable_text (a lone surrogate; kept in discarded.jsonl)"
    if record.get("partial") and not opts.include_partial:
        return "partial"
    left_out = score_filter(record, opts.only_passed, opts.min_score)
    if left_out is not None:
        return left_out
    # The default leaves out the model's faults and cut replies among the kept samples.
    default = DEFAULT_EXCLUDED_STOP_REASONS if discard_reason is None else frozenset()
    return stop_reason_left_out(record, opts, default)


def typed_score_columns(record: dict[str, Any]) -> dict[str, Any]:
    """The score columns of an export row, typed in every row (an export's columns load like the
    record's): ``score_status`` says whether ``score_value`` and ``score_passed`` are a verdict."""
    score = conform_score(record.get("score"))
    return {
        "score_status": score["status"],
        "score_value": score["value"],
        "score_passed": score["passed"],
        "scorer": score["scorer"],
    }


def score_filter(record: dict[str, Any], only_passed: bool, min_score: float | None) -> str | None:
    """Why --only_passed or --min_score leaves a sample out (None: it is exported)."""
    cols = score_columns(record)
    if only_passed and cols["score_passed"] is not True:
        return "not passed (--only_passed)"
    if min_score is not None and (cols["score_value"] is None or cols["score_value"] < min_score):
        return f"score below {min_score:g} (--min_score)"
    return None


def exclusion_note(excluded: Collection[str] | None) -> str | None:
    """A note when --exclude_stop_reasons leaves out a default exclusion: the list replaces the default
    (documented), so ``--exclude_stop_reasons=max_turns`` started exporting cut-off replies unsaid. The
    semantics stay; the note names the reasons now exported. (The scored formats exclude nothing by
    default: no note there.)"""
    if excluded is None:
        return None
    now = sorted(DEFAULT_EXCLUDED_STOP_REASONS - set(excluded))
    if not now:
        return None
    default = ",".join(sorted(DEFAULT_EXCLUDED_STOP_REASONS))
    return (
        f"note: --exclude_stop_reasons replaces the default ({default}): "
        f"samples that stopped for {' or '.join(now)} are exported"
    )


# ----------------------------------------------------------------------------- writers


def _arrow_type(kind: Any) -> Any:
    """A column type in this module's notation (see FEATURES) as an Arrow type."""
    import pyarrow as pa

    if isinstance(kind, dict):
        return pa.struct([(k, _arrow_type(v)) for k, v in kind.items()])
    if isinstance(kind, list):
        return pa.list_(_arrow_type(kind[0]))
    return {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_()}[kind]


def _parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema([(name, _arrow_type(kind)) for name, kind in FEATURES["parquet"].items()])


class _ParquetWriter:
    """Rows are written in row groups as they come, so memory stays flat on a large run; to the temp
    file beside ``path`` (see :func:`write_dataset`)."""

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.path, self.tmp = path, temp_path(path)
        self._schema = _parquet_schema()
        self._rows: list[dict[str, Any]] = []
        self._fh = None
        try:
            self._fh = self.tmp.open("wb")
            self._writer = pq.ParquetWriter(self._fh, self._schema)
        except OSError as exc:
            self.abort()
            raise WriteError(path, exc) from exc

    def write(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        if len(self._rows) >= PARQUET_ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._rows:
            table = pa.Table.from_pylist(self._rows, schema=self._schema)
            try:
                self._writer.write_table(table)
            except OSError as exc:  # a full disk (pyarrow's IOError is an OSError)
                raise WriteError(self.path, exc) from exc
            self._rows = []

    def finish(self) -> None:
        self._flush()
        try:
            self._writer.close()
        except OSError as exc:
            raise WriteError(self.path, exc) from exc
        sync_close(self._fh, self.path)

    def abort(self) -> None:
        for close in (getattr(self, "_writer", None), self._fh):
            if close is not None:
                with contextlib.suppress(Exception):
                    close.close()


def _require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ExportError(
            "--format=parquet needs pyarrow: pip install 'batch-runner[export]' (or pip install pyarrow)"
        ) from None


# ----------------------------------------------------------------------------- the export


def export_run(
    run_dir: str | Path | Sequence[str | Path],
    fmt: str,
    out: str | Path,
    *,
    include_partial: bool = True,
    include_discarded: bool = False,
    test_fraction: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
    reasoning: str = "field",
    stop_reasons: Collection[str] | None = None,
    exclude_stop_reasons: Collection[str] | None = None,
    dedup: bool = False,
    only_passed: bool = False,
    min_score: float | None = None,
) -> ExportResult:
    """Export the trajectories of ``run_dir`` (one run directory, or several exported together into one
    dataset, each row naming its run in ``run_name``), and when asked the discarded samples, to ``out``.

    Raises ExportError for a bad request, NothingToExport when no sample is left to write (nothing is
    written then: ``datasets`` cannot load a dataset of no rows). A sample that does not parse back is
    left out and counted.
    """
    opts = ExportOptions(
        fmt=fmt,
        reasoning=reasoning,
        include_partial=include_partial,
        include_discarded=include_discarded,
        stop_reasons=None if stop_reasons is None else frozenset(stop_reasons),
        exclude_stop_reasons=None if exclude_stop_reasons is None else frozenset(exclude_stop_reasons),
        dedup=dedup,
        only_passed=only_passed,
        min_score=min_score,
    )
    run_dirs = [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(d) for d in run_dir]
    out = Path(out)
    for problem in filter(None, map(check_run_dir, run_dirs)):
        raise ExportError(problem)
    # A run being resumed: what it has written so far went out as if it were all (a mid-resume export
    # wrote 15 samples where the run ended with 90), its "not exported" counts from the growing side files.
    for problem in filter(None, (in_use(d, "export it") for d in run_dirs)):
        raise ExportError(problem)
    _check_request(run_dirs, out, opts, test_fraction, overwrite)
    _check_stop_reasons(run_dirs, opts)
    result = ExportResult(out=out)
    if fmt in SCORED_FORMATS:
        from batchrun.views.export_scored import export_scored

        return export_scored(run_dirs, opts, result, test_fraction, seed)
    result.notes += filter(None, [exclusion_note(opts.exclude_stop_reasons)])
    write_dataset(
        out,
        _rows(run_dirs, opts, seed, test_fraction, result),
        result,
        ext="parquet" if fmt == "parquet" else "jsonl",
        open_writer=_ParquetWriter if fmt == "parquet" else JsonlWriter,
        nothing=lambda: (
            f"nothing to export from {', '.join(str(d) for d in run_dirs)} (not exported: "
            f"{result.skipped_text()}); no dataset written"
        ),
        card=lambda: dataset_card(run_dirs, opts, result, test_fraction, seed),
    )
    if fmt != "sharegpt":  # sharegpt is the record's own text, markup and all, by design
        result.notes += filter(None, [unsplit_warning(result.unsplit, reasoning)])
    result.notes += filter(None, [invalid_calls_warning(result.invalid_calls)])
    return result


def _check_request(
    run_dirs: list[Path], out: Path, opts: ExportOptions, test_fraction: float, overwrite: bool
) -> None:
    if not run_dirs:
        raise ExportError("name at least one run directory")
    if opts.fmt not in FORMATS + SCORED_FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS + SCORED_FORMATS)}, got {opts.fmt!r}")
    if opts.reasoning not in REASONING_MODES:
        raise ExportError(f"--reasoning must be one of {', '.join(REASONING_MODES)}, got {opts.reasoning!r}")
    if opts.fmt == "sharegpt" and opts.reasoning != "field":
        raise ExportError(
            "--reasoning applies to the message formats; sharegpt keeps the record's <think> text"
        )
    if opts.fmt in SCORED_FORMATS:
        # Both were accepted and ignored: the export held the samples they were meant to leave out.
        why = {
            "preference": "a pair needs the failing sample it would leave out",
            "rewards": "a group's rewards are its samples' scores, the low ones included",
        }[opts.fmt]
        for flag, given in (("--only_passed", opts.only_passed), ("--min_score", opts.min_score is not None)):
            if given:
                raise ExportError(f"{flag} does not apply to --format={opts.fmt}: {why}")
    if opts.stop_reasons is not None and opts.exclude_stop_reasons is not None:
        raise ExportError("--stop_reasons and --exclude_stop_reasons exclude each other: name one")
    if opts.min_score is not None and not 0 <= opts.min_score <= 1:  # nan too: it left nothing out
        raise ExportError(f"--min_score must be a score from 0 to 1, got {opts.min_score!r}")
    if not 0 <= test_fraction < 1:
        raise ExportError(f"--test_fraction must be at least 0 and below 1, got {test_fraction!r}")
    for one in run_dirs:
        if not (one / "trajectories.jsonl").is_file():
            raise ExportError(f"{one} holds no trajectories.jsonl (is it a finished run's directory?)")
    if len({d.resolve() for d in run_dirs}) != len(run_dirs):
        raise ExportError("a run directory is named twice: its samples would be exported twice")
    if opts.fmt == "parquet":
        _require_pyarrow()
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; name a directory (created; must be empty)")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():  # said before the runs are read, whatever they hold
        raise ExportError(f"cannot make the output directory {out}: {above} is not a directory")
    if holds_run(out):
        # With --overwrite, the export's card replaced the run's README.md (its record schema, for
        # load_dataset of the run) and its train.jsonl went in beside the run's files. A run killed before
        # its merge (batch files only) is one too.
        raise ExportError(
            f"--out {out} is a run directory: the export would replace its README.md; name another directory"
        )
    if out.is_dir() and out_busy(out):
        raise ExportError(BUSY.format(out=out))  # its temp files would read "not empty"
    if out.is_dir():
        # An export killed outright left its temp files (.train.jsonl.<pid>.tmp): no export's files, and
        # they made the directory "not empty" to the next.
        remove_stale_temp_files(out, EXPORT_FILES)
    if out.exists() and any(out.iterdir()) and not overwrite:
        # An upload sends the whole directory: files left from another export would be published too.
        raise ExportError(f"output directory {out} is not empty (pass --overwrite to replace its files)")


def _check_stop_reasons(run_dirs: list[Path], opts: ExportOptions) -> None:
    """Refuse a stop reason no record can have: ``--exclude_stop_reasons=truncatd`` replaced the default
    exclusions and exported the truncated samples, ``--stop_reasons=final_answr`` found nothing to export.
    Known: this version's reasons, ``unknown`` (a record without one), and those the runs' records hold
    (an older or newer version's), read only when a name is not one of the others."""
    known = {*STOP_REASONS, "unknown"}
    present: set[str] | None = None
    for flag, names in (
        ("--stop_reasons", opts.stop_reasons),
        ("--exclude_stop_reasons", opts.exclude_stop_reasons),
    ):
        odd = sorted((names or frozenset()) - known)
        if not odd:
            continue
        if present is None:
            present = stop_reasons_in(run_dirs)
        odd = [name for name in odd if name not in present]
        if odd:
            raise ExportError(
                f"{flag}: unknown stop reason{'s' if len(odd) > 1 else ''} {', '.join(odd)}; "
                f"the stop reasons are {', '.join(sorted(known | present))}"
            )


def _rows(
    run_dirs: list[Path], opts: ExportOptions, seed: int, test_fraction: float, result: ExportResult
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(split, row) for every sample to export, streamed; what is left out is counted in
    ``result.skipped``, the samples whose assistant text is kept unsplit in ``result.unsplit``."""
    skipped = result.skipped
    seen: set[str] = set()
    for record, reason, run_name in _all_samples(run_dirs, opts.include_discarded, skipped):
        why = wanted(record, reason, opts)
        if why is not None:
            skipped[why] += 1
            continue
        if opts.dedup:
            digest = sample_digest(record)
            if digest in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(digest)
        try:
            row = _row(record, reason, run_name, opts)
        # A record that does not parse back (JSONDecodeError is a ValueError) is left out, and counted.
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            skipped[f"unparsable ({type(exc).__name__})"] += 1
            continue
        result.unsplit += reason == "ambiguous_markup"
        result.invalid_calls += opts.fmt in TEMPLATE_FORMATS and holds_invalid_call(record)
        yield split_of(first_human(record["conversations"]) or "", seed, test_fraction), row


# The columns as Hugging Face features (the card's dataset_info): a dtype name, or a struct (dict), or
# a list of structs ([dict]), or a list of a dtype ([str]). The template formats (arguments as objects,
# tools as a list) have no fixed schema: their card states none and the loader infers it.
_COMMON = {
    "tools": "string",
    "run_name": "string",
    "prompt_index": "int64",
    "sample_index": "int64",
    "stop_reason": "string",
    "completed": "bool",
    "partial": "bool",
    "model": "string",
    "served_model": "string",
    "row_id": "string",
    "row_fields": "string",
    "usage": USAGE,
    "toolsets_used": ["string"],
    "discard_reason": "string",
    "score_status": "string",
    "score_value": "float64",
    "score_passed": "bool",
    "scorer": "string",
}
FEATURES: dict[str, dict[str, Any]] = {
    # raw_arguments: the calls of an invalid_tool_call discard carry it in the openai rows too.
    "openai": {"messages": [_PARQUET_MESSAGE], **_COMMON},
    "parquet": {"messages": [_PARQUET_MESSAGE], **_COMMON},
    "sharegpt": {"conversations": [{"from": "string", "value": "string"}], **_COMMON},
}
COLUMNS_TEXT = {
    "messages": "`messages` (chat messages for `apply_chat_template`: `role`, `content`, `reasoning_content`, "
    "`tool_calls` with `arguments` as JSON objects, `tool_call_id`), `tools` (a list of OpenAI tool objects, "
    "`[]` when none)",
    "openai": "`messages` (OpenAI chat messages: `role`, `content`, `reasoning_content`, `tool_calls`, "
    "`tool_call_id`; keys that do not apply are left out), `tools` (JSON string: list of OpenAI tool objects)",
    "prompt_completion": "`prompt` (the system and user messages) and `completion` (everything the model and "
    "the tools said after them), messages as in the `messages` format (TRL's conversational prompt/completion), "
    "`tools` (a list of OpenAI tool objects)",
    "parquet": "`messages` (OpenAI chat messages: `role`, `content`, `reasoning_content`, `tool_calls`, "
    "`tool_call_id`; null where they do not apply), `tools` (JSON string: list of OpenAI tool objects)",
    "sharegpt": "`conversations` (ShareGPT `from`/`value`, Hermes function-calling markup: `<tools>`, "
    "`<think>`, `<tool_call>`, `<tool_response>`), `tools` (JSON string: list of OpenAI tool objects)",
}


def dataset_card(
    run_dirs: list[Path], opts: ExportOptions, result: ExportResult, test_fraction: float, seed: int
) -> str:
    """A Hugging Face dataset card: the YAML header maps each split to its file."""
    fmt = opts.fmt
    lines = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split, path in result.files.items():
        lines += [f"  - split: {split}", f"    path: {path.name}"]
    if fmt in FEATURES:
        lines += ["dataset_info:", "  features:", *features_yaml(FEATURES[fmt], 2)]
    lines += ["tags:", "- tool-use", "- agent-trajectories", "---", "", ""]
    split_text = (
        f"{test_fraction:g} of prompts in `test`, chosen by seed {seed} and the prompt text"
        if test_fraction > 0
        else "one split, `train`"
    )
    counts = ", ".join(f"{s}: {result.rows[s]}" for s in result.files) or "none"
    names = [d.resolve().name for d in run_dirs]
    title = names[0] if len(names) == 1 else f"{len(names)} runs"
    runs = ", ".join(f"`{n}`" for n in names)
    body = f"""# {title}

Agent trajectories exported by batch-runner from the run{"s" if len(names) > 1 else ""} {runs} (format `{fmt}`,
reasoning `{opts.reasoning}`).

- Columns: {COLUMNS_TEXT[fmt]}; `run_name`, `prompt_index`, `sample_index`, `stop_reason`, `completed`,
  `partial`, `model` (as requested), `served_model` (as the endpoint answered; `""` when it named none),
  `row_id` and `row_fields` (the dataset row's `id`, `""` when none, and its other fields as JSON text),
  `usage` (what the sample spent), `toolsets_used`, `discard_reason` (`""` unless the sample was set aside
  by a quality filter and exported on request).
  `score_status` (passed, failed, unscored or error), `score_value` and `score_passed` (a verdict only
  where the status is passed or failed; 0.0 and false otherwise), `scorer`: the sample's score.
- Splits: {split_text}. Rows: {counts}.
- Not exported: {result.skipped_text()}.

Publish with `hf upload <user>/<repo> <this directory> --repo-type=dataset`
(or `huggingface-cli upload <user>/<repo> <this directory> --repo-type=dataset`).
"""
    return "\n".join(lines) + body


# ----------------------------------------------------------------------------- command line


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError("a comma-separated list of stop reasons (one is empty)")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ViewParser(
        prog="python -m batchrun.views.export", description="Export a run's trajectories for trainers."
    )
    parser.add_argument(
        "run_dir",
        nargs="+",
        help="the run's directory, data/<run_name>; several runs export into one dataset",
    )
    parser.add_argument("--format", choices=FORMATS + SCORED_FORMATS, required=True, dest="fmt")
    parser.add_argument("--out", required=True, help="output directory (created; must be empty)")
    parser.add_argument(
        "--reasoning",
        choices=REASONING_MODES,
        default="field",
        help="field: reasoning_content; think: folded into content as <think>...</think>; drop; default: field",
    )
    parser.add_argument(
        "--include_partial",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="export samples that stopped early (max_turns, context limit, truncation); default: yes",
    )
    parser.add_argument(
        "--stop_reasons",
        type=_names,
        default=None,
        help="export only samples that stopped for these reasons (comma-separated, e.g. final_answer)",
    )
    parser.add_argument(
        "--exclude_stop_reasons",
        type=_names,
        default=None,
        help="leave out samples that stopped for these reasons, instead of the default: "
        "invalid_tool_calls,truncated (kept samples; preference and rewards: none)",
    )
    parser.add_argument(
        "--include_discarded",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also export the samples in discarded.jsonl, with their discard_reason; default: no",
    )
    parser.add_argument(
        "--dedup", action="store_true", help="leave out samples byte-identical to one already exported"
    )
    parser.add_argument("--test_fraction", type=float, default=0.0, help="share of prompts in the test split")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--only_passed", action="store_true", help="only samples whose check passed")
    parser.add_argument("--min_score", type=float, help="only samples scored at least this (0 to 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 when the export is written, 1 when there was nothing to export, 2 for a bad request
    or an output file that could not be written (as the other views' write errors)."""
    args = parse_args(argv)
    try:
        result = export_run(
            args.run_dir,
            args.fmt,
            args.out,
            include_partial=args.include_partial,
            include_discarded=args.include_discarded,
            test_fraction=args.test_fraction,
            seed=args.seed,
            overwrite=args.overwrite,
            reasoning=args.reasoning,
            stop_reasons=args.stop_reasons,
            exclude_stop_reasons=args.exclude_stop_reasons,
            dedup=args.dedup,
            only_passed=args.only_passed,
            min_score=args.min_score,
        )
    except NothingToExport as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except WriteError as exc:  # a full disk, a read-only --out: nothing half-written is left
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    for note in result.notes:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
