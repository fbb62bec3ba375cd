"""Re-score a finished run without running the agent again.

    python -m batchrun.views.score data/<run> --scorer=includes
    python -m batchrun.views.score data/<run> --scorer=numeric --answer_pattern='ANSWER: (.*)' --name=strict
    JUDGE_API_KEY=... python -m batchrun.views.score data/<run> --scorer=judge --judge_model=M --judge_base_url=URL

Scorers that need no sandbox (``exact``, ``includes``, ``regex``, ``numeric``, ``json``, and ``judge``,
which makes only the judge's own model calls) judge every sample of the run (kept trajectories and
discarded samples) against its row's ``answer``/``rubric`` as the record's ``metadata.row_fields``
holds them. ``verify`` cannot run again (the sandbox is gone) and is refused.

The new scores go beside the old ones: ``scores.<name>.jsonl`` (one line per sample: its row key,
sample index, row id and ``score``) and a ``rescored.<name>`` entry in ``statistics.json``'s ``scores``
section (the same figures as the run's own: pass rate, interval, pass@k). The records themselves are
never rewritten.

``--only_errors`` judges again only the samples whose verdict in the run is a scorer error (a judge
that refused its key or was down mid-run), with the run's own scorers and settings, which it checks
against ``run_manifest.json``; every other sample keeps the run's verdict, and no judge call is made
for it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from batchrun.identity import Line, kept_line, lines_matter, record_sample, superseded_discards
from batchrun.record import read_score, valid_outcome_row, valid_record
from batchrun.run.run_dir import RunDirBusy, check_run_dir, holding
from batchrun.scoring import (
    NORMALIZE_STEPS,
    SANDBOX_SCORERS,
    Judgement,
    JudgeSettings,
    RunawayPatterns,
    RunScores,
    ScoringSettings,
    check_from_row_fields,
    headline,
    judge_endpoint,
    parse_scorers,
    pending_judged,
    score_sample,
    wanted_from_duplicates,
    with_planned,
)
from batchrun.sharegpt import first_human, parse_json
from batchrun.storage import (
    PARTIAL_LINE,
    WriteError,
    batch_files,
    cannot_write,
    iter_jsonl,
    json_line,
    read_json_object,
    write_json_atomic,
    write_text_atomic,
)
from batchrun.views.flags import ViewParser, scores_name_problem

DEFAULT_CONCURRENCY, MAX_CONCURRENCY = 8, 256  # --concurrency: judge calls at once
# --name: scores.<name>.jsonl and its temp file (.scores.<name>.jsonl.<pid>.tmp) stay within a file
# name's 255 bytes (300 characters: every judge call paid, then "File name too long").
MAX_NAME = 200

# How long a judge that answers 503 while loading, or stopped answering, is waited for: the run's
# --endpoint_grace default.
JUDGE_GRACE_S = 120.0

T = TypeVar("T")
R = TypeVar("R")


def run_wanted(run_dir: Path) -> dict[tuple[str, int], int]:
    """(row key, sample index) -> how many rows of the run's dataset want it, where more than one
    (identical rows), from statistics.json's ``scores.duplicate_samples``; empty for a run older than it."""
    section = _read_stats(run_dir).get("scores")
    return wanted_from_duplicates(section.get("duplicate_samples") if isinstance(section, dict) else None)


