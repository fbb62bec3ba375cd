"""The command server inside a Docker sandbox's container (``_container_server``), on the real engine.

What the shared contract does not cover: bytes that are special to the protocol (quotes, percent,
backslash, NUL, a leading dash) in commands and stdin, big output and big stdin, exit codes, a
command's leftovers, a command killed with the server, a runner killed in the middle of a command,
and that commands cost no ``docker exec`` and write nothing to the engine's logs.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from helpers import docker_ps, wait_until

from batchrun.prompt.sandboxes.base import SandboxError, SandboxSpec

pytestmark = pytest.mark.docker

RUN = f"server-{uuid.uuid4().hex[:8]}"  # unique: other test sessions may share this Docker engine
CAP = 64 * 1024


@pytest.fixture
def box(docker_test_image: str):
    """A started DockerSandbox (256 MiB, no network), stopped at teardown."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    sandbox = DockerSandbox(
        SandboxSpec(RUN, random.randint(0, 10**6), network=False),
        default_image=docker_test_image,
        memory_mb=256,
        output_cap_bytes=CAP,
    )
    sandbox.start()
    yield sandbox
    sandbox.stop()


def test_special_bytes_in_commands_and_stdin_arrive_unchanged(box):
    tricky = 'it\'s 100% \\n "quoted" `tick` $HOME -dash\ttab\r\nnew line é'
    res = box.run(f"printf '%s' {_sh_word(tricky)}", timeout_s=30)
    assert (res.output, res.exit_code) == (tricky, 0)
    for data in (b"-n starts with a dash", b"%s %d %% \\c \\0 \\\\ '", bytes(range(256)) * 3, b"a\0b\0\0"):
        res = box.run("od -An -v -tx1 | tr -d ' \\n'", timeout_s=30, stdin=data)
        assert res.output == data.hex(), data
    assert box.run("wc -c", timeout_s=30, stdin=b"").output.strip() == "0"  # empty stdin, not none


