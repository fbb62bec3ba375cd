"""batchrun/prompt/trajectory.py: a record built from a prompt's messages (ShareGPT rendering), its quality checks."""

from __future__ import annotations

import json

from batchrun.prompt.trajectory import ambiguous_markup, build_record, to_sharegpt
from batchrun.record import RECORD_FIELDS
from batchrun.sharegpt import (
    SYSTEM_PREAMBLE,
    first_human,
    gpt_value,
    offered_tools,
    parse_gpt_value,
    parse_tool_calls,
    parse_tool_responses,
    reasoning_counts,
    used_tool_names,
)

# ----------------------------------------------------------------------------- to_sharegpt


def _schema(name: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


MESSAGES = [
    {"role": "user", "content": "Do two things"},
    {
        "role": "assistant",
        "content": "Running both.",
        "reasoning": "Two calls in parallel.",
        "tool_calls": [
            _call("c1", "terminal", '{"command": "ls"}'),
            _call("c2", "read_file", '{"path": "a.txt"}'),
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "c1",
        "name": "terminal",
        "content": '{"output": "a.txt\\n", "exit_code": 0}',
    },
    {"role": "tool", "tool_call_id": "c2", "name": "read_file", "content": "error: not json text"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "One more.",
        "tool_calls": [_call("c3", "terminal", "{broken")],
    },
    {"role": "tool", "tool_call_id": "c3", "name": "terminal", "content": '{"error": "Invalid JSON"}'},
    {"role": "assistant", "content": "All done.", "reasoning": None},
]
SCHEMAS = [_schema("terminal"), _schema("read_file")]


def _blocks(value: str) -> list[dict]:
    parts = value.split("<tool_response>\n")[1:]
    return [json.loads(p.split("\n</tool_response>")[0]) for p in parts]


def test_to_sharegpt_roles_and_merged_tool_results():
    conv = to_sharegpt(MESSAGES, SCHEMAS)
    assert [c["from"] for c in conv] == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt"]
    assert conv[1]["value"] == "Do two things"
    first_tools = _blocks(conv[3]["value"])
    assert [b["tool_call_id"] for b in first_tools] == ["c1", "c2"]
    assert [b["name"] for b in first_tools] == ["terminal", "read_file"]
    assert first_tools[0]["content"] == {"output": "a.txt\n", "exit_code": 0}  # JSON results stay JSON
    assert first_tools[1]["content"] == "error: not json text"  # text results stay text
    assert conv[3]["value"].count("<tool_response>") == 2
    assert _blocks(conv[5]["value"]) == [
        {"tool_call_id": "c3", "name": "terminal", "content": {"error": "Invalid JSON"}}
    ]


def test_the_results_of_a_reply_of_thousands_of_calls_are_all_in_one_tool_entry():
    # A reply of 10,000 calls (128 run, with 60 KB of output each; the rest answered that they were not
    # run): appending each result to the entry copied all the results before it, 38 s of one core for
    # this record, spent after the prompt's deadline was last checked; joined once: 0.21 s
    # (benchmarks/README.md; speed is measured there, not asserted here).
    n, run = 10_000, 128
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}
        for i in range(n)
    ]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "reasoning": "r", "tool_calls": calls},
    ]
    for i in range(n):
        content = {"output": "a" * 60_000} if i < run else {"error": "Not run: more than 128 tool calls"}
        messages.append(
            {"role": "tool", "tool_call_id": f"c{i}", "name": "terminal", "content": json.dumps(content)}
        )
    messages.append({"role": "assistant", "content": "done", "reasoning": "r"})
    conv = to_sharegpt(messages, [])
    assert [c["from"] for c in conv] == ["system", "human", "gpt", "tool", "gpt"]
    responses = parse_tool_responses(conv[3]["value"])
    assert [r["tool_call_id"] for r in responses] == [f"c{i}" for i in range(n)]


def test_to_sharegpt_system_lists_exactly_the_schemas():
    conv = to_sharegpt(MESSAGES, SCHEMAS)
    system = conv[0]["value"]
    # Each entry carries the reference's keys: name, description, parameters and required (null).
    entries = [{**s["function"], "required": None} for s in SCHEMAS]
    assert system == SYSTEM_PREAMBLE.format(tools=json.dumps(entries))
    listed = json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0])
    assert listed == entries
    assert [list(e) for e in listed] == [["name", "description", "parameters", "required"]] * len(SCHEMAS)
    assert offered_tools(system) == SCHEMAS  # read back as the OpenAI schemas, without the null key


def test_a_turn_without_reasoning_opens_with_an_empty_think_block_as_the_reference_renders_it():
    assert gpt_value(None, "Hello.", []) == "<think>\n</think>\nHello."
    assert gpt_value("", "", []) == "<think>\n</think>"
    call = {"function": {"name": "terminal", "arguments": '{"command": "ls"}'}}
    value = gpt_value(None, "", [call])
    assert (
        value
        == '<think>\n</think>\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>'
    )
    assert parse_gpt_value(value) == (None, "", [{"name": "terminal", "arguments": '{"command": "ls"}'}])
    assert reasoning_counts([{"from": "gpt", "value": value}]) == (0, 1)


