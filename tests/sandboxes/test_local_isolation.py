"""The local sandbox under bubblewrap: what a prompt can see, write and use up, and what it cannot reach;
and the run-level rules: no silent run without isolation, and --cwd_root when there is none."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import FORGE_FROM_MEMORY, read_jsonl, skip_or_fail

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.sandboxes.base import ExecResult, SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox

RUN = f"isolation-{uuid.uuid4().hex[:8]}"
REPO = Path(__file__).resolve().parents[2]
PY = "/usr/bin/python3"  # the system's: the sandbox sees /usr, not this test's virtualenv
OPTION_NAMES = ("cpus", "memory_mb", "pids_limit", "disk_mb")
CONNECT_DAEMON = "import socket; socket.socket(socket.AF_UNIX).connect('daemon.sock')"


@pytest.fixture
def boxes(bwrap_available: None, tmp_path: Path):
    """``boxes(index, **spec_fields_and_limits)``: started bubblewrap sandboxes, stopped at teardown."""
    made: list[LocalSandbox] = []
    yield sandbox_factory(made, isolation="bwrap", base_dir=str(tmp_path))
    for box in made:
        box.stop()


def sandbox_factory(made: list[LocalSandbox], **options):
    """Started sandboxes with these options; spec fields and limits by keyword; each added to ``made``."""

    def factory(index: int = 0, **fields) -> LocalSandbox:
        limits = {k: fields.pop(k) for k in list(fields) if k in OPTION_NAMES}
        box = LocalSandbox(SandboxSpec(RUN, index, **fields), **options, **limits)
        made.append(box)
        box.start()
        return box

    return factory


@pytest.fixture
def cgroups() -> None:
    from batchrun.prompt.sandboxes.local.limits import CgroupLayout, cgroup_layout

    layout = cgroup_layout()
    if not isinstance(layout, CgroupLayout):
        skip_or_fail(f"no cgroups here ({layout}): a fork bomb would reach the host")


def in_background(fn, *args, **kwargs) -> dict:
    """Run ``fn`` on a thread; the returned dict gets "result" and is joined through dict["join"]()."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=fn(*args, **kwargs)))
    thread.start()
    out["join"] = thread.join
    return out


# ---------------------------------------------------------------------------- what a prompt may write
@pytest.mark.bwrap
def test_a_hostile_cwd_never_makes_a_host_directory_writable(boxes, tmp_path: Path):
    output_dir = tmp_path / "data" / "run"
    output_dir.mkdir(parents=True)
    (output_dir / "checkpoint.json").write_text('{"done": [1, 2]}')
    # /run where the user may write there (root), else the temp dir: a host directory either way
    sock_dir = Path(
        tempfile.mkdtemp(prefix="br-sockdir-", dir="/run" if os.access("/run", os.W_OK) else None)
    )
    daemon = socket.socket(socket.AF_UNIX)
    daemon.bind(str(sock_dir / "daemon.sock"))
    daemon.listen(1)
    try:
        for i, cwd in enumerate([str(output_dir), "/root", "/run", str(sock_dir), "/var/lib"]):
            box = boxes(i, cwd=cwd)
            res = box.run(
                "pwd; ls -A | wc -l; echo pwned > checkpoint.json; mkdir -p br-x && echo pwned > br-x/y; "
                f"{PY} -c {shlex.quote(CONNECT_DAEMON)} 2>&1 | tail -1",
                timeout_s=30,
            )
            # The prompt's own, empty directory at that path: nothing of the host's is there.
            assert res.output.startswith(f"{cwd}\n0\n"), res.output
            assert "No such file" in res.output or "refused" in res.output, res.output
            assert box.run("cat br-x/y", timeout_s=20).output == "pwned\n"
            assert not os.path.lexists(os.path.join(cwd, "br-x"))  # False too where this user may not look
            box.stop()
        assert (output_dir / "checkpoint.json").read_text() == '{"done": [1, 2]}'
        assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint.json"]
        assert sorted(p.name for p in sock_dir.iterdir()) == ["daemon.sock"]
    finally:
        daemon.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.bwrap
def test_nothing_but_the_working_directory_and_tmp_is_writable(boxes):
    box = boxes(0)
    probe = "for d in / /usr /etc /home /root /run /var /var/lib /opt /srv; do touch $d/br-w 2>/dev/null && echo $d; done"
    assert box.run(probe, timeout_s=20).output == ""
    assert box.run("touch br-w /tmp/br-w /var/tmp/br-v && echo ok", timeout_s=20).output == "ok\n"


# ---------------------------------------------------------------------------- what a prompt may see
@pytest.mark.bwrap
@pytest.mark.parametrize("tmpdir", ["/tmp", "/var/tmp", "/srv"])
def test_a_prompt_sees_the_system_but_no_host_data(
    bwrap_available: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmpdir: str
):
    """Whatever TMPDIR is: other prompts, the output and dataset directories, homes, /var/lib, the project."""
    if not os.access(tmpdir, os.W_OK):
        pytest.skip(f"{tmpdir} is not writable by this user")
    host_tmp = Path(tempfile.mkdtemp(prefix="br-tmpdir-", dir=tmpdir))
    monkeypatch.setenv("TMPDIR", str(host_tmp))
    tempfile.tempdir = None  # so the sandboxes' private directories go under this TMPDIR
    secrets: list[Path] = []
    try:
        writable = [
            d for d in (Path.home(), Path("/var/lib")) if os.access(d, os.W_OK)
        ]  # root's, or a user's home
        for where in (host_tmp / "data" / "run", host_tmp / "datasets", *writable):
            where.mkdir(parents=True, exist_ok=True)
            secret = where / f"br-secret-{uuid.uuid4().hex[:8]}.txt"
            secret.write_text("TOP-SECRET")
            secrets.append(secret)
        first = LocalSandbox(SandboxSpec(RUN, 0, cwd="/work/shared"), isolation="bwrap")
        second = LocalSandbox(SandboxSpec(RUN, 1, cwd="/work/shared"), isolation="bwrap")
        first.start()
        second.start()
        try:
            assert first._root and Path(first._root).parent == host_tmp
            first.run("echo TOP-SECRET > mine.txt; echo TOP-SECRET > /tmp/mine.txt", timeout_s=20)
            paths = [*secrets, Path("/work/shared/mine.txt"), Path("/tmp/mine.txt"), Path(first._root), REPO]
            listing = " ".join(shlex.quote(str(p)) for p in paths)
            res = second.run(f"cat {listing}", timeout_s=20)
            assert "TOP-SECRET" not in res.output and res.exit_code != 0, res.output
            dirs = f"/work/shared /tmp {host_tmp} /root /home /var/lib {secrets[0].parent}"
            listed = second.run(f"ls -A {dirs} 2>/dev/null", timeout_s=20).output
            assert "br-secret" not in listed and "mine.txt" not in listed, listed
            assert first.run("cat mine.txt", timeout_s=20).output == "TOP-SECRET\n"
            system = second.run(
                "cat /etc/os-release | head -1; cat /etc/shadow; ls /usr/bin | grep -c .", timeout_s=20
            )
            assert system.output.startswith(("PRETTY_NAME=", "NAME=")) and "root:" not in system.output
        finally:
            first.stop()
            second.stop()
    finally:
        tempfile.tempdir = None
        for secret in secrets:
            secret.unlink(missing_ok=True)
        shutil.rmtree(host_tmp, ignore_errors=True)


