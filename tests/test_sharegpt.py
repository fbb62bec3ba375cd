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


VERBATIM_ARGUMENTS = [
    '{"n": 1e2}',  # was saved (and sent back to the model) as {"n": 100.0}
    '{"a":1}',  # was {"a": 1}
    '{"s": "\\u00e9"}',  # was {"s": "é"}
    '{"b": 1, "a": 2}',  # key order
    '{\n  "command": "ls",\n  "timeout": 5\n}',  # pretty-printed
    ' {"command": "ls"}\n',  # a space and a line break around the object: the model's, kept
    '{"x": "</tool_call> and \\n</tool_call>"}',
    '{"big": 123456789012345678901234567890, "f": 0.10000000000000000001}',
    '{"u": "\u2028 \\u2028 \\ud83c\\udf0d"}',
]


@pytest.mark.parametrize("raw", VERBATIM_ARGUMENTS)
def test_arguments_are_saved_and_written_into_the_block_as_the_model_wrote_them(raw):
    assert canonical_arguments(raw) == raw
    value = gpt_value("why", "words", [_call("call_1", "terminal", raw)])
    block = value.split("\n", 4)[-1]
    assert block == '<tool_call>\n{"name": "terminal", "arguments": ' + raw + "}\n</tool_call>"
    # A JSON reader of the block reads the model's object; the runner's reader gives its text back.
    inner = block.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(inner) == {"name": "terminal", "arguments": json.loads(raw)}
    assert parse_tool_calls(value) == [{"name": "terminal", "arguments": raw}]


def test_no_arguments_are_an_empty_object_and_other_text_is_kept():
    assert canonical_arguments("") == canonical_arguments(" \n") == "{}"
    assert canonical_arguments("{oops") == "{oops"
    assert canonical_arguments("[1,2]") == "[1,2]"


def test_blocks_written_by_earlier_versions_read_back_as_their_tool_calls():
    # Canonical arguments, and a block re-encoded from them; another writer's block (other key order).
    old = '<think>\n</think>\n<tool_call>\n{"name": "t", "arguments": {"n": 100.0, "s": "é"}}\n</tool_call>'
    assert parse_tool_calls(old) == [{"name": "t", "arguments": '{"n": 100.0, "s": "é"}'}]
    other = '<tool_call>\n{"arguments": {"a":1}, "name": "t"}\n</tool_call>'
    assert parse_tool_calls(other) == [{"name": "t", "arguments": '{"a": 1}'}]
    extra = '<tool_call>\n{"name": "t", "arguments": {"a":1}, "id": "x"}\n</tool_call>'
    assert parse_tool_calls(extra) == [{"name": "t", "arguments": '{"a": 1}'}]


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


def test_reasoning_is_found_as_the_envelope_pattern_finds_it():
    """``_has_reasoning`` (every kept turn of every record, twice a merge) finds without copying what
    ``_THINK_RE`` finds: a leading closed envelope with more than white space inside."""
    import random

    from batchrun.sharegpt import _THINK_RE, _has_reasoning

    def by_pattern(value: str) -> bool:
        found = _THINK_RE.match(value)
        return found is not None and bool(found.group(1).strip())

    rng = random.Random(3)
    parts = ["<think>", "</think>", " ", "\n", "\u00a0", "\x1c", "\u2003", "a", "x y", "<think", "think>", ""]
    for _ in range(50_000):
        value = "".join(rng.choice(parts) for _ in range(rng.randint(0, 7)))
        assert _has_reasoning(value) == by_pattern(value), repr(value)
