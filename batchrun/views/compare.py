"""Compare the scores of two runs over the same rows.

    python -m batchrun.views.compare data/<runA> data/<runB>                  # prints; writes compare.html
    python -m batchrun.views.compare data/<runA> data/<runB> --out=ab.html --json

Samples are paired by row identity (prompt text, image, cwd, the row's own settings) and sample
index (the samples of several rows of one identity by their lines' occurrence, where records say it:
:func:`copies_by_line`); only pairs judged in both runs (passed true or false) and against the same check (the row's
``answer``, ``verify``, ``verify_files`` and ``rubric``: not part of its identity) by the same
scorers with the same settings (``--answer_pattern``, ``--answer_normalize``, ``--numeric_tolerance``,
``--judge_model`` and the judge's base URL, where the scorers use them) count. A pair judged
against another check in B (an answer key fixed between the runs), or by another scorer (``exact`` in
A, ``includes`` in B), says nothing about the model: it is left out and counted (``judged_differently``),
its rows listed. Two sides of one run (its own scores and a re-scoring) are two ways of judging the same
samples: there the scorers may differ. A sample judged in one run and held without a verdict in the other
(unscored: its scorers had nothing to judge it by; or a scorer error) is counted apart
(``unjudged_in_b``, ``unjudged_in_b_by_reason``, ``unjudged_in_b_rows``, and ``_a``), not "only in A",
which counts the samples the other run holds none of. Printed and written as HTML:

* the pass rates of A and B on the paired samples and their difference B - A, with a paired bootstrap
  95% interval (the rows resampled with replacement, each with all its pairs, ``--bootstrap`` times,
  seeded: the same inputs give the same interval; widened for few rows, see ``paired_bootstrap``; with
  one pair a row, never narrower than ``paired_exact_interval``, which holds 0 exactly when McNemar's
  exact test's p >= 0.05);
* a p-value that asks whether the two runs differ beyond chance (``p_value``, the test in
  ``p_value_test``): with one pair a row (or a single row), McNemar's exact test on the discordant pairs (b: passed in A
  only, c: passed in B only; two-sided binomial p-value with p = 1/2); with several pairs in a row
  (``--samples_per_prompt``), whose pairs are alike (a row B solves and A does not flips all of them),
  McNemar's test takes them for independent and finds noise significant (10 rows of 10 pairs, no
  difference between the models: p < 0.05 in 37% of simulated comparisons), so the p-value is a sign-flip
  randomisation test by row: each row's total B - A as likely negated (McNemar's exact test again when
  each row has one pair). ``mcnemar_p`` stays McNemar's figure over the pairs;
* the same per toolset mix (A's toolsets of the pair);
* the rows that flipped each way (passed in A and failed in B, and the reverse).

``--scores=NAME`` compares a re-scoring (``scores.NAME.jsonl`` from ``batchrun.views.score``) instead
of the runs' own scores; ``--scores_a``/``--scores_b`` pick one side's (so a run's own scores can be
compared with its re-scoring: the same run named twice).
"""

from __future__ import annotations

import collections
import functools
import html
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from batchrun.record import occurrence_of, read_score
from batchrun.run.resume import MANIFEST_DEFAULTS
from batchrun.run.run_dir import check_run_dir, holds_run, in_use
from batchrun.scoring import (
    TEXT_SCORERS,
    check_from_row_fields,
    mcnemar_exact,
    paired_bootstrap,
    paired_exact_interval,
    pairs_stand_alone,
    sign_flip_p,
)
from batchrun.secrets import terminal_safe
from batchrun.sharegpt import first_human
from batchrun.storage import WriteError, iter_jsonl, read_json_object, write_text_atomic
from batchrun.views.flags import ViewParser, scores_name_problem
from batchrun.views.score import run_samples

MIN_BOOTSTRAP, MAX_BOOTSTRAP = 100, 1_000_000  # --bootstrap

# (row key, sample index, copy): the copy tells apart the samples of rows of one identity (the same row
# key): the occurrence of the line that wrote it, else its order in the run's files (:func:`copies_by_line`);
# the k-th copy in one run is paired with the k-th in the other.
Key = tuple[str, int, int]


