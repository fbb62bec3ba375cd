"""A user's regular expression on a model's text, ended after a time: in a child process, kept between calls.

The patterns are the user's (a row's ``answer`` under ``--scorer=regex``, ``--answer_pattern``) and the
text is the model's: a search may backtrack for ages (``(a+)+$`` on ``'a' * 40 + 'b'``), and ``re`` can
be stopped neither from another thread nor while it holds the GIL, the whole process frozen meanwhile.
So each search runs in a child (``python -I -S``), which is killed when it overruns its time.

A child per search cost a Python start, ~20 ms: re-scoring 10,000 samples with ``--answer_pattern`` took
227 s, of which 3 s were the scoring. A child here serves one search after another, fed over a pipe, one
thread at a time; idle ones are kept (up to :data:`KEEP_IDLE`) for the next search; one that overran or
failed is killed and never used again. Each child also bounds every search itself (an alarm a second
past its time), and ends within a quarter of a second of its own CPU once its parent is gone: one whose
parent died mid-search (SIGKILL too) no longer searched on at full CPU for up to the search's whole time
(the verify timeout, 60 s by default). Not the parent-death signal: that fires when the *thread* that
started the child ends, and a child is kept for the next search, on any thread.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

KEEP_IDLE = 8  # idle children kept for the next search (more threads at once start more, ended after)

# The child: one JSON request a line, [op, pattern, text, timeout_s]; one JSON answer a line,
# ["ok", result], ["error", message] or ["late", null]. "extract" is scoring._last_match, "search" re.search.
_CHILD = r"""
import collections, json, os, re, signal, sys
def late(*_):
    raise TimeoutError
def orphaned(*_):
    if os.getppid() != parent:
        os._exit(1)
signal.signal(signal.SIGALRM, late)
parent = int(sys.argv[1])
signal.signal(signal.SIGPROF, orphaned)
signal.setitimer(signal.ITIMER_PROF, 0.25, 0.25)
orphaned()
for line in sys.stdin:
    op, p, t, timeout_s = json.loads(line)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s + 1.0)
        if op == "search":
            out = ["ok", re.search(p, t) is not None]
        else:
            m = collections.deque(re.finditer(p, t), maxlen=1)  # the last only: a list took GBs
            out = ["ok", "" if not m else (m[0].group(1) if m[0].re.groups else m[0].group(0)) or ""]
        signal.setitimer(signal.ITIMER_REAL, 0)
    except TimeoutError:
        out = ["late", None]
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        out = ["error", f"{type(exc).__name__}: {exc}"]
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
"""
_COMMAND = [sys.executable, "-I", "-S", "-W", "ignore", "-c", _CHILD]


class _Child:
    """One child process and what it has sent of its next answer."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [*_COMMAND, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def ask(self, request: bytes, timeout_s: float) -> Any:
        """The answer to ``request``: subprocess.TimeoutExpired after ``timeout_s``, CalledProcessError
        when the search failed or the child died. Either way the child is killed, to be used no more."""
        deadline = time.monotonic() + timeout_s
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
            got = self._line(deadline, timeout_s)
        except BrokenPipeError:
            got = b""
        except BaseException:
            self.close()
            raise
        try:
            status, value = json.loads(got)
        except ValueError:
            self.close()
            code = self.proc.returncode
            raise subprocess.CalledProcessError(
                code or -1, _COMMAND, stderr=f"the search's process ended (exit {code})".encode()
            ) from None
        if status == "ok":
            return value
        self.close()
        if status == "late":
            raise subprocess.TimeoutExpired(_COMMAND, timeout_s)
        raise subprocess.CalledProcessError(1, _COMMAND, stderr=str(value).encode())

    def _line(self, deadline: float, timeout_s: float) -> bytes:
        """The child's next line, or b"" when it closed its end; TimeoutExpired at ``deadline``."""
        fd, chunks = self.proc.stdout.fileno(), []
        poll = select.poll()  # not select.select: a worker with many prompts in flight has fds past 1024
        poll.register(fd, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poll.poll(left * 1000):
                raise subprocess.TimeoutExpired(_COMMAND, timeout_s)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            chunks.append(chunk)
            if chunk.endswith(b"\n"):  # one answer a line, and nothing is sent before it is asked for
                return b"".join(chunks)

    def close(self) -> None:
        """Kill the child (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # the child's end was gone: the unsent request is not flushed anywhere
                pass


class _Children:
    """The idle children of this process, one taken by each search under way."""

    def __init__(self) -> None:
        self._idle: list[_Child] = []
        self._lock = threading.Lock()

    def take(self) -> _Child:
        """An idle child still alive (one killed meanwhile, by the OOM killer or a user, gave its search a
        scorer error), else a new one."""
        while True:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            if child is None:
                return _Child()
            if child.proc.poll() is None:
                return child
            child.close()

    def give_back(self, child: _Child) -> None:
        with self._lock:
            if len(self._idle) < KEEP_IDLE:
                self._idle.append(child)
                return
        child.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.close()

    def forget(self) -> None:
        """In a forked process: the children are its parent's, never to be asked or killed from here."""
        self._idle, self._lock = [], threading.Lock()


_children = _Children()
atexit.register(_children.close)
os.register_at_fork(after_in_child=_children.forget)


def _run(op: str, pattern: str, text: str, timeout_s: float) -> Any:
    request = (json.dumps([op, pattern, text, timeout_s]) + "\n").encode("ascii")
    child = _children.take()
    value = child.ask(request, timeout_s)  # on any error the child is killed, never given back
    _children.give_back(child)
    return value


def search(pattern: str, text: str, timeout_s: float) -> bool:
    """Whether ``pattern`` is found in ``text`` (``re.search``); subprocess.TimeoutExpired after
    ``timeout_s``, CalledProcessError when the search failed (memory)."""
    return bool(_run("search", pattern, text, timeout_s))


def last_match(pattern: str, text: str, timeout_s: float) -> str:
    """``pattern``'s last match in ``text`` (Python's default flags: ``.`` stops at a line break), its group 1
    when it has groups ("" for none); as :func:`search` for the errors."""
    return str(_run("extract", pattern, text, timeout_s))
