"""br-launch (batchrun/prompt/sandboxes/local/launcher.c): the sandbox's bubblewrap line, run as root by
a small program of ours instead of bwrap.

As root every other local-sandbox test (isolation, escapes, limits, network) runs on it; these
show that it makes the very sandbox bwrap makes from the same line (mounts and their flags, /dev,
capabilities, namespaces, loopback), that it refuses what it does not know before making anything,
that its namespace dies with it, and that ``BATCH_RUNNER_LAUNCHER=0`` gives bwrap back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import IN_CI, ROOT, skip_or_fail

from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox, launcher

pytestmark = pytest.mark.bwrap

# What the sandbox shows of itself: compared line by line between bwrap and br-launch.
PROBE = r"""
grep -E '^(CapInh|CapPrm|CapEff|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status
echo "pid $$ ppid-visible $(cut -d' ' -f4 /proc/self/stat) sid-is-pid1 $(ps -o sid= -p 1 2>/dev/null || cut -d' ' -f6 /proc/1/stat)"
echo "uid $(id -u) gid $(id -g) host $(hostname)"
ls -la --time-style=+ / /dev /dev/pts | sed -E 's/ +/ /g; / proc$/ s/^([^ ]+) [0-9]+ /\1 N /'  # /proc's link count: the host's processes
ls -d /dev/shm /tmp /workspace /var/tmp /.batch-runner
cat /proc/net/if_inet6 2>/dev/null | awk '{print "inet6", $6}'
awk '$2 == "00000000" && $1 == "lo" {print "lo route"}' /proc/net/route
for f in / /usr /etc /tmp /workspace /.batch-runner /proc/sys /dev/shm /root; do
  if touch "$f/.w" 2>/dev/null; then echo "$f writable"; rm -f "$f/.w"; else echo "$f read-only"; fi
done
cat /proc/self/mountinfo
"""


def _mounts(text: str) -> list[str]:
    """mountinfo lines as (mount point, options, fs type): without ids, sources and sizes; each
    mount point once (br-launch covers /proc/sys under the line's own bind of it, both read-only)."""
    seen: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^\d+ \d+ \S+ (\S+) (\S+) (\S+)(?: \S+:\S+)* - (\S+) ", line)
        if not m:
            continue
        point, opts, fstype = m.group(2), m.group(3), m.group(4)
        opts = ",".join(sorted(o for o in opts.split(",") if o not in ("relatime", "noatime")))
        seen[point] = f"{point} {opts} {fstype}"
    return sorted(seen.values())


@pytest.fixture
def launch(bwrap_available: None) -> str:
    if os.geteuid() != 0:
        pytest.skip("br-launch is used as root only (bwrap's user namespace otherwise)")
    path = launcher.launcher_path()
    if path is None:
        skip_or_fail(f"br-launch could not be built here: {launcher.problem}")
    return path


def _line(tmp_path: Path, **spec) -> tuple[LocalSandbox, list[str]]:
    """The local sandbox's own launch line (the bwrap options after the program), as a start makes it."""
    box = LocalSandbox(SandboxSpec("launcher", 0, **spec), isolation="bwrap", base_dir=str(tmp_path))
    box._root = tempfile.mkdtemp(dir=tmp_path)
    os.mkdir(os.path.join(box._root, "ctl"))
    box.workdir = "/workspace"
    argv = box._launch_argv()
    return box, argv[argv.index("--newroot") + 2 :] if "--newroot" in argv else argv[1:]


def test_br_launch_makes_the_sandbox_bwrap_makes_from_the_same_line(launch, tmp_path: Path):
    box, options = _line(tmp_path, network=False)
    newroot = os.path.join(box._root, "newroot")
    os.makedirs(newroot, exist_ok=True)
    command = ["/bin/sh", "-c", PROBE]
    by_bwrap = subprocess.run(["bwrap", *options, *command], capture_output=True, text=True, timeout=60)
    by_us = subprocess.run(
        [launch, "--newroot", newroot, *options, *command], capture_output=True, text=True, timeout=60
    )
    assert by_bwrap.returncode == 0 and by_us.returncode == 0, (by_bwrap.stderr, by_us.stderr)
    theirs, ours = by_bwrap.stdout.splitlines(), by_us.stdout.splitlines()
    cut = next(i for i, line in enumerate(theirs) if re.match(r"^\d+ \d+ ", line))
    cut_ours = next(i for i, line in enumerate(ours) if re.match(r"^\d+ \d+ ", line))
    assert ours[:cut_ours] == theirs[:cut]  # capabilities, PID 1, ids, the tree, /dev, what is writable
    assert _mounts(by_us.stdout) == _mounts(by_bwrap.stdout)
    assert "CapEff:\t0000000000000000" in ours and "NoNewPrivs:\t1" in ours
    assert "/workspace writable" in ours and "/ read-only" in ours and "/usr read-only" in ours


def test_br_launch_refuses_what_it_does_not_know_before_making_anything(launch, tmp_path: Path):
    newroot = str(tmp_path / "root")
    os.mkdir(newroot)
    base = [launch, "--newroot", newroot, "--unshare-pid", "--as-pid-1"]
    cases = {
        "unknown option --bind": [*base, "--bind", "/", "/host", "--", "/bin/true"],
        "a . or .. component": [*base, "--tmpfs", "/tmp/../..", "--", "/bin/true"],
        "may not lie under /dev": [*base, "--dev", "/dev", "--tmpfs", "/dev/fd/x", "--", "/bin/true"],
        # /dev/shm is allowed for a tmpfs alone (the sandbox's own, see system_view.system_mounts)
        "lie under /dev": [*base, "--dev", "/dev", "--ro-bind", "/usr", "/dev/shm", "--", "/bin/true"],
        "--cap-drop takes only ALL": [*base, "--cap-drop", "CAP_SYS_ADMIN", "--", "/bin/true"],
        "only --unshare-pid --as-pid-1": [launch, "--newroot", newroot, "--", "/bin/true"],
        "no command after --": [*base, "--"],
    }
    for said, argv in cases.items():
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert done.returncode == 1 and said in done.stderr, (said, done.stderr)
    assert os.listdir(newroot) == []


def test_destinations_resolve_inside_the_new_root_even_through_an_absolute_symlink(launch, tmp_path: Path):
    """bubblewrap builds the root after pivoting into it; br-launch builds it chrooted into it: a
    destination through a symlink of the new root, absolute too, stays inside, never on the host."""
    name = f"br-launch-test-{os.getpid()}"
    newroot = str(tmp_path / "root")
    os.mkdir(newroot)
    argv = [launch, "--newroot", newroot, "--unshare-pid", "--as-pid-1", "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--proc", "/proc", "--dir", f"/{name}", "--symlink", f"/{name}", "/abs",
            "--size", "1048576", "--tmpfs", "/abs/sub", "--", "/bin/sh", "-c",
            f"grep -c ' /{name}/sub ' /proc/self/mountinfo"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "1", (done.stdout, done.stderr)
    assert not os.path.exists(f"/{name}")  # nothing made on the host


def test_a_sandboxs_namespace_ends_with_its_launcher(launch, tmp_path: Path):
    box = LocalSandbox(SandboxSpec("launcher", 0, network=False), isolation="bwrap", base_dir=str(tmp_path))
    box.start()
    try:
        server = box._server
        assert os.path.realpath(f"/proc/{server.proc.pid}/exe") == os.path.realpath(launch)
        assert box.run("echo hi", timeout_s=30).output.strip() == "hi"
        started = box.run("sleep 300 & echo $!", timeout_s=30)
        assert started.exit_code == 0
        pid1 = server.pid
        os.kill(server.proc.pid, signal.SIGKILL)  # the launcher, as a dying worker's would be
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid1}"):
            server.proc.poll()
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid1}/ns"), "the sandbox's PID 1 outlived its launcher"
        # The next command gets a new namespace, as after bwrap was killed from outside.
        assert box.run("echo again", timeout_s=30).output.strip() == "again"
    finally:
        box.stop()


