"""The ``terminal`` toolset: run a shell command in the prompt's sandbox (``terminal``), or run one in the
background and manage it (``process``)."""

from __future__ import annotations

import re
import shlex
from typing import Any

from batchrun.prompt.sandboxes.base import BACKGROUND_DIR, BACKGROUND_ENV
from batchrun.prompt.tools.registry import Tool, ToolArgumentError, ToolContext, register


def _seconds(value: float) -> str:
    return f"{value:g}"


def terminal(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    command = args["command"]
    if not command.strip():
        raise ToolArgumentError("command must not be empty")
    if "\0" in command:  # no shell can run it: a command line is a C string
        raise ToolArgumentError("command must not contain a NUL character")
    timeout = args.get("timeout")
    if timeout is not None and timeout < 1:
        raise ToolArgumentError("timeout must be a positive number of seconds")
    timeout_s = min(float(timeout), ctx.tool_timeout_s) if timeout is not None else ctx.tool_timeout_s
    res = ctx.sandbox.run(command, timeout_s=timeout_s)
    if res.timed_out:
        return {
            "output": res.output,
            "exit_code": -1,
            "error": f"Command timed out after {_seconds(timeout_s)} s; it was killed with every process it started.",
        }
    return {"output": res.output, "exit_code": res.exit_code, "error": None}


register(
    Tool(
        name="terminal",
        toolset="terminal",
        description=(
            "Run a shell command (POSIX sh syntax) in the sandbox's working directory and return its "
            "combined stdout and stderr with the exit code. A non-zero exit code is reported, not treated "
            "as a failure. Each call starts a fresh shell: `cd` and exported variables do not carry over "
            "to the next call, so chain steps with && (e.g. `cd src && make`). Commands get no input on "
            "stdin, so interactive programs must be given non-interactive flags (e.g. `apt-get -y`). "
            "Long output is cut, with a note saying how much was dropped; filter it with grep, head or "
            "tail. A command that runs longer than `timeout` seconds is killed together with everything "
            "it started; processes left running in the background may not survive the end of the call: "
            "start a server or other long-running command with the process tool instead. To read, write or edit files prefer read_file, write_file and patch."
        ),
        parameters={
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The shell command to run."},
                "timeout": {
                    "type": "integer",
                    "description": "Seconds before the command is killed (default and maximum: the run's tool timeout).",
                    "minimum": 1,
                },
            },
            "required": ["command"],
        },
        handler=terminal,
    )
)


# ----------------------------------------------------------------------------- process: background commands
# Everything runs through the sandbox's own `run`, so every backend supports it. A started command gets
# a directory p<N> under $TMPDIR/BACKGROUND_DIR holding its text (cmd), output (out), pid, exit code
# (rc, written when it ends), `killed` once the tool killed it, and `offset` (bytes of out already read).
# It runs under setsid (where installed) as a process group of its own, with BACKGROUND_ENV set, so the
# local backend's per-command sweep spares it; a timed-out terminal command kills only its own processes.

_DIR = f'"${{TMPDIR:-/tmp}}/{BACKGROUND_DIR}"'
_ID_RE = re.compile(r"p[1-9][0-9]{0,5}")
_MAX_PROCESSES = 1000

_START = f"""base={_DIR}
mkdir -p "$base" || exit 90
n=1
while ! mkdir "$base/p$n" 2>/dev/null; do
    n=$((n + 1)); [ "$n" -le {_MAX_PROCESSES} ] || exit 91
done
d=$base/p$n
cat > "$d/cmd" && echo 0 > "$d/offset" || exit 90
s=; command -v setsid >/dev/null 2>&1 && s=setsid
$s sh -c 'sh "$1/cmd" > "$1/out" 2>&1 < /dev/null; echo $? > "$1/rc"' br-process "$d" \\
    > /dev/null 2>&1 < /dev/null &
echo $! > "$d/pid"
echo "p$n $!"
"""

# alive: whether the process of $d runs. A zombie does not, and neither does another process that got
# its pid (the local sandbox's shell restarts in a fresh PID namespace after a timeout): only the one
# whose last argument is $d counts. Without /proc, kill -0 is all there is.
_ALIVE = r"""alive() {
    pid=$(cat "$d/pid")
    if [ -r "/proc/$pid/stat" ]; then
        ps=$(cat "/proc/$pid/stat" 2>/dev/null); ps=${ps##*) }
        case "${ps%% *}" in Z | X | "") return 1 ;; esac
        tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null | grep -qxF "$d"
    else
        kill -0 "$pid" 2>/dev/null
    fi
}
"""

# Prints "<status> <exit code or -> <bytes of output> <bytes already read>" for the process in $d.
_STATUS = r"""if [ -f "$d/rc" ]; then st="exited $(cat "$d/rc")"
elif [ -f "$d/killed" ]; then st="killed -"
elif alive; then st="running -"
else st="lost -"
fi
touch "$d/out"
echo "$st $(wc -c < "$d/out") $(cat "$d/offset")"
"""

_READ = """off=$(cat "$d/offset"); size=$(wc -c < "$d/out")
n=$((size - off)); [ "$n" -gt "$2" ] && n=$2
[ "$n" -gt 0 ] && tail -c "+$((off + 1))" "$d/out" | head -c "$n"
echo $((off + n)) > "$d/offset"
"""

