"""batchrun/run/finish.py: merge, statistics and the report skip and count lines of the wrong shape."""

from __future__ import annotations

import collections
import json
import os
import re
import time

import pytest
from helpers import read_jsonl, run, stats_of, write_jsonl, write_rows

from batchrun.identity import record_sample
from batchrun.record import read_score, valid_record
from batchrun.run import finish
from batchrun.run.recorder import Recorder
from batchrun.scoring import with_planned
from batchrun.secrets import Redactor
from batchrun.views.report import RunData, add_trajectory, collect, render_page

GARBAGE_RECORDS = [
    "null",
    "[1, 2]",
    '"text"',
    '{"conversations": "x"}',
    '{"conversations": [null]}',
    '{"conversations": [{"from": "human", "value": 5}]}',
    '{"conversations": [{"from": "human", "value": "p"}], "tool_stats": 5}',
    '{"conversations": [{"from": "human", "value": "p"}], "tool_stats": {"terminal": {"count": "x"}}}',
    '{"conversations": [{"from": "gpt", "value": "p", "tool_calls": [{"function": 3}]}]}',
    '{"conversations": [{"from": "human", "value": "p"}], "metadata": []}',
    '{"conversations": [{"from": "human", "value": "p"}], "prompt_index": "3"}',
]
GARBAGE_ROWS = [
    "null",
    "[]",
    '{"prompt": 5, "reason": "x"}',
    '{"prompt": "p", "reason": 3}',
    '{"prompt": "p"}',
]


def test_valid_json_of_the_wrong_shape_is_skipped_and_counted_everywhere(server, tmp_path):
    dataset = write_jsonl(
        tmp_path / "d.jsonl", ["one thing", "two things", "three [no_reasoning]", "x [error:500]"]
    )
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    good = read_jsonl(run_dir / "trajectories.jsonl")
    assert all(valid_record(r) for r in good)
    for name, lines in (
        ("batch_0.jsonl", GARBAGE_RECORDS),
        ("discarded.jsonl", GARBAGE_ROWS),
        ("failed.jsonl", GARBAGE_ROWS),
    ):
        with (run_dir / name).open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))

    before = collections.Counter(server.stats()["requests_by_prompt"])
    run(server, dataset, out, resume=True)  # no crash
    assert set(collections.Counter(server.stats()["requests_by_prompt"]) - before) == {"x [error:500]"}
    run(server, dataset, out, resume=True)  # and again: nothing it wrote breaks the next resume
    assert read_jsonl(run_dir / "trajectories.jsonl") == good
    stats = stats_of(run_dir)
    assert stats["dropped_at_merge"]["invalid_lines"] == len(GARBAGE_RECORDS)
    assert stats["invalid_lines_skipped"] == {
        "batch_files": len(GARBAGE_RECORDS),
        "discarded.jsonl": len(GARBAGE_ROWS),
        "failed.jsonl": len(GARBAGE_ROWS),
    }
    assert stats["discarded"]["total"] == 1
    assert stats["failed_attempts"]["by_class"] == {"http_500": 3}
    # the finished prompts: both trajectories and the discard, not the failure nor any garbage line
    assert sorted(json.loads((run_dir / "checkpoint.json").read_text())["completed_prompts"]) == [0, 1, 2]
    # The report reads the batch files when they are newer than the merge: make them so.
    os.utime(run_dir / "batch_0.jsonl", (time.time() + 5, time.time() + 5))
    data = collect(run_dir)
    assert data.trajectories == 2
    assert data.invalid_lines == len(GARBAGE_RECORDS) + 2 * len(GARBAGE_ROWS)
    assert (run_dir / "report.html").is_file()


def _mock_run(dataset, out, run_name: str = "q", **kw):
    """A run with the built-in mock model; returns its run directory."""
    run(None, dataset, out, run_name, **{"num_workers": 1, **kw})
    return out / run_name


