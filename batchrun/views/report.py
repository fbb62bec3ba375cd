"""An HTML report of a run: ``report.html`` in the run directory, one self-contained file.

    python -m batchrun.views.report data/<run_name> [--max-trajectories 500]

Every file of the run is read as a stream, one record at a time; only a few numbers per record
(turns, tokens, cost) and the first ``max_trajectories`` conversations are kept, so a run of
100,000 trajectories needs little memory. The page needs no network: CSS, JavaScript and the
SVG charts are inline, and the conversations travel as JSON in which ``<`` never appears.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import html
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchrun.identity import Line, kept_line, lines_matter, record_sample, superseded_discards
from batchrun.record import is_tool_failure, read_score, valid_outcome_row, valid_record
from batchrun.run.run_dir import RUN_FILES, check_run_dir, holds_run
from batchrun.scoring import (
    RunScores,
    copied_rows_of,
    interval_clusters,
    line_row,
    of_rows,
    planned_figures,
    wanted_from_duplicates,
)
from batchrun.sharegpt import (
    finite_value,
    first_human,
    parse_json,
    reasoning_counts,
    tools_text,
)
from batchrun.storage import (
    PARTIAL_LINE,
    WriteError,
    batch_files,
    iter_jsonl,
    read_json_object,
    write_parts_atomic,
)
from batchrun.views.flags import ViewParser
from batchrun.views.status import local_alive

DEFAULT_MAX_TRAJECTORIES = 500
MAX_TEXT_CHARS = 20_000  # one turn's text in the browsable list; the JSONL files hold it whole
# A tool's name in the browsable list: a model's hallucinated name can be a whole reply long (tens of MB),
# and the list shows it three times (the sample's tools, the call, the result), each uncut before.
MAX_NAME_CHARS = 200
REPORT_NAME = "report.html"

_THINK_RE = re.compile(r"^<think>\n?(.*?)\n?</think>\n?", re.DOTALL)
_TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>\n?", re.DOTALL)
_TOOL_RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


# ----------------------------------------------------------------------------- reading


def trajectory_sources(run_dir: Path) -> tuple[list[Path], bool]:
    """The files holding the run's trajectories, and whether they are the merged output.

    During a run (or after a crash) batch files are newer than ``trajectories.jsonl``; then the
    batch files are read, which still include what the final merge would drop.
    """
    batches = sorted(
        (p for p in run_dir.glob("batch_*.jsonl") if re.fullmatch(r"batch_\d+\.jsonl", p.name)),
        key=lambda p: int(p.stem.split("_")[1]),
    )
    merged = run_dir / "trajectories.jsonl"
    if merged.is_file() and all(p.stat().st_mtime <= merged.stat().st_mtime for p in batches):
        return [merged], True
    return batches, not batches


# The few short JSON list texts every record repeats ("[]", ...), each read once.
_JSON_LISTS: dict[str, tuple[Any, ...]] = {}


def _json_list(value: Any) -> list[Any]:
    """A record's JSON-text list field (``usage.providers``, ``usage.unreported``); [] for anything else."""
    if not isinstance(value, str):
        return []
    known = _JSON_LISTS.get(value)
    if known is not None:
        return list(known)
    try:
        parsed = parse_json(value)
    except ValueError:
        return []
    if not isinstance(parsed, list):
        return []
    if len(value) <= 256 and len(_JSON_LISTS) < 4096:
        _JSON_LISTS[value] = tuple(parsed)
    return parsed


def record_usage(rec: dict[str, Any]) -> dict[str, Any]:
    """Tokens and cost of one record: ``metadata.usage`` when present, else the flat ``metadata`` counts
    (every record has both; records of other tools may have only the flat ones)."""
    meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
    usage = meta.get("usage") if isinstance(meta.get("usage"), dict) else {}

    unreported = _json_list(usage.get("unreported"))  # counts written as 0 that no response reported

    def pick(key: str) -> float | None:
        if key in unreported:
            return None
        value = finite_value(usage.get(key))
        return value if value is not None else finite_value(meta.get(key))

    prompt, completion = pick("prompt_tokens"), pick("completion_tokens")
    providers = usage.get("providers")
    if isinstance(providers, str):  # JSON text of the list, as records write it now
        providers = _json_list(providers)
    if isinstance(providers, dict):  # {name: calls}: the names are what the report counts
        providers = list(providers)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "tokens": None if prompt is None and completion is None else (prompt or 0) + (completion or 0),
        "reasoning_tokens": pick("reasoning_tokens"),
        "cached_tokens": pick("cached_tokens"),
        "cache_write_tokens": pick("cache_write_tokens"),
        "cost_usd": pick("cost_usd"),
        "retries": finite_value(usage.get("retries")),
        "rate_limited": finite_value(usage.get("rate_limited")),
        "providers": [p for p in providers if isinstance(p, str)] if isinstance(providers, list) else [],
    }


@dataclasses.dataclass
class Spend:
    """Token and dollar totals over a set of records."""

    records: int = 0
    with_tokens: int = 0
    prompt_tokens: float = 0
    completion_tokens: float = 0
    reasoning_tokens: float = 0
    cached_tokens: float = 0  # of prompt_tokens: served from the endpoint's prompt cache
    cache_write_tokens: float = 0  # of prompt_tokens: written to it (Anthropic bills them above the rest)
    cost_usd: float = 0.0
    retries: float = 0
    rate_limited: float = 0

    def add(self, u: dict[str, Any]) -> None:
        self.records += 1
        self.with_tokens += u["tokens"] is not None
        for key in (
            "prompt_tokens",
            "completion_tokens",
            "reasoning_tokens",
            "cached_tokens",
            "cache_write_tokens",
            "cost_usd",
            "retries",
            "rate_limited",
        ):
            setattr(self, key, getattr(self, key) + (u[key] or 0))


# sum() of floats is compensated (Neumaier's) from Python 3.12: a row's mean score adds as it does.
_COMPENSATED_SUM = sys.version_info >= (3, 12)


@dataclasses.dataclass(slots=True)
class RowScores:
    """A row's line in the per-row table: samples with a verdict, passes, samples without one, and its
    scores' count and sum (``total`` plus ``carry``, added as ``sum()`` adds a list of them)."""

    n: int = 0
    line: int | None = None  # the dataset line (1-based) of its first sample, shown for a row of copied lines
    passes: int = 0
    no_verdict: int = 0
    values: int = 0
    total: float = 0.0
    carry: float = 0.0

    def add_value(self, x: float) -> None:
        if self.values and _COMPENSATED_SUM:
            t = self.total + x
            self.carry += (self.total - t) + x if abs(self.total) >= abs(x) else (x - t) + self.total
            self.total = t
        else:
            self.total = 0.0 + x if not self.values else self.total + x
        self.values += 1

    def mean(self) -> float | None:
        if not self.values:
            return None
        total = self.total + self.carry if self.carry and math.isfinite(self.carry) else self.total
        return total / self.values


@dataclasses.dataclass
class ScoresSeen:
    """The scores section's figures, added one judged sample at a time: the samples judged, each row's
    line (by row label and key), how many samples had each score (the histogram's bins are made from
    them at the end), and the first failing samples and samples without a verdict, as many as the page
    lists (the ``max_items`` of each: the page lists the failing ones first), with their counts."""

    judged: int = 0
    rows: dict[tuple[str, str], RowScores] = dataclasses.field(default_factory=dict)
    values: collections.Counter[float] = dataclasses.field(default_factory=collections.Counter)
    # (row label, sample index, where it went, verdict, why, verify output, verify exit code)
    failing: list[tuple[str, int, str, str, str, Any, Any]] = dataclasses.field(default_factory=list)
    failing_count: int = 0
    unjudged: list[tuple[str, int, str, str, str, Any, Any]] = dataclasses.field(default_factory=list)
    unjudged_count: int = 0


