"""The spend journal (batchrun/run/journal.py): a budget run killed with kill -9 at any instant, then
resumed, keeps its budget and books every call that may have been billed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import run, runner_argv, write_jsonl

from batchrun.fakes.fake_model import FakeModelServer


def _served(server: FakeModelServer) -> int:
    stats = server.stats()
    return stats["prompt_tokens"] + stats["completion_tokens"] + stats["check_tokens"]


def _kill_while_held(args: list[str], server: FakeModelServer, held: int) -> None:
    """Run the runner as a process and kill it (SIGKILL) once the endpoint holds ``held`` of its calls;
    return once the endpoint has answered (and billed) them all the same."""
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.stats()["in_flight"] < held:
            time.sleep(0.02)
        assert server.stats()["in_flight"] == held
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the runner started, if any outlived it
        except ProcessLookupError:
            pass
    while server.stats()["in_flight"] and time.monotonic() < deadline + 10:
        time.sleep(0.05)


def test_a_kill_9_with_calls_in_flight_then_resume_stays_within_the_budget(tmp_path):
    """The runner is killed (SIGKILL) while the endpoint holds four calls it will bill, a moment after it
    granted them: status.json, refreshed every 2 s, did not hold them yet, and before the journal the
    resume got their tokens back as budget (the endpoint served 30,295 tokens on a 27,999 cap). Now each grant is journaled before it is sent: the resume counts them at their
    reservations, the endpoint serves at most the budget and the books hold at least what it served."""
    prompts = [f"Task {i} [calls:1] [slow:2]" for i in range(8)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    with FakeModelServer() as server:
        run(server, dataset, tmp_path / "ref", num_workers=1, prompts_per_worker=4, max_tokens=100)
        whole = _served(server)  # the eight prompts, uninterrupted (and one start check)
        server.reset_stats()
        budget = whole + 1_000  # holds one whole run, not the calls a kill leaves billed besides
        args = runner_argv(
            dataset, tmp_path / "data", server, "--batch_size=4", "--prompts_per_worker=4",
            f"--budget_tokens={budget}", "--max_tokens=100", "--max_failure_rate=1.0",
        )  # fmt: skip
        _kill_while_held(args, server, 4)  # the four prompts' first calls, held 2 s
        killed_billed = _served(server)
        assert killed_billed > 4 * 1_000
        run(
            server, dataset, tmp_path / "data", num_workers=1, prompts_per_worker=4, max_tokens=100,
            budget_tokens=budget, resume=True, batch_size=4,
        )  # fmt: skip
        served = _served(server)
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    totals = stats["run_totals"]
    books = totals["prompt_tokens"] + totals["completion_tokens"] + totals["unanswered_tokens"]
    assert served <= budget
    assert books >= served
    assert stats["this_run"]["budget"]["earlier_tokens"] >= killed_billed
    assert not (tmp_path / "data" / "run" / "spend_journal.jsonl").exists()  # statistics.json holds it now


def test_the_journal_counts_a_grant_never_settled_at_its_reservation(tmp_path):
    """What a resume reads: settled calls at what they spent, a grant with no settlement (in flight at the
    kill) at its reservation, a torn last line (the kill mid-write: never sent) as nothing; an invocation
    that wrote statistics.json is not counted twice, and one killed before its first status.json is
    found in the journal alone."""
    from batchrun.run.journal import JOURNAL_NAME, SpendJournal, read_journal
    from batchrun.run.recorder import lost_runs, spend_of

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = SpendJournal(run_dir, "aaaa", "2026-12-06T04:00:00")
    first.open()
    first.grant(1, 1, 500, 0.005)
    first.grant(1, 2, 700, None)
    first.sync()
    first.settle(1, 1, prompt_tokens=200, completion_tokens=30, cost_usd=0.001)
    first.close()
    with (run_dir / JOURNAL_NAME).open("ab") as fh:
        fh.write(b'{"invocation":"aaaa","grant":3,"tok')  # torn by the kill
    second = SpendJournal(run_dir, "bbbb", "2026-12-06T04:01:00")
    second.open()  # closes the torn line
    second.grant("start-check", 1, 40, None)
    second.sync()
    second.close()
    refused = SpendJournal(run_dir, "cccc", "2026-12-06T04:02:00")
    refused.open()  # an invocation refused at start (a changed setting): no call, no runs entry
    refused.close()
    books = read_journal(run_dir)
    assert books["aaaa"]["prompt_tokens"] == 200 and books["aaaa"]["completion_tokens"] == 30
    assert books["aaaa"]["unanswered_tokens"] == 700 and books["aaaa"]["requests"] == 2
    assert books["bbbb"]["unanswered_tokens"] == 40
    status = {"started_at": "2026-12-06T04:00:00", "invocation": "aaaa", "updated_at": "2026-12-06T04:00:02",
              "state": "running", "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}  # fmt: skip
    entries = lost_runs(status, [], books)
    assert [e["invocation"] for e in entries] == ["aaaa", "bbbb"]
    assert spend_of(entries)[0] == 200 + 30 + 700 + 40  # before: 0, status.json's
    # The grants reserved before a price was seen: at the most per token an answer cost (0.001 / 230).
    assert spend_of(entries)[1] == pytest.approx(0.001 + (700 + 40) * 0.001 / 230, abs=1e-7)
    written = [{"started_at": "2026-12-06T04:00:00", "invocation": "aaaa", "duration_s": 1.0}]
    assert [e["invocation"] for e in lost_runs(None, written, books)] == ["bbbb"]


def test_the_resume_refuses_when_the_rest_cannot_hold_the_start_check(tmp_path, capsys):
    """A start check is a call like any under a budget: with less left than its worst case it is not sent
    (exit 2), where before it was sent whatever was left."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["Task [error:500]"])  # fails: the resume runs it again
    with FakeModelServer() as server:
        run(
            server,
            dataset,
            tmp_path / "data",
            num_workers=1,
            budget_tokens=10**6,
            max_tokens=1,
            max_retries=0,
        )
        spent = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())["run_totals"]
        total = spent["prompt_tokens"] + spent["completion_tokens"]
        requests = server.stats()["requests"] + server.stats()["check_calls"]
        capsys.readouterr()
        code = 0
        try:  # one token more than was spent: a call's completion limit (1) fits, the check's 16 do not
            run(server, dataset, tmp_path / "data", num_workers=1, budget_tokens=total + 1, max_tokens=1,
                max_retries=0, resume=True)  # fmt: skip
        except SystemExit as exc:
            code = exc.code
        assert server.stats()["requests"] + server.stats()["check_calls"] == requests  # nothing sent
    assert code == 2
    assert "cannot hold the start check" in capsys.readouterr().err