def test_resume_with_nothing_to_do_keeps_the_run_totals_and_zeroes_this_run(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["One [calls:1]", "Two [calls:0]", "Three [calls:2]"])
    out = tmp_path / "data"
    run_dir = _mock_run(dataset, out, batch_size=2)
    first = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    _mock_run(dataset, out, batch_size=2, resume=True)
    second = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    t1, t2 = first["run_totals"], second["run_totals"]
    assert t1["requests"] == first["this_run"]["api_calls"] > 0
    for key in ("requests", "prompt_tokens", "completion_tokens", "total_tokens", "cost_usd", "trajectories"):
        assert t2[key] == t1[key], key
    assert t2["runs"] == 2 and len(second["runs"]) == 2 and second["runs"][0] == first["runs"][0]
    assert second["duration_seconds"] >= first["duration_seconds"]
    tr = second["this_run"]
    assert tr["attempted"] == 0 and tr["api_calls"] == 0 and tr["usage"].get("prompt_tokens", 0) == 0
    assert second["runs"][1]["requests"] == 0 and second["runs"][1]["prompt_tokens"] == 0
    # The reference runner's names and shapes, beside ours.
    assert second["total_batches"] == 2 and second["batch_size"] == 2 and second["total_prompts"] == 3
    assert isinstance(second["completed_at"], str)
    term = second["tool_statistics"]["terminal"]
    assert set(term) == {"count", "success", "failure", "success_rate", "failure_rate"}
    assert term["count"] == first["tool_stats"]["terminal"]["count"] > 0
    assert term["success_rate"] + term["failure_rate"] == 100.0
    assert "patch" not in second["tool_statistics"]  # never called: no rate at all, as the reference lists
    rs = second["reasoning_statistics"]
    assert rs["total_assistant_turns"] == rs["turns_with_reasoning"] + rs["turns_without_reasoning"] == 6
    assert rs["coverage"] == 1.0


