"""PromptSandbox (batchrun/prompt/sandbox_lifecycle.py): one prompt's sandbox from start to stop.

run_prompt's tests (tests/run/test_runner_overlap.py) show the overlap with the first model call;
these show the context manager's own promises: what was started is stopped, whatever happened,
and a slow stop leaves the prompt's path.
"""

from __future__ import annotations

import pytest

from batchrun.prompt.sandbox_lifecycle import BackgroundStart, PromptSandbox, StartPool
from batchrun.prompt.sandboxes.base import ExecResult, SandboxError, SandboxSpec


class StandIn:
    """A sandbox that records what happened to it: start, stop (``fail_start``: its start raises)."""

    def __init__(self, *, synchronous_start: bool, synchronous_stop: bool = False, fail_start: bool = False):
        self.spec = SandboxSpec(run_name="lifecycle", prompt_index=0)
        self.workdir = "/standin"
        self.isolation = "standin"
        self.image = "img:1"
        self.synchronous_start = synchronous_start
        self.synchronous_stop = synchronous_stop
        self.fail_start = fail_start
        self.events: list[str] = []

    def start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise SandboxError("no room for this sandbox")

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        self.events.append("run")
        return ExecResult(output="ok\n", exit_code=0)

    def stop(self) -> None:
        self.events.append("stop")


def test_a_synchronous_start_that_fails_is_stopped_and_the_error_reaches_the_prompt():
    box = StandIn(synchronous_start=True, fail_start=True)
    with pytest.raises(SandboxError, match="no room"):
        with PromptSandbox(box, StartPool(1)):
            pytest.fail("the body must not run when the start failed")
    assert box.events == ["start", "stop"]  # a failed start may have created a container first


def test_a_synchronous_start_gives_the_box_itself_and_stops_it_on_the_prompts_thread():
    box = StandIn(synchronous_start=True)
    handed_off: list = []
    lifecycle = PromptSandbox(box, StartPool(1), handed_off.append)
    with lifecycle as sandbox:
        assert sandbox is box and box.events == ["start"]  # started before any model call
        assert sandbox.run("true", timeout_s=5).output == "ok\n"
    assert box.events == ["start", "run", "stop"] and handed_off == []
    assert lifecycle.timings["sandbox_stop_background"] is False
    assert lifecycle.isolation == "standin" and lifecycle.image == "img:1"


def test_a_slow_stop_is_handed_to_the_background_stopper_and_the_body_error_still_propagates():
    box = StandIn(synchronous_start=False)
    handed_off: list = []
    lifecycle = PromptSandbox(box, StartPool(1), handed_off.append)
    with pytest.raises(RuntimeError, match="agent bug"):
        with lifecycle as sandbox:
            assert isinstance(sandbox, BackgroundStart)
            assert sandbox.run("true", timeout_s=5).exit_code == 0  # waits for the start
            raise RuntimeError("agent bug")
    assert box.events == ["start", "run"]  # not stopped here: the stopper has it
    assert lifecycle.timings["sandbox_stop_background"] is True and len(handed_off) == 1
    handed_off[0]()
    assert box.events == ["start", "run", "stop"]


def test_a_quick_stop_stays_on_the_prompts_thread_even_with_a_stopper():
    box = StandIn(synchronous_start=False, synchronous_stop=True)
    handed_off: list = []
    with PromptSandbox(box, StartPool(1), handed_off.append) as sandbox:
        sandbox.run("true", timeout_s=5)
    assert box.events == ["start", "run", "stop"] and handed_off == []


def test_a_background_start_a_prompt_never_needed_is_skipped_and_nothing_is_stopped_twice():
    box = StandIn(synchronous_start=False)
    lifecycle = PromptSandbox(box, StartPool(1))  # no stopper: the stop runs here
    with lifecycle:
        pass  # a prompt that never called a tool
    # Either the start was still queued (skipped, nothing to stop) or it ran and was stopped once.
    assert box.events in ([], ["start", "stop"])


def test_a_start_left_to_the_first_request_slot_runs_when_handed_or_when_the_sandbox_is_needed():
    """``start_when`` (Limiter.when_granted) takes the start: nothing starts on entering; the start runs
    when it is called (the first request's slot), or at the first use that needs the sandbox; a prompt
    that ends before either creates nothing; False (no slot limit) starts on entering, as before."""
    handed: list = []
    box = StandIn(synchronous_start=False)
    with PromptSandbox(box, StartPool(1), start_when=lambda start: handed.append(start) or True):
        assert box.events == []
    assert box.events == [] and len(handed) == 1
    handed[0]()  # a grant after the prompt ended starts nothing
    assert box.events == []

    box = StandIn(synchronous_start=False)
    with PromptSandbox(box, StartPool(1), start_when=lambda start: handed.append(start) or True) as sandbox:
        handed[-1]()
        sandbox.wait_started()
        assert box.events == ["start"]
    assert box.events == ["start", "stop"]

    box = StandIn(synchronous_start=False, fail_start=True)
    with pytest.raises(SandboxError, match="no room"):  # needed before any grant (a verify): started now
        with PromptSandbox(box, StartPool(1), start_when=lambda start: True) as sandbox:
            sandbox.run("true", timeout_s=5)
    assert box.events == ["start", "stop"]

    box = StandIn(synchronous_start=False)
    with PromptSandbox(box, StartPool(1), start_when=lambda start: False) as sandbox:
        sandbox.wait_started()  # begun on entering: no slot to wait for
    assert box.events == ["start", "stop"]

    box = StandIn(synchronous_start=True)  # a synchronous start keeps its own: on entering
    with PromptSandbox(box, StartPool(1), start_when=lambda start: pytest.fail("handed a synchronous start")):
        assert box.events == ["start"]
