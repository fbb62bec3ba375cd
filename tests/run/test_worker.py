"""batchrun/run/worker.py: one real worker process, driven over its inbox connection as dispatch.py drives it.

Each test forks a worker from the forkserver (``worker.serve``, as ``WorkerProcesses`` does), plays the
parent on a real :class:`~batchrun.run.inbox.Inbox`, and reads every message the worker sends. The model
is the scripted fake on loopback; prompts run in the local sandbox without isolation.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from helpers import ROOT, default_sigint, wait_until

from batchrun.fakes.fake_model import respond
from batchrun.prompt.attempt import WorkerSettings
from batchrun.prompt.llm import LLMConfig
from batchrun.prompt.loop import LoopLimits
from batchrun.prompt.sandboxes.base import ExecResult, SandboxBackend, SandboxSpec
from batchrun.protocol import (
    FAILED,
    TRAJECTORY,
    EndpointHealth,
    Grant,
    Log,
    Outcome,
    Pause,
    PauseAll,
    PromptJob,
    Ready,
    Received,
    Reserve,
    Skipped,
    Spend,
    StopDone,
    StopQueued,
    StopStarting,
    WorkerExit,
)
from batchrun.run import worker
from batchrun.run.inbox import Inbox
from batchrun.sharegpt import first_human

WAIT_S = (
    30.0  # the longest any one message may take (a loaded machine); no test waits this long when it passes
)


class Parent:
    """The parent's side of one worker process: its inbox, and every message the worker sent so far."""

    def __init__(self, inbox: Inbox, proc: Any) -> None:
        self.inbox = inbox
        self.proc = proc
        self.seen: list[Any] = []

    def next(self, timeout: float = WAIT_S) -> Any:
        """The worker's next message (its WorkerExit once its connection ended)."""
        event = self.inbox.events.get(timeout=timeout)
        assert event.pid == self.proc.pid  # the inbox names the worker by the pid it introduced itself with
        message = event.message if isinstance(event, Received) else event
        self.seen.append(message)
        return message

    def until(self, kind: type | tuple[type, ...], answer_reserves: bool | None = None) -> list[Any]:
        """Messages up to and including the first of ``kind``; a Reserve met on the way is answered
        ``Grant(rid, answer_reserves)`` unless that is None."""
        got = []
        while True:
            message = self.next()
            got.append(message)
            if isinstance(message, Reserve) and answer_reserves is not None:
                self.send(Grant(message.rid, answer_reserves))
            if isinstance(message, kind):
                return got

    def send(self, message: Any) -> None:
        assert self.inbox.send(self.proc.pid, message), "the worker's connection is gone"

    def quiet(self, seconds: float = 0.3) -> list[Any]:
        """What the worker sends within ``seconds`` (a test that expects nothing more)."""
        got = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                got.append(self.next(timeout=left))
            except Exception:  # queue.Empty
                break
        return got


@dataclass
class Launch:
    """What a test changes of the worker it starts."""

    slots: int = 1
    start_slots: int = 1
    parent_pid: int = field(default_factory=os.getpid)
    settings: dict[str, Any] = field(default_factory=dict)


def job(
    index: int, prompt: str, toolsets: tuple[str, ...] = (), batch_num: int = 0, **fields: Any
) -> PromptJob:
    return PromptJob(batch_num=batch_num, prompt_index=index, prompt=prompt, toolsets=toolsets, **fields)


# A worker started as a command of its own (not forked from the forkserver), with Ctrl-C's default
# disposition: what it does with SIGINT is then its own choice, not one it inherited.
WORKER_SCRIPT = """
import pickle, sys
sys.path.insert(0, {root!r})
from batchrun.run import worker
worker.serve(*pickle.loads(bytes.fromhex(sys.argv[1])))
"""


class ScriptProcess:
    """A worker run by WORKER_SCRIPT, with the few ``multiprocessing.Process`` members the tests use."""

    def __init__(self, initargs: tuple[Any, ...]) -> None:
        script = WORKER_SCRIPT.format(root=str(ROOT))
        self._popen = subprocess.Popen(
            [sys.executable, "-c", script, pickle.dumps(initargs).hex()], preexec_fn=default_sigint
        )
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        self._popen.kill()

    def join(self, timeout: float) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()