def test_batch_runner_launcher_0_gives_bwrap_back(bwrap_available: None, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(launcher, "ENABLED", False)
    launcher.launcher_path.cache_clear()
    try:
        box, _ = _line(tmp_path)
        argv = box._launch_argv()
        assert os.path.basename(argv[0]) == "bwrap" and "--newroot" not in argv
    finally:
        launcher.launcher_path.cache_clear()


def test_the_start_says_why_br_launch_is_not_used(bwrap_available: None, monkeypatch, capsys):
    if os.geteuid() != 0:
        pytest.skip("br-launch is for root only")

    def no_compiler() -> str:
        raise RuntimeError("no C compiler (cc, gcc)")

    monkeypatch.setattr(launcher, "_build", no_compiler)
    launcher.launcher_path.cache_clear()
    try:
        LocalSandbox.preflight([], {"isolation": "bwrap"}, real_model=False, network=False)
        line = next(
            x for x in capsys.readouterr().out.splitlines() if x.startswith("Local sandbox isolation")
        )
        assert line.startswith(
            "Local sandbox isolation: bubblewrap (br-launch not used: RuntimeError: no C compiler (cc, gcc)) ("
        ), line
    finally:
        monkeypatch.undo()
        launcher.launcher_path.cache_clear()
    LocalSandbox.preflight([], {"isolation": "bwrap"}, real_model=False, network=False)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Local sandbox isolation"))
    assert "not used" not in line, line  # built again: no stale reason


def test_ci_uses_br_launch_as_root(bwrap_available: None):
    if not IN_CI or os.geteuid() != 0:
        pytest.skip("CI as root only")
    assert launcher.launcher_path() is not None, launcher.problem


_OTHER_VERSION = """
import sys
from pathlib import Path
from batchrun.prompt.sandboxes.local import launcher
launcher.SOURCE = Path(sys.argv[1])
print(launcher._build())
"""


def test_another_versions_build_leaves_a_build_in_use(launch, tmp_path: Path):
    """A build of another source (another checkout or version of batch-runner on the machine) removed
    every other build, in use or not: the run using it failed each sandbox start after that with
    FileNotFoundError (two checkouts' tests side by side did). Builds in use are held now (a shared lock
    for the process's life), and only builds nobody holds are removed."""
    other_source = tmp_path / "launcher.c"
    other_source.write_text(launcher.SOURCE.read_text("utf-8") + "\n/* another version */\n", "utf-8")
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_VERSION, str(other_source)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    other = done.stdout.strip()
    assert other != launch and os.path.basename(other).startswith("br-launch-")
    assert os.access(launch, os.X_OK), "the build in use was removed"
    # The other process has ended: nothing holds its build, and the next clean-up removes it.
    assert os.path.exists(other)
    launcher._remove_unheld(os.path.dirname(launch), launch)
    assert not os.path.exists(other) and os.access(launch, os.X_OK)
    box = LocalSandbox(SandboxSpec("after", 0), isolation="bwrap", base_dir=str(tmp_path))
    box.start()
    try:
        assert box.run("echo ok", timeout_s=30).output == "ok\n"
    finally:
        box.stop()
