"""What each sandbox backend does beyond the shared contract: Docker labels, limits, disk cap,
preflight, containers that end themselves, sweep, host services through the bridge, overhead;
bubblewrap holding the host read-only; the exact CLI and SDK calls of the fakes; options."""

from __future__ import annotations

import contextlib
import hashlib
import io
import ipaddress
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import ROOT, docker_ps, skip_or_fail, wait_until

from batchrun.prompt.sandboxes import BACKENDS, create_sandbox
from batchrun.prompt.sandboxes.base import SandboxError, SandboxSpec
from batchrun.prompt.sandboxes.conformance import FORGE_EXIT_0

RUN = f"backends-{uuid.uuid4().hex[:8]}"  # unique: other test sessions may share this Docker engine


# ============================================================================ Docker
@pytest.fixture
def docker_box(docker_test_image: str):
    """``docker_box(**spec_fields, **options)``: started DockerSandboxes, all stopped at teardown."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    made = []

    def factory(index: int = 0, options: dict | None = None, **spec_fields) -> DockerSandbox:
        box = DockerSandbox(
            SandboxSpec(RUN, index, **spec_fields), default_image=docker_test_image, **(options or {})
        )
        made.append(box)
        box.start()
        return box

    yield factory
    for box in made:
        box.stop()


@pytest.mark.docker
def test_docker_container_has_labels_and_limits_and_is_gone_after_stop(docker_box):
    from batchrun.prompt.sandboxes.docker.sandbox import default_owner, docker_client

    box = docker_box(index=7, network=False, options={"cpus": 0.5, "memory_mb": 300, "pids_limit": 64})
    assert docker_ps(f"batch_runner.run_name={RUN}") != []
    attrs = docker_client().api.inspect_container(box.container_id)
    labels = attrs["Config"]["Labels"]
    assert (labels["batch_runner.run_name"], labels["batch_runner.prompt_index"]) == (RUN, "7")
    assert labels["batch_runner.owner"] == default_owner()
    host = attrs["HostConfig"]
    assert (host["NanoCpus"], host["Memory"], host["PidsLimit"]) == (500_000_000, 300 * 2**20, 64)
    assert host["NetworkMode"] == "none"
    assert host["OomScoreAdj"] == 1000  # the OOM killer's first pick, before the runner
    assert box.run("cat /proc/self/oom_score_adj", timeout_s=10).output.strip() == "1000"
    box.stop()
    assert docker_ps(f"batch_runner.run_name={RUN}") == []


@pytest.mark.docker
def test_docker_failed_start_leaves_no_container(docker_test_image: str):
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    box = DockerSandbox(SandboxSpec(RUN, 0, image="does-not-exist-br:never"), default_image=docker_test_image)
    with pytest.raises(SandboxError, match="does-not-exist-br:never"):
        box.start()
    box.stop()
    assert docker_ps(f"batch_runner.run_name={RUN}") == []


@pytest.mark.docker
def test_docker_start_that_keeps_failing_gives_up_and_leaves_no_container(docker_test_image: str):
    from batchrun.prompt.sandboxes.docker.sandbox import START_ATTEMPTS, DockerSandbox

    index = 31
    box = DockerSandbox(
        SandboxSpec(RUN, index), default_image=docker_test_image, network_mode="no-such-network"
    )
    with pytest.raises(SandboxError, match=f"did not start \\({START_ATTEMPTS} attempts\\)"):
        box.start()
    box.stop()
    assert docker_ps(f"batch_runner.run_name={RUN}", f"batch_runner.prompt_index={index}") == []


@pytest.mark.docker
def test_docker_start_failing_once_is_tried_again(docker_test_image: str, monkeypatch: pytest.MonkeyPatch):
    """The engine's error is faked at docker-py's Container.start (the narrowest seam); the retry is real."""
    from docker.errors import APIError
    from docker.models.containers import Container

    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    real_start, failed = Container.start, []

    def flaky_start(self, **kwargs):
        if not failed:
            failed.append(self.id)
            raise APIError("error reopening /dev/null inside container: no such file or directory")
        return real_start(self, **kwargs)

    monkeypatch.setattr(Container, "start", flaky_start)
    box = DockerSandbox(SandboxSpec(RUN, 32), default_image=docker_test_image)
    box.start()
    try:
        assert box.run("echo up", timeout_s=30).output == "up\n"
        assert failed and failed[0] != box.container_id  # the failed container was replaced ...
        names = docker_ps(f"batch_runner.run_name={RUN}", "batch_runner.prompt_index=32")
        assert len(names) == 1  # ... and removed
    finally:
        box.stop()


@pytest.mark.docker
def test_docker_container_dead_before_its_first_command_is_replaced(docker_box):
    box = docker_box(index=33)
    first = box.container_id
    subprocess.run(["docker", "kill", first], capture_output=True, check=True)
    res = box.run("echo alive", timeout_s=30)
    assert (res.output, res.exit_code) == ("alive\n", 0) and box.container_id != first
    subprocess.run(["docker", "kill", box.container_id], capture_output=True, check=True)
    with pytest.raises(SandboxError):  # after a command ran, a dead container fails the prompt
        box.run("echo again", timeout_s=30)


@pytest.mark.docker
@pytest.mark.parametrize("path", ["server", "exec"])
def test_docker_a_command_cannot_forge_its_exit_code(docker_box, path):
    box = docker_box(index=34)
    run = box.run if path == "server" else box.run_exec
    # It tries every token in any process's command line or environment (the exec path's wrapper
    # had the marker in its argv; both had the token in the command's environment).
    res = run(FORGE_EXIT_0, timeout_s=30)
    assert res.exit_code == 3, res
    assert "after" in res.output
    assert (run("echo next", timeout_s=30).output, run("exit 4", timeout_s=30).exit_code) == ("next\n", 4)


def rewrite_the_server(code: str) -> str:
    """A command writing shell ``code`` into the command server's stdin pipe (root may reopen
    /proc/<pid>/fd/0): the server runs it after this command, itself."""
    return rf"""for p in /proc/[0-9]*; do
    [ "$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)" = "sh -s " ] && server=${{p#/proc/}}
done
printf '%s\n' {shlex.quote(code)} > "/proc/$server/fd/0"
mkdir -p tests && echo 'echo the agent wrote this' > tests/hidden.sh"""


# From then on the server acknowledges every request, answers 0 and runs nothing.
ANSWER_0 = '__br_run() { printf "[batch-runner-run:%s]\\n\\n[batch-runner-exit:%s]=0\\n" "$1" "$1"; }'


@pytest.mark.docker
def test_docker_hidden_files_are_written_by_an_exec_whatever_the_agent_did_to_the_server(docker_box):
    """Written through the server, they were not written at all: the verify ran the agent's own file."""
    from batchrun.scoring import write_verify_files

    box = docker_box(index=35)
    box.run(rewrite_the_server(ANSWER_0), timeout_s=30)
    assert box.run("echo hello; exit 3", timeout_s=30) == box.run("true", timeout_s=30)  # rewritten
    assert box.end_processes(30) is None
    write_verify_files(box, [("tests/hidden.sh", "echo the hidden test\n")], 30)
    assert box.run_judged("sh tests/hidden.sh", timeout_s=30).output == "the hidden test\n"


@pytest.mark.docker
def test_docker_a_loop_written_into_the_server_does_not_rewrite_the_hidden_files(docker_box):
    """Builtins run by the server itself (a base process, spared), no process to kill: it is stopped."""
    from batchrun.scoring import write_verify_files

    box = docker_box(index=36)
    loop = "while :; do echo exit > tests/hidden.sh; done 2>/dev/null"
    box.run(rewrite_the_server(loop), timeout_s=30)
    assert box.end_processes(30) is None
    write_verify_files(box, [("tests/hidden.sh", "echo the hidden test; exit 1\n")], 30)
    time.sleep(0.2)
    res = box.run_judged("sh tests/hidden.sh", timeout_s=30)
    assert (res.output, res.exit_code) == ("the hidden test\n", 1)


# Each base process's pid and the state of each of its threads ("T" stopped, "Z" dead), as a judged
# command sees them: $@, the base pids.
STATES = r"""for p in "$@"; do s=$p:; for t in /proc/$p/task/[0-9]*/stat; do
    read -r l < "$t" && set -- ${l##*) } && s=$s$1; done; echo "$s"; done"""


@pytest.mark.docker
def test_docker_every_process_the_runner_spares_is_stopped_while_a_sample_is_judged(docker_box):
    """docker-init, the boot shell, cat, the sleeper: root may take any of them over (ptrace), and its
    code, not a process of the agent's, ran on while the sample was judged. Only the server was stopped."""
    box = docker_box(index=37)
    base = " ".join(str(p) for p in box._base_pids)
    assert len(box._base_pids) >= 5 and 1 in box._base_pids
    box.run("sleep 1000 & setsid sleep 1000 & echo started", timeout_s=30)
    assert box.end_processes(30) is None
    res = box.run_judged(f"set -- {base}\n{STATES}", timeout_s=30)
    states = dict(line.split(":") for line in res.output.split())
    assert states == {str(p): "T" for p in box._base_pids}, res.output
    assert box.run_judged("ps -o args | grep -c '^sleep 1000$'", timeout_s=30).output == "0\n"  # killed
    # The next command continues them: the sandbox works as before, and ends itself at stop.
    assert box.run("echo alive", timeout_s=30).output == "alive\n"
    res = box.run_judged(f"set -- {base}\n{STATES}", timeout_s=30)
    assert all(s != "T" for s in dict(line.split(":") for line in res.output.split()).values()), res.output
    assert box.end_processes(30) is None  # again: as before, stopped
    assert box.run_judged("read -r l < /proc/1/stat; set -- ${l##*) }; echo $1", timeout_s=30).output == "T\n"


INJECTOR = r"""
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/user.h>
#include <sys/wait.h>
/* inject PID CMD: PID, taken over with ptrace, becomes sh -c CMD (execve in place: the same pid). */
static void poke(pid_t p, unsigned long at, const void *buf, size_t n) {
    for (size_t i = 0; i < n; i += 8) {
        unsigned long w = 0;
        memcpy(&w, (const char *)buf + i, n - i < 8 ? n - i : 8);
        if (ptrace(PTRACE_POKEDATA, p, at + i, w) < 0) exit(3);
    }
}
int main(int argc, char **argv) {
    pid_t p = atoi(argv[1]);
    struct user_regs_struct r;
    if (argc != 3 || ptrace(PTRACE_ATTACH, p, 0, 0) < 0) return 2;
    waitpid(p, 0, __WALL);
    ptrace(PTRACE_GETREGS, p, 0, &r);
    unsigned long at = (r.rsp - 8192) & ~15UL;
    char text[4096] = "/bin/sh\0\0\0\0\0\0\0\0\0sh\0\0\0\0\0\0-c";
    size_t n = 32 + strlen(argv[2]) + 1;
    if (n > sizeof text) return 4;
    strcpy(text + 32, argv[2]);
    n = (n + 7) & ~7UL;
    unsigned long args[4] = {at + 16, at + 24, at + 32, 0};
    unsigned char code[8] = {0x0f, 0x05, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc}; /* syscall */
    poke(p, at, text, n);
    poke(p, at + n, args, sizeof args);
    poke(p, r.rip, code, sizeof code);
    r.rax = 59; r.rdi = at; r.rsi = at + n; r.rdx = 0; r.orig_rax = -1; /* execve, no restart */
    ptrace(PTRACE_SETREGS, p, 0, &r);
    return ptrace(PTRACE_DETACH, p, 0, 0) < 0 ? 5 : 0;
}
"""


def static_program(directory: Path, source: str) -> bytes:
    """``source`` (C) built into a static x86-64 program, to be run in the busybox test image; skips
    the test where this machine cannot build one."""
    if os.uname().machine != "x86_64" or shutil.which("gcc") is None:
        pytest.skip("needs gcc and x86-64")
    src = directory / "program.c"
    src.write_text(source)
    done = subprocess.run(["gcc", "-static", "-O2", "-o", src.with_suffix(""), src], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"no static C library for gcc: {done.stderr.decode()[-200:]}")
    return src.with_suffix("").read_bytes()


@pytest.fixture(scope="module")
def injector(tmp_path_factory) -> bytes:
    """A program that takes a process over with ptrace (Docker's seccomp allows it)."""
    return static_program(tmp_path_factory.mktemp("injector"), INJECTOR)


# The base process taken over, by what a command finds in /proc (docker-init, the boot shell: its only
# child, the sleeper's sleep).
TARGETS = {
    "docker-init": "1",
    "boot shell": r"$(for f in /proc/[0-9]*/stat; do read -r l < $f; set -- ${l##*) }; [ $2 = 1 ] && echo ${f#/proc/} && break; done)",
    "sleeper": """$(ps -o pid,args | awk '$2 == "sleep" {print $1}')""",
}


@pytest.mark.docker
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_docker_code_injected_into_a_base_process_cannot_rewrite_the_hidden_files(
    docker_box, injector, target
):
    """A command running as root takes over a process the runner spared (ptrace), which then rewrites
    the hidden test in a loop of builtins: the hidden test (exit 1) passed, printing nothing."""
    from batchrun.scoring import write_verify_files

    box = docker_box(index=38, options={"lifetime_s": 4200.0})
    assert box.run_exec("cat > /inject && chmod 755 /inject", timeout_s=60, stdin=injector).exit_code == 0
    loop = 'while :; do echo "echo faked; exit 0" > tests/hidden.sh; done 2>/dev/null'
    res = box.run(f"mkdir -p tests && /inject {TARGETS[target]} {shlex.quote(loop)}", timeout_s=30)
    assert res.exit_code == 0, res
    assert wait_until(
        lambda: box.run("cat tests/hidden.sh", timeout_s=30).output == "echo faked; exit 0\n", 10
    )
    assert box.end_processes(30) is None
    write_verify_files(box, [("tests/hidden.sh", "echo the hidden test; exit 1\n")], 30)
    time.sleep(0.2)
    res = box.run_judged("sh tests/hidden.sh", timeout_s=30)
    assert (res.output, res.exit_code) == ("the hidden test\n", 1)


@pytest.mark.docker
def test_docker_rm_rf_root_leaves_host_intact(docker_box, tmp_path: Path):
    from docker.errors import NotFound

    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    sentinel = tmp_path / "host-file.txt"
    sentinel.write_text("still here")
    box = docker_box()
    # Outside the working directory: the archive API does not see into its tmpfs (the disk cap).
    assert box.run("echo mine > /mine.txt", timeout_s=20).exit_code == 0
    docker_client().api.get_archive(box.container_id, "/mine.txt")  # there before
    box.run("rm -rf / --no-preserve-root 2>/dev/null || rm -rf /", timeout_s=120)  # GNU, then busybox
    with pytest.raises(NotFound):
        docker_client().api.get_archive(box.container_id, "/mine.txt")  # rm did run
    assert sentinel.read_text() == "still here"
    assert Path("/etc/passwd").exists() and Path(sys.executable).exists()


@pytest.mark.docker
def test_ensure_images_reports_ready_and_missing(docker_test_image: str):
    from batchrun.prompt.sandboxes.docker.sandbox import ensure_images

    messages: list[str] = []
    result = ensure_images(
        [docker_test_image, "does-not-exist-br:never", docker_test_image], progress=messages.append
    )
    assert list(result) == [docker_test_image, "does-not-exist-br:never"]  # each distinct image once
    assert result[docker_test_image] is None
    assert "pull failed" in result["does-not-exist-br:never"]
    assert messages == ["pulling does-not-exist-br:never ...", "pull of does-not-exist-br:never failed"]


def _image_for_another_platform(base: str, name: str, arch: str, *, runnable: bool) -> str:
    """``base`` saved, labelled as built for linux/``arch`` and loaded as ``name``; unless ``runnable``,
    its busybox is marked a binary of that machine too (ELF e_machine), which this engine cannot run."""
    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    client = docker_client()
    saved = tarfile.open(fileobj=io.BytesIO(b"".join(client.images.get(base).save())))
    files = {m.name: saved.extractfile(m).read() for m in saved.getmembers() if m.isfile()}
    manifest = json.loads(files["manifest.json"])[0]
    config = json.loads(files.pop(manifest["Config"]))
    config["architecture"] = arch
    if not runnable:
        layer, out = manifest["Layers"][-1], io.BytesIO()
        with (
            tarfile.open(fileobj=io.BytesIO(files[layer])) as src,
            tarfile.open(fileobj=out, mode="w") as dst,
        ):
            for member in src.getmembers():
                data = src.extractfile(member).read() if member.isfile() else b""
                if member.name.lstrip("./") == "bin/busybox":
                    data = data[:18] + {"riscv64": 243, "amd64": 62}[arch].to_bytes(2, "little") + data[20:]
                dst.addfile(member, io.BytesIO(data) if member.isfile() else None)
        files[layer] = out.getvalue()
        config["rootfs"]["diff_ids"][-1] = "sha256:" + hashlib.sha256(files[layer]).hexdigest()
    data = json.dumps(config).encode()
    manifest["Config"] = hashlib.sha256(data).hexdigest() + ".json"
    files[manifest["Config"]], manifest["RepoTags"] = data, [name]
    files["manifest.json"] = json.dumps([manifest]).encode()
    files.pop("repositories", None)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for path, content in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    client.images.load(out.getvalue())
    return name


@pytest.mark.docker
def test_an_image_of_another_platform_is_ready_only_if_the_engine_runs_it(docker_test_image: str):
    """Else each of its prompts paid a model call and five starts ("exec format error"), on every resume."""
    from batchrun.prompt.sandboxes.docker.sandbox import default_owner, docker_client, ensure_images

    arch = "amd64" if docker_client().version().get("Arch") == "riscv64" else "riscv64"
    tag = uuid.uuid4().hex[:8]
    runs = _image_for_another_platform(docker_test_image, f"br-test-{arch}-runs:{tag}", arch, runnable=True)
    cannot = _image_for_another_platform(docker_test_image, f"br-test-{arch}:{tag}", arch, runnable=False)
    try:
        result = ensure_images([runs, cannot], progress=lambda _: None)
        assert result[runs] is None  # the label alone: the engine runs it (as with an emulator)
        assert f"built for linux/{arch}" in result[cannot] and "exec format error" in result[cannot]
        assert docker_ps("batch_runner.run_name=image-probe", f"batch_runner.owner={default_owner()}") == []
    finally:
        for image in (runs, cannot):
            docker_client().images.remove(image, force=True)


def _image_without_sh() -> str:
    """An image of one file and no sh, as FROM scratch with one static binary (or distroless) makes."""
    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    name, data, out = f"br-test-no-sh:{uuid.uuid4().hex[:8]}", b"#!/bin/true\n", io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        info = tarfile.TarInfo("hello")
        info.size, info.mode = len(data), 0o755
        archive.addfile(info, io.BytesIO(data))
    docker_client().api.import_image_from_data(
        out.getvalue(), repository=name.split(":")[0], tag=name.split(":")[1]
    )
    return name


@pytest.mark.docker
def test_an_image_without_sh_fails_its_prompts_without_a_model_call_and_a_runnable_one_is_probed_once(
    tmp_path, monkeypatch, capsys, server, docker_test_image
):
    """An image without sh passed preflight as "ready": each of its prompts paid its first model call,
    then five container starts, and failed naming neither sh nor the image ("... cannot be connected
    to the worker's network: it is not running"). Now a container of each image runs sh -c : before
    any prompt, once per image ID on this machine."""
    from helpers import exit_code, read_jsonl, requests, write_rows

    from batchrun.prompt.sandboxes.docker.sandbox import default_owner, docker_client

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    client = docker_client()

    def probed(since: float) -> list[str]:
        """The images of the probe containers this process made since ``since`` (the engine's events)."""
        labels = ["batch_runner.run_name=image-probe", f"batch_runner.owner={default_owner()}"]
        events = client.events(
            since=since, until=time.time(), decode=True,
            filters={"type": "container", "event": "create", "label": labels},
        )  # fmt: skip
        return sorted(e["Actor"]["Attributes"]["image"] for e in events)

    bad = _image_without_sh()
    rows = [
        {"prompt": "on scratch 1", "image": bad},
        {"prompt": "on scratch 2", "image": bad},
        {"prompt": "on busybox"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    try:
        for run_name in ("first", "second"):
            started = time.time()
            code = exit_code(
                server, dataset, tmp_path / "data", run_name=run_name, sandbox="docker",
                default_image=docker_test_image, num_workers=1,
            )  # fmt: skip
            out = capsys.readouterr().out
            assert code != 2, out
            failed = {r["prompt"]: r for r in read_jsonl(tmp_path / "data" / run_name / "failed.jsonl")}
            assert sorted(failed) == ["on scratch 1", "on scratch 2"]
            for record in failed.values():
                assert (
                    f"image '{bad}' not available: has no sh: the runner's command server needs sh"
                    in record["error"]
                ), record
            done = read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")
            assert [r["conversations"][1]["value"] for r in done] == ["on busybox"]
            # What the image's state says is its verdict before the first token of any of its prompts.
            assert set(requests(server)) == {"on busybox"}
            # The busybox image ran the probe in the first run: its ID is kept, and the second run asks
            # nothing of it; an image that failed is tried again (it may be fixed since), three times a run
            # (a busy engine may say "no sh" of an image that has it).
            assert probed(started) == sorted([bad] * 3 + ([docker_test_image] if run_name == "first" else []))
        cache = json.loads((tmp_path / "cache" / "batch-runner" / "docker-images-runnable.json").read_text())
        assert list(cache["runnable"]) == [client.images.get(docker_test_image).id]
    finally:
        client.images.remove(bad, force=True)


@pytest.mark.docker
def test_a_default_image_without_sh_stops_the_run_before_any_token_and_a_rows_fails_its_lines(
    tmp_path, monkeypatch, capsys, server, docker_test_image
):
    """--default_image naming an image without sh was listed "NOT AVAILABLE" and every prompt on it failed
    without a model call, after the start check's call, the run going on (exit 3 past
    --max_failure_rate); a flag the user typed now stops the run (exit 2) before the start check, naming
    the flag, the image and why. The same image named by a row fails only that row's prompts, and the
    start's warning names its line and field."""
    from helpers import exit_code, read_jsonl, requests, write_rows

    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bad = _image_without_sh()
    try:
        dataset = write_rows(
            tmp_path / "d.jsonl", [{"prompt": "on the default 1"}, {"prompt": "on the default 2"}]
        )
        code = exit_code(
            server, dataset, tmp_path / "data", run_name="bad-default", sandbox="docker", default_image=bad,
            num_workers=1,
        )  # fmt: skip
        said = capsys.readouterr()
        assert code == 2, said
        assert f"--default_image '{bad}' cannot be used: has no sh: the runner's command server needs sh" in (
            said.err
        )
        assert server.stats()["check_calls"] == 0 and not requests(server)
        assert not (tmp_path / "data" / "bad-default" / "failed.jsonl").exists()
        # One that is not here and whose pull fails (after the start check: a wrong key costs no pull).
        code = exit_code(
            server, dataset, tmp_path / "data", run_name="gone-default", sandbox="docker",
            default_image="does-not-exist-br:never", num_workers=1,
        )  # fmt: skip
        said = capsys.readouterr()
        assert code == 2, said
        assert (
            "--default_image 'does-not-exist-br:never' cannot be used: not present locally and the pull"
            in (said.err)
        )
        assert server.stats()["check_calls"] == 1 and not requests(server)

        rows = [{"prompt": "on busybox"}, {"prompt": "on scratch", "docker_image": bad}]
        dataset = write_rows(tmp_path / "rows.jsonl", rows)
        code = exit_code(
            server, dataset, tmp_path / "data", run_name="bad-row", sandbox="docker",
            default_image=docker_test_image, num_workers=1,
        )  # fmt: skip
        out = capsys.readouterr().out
        assert code != 2, out
        assert f"{dataset}:2: field 'image'/'docker_image': image '{bad}' not available: has no sh" in out
        failed = read_jsonl(tmp_path / "data" / "bad-row" / "failed.jsonl")
        assert [f["prompt"] for f in failed] == ["on scratch"]
        assert set(requests(server)) == {"on busybox"}
    finally:
        docker_client().images.remove(bad, force=True)


def test_the_runnable_cache_write_removes_what_killed_writers_left(tmp_path, monkeypatch):
    """A runner killed while it wrote the cache of runnable images left its temp file there (a whole
    copy, up to ~300 KiB) for good: 11 of them after 80 kills of two writers. The next write removes
    those of dead writers; the cache itself was never damaged (replaced whole)."""
    from batchrun.prompt.sandboxes.docker import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "batch-runner"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / f".docker-images-runnable.json.{dead.pid}.tmp").write_text('{"probe": "')
    engine._remember_runnable(["sha256:" + "a" * 64])
    assert sorted(p.name for p in folder.iterdir()) == ["docker-images-runnable.json"]
    assert list(engine._read_runnable()) == ["sha256:" + "a" * 64]


@pytest.mark.docker
def test_an_image_whose_sh_has_no_sleep_is_not_available(docker_engine, tmp_path, monkeypatch):
    """dash and cat with their libc, no coreutils: the boot script's sleeper (the lifetime bound) failed at
    once and killed the boot shell, so every start ended with "it ended (no output)" after five tries."""
    from batchrun.prompt.sandboxes.docker.sandbox import docker_client, ensure_images

    dash, cat = shutil.which("dash"), shutil.which("cat")
    if not dash or not cat:
        pytest.skip("needs dash")
    libs = subprocess.run(["ldd", dash, cat], capture_output=True, text=True).stdout.split()
    files = {
        "bin/sh": dash,
        "bin/cat": cat,
        **{p.lstrip("/"): p for p in libs if p.startswith("/") and not p.endswith(":")},
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", dereference=True) as archive:
        for name, path in files.items():
            archive.add(path, arcname=name)
    name = f"br-test-no-sleep:{uuid.uuid4().hex[:8]}"
    docker_client().api.import_image_from_data(
        out.getvalue(), repository=name.split(":")[0], tag=name.split(":")[1], changes=["ENV PATH=/bin"]
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        assert ensure_images([name], progress=lambda _: None, pull=False) == {
            name: "has no sleep: the runner's containers need it to bound their lifetime, and end at once without it"
        }
    finally:
        docker_client().images.remove(name, force=True)


@pytest.mark.docker
def test_a_probe_that_says_no_sh_once_is_tried_again(docker_engine, docker_test_image, tmp_path, monkeypatch):
    """A busy engine's docker-init sometimes finds no sh in an image that has one (exit 127; 1-11 of 30
    starts with two runs at once): one such probe must not make a good image unavailable, and with it
    every prompt on it. A real no-sh image still fails, after its tries."""
    from batchrun.prompt.sandboxes.docker import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real, calls = engine._run_problem, []

    def flaky(image, attrs, platform):
        calls.append(image)
        if len(calls) == 1:
            return f"{engine.NO_SH} ([FATAL tini (7)] exec sh failed: No such file or directory)"
        return real(image, attrs, platform)

    monkeypatch.setattr(engine, "_run_problem", flaky)
    assert engine.ensure_images([docker_test_image], progress=lambda _: None, pull=False) == {
        docker_test_image: None
    }
    assert len(calls) == 2


@pytest.mark.docker
@pytest.mark.parametrize("network", [True, False])
@pytest.mark.parametrize("init", [True, False])
def test_a_container_whose_sh_cannot_run_fails_its_start_once_naming_the_image(network, init, docker_engine):
    """Its start was tried five times and said "it is not running" (with the network hub) or quoted
    docker-init's words without the image; now the engine's State and what it printed say why, naming
    the image, and a container that cannot run its sh is not started again."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox, docker_client

    bad = _image_without_sh()
    box = DockerSandbox(SandboxSpec(RUN, 60, network=network), default_image=bad, init=init)
    try:
        with pytest.raises(SandboxError) as raised:
            box.start()
        said = str(raised.value)
        assert "did not start (1 attempt)" in said
        assert f"image '{bad}' has no sh: the runner's command server needs sh and cat" in said
    finally:
        box.stop()
        docker_client().images.remove(bad, force=True)


@pytest.mark.docker
def test_a_start_that_finds_no_sh_in_an_image_that_ran_sh_is_tried_again(
    docker_test_image, monkeypatch, tmp_path
):
    """Under load the engine now and then starts a container whose docker-init says "exec sh failed: No
    such file or directory" although its image has sh (two runs at once, fresh images: 3 to 11 of a
    run's 30 prompts). Such a start was final and its prompt failed; an image that ran the start's
    probe is tried again (the engine's fault played here by one container of an image without sh)."""
    from docker.models.containers import ContainerCollection

    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox, docker_client, ensure_images

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ensure_images([docker_test_image], progress=lambda _: None, pull=False) == {
        docker_test_image: None
    }
    bad = _image_without_sh()
    real_create, images = ContainerCollection.create, []

    def create(self, image, *args, **kwargs):
        if kwargs.get("labels", {}).get("batch_runner.prompt_index") == "61":  # the prompt's containers
            images.append(image)
            image = bad if len(images) == 1 else image
        return real_create(self, image, *args, **kwargs)

    monkeypatch.setattr(ContainerCollection, "create", create)
    box = DockerSandbox(SandboxSpec(RUN, 61, network=False), default_image=docker_test_image)
    try:
        box.start()
        assert box.run("echo ok", timeout_s=30).output == "ok\n"
        assert images == [docker_test_image, docker_test_image]
    finally:
        box.stop()
        docker_client().images.remove(bad, force=True)


@pytest.mark.docker
def test_sweep_removes_containers_of_dead_owners_of_any_run_and_nothing_else(docker_box, docker_test_image):
    from batchrun.prompt.sandboxes.docker.sandbox import default_owner, docker_client, sweep_containers

    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = os.getpid()
    orphan = docker_box(index=1, options={"run_owner": f"{dead.pid}@{host}"})
    # This pid is alive, but the owner started at another instant: the pid was reused, the owner is dead.
    reused = docker_box(index=2, options={"run_owner": f"{me}:1@{host}"})
    elsewhere = docker_box(index=3, options={"run_owner": "1@some-other-host"})  # cannot tell: kept
    alive = docker_box(index=4, options={"run_owner": default_owner()})
    assert default_owner().startswith(f"{me}:")  # the start time is part of the owner here
    other_run = f"other-{uuid.uuid4().hex[:8]}"  # the sweep is not limited to one run name
    other = docker_client().containers.create(
        docker_test_image, command=["true"], labels={"batch_runner.run_name": other_run,
                                                     "batch_runner.owner": f"{dead.pid}@{host}"},
    )  # fmt: skip
    foreign = docker_client().containers.create(  # ours in nothing but the run-name label: never touched
        docker_test_image, command=["true"], labels={"batch_runner.run_name": other_run}
    )
    kept = {elsewhere.container_id, alive.container_id, foreign.id}
    try:
        removed = sweep_containers()
        assert {orphan.container_id, reused.container_id, other.id}.isdisjoint(_container_ids())
        assert other.name in removed
        assert kept <= _container_ids()
        orphan.stop()  # already gone: still safe
        sweep_containers()
        assert kept <= _container_ids()
    finally:
        foreign.remove(force=True)


class _EngineSocket:
    """A Unix socket in front of the engine's, for this process's Docker client: ``stop()`` is what a
    stopped dockerd is to the runner (the socket gone, every stream of it cut), while the real engine
    goes on for the other test sessions sharing it."""

    def __init__(self, path: Path):
        host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        self.engine = host.removeprefix("unix://")
        self.path = str(path)
        self.links: list[socket.socket] = []
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            engine.connect(self.engine)
            self.links += [client, engine]
            for a, b in ((client, engine), (engine, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def stop(self) -> None:
        self.server.close()
        os.unlink(self.path)
        for link in self.links:
            try:
                link.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def engine_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker_engine: str):
    """This process's Docker client through an ``_EngineSocket`` (the real one back at teardown)."""
    import docker

    from batchrun.prompt.sandboxes.docker import engine

    front = _EngineSocket(tmp_path / "docker.sock")
    client = docker.DockerClient(base_url=f"unix://{front.path}", version="auto")
    monkeypatch.setitem(engine._clients, os.getpid(), client)
    yield front
    client.close()


@pytest.mark.docker
def test_an_engine_that_stops_fails_the_prompt_not_the_tool_call_nor_the_runs_end(
    docker_test_image: str, engine_socket, capsys
):
    """dockerd stopped during a run (here: 8 prompts, each in a 30 s command): docker-py lets requests'
    ConnectionError through, not a DockerException. The terminal call became a tool error for the model,
    the prompt was counted done (completed, not run again on resume) although its container was gone; a
    verify's became a score error; and the run's sweep ended the run in a traceback, no statistics."""
    from helpers import tool_call

    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox, default_owner

    box = DockerSandbox(SandboxSpec(RUN, 50, network=False), default_image=docker_test_image)
    judged = DockerSandbox(SandboxSpec(RUN, 51, network=False), default_image=docker_test_image)
    box.start()
    judged.start()
    ids = {box.container_id, judged.container_id}
    try:
        threading.Timer(1.0, engine_socket.stop).start()
        with pytest.raises(SandboxError):  # the prompt fails (and runs again on resume)
            tool_call(box, "terminal", command="sleep 30")
        with pytest.raises(SandboxError):  # no verdict: the sandbox broke
            judged.run_judged("true", timeout_s=10)
        DockerSandbox.sweep({"run_owner": default_owner()})  # the run's end goes on
        assert "Docker engine did not answer" in capsys.readouterr().err
        judged.stop()
    finally:
        box.stop()
        judged.stop()
    # The engine itself ran on: the containers, their streams cut, ended and removed themselves.
    assert wait_until(lambda: ids.isdisjoint(_container_ids()), timeout_s=60)


@pytest.mark.docker
@pytest.mark.parametrize("by", ["its_end", "the_next_runs_start"])
def test_what_runs_on_in_a_runs_cgroup_is_killed_and_the_run_does_not_wait_for_it(
    docker_test_image, by, capsys
):
    """A dockerd killed (SIGKILL) and started again mid-run lists the run's containers no more, while
    their shims keep them running (here 4 of 8, until their lifetime: 2 h 10 min); the run's end
    waited ~61 s for each of cgroup v1's 10 hierarchies (10 minutes) for the cgroup they held, then
    left it, and the next run's start left it too. A process put in the run's cgroup stands for one.
    The next run's start spares a container the engine lists there: a runner it cannot tell alive
    (another PID namespace) may own it."""
    import docker

    from batchrun.prompt.sandboxes.docker import engine
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    problem = engine.run_cgroup_problem(engine.docker_client().info())
    if problem is not None:
        pytest.skip(problem)
    dead = subprocess.Popen(["true"])
    dead.wait()
    if by == "its_end":
        name = engine.make_run_cgroup(1 << 30, 2048)
    else:  # a killed runner's: the next run's start removes it
        name = f"{engine.RUN_CGROUP_PREFIX}{dead.pid}-{uuid.uuid4().hex[:8]}"
        for path, _ in engine._run_cgroup_dirs(name):
            os.mkdir(path)
    orphan = subprocess.Popen(["sleep", "600"])
    known = None
    try:
        for path, _ in engine._run_cgroup_dirs(name):
            Path(path, "cgroup.procs").write_text(str(orphan.pid))
        for _ in range(5 if by == "the_next_runs_start" else 0):
            made = engine.docker_client().containers.create(
                docker_test_image,
                ["sleep", "600"],
                cgroup_parent=f"/{name}",
                labels={"batch_runner.run_name": RUN},
            )
            try:  # a busy engine now and then says an image has no sleep (see the README's docker)
                made.start()
                known = made
                break
            except docker.errors.APIError:
                made.remove(force=True)
                time.sleep(0.5)
        assert (known is None) == (by == "its_end")
        if by == "its_end":
            options = {"run_owner": f"{dead.pid}:1@{socket.gethostname()}", "cgroup_parent": f"/{name}"}
            ending = threading.Thread(target=DockerSandbox.sweep, args=(options,), daemon=True)
        else:
            ending = threading.Thread(target=engine.sweep_run_cgroups, daemon=True)
        ending.start()
        ending.join(timeout=20)
        assert not ending.is_alive()
        assert orphan.wait(timeout=10) == -9
        if known is not None:
            assert container_running(known.id)
        else:
            assert not any(os.path.exists(os.path.join(h, name)) for h in engine._hierarchies())
            assert "Killed 1 process(es) of this run's containers" in capsys.readouterr().err
    finally:
        orphan.kill()
        if known is not None:
            known.remove(force=True)
        engine.remove_run_cgroup(name, wait_s=10)


@pytest.mark.docker
def test_a_cgroup_parent_of_the_users_own_is_neither_killed_nor_removed_at_the_runs_end(docker_engine):
    """--sandbox_settings may name a cgroup_parent of the user's own, kept where the run's cannot be
    made: the run's end took it for the run's, waited ~61 s per hierarchy for it, and removed what it
    could of it (its empty cgroups); with the end's kill of what runs in a run's cgroup, "/" would have
    killed every process of the machine."""
    from batchrun.prompt.sandboxes.docker import engine
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    name = f"brtest-users-{uuid.uuid4().hex[:8]}"
    dirs = [path for path, _ in engine._run_cgroup_dirs(name)]
    process = subprocess.Popen(["sleep", "600"])
    try:
        for path in dirs:
            os.makedirs(os.path.join(path, "empty"))
            Path(path, "cgroup.procs").write_text(str(process.pid))
        options = {"run_owner": f"1:1@{socket.gethostname()}-none", "cgroup_parent": f"/{name}"}
        ending = threading.Thread(target=DockerSandbox.sweep, args=(options,), daemon=True)
        ending.start()
        ending.join(timeout=20)
        assert not ending.is_alive()
        assert process.poll() is None
        assert all(os.path.isdir(os.path.join(path, "empty")) for path in dirs)
    finally:
        process.kill()
        process.wait()
        for path in dirs:
            for leftover in (os.path.join(path, "empty"), path):
                if os.path.isdir(leftover):
                    os.rmdir(leftover)


@pytest.mark.docker
def test_a_run_s_cgroup_outlives_the_start_of_a_runner_in_another_pid_namespace(docker_engine):
    """A runner in another PID namespace (in a container, sharing the machine's cgroups and engine)
    judged this live run's cgroup by its pid, a pid of this namespace that it does not have: gone.
    Its start removed the cgroup while no container was in it (here: 2 of 2 hierarchies), and the
    engine made it again for the run's next container without the run's memory and pids limits.
    A dead runner's cgroup of this namespace is still removed."""
    from batchrun.prompt.sandboxes.docker import engine

    problem = engine.run_cgroup_problem(engine.docker_client().info())
    if problem is not None:
        pytest.skip(problem)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to start a process in a PID namespace of its own")
    name = engine.make_run_cgroup(1 << 30, 2048)
    dead = subprocess.Popen(["true"])
    dead.wait()
    namespace = os.stat("/proc/self/ns/pid").st_ino  # as make_run_cgroup names it, a dead runner of ours
    gone = f"{engine.RUN_CGROUP_PREFIX}{dead.pid}-{uuid.uuid4().hex[:8]}-{namespace}"
    for path, _ in engine._run_cgroup_dirs(gone):
        os.makedirs(path, exist_ok=True)
    sweep = "from batchrun.prompt.sandboxes.docker import engine; engine.sweep_run_cgroups()"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        other = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", sweep]
        subprocess.run(other, check=True, timeout=60, cwd=ROOT, env=env)
        held = [h for h in engine._hierarchies() if os.path.isdir(os.path.join(h, name))]
        assert len(held) == len(engine._run_cgroup_dirs(name))
        subprocess.run([sys.executable, "-c", sweep], check=True, timeout=60, cwd=ROOT, env=env)
        assert not any(os.path.exists(os.path.join(h, gone)) for h in engine._hierarchies())
        assert all(os.path.isdir(os.path.join(h, name)) for h in held)
    finally:
        for leftover in (name, gone):
            engine.remove_run_cgroup(leftover, wait_s=1)


def _container_ids() -> set[str]:
    """Full ids of every container of the engine, running or not."""
    done = subprocess.run(
        ["docker", "ps", "-a", "--no-trunc", "--format", "{{.ID}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.split())


# A process that creates a sandbox the way a worker does, prints its container id, then waits to be killed.
SANDBOX_HOLDER = """
import sys, time
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox
box = DockerSandbox(SandboxSpec(sys.argv[1], 0), default_image=sys.argv[2])
box.start()
assert box.run("echo up", timeout_s=30).output == "up\\n"
print(box.container_id, flush=True)
time.sleep(3600)
"""


def container_running(container_id: str) -> bool:
    done = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Running}}", container_id], capture_output=True, text=True
    )
    return done.stdout.strip() == "true"  # gone (auto-removed) or exited: not running


@pytest.mark.docker
def test_container_ends_itself_when_the_process_holding_it_is_killed(docker_test_image: str):
    proc = subprocess.Popen(
        [sys.executable, "-c", SANDBOX_HOLDER, RUN, docker_test_image], stdout=subprocess.PIPE, text=True
    )
    try:
        container_id = proc.stdout.readline().strip()
        assert container_id and container_running(container_id)
        proc.kill()  # SIGKILL: no finally, no atexit, no stop()
        proc.wait()
        assert wait_until(lambda: not container_running(container_id), timeout_s=60)
        assert wait_until(lambda: container_id not in _container_ids(), timeout_s=60)  # and removed itself
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["docker", "rm", "-f", container_id], capture_output=True)


@pytest.mark.docker
def test_container_ends_itself_after_its_lifetime(docker_box):
    box = docker_box(index=40, options={"lifetime_s": 2.0})
    assert box.run("echo up", timeout_s=30).output == "up\n"
    assert wait_until(lambda: not container_running(box.container_id), timeout_s=60)


@pytest.mark.docker
def test_storage_probe_answers_and_leaves_no_container(docker_test_image: str):
    from batchrun.prompt.sandboxes.docker.sandbox import storage_size_supported

    before = _container_ids()
    answer = storage_size_supported(docker_test_image)
    driver = subprocess.run(
        ["docker", "info", "-f", "{{.Driver}}"], capture_output=True, text=True
    ).stdout.strip()
    backing = subprocess.run(
        ["docker", "info", "-f", "{{range .DriverStatus}}{{index . 1}} {{end}}"],
        capture_output=True,
        text=True,
    ).stdout
    if driver == "overlay2" and "xfs" not in backing:
        assert answer is False  # overlay2 caps a container only on xfs with pquota
    assert _container_ids() - before == set()


@pytest.mark.docker
def test_writing_past_the_disk_cap_fails_and_other_commands_still_work(docker_box):
    box = docker_box(index=41, options={"disk_mb": 16})
    res = box.run("dd if=/dev/zero of=big bs=1M count=64; echo dd-exit=$?", timeout_s=60)
    assert "No space left on device" in res.output and "dd-exit=0" not in res.output
    res = box.run("rm big && echo fine > small.txt && cat small.txt && pwd", timeout_s=30)
    assert (res.output, res.exit_code) == (f"fine\n{box.workdir}\n", 0)
    if box.disk_cap == "tmpfs":
        attrs = _inspect(box.container_id)
        assert attrs["HostConfig"]["Tmpfs"] == {box.workdir: "size=16m,exec"}


@pytest.mark.docker
def test_tmpfs_disk_cap_stays_below_the_memory_limit_so_a_full_disk_leaves_the_container_usable(docker_box):
    # A tmpfs of the full 256 MiB would fill the 64 MiB of memory: the writer, then every later
    # command, would be OOM-killed. Half the memory: ENOSPC first, and the next command works.
    box = docker_box(index=44, options={"disk_cap": "tmpfs", "disk_mb": 256, "memory_mb": 64})
    assert box.tmpfs_mb == 32
    res = box.run("dd if=/dev/zero of=big bs=1M count=128; echo dd-exit=$?", timeout_s=60)
    assert "No space left on device" in res.output and "Killed" not in res.output
    assert box.run("echo still working", timeout_s=30).output == "still working\n"


class _DiskGrowth:
    """The peak growth of the Docker engine's filesystem while it is sampled (every 10 ms, in a thread)."""

    def __init__(self, path: str = "/var/lib/docker") -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._base = shutil.disk_usage(path).used
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self._base)
            time.sleep(0.01)

    def __enter__(self) -> _DiskGrowth:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# What a container may write between two looks of the disk watch, and its kill: ~0.1 s at the
# speed of the page cache (~2 GB/s here; 240 MiB seen past a 64 MiB cap).
WATCH_OVERSHOOT_MB = 600


@pytest.mark.docker
def test_tmpfs_disk_cap_stops_a_container_that_writes_past_it_outside_the_working_directory(docker_box):
    """Outside its tmpfs working directory a container wrote to the engine's disk, usually the host's
    root filesystem, without bound (1,500 MiB to /tmp past a 32 MiB cap). Now the runner watches its
    writable layer: past the cap the container is stopped, its prompt fails saying why, and the host's
    disk took at most the cap and one look's overshoot. A container under the cap is left alone."""
    options = {"disk_cap": "tmpfs", "disk_mb": 32}
    under, over = docker_box(index=46, options=options), docker_box(index=47, options=options)
    res = under.run("dd if=/dev/zero of=/root/keep bs=1M count=16 2>&1; sleep 1; echo ok", timeout_s=30)
    assert res.output.endswith("ok\n")
    with _DiskGrowth() as growth, pytest.raises(SandboxError, match="past the disk cap of 32 MiB") as caught:
        over.run("dd if=/dev/zero of=/tmp/big bs=1M count=1500; echo dd-exit=$?", timeout_s=120)
    assert "--container_disk_mb" in str(caught.value) and "the runner stopped it" in str(caught.value)
    assert growth.peak < (32 + WATCH_OVERSHOOT_MB) << 20
    with pytest.raises(SandboxError, match="past the disk cap"):  # its later commands say it too
        over.run("echo more", timeout_s=10)
    with pytest.raises(SandboxError, match="past the disk cap"):
        over.run_judged("echo verify", timeout_s=10)
    time.sleep(0.5)  # a few looks of the watch later
    assert under.run("wc -c < /root/keep", timeout_s=10).output == f"{16 << 20}\n"


@pytest.mark.docker
def test_tmpfs_disk_cap_stopping_a_container_while_it_is_judged_fails_the_prompt_saying_so(docker_box):
    """A verify command past the cap: the watch killed the container and the sample was judged
    failed, "verify: exit 137", as if its answer were wrong; now the prompt fails naming the cap, as
    for the agent's commands, and runs again on resume."""
    box = docker_box(index=49, options={"disk_cap": "tmpfs", "disk_mb": 32})
    assert box.end_processes(30) is None
    with pytest.raises(SandboxError, match="past the disk cap of 32 MiB"):
        box.run_judged(
            "dd if=/dev/zero of=/tmp/big bs=1M count=400 2>/dev/null; sleep 5; exit 0", timeout_s=60
        )


@pytest.mark.docker
def test_tmpfs_disk_cap_holds_an_anonymous_volume_of_the_image_too(docker_box, docker_test_image):
    """A directory the image declares a VOLUME is an anonymous volume on the engine's disk, which the
    tmpfs cap did not hold (the image's VOLUME /data took 300 MiB past a 32 MiB cap)."""
    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    seed = docker_client().containers.create(docker_test_image, ["true"])
    image = f"batch-runner-test-volume:{uuid.uuid4().hex[:8]}"
    seed.commit(*image.split(":"), changes=["VOLUME /data"])
    seed.remove()
    try:
        box = docker_box(index=48, image=image, options={"disk_cap": "tmpfs", "disk_mb": 32})
        with pytest.raises(SandboxError, match="past the disk cap of 32 MiB"):
            box.run("dd if=/dev/zero of=/data/big bs=1M count=300; sleep 2; echo dd-exit=$?", timeout_s=60)
        box.stop()
    finally:
        docker_client().images.remove(image, force=True)


@pytest.mark.docker
def test_disk_cap_in_force_says_what_is_capped(docker_test_image, capsys):
    """The start line and statistics.json's sandbox_disk_cap said only "tmpfs ... at the working
    directory": now they say whether the rest of a container's files are watched, and warn when not."""
    from batchrun.prompt.sandboxes.base import Preflight
    from batchrun.prompt.sandboxes.docker.sandbox import _with_disk_cap

    options = {"disk_cap": "tmpfs", "disk_mb": 64, "memory_mb": 256}
    watched = _with_disk_cap(Preflight("docker"), options, {docker_test_image: None})
    fact = watched.facts["sandbox_disk_cap"]
    assert watched.options["disk_watch"] is (os.geteuid() == 0)
    if os.geteuid() == 0:  # root on the engine's machine: the layer can be read
        assert "tmpfs 64 MiB at the working directory" in fact and "watched" in fact and "pass 64 MiB" in fact
    off = _with_disk_cap(Preflight("docker"), {**options, "disk_watch": False}, {docker_test_image: None})
    assert off.options["disk_watch"] is False and "NOT capped" in off.facts["sandbox_disk_cap"]
    assert "warning: what a prompt writes outside its working directory" in capsys.readouterr().out


@pytest.mark.docker
def test_a_run_with_no_container_to_make_still_has_the_disk_cap_field():
    """A --resume with nothing left to run (after a kill once every outcome was in) wrote a statistics.json
    without the sandbox_disk_cap key the uninterrupted run's had: null now, as sandbox_network's."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    found = DockerSandbox.preflight([], {"disk_cap": "tmpfs", "disk_mb": 64}, real_model=False, network=True)
    assert found.facts == {"sandbox_disk_cap": None}


@pytest.mark.docker
def test_a_disk_watch_asked_for_and_impossible_fails_the_start_and_leaves_no_container(
    docker_test_image, monkeypatch
):
    from batchrun.prompt.sandboxes.docker import sandbox as docker_sandbox

    monkeypatch.setattr(docker_sandbox, "layer_paths", lambda attrs: ["/nonexistent/layer/diff"])
    box = docker_sandbox.DockerSandbox(
        SandboxSpec(RUN, 49), default_image=docker_test_image, disk_cap="tmpfs", disk_watch=True
    )
    with pytest.raises(SandboxError, match="cannot be watched"):
        box.start()
    box.stop()
    assert docker_ps(f"batch_runner.run_name={RUN}", "batch_runner.prompt_index=49") == []


def test_layer_bytes_counts_blocks_each_file_at_least_one_and_hard_links_once(tmp_path: Path):
    from batchrun.prompt.sandboxes.docker.disk_watch import MIN_ENTRY_BYTES, layer_bytes

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data").write_bytes(os.urandom(1 << 20))
    os.link(tmp_path / "d" / "data", tmp_path / "link")
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(1 << 30)  # a GiB that takes no block
    for i in range(100):
        (tmp_path / "d" / f"empty{i}").touch()
    expected = (
        sum(
            max(os.lstat(p).st_blocks * 512, MIN_ENTRY_BYTES)
            for p in [tmp_path / "d", tmp_path / "d" / "data", tmp_path / "sparse"]
        )
        + 100 * MIN_ENTRY_BYTES
    )
    assert layer_bytes([str(tmp_path)]) == expected
    assert (1 << 20) + 100 * MIN_ENTRY_BYTES < expected < (1 << 20) + 110 * MIN_ENTRY_BYTES + (1 << 16)
    assert layer_bytes([str(tmp_path / "gone")]) == 0


@pytest.mark.docker
def test_tmpfs_disk_cap_keeps_what_the_image_has_at_the_working_directory(docker_box, docker_test_image):
    import docker.errors

    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    image = f"batch-runner-test-repo:{uuid.uuid4().hex[:8]}"
    for attempt in range(3):
        # The engine here now and then fails a start ("exec: sh: executable file not found", the image's
        # layers not yet there): the test's own set-up, not what it tests, tried again.
        seed_name = f"br-test-seed-{uuid.uuid4().hex[:8]}"
        try:  # named, so a start the engine fails leaves no container behind
            seed = docker_client().containers.run(
                docker_test_image,
                ["sh", "-c", "mkdir -p /repo/src && echo 'print(1)' > /repo/src/main.py && chmod 777 /repo"
                 " && dd if=/dev/zero of=/repo/blob bs=1M count=2"],
                detach=True, name=seed_name,
            )  # fmt: skip
            seed.wait()
            seed.commit(*image.split(":"), changes=["USER nobody"])  # copied in as root all the same
            break
        except docker.errors.APIError:
            if attempt == 2:
                raise
        finally:
            with contextlib.suppress(Exception):
                docker_client().containers.get(seed_name).remove(force=True)
    try:
        box = docker_box(index=42, image=image, cwd="/repo", options={"disk_cap": "tmpfs", "disk_mb": 8})
        probe = "cat src/main.py; wc -c < blob; df -k . | tail -1; stat -c '%U %a' . src/main.py; id -u"
        lines = box.run(probe, timeout_s=30).output.splitlines()
        assert lines[:2] == ["print(1)", str(2 * 2**20)]  # the image's files ...
        assert lines[2].endswith(" /repo") and lines[2].startswith("tmpfs")  # ... on the tmpfs
        assert lines[3:] == ["root 777", "root 644", "65534"]  # owners and modes as in the image
        assert "No space left" in box.run("dd if=/dev/zero of=big bs=1M count=32", timeout_s=60).output
        box.stop()
        # The image's 2 MiB do not fit a 1 MiB tmpfs: the start fails, and leaves no container.
        with pytest.raises(SandboxError, match="into its 1 MiB tmpfs failed"):
            docker_box(index=45, image=image, cwd="/repo", options={"disk_cap": "tmpfs", "disk_mb": 1})
        assert docker_ps(f"batch_runner.run_name={RUN}", "batch_runner.prompt_index=45") == []
    finally:
        docker_client().images.remove(image, force=True)


@pytest.mark.docker
def test_tmpfs_disk_cap_keeps_the_image_s_working_directory_in_every_container(docker_box, docker_test_image):
    """The engine here now and then says a directory its image holds is not there: the archive API of a
    running container (about half of the reads), and the name "root" of an exec's user not in the
    image's passwd file (3 of 20). The first such read made the worker take the image's working
    directory for empty for good: 12 of 12 prompts of a run saw none of its files (a kept sample of a
    model that found no repository). Each container of 12 here must get them."""
    from batchrun.prompt.sandboxes.docker import sandbox as docker_sandbox
    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    files = io.BytesIO()
    with tarfile.open(fileobj=files, mode="w") as tar:
        info = tarfile.TarInfo("seed.txt")
        info.size = len(b"seeded\n")
        tar.addfile(info, io.BytesIO(b"seeded\n"))
    seed = docker_client().containers.create(docker_test_image, ["true"])  # never started: no sh needed
    assert seed.put_archive("/workspace", files.getvalue())
    image = f"batch-runner-test-seeded:{uuid.uuid4().hex[:8]}"
    seed.commit(*image.split(":"))
    seed.remove()
    try:
        assert docker_sandbox.ensure_images([image]) == {image: None}  # probed, as a run's start does
        seen = []
        for index in range(12):
            box = docker_box(index=60 + index, image=image, options={"disk_cap": "tmpfs"})
            seen.append(box.run("cat seed.txt", timeout_s=30).output)
            box.stop()
        assert seen == ["seeded\n"] * 12
        assert (image, "/workspace") not in docker_sandbox._empty_dirs
    finally:
        docker_client().images.remove(image, force=True)


@pytest.fixture
def host_service():
    """An HTTP server of the host on every interface (0.0.0.0), on a free port: what containers must not reach."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"host-secret-service"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def bridge_gateway() -> str:
    """The address of the host on Docker's default bridge (docker0), as containers see it."""
    import ipaddress

    done = subprocess.run(
        ["docker", "network", "inspect", "bridge", "-f", "{{range .IPAM.Config}}{{.Gateway}}{{end}}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    gateway = done.stdout.strip()
    if not gateway:  # some engines leave it out of the IPAM config: the bridge's own address then
        done = subprocess.run(["ip", "-o", "-4", "addr", "show", "docker0"], capture_output=True, text=True)
        fields = done.stdout.split()
        gateway = fields[fields.index("inet") + 1].split("/")[0] if "inet" in fields else ""
    # Never aim at anything but this machine's bridge address.
    assert gateway and ipaddress.ip_address(gateway).is_private, (
        f"no docker bridge address found: {gateway!r}"
    )
    return gateway


def container_gateway(box) -> str:
    """The container's default gateway, as its routing table says."""
    routes = box.run("ip route", timeout_s=30).output.split()
    return routes[routes.index("default") + 2]


def hub_or_skip() -> None:
    from batchrun.prompt.sandboxes.docker.sandbox import network_hub_problem

    if network_hub_problem():
        skip_or_fail(f"containers cannot be put on the network hub here: {network_hub_problem()}")


FETCH = 'printf "GET / HTTP/1.0\\r\\n\\r\\n" | nc -w 5 {host} {port}; echo "nc-exit=$?"'


@pytest.mark.docker
@pytest.mark.parametrize("network", ["off", "hub", "bridge"])
def test_host_services_are_out_of_reach_of_a_container(
    docker_box, host_service, outside_host, metadata_host, network
):
    """A host service on 0.0.0.0 answers no container on the network hub (the default), through its
    gateway, the bridge's address or any other address of the host, nor does a cloud's metadata address
    (169.254.169.254), while the outside world does and
    DNS is the hub's. Off: loopback alone. On Docker's bridge (``network_hub`` off, the fallback where
    the runner cannot use the hub): the host's services answer through the bridge (what README says)."""
    from batchrun.prompt.sandboxes.local.host import host_addresses
    from batchrun.prompt.sandboxes.local.network_hub import PROMPT_NET

    if network == "hub":
        hub_or_skip()
    options = {"network_hub": False} if network == "bridge" else None
    box = docker_box(index=43, network=network != "off", options=options)
    # busybox nc, not wget: the static busybox's wget crashes on any URL.
    if network == "off":
        res = box.run(FETCH.format(host=bridge_gateway(), port=host_service), timeout_s=30)
        assert "Network is unreachable" in res.output and "host-secret-service" not in res.output
        assert "eth0" not in box.run("ip -o addr", timeout_s=30).output  # loopback alone: no route anywhere
        return
    reached = box.run(FETCH.format(host=outside_host[0], port=outside_host[1]), timeout_s=30).output
    assert reached.startswith("hello from outside"), reached  # the network works
    if network == "bridge":
        res = box.run(FETCH.format(host=bridge_gateway(), port=host_service), timeout_s=30)
        assert "host-secret-service" in res.output and box.network_address is None
        return
    assert box.network_address is not None and ipaddress.ip_address(box.network_address) in PROMPT_NET
    gateway = container_gateway(box)
    assert gateway == "10.0.2.2"
    assert box.run("cat /etc/resolv.conf", timeout_s=30).output == "nameserver 10.0.2.3\n"  # slirp's DNS
    hosts = [bridge_gateway(), *(a for a in host_addresses() if ":" not in a)]
    for host in dict.fromkeys(hosts):
        with socket.create_connection((host, host_service), timeout=5):
            pass  # it answers on the host
    for host in dict.fromkeys([gateway, *hosts]):  # the gateway: slirp4netns's, not the host's loopback
        res = box.run(FETCH.format(host=host, port=host_service), timeout_s=30)
        assert "host-secret-service" not in res.output and "nc-exit=1" in res.output, (host, res)
    # Nor the link-local range where clouds serve their metadata and credentials (the host reaches it).
    with socket.create_connection(metadata_host, timeout=5):
        pass
    res = box.run(FETCH.format(host=metadata_host[0], port=metadata_host[1]), timeout_s=30)
    assert "hello from outside" not in res.output and "nc-exit=1" in res.output, res


@pytest.mark.docker
def test_the_run_says_how_its_containers_are_networked(docker_engine, monkeypatch, capsys):
    """Once, at the run's start: the hub where this machine allows it; else the bridge, with why and
    what that lets a container reach (README's fallback); the network off or a network of the user's
    own: as asked, nothing said."""
    from batchrun.prompt.sandboxes.docker import sandbox as docker_sandbox
    from batchrun.prompt.sandboxes.docker.engine import engine_processes_problem
    from batchrun.prompt.sandboxes.local import network_hub

    hub_or_skip()
    bridge = {"network_mode": "bridge", "default_image": "x"}
    assert docker_sandbox._network_in_force(bridge, workers_here=True) == bridge
    said = capsys.readouterr().out
    assert said.startswith(
        "Docker network: each container on a link of its own into its worker's slirp4netns"
    )
    for options in ({"network_mode": "none"}, {"network_mode": "my-net"}, {**bridge, "network_hub": False}):
        assert docker_sandbox._network_in_force(options, workers_here=True) == options
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(network_hub, "ENABLED", False)
    assert docker_sandbox._network_in_force(bridge, workers_here=True) == {**bridge, "network_hub": False}
    said = capsys.readouterr().out
    assert said.startswith("warning: Docker containers with the network on sit on Docker's default bridge "
                           "(BATCH_RUNNER_NETWORK_HUB=0): they reach every host service listening on 0.0.0.0")  # fmt: skip
    monkeypatch.setenv("DOCKER_HOST", "tcp://192.0.2.200:2375")
    assert engine_processes_problem({}) == "the engine is reached over tcp (maybe on another machine)"
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    assert "cannot be asked who serves it" in (engine_processes_problem({}) or "")


@pytest.mark.docker
def test_statistics_and_the_report_say_the_containers_network(
    server, docker_test_image, tmp_path, monkeypatch, capsys
):
    """Whether a run's containers were on the worker's hub, on Docker's bridge (the fallback, with a
    warning at the start) or off was said only on the start line and in the log; statistics.json's
    sandbox_network and the report's settings now say it, as the containers had it (the hub's DNS
    10.0.2.3 in the container's resolv.conf, the bridge's not)."""
    from helpers import read_jsonl, run, stats_of, write_rows

    from batchrun.prompt.sandboxes.docker.sandbox import network_kind
    from batchrun.prompt.sandboxes.local import network_hub

    hub_or_skip()
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "[run:cat /etc/resolv.conf]"}])

    def network_of(run_name: str, **kw) -> tuple[str, str]:
        run(server, dataset, tmp_path / "data", run_name, sandbox="docker", default_image=docker_test_image,
            num_workers=1, **kw)  # fmt: skip
        capsys.readouterr()
        run_dir = tmp_path / "data" / run_name
        (record,) = read_jsonl(run_dir / "trajectories.jsonl")
        said = stats_of(run_dir)["sandbox_network"]
        assert f"<td>sandbox_network</td><td>{said}</td>" in (run_dir / "report.html").read_text()
        return said, record["conversations"][3]["value"]

    said, resolv = network_of("hub")
    assert said == "hub" and "nameserver 10.0.2.3" in resolv
    assert network_of("off", sandbox_network=False)[0] == "off"
    monkeypatch.setattr(network_hub, "ENABLED", False)  # BATCH_RUNNER_NETWORK_HUB=0: the bridge
    said, resolv = network_of("bridge")
    assert said == "bridge" and "nameserver" in resolv and "10.0.2.3" not in resolv
    bridge = {"network_mode": "bridge"}
    assert network_kind(bridge, workers_here=False) == "per_node"  # Ray: each node decides
    assert network_kind({"network_mode": "my-net"}, workers_here=True) == "docker:my-net"


# udp listen PORT SECONDS: print each datagram that comes to PORT within SECONDS.
# udp send DST PORT TEXT: one datagram, from an ordinary socket.
# udp forge DST PORT SRC...: a datagram "forged from SRC" to DST:PORT from each SRC, through a raw
# socket (IP_HDRINCL: the kernel sends the source it is given); exit 0 once every one was sent.
UDP = r"""
#include <arpa/inet.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
int main(int argc, char **argv) {
    struct sockaddr_in at = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3 - (argv[1][0] == 'l')]))};
    if (argv[1][0] == 'l') {
        int s = socket(AF_INET, SOCK_DGRAM, 0);
        if (s < 0 || bind(s, (struct sockaddr *)&at, sizeof at) < 0) { perror("bind"); return 2; }
        time_t end = time(NULL) + atoi(argv[3]);
        struct timeval tv = {1, 0};
        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char buf[200];
        while (time(NULL) < end) {
            long n = recv(s, buf, sizeof buf - 1, 0);
            if (n > 0) { buf[n] = 0; printf("%s", buf); fflush(stdout); }
        }
        return 0;
    }
    inet_pton(AF_INET, argv[2], &at.sin_addr);
    if (argv[1][0] == 's') {
        int s = socket(AF_INET, SOCK_DGRAM, 0);
        return sendto(s, argv[4], strlen(argv[4]), 0, (struct sockaddr *)&at, sizeof at) < 0;
    }
    int s = socket(AF_INET, SOCK_RAW, IPPROTO_RAW);
    if (s < 0) { perror("socket"); return 2; }
    int failed = 0;
    for (int i = 4; i < argc; i++) {
        unsigned char packet[96] = {0};
        struct iphdr *ip = (struct iphdr *)packet;
        struct udphdr *udp = (struct udphdr *)(packet + 20);
        int len = snprintf((char *)packet + 28, 64, "forged from %s\n", argv[i]);
        ip->version = 4; ip->ihl = 5; ip->ttl = 64; ip->protocol = IPPROTO_UDP;
        ip->tot_len = htons(28 + len); ip->saddr = inet_addr(argv[i]); ip->daddr = at.sin_addr.s_addr;
        udp->source = htons(4242); udp->dest = at.sin_port; udp->len = htons(8 + len);
        if (sendto(s, packet, 28 + len, 0, (struct sockaddr *)&at, sizeof at) < 0) { perror(argv[i]); failed = 1; }
    }
    return failed;
}
"""


@pytest.mark.docker
@pytest.mark.parametrize("net_raw", [False, True], ids=["default", "net_raw-kept"])
def test_containers_on_the_hub_do_not_reach_each_other(docker_box, tmp_path: Path, net_raw: bool):
    """B listens on TCP and UDP on all its addresses; A cannot connect to it, and with CAP_NET_RAW
    (``net_raw``) no datagram A sends with its own or a forged source (B's, the gateway's, the host's,
    an outside one) reaches it: each link is a point-to-point pair, the hub forwards nothing from one
    prompt to another and drops what did not come from the link's own address. B's listeners do take
    B's own connection and datagram afterwards. On the bridge all of it went through."""
    from batchrun.prompt.sandboxes.local.host import host_addresses

    hub_or_skip()
    udp = static_program(tmp_path, UDP) if net_raw else b""
    options = {"net_raw": True} if net_raw else None
    a, b = docker_box(index=51, options=options), docker_box(index=52, options=options)
    mine, theirs = a.network_address, b.network_address
    assert mine and theirs and mine != theirs
    listen = f"(timeout 12 nc -l -p 9000 >/tmp/tcp 2>&1 &); sleep 8; echo own-tcp | nc -w 2 {theirs} 9000"
    if net_raw:
        for box in (a, b):
            assert box.run_exec("cat > /udp && chmod 755 /udp", timeout_s=60, stdin=udp).exit_code == 0
        listen = f"(/udp listen 9001 12 >/tmp/udp &); {listen}; /udp send {theirs} 9001 own-udp"
    out: dict = {}
    thread = threading.Thread(
        target=lambda: out.update(b=b.run(f"{listen}; sleep 4; cat /tmp/tcp /tmp/udp", timeout_s=60).output)
    )
    thread.start()
    try:
        time.sleep(2)  # B's listeners are up
        said = a.run(f"echo from-a | nc -w 3 {theirs} 9000; echo nc-exit=$?", timeout_s=30).output
        assert "nc-exit=1" in said, said
        if net_raw:
            sources = [mine, theirs, "10.0.2.2", "10.0.2.3", "198.18.255.254", "203.0.113.9"]
            sources += [h for h in host_addresses() if ":" not in h]
            res = a.run(f"/udp forge {theirs} 9001 {' '.join(sources)}", timeout_s=30)
            assert res.exit_code == 0, res  # every datagram left A
    finally:
        thread.join()
    assert "from-a" not in out["b"] and "forged" not in out["b"], out["b"]
    assert "own-tcp" in out["b"] and ("own-udp" in out["b"]) == net_raw, out["b"]


@pytest.mark.docker
@pytest.mark.parametrize("net_raw", [False, True], ids=["default", "net_raw-kept"])
def test_docker_containers_have_no_raw_sockets_and_still_reach_the_network(docker_box, outside_host, net_raw):
    """With Docker's CAP_NET_RAW, root in a container forged ARP replies on the bridge (the host's entry
    for another container's address took the sender's MAC: its traffic went to the sender)."""
    box = docker_box(index=47, options={"net_raw": True} if net_raw else None)
    gateway = container_gateway(box)
    res = box.run(f"arping -c 1 -w 8 -I eth0 {gateway}", timeout_s=30)  # a packet socket
    if net_raw:
        assert res.exit_code == 0, res
    else:
        assert (res.exit_code, "socket: Operation not permitted" in res.output) == (1, True), res
    fetch = f"nc -w 15 {outside_host[0]} {outside_host[1]} </dev/null"
    assert box.run(fetch, timeout_s=30).output.startswith("hello from outside")


# ping GATEWAY: one ICMP echo through a ping socket (SOCK_DGRAM, IPPROTO_ICMP), as iputils ping sends
# it without CAP_NET_RAW: exit 0 once the reply came.
PING = r"""
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/ip_icmp.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/time.h>
int main(int argc, char **argv) {
    int s = socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
    if (s < 0) { perror("socket"); return 2; }
    struct timeval tv = {10, 0};  /* the hub's slirp4netns answers, on a loaded machine late */
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in to = {.sin_family = AF_INET};
    inet_pton(AF_INET, argv[1], &to.sin_addr);
    struct icmphdr echo = {.type = ICMP_ECHO, .un.echo.sequence = htons(1)};
    if (sendto(s, &echo, sizeof echo, 0, (struct sockaddr *)&to, sizeof to) < 0) { perror("sendto"); return 3; }
    unsigned char reply[1500];
    if (recv(s, reply, sizeof reply, 0) < (long)sizeof echo || reply[0] != ICMP_ECHOREPLY) { perror("recv"); return 4; }
    puts("echo reply");
    return 0;
}
"""


@pytest.mark.docker
def test_docker_ping_sockets_work_without_net_raw(docker_box, tmp_path: Path):
    """What iputils ping needs (Debian's, Ubuntu's): the engine opens ping sockets to every group.
    busybox's ping (Alpine's) opens a raw socket only: it fails, "permission denied (are you root?)"."""
    ping = static_program(tmp_path, PING)
    box = docker_box(index=48)
    gateway = container_gateway(box)
    assert box.run_exec("cat > /ping && chmod 755 /ping", timeout_s=60, stdin=ping).exit_code == 0
    assert box.run(f"/ping {gateway}", timeout_s=30).output == "echo reply\n"
    assert "permission denied" in box.run(f"ping -c 1 -W 2 {gateway}", timeout_s=30).output


def _inspect(container_id: str) -> dict:
    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    return docker_client().api.inspect_container(container_id)


@pytest.mark.docker
def test_remove_owned_containers_removes_every_container_of_that_owner(docker_box):
    from batchrun.prompt.sandboxes.docker.sandbox import remove_owned_containers

    owner = f"{os.getpid()}@test-{uuid.uuid4().hex[:8]}"
    docker_box(index=1, options={"run_owner": owner})
    docker_box(index=2, options={"run_owner": owner})
    assert len(docker_ps(f"batch_runner.owner={owner}")) == 2
    assert len(remove_owned_containers(owner)) == 2
    assert docker_ps(f"batch_runner.owner={owner}") == []


def test_check_engine_fails_clearly_without_an_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import batchrun.prompt.sandboxes.docker.engine as engine

    monkeypatch.setattr(engine, "_clients", {})
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(SandboxError, match=r"Docker engine not reachable.*--sandbox=local"):
        engine.check_engine()


def test_check_engine_says_when_the_socket_is_not_open_to_this_user(tmp_path: Path):
    """An engine whose socket this user may not open (not in the ``docker`` group, the usual case of a
    new user) was reported as absent: "Start dockerd", to a user whose dockerd was running. Checked
    against a real listening socket of mode 0600, from a child that is not its owner."""
    import socket as socketlib

    listener = socketlib.socket(socketlib.AF_UNIX)
    path = tmp_path / "engine.sock"
    listener.bind(str(path))
    listener.listen()
    path.chmod(0o600)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody when the test runs as root, else the socket is closed to its owner too
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            else:
                path.chmod(0)
            import batchrun.prompt.sandboxes.docker.engine as engine

            engine._clients.clear()
            os.environ["DOCKER_HOST"] = f"unix://{path}"
            try:
                engine.check_engine()
                said = "reached"
            except SandboxError as exc:
                said = str(exc)
            os.write(write_end, said.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    listener.close()
    assert "Start dockerd" not in said
    assert f"socket {path} is not open to this user" in said and "usermod -aG" in said, said
    assert said.endswith("or choose --sandbox=local"), said


@pytest.mark.docker
def test_docker_overhead_per_prompt(docker_test_image: str):
    """Prints the create+start+remove time of one prompt's container (run with -s); asserts nothing on time."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    timings = []
    for index in range(8):
        started = time.perf_counter()
        box = DockerSandbox(SandboxSpec(RUN, index), default_image=docker_test_image)
        box.start()
        box.stop()
        timings.append(time.perf_counter() - started)
    print(
        f"\ndocker sandbox create+start+remove: median {statistics.median(timings):.3f}s, max {max(timings):.3f}s"
    )
    assert docker_ps(f"batch_runner.run_name={RUN}") == []


# ============================================================================ local
@pytest.mark.bwrap
def test_rm_rf_root_inside_bwrap_leaves_host_intact(bwrap_available: None, tmp_path: Path):
    from batchrun.prompt.sandboxes.local import LocalSandbox

    # In a system directory: visible (read-only) inside, unlike every other host directory.
    victim = Path(tempfile.mkdtemp(prefix="br-victim-", dir="/usr/local/share"))
    try:
        (victim / "keep.txt").write_text("keep")
        box = LocalSandbox(SandboxSpec(RUN, 0), isolation="bwrap", base_dir=str(tmp_path))
        box.start()
        try:
            probe = box.run(
                f"cat {victim}/keep.txt; touch {victim}/new; mount -o remount,rw / ; touch {victim}/new2",
                timeout_s=20,
            )
            if (
                box.isolation != "bwrap"
                or (victim / "new").exists()
                or (victim / "new2").exists()
                or "keep" not in probe.output
            ):
                pytest.fail(f"host is writable from the sandbox; not running rm -rf /: {probe.output}")
            box.run("echo mine > mine.txt", timeout_s=20)
            box.run("rm -rf / --no-preserve-root", timeout_s=300)
            assert (victim / "keep.txt").read_text() == "keep"
            assert Path("/etc/passwd").exists() and Path(sys.executable).exists()
            assert box.run("cat mine.txt", timeout_s=20).exit_code != 0  # rm did run: the workdir was emptied
        finally:
            box.stop()
    finally:
        shutil.rmtree(victim, ignore_errors=True)


def test_local_isolation_choice(monkeypatch: pytest.MonkeyPatch):
    import batchrun.prompt.sandboxes.local as local
    from batchrun.prompt.sandboxes.local import host, sandbox

    for module in (host, sandbox):  # the probe, and the sandbox's own reference to it
        monkeypatch.setattr(module, "bwrap_problem", lambda: "bubblewrap is not installed")
    assert not local.local_isolation_available()
    assert local.LocalSandbox(SandboxSpec(RUN, 0)).isolation == "none"
    box = local.LocalSandbox(SandboxSpec(RUN, 0), isolation="bwrap")
    with pytest.raises(SandboxError, match="'bwrap' was requested but bubblewrap is not installed"):
        box.start()
    box.stop()


def test_local_bwrap_is_chosen_when_available(bwrap_available: None):
    from batchrun.prompt.sandboxes.local import LocalSandbox, local_isolation_available

    assert local_isolation_available()
    assert LocalSandbox(SandboxSpec(RUN, 0)).isolation == "bwrap"
    assert LocalSandbox(SandboxSpec(RUN, 0), isolation="none").isolation == "none"


def test_local_none_stop_kills_background_processes(tmp_path: Path):
    from batchrun.prompt.sandboxes.local import LocalSandbox

    box = LocalSandbox(SandboxSpec(RUN, 0), isolation="none", base_dir=str(tmp_path))
    box.start()
    tag = 40_000 + os.getpid() % 10_000
    box.run(f"sleep {tag} >/dev/null 2>&1 &", timeout_s=20)
    assert f"sleep {tag}" in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    box.stop()
    time.sleep(0.2)
    assert f"sleep {tag}" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


# ============================================================================ Singularity (fake CLI)
def apptainer_calls(home: Path) -> list[list[str]]:
    return [json.loads(line) for line in (home / "argv.log").read_text().splitlines()]


def test_singularity_cli_calls(fake_apptainer: Path, tmp_path: Path):
    from batchrun.prompt.sandboxes.singularity import SingularitySandbox

    spec = SandboxSpec(RUN, 3, image="ubuntu:22.04", cwd="/srv/app", network=False, env={"A": "1"})
    box = SingularitySandbox(spec, base_dir=str(tmp_path))
    box.start()
    assert box.run("pwd; echo $A", timeout_s=20).output == "/srv/app\n1\n"
    name = box.instance
    box.stop()
    box.stop()
    start, mkdir, run, stop = apptainer_calls(fake_apptainer)
    overlay = start[start.index("--overlay") + 1]
    assert start[:3] == ["instance", "start", "--containall"] and overlay.startswith(str(tmp_path))
    assert start[-2:] == ["docker://ubuntu:22.04", name] and "--network" in start and "none" in start
    assert mkdir == ["exec", "--cleanenv", f"instance://{name}", "mkdir", "-p", "/srv/app"]
    assert run[:4] == ["exec", "--cleanenv", "--pwd", "/srv/app"] and "--env=A=1" in run
    assert run[run.index(f"instance://{name}") + 1 :] == ["sh", "-c", "pwd; echo $A"]
    assert stop == ["instance", "stop", "--force", name]
    assert not Path(overlay).exists()


@pytest.mark.parametrize(
    ("overlay", "expected"),
    [("tmpfs", ["--writable-tmpfs"]), ("image", ["--overlay"])],
)
def test_singularity_overlay_kinds(fake_apptainer: Path, tmp_path: Path, overlay: str, expected: list[str]):
    from batchrun.prompt.sandboxes.singularity import SingularitySandbox

    box = SingularitySandbox(SandboxSpec(RUN, 0), overlay=overlay, overlay_size_mb=64, base_dir=str(tmp_path))
    box.start()
    box.stop()
    calls = apptainer_calls(fake_apptainer)
    start = next(call for call in calls if call[:2] == ["instance", "start"])
    assert all(flag in start for flag in expected)
    if overlay == "image":
        assert ["overlay", "create", "--size", "64"] == calls[0][:4]


@pytest.mark.parametrize(
    ("image", "ref"),
    [
        ("python:3.11", "docker://python:3.11"),
        ("ghcr.io/org/img:tag", "docker://ghcr.io/org/img:tag"),
        ("docker://ubuntu", "docker://ubuntu"),
        ("library://alpine", "library://alpine"),
        ("docker-daemon:local:latest", "docker-daemon:local:latest"),
        ("/images/tool.sif", "/images/tool.sif"),
        ("tool.sif", "tool.sif"),
    ],
)
def test_singularity_image_refs(image: str, ref: str):
    from batchrun.prompt.sandboxes.singularity import image_ref

    assert image_ref(image) == ref


def test_singularity_without_cli_fails_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from batchrun.prompt.sandboxes.singularity import SingularitySandbox

    monkeypatch.setenv("PATH", str(tmp_path))
    box = SingularitySandbox(SandboxSpec(RUN, 0))
    with pytest.raises(SandboxError, match="not found on PATH"):
        box.start()
    box.stop()


# ============================================================================ Modal (fake SDK)
def test_modal_sdk_calls(fake_modal):
    from batchrun.prompt.sandboxes.modal import ModalSandbox

    spec = SandboxSpec(RUN, 0, image="python:3.12-slim", cwd="proj", network=False, env={"A": "1"})
    box = ModalSandbox(spec, cpu=2.0, memory_mb=1024, timeout_s=900, app_name="br-test")
    box.start()
    assert box.run("pwd; echo $A", timeout_s=20).output == "/workspace/proj\n1\n"
    box.stop()
    box.stop()
    calls = dict(fake_modal.calls[:4])
    assert calls["App.lookup"] == {"name": "br-test", "create_if_missing": True}
    assert calls["Image.from_registry"] == {"tag": "python:3.12-slim"}
    create = calls["Sandbox.create"]
    assert (create["cpu"], create["memory"], create["timeout"], create["block_network"]) == (
        2.0,
        1024,
        900,
        True,
    )
    execs = [args for name, args in fake_modal.calls if name == "Sandbox.exec"]
    assert execs[0]["args"] == ("mkdir", "-p", "/workspace/proj")
    assert (
        execs[1]["workdir"] == "/workspace/proj" and execs[1]["text"] is False and execs[1]["timeout"] == 20
    )
    assert [name for name, _ in fake_modal.calls].count("Sandbox.terminate") == 1


def test_modal_without_the_sdk_fails_clearly(monkeypatch: pytest.MonkeyPatch):
    from batchrun.prompt.sandboxes.modal import ModalSandbox

    monkeypatch.setitem(sys.modules, "modal", None)  # makes "import modal" raise ImportError
    box = ModalSandbox(SandboxSpec(RUN, 0))
    with pytest.raises(SandboxError, match=r"pip install 'batch-runner\[modal\]'"):
        box.start()
    box.stop()


# ============================================================================ options
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_unknown_option_is_rejected_with_the_valid_ones(backend: str):
    with pytest.raises(
        ValueError, match=r"unknown .* option\(s\): colour; valid options: .*output_cap_bytes"
    ):
        create_sandbox(backend, SandboxSpec(RUN, 0), {"colour": "blue"})


@pytest.mark.parametrize(
    ("backend", "options", "field"),
    [
        ("docker", {"cpus": "two"}, "cpus"),
        ("docker", {"memory_mb": 0}, "memory_mb"),
        ("docker", {"init": "yes"}, "init"),
        ("docker", {"disk_mb": 0}, "disk_mb"),
        ("docker", {"disk_cap": "quota"}, "disk_cap"),
        ("docker", {"lifetime_s": 0}, "lifetime_s"),
        ("local", {"isolation": "maybe"}, "isolation"),
        ("local", {"output_cap_bytes": 1.5}, "output_cap_bytes"),
        ("singularity", {"overlay": "zfs"}, "overlay"),
        ("modal", {"timeout_s": -1}, "timeout_s"),
    ],
)
def test_bad_option_value_names_the_field(backend: str, options: dict, field: str):
    with pytest.raises(ValueError, match=field):
        create_sandbox(backend, SandboxSpec(RUN, 0), options)


@pytest.mark.parametrize("value", [0, -5, "big", 1.5])
def test_container_disk_mb_must_be_a_positive_int(tmp_path: Path, capsys, value):
    import batch_runner

    dataset = tmp_path / "p.jsonl"
    dataset.write_text('{"prompt": "x"}\n')
    code = batch_runner.main(
        dataset_file=str(dataset), batch_size=1, run_name="disk", sandbox="docker",
        container_disk_mb=value, output_dir=str(tmp_path / "data"), base_url="http://127.0.0.1:9/v1",
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "--container_disk_mb must be an integer from 16 to" in err and str(value) in err


def test_docker_options_from_the_flags_carry_the_disk_cap_and_a_lifetime_past_the_prompt_timeout():
    from batchrun.prompt.limiter import MAX_SLOT_WAIT_S
    from batchrun.prompt.sandboxes.base import SandboxFlags
    from batchrun.prompt.sandboxes.docker.sandbox import LIFETIME_MARGIN_S, DockerSandbox

    flags = SandboxFlags(default_image="img", network=False, disk_mb=300, prompt_timeout_s=1800.0)
    options = DockerSandbox.options_from(flags)
    assert options["disk_mb"] == 300 and options["network_mode"] == "none"
    # past the prompt's timeout by its credited waits for a request slot too
    assert options["lifetime_s"] == 2 * 1800.0 + MAX_SLOT_WAIT_S + LIFETIME_MARGIN_S


def test_a_modal_sandbox_outlives_its_prompt_as_a_docker_container_does(fake_modal):
    """Modal's lifetime was fixed at 3600 s whatever --prompt_timeout said: a prompt of 3600 s or more,
    or one of 1800 s that had waited for a request slot (credited up to MAX_SLOT_WAIT_S), lost its
    sandbox at its next command. It is now Docker's: 2 x the timeout + MAX_SLOT_WAIT_S + a margin,
    within Modal's 24 hours."""
    from batchrun.prompt.limiter import MAX_SLOT_WAIT_S
    from batchrun.prompt.sandboxes.base import SandboxFlags
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox
    from batchrun.prompt.sandboxes.modal import MODAL_MAX_TIMEOUT_S, ModalSandbox

    for timeout in (30.0, 1800.0, 7200.0, 40_000.0):
        flags = SandboxFlags(prompt_timeout_s=timeout)
        options = ModalSandbox.options_from(flags)
        expected = min(MODAL_MAX_TIMEOUT_S, DockerSandbox.options_from(flags)["lifetime_s"])
        assert options["timeout_s"] == expected > timeout + MAX_SLOT_WAIT_S
        box = ModalSandbox(SandboxSpec(RUN, 0), **options)
        box.start()
        box.stop()
        create = dict(fake_modal.calls)["Sandbox.create"]
        assert create["timeout"] == expected
        fake_modal.calls.clear()
    with pytest.raises(ValueError, match="--prompt_timeout=86000 is longer than a Modal sandbox can live"):
        ModalSandbox.options_from(SandboxFlags(prompt_timeout_s=86000.0))


# ---------------------------------------------------------------------------- local: the per-prompt command server
@pytest.fixture
def bwrap_box(bwrap_available: None, tmp_path: Path):
    from batchrun.prompt.sandboxes.local import LocalSandbox

    box = LocalSandbox(SandboxSpec(RUN, 0), isolation="bwrap", base_dir=str(tmp_path))
    box.start()
    yield box
    box.stop()


def _pids_in_namespace(box) -> list[str]:
    """Names of the live processes other than bwrap (PID 1), the server (2) and the probe itself.

    Zombies do not count: a killed process stays listed until bwrap's init reaps it.
    """
    out = box.run("exec cat /proc/[0-9]*/stat 2>/dev/null", timeout_s=20).output
    names = []
    for line in out.splitlines():
        pid, rest = line.split(" (", 1)
        comm, state = rest.rsplit(") ", 1)[0], rest.rsplit(") ", 1)[1][:1]
        if pid not in ("1", "2") and state != "Z" and comm != "cat":
            names.append(comm)
    return sorted(names)


@pytest.mark.bwrap
def test_bwrap_one_namespace_per_prompt_but_nothing_outlives_a_command(bwrap_box):
    from batchrun.prompt.sandboxes.local.host import command_shell

    server_pid = bwrap_box._server.proc.pid
    started = bwrap_box.run("sleep 300 & setsid sleep 301 & (sleep 302 &) ; echo started", timeout_s=20)
    assert started.output == "started\n" and started.exit_code == 0
    left = _pids_in_namespace(bwrap_box)
    assert "sleep" not in left, left  # setsid and double forks included: every leftover was killed
    assert bwrap_box.run("cd / && export X=1 && echo $X", timeout_s=20).output == "1\n"
    fresh = bwrap_box.run('echo "$X|$(pwd)|$SHLVL|$0"', timeout_s=20).output
    assert fresh == f"|{bwrap_box.workdir}|1|{command_shell()}\n"  # $0 as with a plain `bash -c`
    assert bwrap_box._server.proc.pid == server_pid  # no new bubblewrap per command


@pytest.mark.bwrap
def test_bwrap_command_env_matches_unisolated_and_hides_the_server(bwrap_box, tmp_path: Path):
    from batchrun.prompt.sandboxes.local import LocalSandbox

    plain = LocalSandbox(SandboxSpec(RUN, 1), isolation="none", base_dir=str(tmp_path))
    plain.start()
    try:

        def names(box) -> set[str]:
            return {line.split("=", 1)[0] for line in box.run("env", timeout_s=20).output.splitlines()}

        assert names(bwrap_box) == names(plain)
        shell_vars = bwrap_box.run("set", timeout_s=20).output
        assert "ctl=" not in shell_vars and "tok=" not in shell_vars and "batch-runner-exit" not in shell_vars
    finally:
        plain.stop()


@pytest.mark.bwrap
def test_bwrap_path_has_no_directory_the_agent_may_write(bwrap_available, tmp_path: Path, monkeypatch):
    """A host PATH entry in the working directory (a dev container's /workspace/.venv/bin), /tmp or the
    current directory: the agent's `python3` there would have run in place of the system's for the verify."""
    from batchrun.prompt.sandboxes.local import LocalSandbox

    planted = "/workspace/.venv/bin:/tmp/bin::bin:/workspace/../workspace/x"
    monkeypatch.setenv("PATH", f"{planted}:{os.environ['PATH']}")
    box = LocalSandbox(SandboxSpec(RUN, 2), isolation="bwrap", base_dir=str(tmp_path))
    box.start()
    try:
        plant = "printf '#!/bin/sh\\necho planted\\n' > python3 && chmod +x python3"
        for where in (".venv/bin", "/tmp/bin", "bin", "x", "."):
            box.run(f"mkdir -p {where} && cd {where} && {plant}", timeout_s=20)
        res = box.run('python3 -c "print(1)"; echo "$PATH"', timeout_s=20)
        assert res.output == f"1\n{os.environ['PATH'].removeprefix(planted + ':')}\n", res
    finally:
        box.stop()


@pytest.mark.bwrap
def test_bwrap_timeout_kills_the_command_but_keeps_the_prompt_s_files(bwrap_box):
    server = bwrap_box._server.proc.pid
    bwrap_box.run("echo kept > notes.txt", timeout_s=20)
    res = bwrap_box.run("echo partial; sleep 60 & sleep 60", timeout_s=1)
    assert res.timed_out and res.exit_code == -1 and "partial" in res.output
    assert "Killed" not in res.output  # not the server's own notes
    after = bwrap_box.run("cat notes.txt; exit 3", timeout_s=20)
    assert (after.output, after.exit_code, after.timed_out) == ("kept\n", 3, False)
    assert bwrap_box._server.proc.pid == server
    assert "sleep" not in _pids_in_namespace(bwrap_box)


@pytest.mark.bwrap
@pytest.mark.parametrize("killer", ["kill -9 $PPID", "kill -9 -1", "kill -9 1"])
def test_bwrap_command_cannot_end_the_server_or_lose_the_files(bwrap_box, killer: str):
    """The server is the namespace's PID 1: no signal from inside reaches it."""
    bwrap_box.run("echo kept > notes.txt", timeout_s=20)
    res = bwrap_box.run(f"echo before; {killer}; echo after", timeout_s=20)
    assert res.output.startswith("before\n") and res.output.endswith("after\n") and not res.timed_out
    assert bwrap_box.run("cat notes.txt", timeout_s=20).output == "kept\n"


@pytest.mark.bwrap
def test_bwrap_namespace_killed_from_outside_is_reported_and_replaced(bwrap_box):
    import threading

    server = bwrap_box._server
    threading.Timer(0.5, lambda: os.kill(server.proc.pid, 9)).start()
    res = bwrap_box.run("echo before; sleep 10; echo never", timeout_s=20)
    assert res.output.startswith("before\n") and "never" not in res.output
    assert "ended during this command" in res.output and res.exit_code == 137 and not res.timed_out
    assert bwrap_box.run("echo again", timeout_s=20).output == "again\n"
    assert bwrap_box._server is not server


@pytest.mark.bwrap
def test_bwrap_rm_rf_dev_does_not_break_later_commands(bwrap_box):
    bwrap_box.run("rm -rf /dev/* 2>/dev/null; true", timeout_s=20)
    res = bwrap_box.run("cat; echo done", timeout_s=20)
    assert (res.output, res.exit_code) == ("done\n", 0)
    assert bwrap_box.run("cat", timeout_s=20, stdin=b"in\0put").output == "in\0put"


PROBE_CONNECT = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX)\n"
    "try:\n    s.connect(sys.argv[1]); print('CONNECTED')\n"
    "except OSError as e:\n    print('refused', e.errno)\n"
)


@pytest.mark.bwrap
@pytest.mark.parametrize("where", ["/etc", "/run", "/var/tmp"])
def test_bwrap_host_unix_sockets_are_out_of_reach(bwrap_available: None, tmp_path: Path, where: str):
    """A read-only bind does not stop connect(): a daemon's socket would hand the model the host.

    In /run or /var the sandbox sees an empty directory; in /etc (mounted read-only) the socket
    is masked."""
    from batchrun.prompt.sandboxes.local import LocalSandbox
    from batchrun.prompt.sandboxes.local.host import system_sockets

    home = Path(tempfile.mkdtemp(prefix="br-sock-", dir=where))
    path = home / "daemon.sock"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        server.listen(1)
        assert (str(path) in system_sockets()) == (where == "/etc")
        box = LocalSandbox(SandboxSpec(RUN, 0), isolation="bwrap", base_dir=str(tmp_path))
        box.start()
        try:
            res = box.run(f"/usr/bin/python3 -c {shlex.quote(PROBE_CONNECT)} {path}", timeout_s=30)
        finally:
            box.stop()
        assert res.output.startswith("refused"), res.output
        with socket.socket(socket.AF_UNIX) as client:  # the host itself still reaches it
            client.connect(str(path))
    finally:
        server.close()
        shutil.rmtree(home, ignore_errors=True)


def test_command_server_refuses_to_run_outside_its_own_pid_namespace(tmp_path: Path):
    """Its `kill -9 -1` after each command is only safe as PID 2 of the prompt's namespace."""
    from batchrun.prompt.sandboxes.local.command_server import CommandServer

    victim = subprocess.Popen(["sleep", "30"])
    try:
        done = subprocess.run(
            CommandServer.argv(str(tmp_path), "READY"),
            input=b"1 tok 0\n",
            capture_output=True,
            timeout=20,
        )
        assert done.returncode == 97
        assert b"not in its own PID namespace" in done.stderr and b"READY" not in done.stdout
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.bwrap
def test_bwrap_timeout_kill_never_reaches_host_processes(bwrap_box):
    """The host-side kill scans for the server's PID namespace: with a wrong PID it must not scan
    the host's (which would kill every process here), but end the sandbox's namespace instead."""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        server = bwrap_box._server
        server._pid = bystander.pid  # a host process, in the host's PID namespace
        server.kill_commands()
        assert bystander.poll() is None and not server.alive()
    finally:
        bystander.kill()
        bystander.wait()
    assert bwrap_box.run("echo next", timeout_s=20).output == "next\n"  # a new namespace


@pytest.mark.parametrize("cwd", ["/workspace/..", "/.", "//", "///"])
def test_a_docker_cwd_naming_the_root_is_refused_before_the_engine_is_asked(cwd):
    """'/workspace/..', '/.' and '//' were not '/' to the check, so each prompt's start asked the engine
    five times for a tmpfs at '/' ("destination can't be '/'"), after its first model call."""
    from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox

    box = DockerSandbox(SandboxSpec("r", 0, cwd=cwd), disk_cap="tmpfs")
    assert box.workdir == "/"
    with pytest.raises(SandboxError, match="cannot be /"):
        box.create_kwargs("")
    assert DockerSandbox(SandboxSpec("r", 0, cwd="//srv/./app/")).workdir == "/srv/app"
    assert DockerSandbox(SandboxSpec("r", 0)).workdir == "/workspace"


@pytest.mark.parametrize("image", ["/", ".", "/etc", "/dev/null"])
def test_a_row_may_not_make_a_host_directory_or_device_the_container(
    fake_apptainer: Path, tmp_path: Path, image: str
):
    """A row's image is untrusted: "/" was run as a sandbox directory, the host's whole file system
    (the runner's keys too) as the prompt's container. Refused at preflight, before any model call,
    and at start; an image file and remote images stay allowed, and --default_image may be a directory."""
    from batchrun.prompt.sandboxes.singularity import SingularitySandbox

    jobs = [SimpleNamespace(prompt_index=0, image=image), SimpleNamespace(prompt_index=1, image="alpine:3")]
    sif = tmp_path / "tool.sif"
    sif.write_bytes(b"SIF")
    jobs.append(SimpleNamespace(prompt_index=2, image=str(sif)))
    found = SingularitySandbox.preflight(jobs, {}, real_model=True, network=True)
    assert set(found.failed) == {0} and repr(image) in found.failed[0]
    box = SingularitySandbox(SandboxSpec(RUN, 0, image=image), base_dir=str(tmp_path))
    with pytest.raises(SandboxError, match="a row may not make one the container|no regular file"):
        box.start()
    box.stop()
    assert not (fake_apptainer / "argv.log").exists() or not apptainer_calls(fake_apptainer)
    own = SingularitySandbox(SandboxSpec(RUN, 1), default_image=str(tmp_path), base_dir=str(tmp_path))
    own.start()  # the user's own --default_image directory
    own.stop()