@pytest.fixture
def start_worker(server, tmp_path):
    """``start(**Launch fields) -> Parent``: a worker forked from the forkserver (``own_process``: run as
    a command of its own), connected to an inbox of its own."""
    started: list[Parent] = []

    def start(own_process: bool = False, **launch_fields: Any) -> Parent:
        launch = Launch(**launch_fields)
        settings = WorkerSettings(
            run_name="worker-test",
            llm=LLMConfig(model="fake-model", base_url=server.base_url, api_key="sk-test", max_retries=0),
            limits=LoopLimits(max_turns=4, prompt_timeout_s=120.0, tool_timeout_s=30.0),
            sandbox_options={"isolation": "none", "base_dir": str(tmp_path)},
        )
        settings = replace(settings, **launch.settings)
        inbox = Inbox()
        initargs = (settings, inbox.address, launch.slots, launch.start_slots, launch.parent_pid)
        if own_process:
            proc: Any = ScriptProcess(initargs)
        else:
            worker.start_forkserver(settings.sandbox_backend)
            proc = mp.get_context("forkserver").Process(target=worker.serve, args=initargs, daemon=True)
            proc.start()
        parent = Parent(inbox, proc)
        started.append(parent)
        return parent

    yield start
    for parent in started:
        if parent.proc.is_alive():
            parent.proc.kill()
        parent.proc.join(10)
        parent.inbox.close()


# ----------------------------------------------------------------------------- start-up


def test_a_worker_introduces_itself_with_its_slots_and_nothing_else(start_worker):
    parent = start_worker(slots=3)
    assert parent.next() == Ready(3)
    assert parent.quiet() == []  # no job, no message: an idle worker costs the parent nothing
    assert parent.proc.is_alive()


# ----------------------------------------------------------------------------- a job and what comes back


def test_a_job_gets_exactly_one_outcome_with_its_keys_and_no_spend_without_a_budget(start_worker, server):
    parent = start_worker()
    assert parent.next() == Ready(1)
    parent.send(job(7, "List the files [calls:1]", ("terminal",), batch_num=2, sample_index=1))
    outcome = parent.next()
    assert isinstance(outcome, Outcome) and outcome.kind == TRAJECTORY, outcome
    assert (outcome.batch_num, outcome.prompt_index, outcome.sample_index) == (2, 7, 1)
    assert first_human(outcome.record["conversations"]) == "List the files [calls:1]"
    assert outcome.record["tool_stats"]["terminal"]["count"] == 1  # the tool ran in the job's sandbox
    assert outcome.usage["calls"] == 2 and outcome.usage["prompt_tokens"] > 0  # the outcome carries the spend
    assert parent.quiet() == []  # no Spend, Log or stop message: one message for one prompt
    assert server.stats()["requests_by_prompt"] == {"List the files [calls:1]": 2}


def test_a_preflight_failure_is_an_outcome_without_a_model_call(start_worker, server):
    parent = start_worker()
    parent.until(Ready)
    parent.send(job(0, "never sent", fail_reason="the image is not there"))
    outcome = parent.next()
    assert (outcome.kind, outcome.error_class, outcome.error) == (
        FAILED,
        "preflight",
        "the image is not there",
    )
    assert server.stats()["requests"] == 0


def test_a_prompt_that_raises_fails_alone_and_the_worker_runs_the_next(start_worker, tmp_path):
    parent = start_worker(settings=backend_fields("RaisingStartSandbox", tmp_path))
    parent.until(Ready)
    parent.send(job(0, "start me [calls:0]", cwd="/raise"))
    failed = parent.next()
    assert (failed.kind, failed.error_class) == (FAILED, "internal")
    assert "RuntimeError: a bug in the backend" in failed.error
    parent.send(job(1, "and me [calls:0]"))
    assert parent.next().kind == TRAJECTORY
    assert parent.proc.is_alive()


def test_verbose_sends_a_log_line_per_tool_call_before_the_outcome(start_worker):
    parent = start_worker(settings={"verbose": True})
    parent.until(Ready)
    parent.send(job(4, "Run it [run:echo from-the-tool]", ("terminal",)))
    got = parent.until(Outcome)
    logs = [m for m in got if isinstance(m, Log)]
    assert len(logs) == 1 and (logs[0].prompt_index, logs[0].tool) == (4, "terminal")
    assert "echo from-the-tool" in logs[0].args and "from-the-tool" in logs[0].result
    assert got[-1].kind == TRAJECTORY


