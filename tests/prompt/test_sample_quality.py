"""No broken sample saved as a good one; statistics a Hermes reader understands and a resume does not erase.

Runs the CLI in-process against the built-in fake model (``--model=mock``), whose directives script
the hostile replies (bad JSON arguments, empty answers, markup in the model's words and reasoning).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import read_jsonl, write_jsonl
from helpers import run as run_main

from batchrun.prompt.trajectory import ambiguous_markup, empty_answer, invalid_tool_call, to_sharegpt
from batchrun.sharegpt import parse_gpt_value
from batchrun.views.compare import sample_verdicts


def run(dataset: Path, out: Path, run_name: str = "q", **kw) -> Path:
    """A run with the built-in mock model; returns its run directory."""
    run_main(None, dataset, out, run_name, **{"num_workers": 1, **kw})
    return out / run_name


def all_batch_records(run_dir: Path) -> list[dict]:
    return [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]


HOSTILE = {
    "Try a broken call [bad_json]": "invalid_tool_call",
    "Say nothing at all [empty_answer] [calls:0]": "empty_answer",
    "Quote the markup [literal_tool_call] [calls:0]": "ambiguous_markup",
    "Open and forget [unclosed_think] [calls:0]": "ambiguous_markup",
    "Close too early [think_in_reasoning] [calls:0]": "ambiguous_markup",
    "Cut off mid-call [truncate_call]": "invalid_tool_call",
    "Refused by the filter [finish:content_filter] [calls:0]": "content_filter",
    "Ends without a reason [finish:null] [calls:0]": "unknown_finish_reason",
}
GOOD = ["Answer plainly [calls:0]", "Use the shell once [calls:1]"]


def test_hostile_samples_are_discarded_with_their_reason_and_never_rewritten(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [*HOSTILE, *GOOD])
    run_dir = run(dataset, tmp_path / "data")
    discarded = {r["prompt"]: r for r in read_jsonl(run_dir / "discarded.jsonl")}
    assert {p: r["reason"] for p, r in discarded.items()} == HOSTILE
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in kept) == sorted(GOOD)
    # The discarded sample keeps the model's words as it wrote them (no &lt;tool_call&gt;).
    record = discarded["Quote the markup [literal_tool_call] [calls:0]"]["record"]
    quoted = record["conversations"][-1]["value"]
    assert '\n<tool_call>\n{"name": "terminal", "arguments": {}}\n</tool_call>' in quoted
    assert "&lt;" not in quoted
    # No kept record holds a call whose arguments are not a JSON object, and every gpt value parses back.
    for rec in kept:
        for turn in rec["conversations"]:
            for call in turn["tool_calls"]:
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
            if turn["from"] == "gpt":
                _, words, calls = parse_gpt_value(turn["value"])
                assert calls == [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in turn["tool_calls"]
                ]
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["discarded"]["by_reason"] == {
        "invalid_tool_call": 2,
        "empty_answer": 1,
        "ambiguous_markup": 3,
        "content_filter": 1,
        "unknown_finish_reason": 1,
    }
    assert {r["record"]["metadata"]["stop_reason"]: r["record"]["completed"] for r in discarded.values()}[
        "content_filter"
    ] is False


def test_flags_keep_invalid_calls_and_empty_answers_but_never_ambiguous_markup(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", list(HOSTILE))
    run_dir = run(dataset, tmp_path / "data", keep_invalid_tool_calls=True, keep_empty_answers=True)
    kept = {r["conversations"][1]["value"]: r for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert set(kept) == {
        "Try a broken call [bad_json]",
        "Say nothing at all [empty_answer] [calls:0]",
        "Cut off mid-call [truncate_call]",
    }
    assert kept["Say nothing at all [empty_answer] [calls:0]"]["completed"] is True
    cut = kept["Cut off mid-call [truncate_call]"]
    assert cut["partial"] is True and cut["metadata"]["stop_reason"] == "truncated"
    assert (
        cut["conversations"][-1]["tool_calls"][0]["function"]["arguments"]
        == '{"command": "echo a very long comm'
    )

    reasons = {r["reason"] for r in read_jsonl(run_dir / "discarded.jsonl")}
    assert reasons == {"ambiguous_markup", "content_filter", "unknown_finish_reason"}  # no flag keeps these


def test_exclude_partial_leaves_them_in_batch_files_counted_by_stop_reason_and_finished(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["Cut me off [truncate]", "Answer plainly [calls:0]"])
    out = tmp_path / "data"
    run_dir = run(dataset, out, exclude_partial=True)
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert [r["conversations"][1]["value"] for r in kept] == ["Answer plainly [calls:0]"]
    batch = all_batch_records(run_dir)
    assert sorted(r["metadata"]["stop_reason"] for r in batch) == ["final_answer", "truncated"]
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["trajectories_by_stop_reason"] == {"final_answer": 1, "truncated": 1}
    assert stats["dropped_at_merge"]["partial_excluded"] == 1
    assert stats["remaining_for_resume"] == 0
    # Without the flag the same run directory's merge puts the partial one back (nothing is re-run).
    run(dataset, out, resume=True)
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 2
    assert len(all_batch_records(run_dir)) == 2


def test_exclude_partial_still_counts_the_partial_samples_scores(tmp_path):
    """--exclude_partial keeps partial samples out of trajectories.jsonl, not out of the evaluation: a
    sample that ran out of turns and failed its check still counts in statistics.json's scores (before,
    it vanished from them and the pass rate read 100% instead of 50%)."""
    rows = [
        {"prompt": "What is 2+2? [answer:4] [calls:0]", "answer": 4},
        {"prompt": "Make f. [loop]", "verify": "test -f f"},  # never answers: max_turns, check fails
    ]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    out = tmp_path / "data"
    scores = {}
    for name, flags in (("all", {}), ("excl", {"exclude_partial": True})):
        run_dir = run(dataset, out, run_name=name, max_turns=2, **flags)
        scores[name] = json.loads((run_dir / "statistics.json").read_text("utf-8"))["scores"]
    assert len(read_jsonl(out / "excl" / "trajectories.jsonl")) == 1
    for name in ("all", "excl"):
        assert (scores[name]["scored"], scores[name]["passed"], scores[name]["pass_rate"]) == (2, 1, 0.5)
        assert scores[name]["by_stop_reason"]["max_turns"]["scored"] == 1
    assert scores["excl"] == scores["all"]
    # The views that read a finished run's samples (views.score, views.compare) find it too.
    assert len(sample_verdicts(out / "excl")) == len(sample_verdicts(out / "all")) == 2


def test_streamed_replies_cut_short_fail_and_run_again_on_resume_and_a_plain_body_is_kept(tmp_path, server):
    """--stream against the fake model: a stream cut before its finish chunk is a failure (never a kept
    answer) that --resume runs again; a plain JSON body to a streamed request is that answer; a stream
    ended by [DONE] without a finish_reason is discarded, like a plain reply without one."""
    prompts = [
        "Cut once [cut_stream:2] [calls:0]",  # cut on its try and its retry; whole on resume
        "Plain body [plain_body] [calls:1]",
        "No finish [finish:null] [calls:0]",
        "Answer plainly [calls:0]",
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_main(server, dataset, out, "s", num_workers=1, stream=True, max_retries=1)
    run_dir = out / "s"
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert (failed["prompt"], failed["error_class"]) == (prompts[0], "connection")
    assert "no finish_reason and no [DONE]" in failed["error"]
    discarded = {r["prompt"]: r["reason"] for r in read_jsonl(run_dir / "discarded.jsonl")}
    assert discarded == {prompts[2]: "unknown_finish_reason"}
    kept = {r["conversations"][1]["value"]: r for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert set(kept) == {prompts[1], prompts[3]}
    plain = kept[prompts[1]]
    assert (plain["completed"], plain["metadata"]["stop_reason"], plain["api_calls"]) == (
        True,
        "final_answer",
        2,
    )
    assert (
        "\nFinal answer for 'plain-body'. The last tool result said: " in plain["conversations"][-1]["value"]
    )

    run_main(server, dataset, out, "s", num_workers=1, stream=True, max_retries=1, resume=True)
    kept = {r["conversations"][1]["value"]: r for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert set(kept) == {prompts[0], prompts[1], prompts[3]}
    assert kept[prompts[0]]["conversations"][-1]["value"].endswith("Final answer for 'cut-once'.")


def test_served_model_is_recorded_beside_the_requested_one(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["Who answers [served_other] [calls:0]", "Plain [calls:0]"])
    run_dir = run(dataset, tmp_path / "data")
    meta = {r["conversations"][1]["value"]: r["metadata"] for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert meta["Who answers [served_other] [calls:0]"]["served_model"] == "mock-served-other"
    assert meta["Plain [calls:0]"]["served_model"] == "mock"
    assert {m["model"] for m in meta.values()} == {"mock"}


# ----------------------------------------------------------------------------- the checks themselves


def _assistant(content, reasoning=None, calls=()):
    msg = {"role": "assistant", "content": content, "reasoning": reasoning}
    if calls:
        msg["tool_calls"] = [
            {"id": f"c{i}", "type": "function", "function": {"name": "terminal", "arguments": a}}
            for i, a in enumerate(calls)
        ]
    return msg


@pytest.mark.parametrize(
    ("arguments", "invalid"),
    [
        ('{"command": "ls"}', False),
        ("{}", False),
        ('{"command": "l', True),
        ("[1]", True),
        ('"ls"', True),
        # What Python's json reads but no strict reader does, or reads two ways: never a good call.
        ('{"command": "ls", "timeout": NaN}', True),
        ('{"command": "ls", "timeout": -Infinity}', True),
        ('{"command": "ls", "timeout": 1e999}', True),
        ('{"command": "ls", "command": "rm -rf /tmp/x"}', True),
        # A lone surrogate escape: text no UTF-8 reader of the record carries once the arguments are read.
        ('{"command": "echo \\ud800"}', True),
        ('{"command": "echo \\ud83c\\udf0d \\u00e9"}', False),  # a pair, and an ordinary escape
    ],
)
def test_a_call_whose_arguments_are_not_a_json_object_is_invalid(arguments, invalid):
    msgs = [{"role": "user", "content": "q"}, _assistant("", "r", [arguments])]
    assert invalid_tool_call(msgs) is invalid


def test_empty_answer_means_the_final_turn_has_no_words():
    assert empty_answer([{"role": "user", "content": "q"}, _assistant("  ", "only reasoning")])
    assert not empty_answer([{"role": "user", "content": "q"}, _assistant("42", "r")])


@pytest.mark.parametrize(
    ("content", "reasoning", "ambiguous"),
    [
        ("A plain answer.", "why", False),
        ("Tags like <tool_call> alone are words.", "why", False),
        ("Done.", "it ends </think> here", True),
        ("<think>never closed", None, True),
        ("I was </think> here", "why", True),
        ('x\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', "why", True),
        ("Done.", 'r <tool_call>{"name": "a"}</tool_call>', True),
    ],
)
def test_markup_that_would_not_parse_back_as_written_is_ambiguous(content, reasoning, ambiguous):
    msgs = [{"role": "user", "content": "q"}, _assistant(content, reasoning)]
    assert ambiguous_markup(msgs, to_sharegpt(msgs, [])) is ambiguous


@pytest.mark.parametrize("finish", ["tool_calls", "tool_use", "function_call"])
def test_a_reply_that_says_it_called_tools_but_carries_none_is_never_a_final_answer(tmp_path, finish):
    """A reply whose finish_reason says it stopped to call tools, without a single call (a proxy that lost
    them, a stream whose call parts were not read): its words ("Let me look first.") were kept as the
    sample's completed final answer (stop_reason final_answer, completed), exported and scored as one."""
    prompt = f"Look, then answer [finish:{finish}] [calls:0]"
    run_dir = run(write_jsonl(tmp_path / "d.jsonl", [prompt, "Answer plainly [calls:0]"]), tmp_path / "data")
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert [r["conversations"][1]["value"] for r in kept] == ["Answer plainly [calls:0]"]
    (discard,) = read_jsonl(run_dir / "discarded.jsonl")
    assert (discard["prompt"], discard["reason"]) == (prompt, "missing_tool_calls")
    assert discard["record"]["completed"] is False
    assert discard["record"]["metadata"]["stop_reason"] == "missing_tool_calls"
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["discarded"]["by_reason"] == {"missing_tool_calls": 1}
    # No flag keeps it, as none keeps a reply whose end is unknown.
    run_dir = run(
        write_jsonl(tmp_path / "e.jsonl", [prompt]), tmp_path / "data", "k",
        keep_invalid_tool_calls=True, keep_empty_answers=True, keep_no_reasoning=True,
    )  # fmt: skip
    assert read_jsonl(run_dir / "trajectories.jsonl") == []
