"""Exports that group a row's samples by their scores: ``preference`` (chosen / rejected pairs, TRL's
conversational preference layout) and ``rewards`` (each row's samples with their scores, for
GRPO-style trainers).

    python -m batchrun.views.export data/<run> [data/<other_run> ...] --format=preference --out=DIR
    python -m batchrun.views.export data/<run> --format=rewards --out=DIR

Samples are grouped by their row's identity, the tools they were offered and the check they were
judged against (a pair or a group shares one prompt: the same messages up to the user's, the same
``tools``, and scores given by the same ``answer``, ``verify``, ``verify_files`` and ``rubric``, by the
same scorers with the same settings, as ``views.compare`` pairs them: ``includes`` in one run and
``exact`` in another pass and fail the same reply), across every run named, so two models' runs over
one dataset pair up too. Kept trajectories and the samples a failed
check discarded (``--keep=passed``) are read; other discards only with ``--include_discarded``. Each
(row, sample) of a run counts once (per identical row), as statistics.json counts it: an old discard
that ``--rerun_discarded`` ran again is not a second sample.

* ``preference``: ``prompt`` (the messages up to and including the user's), ``chosen`` and
  ``rejected`` (the rest of a passing and of a failing sample: assistant turns with their
  ``tool_calls``, tool results), ``tools``, the two scores, sample indices and run names. A group's passing and
  failing samples are paired in order, so a row with 3 passes and 2 failures gives 2 pairs. ``chosen`` and
  ``rejected`` hold the tool results too, which DPOTrainer scores as if the model had written them.
* ``rewards``: one line per group: ``prompt``, ``completions`` (per judged sample: ``messages``,
  ``reward`` (its score value), ``passed``, ``sample_index``, ``run_name``), ``rewards`` (the values again, as one
  list), ``tools``.

Messages are the ``messages`` format's (each call's ``arguments`` a JSON object, ``{}`` with the text in
``raw_arguments`` for arguments that are not one), with every key (``role``, ``content``,
``reasoning_content``, ``tool_calls``, ``tool_call_id``; null where they do not apply) in every line. The
card states no features: as for ``messages``, the loader infers them (arguments as a struct).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchrun.identity import RowIdentity, record_sample
from batchrun.scoring import check_from_row_fields
from batchrun.sharegpt import first_human, offered_tools
from batchrun.views.compare import JUDGING_SETTINGS, judging_settings
from batchrun.views.export_rows import (
    ExportOptions,
    ExportResult,
    JsonlWriter,
    _all_samples,
    _full_message,
    holds_invalid_call,
    invalid_calls_warning,
    sample_digest,
    sample_messages,
    score_columns,
    split_of,
    stop_reason_left_out,
    template_messages,
    unsplit_warning,
    write_dataset,
)
from batchrun.views.score import run_wanted

# Discards that are judged samples, not broken ones (scorer_error: an older run's were "unscored")
SCORING_DISCARDS = ("failed_check", "scorer_error", "unscored")


def split_prompt(
    record: dict[str, Any], discard_reason: str | None, reasoning: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prompt messages: up to and including the first user message, the completion: the rest).

    The messages are the ``messages`` format's (``sample_messages``, then ``template_messages``): each
    call's ``arguments`` a JSON object. They were JSON strings, which the templates DPOTrainer renders
    chosen and rejected with double-encode (Qwen2.5's ``arguments | tojson`` printed the string quoted,
    its inner quotes escaped: a call the model never made); and an ``ambiguous_markup`` discard's turns
    were split where its markup is ambiguous (or the sample left out as unparsable), not kept whole.
    ``reasoning`` (--reasoning) applies as in ``messages``; it was ignored.
    """
    messages = template_messages(sample_messages(record, discard_reason, reasoning))
    messages = [_full_message(m) for m in messages]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise ValueError("the sample has no user message")
    return messages[: first_user + 1], messages[first_user + 1 :]


def _sample_ok(reason: str | None, include_discarded: bool) -> bool:
    return reason is None or reason in SCORING_DISCARDS or include_discarded


def _judged_samples(
    run_dirs: list[Path], skipped: collections.Counter[str]
) -> Iterator[tuple[Path, dict[str, Any], str | None, str]]:
    for run_dir in run_dirs:
        for record, reason, run_name in _all_samples([run_dir], True, skipped):
            yield run_dir, record, reason, run_name


