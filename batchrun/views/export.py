"""Export a run's trajectories for trainers: OpenAI chat messages, ShareGPT, or Parquet.

    python -m batchrun.views.export data/<run_name> [data/<other_run> ...] --format=openai|sharegpt|parquet --out=DIR \
        [--no-include_partial] [--include_discarded] [--test_fraction=0.1 --seed=0] [--overwrite]

Each sample becomes one row. In the ``openai`` and ``parquet`` formats a row holds ``messages``
(``role``, ``content``, ``reasoning_content``, ``tool_calls``, ``tool_call_id``) and the tools the
prompt was offered as a column of their own (``tools``): the Hermes text markup is taken apart, so a
call is in ``tool_calls`` only (never repeated in ``content``), reasoning is in ``reasoning_content``,
and a tool entry becomes one ``tool`` message per ``tool_call_id``. The record's system entry is the
function-calling preamble around that tool list, so it is not exported as a message; a row's own
``system`` prompt, saved before the preamble, is exported as the first (``system``) message.
``sharegpt`` keeps the record's own ``conversations`` (Hermes convention, system entry included)
without the structured ``tool_calls``, so every turn has the same two keys.

Column types, chosen so that ``datasets.load_dataset`` reads every file whatever the tools were:
``tools`` is one JSON string (a list of OpenAI tool objects; ``json.loads`` it), because tools'
parameter schemas differ too much for one Arrow type. ``openai`` (JSONL) leaves out the message keys
that do not apply, so each message validates as the ``openai`` package's message types;
``parquet`` gives every message all five keys, null where they do not apply (one Arrow type).
The card's ``dataset_info`` states the features, so ``load_dataset(DIR)`` reads the JSONL splits
with one schema even when one split has, say, no tool call at all.

The train/test split is a pure function of (seed, prompt text): the same seed gives the same split
on every export, a resumed run's new rows do not move old ones, and two samples of the same prompt
always land in the same split. A ``README.md`` dataset card beside the files names the splits, so
``hf upload <user>/<repo> DIR --repo-type=dataset`` (or ``huggingface-cli upload``) publishes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.prompt.trajectory import (
    first_human,
    offered_tools,
    parse_gpt_value,
    parse_tool_responses,
    split_system_value,
)
from batchrun.record import features_yaml
from batchrun.storage import iter_jsonl

FORMATS = ("openai", "sharegpt", "parquet")
# Formats that group a row's samples by their scores (batchrun.views.export_scored): JSONL only.
SCORED_FORMATS = ("preference", "rewards")
SPLITS = ("train", "test")
CARD_NAME = "README.md"
PARQUET_ROWS_PER_GROUP = 1000


class ExportError(ValueError):
    """A bad request (missing run, non-empty output directory, missing pyarrow): exit code 2."""


@dataclass
class ExportResult:
    """What an export wrote and what it left out, with the reason for each sample not written."""

    out: Path
    files: dict[str, Path] = field(default_factory=dict)  # split -> file
    rows: Counter[str] = field(default_factory=Counter)  # split -> rows written
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> samples or lines not written

    def summary(self) -> str:
        written = ", ".join(f"{split} {self.rows[split]}" for split in self.files) or "nothing"
        text = f"exported {sum(self.rows.values())} samples ({written}) to {self.out}"
        if self.skipped:
            text += "; not exported: " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return text


# ----------------------------------------------------------------------------- one record -> one row


def to_openai_messages(conversations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A record's ShareGPT conversation as OpenAI chat messages (keys that do not apply left out).

    Raises ValueError (or KeyError, json.JSONDecodeError) for a conversation that does not parse back.
    """
    messages: list[dict[str, Any]] = []
    for turn in conversations:
        who, value = turn.get("from"), turn.get("value")
        if not isinstance(value, str):
            raise ValueError(f"a {who!r} turn has no text value")
        if who == "system":
            own = split_system_value(value)  # a row's own system prompt, before the preamble
            if own is not None:
                messages.append({"role": "system", "content": own})
            continue  # the preamble around the tool list, which is exported as its own column
        if who == "human":
            messages.append({"role": "user", "content": value})
        elif who == "gpt":
            messages.append(_assistant_message(turn, value))
        elif who == "tool":
            for resp in parse_tool_responses(value):
                if not isinstance(resp["tool_call_id"], str):
                    raise ValueError("a tool result's tool_call_id is not a string")
                messages.append(
                    {"role": "tool", "tool_call_id": resp["tool_call_id"], "content": resp["content"]}
                )
        else:
            raise ValueError(f"unknown turn kind {who!r}")
    return messages


