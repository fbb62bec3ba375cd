"""The trajectory record: its fields and their types, defined once.

The writer (``batchrun.prompt.trajectory.build_record`` and ``batchrun.prompt.attempt``), the merge and
statistics (``batchrun.run.finish``), the exporter and the tests all take the schema from here, and
every reader of a saved record checks its shape with :func:`valid_record` / :func:`valid_outcome_row`.
The text convention inside ``conversations`` is ``batchrun.sharegpt``'s.

Every key is present in every record, whatever the backend, endpoint, toolsets or outcome, with one
type that JSON inference sees in every run: a value a run may lack is never ``null`` and never an
empty list (both have no type for a JSON reader, and ``datasets.load_dataset("json", data_files=[...])``
without ``features=`` then fails on whichever file comes second). It is written with its type and a
documented "none" value instead (``""``, ``0``, ``false``), or as JSON text (``row_toolsets``,
``usage.providers``, ``row_fields``), so any set of runs loads together, in any order, with plain
``datasets``. Two exceptions are inherent to the documented record: a run in which no prompt was
offered a tool or called one has ``toolsets_used``/``tool_calls`` empty throughout, and runs that know
different tools (plugins, MCP servers) have different ``tool_stats`` keys; :func:`load_runs` and the
run's card type both.

Types are written as data, without importing ``datasets``: ``"string"``, ``"int64"``, ``"float64"``,
``"bool"`` for a (nullable) value, a dict for a struct, a one-element list for a list of that type.
:func:`record_features` turns the schema into ``datasets.Features`` for readers that want it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.sharegpt import finite_number, first_human, parse_json

STRING, INT, FLOAT, BOOL = "string", "int64", "float64", "bool"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what an int64 column holds

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

# One structured call of a gpt turn; arguments as a JSON string (a JSON object's text in a kept sample,
# as the model wrote it).
TOOL_CALL: dict[str, Any] = {"id": STRING, "type": STRING, "function": {"name": STRING, "arguments": STRING}}

# One ShareGPT entry. ``tool_calls`` is on every entry: the calls of a gpt turn, else an empty list.
TURN: dict[str, Any] = {"from": STRING, "value": STRING, "tool_calls": [TOOL_CALL]}

# metadata.usage: what the prompt spent. A count the endpoint did not report is 0 and named in
# ``unreported`` (so 0 reported and 0 unknown stay apart without a column that may be null throughout).
USAGE: dict[str, Any] = {
    "requests": INT,  # requests sent, failed attempts included (our own count)
    "calls": INT,  # answered calls (our own count)
    "prompt_tokens": INT,
    "completion_tokens": INT,
    "reasoning_tokens": INT,
    # Of prompt_tokens: those the endpoint served from its prompt cache (OpenAI, OpenRouter, vLLM, LiteLLM,
    # llama.cpp: prompt_tokens_details.cached_tokens) and those it wrote to it (OpenRouter's cache_write_tokens,
    # Anthropic's cache_creation_input_tokens): each turn resends the conversation, so they say its cost.
    "cached_tokens": INT,
    "cache_write_tokens": INT,
    "cost_usd": FLOAT,
    "retries": INT,
    "rate_limited": INT,
    "providers": STRING,  # JSON text of the list of providers that served the calls; "[]" when none named
    "estimated_calls": INT,  # answered calls whose usage the endpoint did not report credibly: counted by the runner
    "unreported": STRING,  # JSON text of the list of the counts above no response reported; "[]" when none
}
USAGE_COUNTS = (
    "prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "cache_write_tokens", "cost_usd"
)  # fmt: skip

# Every ``metadata.stop_reason`` this version writes (batchrun.prompt.loop sets them; its REPLY_DISCARDS,
# from ``content_filter`` on, only in discarded.jsonl). Records of other versions may hold others: a
# reader checks a name against these and the ones its records hold (views.export's stop-reason flags).
STOP_REASONS = (
    "final_answer", "max_turns", "truncated", "context_limit", "invalid_tool_calls", "prompt_budget",
    "content_filter", "unknown_finish_reason", "missing_tool_calls", "secret_in_output", "refusal",
)  # fmt: skip

METADATA: dict[str, Any] = {
    "batch_num": INT,
    "timestamp": "timestamp[s]",  # ISO 8601 text, seconds; JSON readers (pyarrow) infer a timestamp
    "model": STRING,  # as requested (--model)
    "served_model": STRING,  # the last answered response's ``model``; "" when the endpoint sent none
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
    # What the distribution drew; a row that names its own toolsets or tools draws nothing and has the
    # toolsets it was given here (row_toolsets / row_tools say so). ``toolsets_used`` is what was offered.
    "toolsets_sampled": [STRING],
    "image": STRING,  # the row's own image; "" when it named none (part of the row's identity)
    "sandbox_image": STRING,  # the image the sandbox actually ran (the row's or --default_image); "" without images
    "cwd": STRING,  # the row's own cwd; "" when it named none
    "row_key": STRING,  # the row's identity, as resume and merge use it
    "row_id": STRING,  # the dataset row's ``id``, as a string; "" when it has none
    "row_fields": STRING,  # the row's other fields as one JSON object's text; "{}" when none
    # Records that lack these (other tools', and those from before format 1) or hold null are read as
    # written for a row that asked for nothing of its own: sample_index 0, no row_* settings.
    "sample_index": INT,  # which sample of its row this record is (--samples_per_prompt, ``samples``), from 0
    # How many earlier dataset rows held the same prompt text when it ran (its toolset draw and request
    # seeds derive from it): resume tells identical rows apart by it after rows moved. -1: not recorded.
    "occurrence": INT,
    "row_toolsets": STRING,  # JSON text of the row's own ``toolsets`` (sorted); "": drawn from the distribution
    "row_tools": STRING,  # JSON text of the row's own ``tools`` allowlist (sorted); "": none
    "row_system_sha256": STRING,  # sha256 of the row's own ``system`` prompt; "": the row had none
    "row_max_turns": INT,  # the row's own ``max_turns``; 0: --max_turns
    "max_turns": INT,  # the limit this sample ran with (the row's, else --max_turns)
    "tools_offered": [STRING],  # the tool names offered to the model, in the order offered
}

TOOL_STAT: dict[str, Any] = {"count": INT, "success": INT, "failure": INT}

# score: how the sample was judged (batchrun.scoring). In every record, typed: an unjudged sample has
# status "unscored" and scorer "none"; a scorer that broke has status "error" and its error (value 0.0 and
# passed false for both; read_score gives them back as None).
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
    "cached_tokens": INT,  # as metadata.usage's (0 also when the endpoint did not say)
    "cache_write_tokens": INT,
    # As metadata.usage's: JSON text of the list of the counts above that no answer of the judge reported
    # (each 0 then); "[]" when every one was, or no judge was asked.
    "unreported": STRING,
}
JUDGE_USAGE_COUNTS = tuple(k for k in USAGE_COUNTS if k in JUDGE_USAGE)  # in metadata.usage's order
# The record's score is typed in every record, as every column is (a null throughout one run would leave the
# column untyped there, and plain ``datasets`` fails on whichever run comes second): ``status`` says what
# the other fields mean. Code reads it through :func:`read_score`, which gives the nulls back.
SCORE_STATUSES = ("passed", "failed", "unscored", "error")  # unscored: not judged; error: a scorer broke
NO_VERIFY = -2  # score.verify_exit_code when no verify command ran (-1: one timed out)
SCORE: dict[str, Any] = {
    "status": STRING,  # passed | failed (a verdict), unscored (not judged), error (a scorer broke: no verdict)
    "value": FLOAT,  # 0..1 (verify's partial credit, a judge's grade); 0.0 without a verdict
    "passed": BOOL,  # true only for status passed
    "scorer": STRING,  # the scorers, comma-separated ("none": not judged)
    "explanation": STRING,
    "error": STRING,  # why a scorer gave no verdict (raised, timed out, bad judge reply); "" when none
    "verify_exit_code": INT,  # the verify commands' last exit code (-1: timed out; NO_VERIFY: none ran)
    "verify_output": STRING,  # their output, its end kept (VERIFY_OUTPUT_CHARS); never shown to the model
    "judge_usage": JUDGE_USAGE,  # the judge model's calls, apart from the agent's metadata.usage (0 when none)
    "parts": STRING,  # JSON text of each scorer's own verdict ({scorer, value, passed, explanation, error})
}
_UNJUDGED = {"scorer": "none", "explanation": "not judged"}


def conform_score(score: dict[str, Any] | None) -> dict[str, Any]:
    """The typed ``score`` of a record from what the scorers said (nulls where they gave no verdict);
    none at all is the unjudged score. A typed score comes back as it is."""
    sem = read_score(score) if isinstance(score, dict) else dict(_UNJUDGED)
    passed, value, error = sem.get("passed"), finite_number(sem.get("value")), sem.get("error")
    if isinstance(passed, bool):
        status = "passed" if passed else "failed"
        value = (1.0 if passed else 0.0) if value is None else value
    else:
        status, value = ("error" if error else "unscored"), 0.0
    code = sem.get("verify_exit_code")
    usage = sem.get("judge_usage") if isinstance(sem.get("judge_usage"), dict) else {}
    parts = [conform(p, SCORE_PART) for p in sem.get("parts") or [] if isinstance(p, dict)]
    return {
        "status": status,
        "value": value,
        "passed": status == "passed",
        "scorer": sem.get("scorer") if isinstance(sem.get("scorer"), str) else "none",
        "explanation": sem.get("explanation") if isinstance(sem.get("explanation"), str) else "",
        "error": error if isinstance(error, str) else "",
        "verify_exit_code": code if isinstance(code, int) and not isinstance(code, bool) else NO_VERIFY,
        "verify_output": sem.get("verify_output") if isinstance(sem.get("verify_output"), str) else "",
        "judge_usage": _typed_judge_usage(usage),
        "parts": json.dumps(parts, ensure_ascii=False),
    }


def _typed_judge_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """``score.judge_usage`` typed: a count no answer of the judge reported (None) is 0 and named in
    ``unreported``, as in metadata.usage (it was 0 alone: an endpoint that reports no cost read as free)."""
    typed = {k: usage.get(k) or EMPTY[kind] for k, kind in JUDGE_USAGE.items()}
    missing: set[str] = set()
    if isinstance(usage.get("unreported"), str):  # typed already: kept
        try:
            listed = parse_json(usage["unreported"])
        except ValueError:
            listed = []
        missing = {k for k in listed if isinstance(k, str)} if isinstance(listed, list) else set()
    elif usage.get("requests"):  # a judge was asked: what it did not say is unknown, not 0
        missing = {k for k in JUDGE_USAGE_COUNTS if finite_number(usage.get(k)) is None}
    typed["unreported"] = json.dumps([k for k in JUDGE_USAGE_COUNTS if k in missing])
    return typed


def in_unit_range(value: Any) -> bool:
    """A score value a verdict can have: a finite number from 0 to 1 (not a bool)."""
    number = finite_number(value)
    return number is not None and 0 <= number <= 1


def read_score(score: Any) -> dict[str, Any]:
    """What a record's ``score`` says, with null where there is no verdict: ``value`` and ``passed`` only
    for status passed or failed, ``error`` and ``verify_exit_code`` only when there is one, ``parts`` a
    list. A score without ``status`` (what the scorers return, before :func:`conform_score`) is read as is."""
    if not isinstance(score, dict):
        return {**_UNJUDGED, "status": "unscored", "value": None, "passed": None, "parts": []}
    if "status" not in score:
        return dict(score)
    judged = score.get("status") in ("passed", "failed")
    value, error = score.get("value"), score.get("error") or None
    if judged and not in_unit_range(value):  # written by a version that took any number (a verify's 7)
        judged, error = False, error or f"its score {value!r} is outside 0..1"
        score = {**score, "status": "error"}
    parts = score.get("parts")
    if isinstance(parts, str):
        try:
            parts = parse_json(parts)
        except ValueError:
            parts = []
    code = score.get("verify_exit_code")
    return {
        **score,
        "value": value if judged else None,
        "passed": score.get("passed") if judged else None,
        "error": error,
        "verify_exit_code": None if code == NO_VERIFY or not isinstance(code, int) else code,
        "parts": parts if isinstance(parts, list) else [],
    }


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
        return finite_number(value) if isinstance(value, int) else value  # 0 and 0.0: two types of one column
    if kind == INT and isinstance(value, (int, float)) and not isinstance(value, bool):
        # An integral float is the int; one no int64 column holds (10**30 in another tool's record) is no
        # value: kept, it failed the whole file's loading in datasets and pyarrow.
        whole = int(value) if isinstance(value, float) and value.is_integer() else value
        return whole if isinstance(whole, float) or INT64_MIN <= whole <= INT64_MAX else None
    return value


# The "none" value of a scalar column: what a record holds where the value does not apply or is unknown.
EMPTY: dict[str, Any] = {STRING: "", INT: 0, FLOAT: 0.0, BOOL: False, "timestamp[s]": None}
NAME_LIST_FIELDS = ("row_toolsets", "row_tools")  # JSON text of a sorted name list; "" for none


def names_text(value: Any) -> str:
    """A row's own name list (toolsets, tools) as a record writes it: JSON text of the sorted list, "" for none."""
    if isinstance(value, str):  # already written (a record read back and written again)
        return value
    if not isinstance(value, (list, tuple)):
        return ""
    return json.dumps(sorted(str(v) for v in value), ensure_ascii=False)


