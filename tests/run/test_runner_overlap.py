"""Sandbox start and stop off a prompt's path (batchrun/prompt/sandbox_lifecycle.py, batchrun/prompt/attempt.py::run_prompt).

For every backend, the sandbox starts on a start-up slot while the prompt's first model call is in
flight; for every backend but local (whose stop takes a few ms), it is stopped by a background
stopper (in the workers) after the outcome went out. The
orderings are checked with a scripted sandbox whose start is gated on what the fake endpoint saw, so
no test depends on timing; then with real Docker: no container of a run survives it, whether it ends
normally, with a failed start, with prompts that never called a tool, or with Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import default_sigint, docker_ps, read_jsonl, wait_for, write_jsonl

import batch_runner
import batchrun.prompt.attempt as runner_mod
from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.attempt import WorkerSettings, run_prompt
from batchrun.prompt.llm import LLMClient, LLMConfig
from batchrun.prompt.loop import LoopLimits
from batchrun.prompt.sandbox_lifecycle import BackgroundStart, BackgroundStopper, StartPool
from batchrun.prompt.sandboxes import backend_class
from batchrun.prompt.sandboxes.base import ExecResult, SandboxError, SandboxSpec
from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox
from batchrun.protocol import PromptJob

REPO = Path(__file__).resolve().parents[2]
GATE_S = 30.0  # longest a gated start waits for its condition before it gives up (the test then fails)


def start_threads_alive() -> bool:
    return any(t.name.startswith("sandbox-start") and t.is_alive() for t in threading.enumerate())


# ----------------------------------------------------------------------------- a scripted sandbox


class ScriptedSandbox:
    """Every command prints "ok"; ``start`` runs the test's ``on_start`` (wait for a condition, fail, ...).
    ``events`` lists what happened, in order: start, started, run, stop."""

    def __init__(self, spec: SandboxSpec, on_start):
        self.spec = spec
        self.workdir = "/scripted"
        self.isolation = "scripted"
        self.on_start = on_start
        self.events: list[str] = []

    def start(self) -> None:
        self.events.append("start")
        self.on_start()
        self.events.append("started")

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        self.events.append("run")
        return ExecResult(output="ok\n", exit_code=0)

    def stop(self) -> None:
        self.events.append("stop")


class Scripted:
    """Replaces the runner's ``create_sandbox``: every prompt gets a ScriptedSandbox running ``on_start``."""

    def __init__(self) -> None:
        self.on_start = lambda: None
        self.boxes: list[ScriptedSandbox] = []

    def create(self, name: str, spec: SandboxSpec, options=None) -> ScriptedSandbox:
        box = ScriptedSandbox(spec, lambda: self.on_start())
        # As the real class of that name says: a quick start (local) stays on the prompt's thread.
        box.synchronous_start = name != "scripted" and backend_class(name).synchronous_start
        self.boxes.append(box)
        return box


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Scripted:
    s = Scripted()
    monkeypatch.setattr(runner_mod, "create_sandbox", s.create)
    return s


def settings_for(server: FakeModelServer, backend: str = "scripted", **kw) -> WorkerSettings:
    return WorkerSettings(
        run_name="overlap",
        llm=LLMConfig(model="fake", base_url=server.base_url, api_key="sk-overlap"),
        limits=LoopLimits(max_turns=6, prompt_timeout_s=120, tool_timeout_s=60),
        sandbox_backend=backend,
        **kw,
    )


def job(prompt: str, index: int = 0, image: str | None = None) -> PromptJob:
    return PromptJob(batch_num=0, prompt_index=index, prompt=prompt, toolsets=("terminal",), image=image)


# ----------------------------------------------------------------------------- the start overlaps the first model call