# ----------------------------------------------------------------------------- slots


@pytest.mark.parametrize("slots", [1, 2])
def test_a_worker_runs_as_many_prompts_at_once_as_its_slots(start_worker, slots):
    """Each prompt's model call waits for the parent's grant, so a Reserve in flight is a prompt running."""
    parent = start_worker(slots=slots, settings={"budget_gate": True})
    parent.until(Ready)
    for i in range(3):
        parent.send(job(i, f"prompt {i} [calls:0]"))
    first = [parent.next() for _ in range(slots)]
    assert all(isinstance(m, Reserve) for m in first)
    assert parent.quiet() == []  # the third prompt (and with one slot the second) waits for a slot
    for m in first:
        parent.send(Grant(m.rid, True))
    got = parent.until(Reserve)  # a slot freed: the next prompt starts only now
    assert sum(isinstance(m, Outcome) for m in got) >= 1


# ----------------------------------------------------------------------------- the run's budget


def test_with_a_budget_each_model_call_waits_for_its_grant_and_reports_its_spend(start_worker, server):
    parent = start_worker(settings={"budget_gate": True})
    parent.until(Ready)
    parent.send(job(3, "Two calls [calls:1]", ("terminal",), batch_num=1, sample_index=2))
    reserve = parent.next()
    assert isinstance(reserve, Reserve) and reserve.tokens > 0 and reserve.prompt == (1, 3, 2)
    assert reserve.priority == 0  # the prompt's first call
    assert parent.quiet() == [] and server.stats()["requests"] == 0  # nothing is sent before the grant
    parent.send(Grant(reserve.rid, True))
    got = parent.until(Outcome, answer_reserves=True)
    spends = [m for m in got if isinstance(m, Spend)]
    reserves = [reserve] + [m for m in got if isinstance(m, Reserve)]
    outcome = got[-1]
    assert outcome.kind == TRAJECTORY
    assert [s.reservation for s in spends] == [r.rid for r in reserves]  # every reservation is freed
    assert [r.priority for r in reserves] == [0, 1]  # a prompt under way goes first
    assert all((s.batch_num, s.prompt_index, s.sample_index) == (1, 3, 2) for s in spends)
    assert sum(s.prompt_tokens for s in spends) == outcome.usage["prompt_tokens"]
    assert sum(s.completion_tokens for s in spends) == outcome.usage["completion_tokens"]


def test_a_refused_reservation_fails_the_prompt_as_budget_without_a_model_call(start_worker, server):
    parent = start_worker(settings={"budget_gate": True})
    parent.until(Ready)
    parent.send(job(0, "too expensive [calls:0]"))
    got = parent.until(Outcome, answer_reserves=False)
    assert (got[-1].kind, got[-1].error_class) == (FAILED, "budget")
    assert not any(isinstance(m, Spend) for m in got)  # nothing was reserved, so nothing to free
    assert server.stats()["requests"] == 0


def test_a_failed_call_frees_its_reservation_with_a_spend_of_nothing(start_worker):
    parent = start_worker(settings={"budget_gate": True})
    parent.until(Ready)
    parent.send(job(0, "Hang up [hangup]"))
    got = parent.until(Outcome, answer_reserves=True)
    (reserve,) = [m for m in got if isinstance(m, Reserve)]
    (spend,) = [m for m in got if isinstance(m, Spend)]
    assert (spend.reservation, spend.prompt_tokens, spend.completion_tokens) == (reserve.rid, 0, 0)
    assert (got[-1].kind, got[-1].error_class) == (FAILED, "connection")


def test_after_stop_starting_a_job_is_skipped_without_a_model_call(start_worker, server):
    parent = start_worker()
    parent.until(Ready)
    parent.send(StopStarting())
    parent.send(job(5, "too late [calls:0]", sample_index=3))
    assert parent.next() == Skipped(0, 5, 3)
    assert parent.quiet() == [] and server.stats()["requests"] == 0