def test_a_probe_the_budget_cannot_hold_is_not_sent(tmp_path):
    """The dead-endpoint probes were sent whatever was left of the budget (and counted only once
    answered): here eight prompts' calls time out, each counted at its worst case, until the rest (5
    tokens) holds no probe; the probe went all the same, and the endpoint billed it past the cap. Now a
    probe asks the budget like any call, and is not sent."""
    from helpers import exit_code, read_jsonl

    rows = [{"prompt": f"task {i} [slow:1.5]", "toolsets": []} for i in range(10)]
    flags = dict(
        num_workers=1, prompts_per_worker=1, max_retries=0, request_timeout=1, max_tokens=50,
        endpoint_grace=30, batch_size=10,
    )  # fmt: skip
    with FakeModelServer() as server:
        calib = tmp_path / "one.jsonl"
        calib.write_text(json.dumps(rows[0]) + "\n")
        exit_code(server, calib, tmp_path / "calib", **flags)
        (failed,) = read_jsonl(tmp_path / "calib" / "run" / "failed.jsonl")
        worst = failed["usage"]["unanswered_tokens"]  # one call's worst case: its request's estimate + 50
        assert worst > 50
        time.sleep(2)  # the calibration's call is answered (late)
        server.reset_stats()
        dataset = tmp_path / "d.jsonl"
        dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
        start = server_check_tokens(server, tmp_path)
        budget = (
            start + 8 * worst + 5
        )  # the start check, eight timed-out calls, and 5 tokens: no probe's worth
        server.reset_stats()
        exit_code(server, dataset, tmp_path / "data", budget_tokens=budget, **flags)
        time.sleep(2)  # a probe sent at the end of the run has reached the endpoint by now
        stats = server.stats()
    assert stats["requests"] == 8
    assert stats["check_calls"] == 1  # the start check only: before, a probe too, past the cap
    assert stats["prompt_tokens"] + stats["completion_tokens"] + stats["check_tokens"] <= budget


def server_check_tokens(server: FakeModelServer, tmp_path) -> int:
    """What the start check costs at this endpoint (a run that makes no other call)."""
    dataset = tmp_path / "none.jsonl"
    dataset.write_text(json.dumps({"prompt": "task [error:400]", "toolsets": []}) + "\n")
    run(server, dataset, tmp_path / "check", max_retries=0)
    return server.stats()["check_tokens"]


def test_a_kill_9_before_any_price_keeps_the_call_in_flight_in_the_usd_books(tmp_path):
    """--budget_usd: the runner is killed while its first call (the only one: none goes beside it until an
    answer shows a price) is held. The books counted its tokens at most, never its dollars, so each such
    kill gave a resume one call's cost back as budget (earlier_usd $0.00031, the start check, for $0.01684
    billed). The journal's grant, never settled, is priced at the most per token the run's answers cost
    (the start check's here)."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:0] [slow:3]" for i in range(2)])
    per_token = 1e-5
    with FakeModelServer(cost_per_token=per_token) as server:
        args = runner_argv(
            dataset, tmp_path / "data", server, "--batch_size=2", "--budget_usd=1.0", "--max_tokens=100"
        )
        _kill_while_held(args, server, 1)
        stats = server.stats()
        billed_usd = stats["cost_usd"] + stats["check_tokens"] * per_token
        assert stats["cost_usd"] > 0  # the held call was answered, and billed
        run(server, dataset, tmp_path / "data", num_workers=1, max_tokens=100, budget_usd=1.0, resume=True,
            batch_size=2)  # fmt: skip
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert stats["this_run"]["budget"]["earlier_usd"] >= billed_usd * 0.999  # before: the start check's only
    killed = stats["runs"][0]
    assert killed["cost_usd"] + killed["unanswered_usd"] >= billed_usd * 0.999
    assert stats["run_totals"]["unanswered_usd"] == killed["unanswered_usd"]