def _assistant_message(turn: dict[str, Any], value: str) -> dict[str, Any]:
    reasoning, content, parsed = parse_gpt_value(value)
    structured = turn.get("tool_calls") or []
    for c in structured:  # typed as the columns are: a bad value would fail the whole Parquet row group
        if not all(isinstance(v, str) for v in (c["id"], c["function"]["name"], c["function"]["arguments"])):
            raise ValueError("a tool call's id, name or arguments is not a string")
    # The structured list carries the ids; the text must hold exactly the same calls, or one of the two is wrong.
    if [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in structured
    ] != parsed:
        raise ValueError("the calls in a gpt turn's text differ from its tool_calls")
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not structured else None}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if structured:
        msg["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            }
            for c in structured
        ]
    return msg


def _full_message(msg: dict[str, Any]) -> dict[str, Any]:
    """Every message key present (null where it does not apply): one Arrow type for all messages."""
    return {
        "role": msg["role"],
        "content": msg.get("content"),
        "reasoning_content": msg.get("reasoning_content"),
        "tool_calls": msg.get("tool_calls"),
        "tool_call_id": msg.get("tool_call_id"),
    }


def _row(record: dict[str, Any], fmt: str, discard_reason: str | None, run_name: str) -> dict[str, Any]:
    conversations = record["conversations"]
    system = next((t["value"] for t in conversations if t.get("from") == "system"), "")
    tools = offered_tools(system)
    metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    row: dict[str, Any]
    if fmt == "sharegpt":
        to_openai_messages(conversations)  # only to check that the sample parses back
        row = {"conversations": [{"from": t["from"], "value": t["value"]} for t in conversations]}
    elif fmt == "openai":
        row = {"messages": to_openai_messages(conversations)}
    else:
        row = {"messages": [_full_message(m) for m in to_openai_messages(conversations)]}
    row["tools"] = json.dumps(tools, ensure_ascii=False)
    index, model = record.get("prompt_index"), metadata.get("model")
    row.update(
        prompt_index=index if isinstance(index, int) and not isinstance(index, bool) else None,
        completed=bool(record.get("completed")),
        partial=bool(record.get("partial")),
        model=model if isinstance(model, str) else None,
        # The model that answered, and the dataset row's id and other fields: join back to ground truth.
        **{k: _text_or_none(metadata.get(k)) for k in ("served_model", "row_id", "row_fields")},
        run_name=run_name,
        toolsets_used=[str(t) for t in record.get("toolsets_used") or []],
        discard_reason=discard_reason,
        **score_columns(record),
    )
    return row


def score_columns(record: dict[str, Any]) -> dict[str, Any]:
    """The sample's score as flat columns (``score_value``, ``score_passed``, ``scorer``): null when not judged."""
    score = record.get("score") if isinstance(record.get("score"), dict) else {}
    value, passed, scorer = score.get("value"), score.get("passed"), score.get("scorer")
    return {
        "score_value": float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else None,
        "score_passed": passed if isinstance(passed, bool) else None,
        "scorer": scorer if isinstance(scorer, str) else None,
    }


