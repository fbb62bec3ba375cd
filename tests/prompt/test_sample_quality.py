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

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.llm import LLMConfig
from batchrun.prompt.trajectory import ambiguous_markup, empty_answer, invalid_tool_call, to_sharegpt
from batchrun.run.preflight import check_endpoint, list_models, warn_unlisted_model
from batchrun.sharegpt import parse_gpt_value


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
    }


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
    assert reasons == {"ambiguous_markup"}


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


def test_served_model_is_recorded_beside_the_requested_one(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["Who answers [served_other] [calls:0]", "Plain [calls:0]"])
    run_dir = run(dataset, tmp_path / "data")
    meta = {r["conversations"][1]["value"]: r["metadata"] for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert meta["Who answers [served_other] [calls:0]"]["served_model"] == "mock-served-other"
    assert meta["Plain [calls:0]"]["served_model"] == "mock"
    assert {m["model"] for m in meta.values()} == {"mock"}


def test_endpoint_check_warns_once_when_models_does_not_list_the_requested_name(capsys):
    with FakeModelServer(latency_s=0) as srv:
        check_endpoint(LLMConfig(model="Qwen/Qwen3-8B", base_url=srv.base_url, api_key="sk-local"))
        err = capsys.readouterr().err
        assert err.count("warning:") == 1 and "'Qwen/Qwen3-8B'" in err and "it lists mock" in err
        check_endpoint(LLMConfig(model="mock", base_url=srv.base_url, api_key="sk-local"))
        assert "warning" not in capsys.readouterr().err
    assert warn_unlisted_model("x", []) is False  # no list: nothing to say
    assert warn_unlisted_model("x", [f"m{i}" for i in range(9)]) is True
    assert "(and 4 more)" in capsys.readouterr().err


def test_endpoint_check_refuses_a_rejected_key_and_tolerates_a_missing_models_route():
    """401 on /models is a clear error without the key in it; any other status leaves it to the first call."""
    import http.server
    import threading

    from batchrun.config import UsageError

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status = 401 if self.headers.get("Authorization") == "Bearer sk-wrong" else 404
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        with pytest.raises(UsageError) as rejected:
            list_models(LLMConfig(model="m", base_url=base, api_key="sk-wrong"))
        assert "rejected the API key (HTTP 401)" in str(rejected.value) and "sk-wrong" not in str(
            rejected.value
        )
        list_models(LLMConfig(model="m", base_url=base, api_key="sk-right"))  # 404: no error
    finally:
        server.shutdown()


def test_resume_with_nothing_to_do_keeps_the_run_totals_and_zeroes_this_run(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["One [calls:1]", "Two [calls:0]", "Three [calls:2]"])
    out = tmp_path / "data"
    run_dir = run(dataset, out, batch_size=2)
    first = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    run(dataset, out, batch_size=2, resume=True)
    second = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    t1, t2 = first["run_totals"], second["run_totals"]
    assert t1["requests"] == first["this_run"]["api_calls"] > 0
    for key in ("requests", "prompt_tokens", "completion_tokens", "total_tokens", "cost_usd", "trajectories"):
        assert t2[key] == t1[key], key
    assert t2["runs"] == 2 and len(second["runs"]) == 2 and second["runs"][0] == first["runs"][0]
    assert second["duration_seconds"] >= first["duration_seconds"]
    tr = second["this_run"]
    assert tr["attempted"] == 0 and tr["api_calls"] == 0 and tr["usage"].get("prompt_tokens", 0) == 0
    assert second["runs"][1]["requests"] == 0 and second["runs"][1]["prompt_tokens"] == 0
    # The reference runner's names and shapes, beside ours.
    assert second["total_batches"] == 2 and second["batch_size"] == 2 and second["total_prompts"] == 3
    assert isinstance(second["completed_at"], str)
    term = second["tool_statistics"]["terminal"]
    assert set(term) == {"count", "success", "failure", "success_rate", "failure_rate"}
    assert term["count"] == first["tool_stats"]["terminal"]["count"] > 0
    assert term["success_rate"] + term["failure_rate"] == 100.0
    assert "patch" not in second["tool_statistics"]  # never called: no rate at all, as the reference lists
    rs = second["reasoning_statistics"]
    assert rs["total_assistant_turns"] == rs["turns_with_reasoning"] + rs["turns_without_reasoning"] == 6
    assert rs["coverage"] == 1.0


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
    [('{"command": "ls"}', False), ("{}", False), ('{"command": "l', True), ("[1]", True), ('"ls"', True)],
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