def export_scored(
    run_dirs: list[Path], opts: ExportOptions, result: ExportResult, test_fraction: float, seed: int
) -> ExportResult:
    """Write ``train.jsonl`` (and ``test.jsonl``) of ``preference`` or ``rewards`` rows, and the card.

    The request's flags apply as in the message formats (they were accepted and ignored, but for
    --include_partial and --include_discarded): --reasoning to every message, --stop_reasons and
    --exclude_stop_reasons to the samples before they are paired or grouped (without them every stop
    reason is read: a cut reply is a failed sample), --dedup within each pair's or group's samples.
    ``export`` refuses --only_passed and --min_score for these formats.
    """
    fmt = opts.fmt
    groups: dict[tuple[str, str, Any], list[dict[str, Any]]] = collections.defaultdict(list)
    skipped = result.skipped
    # Each (row, sample) of a run as often as its dataset wants it (identical rows), as statistics.json
    # counts them: kept first; an old discard that --rerun_discarded ran again is not a second sample.
    wanted = {run_dir: run_wanted(run_dir) for run_dir in run_dirs}
    settings = {run_dir: judging_settings(run_dir) for run_dir in run_dirs}
    counted: collections.Counter[tuple[Path, str, int]] = collections.Counter()
    seen: set[tuple[Any, str]] = set()  # (group, conversation digest): --dedup
    for run_dir, record, reason, run_name in _judged_samples(run_dirs, skipped):
        if not _sample_ok(reason, opts.include_discarded):
            skipped[f"discarded ({reason})"] += 1
            continue
        if record.get("partial") and not opts.include_partial:
            skipped["partial"] += 1
            continue
        # No default exclusion here: a sample the length limit cut, or that made an invalid call, is a
        # failed sample.
        left_out = stop_reason_left_out(record, opts, frozenset())
        if left_out is not None:
            skipped[left_out] += 1
            continue
        cols = score_columns(record)
        if cols["score_passed"] is None or cols["score_value"] is None:
            skipped["not judged"] += 1
            continue
        try:
            sample = (run_dir, *record_sample(record))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            skipped[f"unparsable ({type(exc).__name__})"] += 1
            continue
        if counted[sample] >= wanted[run_dir].get(sample[1:], 1):
            skipped["discarded sample run again (--rerun_discarded)"] += 1
            continue
        counted[sample] += 1
        try:
            system = next((t["value"] for t in record["conversations"] if t.get("from") == "system"), "")
            tools = json.dumps(offered_tools(system), ensure_ascii=False)
            prompt, completion = split_prompt(record, reason, opts.reasoning)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            skipped[f"unparsable ({type(exc).__name__})"] += 1
            continue
        meta = record.get("metadata") or {}
        # The check is not part of the row's identity: samples judged against another answer (a key
        # fixed between runs) are not comparable, so they never share a pair or a group.
        check = check_from_row_fields(meta.get("row_fields"))
        judged_by = _judged_by(cols["scorer"], settings[run_dir])
        group = (RowIdentity.of_record(record).key, tools, check, judged_by)
        if opts.dedup:
            # Per group: the same conversation judged against another check is another sample.
            digest = (group, sample_digest(record))
            if digest in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(digest)
        groups[group].append(
            {
                "prompt": prompt,
                "completion": completion,
                "tools": tools,
                "score": cols["score_value"],
                "passed": cols["score_passed"],
                "sample_index": meta.get("sample_index") or 0,
                "row_id": meta.get("row_id"),
                "row_fields": meta.get("row_fields"),
                "run_name": run_name,
                "text": first_human(record["conversations"]) or "",
                "unsplit": reason == "ambiguous_markup",  # not written: counted for the warning
                "invalid_calls": holds_invalid_call(record),  # the same
            }
        )

    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        for samples in groups.values():
            rows = _preference_rows(samples) if fmt == "preference" else _rewards_rows(samples)
            if not rows:
                skipped["rows without both a passing and a failing sample"] += fmt == "preference"
            used = _used(samples, fmt)
            result.unsplit += sum(s["unsplit"] for s in used)
            result.invalid_calls += sum(s["invalid_calls"] for s in used)
            for row in rows:
                yield split_of(samples[0]["text"], seed, test_fraction), row

    # Nothing is made or replaced on disk before a row is known to exist: the earlier export in --out was
    # deleted (its card left pointing at a missing file), or an empty directory made, when there was none.
    write_dataset(
        result.out,
        rows(),
        result,
        ext="jsonl",
        open_writer=JsonlWriter,
        nothing=lambda: (
            f"no {fmt} rows: "
            + (
                "no row has both a passing and a failing sample"
                if fmt == "preference"
                else "no sample is judged"
            )
            + f" (not exported: {result.skipped_text()})"
        ),
        card=lambda: card(run_dirs, fmt, result, test_fraction, seed),
    )
    result.notes += filter(
        None, [unsplit_warning(result.unsplit, opts.reasoning), invalid_calls_warning(result.invalid_calls)]
    )
    return result