def copies_by_line(
    samples: list[tuple[dict[str, Any], tuple[str, int], int]],
) -> dict[tuple[str, int, int], int]:
    """(row key, sample index, copy in file order) -> its copy as :data:`Key` holds it: the occurrence of
    the line that wrote it (how many earlier dataset lines held its prompt text), which a record says since
    the field exists; its file order where it does not (older records). Lines of one prompt and settings
    (identical ones, or with another check) are rows of one identity: numbered in the order their samples
    ended, the k-th in A was one line's and in B another's, so two runs of one dataset compared as "judged
    differently" pair by pair, or as flips of a row whose samples were the same in both; numbered by their
    rank, a line's sample missing in one run (failed) moved the others onto their neighbours' lines."""
    numbered: dict[tuple[str, int, int], int] = {}
    taken: set[tuple[str, int, int]] = set()
    for rec, sample, copy in samples:
        occurrence = occurrence_of(rec.get("metadata") or {})
        nth = copy if occurrence is None else occurrence
        while (*sample, nth) in taken:  # a run resumed across versions: records with and without it
            nth += 1
        taken.add((*sample, nth))
        numbered[(*sample, copy)] = nth
    return numbered


def sample_verdicts(run_dir: Path, scores_name: str | None = None) -> dict[Key, dict[str, Any]]:
    """(row key, sample index, copy) -> {passed, value, label, toolsets, check} of every judged sample
    of a run."""
    return run_verdicts(run_dir, scores_name)[0]


# Why a sample a run holds has no verdict, as compare tells them apart (the tally's unscored and errors).
UNJUDGED_REASONS = ("unscored", "scorer_error")


def run_verdicts(
    run_dir: Path, scores_name: str | None = None
) -> tuple[dict[Key, dict[str, Any]], dict[Key, str]]:
    """:func:`sample_verdicts`, and the samples the run holds that have no verdict, each with why (one of
    :data:`UNJUDGED_REASONS`: ``unscored``, its scorers had nothing to judge it by; ``scorer_error``)."""
    override: dict[Key, dict[str, Any]] = {}
    if scores_name:
        path = run_dir / f"scores.{scores_name}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (python -m batchrun.views.score writes it)")
        lines: collections.Counter[tuple[str, int]] = collections.Counter()
        # Written in run_samples' order: the k-th line of a sample is its k-th copy.
        for line in iter_jsonl(path):
            index = line.get("sample_index") if isinstance(line, dict) else None
            if (
                isinstance(line, dict)
                and isinstance(line.get("score"), dict)
                and isinstance(line.get("row_key"), str)
                and isinstance(index, int)
                and not isinstance(index, bool)
            ):  # a line of another shape (edited, torn) is skipped, as torn lines are everywhere
                sample = (line["row_key"], index)
                override[(*sample, lines[sample])] = line["score"]
                lines[sample] += 1
    out = {}
    unjudged: dict[Key, str] = {}
    samples = run_samples(run_dir)
    numbered = copies_by_line(samples)
    for rec, sample, copy in samples:
        score = read_score(override.get((*sample, copy)) if scores_name else rec.get("score"))
        key = (*sample, numbered[(*sample, copy)])
        if score.get("error"):  # as the scores' tally counts them: an error first, then no verdict
            unjudged[key] = "scorer_error"
            continue
        if not isinstance(score.get("passed"), bool):
            unjudged[key] = "unscored"
            continue
        meta = rec.get("metadata") or {}
        fields = meta.get("row_fields")
        out[key] = {
            "passed": score["passed"],
            "value": score.get("value"),
            "scorer": score.get("scorer"),
            "label": meta.get("row_id") or " ".join((first_human(rec["conversations"]) or "").split())[:80],
            "toolsets": "+".join(sorted(rec.get("toolsets_used") or [])) or "none",
            "row_fields": fields if isinstance(fields, str) else None,  # its check: see same_check
        }
    return out, unjudged


@functools.lru_cache(maxsize=4096)
def _check_of(fields: str | None) -> Any:
    return check_from_row_fields(fields)