def test_to_sharegpt_gpt_turns_think_and_tool_calls():
    conv = to_sharegpt(MESSAGES, SCHEMAS)
    first, second, last = conv[2], conv[4], conv[6]
    assert first["value"].startswith(
        "<think>\nTwo calls in parallel.\n</think>\nRunning both.\n<tool_call>\n"
    )
    assert [c["id"] for c in first["tool_calls"]] == ["c1", "c2"]
    assert second["value"].startswith("<think>\nOne more.\n</think>\n<tool_call>\n")
    # No reasoning: an empty <think> block, as the reference writes it. tool_calls is on every entry
    # (empty without calls), so the schema holds.
    assert last == {"from": "gpt", "value": "<think>\n</think>\nAll done.", "tool_calls": []}
    for entry in (first, second):
        assert parse_tool_calls(entry["value"]) == [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in entry["tool_calls"]
        ]


def test_to_sharegpt_with_no_tools_offered():
    conv = to_sharegpt([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], [])
    assert "<tools>\n[]\n</tools>" in conv[0]["value"]
    assert [c["from"] for c in conv] == ["system", "human", "gpt"]


def test_tool_call_text_in_content_is_kept_verbatim_and_flagged_ambiguous():
    content = (
        'Hermes models write calls like\n<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>\nas text.'
    )
    calls = [_call("call_1", "terminal", '{"command": "ls"}')]
    value = gpt_value("thinking", content, calls)
    assert content in value  # the model's words are never rewritten
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": content, "reasoning": "thinking", "tool_calls": calls},
    ]
    conv = to_sharegpt(messages, [])
    assert ambiguous_markup(messages, conv)  # it would parse back as a call never made: discarded


def test_the_models_spaces_and_line_breaks_are_kept_in_the_record_and_parse_back():
    call = _call("call_1", "terminal", '{"command": "ls"}')
    turns = [  # (reasoning, words, calls) as the endpoint sent them
        ("  plan\n", "Running it: ", [call]),
        ("\n", "\n\nlet me look\n", [call]),
        (None, "\n", [call]),
        ("done\n\n", "  The answer is 4.\n", []),
    ]
    messages = [{"role": "user", "content": "q"}]
    for reasoning, words, calls in turns:
        messages.append({"role": "assistant", "content": words, "reasoning": reasoning, "tool_calls": calls})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"], "name": "terminal", "content": "ok"})
    conv = to_sharegpt(messages, [])
    values = [c["value"] for c in conv if c["from"] == "gpt"]
    assert values[0].startswith("<think>\n  plan\n\n</think>\nRunning it: \n<tool_call>\n")
    assert values[3] == "<think>\ndone\n\n\n</think>\n  The answer is 4.\n"
    for (reasoning, words, calls), value in zip(turns, values, strict=True):
        expected_calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ]
        assert parse_gpt_value(value) == (reasoning, words, expected_calls)
    assert not ambiguous_markup(messages, conv)  # exact words are not a reason to discard a sample


def test_values_written_before_the_words_were_kept_exactly_read_as_they_did():
    # older records (and the reference's): stripped words after "</think>\n"
    call = '<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>'
    assert parse_gpt_value("<think>\nplan\n</think>\nRunning it.\n" + call) == (
        "plan",
        "Running it.",
        [{"name": "terminal", "arguments": '{"command": "ls"}'}],
    )
    assert parse_gpt_value("<think>\n</think>\nAll done.") == (None, "All done.", [])
    # another tool's shape, read loosely
    assert parse_gpt_value("<think>plan</think>All done.") == ("plan", "All done.", [])
    assert parse_gpt_value("All done.") == (None, "All done.", [])


# ----------------------------------------------------------------------------- build_record and helpers

KNOWN = ["patch", "read_file", "search_files", "terminal", "write_file"]


def _record():
    return build_record(
        prompt_index=7,
        messages=MESSAGES,
        tool_schemas=SCHEMAS,
        known_tools=KNOWN,
        metadata={"batch_num": 1, "timestamp": "2026-01-01T00:00:00", "model": "m"},
        completed=True,
        partial=False,
        api_calls=3,
        toolsets_used=["terminal", "file"],
    )


def test_build_record_tool_stats_over_every_known_tool():
    rec = _record()
    assert list(rec) == list(RECORD_FIELDS)
    assert list(rec["tool_stats"]) == KNOWN
    assert rec["tool_stats"]["terminal"] == {"count": 2, "success": 1, "failure": 1}
    assert rec["tool_stats"]["read_file"] == {"count": 1, "success": 0, "failure": 1}
    assert rec["tool_stats"]["patch"] == {"count": 0, "success": 0, "failure": 0}
    assert rec["tool_error_counts"] == {
        "patch": 0,
        "read_file": 1,
        "search_files": 0,
        "terminal": 1,
        "write_file": 0,
    }


def test_record_helpers():
    rec = _record()
    assert first_human(rec["conversations"]) == "Do two things"
    assert first_human([{"from": "system", "value": "s"}]) is None
    assert reasoning_counts(rec["conversations"]) == (2, 3)
    assert used_tool_names(rec) == {"terminal", "read_file"}