def names_of(value: Any) -> list[str] | None:
    """The inverse of :func:`names_text`; also reads a list or null, as failed.jsonl and discarded.jsonl
    rows hold them (side files, not training data, keep the row's own form)."""
    if value is None or value == "":
        return None
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, str):
        try:
            parsed = parse_json(value)
        except ValueError:
            return None
        if isinstance(parsed, list):
            return [str(v) for v in parsed]
    return None


def _typed_usage(usage: dict[str, Any]) -> dict[str, Any]:
    # A count that is no finite number (NaN, Infinity, text, in a record another tool wrote or a hand
    # edited) is not reported: kept, NaN went out in an export's JSON lines, which strict readers
    # (datasets, pyarrow) refuse whole.
    # An integer no int64 column holds is none either (conform's None).
    usage = {
        k: v
        for k, v in usage.items()
        if USAGE.get(k) not in (INT, FLOAT)
        or (finite_number(v) is not None and conform(v, USAGE[k]) is not None)
    }
    missing = {k for k in USAGE_COUNTS if usage.get(k) is None}
    if isinstance(usage.get("unreported"), str):  # typed already (the recorder types it again): keep it
        try:
            missing |= {k for k in parse_json(usage["unreported"]) if isinstance(k, str)}
        except (ValueError, TypeError):
            pass
    unreported = [k for k in USAGE_COUNTS if k in missing]  # one order: typing twice changes nothing
    providers = usage.get("providers")
    if not isinstance(providers, str):
        # A list as the loop counts them; anything else (a 5, in another tool's record) names none.
        names = providers if isinstance(providers, (list, tuple)) else []
        providers = json.dumps([str(p) for p in names], ensure_ascii=False)
    typed = {k: (EMPTY[kind] if usage.get(k) is None else usage[k]) for k, kind in USAGE.items()}
    typed["providers"] = providers
    typed["unreported"] = json.dumps(unreported)
    return typed