# The kernel's keyrings by syscall (add_key, request_key, keyctl READ), through ctypes: python3 in the
# sandbox; prints "added" or "refused <errno>", then what it reads back ("found <data>" or "none").
KEYRING = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219), "riscv64": (217, 218, 219)}[__import__("os").uname().machine]
desc, data = sys.argv[1].encode(), sys.argv[2].encode()
if data:
    got = libc.syscall(nr[0], b"user", desc, data, len(data), -4)  # KEY_SPEC_USER_KEYRING
    print("added" if got > 0 else f"refused {ctypes.get_errno()}")
key = libc.syscall(nr[1], b"user", desc, None, 0)
buf = ctypes.create_string_buffer(256)
n = libc.syscall(nr[2], 11, ctypes.c_long(key), buf, 256) if key > 0 else -1  # KEYCTL_READ
print(f"found {buf.raw[:n].decode()}" if n > 0 else "none")
"""


def _keyring(box: LocalSandbox, desc: str, data: str = "") -> str:
    box.run(f"cat > /tmp/keyring.py <<'EOF'\n{KEYRING}\nEOF", timeout_s=20)
    return box.run(f"{PY} /tmp/keyring.py {desc} '{data}'", timeout_s=20).output


@pytest.mark.bwrap
def test_the_kernel_keyrings_of_the_runner_s_user_are_out_of_reach(boxes):
    """The sandbox runs as the runner's user: the user's keyring (@u) is that user's on the host. A prompt
    put a key in it that another prompt, and the host, read (and that outlived both), and could read
    the keys the user's other programs keep there. The keyring calls fail, as on a kernel without keys."""
    if not os.path.exists(PY):
        skip_or_fail(f"no {PY} for the keyring calls")
    desc = f"br-audit-{uuid.uuid4().hex[:8]}"
    try:
        said = _keyring(boxes(0), desc, "secret-of-prompt-0")
        assert said.startswith("refused") and "none" in said, said
        assert _keyring(boxes(1), desc) == "none\n"
        assert (
            subprocess.run([sys.executable, "-c", KEYRING, desc, ""], capture_output=True, text=True).stdout
            == "none\n"
        )
    finally:  # a failed run leaves no key on the host: invalidated (KEYCTL_INVALIDATE) from here
        cleanup = KEYRING.split("desc, data =")[0] + (
            "key = libc.syscall(nr[1], b'user', sys.argv[1].encode(), None, 0)\n"
            "key > 0 and libc.syscall(nr[2], 21, ctypes.c_long(key))\n"
        )
        subprocess.run([sys.executable, "-c", cleanup, desc], capture_output=True)


# ---------------------------------------------------------------------------- what a prompt may use up
@pytest.mark.bwrap
def test_a_fork_bomb_ends_with_a_clear_message_and_others_carry_on(boxes, cgroups: None):
    bomb, other = boxes(0, pids_limit=64), boxes(1)
    running = in_background(bomb.run, "b() { b | b & }; b; sleep 3; echo bombed", timeout_s=60)
    assert other.run("echo alive", timeout_s=30).output == "alive\n"
    assert subprocess.run(["true"], timeout=30).returncode == 0  # the host still forks
    running["join"]()
    res = running["result"]
    assert "[batch-runner: the sandbox's process limit (64, and" in res.output, res.output[-500:]
    assert bomb.run("echo recovered", timeout_s=30).output == "recovered\n"


@pytest.mark.bwrap
def test_a_memory_hog_is_killed_with_a_clear_message_and_others_carry_on(boxes, cgroups: None):
    hog, other = boxes(0, memory_mb=64, disk_mb=16), boxes(1)
    running = in_background(hog.run, f"{PY} -c 'b = bytearray(3 << 30); print(len(b))'", timeout_s=120)
    assert other.run("echo alive", timeout_s=30).output == "alive\n"
    running["join"]()
    res = running["result"]
    assert res.exit_code == 137 and str(3 << 30) not in res.output
    assert "memory limit (64 MiB for processes + 16 MiB for files, and" in res.output, res.output
    assert hog.run("echo recovered", timeout_s=30).output == "recovered\n"


@pytest.mark.bwrap
def test_writing_beyond_the_disk_cap_fails_with_a_clear_message(boxes):
    box, other = boxes(0, disk_mb=16), boxes(1)
    res = box.run("dd if=/dev/zero of=big bs=1M count=2048", timeout_s=120)
    assert "No space left on device" in res.output, res.output
    assert "[batch-runner: /workspace is full: its size cap is 16 MiB]" in res.output
    assert int(box.run("du -m big | cut -f1", timeout_s=20).output.split()[0]) <= 16
    tmp = box.run("dd if=/dev/zero of=/tmp/big bs=1M count=64", timeout_s=60)
    assert "No space left on device" in tmp.output and "/tmp is full" in tmp.output
    assert box.run("rm big /tmp/big && echo small > f && cat f", timeout_s=20).output == "small\n"
    assert (
        other.run("dd if=/dev/zero of=big bs=1M count=32 2>/dev/null && du -m big", timeout_s=60).exit_code
        == 0
    )


@pytest.mark.bwrap
def test_files_in_both_tmpfs_are_charged_with_the_processes_under_one_memory_limit(boxes, cgroups: None):
    """Each tmpfs may hold --container_disk_mb, but their pages are charged to the prompt's memory cgroup
    (memory + disk, swap included): two full tmpfs never hold memory + 2 x disk (the start's bound on
    memory + disk against the machine's memory relies on it)."""
    box = boxes(0, memory_mb=64, disk_mb=256)
    first = box.run("dd if=/dev/zero of=a bs=1M count=200 2>&1 | tail -1", timeout_s=120)
    assert first.exit_code == 0 and "200 MiB" in first.output, first.output
    second = box.run("dd if=/dev/zero of=/tmp/b bs=1M count=200", timeout_s=120)
    assert "memory limit (64 MiB for processes + 256 MiB for files, and" in second.output, second.output
    held = box.run("du -cm a /tmp/b | tail -1", timeout_s=30).output.split()
    assert int(held[0]) <= 64 + 256, held  # not 400


@pytest.fixture
def run_boxes(bwrap_available: None, cgroups: None):
    """``run_boxes(index, **limits)``: sandboxes of one run, as a worker makes them (the run's own
    parent cgroup, whose emptied prompt cgroups are kept for the next prompt); swept at teardown."""
    from batchrun.prompt.sandboxes.local.limits import run_cgroup_names

    options = LocalSandbox.prepare_run(RUN, {"isolation": "bwrap"}, workers_here=True)
    made: list[LocalSandbox] = []
    yield sandbox_factory(made, **options)
    for box in made:
        box.stop()
    LocalSandbox.sweep(options)
    assert options["cgroup_parent"] not in run_cgroup_names()  # the kept cgroups went with the run