def score_filter(record: dict[str, Any], only_passed: bool, min_score: float | None) -> str | None:
    """Why --only_passed or --min_score leaves a sample out (None: it is exported)."""
    cols = score_columns(record)
    if only_passed and cols["score_passed"] is not True:
        return "not passed (--only_passed)"
    if min_score is not None and (cols["score_value"] is None or cols["score_value"] < min_score):
        return f"score below {min_score:g} (--min_score)"
    return None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def split_of(prompt: str, seed: int, test_fraction: float) -> str:
    """``test`` for about ``test_fraction`` of prompts, decided by (seed, prompt text) alone."""
    if test_fraction <= 0:
        return "train"
    digest = hashlib.sha256(f"{seed}\0{prompt}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"


# ----------------------------------------------------------------------------- reading the run


def _samples(
    run_dir: Path, include_discarded: bool, skipped: Counter[str]
) -> Iterator[tuple[dict[str, Any], str | None]]:
    """(record, discard reason or None), streamed; malformed lines are counted in ``skipped``."""
    for rec in iter_jsonl(run_dir / "trajectories.jsonl"):
        if rec is None:
            skipped["malformed lines"] += 1
        else:
            yield rec, None
    if not include_discarded:
        return
    for row in iter_jsonl(run_dir / "discarded.jsonl"):
        if row is None:
            skipped["malformed lines"] += 1
        elif not isinstance(row.get("record"), dict):
            skipped["discarded without a record"] += 1
        else:
            yield row["record"], str(row.get("reason") or "unknown")


# ----------------------------------------------------------------------------- writers


class _JsonlWriter:
    def __init__(self, path: Path):
        self.path = path
        self._fh = path.open("w", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._fh.write(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._fh.close()


def _parquet_schema() -> Any:
    import pyarrow as pa

    call = pa.struct(
        [
            ("id", pa.string()),
            ("type", pa.string()),
            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ]
    )
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("reasoning_content", pa.string()),
            ("tool_calls", pa.list_(call)),
            ("tool_call_id", pa.string()),
        ]
    )
    return pa.schema(
        [
            ("messages", pa.list_(message)),
            ("tools", pa.string()),
            ("prompt_index", pa.int64()),
            ("completed", pa.bool_()),
            ("partial", pa.bool_()),
            ("model", pa.string()),
            ("served_model", pa.string()),
            ("row_id", pa.string()),
            ("row_fields", pa.string()),
            ("run_name", pa.string()),
            ("toolsets_used", pa.list_(pa.string())),
            ("discard_reason", pa.string()),
            ("score_value", pa.float64()),
            ("score_passed", pa.bool_()),
            ("scorer", pa.string()),
        ]
    )


class _ParquetWriter:
    """Rows are written in row groups as they come, so memory stays flat on a large run."""

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.path = path
        self._schema = _parquet_schema()
        self._writer = pq.ParquetWriter(path, self._schema)
        self._rows: list[dict[str, Any]] = []

    def write(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        if len(self._rows) >= PARQUET_ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self._schema))
            self._rows = []

    def close(self) -> None:
        self._flush()
        self._writer.close()


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
    only_passed: bool = False,
    min_score: float | None = None,
) -> ExportResult:
    """Export the trajectories of ``run_dir`` (one run directory, or several exported together into one
    dataset, each row naming its run in ``run_name``), and when asked the discarded samples, to ``out``.

    Raises ExportError for a bad request. A sample that does not parse back is left out and counted.
    """
    run_dirs = [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(d) for d in run_dir]
    out = Path(out)
    if not run_dirs:
        raise ExportError("name at least one run directory")
    if fmt not in FORMATS + SCORED_FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS + SCORED_FORMATS)}, got {fmt!r}")
    if not 0 <= test_fraction < 1:
        raise ExportError(f"--test_fraction must be at least 0 and below 1, got {test_fraction!r}")
    for one in run_dirs:
        if not (one / "trajectories.jsonl").is_file():
            raise ExportError(f"{one} holds no trajectories.jsonl (is it a finished run's directory?)")
    if len({d.resolve() for d in run_dirs}) != len(run_dirs):
        raise ExportError("a run directory is named twice: its samples would be exported twice")
    if fmt == "parquet":
        _require_pyarrow()
    if out.exists() and any(out.iterdir()) and not overwrite:
        # An upload sends the whole directory: files left from another export would be published too.
        raise ExportError(f"output directory {out} is not empty (pass --overwrite to replace its files)")
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:  # a previous export's split file must not outlive this one
        for ext in ("jsonl", "parquet"):
            (out / f"{split}.{ext}").unlink(missing_ok=True)

    result = ExportResult(out=out)
    if fmt in SCORED_FORMATS:
        from batchrun.views.export_scored import export_scored

        return export_scored(run_dirs, fmt, result, include_partial, include_discarded, test_fraction, seed)
    ext = "parquet" if fmt == "parquet" else "jsonl"
    writers: dict[str, _JsonlWriter | _ParquetWriter] = {}
    try:
        for record, reason, run_name in _all_samples(run_dirs, include_discarded, result.skipped):
            if record.get("partial") and not include_partial:
                result.skipped["partial"] += 1
                continue
            left_out = score_filter(record, only_passed, min_score)
            if left_out is not None:
                result.skipped[left_out] += 1
                continue
            try:
                row = _row(record, fmt, reason, run_name)
            # A record that does not parse back (JSONDecodeError is a ValueError) is left out, and counted.
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                result.skipped[f"unparsable ({type(exc).__name__})"] += 1
                continue
            split = split_of(first_human(record["conversations"]) or "", seed, test_fraction)
            if split not in writers:
                path = out / f"{split}.{ext}"
                writers[split] = _ParquetWriter(path) if fmt == "parquet" else _JsonlWriter(path)
                result.files[split] = path
            writers[split].write(row)
            result.rows[split] += 1
    finally:
        for writer in writers.values():
            writer.close()
    result.files = {s: result.files[s] for s in SPLITS if s in result.files}
    (out / CARD_NAME).write_text(dataset_card(run_dirs, fmt, result, test_fraction, seed), encoding="utf-8")
    return result


def _all_samples(
    run_dirs: list[Path], include_discarded: bool, skipped: Counter[str]
) -> Iterator[tuple[dict[str, Any], str | None, str]]:
    for run_dir in run_dirs:
        for record, reason in _samples(run_dir, include_discarded, skipped):
            yield record, reason, run_dir.resolve().name


