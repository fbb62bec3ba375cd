"""batchrun/cli.py end to end: one full run through ``batch_runner.main(...)`` in-process (a real
forkserver pool, the runner's model client over real HTTP to the scripted fake model, the local sandbox), checked
from the files a user trains on; SIGTERM before the dispatch.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT, by_prompt, offered_in_system, read_jsonl, run, tool_blocks, write_jsonl

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.tools.catalog import known_tool_names, tools_for_toolsets
from batchrun.record import RECORD_FIELDS
from batchrun.sharegpt import first_human, parse_tool_calls, reasoning_counts

API_KEY = "sk-test-SECRET-123456"
ENV_TOKEN = "tok-very-secret-987"
PROMPT_SECRET = "ds.secret.value.777"  # an env secret that also appears inside one prompt
EPHEMERAL = "EPHEMERAL-SYSTEM-PROMPT: you are a careful agent, marker 5f1c"
PREFILL = [
    {"role": "user", "content": "PREFILL-EXAMPLE question: what is 1+1?"},
    {"role": "assistant", "content": "PREFILL-EXAMPLE answer: 2."},
]


PLAIN = [
    "List the files in the working directory",
    "Write a short poem about the sea and save it",
    "Count the lines of a new notes file",
    "Explain what pwd prints",
    "Create a todo list for a small project",
    "Summarise the contents of your notes",
    "Check which shell you are running",
    "Make a directory called build and report back",
    "Write a haiku about resumable jobs",
    "Find the word slug in files",
]
NON_ASCII = "Привет! Напиши файл с приветствием 🌍 — ünïcödé «ok»"
SECRET_PROMPT = f"Remember the code {PROMPT_SECRET} in a note"
FULL = [
    *PLAIN,
    "Plan a picnic [scratchpad]",
    "Sort three numbers [scratchpad]",
    "Draft an email [scratchpad] [calls:2]",
    "Name a colour [reasoning_details]",
    "Describe a cat [reasoning_details] [calls:1]",
    "Echo hello once [calls:1]",
    "Read a note once [calls:1] [scratchpad]",
    "Answer directly without tools [calls:0]",
    "What is two plus two [calls:0]",
    "Three steps please [calls:3]",
    "Try a broken call [bad_json]",
    "Broken call then notes [bad_json] [scratchpad]",
    "Go somewhere impossible [hallucinate]",
    "No thinking here [no_reasoning]",
    "Quick reply [no_reasoning] [calls:0]",
    "This endpoint breaks [error:500]",
    NON_ASCII,
    PLAIN[0],  # a duplicate: run twice, two trajectories
]
EXPECTED_CALLS = {p: 3 for p in PLAIN + ["Plan a picnic [scratchpad]", "Sort three numbers [scratchpad]"]}
EXPECTED_CALLS.update(
    {
        "Draft an email [scratchpad] [calls:2]": 3,
        "Name a colour [reasoning_details]": 3,
        "Describe a cat [reasoning_details] [calls:1]": 2,
        "Echo hello once [calls:1]": 2,
        "Read a note once [calls:1] [scratchpad]": 2,
        "Answer directly without tools [calls:0]": 1,
        "What is two plus two [calls:0]": 1,
        "Three steps please [calls:3]": 4,
        "Try a broken call [bad_json]": 4,
        "Broken call then notes [bad_json] [scratchpad]": 4,
        NON_ASCII: 3,
    }
)
DROPPED = {
    "Go somewhere impossible [hallucinate]",
    "No thinking here [no_reasoning]",
    "Quick reply [no_reasoning] [calls:0]",
    "This endpoint breaks [error:500]",
}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    dataset = write_jsonl(tmp / "prompts.jsonl", FULL)
    prefill = tmp / "prefill.json"
    prefill.write_text(json.dumps(PREFILL), "utf-8")
    with pytest.MonkeyPatch.context() as mp, FakeModelServer(latency_s=0) as srv:
        mp.setenv("MY_SERVICE_TOKEN", ENV_TOKEN)
        run(
            srv,
            dataset,
            tmp / "data",
            run_name="full",
            api_key=API_KEY,
            ephemeral_system_prompt=EPHEMERAL,
            prefill_messages_file=str(prefill),
            max_failure_rate=0.5,
            # The [bad_json] samples show the model seeing and recovering from its error; by default they
            # are discarded as invalid_tool_call (tests/prompt/test_sample_quality.py).
            keep_invalid_tool_calls=True,
        )
        stats = srv.stats()
    run_dir = tmp / "data" / "full"
    records = read_jsonl(run_dir / "trajectories.jsonl")
    return {
        "dir": run_dir,
        "records": records,
        "by_prompt": by_prompt(records),
        "server": stats,
        "statistics": json.loads((run_dir / "statistics.json").read_text("utf-8")),
    }


def test_full_run_outputs_one_trajectory_per_good_prompt(full_run):
    got = collections.Counter(first_human(r["conversations"]) for r in full_run["records"])
    want = collections.Counter(p for p in FULL if p not in DROPPED)
    assert got == want
    assert got[PLAIN[0]] == 2  # the duplicate prompt ran twice
    # prompt_index is the 0-based dataset line
    for rec in full_run["records"]:
        assert FULL[rec["prompt_index"]] == first_human(rec["conversations"])


def test_full_run_records_have_every_spec_field_with_its_type(full_run):
    known = known_tool_names()
    for rec in full_run["records"]:
        assert list(rec) == list(RECORD_FIELDS)
        assert isinstance(rec["prompt_index"], int)
        assert isinstance(rec["completed"], bool) and isinstance(rec["partial"], bool)
        assert isinstance(rec["api_calls"], int) and rec["api_calls"] >= 1
        assert sorted(rec["toolsets_used"]) == ["file", "terminal"]
        meta = rec["metadata"]
        assert isinstance(meta["batch_num"], int)
        assert meta["model"] == "fake-model"
        assert dt.datetime.fromisoformat(meta["timestamp"]).year >= 2024
        assert list(rec["tool_stats"]) == known
        assert list(rec["tool_error_counts"]) == known
        for name, s in rec["tool_stats"].items():
            assert set(s) == {"count", "success", "failure"}
            assert s["count"] == s["success"] + s["failure"]
            assert rec["tool_error_counts"][name] == s["failure"]
        assert rec["completed"] is True and rec["partial"] is False
        for entry in rec["conversations"]:
            assert entry["from"] in ("system", "human", "gpt", "tool")
            assert isinstance(entry["value"], str)


def test_full_run_records_sit_in_the_batch_file_their_metadata_names(full_run):
    seen = 0
    for path in full_run["dir"].glob("batch_*.jsonl"):
        num = int(path.stem.split("_")[1])
        for rec in read_jsonl(path):
            assert rec["metadata"]["batch_num"] == num
            seen += 1
    assert seen == len(full_run["records"])  # the hallucinated sample is a discard, never in a batch file


def test_system_turn_lists_exactly_the_offered_tools(full_run):
    # The reference's keys: name, description, parameters and required (null).
    expected = [
        {**t.openai_schema()["function"], "required": None} for t in tools_for_toolsets(["terminal", "file"])
    ]
    for rec in full_run["records"]:
        conv = rec["conversations"]
        assert conv[0]["from"] == "system"
        assert offered_in_system(conv[0]["value"]) == expected
        assert conv[1]["from"] == "human"
        assert [c["from"] for c in conv].count("human") == 1
        assert [c["from"] for c in conv].count("system") == 1


def test_gpt_turns_have_think_and_tool_calls_that_parse_back(full_run):
    for rec in full_run["records"]:
        gpt = [c for c in rec["conversations"] if c["from"] == "gpt"]
        assert len(gpt) == rec["api_calls"]
        for entry in gpt:
            assert entry["value"].startswith("<think>\n"), entry["value"][:80]
            assert "REASONING_SCRATCHPAD" not in entry["value"]
            calls = entry.get("tool_calls", [])
            assert parse_tool_calls(entry["value"]) == [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
            ]
            for c in calls:
                assert c["type"] == "function" and isinstance(c["function"]["arguments"], str)
        assert gpt[-1]["tool_calls"] == []  # the final answer calls nothing (the key is always there)


def test_tool_results_follow_their_calls_in_one_merged_tool_entry(full_run):
    multi = 0
    for rec in full_run["records"]:
        conv = rec["conversations"]
        for i, entry in enumerate(conv):
            if entry["from"] == "tool":
                assert conv[i - 1]["from"] == "gpt"
                assert i + 1 == len(conv) or conv[i + 1]["from"] != "tool"
            if entry["from"] == "gpt" and entry.get("tool_calls"):
                blocks = tool_blocks(conv[i + 1]["value"])
                assert [(b["tool_call_id"], b["name"]) for b in blocks] == [
                    (c["id"], c["function"]["name"]) for c in entry["tool_calls"]
                ]
                multi += len(blocks) > 1
    assert multi > 0  # the default plan calls terminal and write_file in parallel


def test_tool_stats_count_every_call(full_run):
    for rec in full_run["records"]:
        calls = collections.Counter(
            c["function"]["name"] for e in rec["conversations"] for c in e.get("tool_calls", [])
        )
        assert {n: s["count"] for n, s in rec["tool_stats"].items() if s["count"]} == dict(calls)
    rec = full_run["by_prompt"][PLAIN[1]][0]
    assert rec["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    assert rec["tool_stats"]["write_file"] == {"count": 1, "success": 1, "failure": 0}
    assert rec["tool_stats"]["read_file"] == {"count": 1, "success": 1, "failure": 0}


def test_api_calls_equal_the_model_requests_per_prompt(full_run):
    seen = full_run["server"]["requests_by_prompt"]
    for prompt, recs in full_run["by_prompt"].items():
        assert seen[prompt] == sum(r["api_calls"] for r in recs)
    for prompt, n in EXPECTED_CALLS.items():
        want = [n] * collections.Counter(FULL)[prompt]
        assert [r["api_calls"] for r in full_run["by_prompt"][prompt]] == want, prompt


def test_reasoning_from_scratchpad_and_reasoning_details_becomes_think(full_run):
    rec = full_run["by_prompt"]["Plan a picnic [scratchpad]"][0]
    first = rec["conversations"][2]["value"]
    assert first.startswith('<think>\nThe user asks: "Plan a picnic". Turn 0')
    rec = full_run["by_prompt"]["Name a colour [reasoning_details]"][0]
    assert rec["conversations"][2]["value"].startswith('<think>\nThe user asks: "Name a colour". Turn 0')


def test_bad_json_arguments_become_a_tool_error_the_model_sees(full_run):
    rec = full_run["by_prompt"]["Try a broken call [bad_json]"][0]
    conv = rec["conversations"]
    bad = conv[2]["tool_calls"][0]["function"]
    assert bad["name"] == "terminal"
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad["arguments"])
    result = tool_blocks(conv[3]["value"])[0]["content"]
    assert "Invalid JSON" in result["error"]
    assert rec["tool_stats"]["terminal"] == {"count": 2, "success": 1, "failure": 1}
    assert rec["tool_error_counts"]["terminal"] == 1
    assert rec["completed"] is True  # the model recovered


def test_non_ascii_prompt_round_trips(full_run):
    (rec,) = full_run["by_prompt"][NON_ASCII]
    assert rec["conversations"][1]["value"] == NON_ASCII
    raw = (full_run["dir"] / "trajectories.jsonl").read_text("utf-8")
    assert NON_ASCII in raw  # written as UTF-8, not \u escapes


def test_a_hallucinated_tool_call_makes_the_sample_a_discard(full_run):
    assert "Go somewhere impossible [hallucinate]" not in full_run["by_prompt"]
    rows = [r for r in read_jsonl(full_run["dir"] / "discarded.jsonl") if r["reason"] == "unknown_tool"]
    assert [r["prompt"] for r in rows] == ["Go somewhere impossible [hallucinate]"]
    rec = rows[0]["record"]
    assert rec["conversations"][2]["tool_calls"][0]["function"]["name"] == "teleport"
    assert "Unknown tool" in tool_blocks(rec["conversations"][3]["value"])[0]["content"]["error"]
    assert full_run["statistics"]["dropped_at_merge"]["unknown_tool"] == 0


def test_no_reasoning_prompts_are_discarded_with_their_reason(full_run):
    rows = [r for r in read_jsonl(full_run["dir"] / "discarded.jsonl") if r["reason"] != "unknown_tool"]
    assert sorted(r["prompt"] for r in rows) == sorted(p for p in DROPPED if "[no_reasoning]" in p)
    assert {r["reason"] for r in rows} == {"no_reasoning"}
    for r in rows:
        assert FULL[r["prompt_index"]] == r["prompt"]
    assert full_run["statistics"]["discarded"] == {
        "total": 3,
        "by_reason": {"no_reasoning": 2, "unknown_tool": 1},
    }


def test_endpoint_500_fails_the_prompt_with_an_error_class(full_run):
    rows = read_jsonl(full_run["dir"] / "failed.jsonl")
    assert [(r["prompt"], r["error_class"]) for r in rows] == [
        ("This endpoint breaks [error:500]", "http_500")
    ]
    assert "500" in rows[0]["error"]
    assert full_run["server"]["requests_by_prompt"]["This endpoint breaks [error:500]"] == 4  # 1 + 3 retries
    assert full_run["statistics"]["failed_attempts"] == {"total": 1, "by_class": {"http_500": 1}}


def test_statistics_cover_tools_reasoning_outcomes_and_duration(full_run):
    stats = full_run["statistics"]
    records = full_run["records"]
    assert stats["trajectories"] == len(records) == len(FULL) - len(DROPPED)
    assert stats["dataset_prompts"] == len(FULL)
    for name in known_tool_names():
        s = stats["tool_stats"][name]
        assert s["count"] == sum(r["tool_stats"][name]["count"] for r in records)
        assert s["success"] == sum(r["tool_stats"][name]["success"] for r in records)
        assert s["failure"] == sum(r["tool_stats"][name]["failure"] for r in records)
        assert s["success_rate"] == (round(s["success"] / s["count"], 4) if s["count"] else None)
    assert stats["tool_stats"]["terminal"]["failure"] == 2  # the two [bad_json] calls
    turns = sum(1 for r in records for c in r["conversations"] if c["from"] == "gpt")
    discarded = read_jsonl(full_run["dir"] / "discarded.jsonl")
    thinking = [reasoning_counts(d["record"]["conversations"]) for d in discarded]
    turns += sum(w for w, _ in thinking)  # the hallucinated sample's turns all reason
    bare = sum(n - w for w, n in thinking)
    assert bare == 4  # the two [no_reasoning] samples: 3 + 1 turns, none with reasoning
    # Coverage is over every sample the model produced, discarded ones included; kept ones apart.
    assert stats["reasoning"] == {
        "turns_with_reasoning": turns,
        "turns_without_reasoning": bare,
        "coverage": round(turns / (turns + bare), 4),
        "coverage_of_kept_trajectories": 1.0,
    }
    assert stats["api_calls_in_trajectories"] == sum(r["api_calls"] for r in records)
    assert stats["remaining_for_resume"] == 1  # the [error:500] prompt
    tr = stats["this_run"]
    assert tr["attempted"] == len(FULL)
    assert tr["trajectories"] == len(FULL) - 4
    assert tr["discarded"] == {"no_reasoning": 2, "unknown_tool": 1}
    assert tr["failed"] == {"http_500": 1}
    assert 0 < tr["duration_s"] < 120


def test_checkpoint_lists_the_finished_prompts(full_run):
    ckpt = json.loads((full_run["dir"] / "checkpoint.json").read_text("utf-8"))
    done = set(ckpt["completed_prompts"])
    assert {r["prompt_index"] for r in full_run["records"]} <= done
    # A discard is finished (resume does not pay for it again), as the reference lists its no-reasoning
    # discards; the failure, which resume runs again, is not.
    failed = {i for i, p in enumerate(FULL) if "[error:" in p}
    discarded = {i for i, p in enumerate(FULL) if p in DROPPED} - failed
    assert discarded <= done and not done & failed and len(discarded) == 3
    assert ckpt["batches"] == sorted(ckpt["batches"])


def test_no_secret_and_no_ephemeral_text_in_any_file(full_run):
    forbidden = [API_KEY, ENV_TOKEN, EPHEMERAL, "PREFILL-EXAMPLE", "5f1c"]
    files = [p for p in full_run["dir"].rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"trajectories.jsonl", "checkpoint.json", "statistics.json", "run_manifest.json"} <= names
    assert {"failed.jsonl", "discarded.jsonl"} <= names
    for path in files:
        data = path.read_bytes()
        for text in forbidden:
            for form in {text, json.dumps(text)[1:-1]}:
                assert form.encode() not in data, f"{form!r} found in {path.name}"


def test_ephemeral_prompt_and_prefill_reach_the_model(full_run):
    last = full_run["server"]["last_requests"]
    assert last
    for req in last:
        msgs = req["messages"]
        assert msgs[0] == {"role": "system", "content": EPHEMERAL}
        assert msgs[1:3] == PREFILL
        assert msgs[3]["role"] == "user"
    for rec in full_run["records"]:
        assert [c["from"] for c in rec["conversations"]][:3] == ["system", "human", "gpt"]


def test_output_loads_with_hugging_face_datasets(full_run, tmp_path, offline_hf):
    datasets = pytest.importorskip("datasets")
    path = full_run["dir"] / "trajectories.jsonl"
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    rows = read_jsonl(path)
    assert ds.num_rows == len(rows) == len(FULL) - len(DROPPED)
    assert set(ds.column_names) == set(RECORD_FIELDS)
    assert all(list(r) == list(RECORD_FIELDS) for r in rows)
    assert set(ds.features["tool_stats"]) == set(known_tool_names())
    assert ds["prompt_index"] == [r["prompt_index"] for r in rows]
    assert [c[1]["value"] for c in ds["conversations"]] == [r["conversations"][1]["value"] for r in rows]


def test_sigterm_before_the_dispatch_exits_130_like_ctrl_c(tmp_path):
    """SIGTERM during the endpoint check (an endpoint that never answers): exit 130, status interrupted."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; no answer ever comes
        port = silent.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=1",
             "--run_name=run", f"--output_dir={tmp_path / 'data'}", "--model=m",
             f"--base_url=http://127.0.0.1:{port}/v1", "--api_key=x"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            line = ""
            while not line.startswith("Run run:"):  # the plan is printed just before the preflight
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "--resume" in err and "Traceback" not in err
    status = json.loads((tmp_path / "data" / "run" / "status.json").read_text("utf-8"))
    assert status["state"] == "interrupted"