def normalize_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """Every metadata key present with its type, none of them null (see the module's docstring):
    unknown scalars take their column's "none" value, row name lists and providers become JSON text."""
    raw = dict(metadata)
    for name in NAME_LIST_FIELDS:
        raw[name] = names_text(raw.get(name))
    raw["usage"] = _typed_usage(raw.get("usage") if isinstance(raw.get("usage"), dict) else {})
    meta = conform(raw, METADATA)
    meta["occurrence"] = occurrence_of(raw)
    if meta["occurrence"] is None:
        meta["occurrence"] = UNKNOWN_OCCURRENCE  # 0 is a row's occurrence: a record without one says so
    for key, kind in METADATA.items():
        if meta[key] is None:
            meta[key] = [] if isinstance(kind, list) else EMPTY.get(kind) if isinstance(kind, str) else None
    return meta


_SCALAR_TYPES = {STRING: str, INT: int, FLOAT: float, BOOL: bool}
# Every ``usage.unreported`` text :func:`_typed_usage` writes: the counts' names in their one order.
_UNREPORTED_TEXTS = frozenset(
    json.dumps([k for i, k in enumerate(USAGE_COUNTS) if mask >> i & 1])
    for mask in range(1 << len(USAGE_COUNTS))
)


def _struct_check(kind: dict[str, Any]) -> Callable[[Any], bool]:
    """A check that a value is exactly of the struct ``kind``'s shape and types: no key missing or extra,
    no null (but a timestamp's), ints within int64, floats finite. Made once per schema, flat: it runs
    for every record a merge copies."""
    by_type: dict[type, list[str]] = {str: [], int: [], float: [], bool: []}
    stamps: list[str] = []
    lists: list[tuple[str, type]] = []
    structs: list[tuple[str, Callable[[Any], bool]]] = []
    for key, sub in kind.items():
        if isinstance(sub, dict):
            structs.append((key, _struct_check(sub)))
        elif isinstance(sub, list) and sub[0] in _SCALAR_TYPES and _SCALAR_TYPES[sub[0]] in (str, bool):
            lists.append((key, _SCALAR_TYPES[sub[0]]))
        elif sub in _SCALAR_TYPES:
            by_type[_SCALAR_TYPES[sub]].append(key)
        elif sub == "timestamp[s]":
            stamps.append(key)
        else:  # a kind this check was not written for: never claim typed
            return lambda value: False
    size = len(kind)
    strs, ints, floats, bools = by_type[str], by_type[int], by_type[float], by_type[bool]

    def check(value: Any) -> bool:
        if type(value) is not dict or len(value) != size:
            return False
        try:
            for key in strs:
                if type(value[key]) is not str:
                    return False
            for key in ints:
                v = value[key]
                if type(v) is not int or not INT64_MIN <= v <= INT64_MAX:
                    return False
            for key in floats:
                v = value[key]
                if type(v) is not float or not math.isfinite(v):
                    return False
            for key in bools:
                if type(value[key]) is not bool:
                    return False
            for key in stamps:
                v = value[key]
                if v is not None and type(v) is not str:
                    return False
            for key, item in lists:
                v = value[key]
                if type(v) is not list or any(type(x) is not item for x in v):
                    return False
            for key, sub_check in structs:
                if not sub_check(value[key]):
                    return False
        except KeyError:
            return False
        return True

    return check


