"""A record's ``metadata`` as the worker knows it after the agent's last turn.

The sandbox's timings and the final ``duration_s`` are added once the sandbox has stopped; the row's
identity fields (``row_*``) by the parent's recorder. The key order is the records' column order.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from batchrun.prompt.llm import Usage
from batchrun.protocol import PromptJob


def prompt_metadata(
    job: PromptJob,
    *,
    model: str,
    backend: str,
    result: Any,
    usage: Usage,
    max_turns: int,
    tools: list[Any],
    isolation: str,
    sandbox_image: str,
) -> dict[str, Any]:
    """The metadata of ``job``'s record: ``model`` as asked, ``result`` the agent loop's, ``tools`` offered."""
    metadata = {
        "batch_num": job.batch_num,
        "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
        "model": model,
        "served_model": result.served_model,
        "stop_reason": result.stop_reason,
        "duration_s": 0.0,
        "sandbox": backend,
        "isolation": isolation,
        "usage": usage.as_dict(),
        "toolsets_sampled": toolsets_sampled(job),
        "image": job.image,
        "sandbox_image": sandbox_image,
        "cwd": job.cwd,
        "row_id": job.row_id,
        "row_fields": job.row_fields,
        "sample_index": job.sample_index,
        "occurrence": job.occurrence,
        "max_turns": max_turns,
        "tools_offered": [t.name for t in tools],
    }
    metadata["prompt_tokens"] = metadata["usage"]["prompt_tokens"]
    metadata["completion_tokens"] = metadata["usage"]["completion_tokens"]
    return metadata


def toolsets_sampled(job: PromptJob) -> list[str]:
    """What the distribution drew for the sample. Nothing was drawn for a row that names its own
    toolsets or tools: the toolsets it was given (row_toolsets, row_tools say so), never null, so the
    column has its type in every run."""
    opts = job.options
    if opts.toolsets is not None or opts.tools is not None or job.toolsets_sampled is None:
        return list(job.toolsets)
    return list(job.toolsets_sampled)
