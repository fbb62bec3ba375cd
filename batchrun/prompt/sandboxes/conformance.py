"""The sandbox contract: one suite of checks that every backend passes, built-in or from another package.

A backend proves itself with :func:`run_suite` (or, under pytest, by parametrizing over
:data:`CHECKS` as tests/sandboxes/test_sandboxes_contract.py does)::

    from batchrun.prompt.sandboxes.conformance import Target, run_suite

    failures = [r for r in run_suite(Target("my_backend", {"region": "eu"})) if not r.passed]

Each check builds sandboxes through the runner's own registry (``create_sandbox``), runs commands
and tool calls in them and stops every one it made. What differs between backends is said in the
:class:`Target`, never by the backend's name.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from batchrun.prompt.sandboxes import create_sandbox
from batchrun.prompt.sandboxes.base import Sandbox, SandboxError, SandboxSpec, judged_run

CAP = 4096  # the output cap the checks expect: give the backend output_cap_bytes=CAP
MISSING_IMAGE = "does-not-exist-br:never"


def host_processes(sandbox: Sandbox) -> str:
    """The host's process list: where the processes of a sandbox that shares the host's kernel show."""
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout


def own_processes(sandbox: Sandbox) -> str:
    """The sandbox's own process list (a container's)."""
    return sandbox.run("ps", timeout_s=20).output


@dataclass
class Target:
    """A backend under test and what the contract may expect of it."""

    backend: str  # a name --sandbox takes (built-in, entry point, or package.module:Class)
    options: dict[str, Any] = field(default_factory=dict)  # its options; include output_cap_bytes=CAP
    absolute_cwd: str = "/srv/proj/sub"  # an absolute cwd the backend accepts
    failing_spec: dict[str, Any] = field(default_factory=lambda: {"image": MISSING_IMAGE})  # start fails
    isolated: bool = True  # a private /tmp, and network=False leaves only loopback
    processes: Callable[[Sandbox], str] = host_processes  # where its processes can be listed
    keeps_background: bool = True  # the process tool's commands outlive the command that started them
    reaps_leftovers: bool = False  # what a command leaves running is killed when it ends
    ends_processes: bool = True  # end_processes ends everything the commands left (not: no isolation)
    run_name: str = field(default_factory=lambda: f"contract-{uuid.uuid4().hex[:8]}")


class Skip(Exception):
    """The check does not apply to this target (its reason is the message)."""


Make = Callable[..., Sandbox]


@contextmanager
def sandboxes(target: Target) -> Iterator[Make]:
    """``make(start=True, **spec_fields)`` builds (and starts) a sandbox; all are stopped at the end."""
    made: list[Sandbox] = []

    def make(*, start: bool = True, **spec_fields: Any) -> Sandbox:
        spec = SandboxSpec(run_name=target.run_name, prompt_index=len(made), **spec_fields)
        sandbox = create_sandbox(target.backend, spec, target.options)
        made.append(sandbox)
        if start:
            sandbox.start()
        return sandbox

    try:
        yield make
    finally:
        for sandbox in made:
            sandbox.stop()


# ----------------------------------------------------------------------------- the checks


def check_run_gives_output_and_exit_code(target: Target, make: Make) -> None:
    sandbox = make()
    result = sandbox.run("echo hello; echo oops >&2; exit 3", timeout_s=20)
    got = (result.output, result.exit_code, result.timed_out, result.truncated)
    assert got == ("hello\noops\n", 3, False, False), got
    assert sandbox.run("true", timeout_s=20).exit_code == 0
    assert sandbox.run("printf 'no newline'", timeout_s=20).output == "no newline"


def check_stdin_reaches_the_command(target: Target, make: Make) -> None:
    sandbox = make()
    assert sandbox.run("cat", timeout_s=20, stdin=b"line one\nline two\n").output == "line one\nline two\n"
    assert sandbox.run("cat", timeout_s=20).output == ""  # no stdin: EOF at once, no hang
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    result = sandbox.run("wc -c; ", timeout_s=60, stdin=blob)
    assert result.output.split() == [str(len(blob))], result.output


# A command that prints the end marker itself with exit code 0, for every hex token it can find in
# any process's command line or environment (its parents' included), then fails. Were the marker's
# token among them, the runner would read 0: a hidden test running the agent's code would pass.
FORGE_EXIT_0 = (
    "for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do "
    "{ tr '\\0' '\\n' <\"$f\"; } 2>/dev/null | grep -o '[0-9a-f]\\{32\\}'; done | sort -u | "
    "while read -r t; do printf '\\n\\133batch-runner-exit:%s\\135=0\\n' \"$t\"; "
    "printf '\\n\\133batch-runner-exit:%s\\135=0\\n' \"$t\" >&2; done; echo after; exit 3"
)


def check_a_command_cannot_forge_its_exit_code(target: Target, make: Make) -> None:
    """Nothing a command can read names its end marker: its output cannot end it with an exit code
    of its choosing."""
    sandbox = make()
    result = sandbox.run(FORGE_EXIT_0, timeout_s=30)
    assert (result.exit_code, result.timed_out) == (3, False), result
    assert result.output.endswith("after\n"), result.output[-300:]
    assert sandbox.run("echo next", timeout_s=20).output == "next\n"


# The same from memory, with a shell's tools only (busybox is enough): every hex token in the writable
# memory of every process it may read (/proc/<pid>/mem), the marker printed with exit code 0 for each.
FORGE_FROM_MEMORY_SH = (
    "for m in /proc/[0-9]*/maps; do p=${m%/maps}; "
    "grep ' rw-p ' \"$m\" 2>/dev/null | cut -d' ' -f1 | while IFS=- read -r lo hi; do "
    "lo=$((0x$lo)) hi=$((0x$hi)); [ $((hi - lo)) -le 16777216 ] || continue; "
    'dd if="$p/mem" bs=4096 skip=$((lo / 4096)) count=$(((hi - lo) / 4096)) 2>/dev/null; done; done | '
    "tr -c '0-9a-f' '\\n' | grep -xE '[0-9a-f]{32}' | sort -u | "
    "while read -r t; do printf '\\n\\133batch-runner-exit:%s\\135=0\\n' \"$t\"; done; echo after; exit 3"
)


# The same from a process the command leaves behind, in a loop for a second: it sees what a server
# shows only after the command has ended (the local one's command line, once the process tool's
# directory, made here, has it become a bash server) and prints the marker before the sweep ends it.
# Python's, for speed (a loop of `tr` and `grep` lost that race): without python3 it just fails.
FORGE_AFTER_EXIT = (
    "command -v python3 >/dev/null || exit 3; mkdir -p ${TMPDIR:-/tmp}/.batch-runner-processes; python3 -c '"
    "import glob, os, re, time\n"
    "seen, end = set(), time.monotonic() + 1\n"
    "while time.monotonic() < end:\n"
    '    for f in glob.glob("/proc/[0-9]*/cmdline"):\n'
    "        try:\n"
    '            found = set(re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", open(f, "rb").read()))\n'
    "        except OSError:\n"
    "            continue\n"
    "        for t in found - seen:\n"
    '            os.write(1, b"\\n[batch-runner-exit:" + t + b"]=0\\n")\n'
    "        seen |= found' & sleep 0.3; exit 3"
)


def check_a_judged_command_cannot_forge_its_exit_code(target: Target, make: Make) -> None:
    """A command that judges a sample (verify; ``run_judged`` where the sandbox has it) reports its
    real exit code, even when it reads every process's memory it may for the end marker's token."""
    if not target.isolated:
        raise Skip("without isolation the commands run beside the runner, as its user")
    sandbox = make()
    run = getattr(sandbox, "run_judged", None) or sandbox.run
    for script in (FORGE_EXIT_0, FORGE_FROM_MEMORY_SH, FORGE_AFTER_EXIT):
        result = run(script, timeout_s=60)
        assert (result.exit_code, result.timed_out) == (3, False), result
    assert run("echo next; exit 4", timeout_s=20).exit_code == 4


def check_timeout_kills_the_command_and_its_children(target: Target, make: Make) -> None:
    sandbox = make()
    tag = random.randint(10_000, 99_999)  # unique sleep durations to find in the process list
    started = time.monotonic()
    result = sandbox.run(f"echo started; sleep {tag} & sleep {tag + 1}; echo never", timeout_s=1)
    assert time.monotonic() - started < 8
    assert result.timed_out and result.exit_code == -1, result
    assert "never" not in result.output
    time.sleep(0.3)
    listing = target.processes(sandbox)
    assert f"sleep {tag}" not in listing and f"sleep {tag + 1}" not in listing, "a child outlived the timeout"
    assert sandbox.run("echo still usable", timeout_s=20).output == "still usable\n"


def check_background_process_does_not_block_run(target: Target, make: Make) -> None:
    sandbox = make()
    started = time.monotonic()
    result = sandbox.run("sleep 50 & echo started", timeout_s=30)
    assert (result.output, result.exit_code, result.timed_out) == ("started\n", 0, False), result
    assert time.monotonic() - started < 40, "run waited for the 50 s background sleep"


def check_output_is_capped_with_a_note(target: Target, make: Make) -> None:
    sandbox = make()
    result = sandbox.run("head -c 100000 /dev/zero | tr '\\0' x; echo; echo tail", timeout_s=30)
    assert result.truncated and result.exit_code == 0, result.exit_code
    # Its start and its end (where a test prints its summary, a verify its score), the note between.
    start = CAP - CAP // 4
    assert result.output.startswith("x" * start + "\n[output truncated: ")
    assert result.output.endswith("\ntail\n") and result.output.count("output truncated") == 1
    assert len(result.output) < CAP + 200


def check_file_round_trip_through_the_file_tools(target: Target, make: Make) -> None:
    from batchrun.prompt.tools.catalog import execute_tool_call
    from batchrun.prompt.tools.registry import ToolContext

    sandbox = make()
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=30.0, output_cap_bytes=CAP)
    offered = {"write_file", "read_file"}
    content = "héllo wörld\n$HOME `backticks` 'quotes' \\ back\nlast"
    written = json.loads(
        execute_tool_call("write_file", json.dumps({"path": "notes/a.txt", "content": content}), ctx, offered)
    )
    assert not written.get("error"), written
    read = json.loads(execute_tool_call("read_file", json.dumps({"path": "notes/a.txt"}), ctx, offered))
    assert read["content"] == "\n".join(f"{n:6d}|{line}" for n, line in enumerate(content.split("\n"), 1))
    assert sandbox.run("cat notes/a.txt", timeout_s=20).output == content


def check_cwd_is_honoured_and_created(target: Target, make: Make) -> None:
    cwd = target.absolute_cwd
    sandbox = make(cwd=cwd)
    assert sandbox.workdir == cwd, sandbox.workdir
    assert sandbox.run("pwd", timeout_s=20).output == f"{cwd}\n"
    sandbox.run("echo x > here.txt", timeout_s=20)
    assert sandbox.run(f"cat {cwd}/here.txt", timeout_s=20).output == "x\n"
    relative = make(cwd="rel/dir")
    assert relative.workdir.endswith("/rel/dir"), relative.workdir
    assert relative.run("pwd", timeout_s=20).output == f"{relative.workdir}\n"


def check_two_sandboxes_do_not_see_each_others_files(target: Target, make: Make) -> None:
    first, second = make(), make()
    first.run("echo secret > left.txt", timeout_s=20)
    assert first.run("cat left.txt", timeout_s=20).output == "secret\n"
    assert second.run("cat left.txt", timeout_s=20).exit_code != 0, "the second sandbox sees the first's file"
    if target.isolated:  # without isolation /tmp is the host's: nothing to check there
        first.run("echo secret > /tmp/left-tmp.txt", timeout_s=20)
        assert first.run("cat /tmp/left-tmp.txt", timeout_s=20).exit_code == 0
        assert second.run("cat /tmp/left-tmp.txt", timeout_s=20).exit_code != 0, "/tmp is shared"


def check_environment_has_spec_env_and_no_host_secrets(target: Target, make: Make) -> None:
    import os

    name, secret = "OPENROUTER_API_KEY", f"sk-or-must-not-leak-{uuid.uuid4().hex[:8]}"
    before = os.environ.get(name)
    os.environ[name] = secret
    try:
        output = make(env={"GREETING": "hi there"}).run("env", timeout_s=20).output
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
    assert "GREETING=hi there" in output
    assert secret not in output, "a host secret reached the sandbox's environment"


def check_no_network_leaves_only_loopback(target: Target, make: Make) -> None:
    if not target.isolated:
        raise Skip("a sandbox without isolation cannot cut the network")
    sandbox = make(network=False)
    devices = sandbox.run("cat /proc/net/dev", timeout_s=20).output.splitlines()[2:]
    assert [line.split(":")[0].strip() for line in devices] == ["lo"], devices


def check_stop_is_idempotent_and_run_after_stop_fails(target: Target, make: Make) -> None:
    sandbox = make()
    sandbox.stop()
    sandbox.stop()
    try:
        sandbox.run("true", timeout_s=5)
    except SandboxError:
        return
    raise AssertionError("run after stop did not raise SandboxError")


def check_failed_start_raises_and_stop_is_safe(target: Target, make: Make) -> None:
    sandbox = make(start=False, **target.failing_spec)
    try:
        sandbox.start()
    except SandboxError:
        pass
    else:
        raise AssertionError(f"start with {target.failing_spec} did not raise SandboxError")
    sandbox.stop()
    sandbox.stop()


def check_process_tool_keeps_a_background_command_between_commands(target: Target, make: Make) -> None:
    """Started by the process tool, a command lives on while other commands come and go."""
    from batchrun.prompt.tools.catalog import execute_tool_call
    from batchrun.prompt.tools.registry import ToolContext

    if not target.keeps_background:
        raise Skip("this target ends every process with its exec")
    sandbox = make()
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=30.0, output_cap_bytes=CAP)

    def call(**args: Any) -> dict[str, Any]:
        return json.loads(execute_tool_call("process", json.dumps(args), ctx, {"process"}))

    def wait_for(proc_id: str, status: str) -> dict[str, Any]:
        deadline = time.monotonic() + 20
        while (got := call(action="poll", id=proc_id))["status"] != status:
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        return got

    tag = random.randint(100_000, 999_999)
    waiter = call(
        action="start", command="echo ready; while [ ! -f stop-now ]; do sleep 1; done; echo bye; exit 3"
    )
    assert waiter["status"] == "running" and waiter["id"] == "p1", waiter
    sleeper = call(action="start", command=f"sleep {tag}")
    # Other commands run and end, and a terminal command's own leftovers are still swept where the
    # backend sweeps them; the background commands live on.
    assert sandbox.run(f"echo other; sleep {tag + 1} >/dev/null 2>&1 &", timeout_s=20).output == "other\n"
    assert sandbox.run("sleep 2", timeout_s=20).exit_code == 0
    # A command that times out is killed with its children, not the background commands.
    timed_out = sandbox.run(f"sleep {tag + 2} & sleep {tag + 3}", timeout_s=1)
    assert timed_out.timed_out
    assert (polled := call(action="poll", id=waiter["id"]))["status"] == "running", polled
    assert call(action="read", id=waiter["id"])["output"] == "ready\n"
    assert call(action="read", id=waiter["id"])["output"] == ""  # read only once
    listing = target.processes(sandbox)
    assert f"sleep {tag}" in listing
    assert f"sleep {tag + 2}" not in listing and f"sleep {tag + 3}" not in listing
    if target.reaps_leftovers:
        assert f"sleep {tag + 1}" not in listing

    sandbox.run("touch stop-now", timeout_s=20)  # in the working directory the background command shares
    done = wait_for(waiter["id"], "exited")
    assert done["exit_code"] == 3 and done["unread_bytes"] == len("bye\n"), done
    assert call(action="read", id=waiter["id"])["output"] == "bye\n"

    killed = call(action="kill", id=sleeper["id"])
    assert killed["status"] == "killed", killed
    deadline = time.monotonic() + 10
    while f"sleep {tag}\n" in target.processes(sandbox) + "\n":
        assert time.monotonic() < deadline, "the killed process still runs"
        time.sleep(0.2)
    listed = [(p["id"], p["status"]) for p in call(action="list")["processes"]]
    assert listed == [("p1", "exited"), ("p2", "killed")], listed


def check_end_processes_ends_what_the_commands_left(target: Target, make: Make) -> None:
    """Before a sample is judged, nothing its agent started runs on: not what the process tool
    started, nor a process that marked and detached itself, nor one forking in a loop."""
    from batchrun.prompt.tools.catalog import execute_tool_call
    from batchrun.prompt.tools.registry import ToolContext

    if not target.ends_processes:
        raise Skip("this target cannot end the processes its commands leave")
    sandbox = make()
    end = getattr(sandbox, "end_processes", None)
    assert end is not None, "the backend has no end_processes(timeout_s)"
    tag = random.randint(100_000, 999_999)
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=30.0, output_cap_bytes=CAP)
    started = json.loads(
        execute_tool_call(
            "process", json.dumps({"action": "start", "command": f"sleep {tag}"}), ctx, {"process"}
        )
    )
    assert started.get("status") == "running" or not target.keeps_background, started
    detach = "mkdir -p ${TMPDIR:-/tmp}/.batch-runner-processes; BATCH_RUNNER_BACKGROUND=1 setsid sh -c"
    sandbox.run(f"{detach} 'sleep {tag + 1}' >/dev/null 2>&1 &", timeout_s=20)
    sandbox.run(f"{detach} 'while :; do sleep {tag + 2} & sleep 1; done' >/dev/null 2>&1 &", timeout_s=20)
    time.sleep(0.3)
    assert end(30) is None
    listing = target.processes(sandbox)
    assert all(f"sleep {tag + i}" not in listing for i in range(3)), listing
    assert sandbox.run("echo still usable", timeout_s=20).output == "still usable\n"
    assert end(30) is None  # nothing left: at once


# A process whose first thread exits while another runs on: its /proc entry says Z (a zombie), yet its
# thread rewrites the hidden test as soon as it appears. Python's: a busybox image has no compiler.
FIRST_THREAD_EXITS = (
    "mkdir -p ${TMPDIR:-/tmp}/.batch-runner-processes; BATCH_RUNNER_BACKGROUND=1 setsid python3 -c '"
    "import ctypes, threading, time\n"
    "def rewrite():\n"
    "    while True:\n"
    '        open("check.sh", "w").write("exit 0\\n")\n'
    "        time.sleep(0.01)\n"
    "threading.Thread(target=rewrite).start()\n"
    "time.sleep(0.2)\n"
    "ctypes.CDLL(None).pthread_exit(None)' >/dev/null 2>&1 & sleep 0.5; "
    "grep -q '^State:.*Z' /proc/$!/status && grep -q '^Threads:.*2' /proc/$!/status && echo planted"
)


def check_end_processes_ends_a_process_whose_first_thread_exited(target: Target, make: Make) -> None:
    """A thread group whose first thread has exited reads as a zombie, but its other threads run on:
    end_processes ends them too (they rewrote the hidden test after it, and the verify passed)."""
    if not target.ends_processes:
        raise Skip("this target cannot end the processes its commands leave")
    sandbox = make()
    if sandbox.run("command -v python3", timeout_s=20).exit_code != 0:
        raise Skip("no python3 in the sandbox to make such a process with")
    planted = sandbox.run(FIRST_THREAD_EXITS, timeout_s=30)
    assert planted.output == "planted\n", planted
    assert sandbox.end_processes(30) is None  # type: ignore[attr-defined]
    sandbox.run("echo 'echo the hidden test; exit 1' > check.sh", timeout_s=20)
    time.sleep(0.3)
    res = sandbox.run("sh check.sh", timeout_s=20)
    assert (res.output, res.exit_code) == ("the hidden test\n", 1), res


# The agent points /dev/fd and /dev/stdin at files of its own (where /dev is writable to it): a hidden
# test comparing through them (bash's `diff <(...) <(...)`, `cmp /dev/fd/3 /dev/fd/4`) compared the
# agent's files and passed whatever the work.
PLANT_DEV = (
    "rm -f /dev/fd /dev/stdin; mkdir -p /dev/.f; for i in 3 4 in; do echo same > /dev/.f/$i; done; "
    "ln -s /dev/.f /dev/fd; ln -s /dev/.f/in /dev/stdin; true"
)
JUDGED_DEV = "echo 1 > a; echo 2 > b; cmp /dev/fd/3 /dev/fd/4 3<a 4<b >/dev/null 2>&1; echo $?; echo in | cat /dev/stdin"


def check_a_sample_is_judged_with_the_standard_dev_links(target: Target, make: Make) -> None:
    """Whatever the agent did to /dev (read-only in the local sandbox; put back before judging where the
    judging user may write it, base.RESTORE_DEV), the judged commands' /dev/fd and /dev/stdin are the
    standard ones."""
    if not target.ends_processes:  # without isolation /dev is the host's: nothing is planted there
        raise Skip("this target cannot end the processes its commands leave, nor judge apart from them")
    sandbox = make()
    assert sandbox.run(f"{PLANT_DEV} 2>/dev/null; echo planted", timeout_s=30).output.endswith("planted\n")
    assert sandbox.end_processes(30) is None  # type: ignore[attr-defined]
    res = judged_run(sandbox)(JUDGED_DEV, timeout_s=30)
    assert (res.output, res.exit_code) == ("1\nin\n", 0), res


# Judged commands whose processes orphan others (a shell's `(cmd &)`, a test that starts a daemon):
# each many, after the agent left many processes that end_processes killed. An init reaps what
# is orphaned to it; one stopped while the sample is judged did not: the zombies filled the pids
# limit (512) and a later command could not fork, and a test that stopped its daemon saw it alive.
AGENT_LEAVES = "for i in $(seq 300); do sleep 1000 & done; echo > left; wait"
ORPHANS = "for i in $(seq 300); do (sleep 0 &); done; echo made"
DAEMON_STOPPED = (
    "sh -c 'sleep 1000 & echo $! > daemon.pid'; p=$(cat daemon.pid); kill $p; i=0; "
    "while kill -0 $p 2>/dev/null; do i=$((i + 1)); [ $i -lt 100 ] || exit 1; sleep 0.05; done; echo stopped"
)
ZOMBIES = (
    "n=0; for f in /proc/[0-9]*/stat; do { read -r l < $f; } 2>/dev/null || continue; "
    'set -- ${l##*) }; [ "$1" = Z ] && n=$((n + 1)); done; echo $n'
)


def check_judged_commands_do_not_fill_the_sandbox_with_zombies(target: Target, make: Make) -> None:
    """What the agent left (killed before judging) and what the judged commands orphan is reaped
    while the sample is judged, as between the agent's commands."""
    if not target.ends_processes:
        raise Skip("this target cannot end the processes its commands leave")
    sandbox = make()
    detach = "mkdir -p ${TMPDIR:-/tmp}/.batch-runner-processes; BATCH_RUNNER_BACKGROUND=1 setsid sh -c"
    left = f"{detach} '{AGENT_LEAVES}' >/dev/null 2>&1 & while [ ! -s left ]; do sleep 0.1; done"
    assert sandbox.run(left, timeout_s=30).exit_code == 0
    assert sandbox.end_processes(60) is None  # type: ignore[attr-defined]
    run = getattr(sandbox, "run_judged", None) or sandbox.run
    for _ in range(3):
        res = run(ORPHANS, timeout_s=60)
        assert (res.output, res.exit_code) == ("made\n", 0), res
    res = run(DAEMON_STOPPED, timeout_s=60)
    assert (res.output, res.exit_code) == ("stopped\n", 0), res
    zombies = run(ZOMBIES, timeout_s=20).output
    assert int(zombies) <= 5, zombies  # one still running when its command ended may be left


CHECKS: dict[str, Callable[[Target, Make], None]] = {
    name.removeprefix("check_"): check
    for name, check in sorted(globals().items())
    if name.startswith("check_") and callable(check)
}


# ----------------------------------------------------------------------------- running the suite


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    skipped: bool = False
    detail: str = ""  # the failure (assertion and where), or why it was skipped


def run_check(target: Target, name: str) -> None:
    """Run one check (raises AssertionError on a failure, :class:`Skip` where it does not apply)."""
    with sandboxes(target) as make:
        CHECKS[name](target, make)


def run_suite(target: Target, names: list[str] | None = None) -> list[CheckResult]:
    """Run the checks (all, or ``names``) against ``target``; never raises for a failing check."""
    results = []
    for name in names or list(CHECKS):
        try:
            run_check(target, name)
        except Skip as exc:
            results.append(CheckResult(name, passed=True, skipped=True, detail=str(exc)))
        except Exception:
            results.append(CheckResult(name, passed=False, detail=traceback.format_exc(limit=4)))
        else:
            results.append(CheckResult(name, passed=True))
    return results