_METADATA_TYPED = _struct_check(METADATA)


def metadata_typed(metadata: Any) -> bool:
    """Whether ``metadata`` is typed already: True only when :func:`normalize_metadata` would give it back
    unchanged (every record the recorder writes), so a reader can skip building the typed copy to compare.
    False says nothing: a record of another tool or version may still be typed (normalize to know)."""
    return (
        _METADATA_TYPED(metadata)
        and metadata["usage"]["unreported"] in _UNREPORTED_TEXTS
        and metadata["occurrence"] >= UNKNOWN_OCCURRENCE  # another negative one is made -1
    )


def identity_options(fields: dict[str, Any]) -> dict[str, Any]:
    """A record's (or outcome row's) ``row_*`` fields in the form the row's identity is computed from:
    lists or None, None where the row set nothing (the records' "" and 0, the outcome rows' null)."""
    turns = fields.get("row_max_turns")
    sha = fields.get("row_system_sha256")
    return {
        "row_toolsets": names_of(fields.get("row_toolsets")),
        "row_tools": names_of(fields.get("row_tools")),
        "row_system_sha256": sha or None,
        "row_max_turns": turns or None,
    }


def optional_text(value: Any) -> str | None:
    """A record's image or cwd for the row's identity: "" (a record's none) and null (an outcome row's) are None."""
    return value or None


