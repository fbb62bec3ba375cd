"""The sandbox contract: one set of tests that every backend passes.

Backends: local without isolation, local inside bubblewrap, Docker on the real engine (marker
``docker``; fails in CI when no engine answers), and Singularity and Modal through their fakes
(a fake ``apptainer`` CLI and a fake ``modal`` SDK that run commands in a local busybox root).
"""

from __future__ import annotations

import json
import random
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchrun.prompt.sandboxes import create_sandbox
from batchrun.prompt.sandboxes.base import Sandbox, SandboxError, SandboxSpec

CAP = 4096
RUN = f"contract-{uuid.uuid4().hex[:8]}"  # unique: other test sessions may share this Docker engine
MISSING_IMAGE = "does-not-exist-br:never"

KINDS = [
    pytest.param("local-none", id="local-none"),
    pytest.param("local-bwrap", id="local-bwrap", marks=pytest.mark.bwrap),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
    pytest.param("singularity-fake", id="singularity-fake"),
    pytest.param("modal-fake", id="modal-fake"),
]
Make = Callable[..., Sandbox]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict]:
    """The registry name and options of this kind, with whatever it needs (engine, image, fakes) ready."""
    if kind.startswith("local"):
        if kind == "local-bwrap":
            request.getfixturevalue("bwrap_available")
        isolation = kind.removeprefix("local-")
        options = {"output_cap_bytes": CAP, "isolation": isolation, "base_dir": str(tmp_path)}
        if isolation == "none":  # an absolute cwd is a host path there, allowed under cwd_root only
            options["cwd_root"] = str(tmp_path)
        return "local", options
    if kind == "docker":
        image = request.getfixturevalue("docker_test_image")
        return "docker", {"output_cap_bytes": CAP, "default_image": image, "memory_mb": 256}
    if kind == "singularity-fake":
        request.getfixturevalue("fake_apptainer")
        return "singularity", {
            "output_cap_bytes": CAP,
            "default_image": "busybox:latest",
            "base_dir": str(tmp_path),
        }
    request.getfixturevalue("fake_modal")
    return "modal", {"output_cap_bytes": CAP, "default_image": "busybox:latest", "timeout_s": 600}


@pytest.fixture
def make(backend: tuple[str, dict]) -> Iterator[Make]:
    """``make(**spec_fields)`` builds and starts a sandbox; every one made is stopped at teardown."""
    name, options = backend
    made: list[Sandbox] = []

    def factory(*, start: bool = True, **spec_fields) -> Sandbox:
        sandbox = create_sandbox(
            name, SandboxSpec(run_name=RUN, prompt_index=len(made), **spec_fields), options
        )
        made.append(sandbox)
        if start:
            sandbox.start()
        return sandbox

    yield factory
    for sandbox in made:
        sandbox.stop()


def absolute_cwd(kind: str, tmp_path: Path) -> str:
    # Without isolation a cwd is a host path: keep it inside the test's directory (its cwd_root).
    return str(tmp_path / "proj" / "sub") if kind == "local-none" else "/srv/proj/sub"


def processes(kind: str, sandbox: Sandbox) -> str:
    """The process list where the sandbox's processes would show (the container's, or the host's)."""
    if kind == "docker":
        return sandbox.run("ps", timeout_s=20).output
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout


def test_run_gives_output_and_exit_code(make: Make):
    sandbox = make()
    result = sandbox.run("echo hello; echo oops >&2; exit 3", timeout_s=20)
    assert (result.output, result.exit_code, result.timed_out, result.truncated) == (
        "hello\noops\n",
        3,
        False,
        False,
    )
    assert sandbox.run("true", timeout_s=20).exit_code == 0
    assert sandbox.run("printf 'no newline'", timeout_s=20).output == "no newline"


def test_stdin_reaches_the_command(make: Make):
    sandbox = make()
    assert sandbox.run("cat", timeout_s=20, stdin=b"line one\nline two\n").output == "line one\nline two\n"
    assert sandbox.run("cat", timeout_s=20).output == ""  # no stdin: EOF at once, no hang
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    result = sandbox.run("wc -c; ", timeout_s=60, stdin=blob)
    assert result.output.split() == [str(len(blob))]


def test_timeout_kills_the_command_and_its_children(make: Make, kind: str):
    sandbox = make()
    tag = random.randint(10_000, 99_999)  # unique sleep durations to find in the process list
    started = time.monotonic()
    result = sandbox.run(f"echo started; sleep {tag} & sleep {tag + 1}; echo never", timeout_s=1)
    assert time.monotonic() - started < 8
    assert result.timed_out and result.exit_code == -1
    assert "never" not in result.output
    time.sleep(0.3)
    listing = processes(kind, sandbox)
    assert f"sleep {tag}" not in listing and f"sleep {tag + 1}" not in listing
    assert sandbox.run("echo still usable", timeout_s=20).output == "still usable\n"


def test_background_process_does_not_block_run(make: Make):
    sandbox = make()
    started = time.monotonic()
    result = sandbox.run("sleep 50 & echo started", timeout_s=30)
    assert (result.output, result.exit_code, result.timed_out) == ("started\n", 0, False)
    assert time.monotonic() - started < 40  # not waiting for the 50 s background sleep