def test_a_resume_over_a_hand_edited_infinity_in_the_runs_history_writes_its_statistics(tmp_path):
    """Python's reader takes Infinity (and 1e999) in a hand-edited statistics.json: run_totals summed it
    and the end of the resume failed with OverflowError (cannot convert float infinity to integer), after
    its calls, with no statistics.json written; an infinite duration_s would be written as Infinity."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["One [calls:1]", "Two [calls:0]"])
    run_dir = _mock_run(dataset, tmp_path / "data")
    path = run_dir / "statistics.json"
    text = path.read_text("utf-8")
    text = re.sub(r'("runs": \[\s*\{[^}]*?"duration_s": )[\d.]+', r"\g<1>Infinity", text)
    path.write_text(re.sub(r'("runs": \[\s*\{[^}]*?"prompt_tokens": )\d+', r"\g<1>1e999", text), "utf-8")
    _mock_run(dataset, tmp_path / "data", resume=True)
    stats = json.loads(path.read_text("utf-8"), parse_constant=lambda name: pytest.fail(name))
    assert stats["run_totals"]["runs"] == 2
    assert stats["run_totals"]["prompt_tokens"] == 0  # counted as nothing: the resume warns of it
    assert stats["duration_seconds"] == stats["run_totals"]["duration_s"] < 1e6


def test_a_resume_over_numbers_no_column_holds_in_a_records_metadata_ends_and_loads(tmp_path):
    """A record another tool wrote (or a hand edited) with a count past a double (10**400), past an int64
    column (10**30) or ``usage.providers`` of another shape (5) ended every resume in a traceback (exit 1:
    OverflowError in the spend's sum, TypeError typing the usage), after which nothing could finish the run.
    Such a count is now not reported (0, named in ``usage.unreported``), as a NaN is."""
    datasets = pytest.importorskip("datasets")
    dataset = write_jsonl(tmp_path / "d.jsonl", ["One [calls:1]", "Two [calls:1]", "Three [calls:1]"])
    out = tmp_path / "data"
    run_dir = _mock_run(dataset, out, batch_size=3)
    path = run_dir / "batch_0.jsonl"
    recs = sorted(read_jsonl(path), key=lambda r: r["prompt_index"])
    recs[0]["metadata"]["usage"]["prompt_tokens"] = 10**400
    recs[1]["metadata"]["prompt_tokens"] = 10**30
    recs[1]["metadata"]["usage"]["completion_tokens"] = -(10**25)
    recs[2]["metadata"]["usage"]["providers"] = 5
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), "utf-8")
    _mock_run(dataset, out, batch_size=3, resume=True)
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["trajectories"] == 3 and stats["this_run"]["api_calls"] == 0
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    usage = {r["prompt_index"]: r["metadata"]["usage"] for r in kept}
    assert usage[0]["prompt_tokens"] == 0 and "prompt_tokens" in json.loads(usage[0]["unreported"])
    assert usage[1]["completion_tokens"] == 0 and "completion_tokens" in json.loads(usage[1]["unreported"])
    assert {r["prompt_index"]: r["metadata"]["prompt_tokens"] for r in kept}[1] == 0
    assert usage[2]["providers"] == "[]"
    rows = datasets.load_dataset("json", data_files=str(run_dir / "trajectories.jsonl"), split="train")
    assert rows.num_rows == 3


def test_scores_and_report_fed_by_the_merge_equal_those_read_back_from_the_files(server, tmp_path):
    """The merge hands each record it writes to the scores section and the report (finish.KeptFeed), so
    neither reads trajectories.jsonl again: what they make must be what reading the files makes, with
    kept and discarded samples, passed, failed and unscored ones, and a record of older metadata types
    (retyped on its way into trajectories.jsonl)."""
    rows = [
        {"prompt": "Right one [answer:4] [calls:1]", "answer": "4", "id": 1},
        {"prompt": "Wrong one [answer:5] [calls:0]", "answer": "4", "id": 2},
        {"prompt": "Unscored [calls:1]"},
        {"prompt": "Thinks not [no_reasoning]", "answer": "1"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, samples_per_prompt=2, scorer="includes")
    batch = run_dir / "batch_0.jsonl"  # a record as a version before format 1 wrote it: a null field
    recs = read_jsonl(batch)
    recs[0]["metadata"]["row_id"] = None
    batch.write_text("".join(json.dumps(r) + "\n" for r in recs), "utf-8")
    run(server, dataset, out, samples_per_prompt=2, scorer="includes", resume=True)

    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert {read_score(r["score"])["status"] for r in merged} == {"passed", "failed", "unscored"}
    discarded = [r for r in read_jsonl(run_dir / "discarded.jsonl") if r["reason"] == "no_reasoning"]
    assert len(discarded) == 2
    # The same sections read back from the files (no duplicate rows: each sample counts once).
    scores = finish.kept_scores(run_dir, "terminal_only")
    for row in discarded:
        scores.add(row["record"], *record_sample(row["record"]))
    expected = with_planned(
        {**scores.summary(0), "samples_pending": 0, "samples_pending_by_check": {}, "duplicate_samples": []}
    )
    assert stats_of(run_dir)["scores"] == json.loads(json.dumps(expected))
    # The same page, but for when it was generated (to the second: the two may fall in different seconds).
    stamp = re.compile(r"generated \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
    written, again = (run_dir / "report.html").read_text("utf-8"), render_page(collect(run_dir))
    assert stamp.search(written) and stamp.sub("generated", written) == stamp.sub("generated", again)


def test_report_entries_prepared_during_the_dispatch_are_those_the_merge_would_make(server, tmp_path):
    """The runner works out each kept line's report entry when it writes the line (finish.PreparedLines)
    and the merge uses it only for a line exactly as written: the list, its system preambles (numbered
    in file order) and a line changed since are as reading the files makes them."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing", "two things [calls:2]", "three things"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    lines = (run_dir / "batch_0.jsonl").read_bytes().splitlines(keepends=True)
    recs = [json.loads(line) for line in lines]
    recs[1]["conversations"][0]["value"] = "Another preamble."  # two system texts: s0 and s1
    lines[1] = (json.dumps(recs[1], ensure_ascii=False) + "\n").encode()
    prepared = finish.PreparedLines(limit=10)
    for i in (1, 0, 2):  # told in another order than the file's (workers finish in any order)
        prepared(lines[i].rstrip(b"\n"))
    changed = dict(recs[2], api_calls=recs[2]["api_calls"] + 7)
    lines[2] = (json.dumps(changed, ensure_ascii=False) + "\n").encode()  # not as it was written

    fed, read = RunData(run_dir=run_dir, max_items=10), RunData(run_dir=run_dir, max_items=10)
    for line in lines:
        rec = json.loads(line)
        ready = prepared.take(line)
        assert (ready is None) == (line is lines[2])
        add_trajectory(fed, rec, ready.item if ready else None)
        add_trajectory(read, rec)
    assert fed.items == read.items and fed.systems == read.systems
    assert [t["ref"] for item in fed.items for t in item["t"] if t["k"] == "s"] == ["s0", "s1", "s0"]
    assert fed.systems["s1"]["v"] == "Another preamble."
    assert fed.items[2]["n"] == recs[2]["api_calls"] + 7
    assert prepared.take(lines[0]) is None  # taken once


def test_prepared_lines_list_up_to_their_limit_and_check_the_rest(server, tmp_path, monkeypatch):
    """Past the report's limit a written line is still checked (held by a digest, no report entry);
    the merge takes that only for the same bytes, once; past MAX_CHECKED nothing is held."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing", "two things", "three things", "four things"])
    out = tmp_path / "data"
    run(server, dataset, out)
    lines = (out / "run" / "batch_0.jsonl").read_bytes().splitlines()
    monkeypatch.setattr(finish.PreparedLines, "MAX_CHECKED", 2)
    prepared = finish.PreparedLines(limit=1)
    for line in lines:
        prepared(line)
    listed = prepared.take(lines[0])
    assert listed is not None and listed.item is not None
    changed = lines[1].replace(b'"api_calls": ', b'"api_calls": 1')  # not the line as written
    assert changed != lines[1] and prepared.take(changed) is None
    assert prepared.take(lines[1][:-5]) is None  # torn
    checked = prepared.take(lines[1] + b"\n")
    assert checked is not None and checked.item is None
    assert prepared.take(lines[1]) is None  # taken once
    assert prepared.take(lines[2]) is not None  # the second line past the limit
    assert prepared.take(lines[3]) is None  # past MAX_CHECKED: the merge checks it itself


def test_the_merge_checks_a_line_not_as_it_was_written_past_the_limit(server, tmp_path):
    """A line past the report's limit that changed after it was written (here: torn into invalid
    JSON, and another retyped) is worked out by the merge as if nothing had been prepared."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing", "two things", "three things"])
    out = tmp_path / "data"
    run(server, dataset, out)
    run_dir = out / "run"
    batch = run_dir / "batch_0.jsonl"
    lines = batch.read_bytes().splitlines(keepends=True)
    prepared = finish.PreparedLines(limit=1)
    for line in lines:
        prepared(line)
    rec = json.loads(lines[2])
    rec["metadata"]["row_id"] = None  # not in the schema's types: the merge must retype it
    lines[1] = lines[1][: len(lines[1]) // 2] + b"\n"
    lines[2] = (json.dumps(rec) + "\n").encode()
    batch.write_bytes(b"".join(lines))
    recorder = Recorder(run_dir, "run", Redactor(None))
    totals = finish.merge(run_dir, [], recorder, prepared=prepared)
    assert totals.dropped["invalid_lines"] == 1
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(merged) == 2 and merged[1]["metadata"]["row_id"] == ""


def test_no_copy_of_the_data_is_left_by_an_interrupted_or_killed_merge(server, tmp_path, monkeypatch):
    """A merge interrupted (Ctrl-C, SIGTERM) removes its temp file; one a runner killed outright (SIGKILL)
    left, a whole copy of trajectories.jsonl, is removed by the next run of the name."""
    import subprocess
    import sys

    dataset = write_jsonl(tmp_path / "d.jsonl", ["one task", "two task"])
    out = tmp_path / "data"
    run(server, dataset, out)
    run_dir = out / "run"
    merged = (run_dir / "trajectories.jsonl").read_bytes()
    names = sorted(p.name for p in run_dir.iterdir())

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = run_dir / f".trajectories.jsonl.{int(dead.stdout)}.tmp"
    stale.write_bytes(merged[: len(merged) // 2])
    run(server, dataset, out, resume=True)
    assert sorted(p.name for p in run_dir.iterdir()) == names

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    recorder = Recorder(run_dir, "run", Redactor(None))
    try:
        finish.merge(run_dir, [], recorder)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the merge was not interrupted")
    assert sorted(p.name for p in run_dir.iterdir()) == names
    assert (run_dir / "trajectories.jsonl").read_bytes() == merged


def test_the_spend_of_an_invocation_killed_before_its_statistics_stays_in_the_run_totals(tmp_path):
    """kill -9 (or a lost machine) leaves no statistics.json for that invocation: the resume's
    run_totals left out what it had spent. Its last status.json says it, as a lower bound."""
    import signal
    import subprocess
    import sys

    from helpers import ROOT

    dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [slow:0.3]" for i in range(8)])
    out = tmp_path / "data"
    args = [
        sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=2",
        "--run_name=run", f"--output_dir={out}", "--model=mock", "--distribution=terminal_only",
        "--num_workers=1", "--prompts_per_worker=2", "--max_failure_rate=1",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    status_path = out / "run" / "status.json"
    try:
        deadline = time.monotonic() + 120
        status: dict = {}
        while time.monotonic() < deadline and not status.get("api_calls"):
            time.sleep(0.05)
            try:
                status = json.loads(status_path.read_text("utf-8"))
            except (OSError, ValueError):
                status = {}
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    status = json.loads(status_path.read_text("utf-8"))  # the last one it wrote
    assert status["state"] == "running" and status["api_calls"] > 0
    assert not (out / "run" / "statistics.json").exists()
    resumed = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    stats = stats_of(out / "run")
    killed, resume = stats["runs"]
    assert killed["started_at"] == status["started_at"] and "last status: running" in killed["ended"]
    assert killed["requests"] == status["api_calls"]
    assert killed["prompt_tokens"] == status["prompt_tokens"] > 0
    assert "ended" not in resume
    assert stats["run_totals"]["runs"] == 2
    assert stats["run_totals"]["requests"] == killed["requests"] + resume["requests"]
    # A third invocation with nothing left counts the killed one once, from statistics.json now.
    subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=120, check=True)
    assert [r["started_at"] for r in stats_of(out / "run")["runs"][:2]] == [
        killed["started_at"],
        resume["started_at"],
    ]
    assert stats_of(out / "run")["run_totals"]["runs"] == 3


def test_an_invocation_killed_in_its_finish_phase_keeps_all_its_spend_in_the_run_totals(server, tmp_path):
    """Killed (SIGKILL) once its last prompt is settled, while it merges: the invocation has made every
    call, and the status.json it left must say so. Its last refresh was the periodic one (every 2 s), so
    the run's books lost up to 2 s of calls, all of them in a run that short: before the fix, 1 request of
    the 25 the endpoint served was in run_totals (the resume's start check)."""
    import signal
    import subprocess
    import sys

    from helpers import ROOT, runner_argv

    dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i}" for i in range(8)])
    out = tmp_path / "data"
    argv = runner_argv(dataset, out, server, "--batch_size=4", "--prompts_per_worker=4")
    killed_in_merge = (
        "import os, runpy, signal, sys; from batchrun.run import finish; "
        "finish.merge = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
        f"sys.argv = {argv[1:]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", killed_in_merge], capture_output=True, text=True, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    served = server.stats()["requests"]
    assert served >= 8 * 3  # three calls a prompt
    run(server, dataset, out, resume=True)
    stats = stats_of(out / "run")
    killed, resume = stats["runs"]
    assert "last status: running" in killed["ended"]
    assert killed["requests"] == served
    assert stats["run_totals"]["requests"] == server.stats()["requests"] == served + resume["requests"]
    assert stats["trajectories"] == 8


def test_a_resume_s_merge_parses_each_batch_line_once(server, tmp_path, monkeypatch):
    """The merge of a resume (a recorder that has counted nothing yet) parsed every batch line twice: its
    own pass, then the checkpoint's batch_stats read every batch file again (a third of the merge of
    20,000 records, benchmarks/large_run.py). The merge's pass counts them now; same checkpoint."""
    import batchrun.storage
    from batchrun.run.dataset import load_dataset

    dataset = write_jsonl(
        tmp_path / "d.jsonl", [f"task {n}" for n in range(6)] + ["x [error:400]", "y [no_reasoning]"]
    )
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=3)
    run_dir = out / "run"
    before = json.loads((run_dir / "checkpoint.json").read_text())
    lines = {line for p in run_dir.glob("batch_*.jsonl") for line in p.read_bytes().splitlines(keepends=True)}
    parsed = []
    real_parse = batchrun.storage._parse_line
    monkeypatch.setattr(batchrun.storage, "_parse_line", lambda raw: parsed.append(raw) or real_parse(raw))
    rows, _ = load_dataset(str(dataset))
    finish.merge(run_dir, rows, Recorder(run_dir, "run", Redactor(None)))
    assert len(lines) == 6
    assert len([raw for raw in parsed if raw in lines]) == 6  # not 12
    after = json.loads((run_dir / "checkpoint.json").read_text())
    assert after["batch_stats"] == before["batch_stats"]
    assert after["completed_prompts"] == before["completed_prompts"]


def test_checkpoint_batch_stats_and_statistics_count_outcome_rows_by_one_rule(server, tmp_path):
    """checkpoint.json's batch_stats and statistics.json counted discarded.jsonl and failed.jsonl rows
    apart, by two rules: the merge's count (what a resume's checkpoint says until its statistics, and
    what it keeps when killed there) took any dict row, statistics only rows of an outcome's shape. A
    row with a batch number but no reason, or no error class (a hand edit, another tool's line) was
    in the one and not in the other. One count now, shared by both."""
    import signal
    import subprocess
    import sys

    from helpers import ROOT, runner_argv

    dataset = write_jsonl(tmp_path / "d.jsonl", [f"task {n}" for n in range(4)] + ["y [no_reasoning]"])
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=3)
    run_dir = out / "run"
    with (run_dir / "discarded.jsonl").open("a", encoding="utf-8") as fh:
        fh.write('{"batch_num": 0, "prompt": "p", "reason": 5}\n{"batch_num": 1, "prompt_index": 4}\n')
    with (run_dir / "failed.jsonl").open("a", encoding="utf-8") as fh:
        fh.write('{"batch_num": 0, "prompt": "p", "error_class": null}\n')
    argv = runner_argv(dataset, out, server, "--batch_size=3", "--resume")
    killed_in_statistics = (
        "import os, runpy, signal, sys; from batchrun.run import finish; "
        "finish.statistics = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
        f"sys.argv = {argv[1:]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", killed_in_statistics], capture_output=True, text=True, env=env
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    at_merge = json.loads((run_dir / "checkpoint.json").read_text())["batch_stats"]
    run(server, dataset, out, batch_size=3, resume=True)
    stats = stats_of(run_dir)
    batch_stats = json.loads((run_dir / "checkpoint.json").read_text())["batch_stats"]
    assert at_merge == batch_stats
    assert sum(b["discarded"] for b in batch_stats.values()) == stats["discarded"]["total"] == 1
    assert sum(b["skipped"] for b in batch_stats.values()) == stats["failed_attempts"]["total"] == 0
    assert stats["invalid_lines_skipped"]["discarded.jsonl"] == 2
    assert stats["invalid_lines_skipped"]["failed.jsonl"] == 1


