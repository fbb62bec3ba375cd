"""batchrun/sharegpt.py: the records' text convention: reasoning pulled out of content, tool calls
written into a gpt value and read back exactly."""

from __future__ import annotations

import json

import pytest

from batchrun.sharegpt import (
    canonical_arguments,
    gpt_value,
    parse_tool_calls,
    parse_tool_responses,
    split_reasoning,
    tool_response_block,
)


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ----------------------------------------------------------------------------- split_reasoning


def test_scratchpad_at_start_becomes_reasoning_and_leaves_the_answer():
    reasoning, content = split_reasoning(
        "<REASONING_SCRATCHPAD>I should list files.</REASONING_SCRATCHPAD>\nLet me use terminal."
    )
    assert reasoning == "I should list files."
    assert content == "Let me use terminal."


def test_several_scratchpads_anywhere_are_joined_in_order():
    reasoning, content = split_reasoning(
        "<REASONING_SCRATCHPAD> first </REASONING_SCRATCHPAD>Answer part one. "
        "<REASONING_SCRATCHPAD>second</REASONING_SCRATCHPAD>Part two."
    )
    assert reasoning == "first\n\nsecond"
    assert "REASONING_SCRATCHPAD" not in content
    assert content == "Answer part one. Part two."


def test_leading_think_block_becomes_reasoning():
    reasoning, content = split_reasoning("  <think>\nweigh the options\n</think>\nThe answer is 4.")
    assert reasoning == "weigh the options"
    assert content == "The answer is 4."


def test_think_not_at_the_start_is_part_of_the_content():
    text = "The tag <think>x</think> is how some models show reasoning."
    assert split_reasoning(text) == (None, text)


def test_scratchpad_and_think_together_keep_both():
    reasoning, content = split_reasoning(
        "<REASONING_SCRATCHPAD>pad</REASONING_SCRATCHPAD><think>thought</think>done"
    )
    assert reasoning == "pad\n\nthought"
    assert content == "done"


@pytest.mark.parametrize("content", [None, "", "Plain answer, no reasoning at all."])
def test_no_reasoning_gives_none(content):
    reasoning, rest = split_reasoning(content)
    assert reasoning is None
    assert rest == (content or "")


def test_empty_scratchpad_is_no_reasoning():
    assert split_reasoning("<REASONING_SCRATCHPAD>  </REASONING_SCRATCHPAD>hi") == (None, "hi")


# ----------------------------------------------------------------------------- parse_tool_calls round trip

ROUND_TRIP_ARGUMENTS = [
    '{"command": "ls -la"}',
    '{"command":"ls",   "timeout": 5}',  # not canonical spacing
    '{"path": "docs/ünïcödé 🌍.txt", "content": "line1\\nline2\\t\\"quoted\\""}',
    '{"nested": {"a": [1, 2.5, null, true]}, "empty": {}}',
    '{"x": "a literal \\n</tool_call> inside the value"}',
    "{broken json",
    "not json at all",
    "",
    "[1, 2, 3]",
    "123",
    "null",
    '{"command": "ls"} trailing garbage',
]


@pytest.mark.parametrize("raw", ROUND_TRIP_ARGUMENTS)
def test_parse_tool_calls_round_trip(raw):
    args = canonical_arguments(raw)
    calls = [_call("call_1", "terminal", args), _call("call_2", "write_file", '{"path": "p"}')]
    value = gpt_value("why", "text", calls)
    assert parse_tool_calls(value) == [
        {"name": "terminal", "arguments": args},
        {"name": "write_file", "arguments": '{"path": "p"}'},
    ]


def test_canonical_arguments_normalises_json_and_keeps_other_text():
    assert canonical_arguments('{"b":1,"a":"é"}') == '{"b": 1, "a": "é"}'
    assert canonical_arguments("{oops") == "{oops"


@pytest.mark.parametrize("raw", ['"ls -la"', json.dumps(json.dumps({"command": "ls"}))])
def test_parse_tool_calls_round_trip_json_string_arguments(raw):
    args = canonical_arguments(raw)
    value = gpt_value(None, "", [_call("call_1", "terminal", args)])
    assert parse_tool_calls(value) == [{"name": "terminal", "arguments": args}]


@pytest.mark.parametrize(
    "content",
    [
        '{"output": "é", "exit_code": 0}',  # as the tools write their results: kept as a JSON value
        '{"error": "r\\u00e9pertoire"}',  # an error written with \u escapes
        '{"a":1}',  # other spacing
        '"quoted"',  # a JSON string: its quotes are part of the text
        "1.0e3",
        "plain text",
    ],
)
def test_a_tool_result_reads_back_as_the_text_the_model_saw(content):
    block = tool_response_block("call_1", "terminal", content)
    assert parse_tool_responses(block) == [{"tool_call_id": "call_1", "name": "terminal", "content": content}]
