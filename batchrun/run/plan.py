"""The plan: each row's toolsets sampled (reproducibly), the rows cut into numbered batches of jobs."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.config import RunConfig, UsageError
from batchrun.distributions import get_distribution, prompt_rng, sample_toolsets_from_distribution
from batchrun.prompt.tools.registry import available_toolsets, toolset_needs
from batchrun.protocol import PromptJob
from batchrun.run.dataset import Row
from batchrun.storage import batch_files


@dataclass
class Plan:
    batches: list[list[PromptJob]]
    offered: collections.Counter[str] = field(default_factory=collections.Counter)  # toolset -> prompts
    missing: collections.Counter[str] = field(default_factory=collections.Counter)  # sampled, not available

    @property
    def prompts(self) -> int:
        return sum(len(b) for b in self.batches)


def make_plan(rows: list[Row], config: RunConfig, run_dir: Path, tool_extra: dict[str, Any]) -> Plan:
    """Sample toolsets (reproducibly per prompt) and cut the rows into new batches after the existing ones."""
    first = max((n for n, _ in batch_files(run_dir)), default=-1) + 1
    try:
        available = available_toolsets(tool_extra)
    except ValueError as exc:
        raise UsageError(f"toolset configuration: {exc}") from None
    dist = get_distribution(config.distribution)
    if rows and not any(t in available for t in dist.probabilities):
        # Tool-less prompts would spend tokens on samples the distribution never meant to make.
        needs = "; ".join(f"{t}: {toolset_needs(t) or 'not available'}" for t in dist.probabilities)
        raise UsageError(
            f"no toolset of distribution {config.distribution!r} is available here, so its prompts "
            f"would run without tools. Missing: {needs}. Configure one, or choose another --distribution"
        )
    plan = Plan(batches=[])
    for i, row in enumerate(rows):
        rng = prompt_rng(config.seed, row.prompt, row.occurrence)
        unavailable: list[str] = []
        usable = sample_toolsets_from_distribution(config.distribution, rng, available, unavailable)
        plan.missing.update(unavailable)
        plan.offered.update(usable)
        if i % config.batch_size == 0:
            plan.batches.append([])
        plan.batches[-1].append(
            PromptJob(
                batch_num=first + i // config.batch_size,
                prompt_index=row.index,
                prompt=row.prompt,
                toolsets=tuple(usable),
                image=row.image,
                cwd=row.cwd,
                row_fields=row.row_fields,
                row_id=row.row_id,
                # Drawn (or the guaranteed one), available here or not: ``toolsets`` is what is offered.
                toolsets_sampled=tuple(t for t in dist.probabilities if t in usable or t in unavailable),
            )
        )
    if plan.missing:
        names = ", ".join(f"{t} ({n} prompts)" for t, n in sorted(plan.missing.items()))
        print(f"note: toolsets sampled but not available in this installation, not offered: {names}")
    return plan


def print_plan(rows: list[Row], plan: Plan, config: RunConfig, base_url: str) -> None:
    from batchrun.prompt.sandbox_lifecycle import start_slots_per_worker
    from batchrun.prompt.sandboxes import backend_class

    n = plan.prompts
    in_flight = min(config.num_workers * config.prompts_per_worker, max(n, 1))
    starts = config.num_workers * start_slots_per_worker(
        backend_class(config.backend), config.max_sandbox_starts, config.num_workers
    )
    print(
        f"Run {config.run_name}: {len(rows)} prompts in dataset, {n} to run in {len(plan.batches)} batches | "
        f"model {config.model} at {base_url} | sandbox {config.backend} | "
        f"{config.num_workers} workers x {config.prompts_per_worker} prompts = up to {in_flight} in flight, "
        f"{starts} concurrent sandbox start-ups"
    )