def test_a_resume_checks_each_batch_line_once(server, tmp_path, monkeypatch):
    """A resume's scan checked every batch line (valid_record), then its merge checked each again (~16 us
    of a 19 KB record). The merge takes the scan's verdicts for the files still as the scan read them:
    the lines the scan found invalid are dropped and counted as before, the others kept unchecked."""
    from batchrun.run import resume

    dataset = write_jsonl(tmp_path / "d.jsonl", [f"task {n}" for n in range(6)])
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=3)
    run_dir = out / "run"
    with (run_dir / "batch_1.jsonl").open("a", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in GARBAGE_RECORDS))
    merged = (run_dir / "trajectories.jsonl").read_bytes()
    checked: list[object] = []
    for module in (resume, finish):
        real = module.valid_record
        monkeypatch.setattr(module, "valid_record", lambda rec, real=real: checked.append(rec) or real(rec))
    run(server, dataset, out, batch_size=3, resume=True)
    assert len(checked) == 6 + len(GARBAGE_RECORDS)  # the scan's, not twice as many
    assert (run_dir / "trajectories.jsonl").read_bytes() == merged
    assert stats_of(run_dir)["dropped_at_merge"]["invalid_lines"] == len(GARBAGE_RECORDS)


def test_a_batch_file_changed_after_the_resume_scan_is_checked_line_by_line(server, tmp_path):
    """The scan's verdicts hold only for a file as it read it: a line appended or edited since is checked
    by the merge (here dropped as invalid, or kept), as it was before the merge took them."""
    from batchrun.run.dataset import load_dataset
    from batchrun.run.resume import CheckedFiles, resume_filter

    dataset = write_jsonl(tmp_path / "d.jsonl", [f"task {n}" for n in range(6)])
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=3)
    run_dir = out / "run"
    rows, _ = load_dataset(str(dataset))
    recorder = Recorder(run_dir, "run", Redactor(None))
    checked = CheckedFiles()
    assert resume_filter(rows, run_dir, recorder.sample_text, rerun_discarded=False, checked=checked) == []
    batch_0, batch_1 = run_dir / "batch_0.jsonl", run_dir / "batch_1.jsonl"
    with batch_0.open("a", encoding="utf-8") as fh:  # appended after the scan
        fh.write('{"conversations": "x"}\n')
    lines = batch_1.read_bytes().splitlines(keepends=True)
    edited = re.sub(rb'"conversations": \[', b'"conversations": {}, "x": [', lines[0], count=1)
    batch_1.write_bytes(edited + b"".join(lines[1:]))  # an edit: valid JSON of the wrong shape
    assert checked.invalid_lines(batch_0) is None and checked.invalid_lines(batch_1) is None
    totals = finish.merge(run_dir, rows, recorder, checked=checked)
    assert totals.dropped["invalid_lines"] == 2
    assert totals.kept == 5


