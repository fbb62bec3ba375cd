"""The local sandbox's /dev: read-only inside, with /dev/shm writable (a tmpfs of its own, capped as /tmp
and the working directory are) and its devices, links and /dev/pts as before; for both makers (br-launch
as root, bwrap) and for a user who is not root.

/dev was a writable tmpfs: a command replaced /dev/fd with a directory of files of its own, and a hidden
test's ``diff <(sh add.sh 2 3) <(echo 5)`` (bash hands diff /dev/fd/63 and /dev/fd/62) compared two of
them and passed whatever the work. It was storage outside the disk cap too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import skip_or_fail

from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox, launcher

pytestmark = pytest.mark.bwrap

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

# Each line: a name and what the command said (exit code, or output), for one comparison.
PROBE = {
    "rm_fd": "rm -f /dev/fd",
    "ln_fd": "ln -sfn /tmp /dev/fd",
    "ln_stdin": "ln -sfn /tmp/x /dev/stdin",
    "echo_x": "echo x > /dev/x",
    "mkdir_d": "mkdir /dev/d",
    "rm_null": "rm -f /dev/null",
    "mknod": "mknod /dev/n2 c 1 3",
    "shm": "echo in-shm > /dev/shm/f && cat /dev/shm/f",
    "mp_lock": "/usr/bin/python3 -c 'import multiprocessing as m; m.Lock(); print(\"locked\")'",
    "fd_n": "cat /dev/fd/5 5<<< via-fd5",
    "procsub": "cat <(echo via-procsub)",
    "stdin": "echo via-stdin | cat /dev/stdin",
    "stdout": "echo via-stdout > /dev/stdout",
    "stderr": "echo via-stderr > /dev/stderr 2>&1",
    "null": "echo gone > /dev/null && wc -c < /dev/null",
    "zero": "head -c 3 /dev/zero | od -An -tx1",
    "urandom": "head -c 16 /dev/urandom | wc -c",
    "tty": "stat -c '%F %t:%T' /dev/tty",
    "pty": "/usr/bin/python3 -c 'import os, pty; m, s = pty.openpty(); print(os.ttyname(s)[:9])'",
    "links": "stat -c '%N' /dev/fd /dev/stdin /dev/stdout /dev/stderr /dev/ptmx | tr -d \"'\\\"\\`\"",
    "planted": "ls -A /dev | tr '\\n' ' '",
}
EXPECTED = {
    "shm": "in-shm",
    "mp_lock": "locked",
    "fd_n": "via-fd5",
    "procsub": "via-procsub",
    "stdin": "via-stdin",
    "stdout": "via-stdout",
    "stderr": "via-stderr",
    "null": "0",
    "zero": "00 00 00",
    "urandom": "16",
    "tty": "character special file 5:0",
    "pty": "/dev/pts/",
    "links": "/dev/fd -> /proc/self/fd\n/dev/stdin -> /proc/self/fd/0\n/dev/stdout -> /proc/self/fd/1\n"
    "/dev/stderr -> /proc/self/fd/2\n/dev/ptmx -> pts/ptmx",
    "planted": "core fd full null ptmx pts random shm stderr stdin stdout tty urandom zero",
}
WRITES = ("rm_fd", "ln_fd", "ln_stdin", "echo_x", "mkdir_d", "rm_null", "mknod")


def probe(run) -> dict[str, str]:
    """What each PROBE command gives: its output, or "exit N" for the attempts to write /dev."""
    seen = {}
    for name, command in PROBE.items():
        res = run(command)
        seen[name] = f"exit {res[0] != 0}" if name in WRITES else res[1].strip()
    return seen


def check(seen: dict[str, str]) -> None:
    for name in WRITES:  # every write to /dev failed (and the links after them are as before)
        assert seen[name] == "exit True", (name, seen)
    for name, want in EXPECTED.items():
        got = seen[name]
        assert got.startswith(want) if name == "pty" else got == want, (name, got, want)


@pytest.fixture(params=["br-launch", "bwrap"])
def maker(request, bwrap_available: None, monkeypatch) -> str:
    """Which program makes the sandbox: br-launch (root only), or bwrap itself."""
    launcher.launcher_path.cache_clear()
    request.addfinalizer(launcher.launcher_path.cache_clear)
    if request.param == "bwrap":
        monkeypatch.setattr(launcher, "ENABLED", False)
    elif os.geteuid() != 0:
        pytest.skip("br-launch is used as root only")
    elif launcher.launcher_path() is None:
        skip_or_fail(f"br-launch could not be built here: {launcher.problem}")
    return request.param


def test_dev_is_read_only_and_dev_shm_and_the_devices_work_as_before(maker, tmp_path: Path):
    box = LocalSandbox(
        SandboxSpec("devro", 0, network=False), isolation="bwrap", base_dir=str(tmp_path), disk_mb=8
    )
    box.start()
    try:
        made_by = os.path.basename(os.path.realpath(f"/proc/{box._server.proc.pid}/exe"))
        assert made_by.startswith("br-launch") == (maker == "br-launch"), made_by

        def run(command: str) -> tuple[int, str]:
            res = box.run(command, timeout_s=60)
            return res.exit_code, res.output

        check(probe(run))
        # /dev/shm is capped as /tmp and the working directory are, and says so when full.
        full = box.run("dd if=/dev/zero of=/dev/shm/big bs=1M count=64", timeout_s=60)
        assert "No space left on device" in full.output, full.output
        assert "[batch-runner: /dev/shm is full: its size cap is 8 MiB]" in full.output, full.output
        assert box.run("du -m /dev/shm/big | cut -f1", timeout_s=20).output.split()[0] in ("7", "8")
        assert box.run("rm /dev/shm/big /dev/shm/f && ls -A /dev/shm", timeout_s=20).output == ""
    finally:
        box.stop()


CHILD = r"""
import json, sys
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox

box = LocalSandbox(SandboxSpec("devro-nonroot", 0, network=False), isolation="bwrap", base_dir=sys.argv[1])
box.start()
try:
    out = {}
    for name, command in json.loads(sys.argv[2]).items():
        res = box.run(command, timeout_s=60)
        out[name] = [res.exit_code, res.output]
    out["uid"] = [0, box.run("id -u", timeout_s=30).output]
    print(json.dumps(out))
finally:
    box.stop()
"""


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def test_dev_is_read_only_for_a_sandbox_of_a_user_who_is_not_root(bwrap_available: None, request):
    if os.geteuid() != 0:
        pytest.skip("needs root to start a child as nobody")
    from test_local_nonroot import _interpreter_for_nobody, nobody_home

    base, env = nobody_home(request, "br-devro-")
    python = _interpreter_for_nobody(env)
    if python is None:
        pytest.skip("no Python interpreter that nobody can run imports the package here")
    done = subprocess.run(
        [python, "-c", CHILD, str(base), json.dumps(PROBE)],
        env=env, preexec_fn=_as_nobody, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said.pop("uid")[1].strip() == str(NOBODY)
    check(probe(lambda command: said[next(k for k, v in PROBE.items() if v == command)]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
