"""The trajectory record: its fields and their types, defined once.

The writer (``batchrun.prompt.trajectory.build_record`` and ``batchrun.prompt.run``), the merge and
statistics (``batchrun.run.finish``), the exporter and the tests all take the schema from here.

Every key is present in every record, whatever the backend, endpoint, toolsets or outcome, with one
type: a value that is unknown is ``null`` (never a missing key, never an empty list of unknown type),
so any set of runs loads together with Hugging Face ``datasets``.

Types are written as data, without importing ``datasets``: ``"string"``, ``"int64"``, ``"float64"``,
``"bool"`` for a (nullable) value, a dict for a struct, a one-element list for a list of that type.
:func:`record_features` turns the schema into ``datasets.Features`` for readers that want it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

STRING, INT, FLOAT, BOOL = "string", "int64", "float64", "bool"

# The top-level fields of a record, in the order they are written (../shared/SPEC.md).
RECORD_FIELDS = (
    "prompt_index",
    "conversations",
    "metadata",
    "completed",
    "partial",
    "api_calls",
    "toolsets_used",
    "tool_stats",
    "tool_error_counts",
    "score",
)

# One structured call of a gpt turn; arguments as a JSON string (always a JSON object's text).
TOOL_CALL: dict[str, Any] = {"id": STRING, "type": STRING, "function": {"name": STRING, "arguments": STRING}}

# One ShareGPT entry. ``tool_calls`` is on every entry: the calls of a gpt turn, else an empty list.
TURN: dict[str, Any] = {"from": STRING, "value": STRING, "tool_calls": [TOOL_CALL]}

# metadata.usage: what the prompt spent. Counts the endpoint did not report are null, not 0.
USAGE: dict[str, Any] = {
    "requests": INT,  # requests sent, failed attempts included (our own count)
    "calls": INT,  # answered calls (our own count)
    "prompt_tokens": INT,
    "completion_tokens": INT,
    "reasoning_tokens": INT,
    "cost_usd": FLOAT,
    "retries": INT,
    "rate_limited": INT,
    "providers": [STRING],  # null when the endpoint named none
}

METADATA: dict[str, Any] = {
    "batch_num": INT,
    "timestamp": "timestamp[s]",  # ISO 8601 text, seconds; JSON readers (pyarrow) infer a timestamp
    "model": STRING,  # as requested (--model)
    "served_model": STRING,  # the last answered response's ``model``; null when the endpoint sent none
    "stop_reason": STRING,
    "duration_s": FLOAT,
    "sandbox": STRING,
    "isolation": STRING,
    "sandbox_start_wait_s": FLOAT,
    "sandbox_start_s": FLOAT,
    "sandbox_start_blocked_s": FLOAT,
    "sandbox_stop_s": FLOAT,
    "sandbox_stop_background": BOOL,  # whether the stop ran after the outcome was sent
    "prompt_tokens": INT,
    "completion_tokens": INT,
    "usage": USAGE,
    "toolsets_sampled": [STRING],  # what the distribution drew (``toolsets_used`` is what was offered)
    "image": STRING,  # the row's image (null: the backend's default)
    "cwd": STRING,
    "row_key": STRING,  # the row's identity, as resume and merge use it
    "row_id": STRING,  # the dataset row's ``id``, as a string; null when it has none
    "row_fields": STRING,  # the row's other fields as one JSON object's text; "{}" when none
    # Records of versions before these fields lack them: readers take a missing sample_index as 0 and
    # a missing row_* field as null (the row asked for nothing of its own).
    "sample_index": INT,  # which sample of its row this record is (--samples_per_prompt, ``samples``), from 0
    "row_toolsets": [STRING],  # the row's own ``toolsets`` (sorted); null: drawn from the distribution
    "row_tools": [STRING],  # the row's own ``tools`` allowlist (sorted); null: none
    "row_system_sha256": STRING,  # sha256 of the row's own ``system`` prompt; null: the row had none
    "row_max_turns": INT,  # the row's own ``max_turns``; null: --max_turns
    "max_turns": INT,  # the limit this sample ran with (the row's, else --max_turns)
    "tools_offered": [STRING],  # the tool names offered to the model, in the order offered
}

# The metadata fields that, with the prompt text, image and cwd, make a row's identity (resume, merge).
ROW_OPTION_FIELDS = ("row_toolsets", "row_tools", "row_system_sha256", "row_max_turns")

TOOL_STAT: dict[str, Any] = {"count": INT, "success": INT, "failure": INT}

# score: how the sample was judged (batchrun.scoring). In every record: an unjudged sample has
# value/passed null and scorer "none"; a scorer that broke has value/passed null and its error.
SCORE_PART: dict[str, Any] = {
    "scorer": STRING,
    "value": FLOAT,
    "passed": BOOL,
    "explanation": STRING,
    "error": STRING,
}
JUDGE_USAGE: dict[str, Any] = {
    "requests": INT,
    "calls": INT,
    "prompt_tokens": INT,
    "completion_tokens": INT,
    "cost_usd": FLOAT,
}
SCORE: dict[str, Any] = {
    "value": FLOAT,  # 0..1 (verify's partial credit, a judge's grade); null: not judged, or the scorer broke
    "passed": BOOL,
    "scorer": STRING,  # the scorers, comma-separated ("none": not judged)
    "explanation": STRING,
    "error": STRING,  # why a scorer gave no verdict (raised, timed out, bad judge reply); null: none
    "verify_exit_code": INT,  # the verify commands' last exit code (-1: timed out); null: no verify
    "verify_output": STRING,  # their output, its end kept (VERIFY_OUTPUT_CHARS); never shown to the model
    "judge_usage": JUDGE_USAGE,  # the judge model's calls, apart from the agent's metadata.usage
    "parts": [SCORE_PART],  # each scorer's own verdict; null when none ran
}


def conform_score(score: dict[str, Any] | None) -> dict[str, Any]:
    """A ``score`` with every key of :data:`SCORE`; none at all is the unjudged score."""
    if score is None:
        score = {"scorer": "none", "explanation": "not judged"}
    return conform(score, SCORE)


# Dataset fields the runner itself reads; every other field of a row travels in ``row_fields``. The
# per-row settings are recorded in their own typed fields (row_toolsets, ...), never also in row_fields.
ROW_RUN_FIELDS = (
    "prompt",
    "image",
    "docker_image",
    "cwd",
    "toolsets",
    "tools",
    "system",
    "max_turns",
    "samples",
)


def record_schema(tool_names: list[str]) -> dict[str, Any]:
    """The whole record's schema; ``tool_stats`` and ``tool_error_counts`` list every known tool."""
    return {
        "prompt_index": INT,
        "conversations": [TURN],
        "metadata": METADATA,
        "completed": BOOL,
        "partial": BOOL,
        "api_calls": INT,
        "toolsets_used": [STRING],
        "tool_stats": {name: TOOL_STAT for name in tool_names},
        "tool_error_counts": {name: INT for name in tool_names},
        "score": SCORE,
    }