def test_the_first_model_call_goes_out_before_the_sandbox_start_finishes(server, scripted):
    finished_at: list[float] = []

    def start() -> None:
        # This start can only finish once the endpoint has seen the prompt's first model call; a runner
        # that waited for the start before calling the model would never get there.
        if not wait_for(lambda: server.stats()["requests"] >= 1, GATE_S, 0.02):
            raise SandboxError("the model was not called while the sandbox was starting")
        finished_at.append(time.time())

    scripted.on_start = start
    settings = settings_for(server)
    outcome = run_prompt(job("overlap please [calls:1]"), settings, LLMClient(settings.llm))
    assert outcome.kind == "trajectory", outcome.error
    assert server.stats()["first_request_at"] < finished_at[0]
    (box,) = scripted.boxes
    assert box.events == ["start", "started", "run", "stop"]  # the tool call ran on the started sandbox
    meta = outcome.record["metadata"]
    assert meta["isolation"] == "scripted"
    assert meta["sandbox_start_blocked_s"] >= 0
    for key in ("sandbox_start_wait_s", "sandbox_start_s", "sandbox_stop_s"):
        assert isinstance(meta[key], float)
    assert meta["sandbox_stop_background"] is False  # no stopper given: stopped before returning


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (SandboxError("image is gone"), "image is gone"),
        (RuntimeError("engine bug"), "RuntimeError: engine bug"),
    ],
)
def test_a_failed_background_start_fails_the_prompt_with_error_class_sandbox(
    server, scripted, error, message
):
    def start() -> None:
        raise error

    scripted.on_start = start
    settings = settings_for(server)
    outcome = run_prompt(job("needs a shell [calls:1]"), settings, LLMClient(settings.llm))
    assert outcome.kind == "failed"
    assert outcome.error_class == "sandbox"
    assert message in outcome.error
    assert outcome.usage["requests"] == 1  # the first model call overlapped the start
    (box,) = scripted.boxes
    assert box.events == ["start", "stop"]  # stop() also after a failed start: it may have created something


def test_a_synchronous_start_runs_on_a_start_pool_slot_before_any_model_call(server, scripted, monkeypatch):
    seen: list[tuple[int, str]] = []
    scripted.on_start = lambda: seen.append((server.stats()["requests"], threading.current_thread().name))

    def create(name, spec, options=None):
        box = Scripted.create(scripted, name, spec, options)
        box.synchronous_start = True  # a backend that must start before the prompt's first model call
        return box

    monkeypatch.setattr(runner_mod, "create_sandbox", create)
    settings = settings_for(server)
    pool = StartPool(1)
    outcome = run_prompt(
        job("needs a shell [calls:1]"), settings, LLMClient(settings.llm), sandbox_starts=pool
    )
    assert outcome.kind == "trajectory"
    ((requests_then, thread),) = seen
    assert requests_then == 0 and thread.startswith("sandbox-start")
    (box,) = scripted.boxes
    assert box.events == ["start", "started", "run", "stop"]


def local_settings(server: FakeModelServer, base_dir: Path) -> WorkerSettings:
    return settings_for(server, backend="local", sandbox_options={"base_dir": str(base_dir)})


def test_a_failed_local_start_fails_the_prompt_with_class_sandbox_after_its_first_model_call(
    server, tmp_path
):
    """The real local sandbox now starts alongside the first model call: a start that fails (here, a
    cwd the sandbox cannot have) fails the prompt with class sandbox at its first tool call, leaves
    nothing behind, and that one model call is counted."""
    settings = local_settings(server, tmp_path)
    bad = dataclasses.replace(job("local [calls:1]"), cwd="/proc")
    outcome = run_prompt(bad, settings, LLMClient(settings.llm))
    assert outcome.kind == "failed" and outcome.error_class == "sandbox"
    assert "cwd" in outcome.error
    assert outcome.usage["requests"] == 1 and server.stats()["requests"] == 1
    assert list(tmp_path.iterdir()) == []