_KILL = """if [ ! -f "$d/rc" ] && [ ! -f "$d/killed" ] && alive; then
    kill -9 -"$pid" 2>/dev/null || kill -9 "$pid" 2>/dev/null
    touch "$d/killed"
fi
"""

_LIST = f"""{_ALIVE}base={_DIR}
for d in "$base"/p*; do
    [ -f "$d/pid" ] || continue
    printf '%s ' "${{d##*/}}"
    ( {_STATUS} )
done
"""

_STATUS_NOTES = {
    "running": None,
    "exited": None,
    "killed": "killed by the process tool",
    "lost": "the process ended without an exit code (killed by another command, or the sandbox "
    "restarted its shell)",
}


def _run_script(ctx: ToolContext, script: str, *args: str, stdin: bytes | None = None) -> tuple[str, int]:
    quoted = " ".join(shlex.quote(a) for a in args)
    res = ctx.sandbox.run(f"set -- {quoted}\n{script}", timeout_s=min(30.0, ctx.tool_timeout_s), stdin=stdin)
    if res.timed_out:
        raise ToolArgumentError("the sandbox did not answer the process tool in time")
    return res.output, res.exit_code


def _status(proc_id: str, line: str) -> dict[str, Any]:
    """Parse a status line of _STATUS into the tool's answer."""
    state, code, size, offset = line.split()
    return {
        "id": proc_id,
        "status": state,
        "exit_code": int(code) if code != "-" else None,
        "output_bytes": int(size),
        "unread_bytes": max(int(size) - int(offset), 0),
        "note": _STATUS_NOTES[state],
    }


def _one(ctx: ToolContext, proc_id: str, script: str, *args: str) -> tuple[str, dict[str, Any]]:
    """Run ``script`` (then the status) for one process: (its output, the status)."""
    check = f'd={_DIR}/$1\n[ -f "$d/pid" ] || exit 92\n'
    out, code = _run_script(ctx, _ALIVE + check + script + _STATUS, proc_id, *args)
    if code == 92:
        raise ToolArgumentError(f"no process {proc_id!r} was started in this sandbox (see action 'list')")
    if code != 0:
        raise ToolArgumentError(f"process tool failed in the sandbox (exit {code}): {out.strip()[:200]}")
    body, _, status_line = out.rstrip("\n").rpartition("\n")
    return body, _status(proc_id, status_line)


def process(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    action = args["action"]
    if action == "start":
        command = args.get("command") or ""
        if not command.strip():
            raise ToolArgumentError("action 'start' needs a non-empty command")
        # The whole start script carries the mark from its exec on: a child between fork and exec shows
        # its parent's initial environment, and the local sweep must already see the mark there.
        script = f"{'='.join(BACKGROUND_ENV)} exec sh -c {shlex.quote(_START)}"
        out, code = _run_script(ctx, script, stdin=command.encode("utf-8", errors="surrogateescape"))
        if code == 91:
            raise ToolArgumentError(f"at most {_MAX_PROCESSES} processes can be started in one sandbox")
        if code != 0:
            return {"error": f"could not start the process (exit {code}): {out.strip()[:200]}"}
        proc_id, pid = out.split()[-2:]
        return {"id": proc_id, "pid": int(pid), "status": "running", "error": None}
    if action == "list":
        out, _ = _run_script(ctx, _LIST)
        processes = [_status(line.split()[0], line.split(None, 1)[1]) for line in out.splitlines() if line]
        return {"processes": processes, "error": None}
    proc_id = args.get("id")
    if not isinstance(proc_id, str) or not _ID_RE.fullmatch(proc_id):
        raise ToolArgumentError(f"action {action!r} needs the id that 'start' returned, e.g. 'p1'")
    if action == "poll":
        _, status = _one(ctx, proc_id, "")
        return {**status, "error": None}
    if action == "read":
        # The header room keeps the answer within the sandbox's output cap, so no read byte is cut.
        chunk = max(ctx.output_cap_bytes - 512, 1)
        body, status = _one(ctx, proc_id, _READ + "echo\n", str(chunk))
        return {**status, "output": body, "error": None}
    if action == "kill":
        _, status = _one(ctx, proc_id, _KILL)
        return {**status, "error": None}
    raise ToolArgumentError(f"unknown action {action!r}")


register(
    Tool(
        name="process",
        toolset="terminal",
        description=(
            "Run a command in the background and manage it: a server, a long build, a watcher. "
            "action 'start' runs `command` (POSIX sh, in the working directory) and returns its id; it "
            "keeps running between calls, until killed or the end of the task. 'poll' gives its status "
            "(running, exited with exit_code, killed, lost) and how many output bytes are unread; 'read' "
            "returns the output (stdout and stderr) written since the last read, in pieces of at most "
            "the output limit; 'kill' ends it with everything in its process group; 'list' shows every "
            "process started. Use the terminal tool for commands that finish on their own."
        ),
        parameters={
            "type": "object",
            "properties": {
                "action": {
                    "type": "string",
                    "enum": ["start", "poll", "read", "kill", "list"],
                    "description": "What to do.",
                },
                "command": {"type": "string", "description": "For 'start': the shell command to run."},
                "id": {"type": "string", "description": "For poll, read and kill: the id 'start' returned."},
            },
            "required": ["action"],
        },
        handler=process,
    )
)
