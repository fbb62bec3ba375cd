"""One dataset row, end to end: toolsets → sandbox → agent loop → record → quality filter → outcome.

Every attempted prompt ends as exactly one :class:`~batchrun.protocol.Outcome`: a trajectory, a
discard (with its reason) or a failure (with an error class and message). The parent process is
the only one that writes them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime as dt
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchrun.identity import request_seed_base
from batchrun.prompt.llm import LLMClient, LLMConfig, LLMError, Usage
from batchrun.prompt.loop import LoopLimits, PromptTimeout, run_agent
from batchrun.prompt.sandbox_lifecycle import BackgroundStart, StartPool
from batchrun.prompt.sandboxes import SandboxError, SandboxSpec, create_sandbox
from batchrun.prompt.sandboxes.base import declared
from batchrun.prompt.tools import mcp
from batchrun.prompt.tools.catalog import known_tool_names, tools_for_toolsets
from batchrun.prompt.tools.mcp import McpSetup
from batchrun.prompt.tools.registry import ToolContext, close_prompt_resources
from batchrun.prompt.trajectory import (
    ambiguous_markup,
    build_record,
    empty_answer,
    invalid_tool_call,
    unoffered_call,
)
from batchrun.protocol import Outcome, PromptJob
from batchrun.record import conform_score, read_score
from batchrun.scoring import Judgement, ScoringSettings, keep_problem, score_sample
from batchrun.sharegpt import reasoning_counts


@dataclass(frozen=True)
class RunTools:
    """The run's tools beyond the built-ins, as the parent found them: each worker installs the same."""

    mcp: McpSetup | None = None  # the MCP servers and the tools the parent listed
    known_tools: tuple[str, ...] = ()  # the parent's known_tool_names(): a worker must know exactly these


_TOOLS_PROBLEM: list[str] = []  # set by install_run_tools: why this worker cannot run prompts


def install_run_tools(tools: RunTools | None) -> None:
    """In a worker, at start: the run's MCP tools; then check it knows the same tools as the parent.

    A worker that does not (a plugin missing or broken on a Ray node) fails each of its prompts with
    the reason, without a model call: a raising initializer would only be restarted again and again.
    """
    _TOOLS_PROBLEM.clear()
    if tools is None:
        known_tool_names()  # the registry (built-ins, plugins) loaded now, not by the first prompt
        return
    mcp.install(tools.mcp)
    # A worker that ends normally stops its servers; one that is killed closes their stdin, which ends them.
    atexit.register(mcp.kill_server_groups)  # atexit runs in reverse: after close_shared, what is left
    atexit.register(mcp.close_shared)
    here = known_tool_names()
    if tools.known_tools and list(tools.known_tools) != here:
        missing = sorted(set(tools.known_tools) - set(here))
        extra = sorted(set(here) - set(tools.known_tools))
        _TOOLS_PROBLEM.append(
            f"this worker's tools differ from the runner's (missing: {', '.join(missing) or '-'}; "
            f"extra: {', '.join(extra) or '-'}): install the same toolset plugins where the workers run"
        )


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
    tools: RunTools | None = None
    # --seed_per_request: the run's --seed, from which each request's ``seed`` is derived; None: no seed sent.
    request_seed: int | None = None
    budget_gate: bool = (
        False  # a run-wide budget: every model call asks the parent first (batchrun/run/budget.py)
    )
    # How samples are judged (--scorer, --keep, ...); the judge model's client settings (--judge_model).
    scoring: ScoringSettings = field(default_factory=ScoringSettings)
    judge_llm: LLMConfig | None = None