def test_output_is_capped_with_a_note(make: Make):
    sandbox = make()
    result = sandbox.run("head -c 100000 /dev/zero | tr '\\0' x; echo; echo tail", timeout_s=30)
    assert result.truncated and result.exit_code == 0
    assert result.output.startswith("x" * CAP)
    assert "output truncated" in result.output and "tail" not in result.output
    assert len(result.output) < CAP + 200


def test_file_round_trip_through_the_file_tools(make: Make):
    from batchrun.prompt.tools.registry import ToolContext, execute_tool_call

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


def test_cwd_is_honoured_and_created(make: Make, kind: str, tmp_path: Path):
    cwd = absolute_cwd(kind, tmp_path)
    sandbox = make(cwd=cwd)
    assert sandbox.workdir == cwd
    assert sandbox.run("pwd", timeout_s=20).output == f"{cwd}\n"
    sandbox.run("echo x > here.txt", timeout_s=20)
    assert sandbox.run(f"cat {cwd}/here.txt", timeout_s=20).output == "x\n"
    relative = make(cwd="rel/dir")
    assert relative.workdir.endswith("/rel/dir")
    assert relative.run("pwd", timeout_s=20).output == f"{relative.workdir}\n"


def test_two_sandboxes_do_not_see_each_others_files(make: Make, kind: str):
    first, second = make(), make()
    first.run("echo secret > left.txt", timeout_s=20)
    assert first.run("cat left.txt", timeout_s=20).output == "secret\n"
    assert second.run("cat left.txt", timeout_s=20).exit_code != 0
    if kind != "local-none":  # without isolation /tmp is the host's: nothing to check there
        first.run("echo secret > /tmp/left-tmp.txt", timeout_s=20)
        assert first.run("cat /tmp/left-tmp.txt", timeout_s=20).exit_code == 0
        assert second.run("cat /tmp/left-tmp.txt", timeout_s=20).exit_code != 0


def test_environment_has_spec_env_and_no_host_secrets(make: Make, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-must-not-leak")
    sandbox = make(env={"GREETING": "hi there"})
    output = sandbox.run("env", timeout_s=20).output
    assert "GREETING=hi there" in output
    assert "sk-or-must-not-leak" not in output


def test_no_network_leaves_only_loopback(make: Make, kind: str):
    if kind == "local-none":
        pytest.skip("local without isolation cannot cut the network")
    sandbox = make(network=False)
    devices = sandbox.run("cat /proc/net/dev", timeout_s=20).output.splitlines()[2:]
    assert [line.split(":")[0].strip() for line in devices] == ["lo"]


def test_stop_is_idempotent_and_run_after_stop_fails(make: Make):
    sandbox = make()
    sandbox.stop()
    sandbox.stop()
    with pytest.raises(SandboxError):
        sandbox.run("true", timeout_s=5)


def test_failed_start_raises_and_stop_is_safe(make: Make, kind: str):
    if kind == "local-none":
        sandbox = make(start=False, cwd="/proc/cannot/create")  # outside cwd_root
    elif kind == "local-bwrap":
        sandbox = make(start=False, cwd="/usr/cannot/create")  # in the read-only system
    else:
        sandbox = make(start=False, image=MISSING_IMAGE)
    with pytest.raises(SandboxError):
        sandbox.start()
    sandbox.stop()
    sandbox.stop()


def test_process_tool_keeps_a_background_command_between_commands(make: Make, kind: str):
    """Started by the process tool, a command lives on while other commands come and go."""
    from batchrun.prompt.tools.registry import ToolContext, execute_tool_call

    if kind.endswith("-fake"):
        # The fakes run each exec in a PID namespace of its own that ends with it; a real Apptainer
        # instance or Modal sandbox keeps one for its life. Untested there: no such service here.
        pytest.skip("the fake backends end every process with its exec")

    sandbox = make()
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=30.0, output_cap_bytes=CAP)

    def call(**args) -> dict:
        return json.loads(execute_tool_call("process", json.dumps(args), ctx, {"process"}))

    def wait_for(proc_id: str, status: str) -> dict:
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
    assert call(action="poll", id=waiter["id"])["status"] == "running"
    assert call(action="read", id=waiter["id"])["output"] == "ready\n"
    assert call(action="read", id=waiter["id"])["output"] == ""  # read only once
    listing = processes(kind, sandbox)
    assert f"sleep {tag}" in listing
    assert f"sleep {tag + 2}" not in listing and f"sleep {tag + 3}" not in listing
    if kind == "local-bwrap":
        assert f"sleep {tag + 1}" not in listing

    sandbox.run("touch stop-now", timeout_s=20)  # in the working directory the background command shares
    done = wait_for(waiter["id"], "exited")
    assert done["exit_code"] == 3 and done["unread_bytes"] == len("bye\n")
    assert call(action="read", id=waiter["id"])["output"] == "bye\n"

    killed = call(action="kill", id=sleeper["id"])
    assert killed["status"] == "killed"
    deadline = time.monotonic() + 10
    while f"sleep {tag}\n" in processes(kind, sandbox) + "\n":
        assert time.monotonic() < deadline, "the killed process still runs"
        time.sleep(0.2)
    assert [(p["id"], p["status"]) for p in call(action="list")["processes"]] == [
        ("p1", "exited"),
        ("p2", "killed"),
    ]