def run_samples(
    run_dir: Path, wanted: dict[tuple[str, int], int] | None = None
) -> list[tuple[dict[str, Any], tuple[str, int], int]]:
    """Every sample a run holds a record of, kept trajectories first, then discarded ones, then partial
    ones ``--exclude_partial`` left in the batch files only: each
    (row, sample) as often as the run's dataset wanted it (``wanted``, by default :func:`run_wanted`;
    others once), as the run's own scores count them. A discard that no longer stands for its sample (it
    ran again, --rerun_discarded or a raised --stop_after_passes, and was kept or discarded again:
    :func:`~batchrun.identity.superseded_discards`) is left out, as statistics.json leaves it out: the
    first discard of a sample found was taken, so a re-scoring judged a reply the run no longer holds,
    and compared, a sample's stale verdict met the other run's. Each record comes with its (row key,
    sample index) and its copy: 0, or n for the n-th further copy of a (row, sample) that identical rows
    want."""
    wanted = run_wanted(run_dir) if wanted is None else wanted
    out: list[tuple[dict[str, Any], tuple[str, int], int]] = []
    counted: collections.Counter[tuple[str, int]] = collections.Counter()
    discards = run_dir / "discarded.jsonl"
    note_lines = lines_matter(discards)  # a kept record's line is held only beside discards
    kept_at: collections.Counter[Line] = collections.Counter()

    def take(rec: Any, kept: bool) -> None:
        if not valid_record(rec):
            return
        if kept and note_lines and (line := kept_line(rec)) is not None:
            kept_at[line] += 1
        key = record_sample(rec)
        if counted[key] < wanted.get(key, 1):
            out.append((rec, key, counted[key]))
            counted[key] += 1

    for rec in iter_jsonl(run_dir / "trajectories.jsonl"):
        take(rec, kept=True)
    # Partial samples --exclude_partial left in the batch files only: judged samples all the same (after
    # the discards, as the run's scores count them; their lines supersede discards too).
    # Only the lines that can be one are parsed: every kept record is in the batch files too, and parsing
    # them all again was a third of what a view of a 100,000-sample run cost.
    partial = [
        rec
        for _, path in batch_files(run_dir)
        for rec in iter_jsonl(path, PARTIAL_LINE)
        if isinstance(rec, dict) and rec.get("partial") is True and valid_record(rec)
    ]
    if note_lines:
        for rec in partial:
            if (line := kept_line(rec)) is not None:
                kept_at[line] += 1
        stale = superseded_discards(discards, kept_at)
        for n, row in enumerate(iter_jsonl(discards)):
            if n not in stale and valid_outcome_row(row, "reason") and isinstance(row.get("record"), dict):
                take(row["record"], kept=False)
    for rec in partial:
        take(rec, kept=False)
    return out


def has_scorer_error(rec: dict[str, Any]) -> bool:
    """Whether a sample's verdict in the run is a scorer error (what --only_errors judges again)."""
    return bool(read_score(rec.get("score")).get("error"))


