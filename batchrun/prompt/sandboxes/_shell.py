"""Helpers for backends that run commands through a remote exec (docker, modal).

A remote exec's output stream stays open while any background process the command left holds
it, so "the stream ended" does not mean "the command ended". The command is therefore wrapped:
stderr joins stdout (one pipe keeps the interleaving exact) and, when the command's shell is
done, an end marker carrying the exit code is printed. Reading stops at the marker.
"""

from __future__ import annotations

import hashlib
import re
import uuid

from batchrun.prompt.sandboxes.base import CappedBuffer

EXEC_TAG_VAR = (
    "BATCH_RUNNER_EXEC"  # in the environment of each command's processes, so a timeout can find them
)

# $1: the command, $2: the exec tag; the first line of stdin: the exec token (see token_line). The
# token is read first, so it is in no process's argv or environment, where the command could read it
# (/proc/$PPID/cmdline) and print the end marker with an exit code of its choosing. The inner sh gets
# the rest of the caller's stdin and the tag in its environment (so a timeout can find it and its
# children); its exit code follows the marker, and is the wrapper's own (what the engine reports:
# see run_judged in the backends).
_WRAPPER = (
    'IFS= read -r t; export {var}="$2"; exec 2>&1; sh -c "$1"; rc=$?; '
    'printf \'\\n[batch-runner-exit:%s]=%s\\n\' "$t" "$rc"; exit "$rc"'
)

# Kills every process whose environment holds "$1" (BATCH_RUNNER_EXEC=<tag>); a few rounds catch forks.
# environ is NUL-separated, and busybox grep stops a line at NUL: hence tr. The braces: a process gone
# since the glob fails the redirection itself, before a 2>/dev/null after it would apply.
KILL_TAGGED_SCRIPT = (
    "for round in 1 2 3; do for e in /proc/[0-9]*/environ; do "
    'if { tr "\\0" "\\n" <"$e"; } 2>/dev/null | grep -qxF "$1"; then p=${e%/environ}; kill -9 "${p#/proc/}" 2>/dev/null; fi; '
    "done; done; true"
)


def new_exec_token() -> str:
    return uuid.uuid4().hex


def exec_tag(token: str) -> str:
    """What a command's processes carry in their environment (``BATCH_RUNNER_EXEC``) so a timeout can
    find them: derived from ``token`` but not the token itself. The token is the end marker's secret:
    a command that could read it (its own environment) could print the marker with exit code 0 before
    it fails, and a verify command would pass."""
    return hashlib.sha256(f"batch-runner exec tag\0{token}".encode()).hexdigest()[:32]


def wrapped_argv(command: str, token: str) -> list[str]:
    """The argv that runs ``command`` under ``sh`` and prints the end marker with its exit code; its
    stdin must begin with :func:`token_line`. ``token`` is not in it: only its tag."""
    wrapper = _WRAPPER.format(var=EXEC_TAG_VAR)
    return ["sh", "-c", wrapper, "sh", command, exec_tag(token)]


def token_line(token: str) -> bytes:
    """What a :func:`wrapped_argv` command's stdin begins with: the token of its end marker (the
    command's own stdin follows)."""
    return token.encode() + b"\n"


def end_marker(token: str) -> bytes:
    return f"\n[batch-runner-exit:{token}]=".encode()


def kill_argv(token: str) -> list[str]:
    return ["sh", "-c", KILL_TAGGED_SCRIPT, "sh", f"{EXEC_TAG_VAR}={exec_tag(token)}"]


class MarkerScanner:
    """Feeds output into a capped buffer until the end marker, then parses the exit code after it."""

    _EXIT = re.compile(rb"(-?\d+)\n")

    def __init__(self, token: str, buf: CappedBuffer):
        self.marker = end_marker(token)
        self.buf = buf
        self.exit_code: int | None = None
        self._held = b""  # bytes that may be the start of the marker, not yet shown
        self._after: bytes | None = None  # bytes after the marker, once it was seen

    @property
    def done(self) -> bool:
        return self.exit_code is not None

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        if self._after is not None:
            self._after += data
        else:
            data = self._held + data
            at = data.find(self.marker)
            if at < 0:
                keep = len(self.marker) - 1
                self.buf.feed(data[:-keep] if len(data) > keep else b"")
                self._held = data[-keep:] if len(data) > keep else data
                return
            self.buf.feed(data[:at])
            self._held = b""
            self._after = data[at + len(self.marker) :]
        match = self._EXIT.match(self._after)
        if match:
            self.exit_code = int(match.group(1))

    def finish(self) -> None:
        """The stream ended without a complete marker: show what was held back."""
        if not self.done and self._after is None:
            self.buf.feed(self._held)
            self._held = b""
