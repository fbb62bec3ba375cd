"""Nothing the runner starts outlives it: a runner killed (SIGKILL) while a short-lived child runs leaves
no process behind.

Each child process here carries a marker in its environment, which every process it starts inherits;
what is left of a run is every process of the machine whose environment holds the marker.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from batchrun.prompt.sandboxes._process import run_reaped, watched

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

# bubblewrap's outer process sets its parent-death signal, then wakes its inner child (an eventfd
# write). A runner killed between the two took the outer with it and left the inner child blocked on
# that eventfd forever. The instant is a few microseconds wide; this library, preloaded into bwrap
# alone, widens it to 400 ms so a kill lands in it every time (bwrap itself runs unchanged).
_WIDEN = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>
int prctl(int option, ...) {
    va_list ap;
    va_start(ap, option);
    unsigned long a2 = va_arg(ap, unsigned long), a3 = va_arg(ap, unsigned long),
                  a4 = va_arg(ap, unsigned long), a5 = va_arg(ap, unsigned long);
    va_end(ap);
    int (*real)(int, ...) = (int (*)(int, ...))dlsym(RTLD_NEXT, "prctl");
    int r = real(option, a2, a3, a4, a5);
    if (option == PR_SET_PDEATHSIG && !strcmp(program_invocation_short_name, "bwrap")) usleep(400000);
    return r;
}
"""

PROBE = """
from batchrun.prompt.sandboxes.local.host import bwrap_problem
print(bwrap_problem(), flush=True)
"""


def _marked(marker: str) -> dict[int, str]:
    """The processes whose environment holds ``marker``: their names, by pid."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/comm") as f:
                found[int(pid)] = f.read().strip()
        except OSError:
            continue
    return found


def _gone(marker: str, within_s: float = 10.0) -> dict[int, str]:
    """What is still there of ``marker``'s processes after waiting up to ``within_s`` for them to end."""
    deadline = time.monotonic() + within_s
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # leave the machine clean, whatever the assertion says
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


@pytest.fixture
def shared_dir(request) -> Path:
    where = Path(tempfile.mkdtemp(prefix="br-orphans-"))  # pytest's tmp_path is root's alone (0700)
    request.addfinalizer(lambda: shutil.rmtree(where, ignore_errors=True))
    os.chmod(where, 0o755)
    return where


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.mark.bwrap
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_a_runner_killed_mid_probe_leaves_no_bwrap_behind(bwrap_available, shared_dir, user):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the library that widens bubblewrap's window")
    if user == "nobody" and os.geteuid() != 0:
        pytest.skip("needs root to start a child as nobody")
    (shared_dir / "widen.c").write_text(_WIDEN)
    library = shared_dir / "widen.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", library, shared_dir / "widen.c", "-ldl"], check=True)
    python = shutil.which("python3", path="/usr/bin:/bin") if user == "nobody" else sys.executable
    marker = f"br-orphans-{uuid.uuid4().hex}"
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        "BR_ORPHANS_MARK": marker,
        "LD_PRELOAD": str(library),
    }
    runner = subprocess.Popen(
        [python, "-c", PROBE], env=env, preexec_fn=_as_nobody if user == "nobody" else None
    )
    try:
        # Both of bwrap's processes exist: the outer one is in its widened instant, the inner waits.
        deadline = time.monotonic() + 60
        while list(_marked(marker).values()).count("bwrap") < 2:
            assert runner.poll() is None, "the probe ended before bubblewrap's two processes were seen"
            assert time.monotonic() < deadline, f"bubblewrap's two processes never showed: {_marked(marker)}"
            time.sleep(0.005)
    finally:
        runner.kill()
        runner.wait()
    assert _gone(marker) == {}


def test_run_reaped_answers_as_subprocess_run_does():
    done = run_reaped(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=60, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    killed = run_reaped(["sh", "-c", "kill -9 $$"], timeout_s=60)
    assert killed.returncode == 128 + signal.SIGKILL
    missing = run_reaped(["/nonexistent/probe"], timeout_s=60)
    assert missing.returncode == 127 and b"/nonexistent/probe" in missing.stderr


def test_run_reaped_leaves_nothing_at_its_timeout_nor_after_the_command():
    marker = f"br-orphans-{uuid.uuid4().hex}"
    os.environ["BR_ORPHANS_MARK"] = marker
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            run_reaped(["sh", "-c", "sleep 300 & sleep 300"], timeout_s=0.5)
        assert _gone(marker) == {}
        # a command that leaves a child of its own running in the background when it exits
        done = run_reaped(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo started"], timeout_s=60)
        assert done.stdout == b"started\n"
        assert _gone(marker) == {}
    finally:
        del os.environ["BR_ORPHANS_MARK"]


@pytest.mark.parametrize("at", ["watcher", "command"])
def test_a_runner_killed_during_run_reaped_leaves_nothing(at):
    """The runner killed while the watcher starts, or while its command runs."""
    marker = f"br-orphans-{uuid.uuid4().hex}"
    code = (
        "from batchrun.prompt.sandboxes._process import run_reaped, watched\n"
        "run_reaped(['sh', '-c', 'sleep 300 & sleep 300'], timeout_s=600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "BR_ORPHANS_MARK": marker}
    runner = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        wanted = "python" if at == "watcher" else "sleep"
        while not any(name.startswith(wanted) for pid, name in _marked(marker).items() if pid != runner.pid):
            assert runner.poll() is None and time.monotonic() < deadline, _marked(marker)
            time.sleep(0.001)
    finally:
        runner.kill()
        runner.wait()
    assert _gone(marker) == {}


def test_a_watched_command_gets_sigterm_and_its_grace_then_all_it_left_is_killed():
    """SIGTERM to the watcher (as the MCP SDK sends a server it stops) reaches the command, whose exit
    status the watcher answers; one that ignores it is killed after the grace period, all it started too."""
    marker = f"br-orphans-{uuid.uuid4().hex}"
    env = {**os.environ, "BR_ORPHANS_MARK": marker}
    polite = "trap 'exit 7' TERM; echo ready; sleep 300 & wait"
    stubborn = "trap '' TERM; setsid sleep 300 & echo ready; sleep 300"
    for script, grace, status in ((polite, 60, 7), (stubborn, 0.5, 128 + signal.SIGKILL)):
        argv = watched(["sh", "-c", script], grace_s=grace)
        with subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE) as proc:
            assert proc.stdout.readline() == b"ready\n"
            proc.terminate()
            assert proc.wait(timeout=60) == status
        assert _gone(marker) == {}