@dataclasses.dataclass
class RunData:
    """What the report shows, gathered in one streaming pass over the run directory."""

    run_dir: Path
    max_items: int
    merged: bool = True
    manifest: dict[str, Any] | None = None
    statistics: dict[str, Any] | None = None
    status: dict[str, Any] | None = None
    trajectories: int = 0
    invalid_lines: int = 0
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    stop_reasons: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    discarded: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failed: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    tool_stats: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    turns_with_reasoning: int = 0
    turns_without_reasoning: int = 0
    turns: list[float] = dataclasses.field(default_factory=list)  # api_calls per trajectory
    tokens: list[float] = dataclasses.field(default_factory=list)
    costs: list[float] = dataclasses.field(default_factory=list)
    spend: Spend = dataclasses.field(default_factory=Spend)
    discarded_spend: Spend = dataclasses.field(default_factory=Spend)
    providers: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    items: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    discarded_items: int = 0
    failed_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    systems: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    system_keys: dict[str, str] = dataclasses.field(default_factory=dict)
    # The judged samples (kept and discarded) as the scores section shows them: counts, never every
    # sample (a score holds its explanation and verify output: 100,000 of them held hundreds of MB).
    scores: ScoresSeen = dataclasses.field(default_factory=lambda: ScoresSeen())
    # (row key, sample index) -> how many rows want it, as statistics.json's scores count them (None:
    # from its scores.duplicate_samples); and how often each is in ``scores`` already.
    wanted: dict[tuple[str, int], int] | None = None
    counted: collections.Counter[tuple[str, int]] = dataclasses.field(default_factory=collections.Counter)
    # The rows of ``wanted`` made of several lines (``copied_rows_of``: made at the first score), and how
    # many of each (row, check, sample) were met, so the per-row table has a line of each, as pass@k does.
    copied: set[str] | None = None
    copies: collections.Counter[tuple[str, int, int]] = dataclasses.field(default_factory=collections.Counter)
    # The same samples' figures (pass rate, interval, pass@k) from the records read, for a report of the
    # batch files: statistics.json is written at the end, so it is absent or an earlier invocation's.
    record_scores: RunScores | None = None
    # (row key, sample index, dataset line) of every kept record seen: a discard of that sample at that
    # line is superseded (it ran again and was kept), as statistics.json counts it; held only when
    # ``note_lines`` (discarded.jsonl holds rows: identity.lines_matter)
    kept_at: collections.Counter[Line] = dataclasses.field(default_factory=collections.Counter)
    note_lines: bool = True
    # discarded.jsonl's rows were handed in already (:func:`add_discard`, by the runner's statistics pass,
    # with its verdict on which stand): collect does not read the file
    discards_fed: bool = False


def collect(run_dir: Path, max_items: int = DEFAULT_MAX_TRAJECTORIES, kept: RunData | None = None) -> RunData:
    """Read every file of the run once, as streams. ``kept``: the merged trajectories already added
    (the runner's merge hands :func:`add_trajectory` each record as it writes trajectories.jsonl), so
    only the other files are read."""
    data = kept if kept is not None else RunData(run_dir=run_dir, max_items=max_items)
    max_items = data.max_items
    data.manifest = read_json_object(run_dir / "run_manifest.json")
    data.statistics = read_json_object(run_dir / "statistics.json")
    data.status = read_json_object(run_dir / "status.json")
    if data.wanted is None:
        section = (data.statistics or {}).get("scores")
        data.wanted = wanted_from_duplicates(
            section.get("duplicate_samples") if isinstance(section, dict) else None
        )
    if kept is None:
        data.note_lines = lines_matter(run_dir / "discarded.jsonl")
        sources, data.merged = trajectory_sources(run_dir)
        for path in sources:
            for rec in iter_jsonl(path):
                if not valid_record(rec):  # torn, or valid JSON of the wrong shape: skipped and counted
                    data.invalid_lines += 1
                else:
                    add_trajectory(data, rec)
        dropped = (data.statistics or {}).get("dropped_at_merge")
        if data.merged and isinstance(dropped, dict) and dropped.get("partial_excluded"):
            # The partial samples --exclude_partial left in the batch files only: judged all the same.
            for _, path in batch_files(run_dir):
                for rec in iter_jsonl(path, PARTIAL_LINE):
                    if valid_record(rec) and rec.get("partial") is True:
                        add_excluded(data, rec)
    if not data.discards_fed:
        # A sample discarded and run again (--rerun_discarded, a raised --stop_after_passes) counts by its
        # latest outcome, as statistics.json counts it; what every attempt spent counts all the same.
        stale = superseded_discards(run_dir / "discarded.jsonl", data.kept_at)
        for n, row in enumerate(iter_jsonl(run_dir / "discarded.jsonl")):
            add_discard(data, row, valid_outcome_row(row, "reason"), n in stale)
    for row in iter_jsonl(run_dir / "failed.jsonl"):
        if not valid_outcome_row(row, "error_class"):
            data.invalid_lines += 1
            continue
        data.failed[str(row.get("error_class") or "unknown")] += 1
        if len(data.failed_rows) < max_items:
            data.failed_rows.append(row)
    return data


def add_discard(data: RunData, row: Any, valid: bool, stale: bool) -> None:
    """One discarded.jsonl row (``valid``: of an outcome row's shape; ``stale``: it no longer stands for
    its sample, :func:`~batchrun.identity.superseded_discards`). The runner's statistics pass hands each
    row here as it reads them (:class:`~batchrun.run.finish.KeptFeed`), so the report does not read
    the file again; :func:`collect` does it otherwise."""
    if not valid:
        data.invalid_lines += 1
        return
    reason = str(row.get("reason") or "unknown")
    rec = row.get("record")
    if stale:
        if isinstance(rec, dict):
            data.discarded_spend.add(record_usage(rec))
        return
    data.discarded[reason] += 1
    if isinstance(rec, dict):
        add_score(data, rec, f"discarded: {reason}")
        data.discarded_spend.add(record_usage(rec))
        if isinstance(rec.get("conversations"), list):  # coverage counts every sample produced
            with_r, gpt_turns = reasoning_counts(rec["conversations"])
            data.turns_with_reasoning += with_r
            data.turns_without_reasoning += gpt_turns - with_r
        if data.discarded_items < data.max_items and isinstance(rec.get("conversations"), list):
            data.discarded_items += 1
            data.items.append(browsable(data, rec, "discarded", reason, record_usage(rec)))


EXCLUDED_PARTIAL = "excluded: partial (--exclude_partial)"


def add_score(data: RunData, rec: dict[str, Any], where: str) -> None:
    """A sample's score for the scores section (a record of a version before scores has none), unless
    its (row, sample) is there as often as the dataset wants it: the samples of statistics.json's
    scores (kept first; an old discard that --rerun_discarded ran again is not counted beside it)."""
    if not isinstance(rec.get("score"), dict):
        return
    try:
        key = record_sample(rec)
    except Exception:  # a discarded record of another shape: listed, as before
        key = None
    if key is not None:
        if data.counted[key] >= (data.wanted or {}).get(key, 1):
            return
        data.counted[key] += 1
    score = read_score(rec["score"])
    meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
    if key is not None and not data.merged:  # merged: statistics.json holds these figures (section_scores)
        if data.record_scores is None:
            data.record_scores = RunScores(str((data.manifest or {}).get("distribution") or ""), data.wanted)
        data.record_scores.add(rec, *key)
    human = next((t.get("value", "") for t in rec.get("conversations") or [] if t.get("from") == "human"), "")
    label = str(meta.get("row_id") or "") or " ".join(str(human).split())[:60]
    index = meta.get("sample_index") if isinstance(meta.get("sample_index"), int) else 0
    row_key, line = "" if key is None else key[0], None
    if data.copied is None:
        data.copied = copied_rows_of(data.wanted)
    if row_key in data.copied:
        # Lines of one prompt and settings (identical, or with other checks) are a row each, as pass@k
        # counts them: one line of the table mixed the samples judged against `7` with those against `8`.
        row_key = line_row(meta, row_key, key[1], data.copies)
        place = rec.get("prompt_index")
        line = place + 1 if isinstance(place, int) and not isinstance(place, bool) and place >= 0 else None
    add_judged(data.scores, data.max_items, label, index, where, score, row_key, line)


