"""The reference's Python API (batchrun/api.py) called the ways scripts, notebooks and services call it:
an unguarded script, a thread that is not the main one, a running event loop, twice in one process.
Real runs against the in-package fake model (``model="mock"``) in the real local sandbox."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import ROOT, read_jsonl, write_jsonl

import batch_runner
from batchrun.config import UsageError

RUNS = pytest.mark.usefixtures("bwrap_available")  # a real run in the local sandbox


def runner(run_name: str, **kw) -> batch_runner.BatchRunner:
    args = {"distribution": "terminal_only", "model": "mock", "num_workers": 1, **kw}
    return batch_runner.BatchRunner(dataset_file="p.jsonl", batch_size=2, run_name=run_name, **args)


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    """``script`` (given ``args``) run by this interpreter in its own directory, with this checkout's package."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@RUNS
def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """Scripts written for the reference (whose workers forked) call BatchRunner(...).run() at the top
    level; a worker process must not run the script again (it failed every prompt as pool_broken)."""
    write_jsonl(tmp_path / "p.jsonl", ["One [calls:1]", "Two [calls:1]", "Three [calls:1]"])
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            with open("runs.log", "a") as f:
                f.write(f"{os.getpid()}\\n")
            from batch_runner import BatchRunner
            code = BatchRunner(dataset_file="p.jsonl", batch_size=2, run_name="top", model="mock",
                               num_workers=2, distribution="terminal_only").run()
            print("exit code", code)
            """
        ),
        encoding="utf-8",
    )
    done = run_script(script)
    assert "exit code 0" in done.stdout, done.stderr[-3000:]
    assert len((tmp_path / "runs.log").read_text().split()) == 1  # the script ran once, in this process
    assert "Traceback" not in done.stderr
    assert len(read_jsonl(tmp_path / "data" / "top" / "trajectories.jsonl")) == 3


@RUNS
def test_run_from_a_thread_that_is_not_the_main_one(tmp_path, monkeypatch):
    """A service runs it on a worker thread, where no signal handler can be installed."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", ["One [calls:1]", "Two [calls:1]"])
    result: dict = {}

    def go() -> None:
        try:
            result["code"] = runner("threaded").run()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=go)
    thread.start()
    thread.join(120)
    assert result == {"code": 0}
    assert len(read_jsonl(tmp_path / "data" / "threaded" / "trajectories.jsonl")) == 2


# Run in a process of its own: in the test suite's, other tests' servers and threads open and close
# descriptors meanwhile (the fresh-clone CI once counted 60 against 59).
PROCESS_STATE_SCRIPT = """
import gc, json, os, signal, sys, threading, time
from batch_runner import BatchRunner

def runner(name):
    return BatchRunner(dataset_file="p.jsonl", batch_size=2, run_name=name, distribution="terminal_only",
                       model="mock", num_workers=1)

def state():
    gc.collect()  # a socket in a reference cycle is closed at the next collection
    umask = os.umask(0o022)
    os.umask(umask)
    fds = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            fds[n] = os.readlink(f"/proc/self/fd/{n}")
        except OSError:  # the listing's own descriptor
            continue
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "fds": fds,
        "sigint": repr(signal.getsignal(signal.SIGINT)),
        "sigterm": repr(signal.getsignal(signal.SIGTERM)),
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "umask": umask,
        "streams": [id(sys.stdout), id(sys.stderr)],
        "hooks": [repr(h) for h in (sys.unraisablehook, sys.excepthook, threading.excepthook)],
    }

assert runner("first").run() == 0  # the process-wide parts start once (the forkserver, tqdm's monitor)
before = state()
same = runner("again")
for name in ("second", "third"):
    assert runner(name).run() == 0
assert same.run() == 0 and same.run(resume=True) == 0
deadline = time.monotonic() + 5  # what a run ends in another thread (a worker's connection) settles
while (after := state()) != before and time.monotonic() < deadline:
    time.sleep(0.1)
print("STATE " + json.dumps({"before": before, "after": after}))
"""


@RUNS
def test_runs_one_after_another_leave_the_process_as_they_found_it(tmp_path):
    """A notebook or a service runs many in one process: each run's threads, sockets and handlers end with it
    (before, every run left 3 threads and 4 open sockets: the inbox's accept thread, the start check's
    connections and the fake model's threads serving them)."""
    write_jsonl(tmp_path / "p.jsonl", ["One [calls:1]", "Two [calls:1]"])
    script = tmp_path / "runs.py"
    script.write_text(PROCESS_STATE_SCRIPT, encoding="utf-8")
    done = run_script(script)
    line = next((x for x in done.stdout.splitlines() if x.startswith("STATE ")), None)
    assert line is not None, done.stderr[-3000:]
    seen = json.loads(line.removeprefix("STATE "))
    assert seen["after"] == seen["before"]
    assert len(read_jsonl(tmp_path / "data" / "again" / "trajectories.jsonl")) == 2