def test_a_resume_that_runs_prompts_parses_each_earlier_batch_line_twice_not_three_times(
    server, tmp_path, monkeypatch
):
    """A resume with prompts to run parsed every batch line three times: its scan, its first checkpoint
    (batch_stats, from a recorder that had counted nothing) and its merge. The checkpoint starts from the
    scan's counts now, and says what it said."""
    import batchrun.storage

    dataset = write_jsonl(tmp_path / "d.jsonl", [f"task {n}" for n in range(6)])
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=3)
    run_dir = out / "run"
    lines = {line for p in run_dir.glob("batch_*.jsonl") for line in p.read_bytes().splitlines(keepends=True)}
    write_jsonl(dataset, [f"task {n}" for n in range(8)])  # two rows more: the resume runs them
    parsed = []
    real_parse = batchrun.storage._parse_line
    monkeypatch.setattr(batchrun.storage, "_parse_line", lambda raw: parsed.append(raw) or real_parse(raw))
    run(server, dataset, out, batch_size=3, resume=True)
    assert len(lines) == 6
    assert len([raw for raw in parsed if raw in lines]) == 2 * 6  # not 3 * 6
    batch_stats = json.loads((run_dir / "checkpoint.json").read_text())["batch_stats"]
    assert {n: b["trajectories"] for n, b in batch_stats.items()} == {"0": 3, "1": 3, "2": 2}


