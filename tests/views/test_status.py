"""Live status (batchrun/views/status.py): format_status on crafted status dicts, and the CLI on a written status.json."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchrun.views import status as st

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_800_000_000.0


def running(**over) -> dict:
    base = {
        "run_name": "big",
        "pid": 4242,
        "host": "gpu-box",
        "started_at": NOW - 3723,
        "updated_at": NOW - 2,
        "state": "running",
        "total": 10_000,
        "done": 1180,
        "failed": 24,
        "discarded": 30,
        "in_flight": 16,
        "api_calls": 3456,
        "tool_calls": 8901,
        "prompt_tokens": 1_234_567,
        "completion_tokens": 45_678,
        "cost_usd": 12.3456,
        "tokens_per_min": 120_345.2,
        "eta_s": 11_640,
        "rate_per_min": 45.2,
        "budget": {"usd": 50.0, "tokens": None, "spent_usd": 12.3456, "spent_tokens": 1_280_245},
        "last_event_at": NOW - 5,
    }
    base.update(over)
    return base


def lines(text: str) -> dict[str, str]:
    """Each line by its first word (Run, Progress, Rate, Spend, Budget, WARNING)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        out.setdefault(line.split(":")[0].split()[0], line)
    return out


def test_a_healthy_running_run() -> None:
    text = st.format_status(running(), NOW, alive=True)
    got = lines(text)
    assert got["Run"] == "Run big: running · pid 4242 on gpu-box · started 1h 02m ago · updated 2s ago"
    assert got["Progress"] == (
        "Progress: 1,234 of 10,000 prompts (12.3%) · 1,180 done · 30 discarded · 24 failed · 16 in flight"
    )
    assert got["Rate"] == "Rate: 45.2 prompts/min · 120k tokens/min · ETA 3h 14m"
    assert (
        got["Spend"]
        == "Spend: $12.35 · 1.23M prompt + 45,678 completion tokens · 3,456 model calls · 8,901 tool calls"
    )
    assert got["Budget"] == "Budget: $12.35 of $50.00 (25%)"
    assert "WARNING" not in text
    assert len(text.splitlines()) == 5


def test_stall_warning_after_a_minute_without_events() -> None:
    assert "WARNING" not in st.format_status(running(last_event_at=NOW - 59), NOW)
    text = st.format_status(running(last_event_at=NOW - 75), NOW)
    assert "WARNING: stalled? no event for 1m 15s" in text
    # A finished run is quiet by design.
    assert "WARNING" not in st.format_status(running(state="finished", last_event_at=NOW - 999), NOW)


def test_dead_process_while_state_says_running() -> None:
    text = st.format_status(running(last_event_at=NOW - 500), NOW, alive=False)
    assert "WARNING: not running" in text and "process 4242 is gone" in text and "--resume" in text
    assert "stalled" not in text  # the stronger diagnosis only
    assert "not running" not in st.format_status(running(state="interrupted"), NOW, alive=False)


def test_status_file_not_rewritten() -> None:
    text = st.format_status(running(updated_at=NOW - 300, last_event_at=NOW - 300), NOW, alive=None)
    assert "status file has not been rewritten for 5m 00s" in text


def test_budget_reached_and_token_budget() -> None:
    budget = {"usd": None, "tokens": 1_000_000, "spent_usd": 3.0, "spent_tokens": 1_000_500}
    got = lines(st.format_status(running(budget=budget), NOW))
    assert got["Budget"] == "Budget: 1M of 1M (100%) REACHED: no new prompts are started"
    no_budget = {"usd": None, "tokens": None, "spent_usd": 0, "spent_tokens": 0}
    assert "Budget" not in lines(st.format_status(running(budget=no_budget), NOW))


def test_failed_attempts_tokens_are_shown_and_counted_against_the_token_budget() -> None:
    budget = {"tokens": 1_000_000, "spent_tokens": 600_000, "unanswered_tokens": 200_000}
    got = lines(st.format_status(running(budget=budget, unanswered_tokens=200_000), NOW))
    assert got["Budget"] == "Budget: 800k of 1M (80%)", got["Budget"]
    assert "+ ~200k of failed attempts" in got["Spend"]
    assert "failed attempts" not in lines(st.format_status(running(), NOW))["Spend"]


def test_the_prompt_tokens_the_endpoint_s_cache_served_and_took_are_shown() -> None:
    got = lines(st.format_status(running(cached_tokens=1_100_000, cache_write_tokens=20_000), NOW))
    assert got["Spend"].startswith(
        "Spend: $12.35 · 1.23M prompt (1.1M cached, 20,000 written to the cache) + 45,678 completion tokens"
    ), got["Spend"]
    only_read = lines(st.format_status(running(cached_tokens=900, cache_write_tokens=0), NOW))["Spend"]
    assert "1.23M prompt (900 cached) + " in only_read
    # None said (0), an older runner's file (absent) or a damaged one: the line as it was.
    for over in (
        {"cached_tokens": 0, "cache_write_tokens": 0},
        {},
        {"cached_tokens": "x", "cache_write_tokens": float("nan")},
    ):
        assert "1.23M prompt + 45,678" in lines(st.format_status(running(**over), NOW))["Spend"]


