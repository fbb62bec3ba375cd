"""The plan: each sample's toolsets (a row's own, or drawn reproducibly), the samples cut into numbered batches of jobs.

A job is one sample of one row: (dataset row, sample index). Batches are filled sample by sample
(every row's sample 0, then every row's sample 1, ...); a batch may hold several samples of one row:
the dispatch and the recorder tell jobs apart by (batch, ``prompt_index``, ``sample_index``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.config import RunConfig, UsageError
from batchrun.distributions import get_distribution, sample_toolsets_from_distribution
from batchrun.identity import toolset_rng
from batchrun.prompt.tools.catalog import available_toolsets, tools_for_toolsets, toolset_needs
from batchrun.prompt.tools.config import NO_SETTINGS, ToolSettings, extra_missing, pip_line
from batchrun.protocol import PromptJob
from batchrun.run.dataset import Row
from batchrun.run.resume import Sample
from batchrun.storage import batch_files


@dataclass
class Plan:
    batches: list[list[PromptJob]]
    offered: collections.Counter[str] = field(default_factory=collections.Counter)  # toolset -> prompts
    missing: collections.Counter[str] = field(default_factory=collections.Counter)  # sampled, not available

    @property
    def prompts(self) -> int:
        return sum(len(b) for b in self.batches)


def make_plan(
    samples: list[Sample], config: RunConfig, run_dir: Path, tool_settings: ToolSettings = NO_SETTINGS
) -> Plan:
    """Choose each sample's toolsets and cut the samples into new batches after the existing ones."""
    first = max((n for n, _ in batch_files(run_dir)), default=-1) + 1
    try:
        available = available_toolsets(tool_settings)
    except ValueError as exc:
        raise UsageError(f"toolset configuration: {exc}") from None
    dist = get_distribution(config.distribution)
    drawn_rows = [row for row, _ in samples if _draws(row)]
    if drawn_rows:
        _refuse_missing_extras(config.distribution, dist.probabilities)
    if drawn_rows and not any(t in available for t in dist.probabilities):
        # Tool-less prompts would spend tokens on samples the distribution never meant to make.
        needs = "; ".join(f"{t}: {toolset_needs(t) or 'not available'}" for t in dist.probabilities)
        raise UsageError(
            f"no toolset of distribution {config.distribution!r} is available here, so its prompts "
            f"would run without tools. Missing: {needs}. Configure one, or choose another --distribution"
        )
    # The prompts in flight share each worker's --max_rpm turns: now that their number is known.
    config.check_rates(prompts=len(samples))
    plan = Plan(batches=[])
    unavailable_rows = 0
    # The jobs are held for the whole run and their toolsets are few combinations: one tuple of each
    # (a tuple each took 160 bytes a job, 16 MB of 100,000 jobs).
    shared: dict[tuple[str, ...], tuple[str, ...]] = {}
    # Sample-major: a run stopped half-way (budget, Ctrl-C) has its first samples of every row.
    for row, s in sorted(samples, key=lambda item: item[1]):
        fail_reason = None
        sampled: tuple[str, ...] | None = None
        if _draws(row):
            unavailable: list[str] = []
            usable = sample_toolsets_from_distribution(
                config.distribution, toolset_rng(config.seed, row, s), available, unavailable
            )
            plan.missing.update(unavailable)
            # Drawn (or the guaranteed one), available here or not: ``toolsets`` is what is offered.
            sampled = tuple(t for t in dist.probabilities if t in usable or t in unavailable)
            sampled = shared.setdefault(sampled, sampled)
        else:
            usable, fail_reason = _row_toolsets(row, available, tool_settings)
            unavailable_rows += fail_reason is not None
        plan.offered.update(usable)
        offered = tuple(usable)
        if not plan.batches or len(plan.batches[-1]) >= config.batch_size:
            plan.batches.append([])
        plan.batches[-1].append(
            PromptJob(
                batch_num=first + len(plan.batches) - 1,
                prompt_index=row.index,
                prompt=row.prompt,
                toolsets=shared.setdefault(offered, offered),
                image=row.image,
                cwd=row.cwd,
                fail_reason=fail_reason,
                row_fields=row.row_fields,
                row_id=row.row_id,
                toolsets_sampled=sampled,
                options=row.options,
                sample_index=s,
                occurrence=row.occurrence,
                check=row.check,
            )
        )
    if plan.missing:
        names = ", ".join(f"{t} ({n} prompts)" for t, n in sorted(plan.missing.items()))
        print(f"note: toolsets sampled but not available in this installation, not offered: {names}")
    if unavailable_rows:
        print(
            f"warning: {unavailable_rows} sample(s) ask for a toolset or tool not available in this run; "
            "they fail without a model call (failed.jsonl says which; --resume runs them once it is configured)"
        )
    return plan