def test_the_checkpoint_counts_a_resume_starts_from_are_those_a_read_of_the_files_gives(server, tmp_path):
    """The scan's counts stand for a read of every batch file (what the first checkpoint of a resume did):
    with a discard run again and discarded again, a malformed row, and without any discard."""
    from batchrun.run.dataset import load_dataset
    from batchrun.run.recorder import count_outcomes, scan_batch_outcomes
    from batchrun.run.resume import CheckedFiles, resume_filter

    dataset = write_jsonl(tmp_path / "d.jsonl", ["terse [no_reasoning]", "fine [calls:1]", "x [error:400]"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, batch_size=1)
    rows, _ = load_dataset(str(dataset))
    recorder = Recorder(run_dir, "run", Redactor(None))

    def seeded(**kw) -> dict:
        checked = CheckedFiles()
        resume_filter(rows, run_dir, recorder.sample_text, rerun_discarded=False, checked=checked, **kw)
        return count_outcomes(run_dir, *checked.take_counts()).batches

    assert seeded() == scan_batch_outcomes(run_dir)
    run(server, dataset, out, batch_size=1, resume=True, rerun_discarded=True)  # discarded again
    with (run_dir / "discarded.jsonl").open("a", encoding="utf-8") as fh:
        fh.write('{"batch_num": 0, "prompt": "p", "reason": 5}\n')
    assert seeded() == scan_batch_outcomes(run_dir)
    assert sum(c["discarded"] for c in seeded().values()) == 1
    (run_dir / "discarded.jsonl").unlink()
    assert seeded() == scan_batch_outcomes(run_dir)


def test_the_merge_holds_a_bit_not_a_place_for_each_record_written_at_its_rows_place(tmp_path, monkeypatch):
    """A run's end held a tuple and a table entry in three counts for every record (its sample, its Line,
    its Place: ~300 bytes a record, 100,000 of them at issue 5's scale) and the report a fourth: nearly
    every record is at its row's own place (its line, fields and occurrence), so the merge holds a bit
    for each of those (MergeTotals.own) and counts only the others; the records' Lines are held only
    beside discards (superseded_discards needs them only then). What the run writes is the same."""
    seen: list[finish.MergeTotals] = []
    recorders: list[Recorder] = []
    merge = finish.merge

    def keep_totals(*args, **kw):
        seen.append(merge(*args, **kw))
        recorders.append(args[2])
        return seen[-1]

    monkeypatch.setattr(finish, "merge", keep_totals)
    reports: list[RunData] = []
    feed = finish.KeptFeed.__init__

    def keep_report(self, *args, **kw):
        feed(self, *args, **kw)
        reports.append(self.report)

    monkeypatch.setattr(finish.KeptFeed, "__init__", keep_report)
    prompts = [f"Task {i} [calls:0]" for i in range(30)] + ["Task 3 [calls:0]"]  # a twin: its own place too
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_dir = _mock_run(dataset, out, batch_size=8)
    totals = seen[-1]
    assert not totals.finished and not totals.finished_where and not totals.finished_at
    assert totals.own is not None and all(totals.own.bits[p, 0] for p in range(len(prompts)))
    assert not reports[-1].kept_at
    # Nor every record's line for checkpoint.json: the run tracks its rows from its start.
    assert recorders[-1].row_pending is not None and recorders[-1].done_indices is None
    stats = stats_of(run_dir)
    assert stats["trajectories"] == 31 and stats["remaining_for_resume"] == 0

    # A row removed above: every record below it is at another line now, counted by its place; the
    # resume matches them to their rows and runs nothing.
    write_jsonl(tmp_path / "d.jsonl", prompts[1:])
    _mock_run(dataset, out, batch_size=8, resume=True)
    totals = seen[-1]
    assert sum(totals.finished.values()) == 31 and len(totals.finished_where) == 31
    assert stats_of(run_dir)["remaining_for_resume"] == 0 and stats_of(run_dir)["this_run"]["attempted"] == 0

    # Beside a discard, the merge holds the Lines (a discard run again and kept is superseded by them);
    # the report none: statistics hands it each discard with its verdict, read once for both.
    dataset = write_jsonl(tmp_path / "e.jsonl", ["Thinks not [no_reasoning]", "Fine [calls:0]"])
    run_dir = _mock_run(dataset, out, "r2")
    assert read_jsonl(run_dir / "discarded.jsonl")
    _mock_run(dataset, out, "r2", resume=True)
    assert len(seen[-1].finished_at) == 1 and not reports[-1].kept_at and reports[-1].discards_fed