@pytest.mark.bwrap
def test_a_kept_cgroup_starts_the_next_prompt_at_zero(run_boxes):
    limits = {"pids_limit": 64, "memory_mb": 64, "disk_mb": 16}
    first = run_boxes(0, **limits)
    dirs = list(first._cgroup.dirs)
    res = first.run("b() { b | b & }; b; sleep 3; echo bombed", timeout_s=60)
    assert "process limit (64, and" in res.output, res.output[-500:]
    res = first.run(f"{PY} -c 'b = bytearray(3 << 30)'", timeout_s=120)
    assert "memory limit (64 MiB for processes + 16 MiB for files, and" in res.output, res.output
    first.stop()
    second = run_boxes(1, **limits)
    assert second._cgroup.dirs == dirs  # the same cgroup, made again: none of its counts are this prompt's
    assert second.run("echo clean", timeout_s=30).output == "clean\n"
    res = second.run("b() { b | b & }; b; sleep 3; echo bombed", timeout_s=60)
    assert "process limit (64, and" in res.output, res.output[-500:]  # and its own still count
    other = run_boxes(2, pids_limit=128)
    assert other._cgroup.dirs != dirs  # other limits, another cgroup


@pytest.mark.bwrap
def test_the_prompts_of_a_run_together_never_take_the_hosts_memory_or_processes(
    bwrap_available: None, cgroups: None, monkeypatch
):
    """Each prompt may hold 512 processes and 512 MiB; a run holds at most what the machine can spare
    (limits.run_bounds, here made small): before, 64 fork bombs of 512 filled a pid_max of 32,768 and
    a dozen prompts of 4 GiB could make the kernel's OOM killer pick the runner itself."""
    from batchrun.prompt.sandboxes.local import limits

    monkeypatch.setattr(limits, "run_bounds", lambda: limits.RunBounds(memory_bytes=160 << 20, pids=48))
    options = LocalSandbox.prepare_run(RUN, {"isolation": "bwrap"}, workers_here=True)
    made: list[LocalSandbox] = []
    try:
        first, second = (
            sandbox_factory(made, **options)(i, pids_limit=512, memory_mb=512, disk_mb=16) for i in (0, 1)
        )
        # Both at once (what a command leaves running is ended when it returns).
        # The first prompt holds 25 processes (counted with builtins), the second then finds no room for
        # its 25 while the first holds them, and room enough once the first is done.
        count = 'n=0; for f in /proc/[0-9]*/comm; do read -r c < "$f" && [ "$c" = sleep ] && n=$((n+1)); done'
        spawn = (
            "mkfifo /tmp/f; exec 9<>/tmp/f; for i in $(seq 25); do sleep 9 & done 2>/dev/null; "
            f"read -t 4 -u 9; {count} 2>/dev/null; echo count $n"
        )
        holding = in_background(first.run, spawn, timeout_s=60)
        time.sleep(1.5)
        crowded = second.run("for i in $(seq 25); do sleep 1 & done; echo spawned", timeout_s=60).output
        holding["join"]()
        assert "count 25" in holding["result"].output, holding["result"].output
        assert "48 for all the run's prompts together) was reached" in crowded, crowded
        alone = second.run("rm -f /tmp/f; " + spawn, timeout_s=60).output
        assert "count 25" in alone and "was reached" not in alone, alone
        hold = f"{PY} -c 'b = bytearray(100 << 20); import time; time.sleep(4); print(\"held\", len(b))'"
        runs = [in_background(box.run, hold, timeout_s=60) for box in (first, second)]
        outputs = [(r["join"](), r["result"].output)[1] for r in runs]
        # 100 MiB each is under each prompt's 512, but 200 together is past the run's 160: one is killed.
        assert sum(f"held {100 << 20}" in out for out in outputs) == 1, outputs
        assert any("160 MiB for all the run's prompts together) was reached" in out for out in outputs), (
            outputs
        )
    finally:
        for box in made:
            box.stop()
        LocalSandbox.sweep(options)


@pytest.mark.bwrap
def test_a_cgroup_that_still_holds_a_process_is_never_kept(run_boxes):
    first = run_boxes(0)
    dirs = list(first._cgroup.dirs)
    lingering = subprocess.Popen(["sleep", "60"])
    try:
        first._cgroup.enter(lingering.pid)  # as if a process of the prompt had outlived its sandbox
        first.stop()
        second = run_boxes(1)
        assert not set(second._cgroup.dirs) & set(dirs)
        assert second.run("cat /proc/self/cgroup >/dev/null; echo own", timeout_s=30).output == "own\n"
    finally:
        lingering.kill()
        lingering.wait()


@pytest.mark.bwrap
def test_a_timeout_s_sweep_never_blocks_on_what_the_prompt_put_in_its_tmp(boxes):
    """After each command the sandbox's server, and after a timeout the worker from the host, spare
    what the process tool started, reading its pid files in the sandbox's /tmp. A FIFO planted there
    as a pid file blocked both: the server's sweep until the command timed out (and the sandbox's
    files were lost with the server), the worker's open() for good, so a timed-out command (a file
    tool's too: read_file of a FIFO) never returned."""
    from batchrun.prompt.sandboxes.base import BACKGROUND_DIR

    box = boxes()
    where = f"/tmp/{BACKGROUND_DIR}"

    def bounded(command: str, timeout_s: float):
        """Whether ``command`` hung the worker 10 s past its timeout, and its result."""
        running = in_background(box.run, command, timeout_s=timeout_s)
        running["join"](timeout=timeout_s + 10)
        hung = "result" not in running
        while "result" not in running:  # open the FIFO's other end: the worker's open() returns
            with contextlib.suppress(OSError):
                os.close(os.open(f"/proc/{box._server.pid}/root{where}/p1/pid", os.O_WRONLY | os.O_NONBLOCK))
            running["join"](timeout=1)
        return hung, running["result"]

    plant = f"mkdir -p {where}/p1 {where}/p2 && mkfifo {where}/p1/pid && ln -s /etc/hostname {where}/p2/pid"
    assert bounded(plant, 5) == (False, ExecResult("", 0))
    hung, result = bounded("sleep 30", 1)
    assert not hung and result.timed_out
    assert box.run(f"ls {where}/p1", timeout_s=10).output == "pid\n"  # the same sandbox, still


# ---------------------------------------------------------------------------- what a prompt may reach
PROBE_TCP = """
import socket, sys
port = int(sys.argv[1])
gateways = [l.split()[2] for l in open("/proc/net/route").read().splitlines()[1:] if l.split()[1] == "00000000"]
hosts = ["127.0.0.1", *(socket.inet_ntoa(bytes.fromhex(g)[::-1]) for g in gateways), *sys.argv[2:]]
for host in hosts:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.settimeout(3)
    try:
        s.connect((host, port))
        print(host, "CONNECTED")
    except OSError as e:
        print(host, "unreachable", e)
"""