def _used(samples: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """The samples of a group that its rows hold: every one in ``rewards``, the paired ones in ``preference``."""
    return samples if fmt == "rewards" else [s for pair in _pairs(samples) for s in pair]


def _judged_by(scorer: str | None, settings: dict[str, Any]) -> tuple[Any, ...]:
    """The scorers of a sample's verdict and the settings of theirs that decide it (views.compare's
    ``JUDGING_SETTINGS``, from the run's manifest): two runs judging one reply with others disagree."""
    names = str(scorer or "").split(",")
    used = tuple(
        (k, json.dumps(settings[k], sort_keys=True))
        for k, users in JUDGING_SETTINGS.items()
        if k in settings and any(n in users for n in names)
    )
    return (scorer, used)


def _common(samples: list[dict[str, Any]]) -> dict[str, Any]:
    first = samples[0]
    return {
        "tools": first["tools"],
        "row_id": first["row_id"],
        "row_fields": first["row_fields"],
        "run_names": sorted({s["run_name"] for s in samples}),
    }


def _pairs(samples: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """A group's (passing, failing) pairs: paired in order; the longer list's rest is unused."""
    passing = [s for s in samples if s["passed"]]
    failing = [s for s in samples if not s["passed"]]
    return list(zip(passing, failing, strict=False))


def _preference_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for good, bad in _pairs(samples):
        rows.append(
            {
                "prompt": good["prompt"],
                "chosen": good["completion"],
                "rejected": bad["completion"],
                "tools": good["tools"],
                "chosen_score": good["score"],
                "rejected_score": bad["score"],
                "chosen_sample_index": good["sample_index"],
                "rejected_sample_index": bad["sample_index"],
                **{k: v for k, v in _common([good, bad]).items() if k != "tools"},
                "chosen_run_name": good["run_name"],
                "rejected_run_name": bad["run_name"],
            }
        )
    return rows


def _rewards_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "prompt": samples[0]["prompt"],
            "completions": [
                {
                    "messages": s["completion"],
                    "reward": s["score"],
                    "passed": s["passed"],
                    "sample_index": s["sample_index"],
                    "run_name": s["run_name"],
                }
                for s in samples
            ],
            "rewards": [s["score"] for s in samples],
            **_common(samples),
        }
    ]


def card(run_dirs: list[Path], fmt: str, result: ExportResult, test_fraction: float, seed: int) -> str:
    lines = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split, path in result.files.items():
        lines += [f"  - split: {split}", f"    path: {path.name}"]
    # No dataset_info: with arguments as objects (a struct per tool's schema) there is no one schema to
    # state, as for the messages format; the loader infers it.
    lines += ["tags:", "- tool-use", "- agent-trajectories", f"- {fmt}", "---", "", ""]
    what = {
        "preference": "`prompt` / `chosen` / `rejected` conversational messages (TRL's preference layout): "
        "a passing and a failing sample of the same row, offered the same `tools` and judged by the same check "
        "with the same scorers and settings",
        "rewards": "`prompt`, `completions` (per sample: `messages`, `reward`, `passed`, `sample_index`, `run_name`) and "
        "`rewards` (the scores as one list), "
        "one line per row, tool list and check (GRPO-style groups)",
    }[fmt]
    counts = ", ".join(f"{s}: {result.rows[s]}" for s in result.files) or "none"
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(result.skipped.items())) or "none"
    runs = ", ".join(f"`{d.resolve().name}`" for d in run_dirs)
    split_text = (
        f"{test_fraction:g} of prompts in `test` (seed {seed})" if test_fraction > 0 else "one split, `train`"
    )
    return (
        "\n".join(lines)
        + f"""# {fmt} data from {runs}

Exported by batch-runner: {what}. Messages carry `role`, `content`, `reasoning_content`, `tool_calls`
(arguments as JSON objects, as chat templates expect), `tool_call_id` (null where they do not apply);
`tools` is the JSON text of the OpenAI tool list the samples were offered.

- Splits: {split_text}. Rows: {counts}.
- Not exported: {skipped}.
"""
    )