def same_check(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two sides' samples were judged against the same row check (an answer, a verify, ...): the
    same fields' text is, and other texts are parsed only then (every sample's, parsed as it was read, was
    a tenth of what comparing two 100,000-sample runs cost)."""
    return a["row_fields"] == b["row_fields"] or _check_of(a["row_fields"]) == _check_of(b["row_fields"])


# The settings of the scorers that use them: judged with others, two runs' verdicts on one answer differ.
JUDGING_SETTINGS = {
    "answer_pattern": TEXT_SCORERS,
    "answer_normalize": ("exact", "includes"),
    "numeric_tolerance": ("numeric",),
    "judge_model": ("judge",),
    # Which server judged (a llama-server answers to any model name): a re-scoring's, and a run's manifest
    # since it records it (an older one does not: compared with nothing).
    "judge_base_url": ("judge",),
}


def judging_settings(run_dir: Path, scores_name: str | None = None) -> dict[str, Any]:
    """How one side's samples were judged, beside each sample's scorer: the run's settings
    (run_manifest.json), or a re-scoring's (statistics.json ``scores.rescored.NAME``). A setting the
    files do not record (a re-scoring older than it) is left out: it is compared with nothing."""
    if scores_name:
        stats = read_json_object(run_dir / "statistics.json") or {}
        section = stats.get("scores") if isinstance(stats.get("scores"), dict) else {}
        rescored = section.get("rescored") if isinstance(section.get("rescored"), dict) else {}
        entry = rescored.get(scores_name) if isinstance(rescored.get(scores_name), dict) else {}
        return {k: entry[k] for k in JUDGING_SETTINGS if k in entry}
    manifest = read_json_object(run_dir / "run_manifest.json")
    if manifest is None:
        return {}
    return {
        k: manifest.get(k, MANIFEST_DEFAULTS.get(k))
        for k in JUDGING_SETTINGS
        if k in manifest or k in MANIFEST_DEFAULTS
    }


def _judged_alike(
    scorer_a: Any, scorer_b: Any, settings_a: dict[str, Any], settings_b: dict[str, Any]
) -> bool:
    """Whether two verdicts on a pair come from the same scorers with the same settings."""
    if scorer_a != scorer_b:
        return False
    names = str(scorer_a or "").split(",")
    return all(
        settings_a[k] == settings_b[k]
        for k, users in JUDGING_SETTINGS.items()
        if k in settings_a and k in settings_b and any(n in users for n in names)
    )


def compare_pairs(
    pairs: list[tuple[bool, bool]], bootstrap: int = 10_000, seed: int = 0, rows: list[Any] | None = None
) -> dict[str, Any]:
    """The figures for paired verdicts (A, B): pass rates, their difference with its interval and
    p-value. ``rows`` names each pair's row (default: a row each): a row's pairs are resampled and
    tested together."""
    n = len(pairs)
    rows = list(range(n)) if rows is None else rows
    a = sum(x for x, _ in pairs)
    b_pass = sum(y for _, y in pairs)
    only_a = sum(1 for x, y in pairs if x and not y)
    only_b = sum(1 for x, y in pairs if y and not x)
    interval = paired_bootstrap([float(y) - float(x) for x, y in pairs], bootstrap, seed, rows)
    totals: dict[Any, int] = collections.defaultdict(int)
    for row, (x, y) in zip(rows, pairs, strict=True):
        totals[row] += int(y) - int(x)
    mcnemar = mcnemar_exact(only_a, only_b)
    # Pairs that stand alone (one a row, or a single row's), as the bootstrap resampled them: McNemar's test.
    one_pair_a_row = pairs_stand_alone(len(totals), n)
    exact = paired_exact_interval(only_a, only_b, n) if one_pair_a_row else None
    if interval is not None and exact is not None:
        # Never narrower than the interval the test agrees with: 3 discordant pairs of 8, all one way,
        # read "+37.5% (95% CI +5.3% to +85.9%)" beside "McNemar exact p = 0.25". Now the interval
        # leaves out 0 only where the test finds the difference (p < 0.05).
        interval = (min(interval[0], exact[0]), max(interval[1], exact[1]))
    p_value = mcnemar if one_pair_a_row else sign_flip_p(list(totals.values()))
    # Rows of several pairs: the resampled interval may leave out 0 where the sign-flip test does not
    # find the difference (5 rows can never give p < 0.05, yet 5.6% of simulated equal models read a sure
    # gain or loss); and beyond EXACT_BINOMIAL_UP_TO discordant pairs the exact interval is Wilson's. It
    # then reaches 0, and says so: no interval here leaves out 0 beside p >= 0.05.
    widened = interval is not None and (interval[0] > 0 or interval[1] < 0) and p_value >= 0.05
    if widened and interval is not None:
        interval = (min(interval[0], 0.0), max(interval[1], 0.0))
    return {
        "pairs": n,
        "rows": len(totals),
        "pass_rate_a": a / n if n else None,
        "pass_rate_b": b_pass / n if n else None,
        "difference": (b_pass - a) / n if n else None,
        "difference_95ci": None if interval is None else [interval[0], interval[1]],
        "passed_only_in_a": only_a,
        "passed_only_in_b": only_b,
        "mcnemar_p": mcnemar,
        "difference_95ci_reaches_0_by_the_test": widened,
        "p_value": p_value,
        "p_value_test": "mcnemar_exact" if one_pair_a_row else "sign_flip_by_row",
    }


def compare_runs(
    run_a: Path,
    run_b: Path,
    scores_a: str | None = None,
    scores_b: str | None = None,
    bootstrap: int = 10_000,
) -> dict[str, Any]:
    (a, a_unjudged), (b, b_unjudged) = run_verdicts(run_a, scores_a), run_verdicts(run_b, scores_b)
    both = sorted(set(a) & set(b))
    # The check is not part of a row's identity: B's samples may be judged against another answer. Nor
    # is the scorer: judged by includes in B and exact in A, the same answer passed in B only (8 of 8
    # pairs, McNemar p = 0.008, for one model). Within one run, judging differently is the point.
    one_run = run_a.resolve() == run_b.resolve()
    settings_a, settings_b = judging_settings(run_a, scores_a), judging_settings(run_b, scores_b)

    def alike(k: Key) -> bool:
        return same_check(a[k], b[k]) and (
            one_run or _judged_alike(a[k]["scorer"], b[k]["scorer"], settings_a, settings_b)
        )

    keys: list[Key] = []
    other_check: list[Key] = []
    for k in both:
        (keys if alike(k) else other_check).append(k)
    # A row's identity is its cluster: its samples, and those of identical rows, are alike.
    pairs = [(a[k]["passed"], b[k]["passed"]) for k in keys]
    rows = [k[0] for k in keys]
    result = compare_pairs(pairs, bootstrap, rows=rows)
    by_mix: dict[str, list[int]] = collections.defaultdict(list)
    for i, k in enumerate(keys):
        by_mix[a[k]["toolsets"]].append(i)
    result["by_toolsets"] = {
        mix: compare_pairs([pairs[i] for i in ix], bootstrap, rows=[rows[i] for i in ix])
        for mix, ix in sorted(by_mix.items())
    }
    # Judged on one side, held without a verdict on the other (its scorers had nothing to judge it by, or
    # broke): apart from "only in", which read as if the other run had no such sample.
    unjudged_in_b = sorted(k for k in a.keys() - b.keys() if k in b_unjudged)
    unjudged_in_a = sorted(k for k in b.keys() - a.keys() if k in a_unjudged)
    result["only_in_a"] = len(a.keys() - b.keys()) - len(unjudged_in_b)
    result["only_in_b"] = len(b.keys() - a.keys()) - len(unjudged_in_a)
    for side, held, why, judged in (("b", unjudged_in_b, b_unjudged, a), ("a", unjudged_in_a, a_unjudged, b)):
        reasons = collections.Counter(why[k] for k in held)
        result[f"unjudged_in_{side}"] = len(held)
        result[f"unjudged_in_{side}_by_reason"] = {reason: reasons[reason] for reason in UNJUDGED_REASONS}
        result[f"unjudged_in_{side}_rows"] = _flipped(_row_labels(judged), held)
    result["judged_differently"] = len(other_check)
    labels = _row_labels(a)
    result["judged_differently_rows"] = _flipped(labels, other_check)
    flips = [(k, x) for k, (x, y) in zip(keys, pairs, strict=True) if x != y]
    result["flipped_to_fail"] = _flipped(labels, [k for k, x in flips if x])
    result["flipped_to_pass"] = _flipped(labels, [k for k, x in flips if not x])
    result["run_a"], result["run_b"] = str(run_a), str(run_b)
    result["skipped_after_passes_a"] = skipped_after_passes(run_a)
    result["skipped_after_passes_b"] = skipped_after_passes(run_b)
    return result


def skipped_after_passes(run_dir: Path) -> int:
    """The samples --stop_after_passes did not run in ``run_dir`` (statistics.json; 0 when it says none)."""
    stats = read_json_object(run_dir / "statistics.json") or {}
    section = stats.get("scores") if isinstance(stats.get("scores"), dict) else {}
    n = section.get("skipped_after_passes")
    return n if type(n) is int and n > 0 else 0


def _stopped_early(r: dict[str, Any]) -> list[str]:
    """The warning about a run that stopped rows early (none when neither did): which of its samples
    ran depended on their verdicts, so its pairs are no fair draw of the model's."""
    sides = [(side, r.get(f"skipped_after_passes_{side.lower()}") or 0) for side in ("A", "B")]
    stopped = [f"{side} skipped {n} samples" for side, n in sides if n]
    if not stopped:
        return []
    return [
        f"warning: --stop_after_passes stopped rows early ({'; '.join(stopped)} after their rows' passes): "
        "which samples ran depended on their verdicts, so the pairs and the difference describe the kept "
        "data, not the models; compare runs made without it"
    ]