def rescore(
    run_dir: Path,
    settings: ScoringSettings,
    name: str,
    judge: Any = None,
    distribution: str = "",
    concurrency: int = DEFAULT_CONCURRENCY,
    only_errors: bool = False,
    samples: list[tuple[dict[str, Any], tuple[str, int], int]] | None = None,
) -> dict[str, Any]:
    """Score every sample of the run again; write ``scores.<name>.jsonl`` and refresh statistics.json.
    What is written is redacted of the judge's key and its URL's credentials (an endpoint's error may
    quote them). With a ``judge``, up to ``concurrency`` samples are judged at once (one after another,
    10,000 samples at 2 s a verdict took 5.5 hours); the lines keep the samples' order.
    ``only_errors``: judge only the samples whose record's verdict is a scorer error, and keep every
    other record's (the caller checks that ``settings`` are the run's own: :func:`differs_from_run`);
    the summary then says how many were judged again (``judged_again``). ``samples``: the run's
    (:func:`run_samples`), when the caller has read them already."""
    from batchrun.secrets import Redactor

    # The judge's settings, not ``judge`` (its client): named alike, the client was shadowed and every
    # judge re-scoring was a scorer error ("'JudgeSettings' object has no attribute 'chat'").
    endpoint = settings.judge
    redact = Redactor.for_endpoint(endpoint.api_key, endpoint.base_url) if endpoint else Redactor(None)
    stats_path = run_dir / "statistics.json"
    stats = _stats_to_update(stats_path)  # before any write: one it cannot read is never replaced
    lines = []
    wanted = run_wanted(run_dir)
    scores = RunScores(distribution, wanted)
    samples = run_samples(run_dir, wanted) if samples is None else samples
    runaways = RunawayPatterns()  # an --answer_pattern that runs away on every answer is tried on a few

    # --only_errors: the samples whose verdict in the run stands (no scorer error) keep it.
    kept = [only_errors and not has_scorer_error(rec) for rec, _, _ in samples]

    def judged(item: tuple[tuple[dict[str, Any], tuple[str, int], int], bool]) -> dict[str, Any]:
        (rec, _, _), keep = item
        if keep:
            return rec.get("score")  # the run's own verdict (or its unscored), by the same scorers
        fields = (rec.get("metadata") or {}).get("row_fields")
        try:
            row = parse_json(fields or "{}")
        except ValueError:
            row = {}
        judgement = Judgement(
            check=check_from_row_fields(fields),
            settings=settings,
            row=row,
            judge=judge,
            prompt=first_human(rec["conversations"]) or "",
            runaways=runaways,
        )
        return score_sample(rec, judgement)

    verdicts = in_order(judged, list(zip(samples, kept, strict=True)), max(1, concurrency) if judge else 1)
    for (rec, (row_key, sample_index), _copy), score in zip(samples, verdicts, strict=True):
        meta = rec.get("metadata") or {}
        scores.add({**rec, "score": score}, row_key, sample_index)
        line = {
            "row_key": row_key,
            "sample_index": sample_index,
            "row_id": meta.get("row_id"),
            "score": score,
        }
        lines.append(json_line(line) + "\n")
    # Read again now, not kept from the start: a judge's re-scoring takes hours, and a --resume that ended
    # meanwhile had its statistics.json (its runs entry, its totals) replaced by the copy read before. main()
    # holds the run's lock, so no runner ends meanwhile there; rescore() called alone (the API) does not.
    stats = _stats_to_update(stats_path)
    write_text_atomic(run_dir / f"scores.{name}.jsonl", redact("".join(lines)))
    section = stats.setdefault("scores", {})
    # The run's samples without an outcome are no more judged by a re-scoring than by the run; nor are
    # those --stop_after_passes skipped (no record): the re-scoring's figures describe the kept data too.
    # Only those the re-scoring's scorers have something to judge by: a verify row's are nothing includes
    # can judge, and counted as not passed they capped its pass rate of planned as its unscored did. A run
    # whose statistics.json does not tell them by their rows' checks (older) gives its own count.
    by_check = section.get("samples_pending_by_check")
    judged = pending_judged(by_check, settings.scorers)
    pending = section.get("samples_pending") if judged is None else judged
    skipped = section.get("skipped_after_passes")
    summary = with_planned(
        {
            **scores.summary(skipped if type(skipped) is int else 0),
            "samples_pending": pending if type(pending) is int else 0,
            **({} if judged is None else {"samples_pending_by_check": by_check}),
        }
    )
    if only_errors:
        summary["judged_again"] = kept.count(False)  # the rest: the run's own verdicts
    section.setdefault("rescored", {})[name] = {
        **summary,
        "scorers": list(settings.scorers),
        **judging_of(settings),
        "only_errors": only_errors,
        "file": f"scores.{name}.jsonl",
    }
    write_json_atomic(stats_path, stats, redact)
    return summary


def judging_of(settings: ScoringSettings) -> dict[str, Any]:
    """What views.compare checks two sides' judging by, beside each sample's scorer (its
    JUDGING_SETTINGS), as a re-scoring's statistics.json entry and a run's manifest record them."""
    return {
        "answer_pattern": settings.answer_pattern,
        "answer_normalize": list(settings.normalize),
        "numeric_tolerance": settings.numeric_tolerance,
        "judge_model": settings.judge.model if settings.judge else None,
        # Which judge, where one model name is answered by several servers (never a key or login).
        "judge_base_url": judge_endpoint(settings.judge.base_url) if settings.judge else None,
    }


