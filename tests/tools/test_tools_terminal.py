"""Tests of the terminal tool, through execute_tool_call as the agent loop calls it.

Every test takes the ``sandbox`` fixture, so the same bodies can run over other backends. It runs
the local backend twice: as is, and with only busybox on PATH (``sh`` being busybox ash), which is
what the tools may assume inside a container.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import TOOL_CAP as CAP

from batchrun.prompt.tools.catalog import execute_tool_call, tools_for_toolsets
from batchrun.prompt.tools.registry import ToolContext

OFFERED = {t.name for t in tools_for_toolsets(["terminal", "file"])}


def call(sandbox, name: str, timeout_s: float = 20.0, **args):
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=timeout_s, output_cap_bytes=CAP)
    return json.loads(execute_tool_call(name, json.dumps(args), ctx, OFFERED))


def call_raw(sandbox, name: str, arguments: str):
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=20.0, output_cap_bytes=CAP)
    return json.loads(execute_tool_call(name, arguments, ctx, OFFERED))


def test_output_and_exit_code(sandbox):
    assert call(sandbox, "terminal", command="echo hello") == {
        "output": "hello\n",
        "exit_code": 0,
        "error": None,
    }


def test_nonzero_exit_is_not_an_error(sandbox):
    result = call(sandbox, "terminal", command="echo oops >&2; exit 3")
    assert result == {"output": "oops\n", "exit_code": 3, "error": None}


def test_runs_in_workdir(sandbox):
    assert call(sandbox, "terminal", command="pwd")["output"].strip() == sandbox.workdir


def test_timeout_kills_the_process_group(sandbox):
    started = time.monotonic()
    result = call(sandbox, "terminal", command="sleep 30 & echo $! > bg.pid; sleep 30", timeout=1)
    assert time.monotonic() - started < 25  # not waiting for the 30 s sleep
    assert result["exit_code"] == -1
    assert result["error"].startswith("Command timed out after 1 s")
    pid = int(sandbox.run("cat bg.pid", timeout_s=5).output)
    # A killed child may linger as a zombie until reaped; it must not be running. (Under bwrap the
    # probe sees a fresh PID namespace; the check bites on backends whose processes share one.)
    probe = (
        f"if [ -d /proc/{pid} ] && ! grep -q 'State:.*Z' /proc/{pid}/status 2>/dev/null; then echo alive; fi"
    )
    deadline = time.monotonic() + 3
    while sandbox.run(probe, timeout_s=5).output.strip() == "alive":
        assert time.monotonic() < deadline, f"background process {pid} survived the timeout"
        time.sleep(0.1)


def test_timeout_is_clamped_to_the_tool_timeout(sandbox):
    started = time.monotonic()
    result = call(sandbox, "terminal", timeout_s=1, command="echo partial; sleep 30", timeout=600)
    assert time.monotonic() - started < 25  # not waiting for the 30 s sleep
    assert result["output"] == "partial\n"
    assert result["error"].startswith("Command timed out after 1 s")


def test_output_cap_with_note(sandbox):
    result = call(sandbox, "terminal", command="head -c 5000000 /dev/zero | tr '\\000' a")
    assert result["exit_code"] == 0 and result["error"] is None
    assert result["output"].startswith("a" * (CAP - CAP // 4) + "\n[output truncated: ")
    assert "[output truncated: 4934464 of 5000000 bytes not shown]\n" + "a" * (CAP // 4) in result["output"]
    assert len(result["output"]) < CAP + 200


def test_binary_output_does_not_crash(sandbox):
    result = call(sandbox, "terminal", command="printf 'ok\\377\\376\\000\\001\\n'")
    assert result["exit_code"] == 0
    assert result["output"].startswith("ok\ufffd\ufffd\x00\x01")


@pytest.mark.parametrize(
    "args, message",
    [
        ({}, "missing required argument(s): command"),
        ({"command": 123}, "argument 'command' must be string"),
        ({"command": "true", "timeout": "5"}, "argument 'timeout' must be integer"),
        ({"command": "true", "timeout": 5.5}, "argument 'timeout' must be integer"),
        ({"command": "true", "timeout": 0}, "timeout must be a positive number"),
        ({"command": "  "}, "command must not be empty"),
        ({"command": "true", "cwd": "/"}, "unknown argument(s): cwd"),
        ({"command": "true", "background": True}, "unknown argument(s): background"),
    ],
)
def test_bad_arguments_are_errors(sandbox, args, message):
    assert message in call(sandbox, "terminal", **args)["error"]


def test_an_integer_written_with_a_decimal_point_is_an_integer(sandbox):
    """JSON Schema counts 30.0 as an integer (some models write every number so)."""
    assert call_raw(sandbox, "terminal", '{"command": "echo fine", "timeout": 30.0}')["output"] == "fine\n"


def test_unknown_tool_and_invalid_json(sandbox):
    assert call_raw(sandbox, "shell", '{"command": "ls"}')["error"].startswith("Unknown tool 'shell'")
    assert "Invalid JSON" in call_raw(sandbox, "terminal", '{"command": ')["error"]
    assert "must be a JSON object" in call_raw(sandbox, "terminal", '["ls"]')["error"]


def test_a_nul_character_in_the_command_is_the_model_s_error(sandbox):
    """No shell can run it (a command line is a C string): the model is told, the prompt goes on."""
    result = call(sandbox, "terminal", command="echo a\u0000b")
    assert "NUL" in result["error"]
    assert call(sandbox, "terminal", command="echo still here")["output"] == "still here\n"


# ----------------------------------------------------------------------------- process (background commands)


def process(sandbox, cap: int = CAP, **args):
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=20.0, output_cap_bytes=cap)
    return json.loads(execute_tool_call("process", json.dumps(args), ctx, OFFERED))


def test_process_is_offered_with_the_terminal():
    assert {t.name for t in tools_for_toolsets(["terminal"])} == {"terminal", "process"}


def test_process_output_is_read_in_pieces_and_once(sandbox):
    # 1500 bytes with a 1024-byte limit: pieces of 512 bytes (room is kept for the status).
    started = process(sandbox, action="start", command="head -c 1500 /dev/zero | tr '\\000' x; exit 7")
    deadline = time.monotonic() + 10
    while (st := process(sandbox, action="poll", id=started["id"]))["status"] != "exited":
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
    assert st["exit_code"] == 7 and st["output_bytes"] == 1500 and st["unread_bytes"] == 1500
    pieces = [process(sandbox, cap=1024, action="read", id=started["id"]) for _ in range(4)]
    assert [len(p["output"]) for p in pieces] == [512, 512, 476, 0]
    assert [p["unread_bytes"] for p in pieces] == [988, 476, 0, 0]
    assert "".join(p["output"] for p in pieces) == "x" * 1500


def test_process_runs_in_the_workdir_and_is_killed_with_its_children(sandbox):
    started = process(sandbox, action="start", command="pwd; sleep 30917 & sleep 30918; echo never")
    assert process(sandbox, action="poll", id=started["id"])["status"] == "running"
    killed = process(sandbox, action="kill", id=started["id"])
    assert killed["status"] == "killed" and killed["note"] == "killed by the process tool"
    time.sleep(0.3)
    assert process(sandbox, action="read", id=started["id"])["output"] == f"{sandbox.workdir}\n"
    assert process(sandbox, action="kill", id=started["id"])["status"] == "killed"  # again: no effect
    listing = sandbox.run("ps -o args 2>/dev/null || ps", timeout_s=10).output
    assert "sleep 30917" not in listing and "sleep 30918" not in listing


@pytest.mark.parametrize(
    "args, message",
    [
        ({"action": "start"}, "needs a non-empty command"),
        ({"action": "poll"}, "needs the id that 'start' returned"),
        ({"action": "read", "id": "../etc"}, "needs the id that 'start' returned"),
        ({"action": "kill", "id": "p42"}, "no process 'p42' was started"),
        ({"action": "pause", "id": "p1"}, "unknown action 'pause'"),
    ],
)
def test_process_bad_arguments_are_errors(sandbox, args, message):
    assert message in process(sandbox, **args)["error"]