def _refuse_missing_extras(name: str, probabilities: Mapping[str, int]) -> None:
    """Stop the run when the distribution may draw a toolset whose optional extra is not installed."""
    lacking = {t: e for t, p in probabilities.items() if p > 0 and (e := extra_missing(t))}
    if lacking:
        toolsets = ", ".join(sorted(lacking))
        raise UsageError(
            f"distribution {name!r} may draw toolset(s) {toolsets}, whose packages are not installed: "
            f"{pip_line(lacking.values())}, or choose another --distribution (--list_distributions)"
        )


def _draws(row: Row) -> bool:
    """Whether the row's toolsets come from the distribution (it names neither toolsets nor tools)."""
    return row.options.toolsets is None and row.options.tools is None


def _row_toolsets(row: Row, available: set[str], tool_settings: ToolSettings) -> tuple[list[str], str | None]:
    """A row's own toolsets (its ``toolsets``, else those of its ``tools``), and why the row cannot run
    as it asked in this run (None: it can): a row is offered exactly what it asked for, or fails."""
    from batchrun.prompt.tools.catalog import all_tools

    opts = row.options
    if opts.toolsets is not None:
        toolsets = list(opts.toolsets)
    else:
        registry = all_tools()
        toolsets = sorted({registry[name].toolset for name in opts.tools or ()})
    for toolset in toolsets:
        if toolset not in available:
            extra = extra_missing(toolset)
            needs = pip_line([extra]) if extra else toolset_needs(toolset) or "not configured"
            return (
                toolsets,
                f"the row asks for toolset {toolset!r}, which is not available in this run ({needs})",
            )
    if opts.tools is not None:
        offered = {t.name for t in tools_for_toolsets(toolsets, tool_settings)}
        for name in opts.tools:
            if name not in offered:
                return (
                    toolsets,
                    f"the row asks for tool {name!r}, which its toolsets do not offer in this run",
                )
    return toolsets, None


def print_plan(rows: list[Row], plan: Plan, config: RunConfig, base_url: str) -> None:
    from batchrun.prompt.llm import resolve_dialect, safe_url
    from batchrun.prompt.sandbox_lifecycle import start_slots_per_worker
    from batchrun.prompt.sandboxes import backend_class

    n = plan.prompts
    in_flight = min(config.num_workers * config.prompts_per_worker, max(n, 1))
    samples = f" x {config.samples_per_prompt} samples" if config.samples_per_prompt > 1 else ""
    starts = config.num_workers * start_slots_per_worker(
        backend_class(config.backend), config.max_sandbox_starts, config.num_workers
    )
    print(
        f"Run {config.run_name}: {len(rows)} prompts in dataset{samples}, {n} to run in {len(plan.batches)} batches | "
        f"model {config.model} at {safe_url(base_url)} ({resolve_dialect(base_url, config.endpoint_dialect)} "
        f"dialect) | sandbox {config.backend} | "
        f"{config.num_workers} workers x {config.prompts_per_worker} prompts = up to {in_flight} in flight, "
        f"{starts} concurrent sandbox start-ups"
    )
    if config.max_tokens is None and config.call_max_tokens is not None:
        print(
            f"Budget: each model call's completion is limited to {config.call_max_tokens} tokens (--max_tokens "
            "not set): a call is sent only when what was spent, what calls in flight may still spend and its "
            "own worst case fit the budget"
        )