def test_finished_and_sparse_dicts() -> None:
    got = lines(
        st.format_status(running(state="finished", done=9900, failed=50, discarded=50, eta_s=None), NOW)
    )
    assert "(100.0%)" in got["Progress"] and got["Rate"].endswith("ETA done")
    # A stop (the endpoint dead: exit 5) leaves state "finished" too; its exit code says it was a stop
    stopped = st.format_status(running(state="finished", exit_code=5, eta_s=None), NOW).splitlines()[0]
    assert stopped.startswith("Run ") and ": finished (exit code 5)" in stopped
    done = st.format_status(running(state="finished", exit_code=0, eta_s=None), NOW).splitlines()[0]
    assert "exit code" not in done
    # Early in a run, or from an older runner: missing fields print as dashes, never raise.
    sparse = st.format_status({"state": "running"}, NOW)
    assert sparse.splitlines()[0] == "Run ?: running"
    assert "Progress: 0 of – prompts · 0 done" in sparse
    assert "Rate: – prompts/min · – tokens/min · ETA –" in sparse


def test_iso_timestamps() -> None:
    iso = dt.datetime.fromtimestamp(NOW - 90, dt.timezone.utc).isoformat().replace("+00:00", "Z")
    text = st.format_status(running(started_at=iso, updated_at=iso, last_event_at=iso), NOW)
    assert "started 1m 30s ago" in text and "no event for 1m 30s" in text


# ----------------------------------------------------------------------------- the CLI


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchrun.views.status", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_status(run_dir: Path, status: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps(status))


