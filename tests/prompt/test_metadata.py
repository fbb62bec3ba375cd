"""prompt_metadata (batchrun/prompt/metadata.py): what a record's metadata says of its sample."""

from __future__ import annotations

from types import SimpleNamespace

from batchrun.prompt.llm import Usage
from batchrun.prompt.metadata import prompt_metadata, toolsets_sampled
from batchrun.protocol import PromptJob, RowOptions


def job(**kw) -> PromptJob:
    return PromptJob(batch_num=3, prompt_index=7, prompt="p", toolsets=("terminal",), **kw)


def test_a_drawn_sample_keeps_what_the_distribution_drew_even_where_it_was_not_offered():
    assert toolsets_sampled(job(toolsets_sampled=("web", "terminal"))) == ["web", "terminal"]


def test_a_row_naming_its_toolsets_or_tools_says_what_it_was_given_never_null():
    assert toolsets_sampled(job(options=RowOptions(toolsets=("terminal",)), toolsets_sampled=("web",))) == [
        "terminal"
    ]
    assert toolsets_sampled(job(options=RowOptions(tools=("terminal",)))) == ["terminal"]
    assert toolsets_sampled(job()) == ["terminal"]  # nothing drawn, nothing named


def test_the_metadata_columns_in_their_order_with_the_token_counts_from_usage():
    usage = Usage()
    result = SimpleNamespace(served_model="served", stop_reason="answered")
    tools = [SimpleNamespace(name="terminal"), SimpleNamespace(name="process")]
    meta = prompt_metadata(
        job(image="img:1", cwd="/w", row_id="r1", sample_index=2, occurrence=2),
        model="asked",
        backend="local",
        result=result,
        usage=usage,
        max_turns=9,
        tools=tools,
        isolation="bwrap",
        sandbox_image="img:1",
    )
    assert list(meta) == [
        "batch_num", "timestamp", "model", "served_model", "stop_reason", "duration_s", "sandbox",
        "isolation", "usage", "toolsets_sampled", "image", "sandbox_image", "cwd", "row_id",
        "row_fields", "sample_index", "occurrence", "max_turns", "tools_offered", "prompt_tokens",
        "completion_tokens",
    ]  # fmt: skip
    assert meta["occurrence"] == 2  # the job's: two earlier rows held its prompt text
    assert (meta["batch_num"], meta["model"], meta["served_model"], meta["sandbox"]) == (
        3,
        "asked",
        "served",
        "local",
    )
    assert meta["tools_offered"] == ["terminal", "process"] and meta["max_turns"] == 9
    assert meta["usage"] == usage.as_dict()
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (
        usage.as_dict()["prompt_tokens"],
        usage.as_dict()["completion_tokens"],
    )