@RUNS
def test_an_environment_changed_between_runs_reaches_the_second_runs_workers(tmp_path, monkeypatch):
    """The workers fork from a server started at the first run: they kept its environment (TZ, a proxy,
    DOCKER_HOST) while the parent's checks read the new one."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", ["Show [run:echo zone=$TZ.]"])
    seen = []
    for name, zone in (("before", "UTC"), ("after", "Asia/Tokyo")):
        monkeypatch.setenv("TZ", zone)
        assert runner(name).run() == 0
        (record,) = read_jsonl(tmp_path / "data" / name / "trajectories.jsonl")
        tool = next(turn["value"] for turn in record["conversations"] if turn["from"] == "tool")
        seen.append(tool.split("zone=")[1].split(".")[0])
    assert seen == ["UTC", "Asia/Tokyo"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # a value that was silently read as another: each names the argument now
        ({"providers_allowed": ["anthropic", None]}, "providers_allowed must be a list of names"),
        ({"reasoning_config": {"enabled": "maybe"}}, "reasoning_config: 'enabled' must be true or false"),
        ({"reasoning_config": {"effort": "hihg"}}, "reasoning_config: 'effort' must be one of"),
        # the same setting twice: one silently won
        ({"max_iterations": 3, "max_turns": 5}, "max_iterations and max_turns"),
        (
            {"reasoning_config": {"effort": "none"}, "reasoning_effort": "high"},
            "reasoning_config and reasoning_effort",
        ),  # fmt: skip
        (
            {"prefill_messages": [], "prefill_messages_file": "missing.json"},
            "prefill_messages and prefill_messages_file",
        ),  # fmt: skip
        # a malformed prefill: named as the argument (not a temporary file), never a TypeError
        (
            {"prefill_messages": [{"role": "user", "content": b"bytes"}]},
            "prefill_messages: message 0 must be",
        ),
        ({"prefill_messages": ["hello"]}, "prefill_messages: message 0 must be"),
        (
            {"prefill_messages": [{"role": "user", "content": "x", "tags": {"a"}}]},
            "prefill_messages: Object of type set",
        ),  # fmt: skip
        # the command line's listing skips every check of a run: a run started unchecked, then a traceback
        (
            {"list_distributions": True, "distribution": "zzz"},
            "list_distributions is the command line's listing",
        ),  # fmt: skip
    ],
)
def test_a_bad_argument_is_refused_naming_it_before_anything_starts(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", ["x"])
    with pytest.raises(UsageError) as caught:
        runner("bad", **args)
    assert message in str(caught.value)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("args", "field", "value"),
    [
        ({"reasoning_config": {"enabled": 0}}, "reasoning_disabled", True),  # ignored before: model default
        ({"reasoning_config": {"enabled": "false"}}, "reasoning_disabled", True),
        ({"reasoning_config": {"enabled": True, "effort": "low"}}, "reasoning_effort", "low"),
        (
            {"providers_allowed": ["anthropic,openai"]},
            "providers_allowed",
            ("anthropic", "openai"),
        ),  # as --flag=a,b
        ({"providers_order": ("openai", "anthropic")}, "providers_order", ("openai", "anthropic")),
        ({"max_turns": 4}, "max_turns", 4),  # the command line's name, max_iterations at its default
        ({"num_workers": "2"}, "num_workers", 2),  # as the command line reads it
    ],
)
def test_an_argument_means_what_the_command_lines_flag_means(tmp_path, monkeypatch, args, field, value):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", ["x"])
    assert getattr(runner("ok", **args).config, field) == value


@pytest.mark.parametrize("name", ["nope", "", None, 123])
def test_toolset_distributions_answer_a_bad_name_as_the_reference(name, capsys):
    """None for get_distribution, False for validate_distribution (an AttributeError traceback for None
    or a number before), ValueError for sampling, a printed line for print_distribution_info."""
    import toolset_distributions as td

    assert td.get_distribution(name) is None
    assert td.validate_distribution(name) is False
    with pytest.raises(ValueError):
        td.sample_toolsets_from_distribution(name)
    td.print_distribution_info(name)
    assert capsys.readouterr().out == f"Unknown distribution: {name}\n"


@RUNS
def test_ctrl_c_during_run_returns_130_and_a_resume_in_the_same_process_finishes_exactly_once(tmp_path):
    """Ctrl-C in the caller's thread mid-run: finished prompts kept, run() returns 130, and
    run(resume=True) on the same object completes every prompt once."""
    write_jsonl(tmp_path / "p.jsonl", [f"Prompt {i} [slow:0.5] [calls:1]" for i in range(8)])
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, threading, time
            from pathlib import Path
            from batch_runner import BatchRunner

            def interrupt():
                while not any(p.stat().st_size for p in Path("data/ci").glob("batch_*.jsonl")):
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGINT)

            if __name__ == "__main__":
                # Ctrl-C as in a terminal: a test run started in the background (`cmd &` without job
                # control) inherits SIGINT ignored, and the signal then never reached the run.
                signal.signal(signal.SIGINT, signal.default_int_handler)
                runner = BatchRunner(dataset_file="p.jsonl", batch_size=4, run_name="ci", model="mock",
                                     num_workers=1, distribution="terminal_only")
                threading.Thread(target=interrupt, daemon=True).start()
                print("first", runner.run(), flush=True)
                print("second", runner.run(resume=True), flush=True)
            """
        ),
        encoding="utf-8",
    )
    done = run_script(script)
    codes = [line for line in done.stdout.splitlines() if line.startswith(("first ", "second "))]
    assert codes == ["first 130", "second 0"], done.stderr[-3000:]
    records = read_jsonl(tmp_path / "data" / "ci" / "trajectories.jsonl")
    prompts = sorted(turn["value"] for r in records for turn in r["conversations"] if turn["from"] == "human")
    assert prompts == sorted(f"Prompt {i} [slow:0.5] [calls:1]" for i in range(8))
    assert "Traceback" not in done.stderr


