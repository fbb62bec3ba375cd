"""batchrun/run/dispatch.py: outcomes and limits, failure rates, retries, timeouts, budgets as hard caps."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    by_prompt,
    read_jsonl,
    run,
    stats_of,
    write_jsonl,
    write_rows,
)

from batchrun.fakes.fake_model import FakeModelServer, find_prompt
from batchrun.sharegpt import first_human


def test_loop_truncate_garbage_and_hangup(server, tmp_path):
    prompts = [
        "Loop forever [loop]",
        "Cut off [truncate]",
        "Exactly three calls",
        "Garbage reply [garbage]",
        "Hang up [hangup]",
        "Fine afterwards [calls:1]",
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run(server, dataset, out, max_turns=3, max_retries=1, batch_size=3)
    recs = by_prompt(read_jsonl(out / "run" / "trajectories.jsonl"))
    (loop,) = recs["Loop forever [loop]"]
    assert (loop["completed"], loop["partial"], loop["api_calls"]) == (False, True, 3)
    assert loop["tool_stats"]["terminal"]["count"] == 3
    assert loop["metadata"]["stop_reason"] == "max_turns"
    assert server.stats()["requests_by_prompt"]["Loop forever [loop]"] == 3
    (cut,) = recs["Cut off [truncate]"]
    assert (cut["completed"], cut["partial"], cut["api_calls"]) == (False, True, 1)
    assert cut["metadata"]["stop_reason"] == "truncated"
    (three,) = recs["Exactly three calls"]
    assert (three["completed"], three["partial"], three["api_calls"]) == (True, False, 3)
    assert recs["Fine afterwards [calls:1]"][0]["completed"] is True
    failed = {r["prompt"]: r for r in read_jsonl(out / "run" / "failed.jsonl")}
    assert failed["Garbage reply [garbage]"]["error_class"] == "bad_response"
    assert failed["Hang up [hangup]"]["error_class"] == "connection"
    assert set(failed) == {"Garbage reply [garbage]", "Hang up [hangup]"}
    assert all(r["error"] for r in failed.values())


def test_wrong_api_key_stops_the_run_before_any_model_call(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["first try", "second try"])
    out = tmp_path / "data"
    with FakeModelServer(latency_s=0, api_key="the-right-key") as srv:
        with pytest.raises(SystemExit) as info:
            run(srv, dataset, out, api_key="the-wrong-key-1234")
        stats = srv.stats()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "401" in err and "API key" in err
    assert "the-wrong-key-1234" not in err
    assert stats["requests_by_prompt"] == {}  # no prompt was sent, no token spent
    assert not read_jsonl(out / "run" / "trajectories.jsonl")
    for path in (out / "run").rglob("*"):
        if path.is_file():
            assert b"the-wrong-key-1234" not in path.read_bytes()


def test_the_same_command_works_after_a_run_that_never_started(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["first try [calls:0]"])
    out = tmp_path / "data"
    with FakeModelServer(latency_s=0, api_key="the-right-key") as srv:
        with pytest.raises(SystemExit):
            run(srv, dataset, out, api_key="the-wrong-key-1234")
        run(srv, dataset, out, api_key="the-right-key")  # fixed the key, same command otherwise
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 1


def test_too_many_failures_exit_3_and_say_so(server, tmp_path, capsys):
    dataset = write_jsonl(
        tmp_path / "d.jsonl", ["down one [error:500]", "down two [error:502]", "fine [calls:0]"]
    )
    out = tmp_path / "data"
    with pytest.raises(SystemExit) as info:
        run(server, dataset, out, max_failure_rate=0.5, max_retries=0)
    assert info.value.code == 3
    assert "2 of 3 prompts failed" in capsys.readouterr().err
    failed = read_jsonl(out / "run" / "failed.jsonl")
    assert sorted(r["error_class"] for r in failed) == ["http_500", "http_502"]
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 1  # what finished is kept
    assert json.loads((out / "run" / "status.json").read_text())["exit_code"] == 3


def test_prompts_the_budget_stopped_do_not_dilute_the_failure_rate(server, tmp_path, capsys, clean_tool_env):
    """2 prompts failing beside 8 that the budget stopped in flight: counted as attempted, the stopped ones
    made it 2 of 10 failed and the run exited 0, although every prompt that ended on its own had failed
    (with HTTP 500s as with these rows asking for a toolset the run lacks). They count neither way now:
    2 of 2, exit 3."""
    rows = [{"prompt": f"fail {i}", "toolsets": ["web"]} for i in range(2)]  # no search provider here
    rows += [{"prompt": f"task {i} [calls:6] [slow:0.5]"} for i in range(8)]
    out = tmp_path / "data"
    with pytest.raises(SystemExit) as info:
        run(
            server, write_rows(tmp_path / "d.jsonl", rows), out, max_failure_rate=0.5, max_retries=0,
            prompts_per_worker=10, max_tokens=100, budget_tokens=12000, batch_size=10,
        )  # fmt: skip
    stats = json.loads((out / "run" / "statistics.json").read_text())
    assert stats["this_run"]["failed"] == {"preflight": 2, "budget": 8}
    assert info.value.code == 3
    assert "2 of 2 prompts failed" in capsys.readouterr().err
    assert json.loads((out / "run" / "status.json").read_text())["exit_code"] == 3


def test_failure_rate_at_the_threshold_exits_zero(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["ok [calls:0]", "bad [error:400]"])
    run(server, dataset, tmp_path / "data", max_failure_rate=0.5)  # 1 of 2 is not *more* than half


def test_rate_limits_are_waited_out_by_the_client_with_default_flags(server, tmp_path):
    """Default --max_retries=3, --prompt_timeout and --request_timeout: three 429s in a row are retried."""
    prompts = ["Rate limited at first [flaky:3]", "Rate limited once [flaky:1] [calls:1]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(server, dataset, tmp_path / "data")
    recs = by_prompt(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl"))
    assert not read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    seen = server.stats()["requests_by_prompt"]
    assert [r["api_calls"] for r in recs[prompts[0]]] == [3]
    assert seen[prompts[0]] == 3 + 3  # the three 429s were retried, not paid as turns
    assert seen[prompts[1]] == 2 + 1


def test_rate_limits_are_retried_when_prompt_timeout_is_below_request_timeout(server, tmp_path):
    """A 429 answered in a millisecond must be retried even with a per-prompt limit under --request_timeout."""
    prompts = ["Rate limited with a short budget [flaky:2] [calls:0]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(server, dataset, tmp_path / "data", prompt_timeout=60)  # --request_timeout stays 600
    assert not read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1


def test_prompt_timeout_bounds_the_whole_prompt(server, tmp_path):
    """--prompt_timeout is wall clock for the prompt, retries included, and fails as prompt_timeout."""

    prompt = "very slow [slow:3] [calls:0]"
    dataset = write_jsonl(tmp_path / "d.jsonl", [prompt])
    run(server, dataset, tmp_path / "data", prompt_timeout=1, max_retries=3)
    failed = read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    assert failed[0]["error_class"] == "prompt_timeout"
    # The 3 s reply never came within the 1 s limit, and no retry was sent after the deadline
    # (3 retries of a 3 s call would have been 12 s).
    assert server.stats()["requests_by_prompt"][prompt] == 1


def test_model_calls_of_failed_prompts_are_counted(server, tmp_path):
    prompt = "slowish [slow:0.6] [calls:3]"
    dataset = write_jsonl(tmp_path / "d.jsonl", [prompt])
    run(server, dataset, tmp_path / "data", prompt_timeout=1, max_retries=0)
    (failed,) = read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    assert failed["error_class"] == "prompt_timeout"
    served = server.stats()["requests_by_prompt"][prompt]
    assert served >= 1
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text("utf-8"))
    assert stats["this_run"]["api_calls"] == served


def test_token_budget_stops_prompts_in_flight_at_their_next_call(tmp_path):
    """40 prompts, 8 in flight, a budget of a few prompts: no call is sent past the budget (each
    reserves its worst case first); the stopped prompts fail with class budget and a resume runs them."""
    prompts = [f"task number {i} [calls:4]" for i in range(40)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_dir = out / "run"
    in_flight = 8
    with FakeModelServer(latency_s=0.05) as server:
        run(server, dataset, out, budget_tokens=20000, num_workers=2, prompts_per_worker=4, batch_size=5)
        stats = stats_of(run_dir)
        budget = stats["this_run"]["budget"]
        records = read_jsonl(run_dir / "trajectories.jsonl")
        failed = read_jsonl(run_dir / "failed.jsonl")
        assert budget["reached"] is True
        assert {r["error_class"] for r in failed} <= {"budget"}
        assert budget["stopped_in_flight"] == len(failed)
        # What the fake server counted is what the run counted (its start check too).
        served = server.stats()
        assert (
            budget["spent_tokens"]
            == served["prompt_tokens"] + served["completion_tokens"] + served["check_tokens"]
        )
        assert budget["spent_tokens"] <= 20000 and budget["overshoot_tokens"] == 0
        usages = [r["metadata"]["usage"] for r in records] + [r["usage"] for r in failed]
        biggest = max((u["prompt_tokens"] or 0) + (u["completion_tokens"] or 0) for u in usages)
        assert budget["spent_tokens"] >= 20000 - in_flight * biggest  # the cap was used, not refused early
        assert len(records) + len(failed) + stats["this_run"]["skipped_for_budget"] == 40
        assert len(records) < 40

        run(server, dataset, out, resume=True, num_workers=2, batch_size=5)
        merged = read_jsonl(run_dir / "trajectories.jsonl")
        assert sorted(first_human(r["conversations"]) for r in merged) == sorted(prompts)
        assert stats_of(run_dir)["remaining_for_resume"] == 0


def test_a_run_wide_429_pause_does_not_time_out_other_prompts(tmp_path):
    """One prompt is rate limited for good and pauses the run again and again; another prompt waits
    through those pauses longer than its --prompt_timeout and still finishes."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["endless [error:429] [retry_after:2.5]", "patient task"])
    out = tmp_path / "data"
    run_dir = out / "run"
    with FakeModelServer(latency_s=0) as server:
        run(server, dataset, out, num_workers=1, prompts_per_worker=2, prompt_timeout=4.0)
        requests = server.stats()["requests_by_prompt"]
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert failed["prompt"].startswith("endless") and failed["error_class"] == "http_429"
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert first_human(record["conversations"]) == "patient task"
    assert record["completed"] is True and requests["patient task"] == 3
    assert stats_of(run_dir)["this_run"]["rate_limit_pauses"] >= 1