@pytest.fixture
def sleeper():
    """A live process of ours, standing in for a running runner."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_cli_prints_a_live_run(tmp_path: Path, sleeper) -> None:
    import time

    now = time.time()
    write_status(
        tmp_path,
        running(
            pid=sleeper.pid, host=socket.gethostname(), started_at=now - 10, updated_at=now, last_event_at=now
        ),
    )
    done = cli(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Run big: running · pid {sleeper.pid} on {socket.gethostname()}")
    assert "(12.3%)" in done.stdout and "WARNING" not in done.stdout


def test_cli_says_not_running_when_the_pid_is_dead(tmp_path: Path) -> None:
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    write_status(
        tmp_path, running(pid=dead.pid, host=socket.gethostname(), updated_at=now, last_event_at=now)
    )
    done = cli(str(tmp_path))
    assert done.returncode == 0
    assert f"WARNING: not running: state says running but process {dead.pid} is gone" in done.stdout
    # On another host the pid means nothing here: no verdict.
    write_status(tmp_path, running(pid=dead.pid, host="elsewhere", updated_at=now, last_event_at=now))
    assert "not running" not in cli(str(tmp_path)).stdout


def test_cli_json(tmp_path: Path) -> None:
    write_status(tmp_path, running(state="finished", pid=os.getpid(), host=socket.gethostname()))
    done = cli(str(tmp_path), "--json")
    data = json.loads(done.stdout)
    assert data["run_name"] == "big" and data["done"] == 1180
    assert data["checks"]["settled"] == 1234 and data["checks"]["progress"] == pytest.approx(0.1234)
    assert data["checks"]["pid_alive"] is True and data["checks"]["stalled"] is False


def test_cli_watch_refreshes_until_the_run_ends(tmp_path: Path, sleeper) -> None:
    import time

    now = time.time()
    write_status(
        tmp_path, running(pid=sleeper.pid, host=socket.gethostname(), updated_at=now, last_event_at=now)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun.views.status", str(tmp_path), "--watch", "0.2", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(proc.stdout.readline())
        assert first["state"] == "running"
        write_status(tmp_path, running(state="finished", pid=sleeper.pid, host=socket.gethostname()))
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    states = [json.loads(line)["state"] for line in out.splitlines()]
    assert states[-1] == "finished" and set(states) <= {"running", "finished"}
    assert proc.returncode == 0


def test_cli_without_a_status_file(tmp_path: Path) -> None:
    done = cli(str(tmp_path))
    assert done.returncode == 2 and "no status.json" in done.stderr
    (tmp_path / "status.json").write_text("[1, 2]")
    done = cli(str(tmp_path))
    assert done.returncode == 2 and "not a JSON object" in done.stderr


def test_cli_on_a_pid_no_process_can_have(tmp_path: Path) -> None:
    # A damaged (or hand-written) status.json whose pid is beyond any pid of this host ended in an
    # OverflowError traceback from os.kill; no such process lives: the run is not running.
    write_status(tmp_path, running(pid=10**30, host=socket.gethostname()))
    done = cli(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "WARNING: not running" in done.stdout
    assert json.loads(cli(str(tmp_path), "--json").stdout)["checks"]["pid_alive"] is False


def test_budget_skips_reached_flag_and_rate_limit_pauses() -> None:
    budget = {"usd": 50.0, "tokens": None, "spent_usd": 49.5, "spent_tokens": 10, "reached": True}
    got = lines(st.format_status(running(skipped_budget=66, budget=budget, rate_limit_pauses=3), NOW))
    assert "(13.0%)" in got["Progress"] and "66 not started (budget)" in got["Progress"]
    assert got["Budget"] == "Budget: $49.50 of $50.00 (99%) REACHED: no new prompts are started"
    assert got["Rate"].endswith("ETA 3h 14m · 3 rate-limit pauses")


def test_stall_before_the_first_event_counts_from_the_start() -> None:
    assert "stalled" not in st.format_status(running(started_at=NOW - 30, last_event_at=None), NOW)
    assert "no event for 2m 00s" in st.format_status(running(started_at=NOW - 120, last_event_at=None), NOW)


def test_cli_on_a_pid_that_is_no_number_cannot_tell(tmp_path: Path) -> None:
    # A pid of another type (a list, text) said "process [1] is gone": nothing can be told of it.
    for pid in ([1], "123", True, 0):
        write_status(tmp_path, running(pid=pid, host=socket.gethostname()))
        done = cli(str(tmp_path), "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["checks"]["pid_alive"] is None, pid
        assert "WARNING: not running" not in cli(str(tmp_path)).stdout


def test_cli_on_a_file_says_it_is_a_file(tmp_path: Path) -> None:
    # A file named instead of the run's directory was reported as "<file>/status.json is not a JSON object".
    (tmp_path / "afile").write_text("x")
    done = cli(str(tmp_path / "afile"))
    assert done.returncode == 2 and "afile is a file; name a run's directory" in done.stderr, done.stderr


def test_cli_never_hands_the_file_s_control_characters_to_the_terminal(tmp_path: Path) -> None:
    # The run's name and its error (an endpoint's text, kept as it came) reached the terminal raw: an
    # ESC or a C1 CSI (\x9b) set its title or cleared it. Shown as \xNN; the JSON output stays JSON.
    hostile = "boom \x1b]0;TITLE\x07\x1b[2J \x9b31m \u2028 end"
    write_status(tmp_path, running(state="failed", run_name="r\x1b[2Jx", error=hostile, pid=None))
    done = cli(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert not any(c in done.stdout for c in "\x1b\x07\x9b"), repr(done.stdout)
    assert "Run r\\x1b[2Jx: failed" in done.stdout and "FAILED: boom \\x1b]0;TITLE\\x07" in done.stdout
    done = cli(str(tmp_path), "--json")
    assert not any(c in done.stdout for c in "\x1b\x07\x9b\u2028"), repr(done.stdout)
    assert json.loads(done.stdout)["error"] == hostile


def test_a_live_run_s_in_flight_is_the_prompts_its_workers_hold(tmp_path: Path) -> None:
    """status.json's ``in_flight`` was every prompt without an outcome (total - settled): a run of 2
    workers x 2 slots showed "147 in flight" beside 93 settled of 240. It is the prompts the workers
    hold, as the status view says, read here from a real run at several moments."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"p{i} [slow:1] [calls:1]"}) + "\n" for i in range(10)))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [
            sys.executable,
            str(root / "batch_runner.py"),
            f"--dataset_file={dataset}",
            "--batch_size=5",
            "--run_name=live",
            f"--output_dir={tmp_path}",
            "--model=mock",
            "--distribution=terminal_only",
            "--num_workers=1",
            "--prompts_per_worker=2",
        ],  # fmt: skip
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen = []
    try:
        while proc.poll() is None:
            try:
                status = json.loads((tmp_path / "live" / "status.json").read_text())
            except (OSError, ValueError):
                status = None
            if status and status["state"] == "running":
                seen.append((status["in_flight"], status["total"] - st.checks(status, 0)["settled"]))
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0
    assert any(left > 2 for _, left in seen), seen  # moments when more than the slots were unsettled
    assert all(0 <= n <= 2 for n, _ in seen), seen
    assert any(n > 0 for n, _ in seen), seen


@pytest.mark.parametrize("watch", ["inf", "1e30", "nan", "1e-300", "0.05", "604801", "0", "five"])
def test_cli_refuses_a_watch_interval_it_cannot_honour_before_the_first_read(
    tmp_path: Path, sleeper, watch: str
) -> None:
    # Only <= 0 was refused: inf and 1e30 printed a status, then an OverflowError traceback (exit 1); nan
    # a status, then "Invalid value NaN" naming no flag; 1e-300 printed 12,000 statuses in 3 s.
    now = time.time()
    write_status(
        tmp_path, running(pid=sleeper.pid, host=socket.gethostname(), updated_at=now, last_event_at=now)
    )
    done = cli(str(tmp_path), f"--watch={watch}", timeout=10)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert "error: --watch must be a number from 0.1 to 604800" in done.stderr


@pytest.mark.parametrize("watch", ["0.1", "604800"])
def test_cli_takes_a_watch_interval_at_its_bounds(tmp_path: Path, watch: str) -> None:
    write_status(tmp_path, running(state="finished", pid=os.getpid(), host=socket.gethostname()))
    done = cli(str(tmp_path), f"--watch={watch}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Run big: finished")