def row_fields_text(fields: dict[str, Any] | None) -> str:
    """A row's extra fields as one JSON object's text (stable key order); ``"{}"`` when it has none.

    Never null: ``json.loads`` always works on it, and a run whose rows have no extra fields still
    gives the column its type (a column null in every record of a file has none for a JSON reader).
    """
    return json.dumps(fields or {}, ensure_ascii=False, sort_keys=True)


def row_id_text(fields: dict[str, Any] | None) -> str | None:
    """The row's ``id`` as a string (numbers too), or None (written as "")."""
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
or pass the schema: `load_dataset("json", data_files=[...], features=batchrun.record.record_features({json.dumps(tool_names, ensure_ascii=False)}))`, or export them
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


UNKNOWN_OCCURRENCE = -1  # metadata.occurrence of a record written before the field existed


def occurrence_of(fields: dict[str, Any]) -> int | None:
    """A record's metadata's (or outcome row's) ``occurrence``: how many earlier dataset rows held its
    prompt text when it ran; None when it does not say (written before the field existed, or -1)."""
    value = fields.get("occurrence")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def sample_index_of(fields: dict[str, Any]) -> int:
    """A record's (or outcome row's) sample index; one that names none (another tool's record) is sample 0."""
    value = fields.get("sample_index")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