def test_one_batch_runs_on_every_worker_at_once(tmp_path):
    """Prompts go out one per free slot, not a batch per worker: one batch of 8 prompts fills the
    slots of both workers (2 x 2), so the endpoint sees more requests at once than one worker has slots."""
    prompts = [f"shared batch task {i}" for i in range(8)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    with FakeModelServer(latency_s=0.5) as server:
        run(server, dataset, out, batch_size=8, num_workers=2, prompts_per_worker=2)
        stats = server.stats()
    assert stats["max_in_flight"] > 2
    assert stats["max_in_flight"] <= 4  # never more prompts in flight than slots
    records = read_jsonl(out / "run" / "batch_0.jsonl")
    assert sorted(first_human(r["conversations"]) for r in records) == sorted(prompts)
    checkpoint = json.loads((out / "run" / "checkpoint.json").read_text("utf-8"))
    assert sorted(checkpoint["completed_prompts"]) == list(range(8))


def test_a_slow_prompt_does_not_hold_back_the_rest_of_its_batch(tmp_path):
    """Two workers with one slot each, batches of 3. The first prompt is slow; the other prompts of
    its batch go to the other worker's free slot instead of waiting behind it (before, a worker
    took a whole batch and ran it in its own slots), so the slow prompt's answer is the endpoint's
    last request, and the batch files and checkpoint are as before."""
    slow = "slow first [slow:2] [calls:2]"
    fast = [f"quick {i} [calls:0]" for i in range(5)]
    dataset = write_jsonl(tmp_path / "d.jsonl", [slow, *fast])
    out = tmp_path / "data"
    with FakeModelServer(latency_s=0) as server:
        run(server, dataset, out, batch_size=3, num_workers=2, prompts_per_worker=1)
        stats = server.stats()
    assert stats["requests_by_prompt"] == {slow: 3, **dict.fromkeys(fast, 1)}
    order = [find_prompt(body["messages"])[1] for body in stats["last_requests"]]
    assert order[-1] == slow
    assert {first_human(r["conversations"]) for r in read_jsonl(out / "run" / "batch_0.jsonl")} == {
        slow,
        *fast[:2],
    }
    assert {first_human(r["conversations"]) for r in read_jsonl(out / "run" / "batch_1.jsonl")} == set(
        fast[2:]
    )
    checkpoint = json.loads((out / "run" / "checkpoint.json").read_text("utf-8"))
    assert sorted(checkpoint["completed_prompts"]) == list(range(6))


def _workers_of_this_process() -> list[int]:
    """The pool's worker processes: the children of this process's multiprocessing forkserver."""
    out = []
    for child in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
        if "forkserver" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
            for task in Path(f"/proc/{child}/task").iterdir():
                out += [int(p) for p in (task / "children").read_text().split()]
    return out


def test_a_killed_worker_fails_only_the_prompts_it_held_and_resume_completes(tmp_path):
    """2 workers x 2 slots, 12 prompts of one slow call each. One worker is killed while all 4 slots
    are busy: exactly its 2 prompts fail (worker_died), the pool's new worker and the other one run
    the rest, and --resume runs the 2 again."""
    prompts = [f"held task {i} [slow:1] [calls:0]" for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_dir = out / "run"
    killed: list[int] = []

    def kill_one_worker_when_every_slot_is_busy(server: FakeModelServer) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.stats()["in_flight"] < 4:
            time.sleep(0.01)
        workers = _workers_of_this_process()
        if workers:
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])

    with FakeModelServer(latency_s=0) as server:
        killer = threading.Thread(target=kill_one_worker_when_every_slot_is_busy, args=(server,))
        killer.start()
        run(server, dataset, out, batch_size=4, num_workers=2, prompts_per_worker=2)
        killer.join()
        assert len(killed) == 1
        failed = read_jsonl(run_dir / "failed.jsonl")
        assert [f["error_class"] for f in failed] == ["worker_died", "worker_died"]
        assert all(f"worker process {killed[0]} ended" in f["error"] for f in failed)
        records = read_jsonl(run_dir / "trajectories.jsonl")
        assert len(records) == 10
        assert {first_human(r["conversations"]) for r in records} | {f["prompt"] for f in failed} == set(
            prompts
        )

        run(server, dataset, out, resume=True, batch_size=4, num_workers=2, prompts_per_worker=2)
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in merged) == sorted(prompts)


def test_a_run_returns_with_its_workers_ended_and_none_left_behind(server, tmp_path, monkeypatch):
    """The workers end, and the backend sweeps after them, while the merge runs: main() still returns
    only once they are all gone and the sweep is done (here a slow one)."""
    import multiprocessing

    from batchrun.prompt.sandboxes.local.sandbox import LocalSandbox

    swept = threading.Event()
    sweep = LocalSandbox.sweep

    def slow_sweep(options):
        time.sleep(1.0)
        sweep(options)
        swept.set()

    monkeypatch.setattr(LocalSandbox, "sweep", staticmethod(slow_sweep))
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"task {i}" for i in range(6)])
    run(server, dataset, tmp_path / "data", num_workers=2)
    assert swept.is_set()
    assert multiprocessing.active_children() == []
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 6