def test_local_prompts_with_and_without_tool_calls_run_and_leave_nothing_behind(server, tmp_path):
    settings = local_settings(server, tmp_path)
    quiet = run_prompt(job("no tools [calls:0]", index=0), settings, LLMClient(settings.llm))
    busy = run_prompt(job("shell please [calls:1]", index=1), settings, LLMClient(settings.llm))
    assert quiet.kind == "trajectory" and quiet.record["api_calls"] == 1
    assert busy.kind == "trajectory" and busy.record["api_calls"] == 2
    assert busy.record["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    assert "step 1 of 1" in json.dumps(busy.record["conversations"])  # the command really ran
    for outcome in (quiet, busy):
        meta = outcome.record["metadata"]
        assert meta["sandbox_stop_background"] is False  # a local stop stays on the prompt's thread
        assert meta["isolation"] in ("bwrap", "none")
    # Both sandboxes stopped: their directories (br-*) are gone. (What stays is the worker's view of
    # /etc and its resolv.conf, which the run's sweep removes with the run's directory.)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("br-")] == []


# ----------------------------------------------------------------------------- prompts that never call a tool


def test_a_prompt_without_tool_calls_never_starts_a_sandbox_still_waiting_for_a_slot(server, scripted):
    slots = threading.BoundedSemaphore(1)
    slots.acquire()  # every start-up slot is taken
    settings = settings_for(server)
    outcome = run_prompt(job("no tools [calls:0]"), settings, LLMClient(settings.llm), sandbox_starts=slots)
    assert outcome.kind == "trajectory"
    slots.release()
    assert wait_for(
        lambda: not start_threads_alive(), GATE_S, 0.02
    )  # the start got its slot and found the prompt gone
    (box,) = scripted.boxes
    assert box.events == []
    meta = outcome.record["metadata"]
    assert meta["sandbox_start_s"] == 0.0 and meta["sandbox_start_blocked_s"] == 0.0


def test_a_prompt_without_tool_calls_reports_at_once_and_its_sandbox_is_stopped_after_its_start(
    server, scripted
):
    gate = threading.Event()
    scripted.on_start = lambda: gate.wait(GATE_S)
    order: list[str] = []
    stopper = BackgroundStopper(
        threads=1,
        max_pending=4,
        on_queued=lambda: order.append("queued"),
        on_done=lambda: order.append("done"),
    )
    settings = settings_for(server)
    outcome = run_prompt(
        job("no tools [calls:0]"), settings, LLMClient(settings.llm), stop_in_background=stopper.submit
    )
    returned_while_starting = not gate.is_set()
    gate.set()
    assert stopper.drain(GATE_S)
    assert returned_while_starting  # neither the start nor the stop held the outcome back
    assert outcome.kind == "trajectory"
    assert outcome.record["metadata"]["sandbox_stop_background"] is True
    (box,) = scripted.boxes
    assert box.events == ["start", "started", "stop"]  # the stop waited for the start
    assert order == ["queued", "done"]


# ----------------------------------------------------------------------------- the building blocks


def test_background_start_waits_in_run_workdir_and_isolation():
    gate = threading.Event()
    box = ScriptedSandbox(SandboxSpec("overlap", 3), lambda: gate.wait(GATE_S))
    wrapped = BackgroundStart(box)
    assert wrapped.spec.prompt_index == 3  # the spec needs no start
    wrapped.start()
    results: list = []
    reader = threading.Thread(target=lambda: results.append((wrapped.workdir, wrapped.run("x", timeout_s=5))))
    reader.start()
    assert wait_for(lambda: box.events == ["start"], GATE_S, 0.02)
    assert results == []  # still waiting for the start
    gate.set()
    reader.join(GATE_S)
    assert results and results[0][0] == "/scripted" and results[0][1].output == "ok\n"
    assert wrapped.isolation == "scripted"
    assert box.events == ["start", "started", "run"]
    wrapped.stop()
    wrapped.stop()  # idempotent
    assert box.events[-1] == "stop"


def test_a_stopper_that_is_full_makes_the_next_hand_off_wait():
    release = threading.Event()
    stopper = BackgroundStopper(threads=1, max_pending=1)
    stopper.submit(lambda: release.wait(GATE_S))
    second = threading.Thread(target=stopper.submit, args=(lambda: None,))
    second.start()
    second.join(0.2)
    assert second.is_alive() and stopper.pending == 1  # waiting for room
    release.set()
    second.join(GATE_S)
    assert stopper.drain(GATE_S) and stopper.pending == 0


# ----------------------------------------------------------------------------- real Docker


@pytest.mark.docker
def test_docker_prompts_with_and_without_tools_and_a_failed_start_leave_no_container(
    server, docker_test_image
):
    run_name = f"overlap-{os.getpid()}"
    settings = dataclasses.replace(
        settings_for(server, backend="docker", sandbox_options={"default_image": docker_test_image}),
        run_name=run_name,
    )
    llm = LLMClient(settings.llm)
    stopper = BackgroundStopper(threads=2, max_pending=8)
    try:
        used = run_prompt(job("list files [calls:1]", 0), settings, llm, stop_in_background=stopper.submit)
        unused = run_prompt(job("just answer [calls:0]", 1), settings, llm, stop_in_background=stopper.submit)
        failed = run_prompt(
            job("shell in a missing image [calls:1]", 2, image="does-not-exist-br:never"),
            settings,
            llm,
            stop_in_background=stopper.submit,
        )
        synchronous = run_prompt(job("list files [calls:1]", 3), settings, llm)  # no stopper: stops here
    finally:
        assert stopper.drain(120)
    assert docker_ps(f"batch_runner.run_name={run_name}") == []
    assert used.kind == "trajectory", used.error
    meta = used.record["metadata"]
    assert meta["isolation"] == "docker" and meta["sandbox_stop_background"] is True
    assert meta["sandbox_start_s"] > 0 and meta["sandbox_start_blocked_s"] >= 0
    assert unused.kind == "trajectory"
    assert failed.kind == "failed" and failed.error_class == "sandbox"
    assert "does-not-exist-br:never" in failed.error
    assert synchronous.kind == "trajectory"
    assert synchronous.record["metadata"]["sandbox_stop_background"] is False


@pytest.mark.docker
@pytest.mark.slow
def test_a_docker_run_ends_with_no_container_of_its_own(server, docker_test_image, tmp_path, monkeypatch):
    """The runner waits for the workers' background stops before ending them: no container is left even
    without the after-run cleanup (disabled here), which only catches what dead workers leave."""
    swept: list[bool] = []
    monkeypatch.setattr(DockerSandbox, "sweep", classmethod(lambda cls, options: swept.append(True)))
    run_name = f"overlap-run-{os.getpid()}"
    prompts = [f"docker task {i} [calls:{i % 3}]" for i in range(10)]
    dataset = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    assert (
        batch_runner.main(
            dataset_file=str(dataset),
            batch_size=3,
            run_name=run_name,
            model="fake",
            base_url=server.base_url,
            api_key="sk-overlap",
            output_dir=str(tmp_path / "data"),
            num_workers=2,
            prompts_per_worker=3,
            max_sandbox_starts=2,
            distribution="terminal_only",
            sandbox="docker",
            default_image=docker_test_image,
            max_failure_rate=1.0,
        )
        == 0
    )
    assert swept == [True]
    assert docker_ps(f"batch_runner.run_name={run_name}") == []
    stats = json.loads((tmp_path / "data" / run_name / "statistics.json").read_text())
    assert stats["sandbox_disk_cap"].startswith(
        ("tmpfs 1024 MiB", "storage-opt 4096 MiB")
    )  # 1024: half the memory
    if stats["sandbox_disk_cap"].startswith("tmpfs") and os.geteuid() == 0:  # the rest of its files too
        assert "watched: a container whose files there pass 4096 MiB is stopped" in stats["sandbox_disk_cap"]
    records = read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")
    failed = read_jsonl(tmp_path / "data" / run_name / "failed.jsonl")
    assert len(records) + len(failed) == len(prompts)
    # This machine's engine fails an odd container start under load; that must be a sandbox failure.
    assert all(f["error_class"] == "sandbox" for f in failed), failed
    assert len(records) >= len(prompts) // 2, failed
    for rec in records:
        meta = rec["metadata"]
        assert meta["sandbox"] == "docker" and meta["sandbox_stop_background"] is True
        assert meta["sandbox_start_blocked_s"] >= 0


def start_slow_docker_run(run_name: str, base_url: str, image: str, tmp_path: Path) -> subprocess.Popen:
    """The runner as a user starts it, on 12 prompts of 3 tool calls each; stderr piped (text)."""
    dataset = write_jsonl(tmp_path / "prompts.jsonl", [f"slow docker task {i} [calls:3]" for i in range(12)])
    return subprocess.Popen(
        [
            sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=3",
            f"--run_name={run_name}", "--model=fake", f"--base_url={base_url}", "--api_key=sk-overlap",
            f"--output_dir={tmp_path / 'data'}", "--num_workers=2", "--prompts_per_worker=3",
            "--distribution=terminal_only", "--sandbox=docker", f"--default_image={image}",
        ],
        cwd=tmp_path,
        preexec_fn=default_sigint,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


@pytest.mark.docker
@pytest.mark.slow
def test_ctrl_c_during_a_docker_run_leaves_no_container(docker_test_image, tmp_path):
    run_name = f"overlap-int-{os.getpid()}"
    with FakeModelServer(latency_s=0.5) as slow:
        proc = start_slow_docker_run(run_name, slow.base_url, docker_test_image, tmp_path)
        try:
            assert wait_for(lambda: docker_ps(f"batch_runner.run_name={run_name}"), 120, 0.2)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, err
    assert docker_ps(f"batch_runner.run_name={run_name}") == []


def running_containers(run_name: str) -> list[str]:
    done = subprocess.run(
        ["docker", "ps", "--filter", f"label=batch_runner.run_name={run_name}", "--format", "{{.Names}}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.split()


@pytest.mark.docker
@pytest.mark.slow
def test_kill_9_of_a_docker_run_leaves_no_running_container_and_a_later_run_removes_the_rest(
    server, docker_test_image, tmp_path
):
    """No cleanup code runs after SIGKILL: the started containers end (and remove) themselves once the
    runner and its workers (which die with it) are gone; one created but not started yet stays, never
    running, until the next run, whatever its name, sweeps it."""
    run_name = f"overlap-kill-{os.getpid()}"
    with FakeModelServer(latency_s=0.5) as slow:
        proc = start_slow_docker_run(run_name, slow.base_url, docker_test_image, tmp_path)
        try:
            assert wait_for(lambda: running_containers(run_name), 120, 0.2)
            proc.kill()
            proc.communicate()  # drains and closes its stderr pipe
            assert wait_for(lambda: not running_containers(run_name), 60, 0.2)
            later = f"overlap-later-{os.getpid()}"
            batch_runner.main(
                dataset_file=str(write_jsonl(tmp_path / "one.jsonl", ["later task [calls:1]"])),
                batch_size=1, run_name=later, model="fake", base_url=server.base_url, api_key="sk-overlap",
                output_dir=str(tmp_path / "data"), num_workers=1, distribution="terminal_only",
                sandbox="docker", default_image=docker_test_image,
            )  # fmt: skip
            assert docker_ps(f"batch_runner.run_name={run_name}") == []
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            left = docker_ps(f"batch_runner.run_name={run_name}")
            if left:
                subprocess.run(["docker", "rm", "-f", *left], capture_output=True)


# ----------------------------------------------------------------------------- the network only where it is asked for


@pytest.mark.parametrize(
    ("toolsets", "verify", "run_network", "expected"),
    [
        (("terminal",), (), True, True),  # commands may use it
        (("file",), (), True, False),  # the file tools never do: no slirp4netns
        (("file", "web"), (), True, False),  # web tools run on the host
        (("file",), ("test -f out.txt",), True, True),  # the row's verify commands may
        (("terminal",), (), False, False),  # --sandbox_network=False wins
    ],
)
def test_a_prompts_sandbox_gets_the_network_only_when_something_there_may_use_it(
    server, scripted, toolsets, verify, run_network, expected
):
    from batchrun.protocol import RowCheck

    settings = settings_for(server, sandbox_network=run_network)
    row = dataclasses.replace(
        job("network please [calls:0]"), toolsets=toolsets, check=RowCheck(verify=verify)
    )
    outcome = run_prompt(row, settings, LLMClient(settings.llm))
    assert outcome.kind in ("trajectory", "discarded"), outcome.error
    (box,) = scripted.boxes
    assert box.spec.network is expected


@pytest.mark.docker
def test_a_docker_prompt_credited_its_wait_for_a_request_slot_keeps_its_container(
    server, docker_test_image, monkeypatch
):
    """A container ends itself after its lifetime, a backstop should the runner die: 2 x
    --prompt_timeout and a 600 s margin. A prompt's waits for a request slot (a llama-server's slots,
    --max_concurrent_requests) are credited to it up to MAX_SLOT_WAIT_S (an hour): a prompt queued that
    long lost its container under it, its next command failing (prompt_timeout 1 s, margin 2 s, the
    bound 8 s, a slot held 6 s: the command found the container gone). Shrunk here to seconds."""
    import batchrun.prompt.limiter as limiter_mod
    import batchrun.prompt.sandboxes.docker.sandbox as docker_mod
    from batchrun.prompt.limiter import Limiter
    from batchrun.prompt.sandboxes.base import SandboxFlags

    monkeypatch.setattr(docker_mod, "LIFETIME_MARGIN_S", 2.0)
    monkeypatch.setattr(limiter_mod, "MAX_SLOT_WAIT_S", 8.0)
    options = DockerSandbox.options_from(SandboxFlags(default_image=docker_test_image, prompt_timeout_s=1.0))
    run_name = f"slotwait-{os.getpid()}"
    settings = dataclasses.replace(
        settings_for(server, backend="docker", sandbox_options=options),
        run_name=run_name,
        limits=LoopLimits(max_turns=6, prompt_timeout_s=1, tool_timeout_s=20),
    )
    limiter = Limiter(max_concurrent=1)

    def other_prompt() -> None:  # once the prompt's first call is in, holds the one slot for 6 s
        wait_for(lambda: server.stats()["requests"] >= 1, GATE_S, 0.01)
        limiter.acquire(time.monotonic() + 60, 100)
        time.sleep(6.0)
        limiter.release()

    threading.Thread(target=other_prompt, daemon=True).start()
    outcome = run_prompt(
        job("list files twice [run:echo one] [run:echo two]"), settings, LLMClient(settings.llm, limiter)
    )
    assert docker_ps(f"batch_runner.run_name={run_name}") == []
    assert outcome.kind == "trajectory", outcome.error
    tool_results = [m["value"] for m in outcome.record["conversations"] if m["from"] == "tool"]
    assert (
        tool_results and "ended" not in json.dumps(tool_results) and "gone" not in json.dumps(tool_results)
    ), tool_results


def _slot_held_after_first_call(server: FakeModelServer, limiter, hold_s: float) -> None:
    """Another prompt's request, once this prompt's first call is in, holds the one slot ``hold_s``: an
    endpoint posing as a one-slot llama-server (its ``Server`` header, ``/props``) that holds each request."""

    def other_prompt() -> None:
        wait_for(lambda: server.stats()["requests"] >= 1, GATE_S, 0.01)
        limiter.acquire(time.monotonic() + 60, 100)
        time.sleep(hold_s)
        limiter.release()

    threading.Thread(target=other_prompt, daemon=True).start()


def test_a_prompt_under_way_ends_by_its_timeout_plus_a_grace_whatever_the_slots_hold(
    server, scripted, monkeypatch
):
    """Once a prompt's first request was granted (its sandbox up), its waits for a request slot were
    credited from one allowance of an hour with its wait for that first slot: behind requests an endpoint
    claiming one llama.cpp slot held to their deadlines, a prompt under way lived its --prompt_timeout
    plus an hour (a 1 s prompt whose second call queued behind a request held 8 s lived 9.0 s and was
    kept). Now the wait for the first slot has its own bound (MAX_QUEUE_WAIT_S), and a prompt under way
    is credited MAX_SLOT_WAIT_S (5 minutes) at most: shrunk here to 1 s, a prompt that queued 3 s for
    its first slot still runs, and ends 1 s + 1 s after that, failed (prompt_timeout), its first answer
    spent."""
    import batchrun.prompt.limiter as limiter_mod
    from batchrun.prompt.limiter import Limiter

    monkeypatch.setattr(limiter_mod, "MAX_SLOT_WAIT_S", 1.0)
    settings = dataclasses.replace(
        settings_for(server), limits=LoopLimits(max_turns=6, prompt_timeout_s=1, tool_timeout_s=20)
    )
    limiter = Limiter(max_concurrent=1)
    limiter.acquire(time.monotonic() + 60)  # another prompt's request holds the slot 3 s

    def release_later() -> None:
        time.sleep(3.0)
        limiter.release()

    threading.Thread(target=release_later, daemon=True).start()
    _slot_held_after_first_call(server, limiter, 8.0)
    outcome = run_prompt(job("twice [calls:2] [slow:0.2]"), settings, LLMClient(settings.llm, limiter))
    ended = time.time()
    assert outcome.kind == "failed" and outcome.error_class == "prompt_timeout", outcome.kind
    assert outcome.usage["calls"] == 1, outcome.usage  # it ran: its first slot's wait was not its time
    assert ended - server.stats()["last_response_at"] < 1 + 1 + 0.8


def test_a_prompt_is_credited_five_minutes_at_most_once_under_way() -> None:
    """What is left of a prompt's credited waits once its first request was granted (an hour before:
    with its wait for its first slot, an hour past its deadline for a prompt under way, its sandbox up)."""
    from batchrun.prompt.limiter import Limiter

    lim = Limiter(max_concurrent=2)
    lim.begin_prompt()
    lim.acquire(time.monotonic() + 5)
    lim.release()
    assert lim.credit_left() == 300.0
    lim = Limiter()  # no request slots: its time starts at once
    lim.begin_prompt()
    assert lim.credit_left() == 300.0


# ----------------------------------------------------------------------------- the start waits for the first request slot


class AliveCount:
    """Wraps the runner's ``create_sandbox``: the real sandbox, its start and stop counted, the most
    started and not yet stopped at once kept."""

    def __init__(self, create) -> None:
        self._create = create
        self._lock = threading.Lock()
        self.alive = self.peak = self.started = 0

    def create(self, name: str, spec: SandboxSpec, options=None):
        box = self._create(name, spec, options)
        start, stop = box.start, box.stop
        began = []

        def counted_start() -> None:
            with self._lock:
                self.started += 1
                self.alive += 1
                self.peak = max(self.peak, self.alive)
                began.append(True)
            start()

        def counted_stop() -> None:
            try:
                stop()
            finally:
                with self._lock:
                    if began and began.pop():
                        self.alive -= 1

        box.start, box.stop = counted_start, counted_stop
        return box


def test_prompts_queued_for_a_request_slot_hold_no_sandbox_until_it_is_granted(server, tmp_path, monkeypatch):
    """Twelve prompts in flight on one request slot (--max_concurrent_requests, a llama-server's slots),
    each call 0.15 s on the endpoint, real local sandboxes: each prompt's sandbox started as the prompt
    began, and all 12 sat alive at once while 11 of their prompts waited for the slot. Now it starts
    when its prompt's first request is granted the slot (still beside that call): at most the prompts
    under way hold one. Every prompt still runs its command in its sandbox, and nothing is left."""
    from batchrun.prompt.limiter import Limiter
    from batchrun.prompt.sandboxes import create_sandbox

    count = AliveCount(create_sandbox)
    monkeypatch.setattr(runner_mod, "create_sandbox", count.create)
    settings = local_settings(server, tmp_path)
    limiter = Limiter(max_concurrent=1)
    outcomes: list = []

    def one(i: int) -> None:
        outcomes.append(
            run_prompt(
                job(f"shell {i} [calls:1] [slow:0.15]", index=i), settings, LLMClient(settings.llm, limiter)
            )
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [o.kind for o in outcomes] == ["trajectory"] * 12, [o.error for o in outcomes]
    assert all(o.record["tool_stats"]["terminal"]["success"] == 1 for o in outcomes)
    assert count.started == 12 and count.alive == 0
    assert count.peak <= 3, f"{count.peak} sandboxes alive at once on one request slot"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("br-")] == []


def test_with_a_request_slot_the_start_still_overlaps_the_first_call_and_its_failure_reaches_the_prompt(
    server, scripted
):
    """Begun at the grant, the start runs beside the first call (it can only finish once the endpoint
    has seen it), and a start that fails still fails the prompt at its first tool call, class sandbox."""
    from batchrun.prompt.limiter import Limiter

    def start() -> None:
        if not wait_for(lambda: server.stats()["requests"] >= 1, GATE_S, 0.02):
            raise SandboxError("the model was not called while the sandbox was starting")

    scripted.on_start = start
    settings = settings_for(server)
    outcome = run_prompt(
        job("overlap [calls:1]"), settings, LLMClient(settings.llm, Limiter(max_concurrent=1))
    )
    assert outcome.kind == "trajectory", outcome.error
    assert scripted.boxes[0].events == ["start", "started", "run", "stop"]

    def fail() -> None:
        raise SandboxError("image is gone")

    scripted.on_start = fail
    outcome = run_prompt(job("again [calls:1]"), settings, LLMClient(settings.llm, Limiter(max_concurrent=1)))
    assert outcome.kind == "failed" and outcome.error_class == "sandbox" and "image is gone" in outcome.error
    assert scripted.boxes[1].events == ["start", "stop"]


def test_a_prompt_whose_deadline_passes_before_its_first_request_slot_creates_no_sandbox(
    server, scripted, monkeypatch
):
    """Its slot held past its deadline and its allowance of credited waits for its first slot (shrunk to
    0.3 s), the prompt fails with a timeout and no sandbox was ever started; its judge, when it has one,
    starts none either."""
    import batchrun.prompt.limiter as limiter_mod
    from batchrun.prompt.limiter import Limiter

    monkeypatch.setattr(limiter_mod, "MAX_QUEUE_WAIT_S", 0.3)
    limiter = Limiter(max_concurrent=1)
    limiter.acquire(time.monotonic() + 60)  # another prompt holds the one slot throughout
    settings = dataclasses.replace(
        settings_for(server), limits=LoopLimits(max_turns=6, prompt_timeout_s=0.3, tool_timeout_s=60)
    )
    outcome = run_prompt(job("queued [calls:1]"), settings, LLMClient(settings.llm, limiter))
    assert outcome.kind == "failed" and outcome.error_class == "prompt_timeout", outcome.error
    (box,) = scripted.boxes
    assert box.events == []
    assert not start_threads_alive()
    limiter.release()
    limiter.acquire(time.monotonic() + 5)  # a later call on this thread runs nothing left by that prompt
    limiter.release()
    assert box.events == []


def test_prompts_queued_for_a_request_slot_when_the_run_stops_start_no_sandbox(server, scripted):
    """The run stops (a budget reached, Ctrl-C) while prompts wait for the one request slot: each is
    granted it in turn only to stop before its request; none may start its sandbox on the way out."""
    from batchrun.prompt.limiter import Limiter

    limiter, stop = Limiter(max_concurrent=1), threading.Event()
    limiter.acquire(time.monotonic() + 60)  # another prompt holds the slot
    settings = settings_for(server)
    outcomes: list = []

    def one(i: int) -> None:
        client = LLMClient(settings.llm, limiter, stop=stop)
        outcomes.append(run_prompt(job(f"queued {i} [calls:1]", index=i), settings, client))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert wait_for(lambda: len(scripted.boxes) == 3, GATE_S, 0.01)
    time.sleep(0.2)  # all three in the slot's queue
    stop.set()
    limiter.release()
    for t in threads:
        t.join(30)
    assert sorted(o.error_class for o in outcomes) == ["budget"] * 3
    assert [b.events for b in scripted.boxes] == [[], [], []]
    assert server.stats()["requests"] == 0


@pytest.mark.parametrize("prompt", ["needs a shell [calls:1]", "just answer"])
def test_a_start_that_cannot_be_begun_at_the_first_grant_fails_cleanly(server, scripted, prompt):
    """A sandbox start begun by the prompt's first request, once granted its slot, that cannot be begun at
    all (its StartPool shut down, as at the worker's exit; no thread to be had) raised from inside the
    model call: the request was never sent and the prompt failed as 'internal' (RuntimeError). Now it is
    a failed start as any other: the request goes out, and the prompt fails with class 'sandbox' when the
    sandbox is needed (a tool call, or the sample's judging)."""
    from batchrun.prompt.limiter import Limiter

    pool = StartPool(1)
    pool._pool.shutdown()
    settings = settings_for(server)
    outcome = run_prompt(
        job(prompt), settings, LLMClient(settings.llm, Limiter(max_concurrent=1)), sandbox_starts=pool
    )
    assert (outcome.kind, outcome.error_class) == ("failed", "sandbox"), outcome.error
    assert "did not start: RuntimeError: cannot schedule new futures" in outcome.error
    assert outcome.usage["requests"] == 1
    (box,) = scripted.boxes
    assert box.events == []  # nothing was created: nothing to stop


def test_a_start_thread_that_cannot_be_created_is_a_failed_start_not_a_hang(monkeypatch):
    """A start on a thread of its own (a semaphore bounding starts) whose thread could not be created
    left the start 'begun' but never done: the first need of the sandbox waited for ever."""
    box = ScriptedSandbox(SandboxSpec(run_name="overlap", prompt_index=0), lambda: None)
    start = BackgroundStart(box, threading.Semaphore(1))

    def no_thread(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    start.start()
    monkeypatch.undo()
    waiter = threading.Thread(target=lambda: pytest.raises(SandboxError, start.wait_started), daemon=True)
    waiter.start()
    waiter.join(2)
    assert not waiter.is_alive()
    with pytest.raises(SandboxError, match="can't start new thread"):
        start.wait_started()
    start.stop()
    assert box.events == []