def test_stop_starting_ends_a_prompt_in_flight_at_its_next_model_call(start_worker, server):
    parent = start_worker(settings={"budget_gate": True})
    parent.until(Ready)
    parent.send(job(0, "Under way [calls:0]"))
    reserve = parent.until(Reserve)[-1]
    parent.send(StopStarting())  # arrives before the grant, on the same connection
    parent.send(Grant(reserve.rid, True))
    got = parent.until(Outcome)
    assert (got[-1].kind, got[-1].error_class) == (FAILED, "budget")
    assert [m.reservation for m in got if isinstance(m, Spend)] == [reserve.rid]  # its reservation freed
    assert server.stats()["requests"] == 0


# ----------------------------------------------------------------------------- the endpoint: pauses and health


class _NoUsageHandler(BaseHTTPRequestHandler):
    """The fake model's replies without their ``usage``: an endpoint whose spend cannot be trusted."""

    def do_POST(self) -> None:  # noqa: N802
        reply = respond(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        reply.pop("usage", None)
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


@pytest.fixture
def no_usage_endpoint():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NoUsageHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_without_a_budget_only_the_first_untrusted_usage_is_sent_at_once(start_worker, no_usage_endpoint):
    llm = LLMConfig(model="fake-model", base_url=no_usage_endpoint, api_key="sk-test", max_retries=0)
    parent = start_worker(settings={"llm": llm})
    parent.until(Ready)
    parent.send(job(0, "First [calls:0]", sample_index=1))
    got = parent.until(Outcome)
    assert [type(m) for m in got] == [Spend, Outcome]  # the parent warns while the run goes on
    assert "no usage" in got[0].fault and (got[0].prompt_index, got[0].sample_index) == (0, 1)
    assert got[0].reservation is None
    parent.send(job(1, "Second [calls:0]"))
    assert [type(m) for m in parent.until(Outcome)] == [Outcome]  # once per worker, not per call


def test_a_429_is_reported_as_a_pause_for_the_whole_run(start_worker):
    parent = start_worker()
    parent.until(Ready)
    parent.send(job(0, "Busy once [flaky:1] [calls:0]"))
    got = parent.until(Outcome)
    assert [type(m) for m in got] == [Pause, Outcome]
    assert got[-1].kind == TRAJECTORY  # waited out, then answered


def test_a_pause_from_the_parent_holds_the_next_model_call(start_worker, server):
    parent = start_worker()
    parent.until(Ready)
    until = time.time() + 1.0
    parent.send(PauseAll(until))
    parent.send(job(0, "After the pause [calls:0]"))
    assert parent.next().kind == TRAJECTORY
    assert server.stats()["first_request_at"] >= until


def test_endpoint_health_is_sent_on_a_failure_and_on_the_first_answer_after_it_only(start_worker):
    parent = start_worker()
    parent.until(Ready)
    parent.send(job(0, "Hang up [hangup]"))
    failed = parent.until(Outcome)
    assert [type(m) for m in failed] == [EndpointHealth, Outcome] and failed[1].error_class == "connection"
    assert (failed[0].error_class, failed[0].refused) == ("connection", False)
    parent.send(job(1, "Fine again [calls:0]"))
    got = parent.until(Outcome)
    assert (got[0].error_class, got[0].refused) == (None, False) and got[-1].kind == TRAJECTORY
    # Each with the time its call went out: the answer's call went out after the failed one.
    assert failed[0].sent_at < got[0].sent_at <= time.time()
    parent.send(job(2, "Still fine [calls:0]"))
    assert [type(m) for m in parent.until(Outcome)] == [Outcome]  # a healthy endpoint costs no message
    # A refusal of the key or the account (a 402, final) is told as one: the parent's refused-key watch
    # counts it, not its dead-endpoint watch nor statistics' endpoint_failures.
    parent.send(job(3, "Out of credits [error:402]"))
    told = parent.until(Outcome)[0]
    assert (type(told), told.error_class, told.refused) == (EndpointHealth, "http_402", True)


# ----------------------------------------------------------------------------- background sandbox stops


def test_a_slow_stop_is_queued_before_the_outcome_and_done_after_it(start_worker, tmp_path):
    parent = start_worker(settings=backend_fields("HeldStopSandbox", tmp_path))
    parent.until(Ready)
    parent.send(job(0, "Use the box [run:echo hi]", ("terminal",)))
    got = parent.until(Outcome)
    assert [type(m) for m in got] == [StopQueued, Outcome]
    assert got[-1].kind == TRAJECTORY
    assert parent.quiet() == []  # the stop is still held: the outcome did not wait for it
    (tmp_path / RELEASE).touch()
    assert parent.next() == StopDone()


# ----------------------------------------------------------------------------- how a worker ends


def test_sigint_is_left_to_the_parent_and_sigterm_ends_the_worker(start_worker):
    parent = start_worker(own_process=True)
    assert parent.next(timeout=60) == Ready(1)  # a fresh interpreter imports the package first
    os.kill(parent.proc.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches the whole process group
    parent.send(job(0, "Still here [calls:0]"))
    assert parent.next().kind == TRAJECTORY
    os.kill(parent.proc.pid, signal.SIGTERM)
    parent.proc.join(WAIT_S)
    assert parent.proc.exitcode == 128 + signal.SIGTERM
    assert parent.next() == WorkerExit(parent.proc.pid)


def test_a_worker_ends_when_the_runner_process_dies(start_worker):
    runner = subprocess.Popen(["sleep", "60"])
    parent = start_worker(parent_pid=runner.pid)
    parent.until(Ready)
    runner.kill()
    runner.wait()
    parent.proc.join(WAIT_S)
    assert parent.proc.exitcode == 1


def test_a_worker_ends_when_its_inbox_connection_closes(server, tmp_path):
    from multiprocessing.connection import Listener

    authkey = os.urandom(16)
    listener = Listener(family="AF_UNIX", authkey=authkey)
    settings = WorkerSettings(
        run_name="worker-test",
        llm=LLMConfig(model="fake-model", base_url=server.base_url, api_key="sk-test"),
        limits=LoopLimits(max_turns=1),
        sandbox_options={"isolation": "none", "base_dir": str(tmp_path)},
    )
    worker.start_forkserver(settings.sandbox_backend)
    proc = mp.get_context("forkserver").Process(
        target=worker.serve, args=(settings, (listener.address, authkey), 1, 1, os.getpid()), daemon=True
    )
    proc.start()
    try:
        conn = listener.accept()
        assert conn.recv() == proc.pid  # a worker's first message is its pid
        assert conn.recv() == Ready(1)
        conn.close()  # the parent is gone: nobody would write the worker's results
        proc.join(WAIT_S)
        assert proc.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
        listener.close()


# ----------------------------------------------------------------------------- test backends (found by dotted path)

RELEASE = "release-stops"  # HeldStopSandbox's stops wait until this file is in its base_dir


def backend_fields(name: str, base_dir: Any) -> dict[str, Any]:
    """WorkerSettings fields for a backend of this module, found by its dotted path as a plugin's would be."""
    return {"sandbox_backend": f"{__name__}:{name}", "sandbox_options": {"base_dir": str(base_dir)}}


class HeldStopSandbox(SandboxBackend):
    """Commands run in a host directory; the stop (background: it is not ``synchronous_stop``) waits
    until the test writes RELEASE into ``base_dir``."""

    def __init__(self, spec: SandboxSpec, output_cap_bytes: int = 65536, base_dir: str | None = None):
        self.spec = spec
        self.base_dir = base_dir or tempfile.gettempdir()
        self.isolation = "none"
        self.workdir = ""

    def start(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="held-stop-", dir=self.base_dir)

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        done = subprocess.run(
            ["bash", "-c", command], cwd=self.workdir, input=stdin, capture_output=True, timeout=timeout_s
        )
        return ExecResult((done.stdout + done.stderr).decode("utf-8", "replace"), done.returncode)

    def stop(self) -> None:
        if self.workdir:
            wait_until(lambda: os.path.exists(os.path.join(self.base_dir, RELEASE)), WAIT_S, 0.05)
            shutil.rmtree(self.workdir, ignore_errors=True)


class RaisingStartSandbox(HeldStopSandbox):
    """Started on the prompt's thread; a cwd of ``/raise`` makes the start raise what no backend should."""

    synchronous_start = True

    def start(self) -> None:
        if self.spec.cwd == "/raise":
            raise RuntimeError("a bug in the backend")
        super().start()

    def stop(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True) if self.workdir else None