def test_big_stdin_and_big_output(box):
    blob = random.Random(7).randbytes(4 * 2**20)
    res = box.run("md5sum", timeout_s=120, stdin=blob)
    assert res.output.split()[0] == hashlib.md5(blob).hexdigest()
    res = box.run("head -c 20000000 /dev/zero | tr '\\0' y; echo; echo end", timeout_s=120)
    assert res.truncated and res.exit_code == 0 and res.output.startswith("y" * (CAP - CAP // 4) + "\n[")
    # The end is kept (from a line's start): "end", and what was cut between.
    assert res.output.endswith(
        f"[output truncated: {20_000_001 - CAP + CAP // 4} of 20000005 bytes not shown]\nend\n"
    )
    # Nothing of that output spills into the next command.
    assert box.run("echo next", timeout_s=30).output == "next\n"


def test_exit_codes(box):
    assert box.run("exit 7", timeout_s=30).exit_code == 7
    assert box.run("kill -9 $$", timeout_s=30).exit_code == 128 + 9  # killed by a signal
    assert box.run("no-such-command-br", timeout_s=30).exit_code == 127
    assert box.run("true", timeout_s=30).exit_code == 0


def test_nul_in_a_command_is_an_observation_and_the_sandbox_goes_on(box):
    res = box.run("echo a\0b", timeout_s=30)
    assert res.exit_code != 0 and "NUL" in res.output
    assert box.run("echo fine", timeout_s=30).output == "fine\n"


def test_leftovers_of_a_command_are_ended_and_never_write_into_the_next(box):
    tag = random.randint(10_000, 99_999)
    res = box.run(f"(sleep 1; echo late-{tag}) & sleep {tag} & echo now", timeout_s=30)
    assert res.output == "now\n"
    time.sleep(1.5)
    res = box.run("ps", timeout_s=30)
    assert f"sleep {tag}" not in res.output and f"late-{tag}" not in res.output


def test_processes_ending_during_the_sweep_leave_nothing_in_the_output(box):
    """The sweep reads each leftover's environment; one that ended after its stat was read fails the
    read, and the shell's note of that ("can't open /proc/N/environ") went into the command's output
    (a flake of the test above, and text the command never wrote in a kept sample)."""
    for _ in range(3):
        res = box.run(
            "i=0; while [ $i -lt 150 ]; do sleep 0.0$((i % 10)) & i=$((i + 1)); done; echo now", timeout_s=60
        )
        assert res.output == "now\n"


def test_timeout_kills_a_command_that_ignores_signals_and_its_children(box):
    tag = random.randint(10_000, 99_999)
    res = box.run(f"trap '' TERM INT HUP; echo begun; sleep {tag} & sleep {tag + 1}", timeout_s=1)
    assert res.timed_out and res.exit_code == -1 and res.output == "begun\n"
    listing = box.run("ps", timeout_s=30).output
    assert f"sleep {tag}" not in listing and f"sleep {tag + 1}" not in listing


def test_server_killed_during_a_command_fails_the_sandbox_without_hanging(box):
    box.run("echo first", timeout_s=30)  # a command ran: the container is not replaced silently
    with pytest.raises(SandboxError, match="ended during a command"):
        box.run("echo going; kill -9 $PPID; sleep 600", timeout_s=300)  # $PPID: the server shell
    with pytest.raises(SandboxError, match="gone"):
        box.run("echo again", timeout_s=30)


@pytest.mark.parametrize("ending", ["kill -9 -1", "kill -9 $PPID"])
def test_a_first_command_that_ends_its_container_runs_once(docker_test_image: str, ending: str):
    """A container that ends during its first command is not replaced and the command sent again:
    it had run (a side effect seen by the host, here a connection). Before, the sandbox took it for a
    start the engine botched ("ended before its first command"), started a new container and ran the
    command twice; only a command the server never acknowledged is sent to a fresh container."""
    import socket

    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    listener = socket.create_server(("127.0.0.1", 0))
    hits: list[bytes] = []

    def count() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            hits.append(conn.recv(100))
            conn.close()

    threading.Thread(target=count, daemon=True).start()
    port = listener.getsockname()[1]
    # The host's network, so that the command reaches the listener above (the hub would not let it).
    box = DockerSandbox(SandboxSpec(RUN, 3), default_image=docker_test_image, network_mode="host")
    box.start()
    try:
        first = box.container_id
        with pytest.raises(SandboxError, match="ended during a command"):
            box.run(f"echo hit | nc 127.0.0.1 {port}; {ending}; sleep 5", timeout_s=60)
        time.sleep(0.5)  # a second run's connection, if any, has arrived
        assert len(hits) == 1 and box.container_id == first
        with pytest.raises(SandboxError, match="gone"):
            box.run("echo again", timeout_s=30)
    finally:
        box.stop()
        listener.close()
    assert docker_ps(f"batch_runner.run_name={RUN}", "batch_runner.prompt_index=3") == []


# SIGSTOP to the cat that relays the runner's stream to the server (its argv is "cat" alone).
STOP_THE_CAT = """for p in /proc/[0-9]*; do
    [ "$(tr '\\0' ' ' < "$p/cmdline" 2>/dev/null)" = 'cat ' ] && kill -STOP "${p#/proc/}" && echo stopped
done"""


def test_a_stopped_cat_holds_neither_a_command_nor_the_stop(docker_test_image: str):
    """A command that stops the server's cat: the container no longer sees the end of its stream. Each
    stop waited 10 s for it to end by itself, and the next command its timeout and 10 s more for a
    report the server, which never got the command, could not send."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    box = DockerSandbox(SandboxSpec(RUN, 4, network=False), default_image=docker_test_image)
    box.start()
    try:
        assert box.run(STOP_THE_CAT, timeout_s=30).output == "stopped\n"
        t0 = time.monotonic()
        res = box.run("echo never", timeout_s=2)
        assert res.timed_out and time.monotonic() - t0 < 4
        with pytest.raises(SandboxError, match="did not take a command"):
            box.run("echo again", timeout_s=30)
    finally:
        t0 = time.monotonic()
        box.stop()
        took = time.monotonic() - t0
    assert took < 4, f"{took:.1f} s"
    assert docker_ps(f"batch_runner.run_name={RUN}", "batch_runner.prompt_index=4") == []


def test_commands_cost_no_exec_and_write_no_log(box):
    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    client = docker_client()
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    for i in range(5):
        assert box.run(f"echo {i}", timeout_s=30, stdin=b"x" if i % 2 else None).output == f"{i}\n"
    box.run_exec("echo through-exec", timeout_s=30)  # one exec, so that the count below can see it
    until = datetime.now(timezone.utc) + timedelta(seconds=1)
    events = client.api.events(
        since=since, until=until, decode=True, filters={"container": box.container_id, "event": "exec_create"}
    )
    assert len(list(events)) == 1
    attrs = client.api.inspect_container(box.container_id)
    assert attrs["HostConfig"]["LogConfig"]["Type"] == "none"


# A process that starts a sandbox, runs a long command in it and is SIGKILLed in the middle of it.
HOLDER = """
import sys, threading
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox
box = DockerSandbox(SandboxSpec(sys.argv[1], 1), default_image=sys.argv[2])
box.start()
print(box.container_id, flush=True)
if sys.argv[3] == "judging":  # the container's processes stopped, for a verify that takes an hour
    box.run("sleep 2000 &", timeout_s=60)
    assert box.end_processes(60) is None
    box.run_judged("sleep 3000", timeout_s=3600)
if sys.argv[3] == "freezing":  # killed after its processes were stopped, before anything holds them
    import os
    box.run("sleep 2000 &", timeout_s=60)
    DockerSandbox._hold_stopped = lambda self, spared: os.kill(os.getpid(), 9)
    box.end_processes(60)
box.run("sleep 3000", timeout_s=3600)
"""


@pytest.mark.parametrize("during", ["command", "judging", "freezing"])
def test_container_ends_when_its_runner_dies_in_the_middle_of_a_command(docker_test_image: str, during: str):
    """Also while a sample is judged, when every process but the judge's is stopped (end_processes),
    and while they are being stopped, before an exec holds them (its end would continue them)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, RUN, docker_test_image, during], stdout=subprocess.PIPE, text=True
    )
    container_id = ""
    try:
        container_id = proc.stdout.readline().strip()
        assert container_id
        if during == "freezing":
            proc.wait(timeout=120)  # it killed itself, its container's processes stopped
        else:
            assert wait_until(lambda: "sleep 3000" in _top(container_id), timeout_s=60)
            proc.kill()  # SIGKILL: no finally, no stop(); the command has an hour to go
            proc.wait()
        assert wait_until(lambda: not _exists(container_id), timeout_s=60)  # ended and removed itself
        assert docker_ps(f"batch_runner.run_name={RUN}", "batch_runner.prompt_index=1") == []
    finally:
        if proc.poll() is None:
            proc.kill()
        if container_id:
            subprocess.run(["docker", "rm", "-f", container_id], capture_output=True)


