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
# see run_judged in the backends). {run}: how the command runs (RUN_BY_PATH, RUN_IN_IMAGE_SH).
_WRAPPER = (
    'IFS= read -r t; export {var}="$2"; exec 2>&1; {run}; rc=$?; '
    'printf \'\\n[batch-runner-exit:%s]=%s\\n\' "$t" "$rc"; exit "$rc"'
)
# The command in the `sh` its PATH finds; under a trusted busybox (see wrapped_argv), busybox's own
# sh applet: busybox prefers its applets to PATH.
RUN_BY_PATH = 'sh -c "$1"'
# Under a trusted busybox, a judged command of the user's (a verify line, a scorer's): in the image's
# own /bin/sh (a path with a slash: a file, never busybox's applet), so that it sees the image as the
# agent did, but only while /bin/sh is what it was when the container started ($3: busybox's
# `sha256sum /bin/sh` then, before the agent's first command; "" where there was none to take). Root in
# the container may have replaced it (with `exit 0`: every verify passed). Exit 126 then, the command
# not run: the check fails, as for wrong work.
RUN_IN_IMAGE_SH = (
    'if [ -z "$3" ] || [ "$(sha256sum /bin/sh 2>/dev/null)" = "$3" ]; then /bin/sh -c "$1"; '
    'else echo "batch-runner: /bin/sh is not the file it was when the container started (changed '
    "since, by the agent's commands as root?): the judged command was not run\"; (exit 126); fi"
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


def sh_c(script: str, busybox: str = "") -> list[str]:
    """The argv that runs the shell ``script`` (its arguments follow, ``$0`` first): in the ``sh`` that
    PATH finds, or in ``busybox``'s own sh with its applets (a static busybox the agent cannot replace:
    see wrapped_argv)."""
    return [*([busybox] if busybox else []), "sh", "-c", script]


def wrapped_argv(command: str, token: str, *, busybox: str = "", image_sh: str | None = None) -> list[str]:
    """The argv that runs ``command`` under ``sh`` and prints the end marker with its exit code; its
    stdin must begin with :func:`token_line`. ``token`` is not in it: only its tag.

    ``busybox``: the path of a static busybox that the agent cannot replace (the Docker backend's
    read-only bind mount): the wrapper runs in its sh, with its applets, not in what the image's PATH
    finds, which root in the container may have replaced. The command then runs in busybox's sh too
    (a script of the runner's own), unless ``image_sh`` is given: a judged command of the user's, run
    in the image's /bin/sh while that is unchanged (``image_sh``: its checksum at the start, see
    RUN_IN_IMAGE_SH)."""
    if busybox and image_sh is not None:
        wrapper = _WRAPPER.format(var=EXEC_TAG_VAR, run=RUN_IN_IMAGE_SH)
        return [*sh_c(wrapper, busybox), "sh", command, exec_tag(token), image_sh]
    wrapper = _WRAPPER.format(var=EXEC_TAG_VAR, run=RUN_BY_PATH)
    return [*sh_c(wrapper, busybox), "sh", command, exec_tag(token)]


def token_line(token: str) -> bytes:
    """What a :func:`wrapped_argv` command's stdin begins with: the token of its end marker (the
    command's own stdin follows)."""
    return token.encode() + b"\n"


def end_marker(token: str) -> bytes:
    return f"\n[batch-runner-exit:{token}]=".encode()


def kill_argv(token: str, busybox: str = "") -> list[str]:
    """The argv that kills a command's processes (``busybox``: in that busybox's sh, see wrapped_argv)."""
    return [*sh_c(KILL_TAGGED_SCRIPT, busybox), "sh", f"{EXEC_TAG_VAR}={exec_tag(token)}"]


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