def run_prompt(
    job: PromptJob,
    settings: RunSettings,
    llm: LLMClient,
    *,
    sandbox_starts: threading.Semaphore | Any | None = None,
    stop_in_background: Callable[[Callable[[], None]], None] | None = None,
    log=None,
    judge: LLMClient | None = None,
) -> Outcome:
    """Run one prompt and return its outcome; never raises. Every outcome carries the usage it spent.

    The sandbox starts on a start-up slot (``sandbox_starts``: a ``StartPool`` or a semaphore) while the
    first model call is in flight; the first tool call waits for it (a backend with
    ``synchronous_start`` starts here, before any model call). ``stop_in_background`` (e.g.
    ``BackgroundStopper.submit``), when given, takes the sandbox's stop off the prompt's path: the
    outcome is returned at once and the stop runs later. A backend with ``synchronous_stop`` (local:
    a few ms) always stops here, so its stop costs the parent no messages.

    The sample is judged after the agent's last turn and before the sandbox stops (the row's verify
    commands and hidden files, text scorers, ``judge``: the judge model's client); its ``score`` goes
    into the record.
    """
    started = time.monotonic()
    usage = Usage()
    if job.fail_reason:
        return Outcome.failed(job, "preflight", job.fail_reason, usage.as_dict())
    if _TOOLS_PROBLEM:
        return Outcome.failed(job, "tools", _TOOLS_PROBLEM[0], usage.as_dict())
    tools = tools_for_toolsets(list(job.toolsets), settings.tool_extra)
    own = job.options
    if own.tools is not None:  # the row's allowlist: only these are offered
        tools = [t for t in tools if t.name in own.tools]
    limits = settings.limits
    if own.max_turns is not None:
        limits = dataclasses.replace(limits, max_turns=own.max_turns)
    spec = SandboxSpec(
        run_name=settings.run_name,
        prompt_index=job.prompt_index,
        image=job.image,
        cwd=job.cwd,
        network=settings.sandbox_network,
    )
    options = {"output_cap_bytes": settings.output_cap_bytes, **settings.sandbox_options}
    sandbox = None
    sandbox_image = ""
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
        sandbox_image = getattr(box, "image", None) or ""  # the row's or the backend's default
        # The start runs on a start-up slot while the prompt's first model call is in flight: the
        # prompt pays for it only when its first tool call comes before the start is done.
        background = not declared(box, "synchronous_start")
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
            llm=llm,
        )
        result = run_agent(
            llm=llm,
            prompt=job.prompt,
            tools=tools,
            ctx=ctx,
            limits=limits,
            ephemeral_system_prompt=settings.ephemeral_system_prompt,
            prefill_messages=list(settings.prefill_messages),
            usage=usage,
            log=log if settings.verbose else None,
            system_prompt=own.system,
            request_seed=None
            if settings.request_seed is None
            else request_seed_base(settings.request_seed, job),
        )
        # The backend's own value, without waiting for a start the prompt never needed.
        isolation = sandbox.inner.isolation if background else sandbox.isolation
        metadata = _metadata(job, settings, result, usage, limits, tools, isolation, sandbox_image)
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
            system=own.system,
        )
        # Judged now: the agent is done and the sandbox still holds what it made. Hidden files are
        # written only here, so the model never saw them.
        record["score"] = conform_score(
            score_sample(
                record,
                Judgement(
                    check=job.check,
                    settings=settings.scoring,
                    row=_row_of(job),
                    sandbox=sandbox,
                    judge=judge,
                    prompt=job.prompt,
                    deadline=started + limits.prompt_timeout_s + settings.scoring.verify_timeout_s,
                ),
            )
        )
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
    # The sandbox's timings and the duration as they are now that it stopped (judging included).
    record["metadata"].update(timings, duration_s=round(time.monotonic() - started, 3))
    spent = with_judge_usage(usage.as_dict(), record["score"]["judge_usage"])
    reason = quality_problem(result.messages, record, settings)
    if reason is not None:
        return Outcome.discarded(job, reason, record, spent)
    return Outcome.trajectory(job, record, spent)


def with_judge_usage(usage: dict[str, Any], judge: dict[str, Any] | None) -> dict[str, Any]:
    """What the sample cost the run (the outcome's usage: budget, statistics): the agent's calls plus the
    judge's. The record keeps them apart (metadata.usage, score.judge_usage)."""
    if not judge:
        return usage
    total = dict(usage)
    for key, value in judge.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = (total.get(key) or 0) + value
    return total


def _metadata(
    job: PromptJob,
    settings: RunSettings,
    result: Any,
    usage: Usage,
    limits: LoopLimits,
    tools: list[Any],
    isolation: str,
    sandbox_image: str,
) -> dict[str, Any]:
    """The record's metadata as known after the last turn (the sandbox's stop timings are added later)."""
    own = job.options
    metadata = {
        "batch_num": job.batch_num,
        "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
        "model": settings.llm.model,
        "served_model": result.served_model,
        "stop_reason": result.stop_reason,
        "duration_s": 0.0,
        "sandbox": settings.sandbox_backend,
        "isolation": isolation,
        "usage": usage.as_dict(),
        # Nothing was drawn for a row that names its own toolsets or tools: the toolsets it was given
        # (row_toolsets, row_tools say so), never null, so the column has its type in every run.
        "toolsets_sampled": list(job.toolsets)
        if own.toolsets is not None or own.tools is not None or job.toolsets_sampled is None
        else list(job.toolsets_sampled),
        "image": job.image,
        "sandbox_image": sandbox_image,
        "cwd": job.cwd,
        "row_id": job.row_id,
        "row_fields": job.row_fields,
        # The row's identity fields (row_*, sample_index) are filled in by the parent's recorder.
        "sample_index": job.sample_index,
        "max_turns": limits.max_turns,
        "tools_offered": [t.name for t in tools],
    }
    metadata["prompt_tokens"] = metadata["usage"]["prompt_tokens"]
    metadata["completion_tokens"] = metadata["usage"]["completion_tokens"]
    return metadata


def _row_of(job: PromptJob) -> dict[str, Any]:
    """The dataset row as a user's scorer sees it: its fields, with its prompt."""
    try:
        fields = json.loads(job.row_fields or "{}")
    except ValueError:
        fields = {}
    return {**(fields if isinstance(fields, dict) else {}), "prompt": job.prompt}


def quality_problem(
    messages: list[dict[str, Any]], record: dict[str, Any], settings: RunSettings
) -> str | None:
    """The first quality filter a sample fails (its discard reason), or None: no broken sample is saved as good."""
    if not settings.keep_invalid_tool_calls and invalid_tool_call(messages):
        return "invalid_tool_call"
    # No flag keeps these: a call to a tool that was not offered is never a kept sample, partial or not.
    unoffered = unoffered_call(
        messages,
        set(record["metadata"]["tools_offered"]),
        set(known_tool_names()),  # not tool_stats: it counts every name called, hallucinated ones too
    )
    if unoffered is not None:
        return unoffered
    if ambiguous_markup(messages, record["conversations"]):
        return "ambiguous_markup"  # no flag keeps it: its text does not say what the model said
    if not settings.keep_empty_answers and record["completed"] and empty_answer(messages):
        return "empty_answer"
    with_reasoning, _ = reasoning_counts(record["conversations"])
    if settings.require_reasoning and with_reasoning == 0:
        return "no_reasoning"
    return keep_problem(read_score(record.get("score")), settings.scoring.keep)  # --keep=passed


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