def _row_labels(verdicts: dict[Key, dict[str, Any]]) -> dict[str, str]:
    """Each row's label (an id, or the start of its prompt), told apart by the start of its row key
    where rows share one: never merged into one."""
    labels = {k[0]: verdicts[k]["label"] for k in verdicts}
    shared = collections.Counter(labels.values())
    return {r: f"{label} · row {r[:8]}" if shared[label] > 1 else label for r, label in labels.items()}


def _flipped(labels: dict[str, str], keys: list[Key]) -> list[str]:
    """The rows of ``keys`` (a row's samples count once) by their :func:`_row_labels` label."""
    return sorted(labels[r] for r in {k[0] for k in keys})


def _judged_differently(r: dict[str, Any]) -> list[str]:
    """The line about pairs left out for another check in B (none when there are none)."""
    if not r["judged_differently"]:
        return []
    rows = r["judged_differently_rows"]
    return [
        f"left out: {r['judged_differently']} pairs judged against another check in B (answer, verify, "
        f"verify_files or rubric changed, or another scorer or its settings), in {len(rows)} rows: "
        f"{', '.join(rows[:20])}"
    ]


REASON_WORDS = {
    "unscored": "unscored: {side}'s scorers have nothing to judge them by",
    "scorer_error": "scorer errors",
}


