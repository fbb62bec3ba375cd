"""The ``terminal`` toolset: run a shell command in the prompt's sandbox."""

from __future__ import annotations

from typing import Any

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
            "it started; processes left running in the background may not survive the end of the call, so "
            "start a server and the commands that use it in one call. To read, write or edit files prefer read_file, write_file and patch."
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