# ----------------------------------------------------------------------------- a record read back
# The shape every reader of a saved record (merge, resume, statistics, checkpoint, the views) relies on.


def is_tool_failure(content: str) -> bool:
    """Whether a tool result counts as a failure in ``tool_stats``, by SPEC's rule: non-null ``error`` (also nested in ``content``), ``success: false``, or error-like text."""
    try:
        data = parse_json(content)
    except (ValueError, TypeError):
        text = (content or "").strip()
        return not text or text.lower().startswith("error:")
    if isinstance(data, dict):
        if data.get("error") is not None or data.get("success") is False:
            return True
        inner = data.get("content")
        if isinstance(inner, dict) and (inner.get("error") is not None or inner.get("success") is False):
            return True
    return False


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _identity_fields_ok(fields: dict[str, Any]) -> bool:
    """The row_* identity fields and sample_index, where present, have their types (absent: none of its own)."""

    def names(value: Any) -> bool:
        if value is None or value == "":
            return True
        if isinstance(value, str):  # JSON text of a name list, as records write it
            return names_of(value) is not None
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    turns, sample = fields.get("row_max_turns"), fields.get("sample_index")
    return (
        names(fields.get("row_toolsets"))
        and names(fields.get("row_tools"))
        and _optional_str(fields.get("row_system_sha256"))
        and (turns is None or _count(turns))
        and (sample is None or _count(sample))
    )


def valid_record(rec: Any) -> bool:
    """Whether a line read back from a batch file has the shape every reader relies on.

    Valid JSON of the wrong shape (``null``, a list, ``"conversations": "x"``, ``"tool_stats": 5``)
    is skipped and counted like a torn line, by merge, resume, statistics, checkpoint and report.
    """
    if not isinstance(rec, dict):
        return False
    conv = rec.get("conversations")
    if not isinstance(conv, list) or not conv:
        return False
    for turn in conv:
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
            return False
        if not isinstance(turn.get("value"), str):
            return False
        calls = turn.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list)
            and all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                for c in calls
            )
        ):
            return False
    if first_human(conv) is None:
        return False
    stats = rec.get("tool_stats", {})
    if not isinstance(stats, dict):
        return False
    # A plain loop: a record counts every known tool (~40), and two nested generators over them were a
    # quarter of what merging a run cost beside parsing it.
    for s in stats.values():
        if not isinstance(s, dict):
            return False
        for k in ("count", "success", "failure"):
            v = s.get(k, 0)
            if v.__class__ is not int or v < 0:  # _count: bool is no count
                return False
    meta = rec.get("metadata", {})
    if not isinstance(meta, dict) or not isinstance(meta.get("usage", {}), dict):
        return False
    if not (
        _optional_str(meta.get("image")) and _optional_str(meta.get("cwd")) and _identity_fields_ok(meta)
    ):
        return False
    index, calls_made = rec.get("prompt_index"), rec.get("api_calls", 0)
    return (index is None or _count(index)) and (calls_made is None or _count(calls_made))