def _unjudged(r: dict[str, Any]) -> list[str]:
    """The lines about samples judged in one run and held without a verdict in the other (none when
    there are none): not paired, and not "only in" the first, since the other holds them."""
    lines = []
    for judged, other in (("A", "B"), ("B", "A")):
        n = r.get(f"unjudged_in_{other.lower()}") or 0
        if not n:
            continue
        reasons = r[f"unjudged_in_{other.lower()}_by_reason"]
        why = "; ".join(
            f"{reasons[k]} {REASON_WORDS[k].format(side=other)}" for k in UNJUDGED_REASONS if reasons.get(k)
        )
        rows = r[f"unjudged_in_{other.lower()}_rows"]
        lines.append(
            f"not paired: {n} samples judged in {judged} have no verdict in {other} ({why}), in {len(rows)} "
            f"rows: {', '.join(rows[:20])}"
        )
    return lines


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _diff(r: dict[str, Any]) -> str:
    if r["difference"] is None:
        return "–"
    lo, hi = r["difference_95ci"]
    return f"{r['difference']:+.1%} (95% CI {lo:+.1%} to {hi:+.1%})"


TEST_NAMES = {"mcnemar_exact": "McNemar exact", "sign_flip_by_row": "sign-flip test by row"}


def _test(r: dict[str, Any]) -> str:
    """The p-value with the test that gave it."""
    return f"{TEST_NAMES.get(r['p_value_test'], r['p_value_test'])} p = {r['p_value']:.4g}"


def _why_test(r: dict[str, Any]) -> str:
    """Why the p-value is not McNemar's (empty when it is)."""
    if r["p_value_test"] == "mcnemar_exact":
        return ""
    return (
        f"{r['rows']} rows of several pairs: each row's pairs resampled and tested together (McNemar's "
        f"test, which takes the pairs for independent, would say p = {r['mcnemar_p']:.4g})"
    )


def _reaches_0(r: dict[str, Any]) -> str:
    """Why the interval reaches 0 (empty when the resampled one did): the test does not find the difference."""
    if not r.get("difference_95ci_reaches_0_by_the_test"):
        return ""
    return (
        f"the interval is widened to 0: it left 0 out, but the {TEST_NAMES.get(r['p_value_test'])} "
        f"does not find the difference (p = {r['p_value']:.4g}; {r['rows']} rows)"
    )


