"""One dataset row, end to end: toolsets → sandbox → agent loop → record → quality filter → outcome.

Every attempted prompt ends as exactly one :class:`~batchrun.protocol.Outcome`: a trajectory, a
discard (with its reason) or a failure (with an error class and message). The parent process is
the only one that writes them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchrun.identity import request_seed_base
from batchrun.prompt.llm import ContextLimitError, LLMClient, LLMConfig, LLMError, Usage
from batchrun.prompt.loop import REPLY_DISCARDS, LoopLimits, PromptTimeout, run_agent
from batchrun.prompt.metadata import prompt_metadata
from batchrun.prompt.sandbox_lifecycle import PromptSandbox
from batchrun.prompt.sandboxes import DEFAULT_BACKEND, SandboxError, SandboxSpec, create_sandbox
from batchrun.prompt.tools import mcp
from batchrun.prompt.tools.catalog import known_tool_names, tools_for_toolsets
from batchrun.prompt.tools.config import NO_SETTINGS, ToolSettings
from batchrun.prompt.tools.mcp import McpSetup
from batchrun.prompt.tools.registry import Tool, ToolContext, close_prompt_resources, needs_sandbox_network
from batchrun.prompt.trajectory import (
    ambiguous_markup,
    build_record,
    empty_answer,
    invalid_tool_call,
    unoffered_call,
)
from batchrun.protocol import Outcome, PromptJob
from batchrun.record import conform_score, read_score
from batchrun.scoring import Judgement, RunawayPatterns, ScoringSettings, keep_problem, score_sample
from batchrun.sharegpt import parse_json, reasoning_counts


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
    # A worker that ends normally stops its servers; one that is killed takes them with it (their watchers).
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
class WorkerSettings:
    """Per-run settings a worker needs; pickled once into each worker process."""

    run_name: str
    llm: LLMConfig
    limits: LoopLimits
    sandbox_backend: str = DEFAULT_BACKEND
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    sandbox_network: bool = True  # whether the prompt's commands may reach the network
    rpm_per_worker: float | None = None  # this worker's share of --max_rpm
    requests_per_worker: int | None = None  # this worker's share of --max_concurrent_requests
    # The requests_per_worker are a llama-server's slots (the run's endpoint): no other endpoint's take one.
    request_slots_endpoint_only: bool = False
    tool_settings: ToolSettings = NO_SETTINGS  # ToolContext.settings: run endpoint, run_dir, tool_env
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
    # The run's secret values (the parent's Redactor's): a tool result holding one ends its prompt before
    # it is sent on to the model (the loop's holds_secret).
    secret_values: tuple[str, ...] = ()


def run_prompt(
    job: PromptJob,
    settings: WorkerSettings,
    llm: LLMClient,
    *,
    sandbox_starts: threading.Semaphore | Any | None = None,
    stop_in_background: Callable[[Callable[[], None]], None] | None = None,
    log=None,
    judge: LLMClient | None = None,
) -> Outcome:
    """Run one prompt and return its outcome; never raises. Every outcome carries the usage it spent.

    The sandbox's start and stop are :class:`~batchrun.prompt.sandbox_lifecycle.PromptSandbox`'s
    (``sandbox_starts``: its start-up slots; ``stop_in_background``: its background stopper). The
    sample is judged after the agent's last turn and before the sandbox stops (``judge``: the judge
    model's client); its ``score`` goes into the record.
    """
    started = time.monotonic()
    limiter = getattr(llm, "limiter", None)
    if limiter is not None:
        # Its waits credited (the judge's included) up to MAX_SLOT_WAIT_S once its first request is
        # granted; before, its wait for that request's slot up to MAX_QUEUE_WAIT_S.
        limiter.begin_prompt()
    credited_at_start = limiter.credited_s() if limiter is not None else 0.0
    usage = Usage()
    if job.fail_reason:
        return Outcome.failed(job, "preflight", job.fail_reason, usage.as_dict())
    if _TOOLS_PROBLEM:
        return Outcome.failed(job, "tools", _TOOLS_PROBLEM[0], usage.as_dict())
    tools = offered_tools(job, settings)
    limits = prompt_limits(job, settings)
    try:
        box = create_sandbox(
            settings.sandbox_backend, sandbox_spec(job, settings, tools), sandbox_options(settings)
        )
        # Its start waits for the first request's slot, when one is to be waited for (Limiter.when_granted).
        start_when = limiter.when_granted if limiter is not None else None
        lifecycle = PromptSandbox(box, sandbox_starts, stop_in_background, start_when)
        with lifecycle as sandbox, _tool_context(sandbox, settings, usage, llm) as ctx:
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
                system_prompt=job.options.system,
                request_seed=None
                if settings.request_seed is None
                else request_seed_base(settings.request_seed, job),
                holds_secret=secret_finder(settings.secret_values),
            )
            if limiter is not None:  # the judge's calls do not start it: a verify needing it does
                limiter.when_granted(None)
            record = _record(job, settings, result, usage, limits, tools, lifecycle)
            # The waits the loop's deadline was moved by (a request slot, another prompt's 429) move
            # the judging's too: without them, every sample of 20 queued on a one-slot llama-server
            # was scored "no time left for verify" (its verify never ran) although no time was its own.
            credited = limiter.credited_s() - credited_at_start if limiter is not None else 0.0
            deadline = started + credited + limits.prompt_timeout_s + settings.scoring.verify_timeout_s
            close_prompt_resources(ctx)  # the agent is done: its browser, MCP servers, ... before judging
            record["score"], judge_usage = judge_sample(
                record, job, settings.scoring, sandbox, judge, deadline
            )
    except ContextLimitError as exc:
        # Its first turn does not fit the model's context (the loop ends a later overflow as partial): the
        # same prompt, tools and model overflow again, so it is a discard --resume does not pay for again.
        return Outcome.discarded(job, "context_limit", None, usage.as_dict(), error=str(exc))
    except LLMError as exc:
        return Outcome.failed(job, exc.error_class, str(exc), usage.as_dict())
    except SandboxError as exc:
        return Outcome.failed(job, "sandbox", str(exc), usage.as_dict())
    except PromptTimeout as exc:
        return Outcome.failed(job, "prompt_timeout", str(exc), usage.as_dict())
    except Exception as exc:  # a bug must fail one prompt, not the worker and its other prompts
        return Outcome.failed(job, "internal", f"{type(exc).__name__}: {exc}", usage.as_dict())
    finally:
        if limiter is not None:  # a start never begun (no slot before the end): left to no later call
            limiter.when_granted(None)
    # The sandbox's timings and the duration as they are now that it stopped (judging included).
    record["metadata"].update(lifecycle.timings, duration_s=round(time.monotonic() - started, 3))
    spent = with_judge_usage(usage.as_dict(), judge_usage)
    reason = quality_problem(result.messages, record, settings)
    if reason is not None:
        return Outcome.discarded(job, reason, record, spent)
    return Outcome.trajectory(job, record, spent)


def offered_tools(job: PromptJob, settings: WorkerSettings) -> list[Tool]:
    """The tools of the job's toolsets, narrowed to the row's allowlist (its ``tools``) when it has one."""
    tools = tools_for_toolsets(list(job.toolsets), settings.tool_settings)
    allowed = job.options.tools
    return tools if allowed is None else [t for t in tools if t.name in allowed]


def prompt_limits(job: PromptJob, settings: WorkerSettings) -> LoopLimits:
    """The run's loop limits, with the row's own ``max_turns`` when it sets one."""
    max_turns = job.options.max_turns
    if max_turns is None:
        return settings.limits
    return dataclasses.replace(settings.limits, max_turns=max_turns)


def sandbox_spec(job: PromptJob, settings: WorkerSettings, tools: list[Tool]) -> SandboxSpec:
    return SandboxSpec(
        run_name=settings.run_name,
        prompt_index=job.prompt_index,
        image=job.image,
        cwd=job.cwd,
        network=settings.sandbox_network and _needs_network(tools, job),
    )


def _needs_network(tools: list[Any], job: PromptJob) -> bool:
    """A prompt's sandbox gets the network (when the run allows it) only if something will run there
    that may use it: an offered tool that runs commands (terminal, process, a plugin's) or the row's
    verify commands. Without one the start skips slirp4netns and its routes."""
    return needs_sandbox_network(tools) or bool(job.check and job.check.verify)


def sandbox_options(settings: WorkerSettings) -> dict[str, Any]:
    return {"output_cap_bytes": settings.output_cap_bytes, **settings.sandbox_options}


@contextlib.contextmanager
def _tool_context(
    sandbox: Any, settings: WorkerSettings, usage: Usage, llm: LLMClient
) -> Iterator[ToolContext]:
    """The prompt's ToolContext; what its tools kept open is closed on leaving, before the sandbox stops."""
    ctx = ToolContext(
        sandbox=sandbox,
        tool_timeout_s=settings.limits.tool_timeout_s,
        output_cap_bytes=settings.output_cap_bytes,
        settings=settings.tool_settings,
        usage=usage,
        llm=llm,
    )
    try:
        yield ctx
    finally:
        close_prompt_resources(ctx)


def _record(
    job: PromptJob,
    settings: WorkerSettings,
    result: Any,
    usage: Usage,
    limits: LoopLimits,
    tools: list[Tool],
    lifecycle: PromptSandbox,
) -> dict[str, Any]:
    """The sample's record as known after the agent's last turn (not yet judged, the sandbox not stopped)."""
    metadata = prompt_metadata(
        job,
        model=settings.llm.model,
        backend=settings.sandbox_backend,
        result=result,
        usage=usage,
        max_turns=limits.max_turns,
        tools=tools,
        isolation=lifecycle.isolation,
        sandbox_image=lifecycle.image,
    )
    return build_record(
        prompt_index=job.prompt_index,
        messages=result.messages,
        tool_schemas=[t.openai_schema() for t in tools],
        known_tools=known_tool_names(),
        metadata=metadata,
        completed=result.completed,
        partial=result.partial,
        api_calls=result.api_calls,
        toolsets_used=list(job.toolsets),
        system=job.options.system,
    )


# This worker's --answer_pattern searches that ran away (a worker process serves one run).
_RUNAWAYS = RunawayPatterns()


def judge_sample(
    record: dict[str, Any],
    job: PromptJob,
    scoring: ScoringSettings,
    sandbox: Any,
    judge: LLMClient | None,
    deadline: float,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The sample's ``score``, judged while the sandbox still holds what the agent made: the row's verify
    commands and hidden files (written only now, so the model never saw them), text scorers, the judge;
    and the judge's whole usage (the score's ``judge_usage`` keeps only some of its counts, not the
    ``unanswered_tokens`` the run's spend and budget count, see :func:`with_judge_usage`)."""
    judgement = Judgement(
        check=job.check,
        settings=scoring,
        row=_row_of(job),
        sandbox=sandbox,
        judge=judge,
        prompt=job.prompt,
        deadline=deadline,
        runaways=_RUNAWAYS,
    )
    score = score_sample(record, judgement)
    return conform_score(score), score.get("judge_usage")


def with_judge_usage(usage: dict[str, Any], judge: dict[str, Any] | None) -> dict[str, Any]:
    """What the sample cost the run (the outcome's usage: budget, statistics): the agent's calls plus the
    judge's, all its counts (its failed attempts' ``unanswered_tokens`` too: the parent counted them as
    they happened, and an outcome without them took them back out of the spend). The record keeps them
    apart (metadata.usage, score.judge_usage)."""
    if not judge:
        return usage
    total = dict(usage)
    for key, value in judge.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = (total.get(key) or 0) + value
    return total


@functools.lru_cache(maxsize=4)
def secret_finder(values: tuple[str, ...]) -> Callable[[str], bool] | None:
    """Whether a text holds one of ``values`` in any form the recorder finds (None: no secrets); made once
    a worker (a Redactor compiles its patterns), from the parent's values alone, so that what it finds the
    recorder finds too."""
    if not values:
        return None
    from batchrun.secrets import Redactor

    return Redactor(None, environ={}, secrets=values).finds_secret


def _row_of(job: PromptJob) -> dict[str, Any]:
    """The dataset row as a user's scorer sees it: its fields, with its prompt."""
    try:
        fields = parse_json(job.row_fields or "{}")
    except ValueError:
        fields = {}
    return {**(fields if isinstance(fields, dict) else {}), "prompt": job.prompt}


def quality_problem(
    messages: list[dict[str, Any]], record: dict[str, Any], settings: WorkerSettings
) -> str | None:
    """The first quality filter a sample fails (its discard reason), or None: no broken sample is saved as good."""
    stop_reason = record["metadata"].get("stop_reason")
    if stop_reason in REPLY_DISCARDS:  # no flag keeps it: the last reply was filtered or may be cut short
        return stop_reason
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