def differs_from_run(run_dir: Path, settings: ScoringSettings) -> str | None:
    """Why ``settings`` cannot judge again only a run's scorer errors beside its other verdicts (the
    run's manifest names other scorers, or another setting they use: the two kinds of verdicts would be
    mixed in one pass rate), or None when they are the run's own."""
    from batchrun.views.compare import JUDGING_SETTINGS, judging_settings

    manifest = read_json_object(run_dir / "run_manifest.json")
    if manifest is None:
        return f"{run_dir / 'run_manifest.json'} is missing or damaged: the run's own scorers are unknown"
    theirs = manifest.get("scorer")
    if not isinstance(theirs, list) or theirs != list(settings.scorers):
        ran = ",".join(map(str, theirs)) if isinstance(theirs, list) and theirs else "auto (the rows' checks)"
        return f"the run judged with --scorer={ran}, not --scorer={','.join(settings.scorers)}"
    run, ours = judging_settings(run_dir), judging_of(settings)
    for key, users in JUDGING_SETTINGS.items():
        if key in run and any(n in users for n in settings.scorers) and run[key] != ours[key]:
            return f"the run judged with --{key}={_shown(run[key])}, not --{key}={_shown(ours[key])}"
    return None


def rejudge_command(run_dir: Path) -> str | None:
    """The re-scoring that judges again a judged run's scorer errors (``--only_errors``, the run's
    scorers and settings from its manifest), or None when the run has no judge among its scorers (the
    other scorers' errors are their answers' own: judged again, they are the same). Not redacted."""
    import shlex

    manifest = read_json_object(run_dir / "run_manifest.json") or {}
    scorers = manifest.get("scorer")
    if not isinstance(scorers, list) or "judge" not in scorers:
        return None
    if not manifest.get("judge_model") or not manifest.get("judge_base_url"):
        return None  # a manifest older than its judge_base_url: the judge is not known
    words = ["python", "-m", "batchrun.views.score", str(run_dir), f"--scorer={','.join(map(str, scorers))}"]
    if manifest.get("answer_pattern") is not None:
        words.append(f"--answer_pattern={manifest['answer_pattern']}")
    normalize = manifest.get("answer_normalize")
    if isinstance(normalize, list) and tuple(normalize) != NORMALIZE_STEPS:
        words.append(f"--answer_normalize={','.join(map(str, normalize)) or 'none'}")
    tolerance = manifest.get("numeric_tolerance")
    if tolerance is not None and tolerance != ScoringSettings.numeric_tolerance:
        words.append(f"--numeric_tolerance={tolerance}")
    words += [
        f"--judge_model={manifest.get('judge_model')}",
        f"--judge_base_url={manifest.get('judge_base_url')}",
    ]
    return shlex.join([*words, "--only_errors"])


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return "(unset)" if value is None else str(value)


def in_order(fn: Callable[[T], R], items: list[T], workers: int) -> list[R]:
    """``fn`` of each item, up to ``workers`` at once, in the items' order; the first error is raised once
    the calls under way are over, and no further one starts. The threads are daemons: a Ctrl-C (or any
    exception in the caller) returns at once, no further call starts, and the process exits without
    waiting for the calls under way (a ThreadPoolExecutor's threads are joined at exit: against a judge
    that hangs, Ctrl-C and a second one left views.score running, each call up to 4 x 600 s)."""
    if workers <= 1:
        return [fn(item) for item in items]
    results: list[Any] = [None] * len(items)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()
    taken = iter(range(len(items)))
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                i = next(taken, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - raised by the caller's thread
                with lock:
                    errors.append((i, exc))
                stop.set()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(workers, len(items)))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # a join with a timeout: Ctrl-C is taken at once
                t.join(0.25)
    finally:
        stop.set()
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return results


def _stats_to_update(path: Path) -> dict[str, Any]:
    """The run's statistics.json, to add a re-scoring to: {} when there is none. ValueError when it
    cannot be read (torn, edited): rewritten, it would lose the run's totals and runs history."""
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
    try:
        stats = parse_json(text)
    except ValueError:
        stats = None
    scores = stats.get("scores", {}) if isinstance(stats, dict) else None
    if not isinstance(scores, dict) or not isinstance(scores.get("rescored", {}), dict):
        raise ValueError(
            f"{path} is not a statistics.json this batch-runner can read (torn, or edited): left as it "
            "is, nothing re-scored"
        )
    return stats