def conform(value: Any, kind: Any) -> Any:
    """``value`` shaped as ``kind``: every struct key present (missing ones null), numbers of the column's type.

    Extra struct keys are dropped, so nothing outside the schema reaches a record.
    """
    if value is None:
        return None
    if isinstance(kind, dict):
        source = value if isinstance(value, dict) else {}
        return {key: conform(source.get(key), sub) for key, sub in kind.items()}
    if isinstance(kind, list):
        if not isinstance(value, (list, tuple)):
            return None
        return [conform(v, kind[0]) for v in value]
    if kind == FLOAT and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)  # 0 and 0.0 must not make two types of one column
    if kind == INT and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def normalize_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """Every metadata key present with its type; an empty providers list (element type unknown) is null."""
    meta = conform(metadata, METADATA)
    usage = meta.get("usage")
    if usage is not None and not usage.get("providers"):
        usage["providers"] = None
    return meta


def row_fields_text(fields: dict[str, Any] | None) -> str:
    """A row's extra fields as one JSON object's text (stable key order); ``"{}"`` when it has none.

    Never null: ``json.loads`` always works on it, and a run whose rows have no extra fields still
    gives the column its type (a column null in every record of a file has none for a JSON reader).
    """
    return json.dumps(fields or {}, ensure_ascii=False, sort_keys=True)


def row_id_text(fields: dict[str, Any] | None) -> str | None:
    """The row's ``id`` as a string (numbers too), or None."""
    value = (fields or {}).get("id")
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def features_yaml(spec: dict[str, Any], indent: int = 2) -> list[str]:
    """A schema (this module's notation) as the ``features:`` list of a Hugging Face dataset card."""
    pad = " " * indent
    lines = []
    for name, kind in spec.items():
        lines.append(f"{pad}- name: {name}")
        if isinstance(kind, str):
            lines.append(f"{pad}  dtype: {kind}")
        elif isinstance(kind, dict):
            lines += [f"{pad}  struct:", *features_yaml(kind, indent + 2)]
        elif isinstance(kind[0], str):
            lines.append(f"{pad}  list: {kind[0]}")
        else:
            lines += [f"{pad}  list:", *features_yaml(kind[0], indent + 2)]
    return lines