def valid_outcome_row(row: Any, field: str) -> bool:
    """A discarded.jsonl (``field="reason"``) or failed.jsonl (``"error_class"``) row of the right shape."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("prompt"), str)
        and isinstance(row.get(field), str)
        and _optional_str(row.get("image"))
        and _optional_str(row.get("cwd"))
        and _identity_fields_ok(row)
        and (row.get("record") is None or valid_record(row["record"]))
        and isinstance(row.get("usage", {}), dict)
    )


# A discarded.jsonl row's field: the --rerun_discarded round that wrote it (absent: written by a run
# without the flag, or by a version before rounds). checkpoint.json's key of the same name holds the
# latest round, {"round": N, "finished": bool} (batchrun.run.resume.latest_round).
ROUND_FIELD = "rerun_round"


def round_of(row: dict[str, Any]) -> int | None:
    """The rerun round a discarded.jsonl row was written in (None: none, or another shape)."""
    value = row.get(ROUND_FIELD)
    return value if _count(value) and value > 0 else None


def run_tool_names(trajectories: Path) -> list[str]:
    """The tools a run's records count (the keys of ``tool_stats``, the same in every record of a run),
    from its first record; none for an empty file."""
    with trajectories.open("rb") as fh:
        for line in fh:
            try:
                stats = parse_json(line).get("tool_stats")
            except (ValueError, AttributeError):
                continue
            if isinstance(stats, dict):
                return list(stats)
    return []


def typed_record(rec: dict[str, Any], tool_names: list[str]) -> dict[str, Any]:
    """A record read back, in the schema of today: only the record's own top-level keys (other tools add
    theirs, e.g. Hermes' compressor its ``compression_metrics``), every key present with its type (a record
    that holds null or lists where the schema has "" or JSON text, as other tools may write, is typed)."""
    own = {key: rec.get(key) for key in RECORD_FIELDS}
    if isinstance(own["metadata"], dict):
        own["metadata"] = normalize_metadata(own["metadata"])
    return conform(own, record_schema(tool_names))


def _run_records(sources: list[tuple[str, str, str]], tool_names: tuple[str, ...]) -> Any:
    """Each (file, run name, stamp)'s records, typed. The stamp (size and mtime) only changes the
    generator's fingerprint, so a file that grew is read again instead of coming from the cache."""
    for path, run_name, _stamp in sources:
        with open(path, "rb") as fh:
            for line in fh:
                try:
                    rec = parse_json(line)
                except ValueError:
                    continue  # a torn line: every reader skips it
                if isinstance(rec, dict) and isinstance(rec.get("conversations"), list):
                    yield {**typed_record(rec, list(tool_names)), "run_name": run_name}


def load_runs(*run_dirs: str | Path, split: str = "train", **kwargs: Any) -> Any:
    """The ``trajectories.jsonl`` of one or several runs as one ``datasets.Dataset``, typed by the record
    schema, with a ``run_name`` column (the directory's name: rows of two runs share prompt indices).

    ``tool_stats`` and ``tool_error_counts`` list every tool any of the runs counts (null where a run did
    not know it); top-level keys that other tools added are left out; a run with no trajectory (every
    prompt failed or was discarded) adds no row, and runs with none at all give an empty dataset.
    ``streaming=True`` gives an ``IterableDataset``; other keyword arguments (``cache_dir``, ...) go to
    ``datasets.Dataset.from_generator``."""
    import datasets

    paths = [Path(d) / "trajectories.jsonl" for d in run_dirs]
    if not paths:
        raise ValueError("name at least one run directory")
    tools: dict[str, None] = {}
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (is {path.parent} a finished run's directory?)")
        tools.update(dict.fromkeys(run_tool_names(path)))
    features = record_features(list(tools))
    features["run_name"] = datasets.Value("string")
    gen_kwargs = {
        "sources": [
            (str(p), p.parent.resolve().name, f"{p.stat().st_size}:{p.stat().st_mtime_ns}") for p in paths
        ],
        "tool_names": tuple(tools),  # a tuple: datasets shards generators over their list arguments
    }
    if kwargs.pop("streaming", False):
        return datasets.IterableDataset.from_generator(_run_records, features=features, gen_kwargs=gen_kwargs)
    if not any(True for _ in _run_records(**gen_kwargs)):
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features, split=split)
    return datasets.Dataset.from_generator(
        _run_records, features=features, gen_kwargs=gen_kwargs, split=split, **kwargs
    )


def record_features(tool_names: list[str]) -> Any:
    """The schema as ``datasets.Features`` for records that count ``tool_names`` in ``tool_stats``
    (imports ``datasets``; only readers call this). A run's own names: :func:`run_tool_names`; every
    installed tool's: ``batchrun.prompt.tools.catalog.known_tool_names()``.

    Pass it to ``datasets.load_dataset("json", data_files=[...], features=...)``: the loader otherwise
    infers the types from the first file, and a column that happens to be null in every record of that
    file (no row had an image, no endpoint reported reasoning tokens) has no type to cast the others to.
    """
    import datasets

    def feature(kind: Any) -> Any:
        if isinstance(kind, dict):
            return {k: feature(v) for k, v in kind.items()}
        if isinstance(kind, list):
            return datasets.List(feature(kind[0]))
        return datasets.Value(kind)

    return datasets.Features(feature(record_schema(tool_names)))