def judge_client(settings: JudgeSettings, key_variable: str = "JUDGE_API_KEY") -> Any:
    """The judge's model client: the runner's own (retries, timeouts, bounds on what it reads), once the
    judge has passed the run's start check (a UsageError says why not). A judge that cannot answer (a
    wrong URL, key or model name, a dead server) made every sample a scorer error, each after its
    retries (3.4 s a sample against a closed port: a day for 25,000), and exit 0. ``key_variable``: the
    variable the key is read from (--judge_api_key_env), named when the judge wants a key it was not given."""
    from batchrun.prompt.llm import LLMClient, LLMConfig
    from batchrun.run.preflight import check_endpoint, judge_key_hint

    cfg = LLMConfig(
        model=settings.model,
        base_url=settings.base_url,
        api_key=settings.api_key,
        max_tokens=settings.max_tokens,
        temperature=0.0,
    )
    # A judge still loading its model (llama-server answers 503 meanwhile) is waited for, as a run waits:
    # started beside one, views.score exited 2 at once.
    check_endpoint(
        cfg, who="the judge's endpoint", key_hint=judge_key_hint(key_variable), grace_s=JUDGE_GRACE_S
    )
    watch = JudgeWatch(cfg, JUDGE_GRACE_S)
    watch.client = LLMClient(cfg, stop=watch.stop, on_failure=watch)
    return watch.client