def add_judged(
    seen: ScoresSeen,
    max_items: int,
    label: str,
    index: int,
    where: str,
    sc: dict[str, Any],
    row_key: str,
    line: int | None = None,
) -> None:
    """One sample's score (read by ``read_score``) into the figures of the scores section: ``row_key`` is its
    row's (its line's: :func:`line_row`, for lines of one identity), ``line`` its dataset line then."""
    if sc.get("scorer") in (None, "none"):
        return
    seen.judged += 1
    # Per row by its identity, not its label: rows may share an id, or their prompts' first 60 characters.
    # A row's samples are those with a verdict, as the pass rate counts them; a scorer error is no failure
    # (4 timed-out verify commands read "4 samples, 0 passes": a row the model failed, that nothing judged).
    row = seen.rows.get((label, row_key))
    if row is None:
        row = seen.rows[(label, row_key)] = RowScores(line=line)
    verdict = isinstance(sc.get("passed"), bool)
    row.n += verdict
    row.passes += sc.get("passed") is True
    row.no_verdict += not verdict
    if isinstance(sc.get("value"), (int, float)):
        value = float(sc["value"])
        row.add_value(value)
        seen.values[value] += 1
    if sc.get("passed") is False:
        seen.failing_count += 1
        shown = seen.failing
    elif sc.get("passed") is None:
        seen.unjudged_count += 1
        shown = seen.unjudged
    else:
        return
    if len(shown) < max_items:
        verdict_text = "no verdict" if sc.get("passed") is None else f"score {sc.get('value')}"
        why = sc.get("error") or sc.get("explanation") or ""
        shown.append(
            (
                label,
                index,
                where,
                verdict_text,
                why[:200],
                sc.get("verify_output"),
                sc.get("verify_exit_code"),
            )
        )


def _outcome_and_stop(rec: dict[str, Any]) -> tuple[str, str]:
    outcome = "completed" if rec.get("completed") else "partial" if rec.get("partial") else "incomplete"
    meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
    return outcome, str(meta.get("stop_reason") or "not recorded")


def prepare_trajectory(rec: dict[str, Any]) -> dict[str, Any]:
    """A kept record's entry in the browsable list, made from the record alone (see :func:`item_of`):
    the runner makes it while the dispatch waits for outcomes, and hands it to :func:`add_trajectory`."""
    outcome, stop = _outcome_and_stop(rec)
    return item_of(rec, outcome, stop, record_usage(rec))


def note_kept(data: RunData, rec: dict[str, Any]) -> None:
    """A record in the batch files (kept, or partial and left out by --exclude_partial): a discard of
    its sample at its line ran again before it, and no longer counts."""
    if not data.note_lines:
        return
    line = kept_line(rec)
    if line is not None:
        data.kept_at[line] += 1


def add_excluded(data: RunData, rec: dict[str, Any]) -> None:
    """A partial sample --exclude_partial left in the batch files only: judged all the same."""
    add_score(data, rec, EXCLUDED_PARTIAL)
    note_kept(data, rec)


def add_trajectory(
    data: RunData,
    rec: dict[str, Any],
    prepared: dict[str, Any] | None = None,
    reasoning: tuple[int, int] | None = None,
) -> None:
    """Count a kept record, and list it while the list has room. ``prepared``: its
    :func:`prepare_trajectory`, made earlier from the same record (else it is made here if listed);
    ``reasoning``: its ``reasoning_counts``, when the caller has them (the merge counts them too)."""
    add_score(data, rec, "kept")
    note_kept(data, rec)
    data.trajectories += 1
    outcome, stop = _outcome_and_stop(rec)
    data.outcomes[outcome] += 1
    data.stop_reasons[stop] += 1
    for name, s in (rec.get("tool_stats") or {}).items():
        if isinstance(s, dict):
            # Most tools a record lists were never called: a falsy count adds 0, as below.
            if name in data.tool_stats and not (s.get("count") or s.get("success") or s.get("failure")):
                continue
            t = data.tool_stats.setdefault(name, {"count": 0, "success": 0, "failure": 0})
            for key in t:
                value = s.get(key)
                t[key] += value if type(value) is int else int(finite_value(value) or 0)
    with_r, gpt_turns = reasoning if reasoning is not None else reasoning_counts(rec["conversations"])
    data.turns_with_reasoning += with_r
    data.turns_without_reasoning += gpt_turns - with_r
    data.turns.append(finite_value(rec.get("api_calls")) or 0)
    usage = record_usage(rec)
    data.spend.add(usage)
    if usage["tokens"] is not None:
        data.tokens.append(usage["tokens"])
    if usage["cost_usd"] is not None:
        data.costs.append(usage["cost_usd"])
    data.providers.update(usage["providers"])
    if len(data.items) < data.max_items:
        data.items.append(bind_systems(data, prepared or item_of(rec, outcome, stop, usage)))


# ----------------------------------------------------------------------------- conversations