def text_report(r: dict[str, Any]) -> str:
    lines = [
        f"A: {r['run_a']}",
        f"B: {r['run_b']}",
        f"{r['pairs']} paired samples in {r['rows']} rows (only in A: {r['only_in_a']}, only in B: {r['only_in_b']})",
        *_unjudged(r),
        *_judged_differently(r),
        *_stopped_early(r),
        f"pass rate A {_pct(r['pass_rate_a'])}, B {_pct(r['pass_rate_b'])}; B - A {_diff(r)}",
        f"{_test(r)} (passed only in A: {r['passed_only_in_a']}, only in B: {r['passed_only_in_b']})",
        *([_why_test(r)] if _why_test(r) else []),
        *([_reaches_0(r)] if _reaches_0(r) else []),
    ]
    for mix, m in r["by_toolsets"].items():
        lines.append(f"  {mix}: {m['pairs']} pairs, B - A {_diff(m)}, {_test(m)}")
    lines.append(
        f"rows that flipped to fail in B ({len(r['flipped_to_fail'])}): {', '.join(r['flipped_to_fail'][:20])}"
    )
    lines.append(
        f"rows that flipped to pass in B ({len(r['flipped_to_pass'])}): {', '.join(r['flipped_to_pass'][:20])}"
    )
    return terminal_safe("\n".join(lines))


# How every comparison page begins (since the view's first version): --out may replace a file that does,
# an earlier comparison, and no other (a run's trajectories.jsonl became a page, exit 0).
PAGE_START = '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Run comparison</title>'


def out_problem(out: Path) -> str | None:
    """Why the page cannot go to ``out`` (a message naming --out, exit 2), or None: checked before any work,
    so a place it cannot be written to, or a file it must not replace, costs no comparison and prints
    nothing that looks like a result. ``out`` may be a new file in a writable directory that holds no run
    (:func:`holds_run`: a run file or a batch file), or an earlier comparison page (:data:`PAGE_START`)."""
    parent = out.parent
    if not parent.is_dir():
        return f"--out {out}: {parent} is not a directory (make it first, or name another place)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out}: cannot write into {parent} (permission denied or read-only)"
    # The directory the page goes into, and the one a symlink at --out points into.
    try:
        places = dict.fromkeys((parent.resolve(), out.resolve().parent))
    except (OSError, RuntimeError) as exc:  # a symlink loop: RuntimeError on Python 3.11, OSError after
        return f"--out {out}: cannot follow it: {exc}"
    for place in places:
        if holds_run(place):
            return (
                f"--out {out} is in the run directory {place}: the page would replace or sit among the run's "
                "files; name a place outside it"
            )
    if out.is_dir():
        return f"--out {out} is a directory; name the page's file (e.g. {out / 'compare.html'})"
    if out.exists() and not out.is_file():
        return f"--out {out} is not a regular file; name the page's file"
    if out.exists():
        try:
            with out.open("rb") as fh:
                start = fh.read(len(PAGE_START.encode()))
        except OSError as exc:
            return f"--out {out}: cannot read it to see what it holds: {exc.strerror or exc}"
        if start != PAGE_START.encode():
            return (
                f"--out {out} exists and is no comparison page: it would be replaced; name a new file, or "
                "remove it first"
            )
    return None