class JudgeWatch:
    """The run's dead-endpoint stop (batchrun.run.endpoint_watch.EndpointWatch, its rule and figures) for a
    re-scoring's judge: after ``DEAD_AFTER`` attempts in a row that failed for the endpoint's reasons
    (refused, reset, timed out, 5xx), every judge call is held (the client's limiter paused) and the judge
    probed (the start check's call) for up to ``grace_s``, as a run waits --endpoint_grace for its
    endpoint; an answer lets the calls go on, none sets ``stop``: every further judge call raises
    BudgetStop before it is sent, and the re-scoring ends writing nothing (exit 5). The same after
    ``REFUSED_AFTER`` calls in a row refused (401-404, a spent quota) and probes refused for ``grace_s``
    (exit 8). A judge that died mid-way made every remaining sample a scorer error after its retries (36 of 64 samples, 27 s at
    --concurrency=4; 10,000 would take hours), written as the re-scoring, exit 0. What the run's dispatch
    loop does for its watch (report each attempt, tick while it probes) is done here by the judge's own
    threads and a ticking thread."""

    TICK_S = 0.25

    def __init__(self, cfg: Any, grace_s: float) -> None:
        from batchrun.run.endpoint_watch import RESCORING_JUDGE, EndpointWatch
        from batchrun.secrets import Redactor

        self.client: Any = None  # the judge's client, whose calls are held while the judge is probed
        self.stop = threading.Event()
        self.watch = EndpointWatch(cfg, grace_s, pause=self._pause, lift=self._lift, words=RESCORING_JUDGE)
        self._lock = threading.Lock()  # the watch is the dispatch loop's, one thread's: here several report
        self.redact = Redactor.for_endpoint(cfg.api_key, cfg.base_url)  # the judge's key, and its URL's login

    def __call__(self, error_class: str | None, refused: bool = False, sent_at: float | None = None) -> None:
        """LLMClient's ``on_failure``: told after each attempt (None: it was answered; ``refused``: the
        key or the account refused it)."""
        with self._lock:
            if self.stop.is_set():
                return
            before = self.watch.probing_since
            self._say(self.watch.report(error_class, refused, sent_at))
            # The watch began probing (a line says so only the first time refusals start it: the second
            # time, in a re-scoring of many flagged samples, no ticking began, and the probe's answer
            # never lifted the pause, which ran its 15 s at each renewal).
            started = before is None and self.watch.probing_since is not None
        if started:
            threading.Thread(target=self._tick, name="judge-probe", daemon=True).start()

    def _say(self, line: str | None) -> None:
        """A watch's line on the console, redacted (a refusal quotes the endpoint, which may quote the
        key): the re-scoring said nothing while its judge was probed for up to 120 s, the refusal's words
        shown only at its end. Its stop's own line is main's, said once it has written nothing."""
        if line and not line.startswith("error:"):
            from batchrun.secrets import terminal_safe

            print(terminal_safe(self.redact(line)), file=sys.stderr, flush=True)

    def _tick(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            with self._lock:
                self._say(self.watch.tick())
                if self.watch.dead:
                    self.stop.set()  # before the calls are let go: each raises BudgetStop unsent
                    self.watch.lift_pause()
                    return
                if self.watch.probing_since is None:  # it answered: the watch lifted the pause
                    return

    def _pause(self, until: float) -> None:
        if self.client is not None:
            self.client.limiter.pause_until(until)

    def _lift(self, until: float) -> None:
        if self.client is not None:
            self.client.limiter.lift(until)


def main(argv: list[str] | None = None) -> int:
    parser = ViewParser(
        prog="python -m batchrun.views.score", description="Re-score a finished run (no agent calls)."
    )
    parser.add_argument("run_dir", type=Path, help="the run's directory, e.g. data/my_run")
    parser.add_argument(
        "--scorer",
        required=True,
        help="exact, includes, regex, numeric, json, judge, or your own module:function or entry point "
        "(called with sandbox None), comma-separated; not verify: the sandbox is gone",
    )
    parser.add_argument("--name", help="label of the new scores (default: the scorers' names)")
    parser.add_argument("--answer_pattern", help="regex extracting the answer (group 1, last match)")
    parser.add_argument(
        "--answer_normalize", default=",".join(NORMALIZE_STEPS), help="case,whitespace,punctuation or none"
    )
    parser.add_argument("--numeric_tolerance", default="1e-6", help="as the run's flag (0 to 1)")
    parser.add_argument(
        "--verify_timeout",
        help="seconds --answer_pattern and the regex scorer may search one sample's answer (default: the "
        "run's --verify_timeout, from its run_manifest.json)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        help=f"samples judged at once by --scorer=judge (1 to {MAX_CONCURRENCY}, default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument(
        "--only_errors",
        action="store_true",
        help="judge again only the samples whose verdict in the run is a scorer error (a judge refused or "
        "down mid-run); the others keep the run's verdict. The scorers and settings must be the run's own",
    )
    parser.add_argument("--judge_model")
    parser.add_argument("--judge_base_url")
    parser.add_argument(
        "--judge_api_key_env", default="JUDGE_API_KEY", help="variable holding the judge's key"
    )
    args = parser.parse_args(argv)
    if args.concurrency is not None and not 1 <= args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--concurrency must be from 1 to {MAX_CONCURRENCY}, not {args.concurrency}")
    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.concurrency is not None and settings.judge is None:
        # A flag that would do nothing is a mistake the user would want to hear of (as the runner's).
        print("error: --concurrency applies only with the judge scorer (--scorer=judge)", file=sys.stderr)
        return 2
    concurrency = DEFAULT_CONCURRENCY if args.concurrency is None else args.concurrency
    problem = check_run_dir(args.run_dir)  # first: one this user cannot read raised on the check below
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not (args.run_dir / "trajectories.jsonl").is_file():
        print(
            f"error: {args.run_dir} holds no trajectories.jsonl (is it a finished run's directory?)",
            file=sys.stderr,
        )
        return 2
    name = args.name or "+".join(s.replace(":", "_") for s in settings.scorers)
    if len(name) > MAX_NAME:
        print(
            f"error: --name: at most {MAX_NAME} characters (scores.<name>.jsonl is a file name), not "
            f"{len(name)}" + ("" if args.name else ": the scorers' names make it; give a shorter --name"),
            file=sys.stderr,
        )
        return 2
    if args.only_errors:
        differs = differs_from_run(args.run_dir, settings)
        if differs:  # before the judge's start check: nothing is asked of it
            print(
                f"error: --only_errors keeps the run's own verdicts beside the new ones, so it judges as the "
                f"run did, and {differs}; without --only_errors every sample is judged again",
                file=sys.stderr,
            )
            return 2
    stats = _read_stats(args.run_dir)
    from batchrun.prompt.llm import BudgetStop, safe_url
    from batchrun.run.endpoint_watch import (
        DEAD_AFTER,
        EXIT_ENDPOINT_DEAD,
        EXIT_ENDPOINT_REFUSED,
        REFUSED_AFTER,
        refused_means,
    )

    try:
        # Held while it reads and writes: a runner finishing meanwhile replaced statistics.json, and this
        # re-scoring's copy (read before) then replaced the runner's, its invocation and totals gone. Taken
        # before the judge's start check: a run directory a runner is resuming cost a judge call, then exit 2.
        with holding(args.run_dir, "python -m batchrun.views.score"):
            replaced = (args.run_dir / f"scores.{name}.jsonl").exists()
            # Before any judge call: a read-only run directory refused the verdicts of every call made.
            for path in (args.run_dir / f"scores.{name}.jsonl", args.run_dir / "statistics.json"):
                if problem := cannot_write(path):
                    print(f"error: {problem}; nothing re-scored", file=sys.stderr)
                    return 2
            judge = None
            # --only_errors on a run with no scorer error judges nothing: the judge is not asked (its start
            # check cost a call, and a judge gone since the run failed a re-scoring that needs none). The
            # samples read for that are the re-scoring's: the run is read once.
            samples = run_samples(args.run_dir) if args.only_errors else None
            if settings.judge is not None and not (
                samples is not None and not any(has_scorer_error(rec) for rec, _, _ in samples)
            ):
                from batchrun.secrets import Redactor

                try:
                    judge = judge_client(settings.judge, args.judge_api_key_env)
                except ValueError as exc:  # the start check's refusal: nothing judged, nothing written
                    redact = Redactor.for_endpoint(settings.judge.api_key, settings.judge.base_url)
                    print(f"error: {redact(str(exc))}; nothing re-scored", file=sys.stderr)
                    return 2
                except KeyboardInterrupt:  # while the start check waits for a judge loading its model
                    print("\nInterrupted: nothing re-scored", file=sys.stderr)
                    return 130
            summary = rescore(
                args.run_dir,
                settings,
                name,
                judge,
                stats.get("distribution", ""),
                concurrency,
                only_errors=args.only_errors,
                samples=samples,
            )
    except RunDirBusy as exc:
        print(
            f"error: {exc}; re-score when it has ended (its samples are not all there yet)", file=sys.stderr
        )
        return 2
    except (
        WriteError,
        ValueError,
    ) as exc:  # a read-only run directory, a full disk; a damaged statistics.json
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BudgetStop:  # JudgeWatch: the judge stopped answering mid-way, or refused its key
        shown = safe_url(settings.judge.base_url) if settings.judge else ""
        watch = getattr(judge, "on_failure", None)
        refused = watch.watch.refused if isinstance(watch, JudgeWatch) else None
        if refused is not None:
            from batchrun.secrets import terminal_safe

            print(
                f"error: the judge's endpoint {shown} refused {REFUSED_AFTER} calls in a row, then its "
                f"probes for {JUDGE_GRACE_S:g} s ({terminal_safe(watch.redact(refused))[:300]}): "
                f"{refused_means('its key', 'its model', 'the re-scoring', 'that grace')}; nothing "
                "re-scored: run it again once that is fixed",
                file=sys.stderr,
            )
            return EXIT_ENDPOINT_REFUSED
        print(
            f"error: the judge's endpoint {shown} stopped answering ({DEAD_AFTER} attempts in a row failed, "
            "and a probe); nothing re-scored: run it again once the judge is back",
            file=sys.stderr,
        )
        return EXIT_ENDPOINT_DEAD
    except KeyboardInterrupt:  # the judge calls under way are left unanswered: nothing is written
        print(f"\nInterrupted: nothing re-scored ({name})", file=sys.stderr)
        return 130
    if args.only_errors:
        print(
            f"Judged again: {summary['judged_again']} sample(s) whose verdict in the run was a scorer error; "
            "every other sample keeps the run's verdict"
            + ("" if summary["judged_again"] else " (the judge was not asked anything)")
        )
    print(headline(summary) or "Scores: no sample could be judged by these scorers")
    old = (stats.get("scores") or {}).get("pass_rate")
    if old is not None and summary["pass_rate"] is not None:
        print(f"The run's own scores: pass rate {old:.1%}; re-scored ({name}): {summary['pass_rate']:.1%}")
    print(
        f"Wrote {args.run_dir / f'scores.{name}.jsonl'}; statistics.json scores.rescored.{name}"
        + (" (replacing the earlier re-scoring of that name: --name keeps both)" if replaced else "")
    )
    return 0


def _settings(args: argparse.Namespace) -> ScoringSettings:
    scorers = parse_scorers(args.scorer)
    if not scorers:
        raise ValueError("--scorer names no scorer")
    needs_box = [s for s in scorers if s in SANDBOX_SCORERS]
    if needs_box:
        raise ValueError(
            f"--scorer={needs_box[0]} needs the prompt's sandbox, which is gone; re-run the samples"
        )
    if args.name is not None and (problem := scores_name_problem("--name", args.name)):
        raise ValueError(problem)
    from batchrun.config import (
        MAX_DURATION_S,
        check_judge_key,
        check_judge_key_env,
        float_flag,
        is_http_url,
        judge_flags_given,
        normalize_flag,
        regex_flag,
    )

    # The run's own flag readers: an empty pattern (a pattern of nothing) and ",," (no step named) were
    # taken for none here, refused by the runner.
    answer_pattern = regex_flag(args.answer_pattern, "answer_pattern")

    # As the run's flag reads it: a NaN or a negative tolerance failed every numeric answer, right ones too,
    # and one above 1 passed answers off by more than the answer itself.
    tolerance = float_flag(0, 1)(args.numeric_tolerance, "numeric_tolerance")
    # The run's own bound unless given: a pattern that backtracks on every answer held each sample the
    # default 60 s, one after another (a run judged with --verify_timeout=1: 2 samples took 120 s).
    timeout = args.verify_timeout
    read_timeout = float_flag(0, MAX_DURATION_S, low_open=True)
    if timeout is None:
        manifest = read_json_object(args.run_dir / "run_manifest.json") or {}
        try:
            verify_timeout = read_timeout(manifest.get("verify_timeout", 60.0), "verify_timeout")
        except ValueError as exc:  # a damaged manifest's, not a flag the user gave
            raise ValueError(
                f"{args.run_dir / 'run_manifest.json'}: its verify_timeout is not one a run writes ({exc}); "
                "give --verify_timeout"
            ) from None
    else:
        verify_timeout = read_timeout(timeout, "verify_timeout")
    steps = normalize_flag(args.answer_normalize, "answer_normalize")
    judge_settings = None
    # The judge's flags as the runner checks them (one without the judge scorer: a forgotten --scorer=judge).
    check_judge_key_env(args.judge_api_key_env)
    if "judge" not in scorers:
        given = judge_flags_given(args.judge_model, args.judge_base_url, args.judge_api_key_env)
        if given:
            raise ValueError(f"--{given[0]} applies only with the judge scorer (--scorer=judge)")
    else:
        if not args.judge_model or not args.judge_base_url:
            raise ValueError("--scorer=judge needs --judge_model and --judge_base_url")
        if not is_http_url(args.judge_base_url):
            raise ValueError("--judge_base_url must be an http:// or https:// URL with a host")
        key = os.environ.get(args.judge_api_key_env) or None
        check_judge_key(args.judge_api_key_env, args.judge_base_url, key)
        judge_settings = JudgeSettings(args.judge_model, args.judge_base_url, key)
    return ScoringSettings(
        scorers=scorers,
        answer_pattern=answer_pattern,
        numeric_tolerance=tolerance,
        normalize=steps,
        verify_timeout_s=verify_timeout,
        judge=judge_settings,
    )


def _read_stats(run_dir: Path) -> dict[str, Any]:
    try:
        stats = parse_json((run_dir / "statistics.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


if __name__ == "__main__":
    raise SystemExit(main())
