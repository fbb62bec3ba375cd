"""A run that cannot go on, a row's identity, garbage in the run's files, secrets the endpoint quotes back,
and budgets as hard caps (issue 12, sections 2, 3, 4, 5, 8). In-process ``batch_runner.main`` with the real
forkserver pool and the real ``openai`` client against the scripted fake model, as in test_batch_runner.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import read_jsonl, write_jsonl

import batch_runner
from batchrun.cli import EXIT_CANNOT_WRITE
from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.trajectory import first_human, row_key, valid_record
from batchrun.secrets import Redactor
from batchrun.views.report import collect
from batchrun.views.status import format_status

ROOT = Path(__file__).resolve().parent.parent


def run(server: FakeModelServer, dataset: Path, out: Path, run_name: str = "run", **kw) -> None:
    args = dict(
        dataset_file=str(dataset),
        batch_size=4,
        run_name=run_name,
        model="fake-model",
        base_url=server.base_url,
        api_key="sk-local-test",
        output_dir=str(out),
        num_workers=2,
        distribution="terminal_only",
        max_failure_rate=1.0,
    )
    args.update(kw)
    assert batch_runner.main(**args) is None


def exit_code(server: FakeModelServer, dataset: Path, out: Path, **kw) -> int:
    try:
        run(server, dataset, out, **kw)
    except SystemExit as exc:
        return int(exc.code)
    return 0


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    return path


def stats_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "statistics.json").read_text("utf-8"))


@pytest.fixture
def server():
    with FakeModelServer(latency_s=0) as srv:
        yield srv


# ----------------------------------------------------------------------------- 3. identity


def test_same_instruction_in_n_repositories_resume_runs_the_lost_row_not_its_twin(server, tmp_path):
    """Rows differ only by cwd: the one whose record is missing is the one that runs again."""
    repos = [tmp_path / "repos" / name for name in ("a", "b", "c")]
    for repo in repos:
        repo.mkdir(parents=True)
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "fix the bug", "cwd": str(r)} for r in repos])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    records = read_jsonl(run_dir / "batch_0.jsonl")
    assert sorted(r["metadata"]["cwd"] for r in records) == sorted(map(str, repos))
    for rec in records:
        meta = rec["metadata"]
        assert meta["image"] is None
        assert meta["row_key"] == row_key("fix the bug", None, meta["cwd"])

    # The record of the first row (repo a) is lost; b and c are done.
    lost = next(r for r in records if r["metadata"]["cwd"] == str(repos[0]))
    kept = [r for r in records if r is not lost]
    (run_dir / "batch_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept), "utf-8")

    before = server.stats()["requests"]
    run(server, dataset, out, resume=True)
    assert server.stats()["requests"] - before == 3  # one prompt's three model calls
    new = read_jsonl(run_dir / "batch_1.jsonl")
    assert [r["metadata"]["cwd"] for r in new] == [str(repos[0])]
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["metadata"]["cwd"] for r in merged) == sorted(map(str, repos))


@pytest.mark.docker
def test_same_instruction_in_two_images_resume_runs_exactly_the_failed_row(
    server, tmp_path, docker_test_image, capsys
):
    """The row whose image is missing fails (first in the dataset); its twin in a good image succeeds.
    A resume runs the failed row only: no model call for the finished twin."""
    run_name = f"ident-{os.getpid()}"
    missing = "127.0.0.1:9/batch-runner-missing:never"  # a registry on loopback that refuses at once
    rows = [
        {"prompt": "fix the bug", "image": missing},
        {"prompt": "fix the bug", "image": docker_test_image},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / run_name
    kw = dict(run_name=run_name, sandbox="docker", default_image=docker_test_image, num_workers=1)
    run(server, dataset, out, **kw)
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert (failed["error_class"], failed["image"]) == ("preflight", missing)
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["metadata"]["image"] == docker_test_image
    calls = server.stats()["requests"]
    capsys.readouterr()
    run(server, dataset, out, resume=True, **kw)
    assert "1 prompt(s) already finished, 1 to run" in capsys.readouterr().out
    assert server.stats()["requests"] == calls  # the twin did not run again (the failed row makes no call)
    assert [r["image"] for r in read_jsonl(run_dir / "failed.jsonl")] == [missing, missing]
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 1


def test_merge_keeps_one_record_per_identity_and_counts_duplicates_per_identity(server, tmp_path):
    repo_a, repo_b = tmp_path / "a", tmp_path / "b"
    repo_a.mkdir(), repo_b.mkdir()
    rows = [
        {"prompt": "same words", "cwd": str(repo_a)},
        {"prompt": "same words", "cwd": str(repo_b)},
        {"prompt": "same words", "cwd": str(repo_b)},  # an intentional duplicate of the row above
        {"prompt": "same words"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 4
    # An extra copy of repo a's record (say, from a crashed earlier attempt) is dropped at merge.
    batch = run_dir / "batch_0.jsonl"
    extra = next(r for r in read_jsonl(batch) if r["metadata"]["cwd"] == str(repo_a))
    with batch.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(extra) + "\n")
    before = server.stats()["requests"]
    run(server, dataset, out, resume=True)
    assert server.stats()["requests"] == before
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert collections.Counter(r["metadata"]["cwd"] for r in merged) == {
        str(repo_a): 1,
        str(repo_b): 2,
        None: 1,
    }
    assert stats_of(run_dir)["dropped_at_merge"]["duplicate"] == 1


def test_failed_and_discarded_rows_carry_the_identity(server, tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    rows = [
        {"prompt": "down [error:500]", "cwd": str(repo)},
        {"prompt": "down [error:500]"},
        {"prompt": "terse [no_reasoning]", "image": "some/image:1"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert sorted((r["cwd"] or "") for r in failed) == ["", str(repo)]
    assert all(r["row_key"] == row_key(r["prompt"], r["image"], r["cwd"]) for r in failed)
    (discard,) = read_jsonl(run_dir / "discarded.jsonl")
    assert (discard["image"], discard["cwd"]) == ("some/image:1", None)
    assert discard["record"]["metadata"]["image"] == "some/image:1"
    before = collections.Counter(server.stats()["requests_by_prompt"])
    run(server, dataset, out, resume=True)
    new = collections.Counter(server.stats()["requests_by_prompt"]) - before
    assert set(new) == {"down [error:500]"}  # both failed rows again, the discard not
    assert len(read_jsonl(run_dir / "failed.jsonl")) == 4


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_manifest.json").read_text("utf-8"))


def test_resume_refuses_changed_data_settings_and_forced_keeps_a_history(server, tmp_path, capsys):
    secret_prompt = "SYSTEM-SECRET marker-9d2e: answer in French"
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing", "two things"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, ephemeral_system_prompt=secret_prompt)
    first = _manifest(run_dir)
    for key in ("sandbox", "keep_no_reasoning", "ephemeral_system_prompt_sha256", "prefill_sha256"):
        assert key in first
    assert first["keep_no_reasoning"] is False and first["prefill_sha256"] is None
    assert "marker-9d2e" not in (run_dir / "run_manifest.json").read_text("utf-8")

    prefill = tmp_path / "prefill.json"
    prefill.write_text(json.dumps([{"role": "user", "content": "PREFILL marker-77aa example"}]), "utf-8")
    changes = [
        {"keep_no_reasoning": True},
        {"ephemeral_system_prompt": "another system prompt entirely"},
        {"ephemeral_system_prompt": None},
        {"prefill_messages_file": str(prefill)},
    ]
    for change in changes:
        capsys.readouterr()
        kw = {"ephemeral_system_prompt": secret_prompt, **change}
        assert exit_code(server, dataset, out, resume=True, **kw) == 2
        err = capsys.readouterr().err
        assert "would mix two datasets" in err
        assert "marker-9d2e" not in err and "marker-77aa" not in err
    assert _manifest(run_dir) == first

    capsys.readouterr()
    run(server, dataset, out, resume=True, keep_no_reasoning=True, force_resume=True)
    after = _manifest(run_dir)
    assert after["keep_no_reasoning"] is True and after["ephemeral_system_prompt_sha256"] is None
    (entry,) = after["history"]
    assert entry["settings"]["keep_no_reasoning"] is False
    assert entry["settings"]["ephemeral_system_prompt_sha256"] == first["ephemeral_system_prompt_sha256"]
    assert entry["replaced_at"]
    # The next resume compares with the latest settings and keeps the history.
    run(server, dataset, out, resume=True, keep_no_reasoning=True)
    assert _manifest(run_dir)["history"] == after["history"]


def test_a_manifest_of_an_older_version_still_resumes(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    old = _manifest(run_dir)
    for key in ("keep_no_reasoning", "ephemeral_system_prompt_sha256", "prefill_sha256"):
        del old[key]
    (run_dir / "run_manifest.json").write_text(json.dumps(old), "utf-8")
    run(server, dataset, out, resume=True)
    assert _manifest(run_dir)["keep_no_reasoning"] is False


# ----------------------------------------------------------------------------- 4. garbage lines

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
    assert sorted(json.loads((run_dir / "checkpoint.json").read_text())["completed_prompts"]) == [0, 1]
    # The report reads the batch files when they are newer than the merge: make them so.
    os.utime(run_dir / "batch_0.jsonl", (time.time() + 5, time.time() + 5))
    data = collect(run_dir)
    assert data.trajectories == 2
    assert data.invalid_lines == len(GARBAGE_RECORDS) + 2 * len(GARBAGE_ROWS)
    assert (run_dir / "report.html").is_file()


@pytest.mark.parametrize("content", ["null", "[1]", "{not json"])
def test_a_damaged_manifest_stops_the_resume_with_exit_2(server, tmp_path, capsys, content):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    out = tmp_path / "data"
    run(server, dataset, out)
    (out / "run" / "run_manifest.json").write_text(content, "utf-8")
    capsys.readouterr()
    assert exit_code(server, dataset, out, resume=True) == 2
    assert "the resume cannot check its settings" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 5. secrets quoted back

EPHEMERAL = 'You are "careful".\nSecret house rule marker-5f1c: never say the word banana.'
PREFILL = [
    {"role": "user", "content": "PREFILL question marker-6a2b: what is 1+1?"},
    {"role": "assistant", "content": "ok"},  # too short to be a secret: ordinary words stay
]


def test_an_endpoint_quoting_the_request_leaks_neither_system_prompt_nor_prefill(server, tmp_path, capsys):
    prefill = tmp_path / "prefill.json"
    prefill.write_text(json.dumps(PREFILL), "utf-8")
    dataset = write_jsonl(tmp_path / "d.jsonl", ["bad request [error:400] [quote_request]", "a fine task"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(
        server,
        dataset,
        out,
        ephemeral_system_prompt=EPHEMERAL,
        prefill_messages_file=str(prefill),
        verbose=True,
    )
    # The endpoint did quote them: the test would see a leak.
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert failed["error_class"] == "http_400" and "[REDACTED]" in failed["error"]
    assert "Invalid request" in failed["error"]
    captured = capsys.readouterr()
    texts = {p.name: p.read_text("utf-8") for p in run_dir.iterdir() if p.is_file()}
    texts["stdout"], texts["stderr"] = captured.out, captured.err
    assert "report.html" in texts and "failed.jsonl" in texts
    for name, text in texts.items():
        for marker in ("marker-5f1c", "marker-6a2b", "never say the word banana"):
            assert marker not in text, (name, marker)
    assert "[REDACTED]" in texts["report.html"]


def test_redactor_covers_escaped_forms_of_multiline_secrets():
    redact = Redactor(None, environ={}, secrets=(EPHEMERAL, "ok", "short"))
    once = json.dumps(EPHEMERAL)
    twice = json.dumps(once)
    for text in (EPHEMERAL, once, twice, json.dumps(EPHEMERAL, ensure_ascii=False)):
        assert "marker-5f1c" not in redact(text)
    assert redact("ok, short") == "ok, short"


# ----------------------------------------------------------------------------- 8. budgets


def test_token_budget_stops_prompts_in_flight_at_their_next_call(tmp_path):
    """40 prompts, 8 in flight, a budget of a few prompts: the overshoot is bounded by one call
    per prompt in flight; the stopped prompts fail with class budget and a resume runs them."""
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
        assert {r["error_class"] for r in failed} == {"budget"}
        assert budget["stopped_in_flight"] == len(failed) > 0
        # What the fake server counted is what the run counted.
        served = server.stats()
        assert budget["spent_tokens"] == served["prompt_tokens"] + served["completion_tokens"]
        assert budget["overshoot_tokens"] == budget["spent_tokens"] - 20000
        # Every call belongs to a prompt with an outcome, so no call cost more than the costliest outcome:
        # the bound of one call per prompt in flight.
        usages = [r["metadata"]["usage"] for r in records] + [r["usage"] for r in failed]
        biggest = max(u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        assert budget["overshoot_tokens"] <= in_flight * biggest
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


def test_limiter_credits_a_pause_another_prompt_caused_but_not_its_own():
    from batchrun.prompt.limiter import Limiter, LimitTimeout

    limiter = Limiter()
    limiter.pause_until(time.time() + 0.3)  # relayed from another worker's 429
    deadline = time.monotonic() + 0.05  # passes during the pause
    credited = limiter.acquire(deadline)
    limiter.release()
    assert credited >= 0.2 and limiter.credited_s() == credited
    limiter.pause(0.3)  # this thread's own 429: its wait counts
    with pytest.raises(LimitTimeout):
        limiter.acquire(time.monotonic() + 0.05)


# ----------------------------------------------------------------------------- 2. a run that cannot go on


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A real file system that fills up (root only); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.root
def test_disk_full_stops_with_exit_4_and_resume_gives_each_row_once(server, tmp_path, capsys):
    prompts = [f"row {i:02d} " + "lorem ipsum " * 300 for i in range(30)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    with small_tmpfs(tmp_path / "out", "96k") as out:
        run_dir = out / "run"
        assert exit_code(server, dataset, out, batch_size=50) == EXIT_CANNOT_WRITE
        err = capsys.readouterr().err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert f"cannot write {run_dir}" in line and "No space left on device" in line
        assert "Traceback" not in err
        status = json.loads((run_dir / "status.json").read_text("utf-8"))
        assert status["state"] == "failed" and "No space left on device" in status["error"]
        kept = [
            r for r in map(_parse, (run_dir / "batch_0.jsonl").read_bytes().splitlines()) if valid_record(r)
        ]
        assert 0 < len(kept) < 30
        first_run = collections.Counter(server.stats()["requests_by_prompt"])

        subprocess.run(["mount", "-o", "remount,size=16m", str(out)], check=True)
        run(server, dataset, out, resume=True, batch_size=50)
        merged = read_jsonl(run_dir / "trajectories.jsonl")
        assert sorted(first_human(r["conversations"]) for r in merged) == sorted(prompts)
        again = collections.Counter(server.stats()["requests_by_prompt"]) - first_run
        assert not {first_human(r["conversations"]) for r in kept} & set(again)  # recorded rows never re-ran
        assert json.loads((run_dir / "status.json").read_text("utf-8"))["state"] == "finished"


@pytest.mark.root
def test_an_output_directory_that_turns_read_only_stops_with_exit_4(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"row {i} [slow:0.2]" for i in range(12)])
    with small_tmpfs(tmp_path / "out", "16m") as out:
        run_dir = out / "run"
        import threading

        def make_read_only() -> None:
            # A read-only bind mount over the run directory: the runner's open lock file stays on the
            # writable mount below, every later write goes through the read-only one.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (run_dir / "batch_0.jsonl").exists():
                time.sleep(0.02)
            subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(run_dir)], check=True)

        thread = threading.Thread(target=make_read_only)
        thread.start()
        try:
            code = exit_code(server, dataset, out, num_workers=1, prompts_per_worker=2, batch_size=12)
        finally:
            thread.join()
        err = capsys.readouterr().err
        assert code == EXIT_CANNOT_WRITE
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error: cannot write")]
        assert str(run_dir) in line and "Read-only file system" in line
        assert "status.json could not say so either" in err and "Traceback" not in err
        subprocess.run(["umount", str(run_dir)], check=True)
        kept = [r for r in read_jsonl(run_dir / "batch_0.jsonl") if valid_record(r)]
        run(server, dataset, out, resume=True, batch_size=12)
        merged = read_jsonl(run_dir / "trajectories.jsonl")
        assert len(merged) == 12 and len({first_human(r["conversations"]) for r in merged}) == 12
        assert len(kept) >= 1


def test_an_output_dir_that_is_a_file_exits_2_before_anything_runs(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert exit_code(server, dataset, not_a_dir) == 2
    err = capsys.readouterr().err
    assert "--output_dir" in err and "not a directory" in err
    assert server.stats()["requests"] == 0


def test_status_shows_why_a_run_failed():
    status = {
        "run_name": "r",
        "state": "failed",
        "error": "cannot write /x/batch_0.jsonl: No space left on device",
    }
    text = format_status(status, now=time.time())
    assert "Run r: failed" in text
    assert "FAILED: cannot write /x/batch_0.jsonl: No space left on device" in text


def _parse(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def test_sigterm_before_the_dispatch_exits_130_like_ctrl_c(tmp_path):
    """SIGTERM during the endpoint check (an endpoint that never answers): exit 130, status interrupted."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; no answer ever comes
        port = silent.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=1",
             "--run_name=run", f"--output_dir={tmp_path / 'data'}", "--model=m",
             f"--base_url=http://127.0.0.1:{port}/v1", "--api_key=x"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            line = ""
            while not line.startswith("Run run:"):  # the plan is printed just before the preflight
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "--resume" in err and "Traceback" not in err
    status = json.loads((tmp_path / "data" / "run" / "status.json").read_text("utf-8"))
    assert status["state"] == "interrupted"