# The columns as Hugging Face features (the card's dataset_info): a dtype name, or a struct (dict), or
# a list of structs ([dict]), or a list of a dtype ([str]).
_CALL = {"id": "string", "type": "string", "function": {"name": "string", "arguments": "string"}}
_MESSAGE = {
    "role": "string",
    "content": "string",
    "reasoning_content": "string",
    "tool_calls": [_CALL],
    "tool_call_id": "string",
}
_COMMON = {
    "tools": "string",
    "prompt_index": "int64",
    "completed": "bool",
    "partial": "bool",
    "model": "string",
    "served_model": "string",
    "row_id": "string",
    "row_fields": "string",
    "run_name": "string",
    "toolsets_used": ["string"],
    "discard_reason": "string",
    "score_value": "float64",
    "score_passed": "bool",
    "scorer": "string",
}
FEATURES: dict[str, dict[str, Any]] = {
    "openai": {"messages": [_MESSAGE], **_COMMON},
    "parquet": {"messages": [_MESSAGE], **_COMMON},
    "sharegpt": {"conversations": [{"from": "string", "value": "string"}], **_COMMON},
}


def dataset_card(
    run_dirs: list[Path], fmt: str, result: ExportResult, test_fraction: float, seed: int
) -> str:
    """A Hugging Face dataset card: the YAML header maps each split to its file."""
    lines = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split, path in result.files.items():
        lines += [f"  - split: {split}", f"    path: {path.name}"]
    lines += ["dataset_info:", "  features:", *features_yaml(FEATURES[fmt], 2)]
    lines += ["tags:", "- tool-use", "- agent-trajectories", "---", "", ""]
    columns = {
        "openai": "`messages` (OpenAI chat messages: `role`, `content`, `reasoning_content`, `tool_calls`, "
        "`tool_call_id`; keys that do not apply are left out), `tools` (JSON string: list of OpenAI tool objects)",
        "parquet": "`messages` (OpenAI chat messages: `role`, `content`, `reasoning_content`, `tool_calls`, "
        "`tool_call_id`; null where they do not apply), `tools` (JSON string: list of OpenAI tool objects)",
        "sharegpt": "`conversations` (ShareGPT `from`/`value`, Hermes function-calling markup: `<tools>`, "
        "`<think>`, `<tool_call>`, `<tool_response>`), `tools` (JSON string: list of OpenAI tool objects)",
    }[fmt]
    split_text = (
        f"{test_fraction:g} of prompts in `test`, chosen by seed {seed} and the prompt text"
        if test_fraction > 0
        else "one split, `train`"
    )
    counts = ", ".join(f"{s}: {result.rows[s]}" for s in result.files) or "none"
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(result.skipped.items())) or "none"
    names = [d.resolve().name for d in run_dirs]
    title = names[0] if len(names) == 1 else f"{len(names)} runs"
    runs = ", ".join(f"`{n}`" for n in names)
    body = f"""# {title}

Agent trajectories exported by batch-runner from the run{"s" if len(names) > 1 else ""} {runs} (format `{fmt}`).

- Columns: {columns}; `prompt_index`, `completed`, `partial`, `model` (as requested), `served_model` (as the
  endpoint answered), `row_id` and `row_fields` (the dataset row's `id` and other fields, JSON text),
  `run_name`, `toolsets_used`, `discard_reason`
  (null unless the sample was set aside by a quality filter and exported on request), `score_value`,
  `score_passed`, `scorer` (the sample's score; null when it was not judged).
- Splits: {split_text}. Rows: {counts}.
- Not exported: {skipped}.

Publish with `hf upload <user>/<repo> <this directory> --repo-type=dataset`
(or `huggingface-cli upload <user>/<repo> <this directory> --repo-type=dataset`).
"""
    return "\n".join(lines) + body


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
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
        "--include_partial",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="export samples that stopped early (max_turns, context limit, truncation); default: yes",
    )
    parser.add_argument(
        "--include_discarded",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also export the samples in discarded.jsonl, with their discard_reason; default: no",
    )
    parser.add_argument("--test_fraction", type=float, default=0.0, help="share of prompts in the test split")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--only_passed", action="store_true", help="only samples whose check passed")
    parser.add_argument("--min_score", type=float, help="only samples scored at least this (0 to 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 when the export is written, 2 for a bad request."""
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
            only_passed=args.only_passed,
            min_score=args.min_score,
        )
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


if __name__ == "__main__":
    # The package's own copy of this module (not __main__), so errors raised by the modules it
    # imports (export_scored) are this main's ExportError.
    from batchrun.views.export import main as package_main

    sys.exit(package_main())