@pytest.mark.bwrap
@pytest.mark.parametrize("routes_by", ["hub", "netlink", "ip"])
def test_host_services_are_out_of_reach_with_network_on_or_off(boxes, routes_by, monkeypatch):
    """Loopback, the gateway and the host's other addresses: a service on all interfaces (as model
    servers often are) answers none of them from inside. As root a prompt's network is a link into
    the worker's one slirp4netns (``network_hub``, "hub"); else, or with the hub off, a slirp4netns
    of its own, and the routes that close the host's addresses are added over netlink from the
    worker where it may enter the namespace (root), else by ``nsenter ... ip``: all three are tried."""
    from batchrun.prompt.sandboxes.local import command_server, network_hub
    from batchrun.prompt.sandboxes.local.host import host_addresses, network_problem

    if network_problem():
        skip_or_fail(network_problem())
    if routes_by == "hub" and os.geteuid() != 0:
        pytest.skip("the hub is for root; unprivileged bubblewrap keeps a slirp4netns per prompt")
    monkeypatch.setattr(network_hub, "ENABLED", routes_by == "hub")
    if routes_by == "ip":

        def refuse(*args):
            raise OSError("netlink refused in this test")

        monkeypatch.setattr(command_server, "add_unreachable_routes", refuse)
    service = socket.socket(socket.AF_INET6)
    service.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    service.bind(("::", 0))
    service.listen(8)
    port = service.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the service does answer on the host
        online, offline = boxes(0, network=True), boxes(1, network=False)
        assert online.network == "slirp4netns" and offline.network == "none"
        on_hub = online._server.address is not None
        assert on_hub == (routes_by == "hub") and (online._server._slirp is None) == on_hub
        devices = online.run("tail -n +3 /proc/net/dev | cut -d: -f1", timeout_s=20).output.split()
        assert "lo" in devices and len(devices) >= 2, devices  # an interface to the outside world
        assert "00000000" in online.run("cut -f2 /proc/net/route", timeout_s=20).output  # a default route
        assert (
            online.run("cat /etc/resolv.conf", timeout_s=20).output == "nameserver 10.0.2.3\n"
        )  # slirp's DNS
        others = host_addresses()
        for address in others:  # each one answers on the host
            with socket.create_connection((address, port), timeout=5):
                pass
        for box in (online, offline):
            res = box.run(f"{PY} -c {shlex.quote(PROBE_TCP)} {port} {' '.join(others)}", timeout_s=120)
            assert "127.0.0.1 unreachable" in res.output and "CONNECTED" not in res.output, res.output
            assert all(f"{a} unreachable" in res.output for a in others), res.output
    finally:
        service.close()