@RUNS
def test_the_resume_hint_of_a_run_from_python_is_the_call_not_the_scripts_command_line(tmp_path):
    """A run started from a script printed its script's arguments as the command to continue with:
    ``python gen.py --shard=3`` ended with ``python batch_runner.py --shard=3 --resume``, a command that
    exits 2 (no such flag). From Python the hint is the call with resume=True; the command line's own
    run still prints its command, without the key."""
    write_jsonl(tmp_path / "p.jsonl", ["fine", "fails [error:400]"])
    script = tmp_path / "gen.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from batch_runner import BatchRunner, cli

            if sys.argv[1] == "--shard=3":
                BatchRunner("p.jsonl", 2, "api", distribution="terminal_only", model="mock", num_workers=1,
                            max_failure_rate=1).run()
            else:
                sys.argv = ["batch_runner.py", *sys.argv[1:]]
                cli()
            """
        )
    )
    done = run_script(script, "--shard=3")
    hint = done.stdout.split("continue with:\n", 1)[1].splitlines()[0].strip()
    assert hint.startswith("the same call with resume=True") and "shard" not in hint, done.stdout
    flags = ["--dataset_file=p.jsonl", "--batch_size=2", "--run_name=cli", "--distribution=terminal_only"]
    flags += ["--model=mock", "--num_workers=1", "--max_failure_rate=1", "--api_key=sk-not-shown-12345"]
    done = run_script(script, *flags)
    hint = done.stdout.split("continue with:\n", 1)[1].splitlines()[0].strip()
    assert hint == "python batch_runner.py " + " ".join(flags[:-1]) + " --resume", done.stdout


@RUNS
def test_the_resume_hint_leaves_the_ephemeral_prompts_text_out_and_says_so(tmp_path):
    """The printed command held '--ephemeral_system_prompt=[REDACTED]' (the summary redacts the text): run
    as printed it was refused (another prompt), and with --force_resume it sent the model "[REDACTED]" as
    its system prompt. The flag is left out now and named in a shell comment; with the text given again
    (here through its environment variable), the command as printed resumes the run."""
    write_jsonl(tmp_path / "p.jsonl", ["fine", "fails [error:400]"])
    script = tmp_path / "gen.py"
    script.write_text("import sys\nfrom batch_runner import cli\nsys.argv[0] = 'batch_runner.py'\ncli()\n")
    flags = ["--dataset_file=p.jsonl", "--batch_size=2", "--run_name=cli", "--distribution=terminal_only"]
    flags += ["--model=mock", "--num_workers=1", "--max_failure_rate=1"]
    done = run_script(script, *flags, "--ephemeral_system_prompt", "Be brief, please")
    hint = done.stdout.split("continue with:\n", 1)[1].splitlines()[0].strip()
    assert "REDACTED" not in done.stdout and "Be brief" not in done.stdout, done.stdout
    command, _, comment = hint.partition("  # ")
    assert command == "python batch_runner.py " + " ".join(flags) + " --resume", hint
    assert comment.startswith("and the same --ephemeral_system_prompt (its text is not shown"), hint
    argv = shlex.split(command, comments=True)
    assert argv[:2] == ["python", "batch_runner.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BATCH_RUNNER_EPHEMERAL_SYSTEM_PROMPT": "Be brief, please"}
    again = subprocess.run(
        [sys.executable, str(script), *argv[2:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "settings that differ" not in again.stderr and "1 prompt(s) already finished" in again.stdout, (
        again.stdout + again.stderr
    )


@RUNS
def test_a_script_finds_the_output_under_the_references_attribute_names(tmp_path, monkeypatch):
    """Scripts written for the reference read their results through ``runner.output_dir``,
    ``runner.stats_file`` and ``runner.checkpoint_file``; those were AttributeErrors."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", ["one", "two"])
    r = runner("attrs")
    assert r.output_dir == Path("data") / "attrs"
    assert r.run() == 0
    assert len(read_jsonl(r.output_dir / "trajectories.jsonl")) == 2
    assert json.loads(r.stats_file.read_text())["total_prompts"] == 2
    assert json.loads(r.checkpoint_file.read_text())["completed_prompts"] == [0, 1]
