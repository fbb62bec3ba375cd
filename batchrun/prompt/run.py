"""One dataset row, end to end: toolsets → sandbox → agent loop → record → quality filter → outcome.

Every attempted prompt ends as exactly one :class:`~batchrun.protocol.Outcome`: a trajectory, a
discard (with its reason) or a failure (with an error class and message). The parent process is
the only one that writes them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchrun.prompt.llm import LLMClient, LLMConfig, LLMError, Usage
from batchrun.prompt.loop import LoopLimits, PromptTimeout, run_agent
from batchrun.prompt.sandbox_lifecycle import BackgroundStart, StartPool
from batchrun.prompt.sandboxes import SandboxError, SandboxSpec, create_sandbox
from batchrun.prompt.tools.registry import (
    ToolContext,
    close_prompt_resources,
    known_tool_names,
    tools_for_toolsets,
)
from batchrun.prompt.trajectory import (
    ambiguous_markup,
    build_record,
    empty_answer,
    invalid_tool_call,
    reasoning_counts,
)
from batchrun.protocol import Outcome, PromptJob


@dataclass(frozen=True)
class RunSettings:
    """Per-run settings a worker needs; pickled once into each worker process."""

    run_name: str
    llm: LLMConfig
    limits: LoopLimits
    sandbox_backend: str = "local"
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    sandbox_network: bool = True  # whether the prompt's commands may reach the network
    rpm_per_worker: float | None = None  # this worker's share of --max_rpm
    requests_per_worker: int | None = None  # this worker's share of --max_concurrent_requests
    tool_extra: dict[str, Any] = field(
        default_factory=dict
    )  # ToolContext.extra: run endpoint, run_dir, tool_env
    output_cap_bytes: int = 64 * 1024
    ephemeral_system_prompt: str | None = None
    prefill_messages: tuple[dict[str, Any], ...] = ()
    require_reasoning: bool = True
    # Else a sample with a call whose arguments are not a JSON object is discarded (invalid_tool_call),
    # and one whose final answer has no words (empty_answer).
    keep_invalid_tool_calls: bool = False
    keep_empty_answers: bool = False
    verbose: bool = False
    log_prefix_chars: int = 100


def run_prompt(
    job: PromptJob,
    settings: RunSettings,
    llm: LLMClient,
    *,
    sandbox_starts: threading.Semaphore | Any | None = None,
    stop_in_background: Callable[[Callable[[], None]], None] | None = None,
    log=None,
) -> Outcome:
    """Run one prompt and return its outcome; never raises. Every outcome carries the usage it spent.

    The sandbox starts on a start-up slot (``sandbox_starts``: a ``StartPool`` or a semaphore) while the
    first model call is in flight; the first tool call waits for it (a backend with
    ``synchronous_start`` starts here, before any model call). ``stop_in_background`` (e.g.
    ``BackgroundStopper.submit``), when given, takes the sandbox's stop off the prompt's path: the
    outcome is returned at once and the stop runs later. A backend with ``synchronous_stop`` (local:
    a few ms) always stops here, so its stop costs the parent no messages.
    """
    started = time.monotonic()
    usage = Usage()
    if job.fail_reason:
        return Outcome.failed(job, "preflight", job.fail_reason, usage.as_dict())
    tools = tools_for_toolsets(list(job.toolsets), settings.tool_extra)
    spec = SandboxSpec(
        run_name=settings.run_name,
        prompt_index=job.prompt_index,
        image=job.image,
        cwd=job.cwd,
        network=settings.sandbox_network,
    )
    options = {"output_cap_bytes": settings.output_cap_bytes, **settings.sandbox_options}
    sandbox = None
    background = False
    ctx = None
    timings: dict[str, Any] = {
        "sandbox_start_wait_s": 0.0,  # waiting for a start-up slot
        "sandbox_start_s": 0.0,  # the backend's start
        "sandbox_start_blocked_s": 0.0,  # what this prompt's own thread waited for the start
        "sandbox_stop_s": 0.0,  # what this prompt's own thread waited for the stop
        "sandbox_stop_background": False,  # whether the stop was left to the background stopper
    }
    try:
        box = create_sandbox(settings.sandbox_backend, spec, options)
        # The start runs on a start-up slot while the prompt's first model call is in flight: the
        # prompt pays for it only when its first tool call comes before the start is done.
        background = not getattr(box, "synchronous_start", False)
        if background:
            sandbox = BackgroundStart(box, sandbox_starts)
            sandbox.start()  # returns at once; the first tool call waits for it
        else:
            sandbox = box
            t0 = time.monotonic()
            if isinstance(sandbox_starts, StartPool):  # on a start-up slot's thread; this one waits
                began = sandbox_starts.submit(_timed_start(sandbox), t0).result()
                timings["sandbox_start_wait_s"] = round(began - t0, 3)
                timings["sandbox_start_s"] = round(time.monotonic() - began, 3)
            else:
                with sandbox_starts if sandbox_starts is not None else contextlib.nullcontext():
                    t1 = time.monotonic()
                    sandbox.start()
                timings["sandbox_start_wait_s"] = round(t1 - t0, 3)
                timings["sandbox_start_s"] = round(time.monotonic() - t1, 3)
            timings["sandbox_start_blocked_s"] = round(time.monotonic() - t0, 3)
        ctx = ToolContext(
            sandbox=sandbox,
            tool_timeout_s=settings.limits.tool_timeout_s,
            output_cap_bytes=settings.output_cap_bytes,
            extra=dict(settings.tool_extra),
            usage=usage,
        )
        result = run_agent(
            llm=llm,
            prompt=job.prompt,
            tools=tools,
            ctx=ctx,
            limits=settings.limits,
            ephemeral_system_prompt=settings.ephemeral_system_prompt,
            prefill_messages=list(settings.prefill_messages),
            usage=usage,
            log=log if settings.verbose else None,
        )
        # The backend's own value, without waiting for a start the prompt never needed.
        isolation = sandbox.inner.isolation if background else sandbox.isolation
    except LLMError as exc:
        return Outcome.failed(job, exc.error_class, str(exc), usage.as_dict())
    except SandboxError as exc:
        return Outcome.failed(job, "sandbox", str(exc), usage.as_dict())
    except PromptTimeout as exc:
        return Outcome.failed(job, "prompt_timeout", str(exc), usage.as_dict())
    except Exception as exc:  # a bug must fail one prompt, not the worker and its other prompts
        return Outcome.failed(job, "internal", f"{type(exc).__name__}: {exc}", usage.as_dict())
    finally:
        if ctx is not None:
            close_prompt_resources(ctx)
        if sandbox is not None:
            t0 = time.monotonic()
            later = background and not getattr(sandbox.inner, "synchronous_stop", False)
            if later and stop_in_background is not None and _hand_off(stop_in_background, sandbox.stop):
                timings["sandbox_stop_background"] = True
            else:
                try:
                    sandbox.stop()
                except Exception:
                    pass
            timings["sandbox_stop_s"] = round(time.monotonic() - t0, 3)
            if background:  # as known now: a start the prompt never needed may still be going on
                timings["sandbox_start_wait_s"] = sandbox.start_wait_s
                timings["sandbox_start_s"] = sandbox.start_s
                timings["sandbox_start_blocked_s"] = sandbox.blocked_s
    metadata = {
        "batch_num": job.batch_num,
        "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
        "model": settings.llm.model,
        "served_model": result.served_model,
        "stop_reason": result.stop_reason,
        "duration_s": round(time.monotonic() - started, 3),
        "sandbox": settings.sandbox_backend,
        "isolation": isolation,
        **timings,
        "usage": usage.as_dict(),
        "toolsets_sampled": list(job.toolsets_sampled if job.toolsets_sampled is not None else job.toolsets),
        "image": job.image,
        "cwd": job.cwd,
        "row_id": job.row_id,
        "row_fields": job.row_fields,
    }
    metadata["prompt_tokens"] = metadata["usage"]["prompt_tokens"]
    metadata["completion_tokens"] = metadata["usage"]["completion_tokens"]
    record = build_record(
        prompt_index=job.prompt_index,
        messages=result.messages,
        tool_schemas=[t.openai_schema() for t in tools],
        known_tools=known_tool_names(),
        metadata=metadata,
        completed=result.completed,
        partial=result.partial,
        api_calls=result.api_calls,
        toolsets_used=list(job.toolsets),
    )
    reason = quality_problem(result.messages, record, settings)
    if reason is not None:
        return Outcome.discarded(job, reason, record, usage.as_dict())
    return Outcome.trajectory(job, record, usage.as_dict())


def quality_problem(
    messages: list[dict[str, Any]], record: dict[str, Any], settings: RunSettings
) -> str | None:
    """The first quality filter a sample fails (its discard reason), or None: no broken sample is saved as good."""
    if not settings.keep_invalid_tool_calls and invalid_tool_call(messages):
        return "invalid_tool_call"
    if ambiguous_markup(messages, record["conversations"]):
        return "ambiguous_markup"  # no flag keeps it: its text does not say what the model said
    if not settings.keep_empty_answers and record["completed"] and empty_answer(messages):
        return "empty_answer"
    with_reasoning, _ = reasoning_counts(record["conversations"])
    if settings.require_reasoning and with_reasoning == 0:
        return "no_reasoning"
    return None


def _timed_start(sandbox: Any) -> Callable[[float], float]:
    """A start for a StartPool slot that returns when it began (the time after the queue)."""

    def start(queued_at: float) -> float:
        began = time.monotonic()
        sandbox.start()
        return began

    return start


def _hand_off(stop_in_background: Callable[[Callable[[], None]], None], stop: Callable[[], None]) -> bool:
    """Give ``stop`` to the background stopper (waits only while too many stops are queued); False if it refused."""
    try:
        stop_in_background(stop)
    except Exception:
        return False
    return True