def _sh_word(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _top(container_id: str) -> str:
    return subprocess.run(["docker", "top", container_id], capture_output=True, text=True).stdout


def _exists(container_id: str) -> bool:
    done = subprocess.run(["docker", "inspect", container_id], capture_output=True, text=True)
    return done.returncode == 0


def test_without_docker_init_the_server_works_and_the_lifetime_still_ends_the_container(
    docker_test_image: str,
):
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    box = DockerSandbox(
        SandboxSpec(RUN, 2, network=False), default_image=docker_test_image, init=False, lifetime_s=3.0
    )
    box.start()
    try:
        assert box.run("echo $$; sleep 1000 & echo started", timeout_s=30).output.splitlines()[1] == "started"
        assert box.run("cat /proc/1/comm", timeout_s=30).output == "sh\n"  # the boot shell is PID 1
        assert wait_until(lambda: not _exists(box.container_id), timeout_s=60)
    finally:
        box.stop()


@pytest.mark.parametrize("init", [True, False])
def test_the_lifetime_sleep_runs_before_the_server_lists_the_base_processes(
    docker_test_image: str, init: bool
):
    """The sleep that bounds the container's life is the boot shell's own child, forked before the
    server: the server's list of the processes the runner spares has it. A subshell's sleep,
    ``(sleep; kill) &``, was forked whenever that subshell ran: on a busy machine after the list was
    made (3 of 100 starts with 0.01 CPU), and end_processes killed it as the agent's; the subshell then
    killed the boot shell, and the sample failed as a sandbox error, "container ... is gone: 409"."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    box = DockerSandbox(SandboxSpec(RUN, 3, network=False), default_image=docker_test_image, init=init)
    box.start()
    try:
        # pid, parent pid and name of every process
        listing = r'for f in /proc/[0-9]*/stat; do read -r l < $f; p=${f#/proc/}; set -- ${l##*) }; echo "${p%/stat} $2 ${l#*(}"; done'
        out = box.run_exec(listing, timeout_s=30).output
        procs = {int(pid): (int(ppid), name) for pid, ppid, name, *_ in map(str.split, out.splitlines())}

        def of_the_exec(pid: int) -> bool:  # its first process's parent is outside the namespace (0)
            while pid != 1 and pid in procs:
                pid = procs[pid][0]
                if pid == 0:
                    return True
            return False

        parent = {pid: ppid for pid, (ppid, _) in procs.items() if not of_the_exec(pid)}
        boot = next(pid for pid, ppid in parent.items() if ppid == 1) if init else 1
        sleeps = [pid for pid, (_, name) in procs.items() if name == "sleep)"]
        assert [parent[pid] for pid in sleeps] == [boot], out
        assert sorted(parent) == sorted(box._base_pids), (out, box._base_pids)
    finally:
        box.stop()


def test_the_containers_of_a_run_together_never_take_the_hosts_memory_or_processes(
    docker_test_image: str, monkeypatch
):
    """Each container may hold 512 MiB and 512 processes; the run's containers together hold at most what
    the machine can spare (docker_run_share, here made small) through one --cgroup-parent. Before, a few
    hundred containers could fill the machine's memory or its pid_max (32,768 here: 64 fork bombs)."""
    from helpers import skip_or_fail

    from batchrun.prompt.sandboxes.docker import engine
    from batchrun.prompt.sandboxes.docker import sandbox as docker_sandbox
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    problem = engine.run_cgroup_problem(engine.docker_client().info())
    if problem:
        skip_or_fail(f"no run cgroup for Docker here: {problem}")
    monkeypatch.setattr(docker_sandbox, "docker_run_share", lambda info: (160 << 20, 80))
    wanted = {"default_image": docker_test_image, "memory_mb": 512, "pids_limit": 512}
    options = DockerSandbox.prepare_run(RUN, wanted, workers_here=True)
    name = options["cgroup_parent"].lstrip("/")
    boxes = [DockerSandbox(SandboxSpec(RUN, i, network=False), **options) for i in range(2)]
    try:
        for box in boxes:
            box.start()
        for path, _ in engine._run_cgroup_dirs(name):
            assert {e.name for e in os.scandir(path) if e.is_dir()} >= {b.container_id for b in boxes}
        # Processes: the first holds 50 while the second tries 50 more (80 for both).
        hold = "for i in $(seq 50); do sleep 6 & done; sleep 3; echo held $(ls -d /proc/[0-9]* | wc -l)"
        results: list = []
        holding = threading.Thread(target=lambda: results.append(boxes[0].run(hold, timeout_s=60)))
        holding.start()
        time.sleep(1.5)
        crowded = boxes[1].run(
            "for i in $(seq 50); do sleep 1 & done 2>&1 | tail -1; echo done", timeout_s=60
        )
        holding.join()
        assert "held" in results[0].output, results[0].output
        assert "can't fork" in crowded.output or "Resource temporarily unavailable" in crowded.output, (
            crowded.output
        )
        # Memory: 100 MiB each is under each container's 512, but 200 together is past the run's 160.
        grow = "dd if=/dev/zero of=/dev/null bs=100M count=300 2>&1 | tail -1"
        runs: list = []
        threads = [
            threading.Thread(target=lambda b=b: runs.append(b.run(grow, timeout_s=120))) for b in boxes
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        finished = [r for r in runs if "300+0 records out" in r.output]
        assert len(finished) <= 1, [r.output for r in runs]
    finally:
        for box in boxes:
            box.stop()
        DockerSandbox.sweep(options)
    # Gone from every hierarchy: the engine makes it in cpu, blkio, freezer... too (v1).
    assert all(not os.path.exists(os.path.join(h, name)) for h in engine._hierarchies())


@pytest.fixture
def trusted_box(docker_test_image: str):
    """A started DockerSandbox with the runner's own busybox and docker-init mounted, as a run's
    prepare_run makes it (trusted_tools); fails where this machine has neither (CI installs both)."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox, docker_client, trusted_tools

    tools, said = trusted_tools(docker_client().info())
    assert tools.get("trusted_busybox") and tools.get("trusted_init"), said
    sandbox = DockerSandbox(
        SandboxSpec(RUN, random.randint(0, 10**6), network=False),
        default_image=docker_test_image, memory_mb=256, output_cap_bytes=CAP, **tools,
    )  # fmt: skip
    sandbox.start()
    yield sandbox
    sandbox.stop()


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_root_in_the_container_can_neither_remove_rename_write_nor_mount_over_the_runners_tools(trusted_box):
    from batchrun.prompt.sandboxes.docker.container_server import TRUSTED_BUSYBOX, TRUSTED_INIT

    attempts = []
    for path in (TRUSTED_BUSYBOX, TRUSTED_INIT):
        attempts += [f"rm -f {path}", f"mv {path} /moved", f"echo x > {path}", f"chmod 0 {path}",
                     f"umount {path}", f"umount -l {path}", f"mount --bind /bin/busybox {path}",
                     f"mount -t tmpfs none {path}"]  # fmt: skip
    attempts += ["mount -t tmpfs none /", "mv / /x", "ln -sf /bin/true /busybox.batch-runner"]
    script = "; ".join(f"if {{ {a}; }} 2>/dev/null; then echo 'took: {a}'; fi" for a in attempts)
    res = trusted_box.run(script, timeout_s=60)
    assert (res.exit_code, res.output) == (0, ""), res
    opts = trusted_box.options
    res = trusted_box.run_trusted(f"sha256sum {TRUSTED_BUSYBOX} {TRUSTED_INIT}", timeout_s=60)
    sums = [line.split()[0] for line in res.output.splitlines()]
    assert sums == [_sha256(opts.trusted_busybox), _sha256(opts.trusted_init)], res


# The image's tools that the runner's own judging steps ran by PATH, each made a script that exits 0.
# What is left of the agent's `sleep 1000` and of a timed-out judged `sleep 999`.
LEFT_SLEEPS = (
    """ps -o args | while read -r a; do case $a in "sleep 1000"* | "sleep 999"*) echo "$a" ;; esac; done"""
)
RUNNERS_TOOLS = ("cat", "rm", "mkdir", "dirname", "tr", "grep", "kill", "mknod", "ln")


def test_judging_steps_run_the_runners_busybox_and_the_verify_the_images_sh(trusted_box):
    """The image's cat, rm, mkdir, ... and /sbin/docker-init replaced by fakes that exit 0, a process
    left behind: end_processes still ends it, the hidden file is still written, a timed-out judged
    command is still killed; the verify runs in the image's own /bin/sh, under the runner's docker-init."""
    from batchrun.scoring import write_verify_files

    fakes = "; ".join(f"rm /bin/{t} && printf '#!/bin/busybox sh\\nexit 0\\n' > /bin/{t} && busybox chmod +x /bin/{t}"
                      for t in RUNNERS_TOOLS)  # fmt: skip
    fake_init = "busybox rm /sbin && busybox mkdir /sbin && printf '#!/bin/busybox sh\\nexit 0\\n' > /sbin/docker-init"
    res = trusted_box.run(
        f"{fakes}; {fake_init} && chmod +x /sbin/docker-init; sleep 1000 & echo left", timeout_s=60
    )
    assert res.output == "left\n", res
    assert trusted_box.end_processes(60) is None
    write_verify_files(trusted_box, [("tests/t.txt", "hidden\n")], 60)
    res = trusted_box.run_judged(
        'read -r l < tests/t.txt; echo "$l $(readlink /proc/$$/exe)"; busybox tr "\\0" " " < /proc/$PPID/cmdline',
        timeout_s=60,
    )
    said, parent = res.output.split("\n", 1)
    assert (res.exit_code, said) == (0, "hidden /bin/busybox"), res  # the image's sh, not the runner's
    assert parent.startswith("/busybox.batch-runner sh -c "), res
    res = trusted_box.run_judged(LEFT_SLEEPS, timeout_s=60)
    assert (res.exit_code, res.output) == (0, ""), res  # the agent's sleep 1000 ended
    res = trusted_box.run_judged("sleep 999", timeout_s=1)
    assert res.timed_out, res
    res = trusted_box.run_judged(LEFT_SLEEPS, timeout_s=60)
    assert (res.exit_code, res.output) == (0, ""), res