def html_report(r: dict[str, Any]) -> str:
    esc = html.escape

    def row(name: str, m: dict[str, Any]) -> str:
        cells = [
            name,
            m["pairs"],
            _pct(m["pass_rate_a"]),
            _pct(m["pass_rate_b"]),
            _diff(m),
            f"{m['p_value']:.4g}",
            TEST_NAMES.get(m["p_value_test"], m["p_value_test"]),
        ]
        return "<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in cells) + "</tr>"

    head = "".join(f"<th>{h}</th>" for h in ("", "pairs", "pass rate A", "pass rate B", "B - A", "p", "test"))
    rows = row("all", r) + "".join(row(mix, m) for mix, m in r["by_toolsets"].items())
    flips = "".join(
        f"<h2>{esc(title)} ({len(names)})</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in names) + "</ul>"
        for title, names in (
            ("Passed in A, failed in B", r["flipped_to_fail"]),
            ("Failed in A, passed in B", r["flipped_to_pass"]),
        )
    )
    return (
        PAGE_START
        + "<style>body{font:14px system-ui,sans-serif;margin:24px;color:#1d2330}table{border-collapse:collapse}"
        "td,th{border-bottom:1px solid #e3e6eb;padding:4px 10px;text-align:left}</style></head><body>"
        f"<h1>Run comparison</h1><p>A: <code>{esc(r['run_a'])}</code><br>B: <code>{esc(r['run_b'])}</code></p>"
        f'<p id="headline">{r["pairs"]} paired samples in {r["rows"]} rows · B - A {esc(_diff(r))} · '
        f"{esc(_test(r))}</p>"
        + (f'<p id="test">{esc(_why_test(r))}</p>' if _why_test(r) else "")
        + (f'<p id="reaches0">{esc(_reaches_0(r))}</p>' if _reaches_0(r) else "")
        + f'<p id="pairing">only in A: {r["only_in_a"]}, only in B: {r["only_in_b"]}</p>'
        + "".join(f'<p class="unjudged">{esc(line)}</p>' for line in _unjudged(r))
        + "".join(
            f'<p class="warning">{esc(line)}</p>' for line in _judged_differently(r) + _stopped_early(r)
        )
        + f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{flips}</body></html>"
    )


def main(argv: list[str] | None = None) -> int:
    parser = ViewParser(prog="python -m batchrun.views.compare", description="Compare two runs' scores.")
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument(
        "--out", type=Path, default=Path("compare.html"), help="the HTML page (default compare.html)"
    )
    parser.add_argument(
        "--scores", help="compare scores.NAME.jsonl (a re-scoring) instead of the records' own"
    )
    parser.add_argument("--scores_a", help="A's scores.NAME.jsonl (default --scores, else A's own)")
    parser.add_argument("--scores_b", help="B's scores.NAME.jsonl (default --scores, else B's own)")
    parser.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not MIN_BOOTSTRAP <= args.bootstrap <= MAX_BOOTSTRAP:
        # A typo's extra zeros ran for hours: an interval's Monte Carlo error at 10,000 resamples is
        # already ~0.2 of a percentage point; a million leave none worth waiting for.
        parser.error(
            f"--bootstrap must be from {MIN_BOOTSTRAP:,} to {MAX_BOOTSTRAP:,}, not {args.bootstrap:,}"
        )
    for flag in ("--scores", "--scores_a", "--scores_b"):
        # A name with a "/" went into the path (--scores=../../x); "" meant the runs' own scores.
        name = getattr(args, flag[2:])
        if name is not None and (problem := scores_name_problem(flag, name)):
            parser.error(problem)
    scores_a, scores_b = args.scores_a or args.scores, args.scores_b or args.scores
    problem = out_problem(args.out)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    for run, scores in ((args.run_a, scores_a), (args.run_b, scores_b)):
        # First: one this user cannot read raised on the check below. A run being resumed is half old.
        problem = check_run_dir(run) or in_use(run, "compare it")
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        if not (run / "trajectories.jsonl").is_file():
            print(
                f"error: {run} holds no trajectories.jsonl (is it a finished run's directory?)",
                file=sys.stderr,
            )
            return 2
        if scores and not (run / f"scores.{scores}.jsonl").is_file():
            named = re.fullmatch(r"scores\.(.+)\.jsonl", scores)  # the file's name given for the re-scoring's
            hint = f"; the re-scoring's name is {named.group(1)!r}, not its file's" if named else ""
            print(
                f"error: {run / f'scores.{scores}.jsonl'} does not exist (python -m batchrun.views.score "
                f"writes it){hint}",
                file=sys.stderr,
            )
            return 2
    try:
        result = compare_runs(args.run_a, args.run_b, scores_a, scores_b, args.bootstrap)
    except FileNotFoundError as exc:  # gone meanwhile
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not result["pairs"]:
        why = "\n".join(_unjudged(result) + _judged_differently(result)) or "same rows? scores on?"
        print(f"error: no sample is judged alike in both runs ({why})", file=sys.stderr)
        return 1
    try:  # first: a page that cannot be written (a full disk) leaves no result on stdout beside exit 2
        write_text_atomic(args.out, html_report(result))
    except WriteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else text_report(result))
    if not args.json:
        print(f"Wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