# ---------------------------------------------------------------------------- the run: no silent "no isolation"
def run_cli(
    tmp_path: Path, rows: list[dict], *flags: str, path: str | None = None
) -> subprocess.CompletedProcess:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = [
        sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=2",
        "--run_name=iso", f"--output_dir={tmp_path / 'data'}", "--num_workers=1",
        "--distribution=terminal_only", *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def path_without_bwrap(tmp_path: Path) -> str:
    """A PATH with every command of this machine but bubblewrap."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            target = bin_dir / entry.name
            if entry.name != "bwrap" and not target.exists() and os.access(entry.path, os.X_OK):
                target.symlink_to(entry.path)
    return str(bin_dir)


def test_auto_isolation_without_bubblewrap_refuses_a_real_model(tmp_path: Path):
    with FakeModelServer() as server:
        done = run_cli(
            tmp_path, [{"prompt": "list files [calls:1]"}], "--model=some/model",
            f"--base_url={server.base_url}", "--api_key=sk-iso", path=path_without_bwrap(tmp_path),
        )  # fmt: skip
        assert server.stats()["requests_by_prompt"] == {}  # no model call
    assert done.returncode == 2, done.stderr
    assert "bubblewrap is not installed" in done.stderr and "--local_isolation=none" in done.stderr
    assert not (tmp_path / "data" / "iso" / "trajectories.jsonl").exists()


def test_auto_isolation_falls_back_to_none_only_for_the_mock_model(tmp_path: Path):
    done = run_cli(
        tmp_path, [{"prompt": "list files [calls:1]"}], "--model=mock", path=path_without_bwrap(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert "the local sandbox has NO isolation (bubblewrap is not installed" in done.stdout
    assert len(read_jsonl(tmp_path / "data" / "iso" / "trajectories.jsonl")) == 1


def test_no_isolation_refuses_a_cwd_outside_cwd_root(tmp_path: Path):
    root = tmp_path / "projects"
    (root / "a").mkdir(parents=True)
    rows = [
        {"prompt": "hello", "cwd": str(root / "a")},  # the fake model runs pwd for it
        {"prompt": "outside [calls:1]", "cwd": "/etc"},
    ]
    with FakeModelServer() as server:
        common = [
            "--model=some/model",
            f"--base_url={server.base_url}",
            "--api_key=sk-iso",
            "--local_isolation=none",
        ]
        refused = run_cli(tmp_path, rows, *common, f"--cwd_root={root}")
        no_root = run_cli(tmp_path, rows[:1], *common)
        assert server.stats()["requests_by_prompt"] == {}
        accepted = run_cli(tmp_path, rows[:1], *common, f"--cwd_root={root}")
    assert (
        refused.returncode == 2 and f"rows.jsonl:2: cwd '/etc' is outside --cwd_root {root}" in refused.stderr
    )
    assert "rows.jsonl:1:" not in refused.stderr
    assert no_root.returncode == 2 and "name its parent with --cwd_root" in no_root.stderr
    assert accepted.returncode == 0, accepted.stderr
    (record,) = read_jsonl(tmp_path / "data" / "iso" / "trajectories.jsonl")
    assert str(root / "a") in json.dumps(record["conversations"])  # the command ran there


def test_a_worker_s_first_starts_at_once_all_find_the_cgroups(cgroups):
    """A worker's first sandbox starts run at once, and each may be the first to look for the cgroups.
    They probed with one directory name per process: the thread whose mkdir lost found the cgroups
    "not writable", and its sandbox (or, once that answer was cached, every later one of the worker)
    ran on rlimits, without its cgroup, and said nothing (193 of 400 such looks in one measurement)."""
    from batchrun.prompt.sandboxes.local.limits import CgroupLayout, cgroup_layout

    found: list[object] = []
    for _ in range(20):
        barrier = threading.Barrier(8)

        def look(barrier: threading.Barrier) -> None:
            barrier.wait()
            found.append(cgroup_layout.__wrapped__())  # as a fresh process's first look, uncached

        threads = [threading.Thread(target=look, args=(barrier,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [f for f in found if not isinstance(f, CgroupLayout)] == []
    assert len(found) == 160


@pytest.mark.bwrap
def test_without_cgroups_rlimits_still_bound_memory_and_disk(
    bwrap_available: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from batchrun.prompt.sandboxes.local import sandbox

    monkeypatch.setattr(sandbox, "cgroup_layout", lambda: "no cgroups (test)")
    box = LocalSandbox(
        SandboxSpec(RUN, 0), isolation="bwrap", base_dir=str(tmp_path), memory_mb=256, disk_mb=16
    )
    box.start()
    try:
        assert box._cgroup is None
        res = box.run(f"{PY} -c 'b = bytearray(3 << 30); print(len(b))'", timeout_s=60)
        assert "MemoryError" in res.output and res.exit_code == 1, res.output
        assert box.run("ulimit -v", timeout_s=20).output == f"{256 << 10}\n"
        assert box.run("ulimit -v unlimited", timeout_s=20).exit_code != 0  # the sandbox cannot raise it
        dd = box.run("dd if=/dev/zero of=big bs=1M count=64", timeout_s=60)
        assert "No space left on device" in dd.output
    finally:
        box.stop()


@pytest.mark.parametrize(
    ("cwd", "why"),
    [
        ("//", "would replace a directory the sandbox needs"),
        ("//proc", "would replace a directory the sandbox needs"),
        ("//dev/x", "would replace a directory the sandbox needs"),
        ("//etc/x", "read-only system directory /etc"),
        ("///usr/../usr/lib", "read-only system directory /usr"),
    ],
)
def test_a_cwd_with_a_leading_double_slash_is_checked_as_the_path_it_names(cwd, why):
    """normpath keeps a leading '//' (Linux reads it as '/'): '//proc' passed the check, and the prompt ran
    with a tmpfs over the sandbox's /proc ('//dev': no /dev/null); '//etc/x' failed after a paid model call."""
    from batchrun.prompt.sandboxes.local.host import sandbox_cwd_problem, sandbox_workdir

    assert why in (sandbox_cwd_problem(cwd) or "")
    assert sandbox_workdir("//srv//app/") == "/srv/app" and sandbox_workdir("") == "/workspace"


def test_a_cwd_the_sandbox_cannot_have_fails_its_row_without_a_model_call(
    bwrap_available: None, tmp_path: Path
):
    rows = [{"prompt": "system dir [calls:1]", "cwd": "/usr/lib/app"}, {"prompt": "hello", "cwd": "/srv/app"}]
    with FakeModelServer() as server:
        done = run_cli(
            tmp_path, rows, "--model=some/model", f"--base_url={server.base_url}", "--api_key=sk-iso",
            "--max_failure_rate=1.0",
        )  # fmt: skip
        asked = server.stats()["requests_by_prompt"]
    assert done.returncode == 0, done.stderr
    (failed,) = read_jsonl(tmp_path / "data" / "iso" / "failed.jsonl")
    assert "/usr/lib/app" in json.dumps(failed) and "read-only system directory /usr" in json.dumps(failed)
    assert not any("system dir" in key for key in asked), asked
    (record,) = read_jsonl(tmp_path / "data" / "iso" / "trajectories.jsonl")
    assert "/srv/app" in json.dumps(record["conversations"])  # the fake model's pwd, inside the sandbox


@pytest.mark.bwrap
def test_a_busy_loop_is_held_to_the_cpu_quota(boxes, cgroups: None):
    box = boxes(0, cpus=0.1)
    stat = next(Path(d) for d in box._cgroup.dirs if (Path(d) / "cpu.stat").exists()) / "cpu.stat"
    quota = (stat.parent / "cpu.cfs_quota_us") if (stat.parent / "cpu.cfs_quota_us").exists() else None
    assert quota is None or quota.read_text().strip() == "10000"
    box.run("timeout 1 sh -c 'while :; do :; done'", timeout_s=30)
    throttled = dict(line.split() for line in stat.read_text().splitlines())
    assert int(throttled["nr_throttled"]) > 0, throttled


def test_bound_unix_socket_paths_asked_of_the_kernel_are_those_a_path_reaches():
    """sock_diag gives the listening and the bound unconnected sockets' paths, exactly (a newline in a
    name included), without the connected ones /proc/net/unix lists a line each for, and no
    abstract names; in a network namespace of our own, so only this test's sockets are there."""
    if shutil.which("unshare") is None:
        skip_or_fail("unshare is needed")
    script = r"""
import json, re, socket, tempfile
from batchrun.prompt.sandboxes.local import netlink
d = tempfile.mkdtemp()
kept = []
def bound(name, kind=socket.SOCK_STREAM, listen=True):
    s = socket.socket(socket.AF_UNIX, kind)
    s.bind(name if name.startswith("\0") else f"{d}/{name}")
    if listen:
        s.listen(4)
    kept.append(s)
    return s
listener = bound("listening")
bound("bound-only", listen=False)
bound("datagram", socket.SOCK_DGRAM, listen=False)
bound("seqpacket", socket.SOCK_SEQPACKET)
bound("new\nline")
bound("\0abstract-name")
client = socket.socket(socket.AF_UNIX)
client.connect(f"{d}/listening")
accepted = listener.accept()[0]  # connected, and listed under its listener's path by /proc/net/unix
pairs = [socket.socketpair() for _ in range(50)]
proc = re.findall(r" (/[^\n]*)", open("/proc/net/unix").read())
print(json.dumps({"dir": d, "diag": netlink.bound_unix_paths(), "proc": proc}))
"""
    done = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        skip_or_fail(f"cannot make a network namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    d = got["dir"]
    expected = {f"{d}/{n}" for n in ("listening", "bound-only", "datagram", "seqpacket", "new\nline")}
    assert sorted(got["diag"]) == sorted(expected)  # each once: not the accepted connection again
    assert set(got["proc"]) - {f"{d}/new"} <= expected  # the file cuts the name at its newline
    assert got["proc"].count(f"{d}/listening") == 2  # the listener and the connection it accepted


def test_system_sockets_are_read_from_proc_where_the_kernel_cannot_say(monkeypatch):
    """Without unix_diag in the kernel, the masked sockets come from /proc/net/unix, as before."""
    from batchrun.prompt.sandboxes.local import host

    try:
        home = Path(tempfile.mkdtemp(prefix="br-sock-", dir="/etc"))
    except OSError:
        skip_or_fail("a directory in /etc is needed (root)")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(home / "daemon.sock"))
        server.listen(1)
        assert str(home / "daemon.sock") in host.system_sockets()

        def no_unix_diag() -> list[str]:
            raise OSError(2, "No such file or directory")

        monkeypatch.setattr(host, "bound_unix_paths", no_unix_diag)
        monkeypatch.setattr(host, "_diag_works", True)
        assert str(home / "daemon.sock") in host.system_sockets()
        assert host._diag_works is False
    finally:
        server.close()
        shutil.rmtree(home, ignore_errors=True)


def test_host_addresses_read_from_proc_are_those_ip_lists_secondary_ones_included():
    """The host's addresses are read from /proc at every start (no process); in a network namespace
    of our own with a secondary IPv4 and an IPv6 address, they are exactly what ``ip -o addr`` lists."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        skip_or_fail("unshare and ip are needed")
    script = (
        "import ipaddress\n"
        "from batchrun.prompt.sandboxes.local import host as L\n"
        "ip = sorted({str(a) for a in map(ipaddress.ip_address, L._ip_addresses())"
        " if not (a.is_loopback or a.is_link_local)})\n"
        "print(L.host_addresses() == ip, L.host_addresses())\n"
    )
    setup = (
        "ip link set lo up && ip addr add 10.9.8.7/24 dev lo && ip addr add 10.9.8.8/24 dev lo"
        ' && ip -6 addr add fd12::5/64 dev lo && exec "$0" -c "$1"'
    )
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", setup, sys.executable, script],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        skip_or_fail(f"cannot make a network namespace here: {done.stderr.strip()}")
    assert done.stdout.strip() == "True ['10.9.8.7', '10.9.8.8', 'fd12::5']", done.stderr


@pytest.mark.bwrap
def test_a_worker_with_descriptors_above_1023_still_starts_and_runs_sandboxes(boxes):
    """A worker with hundreds of prompts in flight holds thousands of descriptors; select(2) refuses
    any above 1023 (it raised ValueError at the network's start), poll(2) does not."""
    import resource

    from batchrun.prompt.sandboxes.base import readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:  # as the runner does (run/open_files.py); a user's soft limit is often 1024
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip(f"the hard limit on open files ({hard}) is below 1200")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        r, w = os.pipe()
        held += [r, w]
        assert r > 1023 and not readable(r, 0.01)
        os.write(w, b"x")
        assert readable(r, 1.0)
        box = boxes(0, network=True)
        assert box.run("echo ok", timeout_s=20).output == "ok\n"
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.bwrap
def test_the_runs_etc_view_shows_what_the_masks_show(bwrap_available: None, tmp_path: Path):
    """A run's sandboxes bind one copy of /etc without its secrets instead of masking each secret
    (a mount each): the same names, the same contents, and every secret empty."""
    from batchrun.prompt.sandboxes.local.system_view import etc_secrets, run_etc_view

    view = LocalSandbox(SandboxSpec(RUN, 0), isolation="bwrap", base_dir=str(tmp_path))
    masked = LocalSandbox(SandboxSpec(RUN, 1), isolation="bwrap")
    view.start()
    masked.start()
    try:
        etc = run_etc_view(str(tmp_path))
        assert etc is not None and ["--ro-bind", etc, "/etc"] == _bound(view, "/etc")  # the view is in use
        listing = "find /etc | sort"
        assert view.run(listing, timeout_s=30).output == masked.run(listing, timeout_s=30).output
        digests = "find /etc -type f -size +0 -readable -exec md5sum {} + | sort"
        seen = view.run(digests, timeout_s=30).output
        assert seen == masked.run(digests, timeout_s=30).output and seen.count("\n") > 20
        for path, is_dir in etc_secrets():
            probe = f"ls -A {shlex.quote(path)}" if is_dir else f"cat {shlex.quote(path)}"
            assert view.run(probe, timeout_s=10).output == "", path
        assert "root:" not in view.run("cat /etc/shadow", timeout_s=10).output
    finally:
        view.stop()
        masked.stop()


@pytest.mark.bwrap
def test_a_sandbox_started_on_a_thread_that_ends_keeps_its_shell(bwrap_available: None, tmp_path: Path):
    """bwrap's --die-with-parent follows the thread that started it, not the process: a sandbox
    started on a thread of its own (a start alongside the first model call, without a pool of start
    threads) must still be there for its first command."""
    from batchrun.prompt.sandbox_lifecycle import BackgroundStart

    box = BackgroundStart(LocalSandbox(SandboxSpec(RUN, 0), isolation="bwrap", base_dir=str(tmp_path)))
    box.start()
    try:
        box.wait_started()
        server = box.inner._server
        time.sleep(0.3)  # the start's thread has returned
        assert server.alive()  # not killed with that thread (run() would quietly start another)
        assert box.run("echo still here", timeout_s=20).output == "still here\n"
        assert box.inner._server is server
    finally:
        box.stop()


def _bound(box: LocalSandbox, target: str) -> list[str] | None:
    """The ``--ro-bind <source> <target>`` that box's bwrap would get for ``target``."""
    argv = box._launch_argv()
    for i in range(len(argv) - 2):
        if argv[i] == "--ro-bind" and argv[i + 2] == target:
            return argv[i : i + 3]
    return None


@pytest.mark.bwrap
def test_every_run_shares_one_etc_view_in_a_directory_only_this_user_can_use(
    bwrap_available: None, tmp_path: Path, monkeypatch
):
    """The /etc view is made once per machine in this user's runtime directory, not once per worker
    and run: two runs (two run directories) bind the same one; a runtime directory someone else could
    write into is not used (each run then makes its own view in its run directory)."""
    from batchrun.prompt.sandboxes.local import system_view as local

    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(local, "_etc_views", {})
    first, second = tmp_path / "run1", tmp_path / "run2"
    first.mkdir()
    second.mkdir()
    view = local.run_etc_view(str(first))
    assert view is not None and view == local.run_etc_view(str(second))
    assert Path(view).parent == runtime / f"batch-runner-{os.geteuid()}"
    assert Path(view).parent.stat().st_mode & 0o777 == 0o700
    assert os.listdir(first) == [] and os.listdir(second) == []
    box = LocalSandbox(SandboxSpec(RUN, 0), isolation="bwrap", base_dir=str(first))
    box.start()
    try:
        assert _bound(box, "/etc") == ["--ro-bind", view, "/etc"]
        assert "root:" not in box.run("cat /etc/shadow", timeout_s=10).output
        assert box.run("cat /etc/passwd", timeout_s=10).output == Path("/etc/passwd").read_text()
    finally:
        box.stop()

    Path(view).parent.chmod(0o733)  # others may write into it: not trusted
    monkeypatch.setattr(local, "_etc_views", {})
    own = local.run_etc_view(str(first))
    assert own is not None and Path(own).parent == first


def test_the_rlimit_fallback_says_memory_is_per_process_and_the_run_records_it(monkeypatch, tmp_path):
    """Without cgroups (a user who is not root, without delegation: the usual case) the start said
    "Per-prompt limits: 1.0 CPU, 2048 MiB memory + 4096 MiB per tmpfs ..., 512 processes; enforced by
    rlimits: RLIMIT_AS per process, ..." while 6 processes of 200 MiB each ran in one prompt's sandbox
    of 256 MiB (measured as uid 1001), and statistics.json did not say how the limits were held. The
    line now says what RLIMIT_AS does not bound, and statistics.json records it (sandbox_limits)."""
    from helpers import run, stats_of, write_jsonl

    from batchrun.prompt.sandboxes.local import limits as _limits
    from batchrun.prompt.sandboxes.local import local_isolation_available

    monkeypatch.setattr(_limits, "cgroup_layout", lambda: "the cgroup v2 tree is not writable (not root)")
    said = _limits.limits_mechanism()
    assert said.startswith(
        "rlimits: RLIMIT_AS per process (not the prompt's processes together, nor its tmpfs files), "
    )
    assert said.endswith(", no CPU limit (the cgroup v2 tree is not writable (not root))")
    monkeypatch.undo()
    if not local_isolation_available():
        pytest.skip("needs bubblewrap")
    run(None, write_jsonl(tmp_path / "d.jsonl", ["x"]), tmp_path / "data", sandbox="local")
    assert stats_of(tmp_path / "data" / "run")["sandbox_limits"] == _limits.limits_mechanism()


def test_the_rlimit_fallback_sets_memory_and_processes_on_the_running_server(monkeypatch):
    """Without cgroups the limits go onto the server process (its commands inherit them), soft and
    hard alike; for a user other than root the process count too (a shell's ``ulimit -u`` did that
    before, which /bin/sh as dash refused: no sandbox started for such a user)."""
    from batchrun.prompt.sandboxes.local import limits as _limits

    proc = subprocess.Popen(["sleep", "30"])
    try:
        monkeypatch.setattr(_limits, "_user_processes", lambda: 7)
        monkeypatch.setattr(_limits.os, "geteuid", lambda: 1000)  # the non-root branch, as root
        _limits.apply_rlimits(proc.pid, _limits.Limits(cpus=1.0, memory_mb=300, pids_limit=40, disk_mb=16))
        monkeypatch.undo()
        limits = {
            line[:26].strip(): line[26:].split()[:2]
            for line in Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
        }
        assert limits["Max address space"] == [str(300 << 20)] * 2
        assert limits["Max processes"] == ["47", "47"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.bwrap
@pytest.mark.parametrize("lines", [1, 3, 400], ids=["short", "multi-line", "long"])
def test_a_command_reaches_bash_byte_for_byte_whatever_its_length(boxes, lines: int):
    """The command server (sh) reads short commands with `read` and long ones (> 1 KB) with `cat`:
    either way bash gets exactly the text, trailing newlines, backslashes, a final "." and a
    here-document included, up to a NUL, as bash's own `read -d ''` took it before."""
    box = boxes(0)
    body = "".join(f"printf '%s\\n' 'line {i} \\\\ end.'\n" for i in range(lines))
    # Its last line prints the length of the text bash got: the two trailing newlines count.
    command = body + "cat <<'EOF'\nx\\ty $HOME.\nEOF\n" + 'printf "last. %s" "${#BASH_EXECUTION_STRING}"\n\n'
    assert (len(command) > 1024) == (lines == 400)
    expected = "".join(f"line {i} \\\\ end.\n" for i in range(lines)) + f"x\\ty $HOME.\nlast. {len(command)}"
    assert box.run(command, timeout_s=30).output == expected
    assert box.run("echo before\0echo after", timeout_s=10).output == "before\n"


@pytest.mark.bwrap
def test_a_command_killed_at_its_deadline_leaves_no_shell_note(boxes):
    """The shell's "Killed" note for a command killed at its deadline is not in the output."""
    box = boxes(0)
    result = box.run("echo partial; sleep 30", timeout_s=1)
    assert result.timed_out and result.output == "partial\n"
    assert box.run("echo next", timeout_s=10).output == "next\n"


@pytest.mark.parametrize("version", [1, 2])
def test_the_run_bounds_take_the_strictest_limit_along_the_runner_s_cgroup_path(
    tmp_path, monkeypatch, version
):
    """A limited slice or pod above the runner's own, unlimited, cgroup binds its prompts too: before, only
    the runner's own cgroup was read, so the run's parent allowed three quarters of the machine's memory
    inside a 2 GiB slice (and the OOM killer could pick the runner, the case the bound is for)."""
    from batchrun.prompt.sandboxes.local import limits

    memory_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
    unlimited = "9223372036854771712" if version == 1 else "max"
    slice_dir = tmp_path / "slice"
    own = slice_dir / "runner"
    own.mkdir(parents=True)
    (slice_dir / memory_file).write_text(str(2 << 30))
    (slice_dir / "pids.max").write_text("4096")
    (own / memory_file).write_text(unlimited)
    (own / "pids.max").write_text("max")
    from batchrun.prompt.sandboxes import base

    def own_dir(controller: str) -> tuple[str, int]:
        return str(own), version

    monkeypatch.setattr(base, "own_cgroup_dir", own_dir)  # the runner's own cgroup, as the kernel shows it
    limits.run_bounds.cache_clear()
    try:
        bounds = limits.run_bounds()
    finally:
        limits.run_bounds.cache_clear()
    assert bounds.memory_bytes == 1 << 30  # 2 GiB less the 1 GiB kept for the host
    assert bounds.pids == 4096 - 2048


@pytest.mark.bwrap
def test_the_oom_killer_picks_a_sandbox_before_the_runner(boxes):
    """Memory pressure no cgroup bounds (the rlimit fallback, tmpfs files, a machine full for other
    reasons) had the kernel's OOM killer pick by size alone: the runner's worker as likely as the
    prompt's hog. A sandbox's commands now carry the highest score; with CAP_SYS_RESOURCE (root on
    most machines, not in every container) it is also their floor, which they cannot lower."""
    from batchrun.prompt.sandboxes.local.process_tree import _can_set_oom_floor

    box = boxes(network=False)
    assert box.run("cat /proc/self/oom_score_adj", timeout_s=10).output.strip() == "1000"
    assert box.run("sh -c 'cat /proc/self/oom_score_adj'", timeout_s=10).output.strip() == "1000"
    with open("/proc/self/oom_score_adj") as f:
        assert int(f.read()) < 1000  # the runner's own is left as it was
    lowered = box.run("echo 0 > /proc/self/oom_score_adj; cat /proc/self/oom_score_adj", timeout_s=10).output
    if _can_set_oom_floor():  # else a command may go back to 0, the host's default, and no lower
        assert lowered.strip().endswith("1000"), lowered


# ---------------------------------------------------------------------------- what a command reports


@pytest.mark.bwrap
def test_a_command_cannot_forge_its_exit_code_from_the_command_servers_memory(boxes):
    """The command server (PID 1) holds the end marker's token; it runs from a copy of its shell that
    no one in the sandbox may read, which makes it non-dumpable: no command may read its memory or
    reopen its descriptors (/proc/1/mem, /proc/1/fd), so none can print the marker itself."""
    box = boxes()
    for _ in range(2):  # the sh server, then the bash one it becomes once the process tool is used
        res = box.run(f"{PY} -c {shlex.quote(FORGE_FROM_MEMORY)}", timeout_s=60)
        assert (res.exit_code, res.timed_out) == (3, False), res
        assert "read the memory of" in res.output and "'1'" not in res.output.split("read the memory of")[-1]
        assert box.run("cat /proc/1/fd/0 </dev/null; echo $?", timeout_s=30).output.strip().endswith("1")
        box.run("mkdir -p ${TMPDIR:-/tmp}/.batch-runner-processes", timeout_s=30)


WITHOUT_PTRACE = r"""
import sys, tempfile
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox
from batchrun.prompt.sandboxes.local.system_view import user_namespace_args
box = LocalSandbox(SandboxSpec("noptrace", 0, network=True), isolation="bwrap", base_dir=tempfile.mkdtemp())
box.start()
try:
    ok = box.write_direct(box.workdir + "/f.txt", b"direct", make_parents=False)
    own = box._own_shells == bool(user_namespace_args())
    print(own, ok, box.run("cat f.txt; echo; echo done", timeout_s=30).output.split())
finally:
    box.stop()
"""


def _without_ptrace(script: str, *args: str) -> subprocess.CompletedProcess:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run without CAP_SYS_PTRACE")
    return subprocess.run(
        [setpriv, "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", sys.executable, "-c", script, *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip


@pytest.mark.bwrap
def test_a_root_runner_without_cap_sys_ptrace_still_reaches_its_server(bwrap_available):
    """Root without CAP_SYS_PTRACE (a container's default) cannot reach a non-dumpable server in its
    own user namespace (its /proc/<pid>/root, its namespaces): the sandbox gets a user namespace of
    its own, whose owner may, and the server runs from the execute-only shells; where bwrap cannot
    make one, from the system's shells. Either way it works, files and network included."""
    done = _without_ptrace(WITHOUT_PTRACE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "['direct',", "'done']"], done.stdout


# The agent's last command takes the command server over in each way a command of the server's own
# user and capabilities could: a request line written into its stdin pipe that names a command file
# of the agent's (a loop that reads the requests after it and answers each with exit code 0), the
# path of the shell it runs commands with rewritten in its memory (/proc/1/mem), ptrace.
TAKE_OVER_POKE = r"""
import re
maps = open("/proc/1/maps").read().splitlines()
with open("/proc/1/mem", "r+b", buffering=0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if "rw" in perms:
            mem.seek(lo)
            for m in re.finditer(rb"sh=/[^\0]{6,}\0", mem.read(hi - lo)):
                mem.seek(lo + m.start())
                mem.write(b"sh=/tmp/e\0")
"""
TAKE_OVER_LOOP = r"""while IFS=' ' read -r seq tok rest; do printf '\n[batch-runner-exit:%s]=0\n' "$tok"; done < /proc/1/fd/0"""
TAKE_OVER = r"""
import json, shlex, sys, tempfile
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox
from batchrun.scoring import judged_run, write_verify_files
py, forge, poke, loop = sys.argv[1:5]
attach = "import ctypes; ctypes.CDLL(None).ptrace(16, 1, 0, 0) == 0 and print('attached')"
agent = (
    f"printf '%s\n' {shlex.quote(loop)} > /tmp/evil.cmd; printf '#!/bin/sh\nexit 0\n' > /tmp/e; chmod +x /tmp/e; "
    f"printf '../tmp/evil 0 0 1\n' > /proc/1/fd/0; {py} -c {shlex.quote(poke)}; {py} -c {shlex.quote(attach)}; exit 0"
)
box = LocalSandbox(SandboxSpec("takeover", 0, network=False), isolation="bwrap", base_dir=tempfile.mkdtemp())
box.start()
try:
    took = box.run(agent, timeout_s=60)
    ended = box.end_processes(30)
    write_verify_files(box, [("/tmp/check.sh", "echo checked; exit 1\n")], 30)
    verify = judged_run(box)("sh /tmp/check.sh", timeout_s=30)
    forged = judged_run(box)(f"{py} -c {shlex.quote(forge)}", timeout_s=60)
    print(json.dumps({"agent": took.output, "ended": ended, "verify": [verify.exit_code, verify.output],
                      "forged": forged.exit_code}))
finally:
    box.stop()
"""


@pytest.mark.bwrap
@pytest.mark.slow  # ~1 min: two sandboxes started without br-launch, one attack each
def test_a_root_runner_without_cap_sys_ptrace_keeps_its_server_out_of_the_commands_reach(bwrap_available):
    """Without CAP_SYS_PTRACE the server ran from readable shells in the runner's user namespace: the
    agent's command reopened its stdin pipe (/proc/1/fd/0) with a request of its own, and end_processes,
    the hidden file's write and the failing verify then all answered exit 0 without running (writing
    the server's memory or ptracing it did as much). In a user namespace of its own it is out of reach."""
    userns = _without_ptrace("import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)",
                             "bwrap", "--unshare-user", "--uid", "0", "--gid", "0", "--ro-bind", "/", "/", "true")  # fmt: skip
    if userns.returncode != 0:
        pytest.skip(f"bwrap cannot make a user namespace here: {userns.stderr.strip()[-200:]}")
    done = _without_ptrace(TAKE_OVER, PY, FORGE_FROM_MEMORY, TAKE_OVER_POKE, TAKE_OVER_LOOP)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "attached" not in seen["agent"], seen
    assert seen["ended"] is None, seen
    assert seen["verify"] == [1, "checked\n"], seen
    assert seen["forged"] == 3, seen


@pytest.mark.bwrap
def test_the_start_warns_when_the_command_server_is_in_its_commands_reach(
    bwrap_available, monkeypatch, capsys
):
    """Where the runner cannot reach a non-dumpable server (root without CAP_SYS_PTRACE and no user
    namespace, a setuid bubblewrap), any command could take the server over: the start says so."""
    from batchrun.prompt.sandboxes.local import sandbox as local_sandbox

    LocalSandbox.preflight([], {"isolation": "bwrap"}, real_model=False, network=False)
    assert "command server is in its commands' reach" not in capsys.readouterr().out
    monkeypatch.setattr(local_sandbox, "can_reach_non_dumpable", lambda: False)
    LocalSandbox.preflight([], {"isolation": "bwrap"}, real_model=False, network=False)
    said = capsys.readouterr().out
    assert "warning: the local sandbox's command server is in its commands' reach" in said, said
    assert "do not train on this run's scores" in said


def test_etc_views_no_process_holds_go_once_unused_and_held_ones_stay(tmp_path: Path, monkeypatch):
    """Each change of /etc made a new machine-wide view (a 3 MB copy in /dev/shm: hard links cannot
    cross into tmpfs), and a view stayed two days whether or not any run used it: 122 views, 351 MB of
    memory here. A view no process holds and none asked for in VIEW_KEEP_S goes now; one a worker holds
    stays however old, and so does one of an earlier version (no lock file) for the two days it had."""
    import subprocess
    import sys
    import time

    from batchrun.prompt.sandboxes.local import system_view as local

    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(local, "_held_views", {}, raising=False)
    cache = Path(local.private_cache_dir())
    hour, days = 3600.0, 3 * 86400.0  # past VIEW_KEEP_S; past the two days of a view without a lock
    old = time.time() - hour

    def view(name: str, lock: bool, age_s: float) -> Path:
        path = cache / name
        (path / "ssl").mkdir(parents=True)
        (path / "hosts").write_text("127.0.0.1 localhost\n")
        if lock:
            Path(f"{path}.lock").touch()
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return path

    unused = view("etc-unused", lock=True, age_s=hour)
    held = view("etc-held", lock=True, age_s=hour)
    legacy = view("etc-legacy", lock=False, age_s=hour)
    legacy_old = view("etc-legacy-old", lock=False, age_s=days)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(120)", f"{held}.lock"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        current = local.shared_etc_view()
        assert current is not None and Path(current).parent == cache and os.path.isdir(current)
        assert old < Path(current).stat().st_mtime
        assert not unused.exists() and not Path(f"{unused}.lock").exists()
        assert held.is_dir() and legacy.is_dir()
        assert not legacy_old.exists()
        # This process holds the view it uses: another's prune leaves it, however long it runs.
        os.utime(current, (old, old))
        local._prune_views(str(cache), keep=str(held))
        assert os.path.isdir(current) and not os.path.exists(os.path.join(current, ".lock"))
    finally:
        holder.kill()
        holder.wait()
    local._prune_views(str(cache), keep=str(current))  # its holder gone: the old view goes
    assert not held.exists() and not Path(f"{held}.lock").exists()