def run_card(run_name: str, tool_names: list[str]) -> str:
    """The dataset card written beside ``trajectories.jsonl``: ``load_dataset(run_dir)`` reads that file
    with this schema, so every column has its type even when it is null in every record of the run."""
    lines = [
        "---",
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        "    path: trajectories.jsonl",
        "dataset_info:",
        "  features:",
        *features_yaml(record_schema(tool_names), 2),
        "tags:",
        "- tool-use",
        "- agent-trajectories",
        "---",
        "",
    ]
    body = f"""# {run_name}

Agent trajectories written by batch-runner (ShareGPT `conversations` with structured `tool_calls`,
`metadata`, tool statistics over every known tool). `datasets.load_dataset("<this directory>")` reads
`trajectories.jsonl` with the schema above. For several runs at once, `batchrun.record.load_runs(DIR, ...)`,
or pass the schema: `load_dataset("json", data_files=[...], features=batchrun.record.record_features())`, or export them
together with `python batch_runner.py export RUN_DIR [RUN_DIR ...] --format=parquet --out=DIR`.
"""
    return "\n".join(lines) + "\n" + body


def row_option_fields(
    toolsets: tuple[str, ...] | None, tools: tuple[str, ...] | None, system: str | None, max_turns: int | None
) -> dict[str, Any]:
    """A row's own settings as the record's ``row_*`` metadata fields (the system prompt as its sha256)."""
    return {
        "row_toolsets": None if toolsets is None else sorted(toolsets),
        "row_tools": None if tools is None else sorted(tools),
        "row_system_sha256": None
        if system is None
        else hashlib.sha256(system.encode("utf-8", "surrogatepass")).hexdigest(),
        "row_max_turns": max_turns,
    }


def sample_index_of(fields: dict[str, Any]) -> int:
    """A record's (or outcome row's) sample index: records written before samples existed are sample 0."""
    value = fields.get("sample_index")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def run_tool_names(trajectories: Path) -> list[str]:
    """The tools a run's records count (the keys of ``tool_stats``, the same in every record of a run),
    from its first record; none for an empty file."""
    with trajectories.open("rb") as fh:
        for line in fh:
            try:
                stats = json.loads(line).get("tool_stats")
            except (ValueError, AttributeError):
                continue
            if isinstance(stats, dict):
                return list(stats)
    return []


def load_runs(*run_dirs: str | Path, split: str = "train", **kwargs: Any) -> Any:
    """The ``trajectories.jsonl`` of one or several runs as one ``datasets.Dataset``, typed by the record
    schema (a column null throughout one run still loads beside another run's values). ``tool_stats``
    and ``tool_error_counts`` list every tool any of the runs counts (null where a run did not know it).
    Other keyword arguments go to ``datasets.load_dataset`` (``cache_dir``, ``streaming``, ...)."""
    import datasets

    files = [Path(d) / "trajectories.jsonl" for d in run_dirs]
    if not files:
        raise ValueError("name at least one run directory")
    tools: dict[str, None] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (is {path.parent} a finished run's directory?)")
        tools.update(dict.fromkeys(run_tool_names(path)))
    return datasets.load_dataset(
        "json",
        data_files=[str(f) for f in files],
        split=split,
        features=record_features(list(tools)),
        **kwargs,
    )


def record_features(tool_names: list[str] | None = None) -> Any:
    """The schema as ``datasets.Features`` (imports ``datasets``; only readers call this).

    Pass it to ``datasets.load_dataset("json", data_files=[...], features=...)``: the loader otherwise
    infers the types from the first file, and a column that happens to be null in every record of that
    file (no row had an image, no endpoint reported reasoning tokens) has no type to cast the others to.
    """
    import datasets

    if tool_names is None:
        from batchrun.prompt.tools.registry import known_tool_names

        tool_names = known_tool_names()

    def feature(kind: Any) -> Any:
        if isinstance(kind, dict):
            return {k: feature(v) for k, v in kind.items()}
        if isinstance(kind, list):
            return datasets.List(feature(kind[0]))
        return datasets.Value(kind)

    return datasets.Features(feature(record_schema(tool_names)))