def _cut(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return text[:MAX_TEXT_CHARS] + f"\n… [{len(text) - MAX_TEXT_CHARS:,} more characters in the JSONL file]"


def _name(name: Any) -> str:
    text = str(name)
    if len(text) <= MAX_NAME_CHARS:
        return text
    return text[:MAX_NAME_CHARS] + f"… [{len(text):,} characters]"


def _pretty(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = parse_json(value)
        except ValueError:
            return value
        if isinstance(value, str):
            return value
    return json.dumps(value, indent=2, ensure_ascii=False)


def browsable(
    data: RunData, rec: dict[str, Any], outcome: str, reason: str, usage: dict[str, Any]
) -> dict[str, Any]:
    """A record in the compact form the page's script renders (short keys: the page holds hundreds)."""
    return bind_systems(data, item_of(rec, outcome, reason, usage))


def bind_systems(data: RunData, item: dict[str, Any]) -> dict[str, Any]:
    """``item`` (:func:`item_of`) with each system turn as a reference to the page's one copy of its
    text: the same preamble recurs in most records, and the page holds it once (numbered in the
    order the page first meets each)."""
    turns = [_system_ref(data, turn["v"]) if turn["k"] == "s" else turn for turn in item["t"]]
    return {**item, "t": turns}


def _system_ref(data: RunData, value: str) -> dict[str, Any]:
    key = data.system_keys.get(value)
    if key is None:
        key = data.system_keys[value] = f"s{len(data.systems)}"
        data.systems[key] = {"v": _cut(value), "tools": _offered_tools(value)}
    return {"k": "s", "ref": key}


def item_of(rec: dict[str, Any], outcome: str, reason: str, usage: dict[str, Any]) -> dict[str, Any]:
    """A record's entry in the browsable list from the record alone, its system turns still holding
    their text (:func:`bind_systems` makes them references)."""
    conv = rec["conversations"]
    used = {
        _name(n): s.get("count", 0)
        for n, s in (rec.get("tool_stats") or {}).items()
        if isinstance(s, dict) and s.get("count")
    }
    failures = sum(s.get("failure", 0) for s in (rec.get("tool_stats") or {}).values() if isinstance(s, dict))
    return {
        "i": rec.get("prompt_index"),
        "o": outcome,
        "r": reason,
        "n": rec.get("api_calls"),
        "tok": usage["tokens"],
        "usd": usage["cost_usd"],
        "tools": used,
        "tf": failures,
        "p": (first_human(conv) or "")[:300],
        "t": [turn for c in conv if isinstance(c, dict) for turn in [render_turn(c)] if turn],
    }


def render_turn(c: dict[str, Any]) -> dict[str, Any] | None:
    role, value = c.get("from"), c.get("value")
    value = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if role == "system":
        return {"k": "s", "v": value}  # made a reference by bind_systems
    if role == "human":
        return {"k": "h", "v": _cut(value)}
    if role == "gpt":
        return _gpt_turn(value, c.get("tool_calls"))
    if role == "tool":
        return _tool_turn(value)
    return {"k": "h", "v": _cut(f"[{role}] {value}")}


def _offered_tools(system: str) -> list[str]:
    found = tools_text(system)
    try:
        tools = parse_json(found) if found is not None else []
    except ValueError:
        return []
    return [t["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)]


def _gpt_turn(value: str, structured: Any) -> dict[str, Any]:
    think = _THINK_RE.match(value)
    rest = value[think.end() :] if think else value
    blocks = _TOOL_CALL_RE.findall(rest)
    text = _TOOL_CALL_RE.sub("", rest).strip()
    calls = []
    if isinstance(structured, list) and structured:
        for call in structured:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                calls.append({"n": _name(fn.get("name")), "a": _cut(_pretty(fn.get("arguments", "")))})
    else:
        for block in blocks:
            try:
                obj = parse_json(block)
                calls.append({"n": _name(obj.get("name")), "a": _cut(_pretty(obj.get("arguments")))})
            except (ValueError, AttributeError):
                calls.append({"n": "(unparsable call)", "a": _cut(block)})
    return {"k": "g", "th": _cut(think.group(1).strip()) if think else None, "v": _cut(text), "c": calls}


def _tool_turn(value: str) -> dict[str, Any]:
    results = []
    for block in _TOOL_RESPONSE_RE.findall(value):
        try:
            obj = parse_json(block)
        except ValueError:
            results.append({"n": "(unparsable result)", "ok": False, "v": _cut(block)})
            continue
        content = obj.get("content") if isinstance(obj, dict) else obj
        raw = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        name = obj.get("name") if isinstance(obj, dict) else None
        results.append(
            {"n": _name(name or "tool"), "ok": not is_tool_failure(raw), "v": _cut(_pretty(content))}
        )
    if not results:
        results.append({"n": "tool", "ok": not is_tool_failure(value), "v": _cut(value)})
    return {"k": "t", "r": results}


# ----------------------------------------------------------------------------- numbers and charts


# Invisible characters that reorder the text after them up to the end of its paragraph (U+202A-U+202E
# embeddings and overrides, U+2066-U+2069 isolates): a row id holding U+202E showed the report's own words
# after it in a failing sample's line reversed ("0.0 erocs · tpek · 0#"), and a row's digest in its table
# cell. Shown as their escapes, as the scorers' explanations show them; the JSONL files keep them.
_BIDI_CONTROL = re.compile("[\u202a-\u202e\u2066-\u2069]")


def esc(value: Any) -> str:
    text = _BIDI_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", str(value))
    return html.escape(text, quote=True)


def fmt_int(n: float) -> str:
    return f"{int(round(n)):,}"


def fmt_usd(x: float) -> str:
    if x == 0:
        return "$0"
    if abs(x) >= 1:
        return f"${x:,.2f}"
    return f"${x:.{max(2, 2 - math.floor(math.log10(abs(x))))}f}"


def fmt_compact(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}" if x != int(x) else str(int(x))


def fmt_pct(num: float, den: float) -> str:
    return f"{num / den:.1%}" if den else "–"


def json_for_script(obj: Any) -> str:
    """JSON safe inside ``<script>``: no ``<`` at all (so no ``</script>`` or ``<!--``), no U+2028/9."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for ch, rep in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(ch, rep)
    return text


def _nice_step(raw: float) -> float:
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def histogram(values: list[float], target_bins: int = 20) -> list[tuple[float, float, int]]:
    """Bins ``(low, high, count)`` of equal, round width; integers get whole-number bins."""
    return histogram_counts(collections.Counter(values), target_bins)


def histogram_counts(
    counts: collections.Counter[float], target_bins: int = 20
) -> list[tuple[float, float, int]]:
    """:func:`histogram` of the values counted: how many times each value was seen."""
    if not counts:
        return []
    lo, hi = min(counts), max(counts)
    integral = all(float(v).is_integer() for v in counts)
    if integral and hi - lo < 40:
        whole: collections.Counter[int] = collections.Counter()
        for v, c in counts.items():
            whole[int(v)] += c
        return [(v, v + 1, whole.get(v, 0)) for v in range(int(lo), int(hi) + 1)]
    if hi == lo:
        return [(lo, hi, sum(counts.values()))]
    width = _nice_step((hi - lo) / target_bins)
    if integral:
        width = max(1, math.ceil(width))
    # Bin i is [start + i w, start + (i + 1) w), the last one closed: a top value on a bin's edge (a
    # score of 1) is in the bin below it, not alone in one of its own. The small slack keeps float
    # division on the right side of an edge: 0.3 / 0.1 is 2.9999999999999996, 1.0 // 0.1 is 9.0.
    start = math.floor(lo / width + 1e-9) * width
    n = max(1, math.ceil((hi - start) / width - 1e-9))
    bins = [0] * n
    for v, c in counts.items():
        bins[min(n - 1, max(0, math.floor((v - start) / width + 1e-9)))] += c
    return [(round(start + i * width, 12), round(start + (i + 1) * width, 12), c) for i, c in enumerate(bins)]


def summary(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    n = len(s)
    return {
        "n": n,
        "sum": sum(s),
        "mean": sum(s) / n,
        "median": s[(n - 1) // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2,
        "p90": s[min(n - 1, math.ceil(0.9 * n) - 1)],
        "max": s[-1],
    }


def svg_hbars(rows: list[tuple[str, list[tuple[float, str]], str]], width: int = 720) -> str:
    """Horizontal bars: (label, [(value, css class) segments], text at the right end)."""
    if not rows:
        return ""
    rows = [(label if len(label) <= 40 else label[:39] + "…", segs, right) for label, segs, right in rows]
    label_w = min(300, max(90, 7 * max(len(label) for label, _, _ in rows) + 12))
    right_w, bar_h, gap = 170, 18, 8
    area = width - label_w - right_w
    top = max((sum(v for v, _ in segs) for _, segs, _ in rows), default=0) or 1
    height = len(rows) * (bar_h + gap) + gap
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">']
    for i, (label, segs, right) in enumerate(rows):
        y = gap + i * (bar_h + gap)
        out.append(f'<text class="lbl" x="{label_w - 8}" y="{y + 13}" text-anchor="end">{esc(label)}</text>')
        x = float(label_w)
        for value, cls in segs:
            w = area * value / top
            if w > 0:
                out.append(
                    f'<rect class="{cls}" x="{x:.1f}" y="{y}" width="{max(w, 1.5):.1f}" height="{bar_h}" rx="2">'
                    f"<title>{esc(label)}: {esc(fmt_int(value))}</title></rect>"
                )
            x += w
        out.append(f'<text class="val" x="{x + 6:.1f}" y="{y + 13}">{esc(right)}</text>')
    out.append("</svg>")
    return "".join(out)


def svg_histogram(
    bins: list[tuple[float, float, int]],
    unit: str,
    fmt=fmt_compact,
    width: int = 720,
    counted: str = "prompt",
) -> str:
    """Vertical bars, one per bin, labelled with the bin's lower bound (every k-th when crowded)."""
    if not bins:
        return ""
    left, bottom, top_pad, height = 44, 30, 18, 200
    plot_h = height - bottom - top_pad
    slot = min((width - left - 10) / len(bins), 64.0)  # a few wide bins look like blocks, not a histogram
    peak = max(c for _, _, c in bins) or 1
    every = max(1, math.ceil(len(bins) / 14))
    single = all(hi - lo == 1 for lo, hi, _ in bins)
    out = [
        f'<svg class="chart hist" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">'
    ]
    out.append(
        f'<line class="axis" x1="{left}" y1="{height - bottom}" x2="{left + slot * len(bins):.1f}" y2="{height - bottom}"/>'
    )
    out.append(f'<text class="tick" x="{left - 6}" y="{top_pad + 4}" text-anchor="end">{peak:,}</text>')
    for i, (lo, hi, c) in enumerate(bins):
        x = left + i * slot
        h = plot_h * c / peak
        span = fmt(lo) if single else f"{fmt(lo)}–{fmt(hi)}"
        title = f"{span} {unit}: {c:,} {counted}{'s' if c != 1 else ''}"
        out.append(
            f'<rect class="bar" x="{x + 1:.1f}" y="{height - bottom - h:.1f}" width="{max(slot - 2, 1):.1f}" '
            f'height="{h:.1f}"><title>{esc(title)}</title></rect>'
        )
        if c and slot >= 18:
            out.append(
                f'<text class="cnt" x="{x + slot / 2:.1f}" y="{height - bottom - h - 4:.1f}" text-anchor="middle">{c:,}</text>'
            )
        if i % every == 0:
            out.append(
                f'<text class="tick" x="{x + slot / 2:.1f}" y="{height - bottom + 16}" text-anchor="middle">{esc(fmt(lo))}</text>'
            )
    out.append("</svg>")
    return "".join(out)


# ----------------------------------------------------------------------------- page


def stat(key: str, value: str, label: str, sub: str = "") -> str:
    """A headline number; ``data-stat`` lets tests and scripts find it."""
    return (
        f'<div class="card"><div class="num" data-stat="{esc(key)}">{esc(value)}</div>'
        f'<div class="cap">{esc(label)}</div><div class="sub">{esc(sub)}</div></div>'
    )


def table(rows: list[tuple[Any, ...]], head: tuple[str, ...], cls: str = "") -> str:
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{"".join(f"<th>{esc(h)}</th>" for h in head)}</tr></thead><tbody>{body}</tbody></table>'


def section_outcomes(d: RunData) -> str:
    stats = d.statistics or {}
    dropped = stats.get("dropped_at_merge") if d.merged else None
    dropped = {k: v for k, v in dropped.items() if isinstance(v, int)} if isinstance(dropped, dict) else {}
    rows: list[tuple[str, str, int, str]] = []
    for outcome, cls in (("completed", "ok"), ("partial", "warn"), ("incomplete", "muted")):
        if d.outcomes[outcome]:
            rows.append(("trajectory", outcome, d.outcomes[outcome], cls))
    rows += [("discarded", r, n, "disc") for r, n in d.discarded.most_common()]
    rows += [("failed attempt", c, n, "bad") for c, n in d.failed.most_common()]
    rows += [("dropped at merge", k, n, "muted") for k, n in dropped.items() if n]
    cards = [
        stat(
            "trajectories",
            fmt_int(d.trajectories),
            "trajectories",
            f"{d.outcomes['completed']:,} completed · {d.outcomes['partial']:,} partial",
        ),
        stat(
            "discarded",
            fmt_int(sum(d.discarded.values())),
            "discarded",
            ", ".join(f"{k} {v:,}" for k, v in d.discarded.most_common(3)),
        ),
        stat(
            "failed",
            fmt_int(sum(d.failed.values())),
            "failed attempts",
            ", ".join(f"{k} {v:,}" for k, v in d.failed.most_common(3)),
        ),
        stat(
            "dropped",
            fmt_int(sum(dropped.values())),
            "dropped at merge",
            "" if d.merged else "not merged yet",
        ),
    ]
    if isinstance(stats.get("dataset_prompts"), int):
        # statistics.json's, as of its merge: read from the batch files, the report outlives it (a resume
        # killed mid-way said "0 left for --resume", the first invocation's figure, with samples left).
        left = stats.get("remaining_for_resume") if d.merged else None
        cards.append(
            stat(
                "dataset_prompts",
                fmt_int(stats["dataset_prompts"]),
                "prompts in dataset",
                f"{left:,} left for --resume" if isinstance(left, int) else "",
            )
        )
    chart = svg_hbars([(f"{kind}: {reason}", [(n, cls)], f"{n:,}") for kind, reason, n, cls in rows])
    stops = table(
        [(r, f"{n:,}", fmt_pct(n, d.trajectories)) for r, n in d.stop_reasons.most_common()],
        ("stop reason", "trajectories", "share"),
        "narrow stops",
    )
    detail = table(
        [(k, r, f"{n:,}") for k, r, n, _ in rows], ("outcome", "reason", "count"), "narrow outcomes"
    )
    return (
        f'<section id="outcomes"><h2>Outcomes</h2><div class="cards">{"".join(cards)}</div>{chart}'
        f'<div class="cols">{detail}{stops}</div>'
        '<p class="note">Failed attempts run again on <code>--resume</code>, so a prompt can be counted both as failed and as a trajectory.</p></section>'
    )


def section_tools(d: RunData) -> str:
    used = sorted(
        ((n, s) for n, s in d.tool_stats.items() if s["count"]), key=lambda kv: (-kv[1]["count"], kv[0])
    )
    if not used:
        return '<section id="tools"><h2>Tool calls</h2><p class="empty">No tool was called.</p></section>'
    chart = svg_hbars(
        [
            (
                n,
                [(s["success"], "ok"), (s["failure"], "bad")],
                f"{s['count']:,} calls · {fmt_pct(s['success'], s['count'])} ok",
            )
            for n, s in used
        ]
    )
    rows = [
        (n, f"{s['count']:,}", f"{s['success']:,}", f"{s['failure']:,}", fmt_pct(s["success"], s["count"]))
        for n, s in used
    ]
    unused = len(d.tool_stats) - len(used)
    return (
        f'<section id="tools"><h2>Tool calls</h2><p class="legend"><span class="sw ok"></span>succeeded '
        f'<span class="sw bad"></span>failed</p>{chart}'
        f"<details><summary>Table</summary>{table(rows, ('tool', 'calls', 'succeeded', 'failed', 'success rate'), 'narrow tools')}</details>"
        + (
            f'<p class="note">{unused} other known tool{"s" if unused != 1 else ""} never called.</p>'
            if unused
            else ""
        )
        + "</section>"
    )


def section_reasoning(d: RunData) -> str:
    w, wo = d.turns_with_reasoning, d.turns_without_reasoning
    no_reasoning = d.discarded.get("no_reasoning", 0)
    chart = (
        svg_hbars([("assistant turns", [(w, "ok"), (wo, "bad")], f"{fmt_pct(w, w + wo)} with reasoning")])
        if w + wo
        else ""
    )
    return (
        '<section id="reasoning"><h2>Reasoning coverage</h2><div class="cards">'
        + stat(
            "reasoning_coverage",
            fmt_pct(w, w + wo),
            "of assistant turns have reasoning (discarded samples included)",
            f"{w:,} with · {wo:,} without",
        )
        + stat("no_reasoning_discards", fmt_int(no_reasoning), "samples discarded for no reasoning")
        + f"</div>{chart}</section>"
    )


def section_usage(d: RunData) -> str:
    s, ds = d.spend, d.discarded_spend
    has_cost = any(c > 0 for c in d.costs) or ds.cost_usd > 0
    cards = [
        stat(
            "prompt_tokens",
            fmt_int(s.prompt_tokens),
            "prompt tokens",
            f"in {s.with_tokens:,} of {s.records:,} trajectories"
            + (f", {fmt_int(s.cached_tokens)} from the endpoint's cache" if s.cached_tokens else "")
            + (f", {fmt_int(s.cache_write_tokens)} written to it" if s.cache_write_tokens else ""),
        ),
        stat(
            "completion_tokens",
            fmt_int(s.completion_tokens),
            "completion tokens",
            f"{fmt_int(s.reasoning_tokens)} reasoning" if s.reasoning_tokens else "",
        ),
        stat(
            "cost_usd",
            fmt_usd(s.cost_usd) if has_cost else "–",
            "cost of trajectories",
            "" if has_cost else "no cost reported by the endpoint",
        ),
    ]
    if ds.records:
        cards.append(
            stat(
                "discarded_tokens",
                fmt_int(ds.prompt_tokens + ds.completion_tokens),
                "tokens spent on discarded samples",
                fmt_usd(ds.cost_usd) if has_cost else "",
            )
        )
    if s.retries or s.rate_limited:
        cards.append(
            stat(
                "retries",
                fmt_int(s.retries),
                "retried model calls",
                f"{fmt_int(s.rate_limited)} rate-limited (429)",
            )
        )
    providers = ""
    if d.providers:
        providers = "<h3>Providers</h3>" + table(
            [(p, f"{n:,}") for p, n in d.providers.most_common()],
            ("provider", "trajectories served"),
            "narrow providers",
        )
    this_run = (d.statistics or {}).get("this_run")
    run_usage = this_run.get("usage") if isinstance(this_run, dict) else None
    if isinstance(run_usage, dict):
        flat = [
            (k, fmt_usd(v) if k == "cost_usd" else fmt_int(v))
            for k, v in run_usage.items()
            if finite_value(v) is not None
        ]
        if flat:
            providers += "<h3>Last run, every model call (failed attempts included)</h3>" + table(
                flat, ("counter", "value"), "narrow kv run-usage"
            )
    return (
        '<section id="usage"><h2>Tokens and cost</h2><div class="cards">'
        + "".join(cards)
        + "</div>"
        + providers
        + '<p class="note">Failed attempts keep no record: their tokens are only in the last run\'s totals.</p></section>'
    )


def section_histograms(d: RunData) -> str:
    parts = ['<section id="histograms"><h2>Per prompt</h2>']
    specs = [
        ("turns", "Turns per prompt (model calls)", d.turns, "calls", fmt_compact),
        ("tokens", "Tokens per prompt (prompt + completion)", d.tokens, "tokens", fmt_compact),
    ]
    if any(c > 0 for c in d.costs):
        specs.append(("cost", "Cost per prompt", d.costs, "USD", fmt_usd))
    for key, title, values, unit, fmt in specs:
        parts.append(f'<div class="hist-block" id="hist-{key}"><h3>{esc(title)}</h3>')
        if not values:
            parts.append('<p class="empty">No values recorded.</p></div>')
            continue
        s = summary(values)
        missing = d.trajectories - s["n"]
        parts.append(
            f'<p class="hsum" data-hist="{key}" data-n="{s["n"]}">{s["n"]:,} trajectories · mean {esc(fmt(s["mean"]))} · '
            f"median {esc(fmt(s['median']))} · p90 {esc(fmt(s['p90']))} · max {esc(fmt(s['max']))} · total {esc(fmt(s['sum']))}"
            + (f" · {missing:,} without a value" if missing else "")
            + "</p>"
        )
        parts.append(svg_histogram(histogram(values), unit, fmt) + "</div>")
    return "".join(parts) + "</section>"


def section_settings(d: RunData) -> str:
    rows = [
        (k, json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v)
        for k, v in (d.manifest or {}).items()
    ]
    this_run = (d.statistics or {}).get("this_run")
    if isinstance(this_run, dict):
        for key in (
            "attempted",
            "api_calls",
            "duration_s",
            "skipped_for_budget",
            "rate_limit_pauses",
            "bad_dataset_lines",
        ):
            if key in this_run:
                rows.append((f"last run: {key}", str(this_run[key])))
    for key in ("sandbox", "isolation", "sandbox_network"):
        if (d.statistics or {}).get(key) is not None and key not in (d.manifest or {}):
            rows.append((key, str(d.statistics[key])))
    body = (
        table(rows, ("setting", "value"), "narrow kv settings")
        if rows
        else '<p class="empty">No run_manifest.json.</p>'
    )
    return f'<section id="settings"><h2>Run settings</h2>{body}</section>'


def section_scores(d: RunData) -> str:
    """Pass rate and pass@k (from statistics.json), a per-row table, the score histogram, and the
    failing samples with their verify output, one click away."""
    seen = d.scores
    if not seen.judged:
        return ""
    # The figures statistics.json holds; one it cannot read (a section of another shape) is left out.
    scores = (d.statistics or {}).get("scores")
    scores = scores if isinstance(scores, dict) else {}
    snapshot = ""
    if not d.merged and d.record_scores is not None:
        # Read from the batch files (a run going on, or killed): statistics.json is absent or an earlier
        # invocation's, whose pass rate and n this page showed beside the samples listed below it.
        scores = d.record_scores.summary()
        snapshot = (
            '<p class="note">From the samples recorded so far (statistics.json is written when the run '
            "ends): samples without an outcome yet are in none of these figures.</p>"
        )
    cards = []
    rate, ci, n = (
        finite_value(scores.get("pass_rate")),
        scores.get("pass_rate_95ci"),
        finite_value(scores.get("scored")),
    )
    if (
        rate is not None
        and n is not None
        and isinstance(ci, list)
        and len(ci) == 2
        and None not in map(finite_value, ci)
    ):
        lo, hi = ci
        # Several samples a row are not independent draws: statistics.json's interval is then clustered by row.
        clusters = interval_clusters(scores)
        by_rows = f" · clustered by {clusters:,} rows" if clusters else ""
        cards.append(
            stat("pass_rate", f"{rate:.1%}", "pass rate", f"95% CI {lo:.1%}–{hi:.1%} · n={n:,}{by_rows}")
        )
        # Beside it, never alone: the passes over every sample planned (a run whose other half failed
        # showed a pass rate of 100% and nothing lower). Computed here too, for a run older than the figure.
        planned = planned_figures(scores)
        if planned["samples_planned"] and planned["samples_planned"] != n:
            cards.append(
                stat(
                    "pass_rate_of_planned",
                    f"{planned['pass_rate_of_planned']:.1%}",
                    "passed of all planned",
                    f"{fmt_int(scores.get('passed', 0))} of {fmt_int(planned['samples_planned'])} samples: "
                    "scorer errors and samples without an outcome count as not passed",
                )
            )
    pass_at_k = scores.get("pass_at_k")
    for k, v in pass_at_k.items() if isinstance(pass_at_k, dict) else ():
        if finite_value(v) is not None:
            cards.append(stat(k, f"{v:.3f}", k, f"unbiased estimator{of_rows(scores, k)}"))
    if finite_value(scores.get("mean_score")) is not None:
        cards.append(stat("mean_score", f"{scores['mean_score']:.3f}", "mean score"))
    errors = finite_value(scores.get("scorer_errors")) or 0
    unscored = finite_value(scores.get("unscored")) or 0
    pending = finite_value(scores.get("samples_pending")) or 0
    # Says what its figure holds: it read "4 not judged · 1 scorer errors · 1 samples without an outcome",
    # the 4 being 3 unscored and 1 error, and the sample without an outcome none of them.
    cards.append(
        stat(
            "unscored",
            fmt_int(unscored + errors),
            "not judged",
            f"{fmt_int(unscored)} unscored (nothing to judge them by) · {fmt_int(errors)} scorer errors"
            + (
                f"; not counted here: {fmt_int(pending)} samples without an outcome (failed or not run)"
                if pending
                else ""
            ),
        )
    )
    shared = collections.Counter(label for label, _ in seen.rows)
    # A line of rows of one identity (copied lines: their key is the identity's, a slash, and the line's)
    # is named by its dataset line; other rows that share a label by their key's start.
    lines = collections.Counter((label, key.partition("/")[0]) for label, key in seen.rows)
    rows = []
    for (label, key), row in sorted(
        seen.rows.items(), key=lambda item: (item[0][0], item[1].line or 0, item[0][1])
    )[: d.max_items]:
        mean = row.mean()
        if shared[label] == 1:
            name = label
        elif lines[label, key.partition("/")[0]] > 1 and row.line is not None:
            name = f"{label} · line {row.line:,}"
        else:
            name = f"{label} · row {key[:8]}"
        rows.append(
            (
                name,
                row.n,
                row.passes,
                row.no_verdict,
                f"{mean:.3f}" if mean is not None else "–",
            )
        )
    rows_note = (
        f'<p class="note">The first {d.max_items:,} of {len(seen.rows):,} rows; all are counted above.</p>'
        if len(seen.rows) > d.max_items
        else ""
    )
    items = []
    listed = (seen.failing + seen.unjudged)[: d.max_items]
    for label, i, where, verdict, why, output, code in listed:
        body = f"<pre>{esc(output)}</pre>" if output else '<p class="note">No verify output.</p>'
        exit_note = "" if code is None else f" · exit {code}"
        items.append(
            f'<details class="failing"><summary><b>{esc(label)}</b> #{i} · {esc(where)} · {esc(verdict)} · '
            f"{esc(why)}{esc(exit_note)}</summary>{body}</details>"
        )
    more = seen.failing_count + seen.unjudged_count - len(listed)
    if more > 0:
        items.append(
            f'<p class="note">{more:,} more are not listed; each sample\'s record holds its score, '
            "explanation and verify output.</p>"
        )
    hist = (
        svg_histogram(histogram_counts(seen.values, 10), "score", fmt=lambda x: f"{x:g}", counted="sample")
        if seen.values
        else ""
    )
    # --stop_after_passes: the console and statistics.json say the figures describe the kept data; the
    # page showed them bare (a pass@4 of 0.000: only rows that never passed ran 4 samples).
    skipped = finite_value(scores.get("skipped_after_passes")) or 0
    caveat = (
        f'<p class="note stop-after-passes">{fmt_int(skipped)} samples skipped after passes: '
        f"{esc(scores['note'])}.</p>"
        if skipped and isinstance(scores.get("note"), str)
        else ""
    )
    return (
        '<section id="scores"><h2>Scores</h2><div class="cards">'
        + "".join(cards)
        + "</div>"
        + caveat
        + snapshot
        + (f"<h3>Score histogram</h3>{hist}" if hist else "")
        + "<h3>Per row</h3>"
        + table(rows, ("row", "samples", "passes", "no verdict", "mean score"), "scores")
        + rows_note
        + f"<h3>Failing samples ({seen.failing_count:,})"
        + (f" and samples without a verdict ({seen.unjudged_count:,})" if seen.unjudged_count else "")
        + "</h3>"
        + ("".join(items) or '<p class="empty">None.</p>')
        + "</section>"
    )


def section_failed(d: RunData) -> str:
    total = sum(d.failed.values())
    if not total:
        return ""
    rows = [
        (
            r.get("prompt_index", ""),
            r.get("error_class", ""),
            str(r.get("error", ""))[:500],
            str(r.get("prompt", ""))[:200],
        )
        for r in d.failed_rows
    ]
    more = f'<p class="note">{total - len(rows):,} more in failed.jsonl.</p>' if total > len(rows) else ""
    return (
        f'<section id="failed"><h2>Failed attempts</h2><details><summary>{total:,} failed attempt{"s" if total != 1 else ""}</summary>'
        f"{table(rows, ('prompt', 'error class', 'error', 'prompt text'), 'failed')}{more}</details></section>"
    )


def section_browser(d: RunData) -> str:
    shown = len(d.items) - d.discarded_items
    notes = []
    if d.trajectories > shown:
        notes.append(
            f"{d.trajectories - shown:,} of {d.trajectories:,} trajectories are not listed here (the first {shown:,} in file order are); all are counted above."
        )
    total_discarded = sum(d.discarded.values())
    if total_discarded > d.discarded_items:
        notes.append(f"{total_discarded - d.discarded_items:,} discarded samples are not listed.")
    note = "".join(f'<p class="note" data-left-out>{esc(n)}</p>' for n in notes)
    return (
        '<section id="browse"><h2>Trajectories</h2>'
        + note
        + '<div class="controls"><input id="filter" type="search" placeholder="Filter by text (prompt, reasoning, tool calls, results)…" autocomplete="off">'
        '<select id="outcome"><option value="">all outcomes</option><option value="completed">completed</option>'
        '<option value="partial">partial</option><option value="incomplete">incomplete</option>'
        '<option value="discarded">discarded</option></select>'
        '<button id="expand" type="button">expand shown</button><button id="collapse" type="button">collapse all</button>'
        '<span id="shown" class="note"></span></div><div id="list"><noscript>The list needs JavaScript.</noscript></div></section>'
    )


def render_page(d: RunData) -> str:
    return "".join(page_parts(d))


def page_parts(d: RunData) -> Iterator[str]:
    """The page in parts, in order: its HTML, then the report data a trajectory at a time, so
    :func:`write_report` writes each as it comes (the page whole was held three or four times over while
    it was put together: 8 MB a copy with 1,000 trajectories listed)."""
    manifest = d.manifest or {}
    name = (d.statistics or {}).get("run_name") or d.run_dir.name
    generated = dt.datetime.now().isoformat(timespec="seconds")
    banner = ""
    state = (d.status or {}).get("state")
    if (
        state == "running" and local_alive(d.status or {}) is False
    ):  # killed outright: status.json says running
        banner = (
            f'<p class="banner">The run stopped without finishing: status.json says running, but its process '
            f"{esc(d.status.get('pid'))} is gone (killed or crashed); numbers are what it recorded. "
            "Continue it with <code>--resume</code>.</p>"
        )
    elif state == "running":
        banner = '<p class="banner">The run was still running when this report was written; numbers are a snapshot.</p>'
    if not d.merged:
        banner += '<p class="banner">Read from the batch files (not merged yet): records the final merge drops (unknown tools, duplicates) are included.</p>'
    if d.invalid_lines:
        banner += f'<p class="banner">{d.invalid_lines:,} torn or invalid line(s) were skipped.</p>'
    sub = " · ".join(
        esc(x)
        for x in (
            manifest.get("model"),
            manifest.get("distribution") and f"distribution {manifest['distribution']}",
            f"generated {generated}",
        )
        if x
    )
    yield (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>Run report: {esc(name)}</title><style>{CSS}</style></head><body>"
        f'<header><h1>Run <span id="run-name">{esc(name)}</span></h1><p class="sub">{sub}</p>'
        '<nav><a href="#outcomes">Outcomes</a><a href="#scores">Scores</a><a href="#tools">Tools</a><a href="#reasoning">Reasoning</a>'
        '<a href="#usage">Tokens and cost</a><a href="#histograms">Per prompt</a><a href="#settings">Settings</a>'
        f'<a href="#browse">Trajectories</a></nav></header><main>{banner}'
        + section_outcomes(d)
        + section_scores(d)
        + section_tools(d)
        + section_reasoning(d)
        + section_usage(d)
        + section_histograms(d)
        + section_settings(d)
        + section_failed(d)
        + section_browser(d)
        + '</main><script type="application/json" id="report-data">'
    )
    # {"items": d.items, "systems": d.systems} as json_for_script writes it whole (its escapes are of
    # single characters, none in the brackets and commas between the parts)
    yield '{"items":['
    for n, item in enumerate(d.items):
        yield ("," if n else "") + json_for_script(item)
    yield '],"systems":' + json_for_script(d.systems) + "}"
    yield f"</script><script>{JS}</script></body></html>"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def write_report(
    run_dir: Path,
    max_trajectories: int = DEFAULT_MAX_TRAJECTORIES,
    redact: Callable[[str], str] | None = None,
    kept: RunData | None = None,
) -> Path:
    """Write ``report.html`` into the run directory (atomically) and return its path.

    ``redact``: the run's secret filter (the runner passes it); the files read are redacted already,
    this also covers what the page derives from them. ``kept``: see :func:`collect`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {run_dir}")
    data = collect(run_dir, max_trajectories, kept)

    def written(part: str) -> str:
        # Redacted a part at a time: a part is a section or a whole trajectory's data, and the files it
        # is made from are redacted already. A discarded sample may hold a lone surrogate (a model's
        # broken text, kept escaped in its JSON line): a page is UTF-8, which cannot carry one; it shows
        # as U+FFFD there (the files keep it).
        return _LONE_SURROGATE.sub("\ufffd", redact(part) if redact is not None else part)

    out = run_dir / REPORT_NAME
    write_parts_atomic(out, (written(part) for part in page_parts(data)))
    return out


CSS = """
:root{--fg:#1d2330;--muted:#667085;--line:#e3e6eb;--bg:#f6f7f9;--card:#fff;--ok:#2f9e6e;--bad:#d9534f;--warn:#e0a030;
--disc:#c2410c;--human:#2f6fde;--gpt:#2f9e6e;--tool:#b7791f;--think:#7a5cc2}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header{background:#1d2330;color:#fff;padding:16px 28px 10px}header h1{margin:0;font-size:22px;font-weight:600}
header .sub{margin:2px 0 8px;color:#b8c0cc}nav a{color:#cfe0ff;margin-right:16px;text-decoration:none;font-size:13px}
main{max-width:1120px;margin:0 auto;padding:8px 24px 60px}
section{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:14px 20px;margin:16px 0}
h2{font-size:17px;margin:2px 0 12px}h3{font-size:14px;margin:14px 0 6px;color:#344054}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:10px}
.card{flex:1 1 160px;border:1px solid var(--line);border-radius:6px;padding:10px 12px;background:#fbfcfd}
.num{font-size:24px;font-weight:650}.cap{color:#344054}.sub{color:var(--muted);font-size:12px;min-height:1em}
.cols{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
table{border-collapse:collapse;margin:6px 0}th,td{text-align:left;padding:4px 12px 4px 0;border-bottom:1px solid var(--line);vertical-align:top}
th{color:var(--muted);font-weight:600;font-size:12px}table.failed td{font-size:12px;word-break:break-word}
.note,.empty{color:var(--muted);font-size:12.5px}.banner{background:#fff7e0;border:1px solid #f0d58a;padding:8px 12px;border-radius:6px}
.chart{max-width:100%;height:auto;display:block;margin:6px 0}.chart text{font-size:12px;fill:#344054}
.chart .val,.chart .tick,.chart .cnt{fill:var(--muted);font-size:11px}.chart .axis{stroke:#c4c9d2}
rect.ok{fill:var(--ok)}rect.bad{fill:var(--bad)}rect.warn{fill:var(--warn)}rect.disc{fill:var(--disc)}rect.muted{fill:#9aa3b2}rect.bar{fill:#5b8def}
.legend{font-size:12px;color:var(--muted)}.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 10px}
.sw.ok{background:var(--ok)}.sw.bad{background:var(--bad)}code{background:#eef1f5;padding:0 4px;border-radius:3px}
.controls{display:flex;flex-wrap:wrap;gap:8px;align-items:center;margin:8px 0 12px}
#filter{flex:1 1 320px;padding:7px 10px;border:1px solid #c4c9d2;border-radius:6px;font:inherit}
select,button{padding:6px 10px;border:1px solid #c4c9d2;border-radius:6px;background:#fff;font:inherit;cursor:pointer}
details.traj{border:1px solid var(--line);border-radius:6px;margin:6px 0;background:#fff}
details.traj>summary{padding:8px 12px;cursor:pointer;display:flex;gap:10px;align-items:baseline;list-style:none}
details.traj>summary::-webkit-details-marker{display:none}details.traj[open]>summary{border-bottom:1px solid var(--line);background:#fafbfc}
.idx{color:var(--muted);font-variant-numeric:tabular-nums;min-width:3.5em}.prompt{flex:1;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.meta{color:var(--muted);font-size:12px;white-space:nowrap}
.badge{font-size:11px;padding:1px 7px;border-radius:10px;color:#fff;white-space:nowrap}
.badge.completed{background:var(--ok)}.badge.partial{background:var(--warn)}.badge.incomplete{background:#9aa3b2}.badge.discarded{background:var(--disc)}
.conv{padding:10px 14px}.turn{border-left:3px solid;padding:4px 10px;margin:8px 0;border-radius:0 6px 6px 0}
.turn .who{font-size:11px;font-weight:700;text-transform:uppercase;letter-spacing:.04em}
.turn.human{border-color:var(--human);background:#f2f6fe}.turn.human .who{color:var(--human)}
.turn.gpt{border-color:var(--gpt);background:#f1faf5}.turn.gpt .who{color:var(--gpt)}
.turn.tool{border-color:var(--tool);background:#fdf8ef}.turn.tool .who{color:var(--tool)}
.turn.system{border-color:#9aa3b2;background:#f6f7f9}.turn.system .who{color:#667085}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:12.5px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.text{white-space:pre-wrap;word-break:break-word;margin:4px 0}
details.fold{margin:4px 0;border:1px solid var(--line);border-radius:5px;background:#fff}
details.fold>summary{cursor:pointer;padding:3px 8px;font-size:12.5px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
details.fold>pre{padding:4px 10px;border-top:1px solid var(--line);max-height:480px;overflow:auto}
details.think>summary{color:var(--think);font-style:italic}details.call>summary{font-family:ui-monospace,Menlo,Consolas,monospace}
.res-ok{color:var(--ok);font-weight:700}.res-bad{color:var(--bad);font-weight:700}
details.failing{border:1px solid var(--line);border-left:3px solid var(--bad);border-radius:6px;margin:4px 0;padding:4px 10px}
details.failing summary{cursor:pointer}details.failing pre{max-height:360px;overflow:auto;background:var(--bg);padding:6px}
"""

JS = r"""
(function () {
  var data = JSON.parse(document.getElementById('report-data').textContent);
  var items = data.items, systems = data.systems;
  var list = document.getElementById('list'), filter = document.getElementById('filter');
  var outcome = document.getElementById('outcome'), shown = document.getElementById('shown');
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function preview(s, n) { s = String(s || '').replace(/\s+/g, ' ').trim(); return s.length > n ? s.slice(0, n) + '…' : s; }
  function fold(cls, summary, body, open) {
    var d = el('details', 'fold ' + cls); d.appendChild(el('summary', null, summary));
    d.appendChild(el('pre', null, body)); if (open) d.open = true; return d;
  }
  function turn(cls, who) { var t = el('div', 'turn ' + cls); t.appendChild(el('div', 'who', who)); return t; }
  function renderTurn(t) {
    if (t.k === 's') {
      var s = systems[t.ref] || {v: '', tools: []}, box = turn('system', 'system');
      box.appendChild(fold('sys', 'System prompt · ' + s.tools.length + ' tools offered: ' + s.tools.join(', '), s.v));
      return box;
    }
    if (t.k === 'h') { var h = turn('human', 'human'); h.appendChild(el('div', 'text', t.v)); return h; }
    if (t.k === 'g') {
      var g = turn('gpt', 'gpt');
      if (t.th) g.appendChild(fold('think', 'Reasoning · ' + preview(t.th, 110), t.th));
      if (t.v) g.appendChild(el('div', 'text', t.v));
      t.c.forEach(function (c) { g.appendChild(fold('call', '⚙ ' + c.n + '(' + preview(c.a, 90) + ')', c.a)); });
      return g;
    }
    var r = turn('tool', 'tool');
    t.r.forEach(function (x) {
      var d = fold('result', '', x.v), sm = d.firstChild;
      sm.appendChild(el('span', x.ok ? 'res-ok' : 'res-bad', x.ok ? '✓ ' : '✗ '));
      sm.appendChild(document.createTextNode(x.n + ' → ' + preview(x.v, 100)));
      r.appendChild(d);
    });
    return r;
  }
  function render(d, it) {
    if (d.dataset.rendered) return;
    d.dataset.rendered = '1';
    var conv = el('div', 'conv');
    it.t.forEach(function (t) { conv.appendChild(renderTurn(t)); });
    d.appendChild(conv);
  }
  var rows = items.map(function (it) {
    var d = el('details', 'traj'), s = el('summary');
    d.dataset.outcome = it.o;
    s.appendChild(el('span', 'idx', '#' + it.i));
    s.appendChild(el('span', 'badge ' + it.o, it.o === 'discarded' ? 'discarded: ' + it.r : it.o));
    s.appendChild(el('span', 'prompt', preview(it.p, 200)));
    var meta = (it.n == null ? '?' : it.n) + ' calls';
    var nt = Object.keys(it.tools).reduce(function (a, k) { return a + it.tools[k]; }, 0);
    meta += ' · ' + nt + ' tool' + (nt === 1 ? '' : 's') + (it.tf ? ' (' + it.tf + ' failed)' : '');
    if (it.tok != null) meta += ' · ' + it.tok.toLocaleString('en-US') + ' tok';
    if (it.usd) meta += ' · $' + it.usd.toPrecision(3);
    if (it.o !== 'discarded' && it.r && it.r !== 'final_answer') meta += ' · ' + it.r;
    s.appendChild(el('span', 'meta', meta));
    d.appendChild(s);
    d.addEventListener('toggle', function () { if (d.open) render(d, it); });
    list.appendChild(d);
    return {el: d, it: it, hay: null};
  });
  function haystack(r) {
    if (r.hay === null) {
      var parts = [r.it.p, r.it.o, r.it.r, '#' + r.it.i];
      r.it.t.forEach(function (t) {
        if (t.k === 'h') parts.push(t.v);
        else if (t.k === 'g') { parts.push(t.th || '', t.v); t.c.forEach(function (c) { parts.push(c.n, c.a); }); }
        else if (t.k === 't') t.r.forEach(function (x) { parts.push(x.n, x.v); });
      });
      r.hay = parts.join('\n').toLowerCase();
    }
    return r.hay;
  }
  function apply() {
    var q = filter.value.trim().toLowerCase(), o = outcome.value, n = 0;
    rows.forEach(function (r) {
      var ok = (!o || r.it.o === o) && (!q || haystack(r).indexOf(q) !== -1);
      r.el.hidden = !ok; if (ok) n++;
    });
    shown.textContent = n + ' of ' + rows.length + ' shown';
  }
  var timer = null;
  filter.addEventListener('input', function () { clearTimeout(timer); timer = setTimeout(apply, 120); });
  outcome.addEventListener('change', apply);
  document.getElementById('expand').addEventListener('click', function () {
    rows.forEach(function (r) { if (!r.el.hidden) r.el.open = true; });
  });
  document.getElementById('collapse').addEventListener('click', function () {
    rows.forEach(function (r) { r.el.open = false; });
  });
  apply();
})();
"""


def main(argv: list[str] | None = None) -> int:
    parser = ViewParser(
        prog="python -m batchrun.views.report", description="Write report.html for a run directory."
    )
    parser.add_argument("run_dir", type=Path, help="the run's directory, e.g. data/my_run")
    parser.add_argument(
        "--max_trajectories",
        "--max-trajectories",  # its first spelling; every other flag of the runner and the views has "_"
        type=int,
        default=DEFAULT_MAX_TRAJECTORIES,
        help=f"conversations to include in the browsable list (default {DEFAULT_MAX_TRAJECTORIES}); all are counted",
    )
    args = parser.parse_args(argv)
    if args.max_trajectories < 0:
        parser.error("--max_trajectories must be 0 or more")
    problem = check_run_dir(args.run_dir)
    if not problem and args.run_dir.is_dir() and not holds_run(args.run_dir):
        # An empty directory (or "", the current one) got a report.html titled "Run report: " written into
        # it, exit 0: every other view refuses a directory that holds no run.
        shown = f"{args.run_dir}" + (
            " (the current directory)" if args.run_dir.resolve() == Path.cwd() else ""
        )
        problem = (
            f"{shown} holds no run (no {', '.join(RUN_FILES)} or batch_N.jsonl); name a run's directory "
            "(data/<run_name>)"
        )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        path = write_report(args.run_dir, args.max_trajectories)
    except (FileNotFoundError, WriteError) as exc:  # no run directory; report.html cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
