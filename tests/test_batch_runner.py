"""The batch runner end to end: ``batch_runner.main(...)`` in-process, a real forkserver pool, the real
``openai`` client over HTTP to the scripted fake model, the local sandbox. Values are read back from the
files a user trains on (``data/<run_name>/``) and from the fake server's request counters.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import random
from pathlib import Path

import pytest
from helpers import read_jsonl, write_jsonl

import batch_runner
from batchrun.cli import tool_settings, worker_settings
from batchrun.config import RunConfig
from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.tools.registry import known_tool_names, tools_for_toolsets
from batchrun.prompt.trajectory import first_human, parse_tool_calls
from batchrun.record import RECORD_FIELDS
from batchrun.secrets import Redactor
from batchrun.storage import append_jsonl
from toolset_distributions import prompt_rng, sample_toolsets_from_distribution

API_KEY = "sk-test-SECRET-123456"
ENV_TOKEN = "tok-very-secret-987"
PROMPT_SECRET = "ds.secret.value.777"  # an env secret that also appears inside one prompt
EPHEMERAL = "EPHEMERAL-SYSTEM-PROMPT: you are a careful agent, marker 5f1c"
PREFILL = [
    {"role": "user", "content": "PREFILL-EXAMPLE question: what is 1+1?"},
    {"role": "assistant", "content": "PREFILL-EXAMPLE answer: 2."},
]


# ----------------------------------------------------------------------------- helpers


def run(server: FakeModelServer, dataset: Path, out: Path, run_name: str = "run", **kw) -> None:
    """One in-process run; raises SystemExit on a non-zero exit like the CLI does."""
    args = dict(
        dataset_file=str(dataset),
        batch_size=4,
        run_name=run_name,
        model="fake-model",
        base_url=server.base_url,
        api_key="sk-local-test",
        output_dir=str(out),
        num_workers=2,
        distribution="terminal_only",
        max_failure_rate=1.0,
    )
    args.update(kw)
    assert batch_runner.main(**args) is None


def by_prompt(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in records:
        out[first_human(rec["conversations"])].append(rec)
    return out


def requests(server: FakeModelServer) -> collections.Counter:
    return collections.Counter(server.stats()["requests_by_prompt"])


def tool_blocks(value: str) -> list[dict]:
    parts = value.split("<tool_response>\n")[1:]
    return [json.loads(p.split("\n</tool_response>")[0]) for p in parts]


def offered_in_system(system_value: str) -> list[dict]:
    return json.loads(system_value.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0])


@pytest.fixture
def server():
    with FakeModelServer(latency_s=0) as srv:
        yield srv


# ----------------------------------------------------------------------------- one full run, many checks

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
            # are discarded as invalid_tool_call (tests/test_sample_quality.py).
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
    assert seen == len(full_run["records"]) + 1  # + the hallucinated record, dropped at merge only


def test_system_turn_lists_exactly_the_offered_tools(full_run):
    expected = [t.openai_schema()["function"] for t in tools_for_toolsets(["terminal", "file"])]
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


def test_hallucinated_tool_record_is_dropped_at_merge(full_run):
    assert "Go somewhere impossible [hallucinate]" not in full_run["by_prompt"]
    batch = [
        r
        for p in full_run["dir"].glob("batch_*.jsonl")
        for r in read_jsonl(p)
        if first_human(r["conversations"]) == "Go somewhere impossible [hallucinate]"
    ]
    assert len(batch) == 1
    first = batch[0]["conversations"][2]["tool_calls"][0]["function"]["name"]
    assert first == "teleport"
    assert "Unknown tool" in tool_blocks(batch[0]["conversations"][3]["value"])[0]["content"]["error"]
    assert full_run["statistics"]["dropped_at_merge"]["unknown_tool"] == 1


def test_no_reasoning_prompts_are_discarded_with_their_reason(full_run):
    rows = read_jsonl(full_run["dir"] / "discarded.jsonl")
    assert sorted(r["prompt"] for r in rows) == sorted(p for p in DROPPED if "[no_reasoning]" in p)
    assert {r["reason"] for r in rows} == {"no_reasoning"}
    for r in rows:
        assert FULL[r["prompt_index"]] == r["prompt"]
    assert full_run["statistics"]["discarded"] == {"total": 2, "by_reason": {"no_reasoning": 2}}


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
    bare = sum(1 for d in discarded for c in d["record"]["conversations"] if c["from"] == "gpt")
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
    assert tr["trajectories"] == len(FULL) - 3  # the hallucinated record was a trajectory until the merge
    assert tr["discarded"] == {"no_reasoning": 2}
    assert tr["failed"] == {"http_500": 1}
    assert 0 < tr["duration_s"] < 120


def test_checkpoint_lists_the_finished_prompts(full_run):
    ckpt = json.loads((full_run["dir"] / "checkpoint.json").read_text("utf-8"))
    done = set(ckpt["completed_prompts"])
    assert {r["prompt_index"] for r in full_run["records"]} <= done
    failed_or_discarded = {i for i, p in enumerate(FULL) if p in DROPPED and "[hallucinate]" not in p}
    assert not done & failed_or_discarded
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


def test_output_loads_with_hugging_face_datasets(full_run, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
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


# ----------------------------------------------------------------------------- resume

RESUME = ["alpha task", "beta task", "gamma task", "alpha task", "delta task", "epsilon task"]


def _checkpoint(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoint.json").read_text("utf-8"))


def test_resume_runs_only_missing_prompts_then_nothing(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", RESUME)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, max_samples=3, batch_size=2)
    assert requests(server) == {"alpha task": 3, "beta task": 3, "gamma task": 3}
    assert sorted(_checkpoint(run_dir)["completed_prompts"]) == [0, 1, 2]
    first_stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert first_stats["remaining_for_resume"] == 0  # of the 3 rows this run was asked for

    before = requests(server)
    run(server, dataset, out, resume=True, batch_size=2)
    assert requests(server) - before == {"alpha task": 3, "delta task": 3, "epsilon task": 3}
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert collections.Counter(first_human(r["conversations"]) for r in records) == collections.Counter(
        RESUME
    )
    assert sorted(_checkpoint(run_dir)["completed_prompts"]) == [0, 1, 2, 3, 4, 5]

    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["trajectories"] == 6  # both runs
    assert stats["tool_stats"]["terminal"]["count"] == 6
    assert stats["tool_stats"]["read_file"]["count"] == 6
    assert stats["api_calls_in_trajectories"] == 18
    assert stats["this_run"]["attempted"] == 3
    assert stats["remaining_for_resume"] == 0

    total = server.stats()["requests"]
    capsys.readouterr()
    run(server, dataset, out, resume=True, batch_size=2)
    assert server.stats()["requests"] == total  # zero model calls when everything is done
    assert "6 prompt(s) already finished, 0 to run" in capsys.readouterr().out
    assert read_jsonl(run_dir / "trajectories.jsonl") == records
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["trajectories"] == 6 and stats["this_run"]["attempted"] == 0


def test_resume_reruns_prompts_whose_lines_were_lost(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", RESUME)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, batch_size=3)
    b0, b1 = run_dir / "batch_0.jsonl", run_dir / "batch_1.jsonl"
    lines0, lines1 = b0.read_text("utf-8").splitlines(True), b1.read_text("utf-8").splitlines(True)
    lost = [
        first_human(json.loads(lines0[-1])["conversations"]),
        first_human(json.loads(lines1[0])["conversations"]),
    ]
    b0.write_text("".join(lines0[:-1]), "utf-8")
    b1.write_text("".join(lines1[1:]), "utf-8")

    before = requests(server)
    run(server, dataset, out, resume=True, batch_size=3)
    assert requests(server) - before == collections.Counter({p: 3 * lost.count(p) for p in lost})
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert collections.Counter(first_human(r["conversations"]) for r in records) == collections.Counter(
        RESUME
    )


def test_reordered_dataset_resumes_with_zero_calls(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", RESUME)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, batch_size=2)
    before_records = read_jsonl(run_dir / "trajectories.jsonl")
    shuffled = RESUME[:]
    random.Random(3).shuffle(shuffled)
    assert shuffled != RESUME
    write_jsonl(dataset, shuffled)

    total = server.stats()["requests"]
    run(server, dataset, out, resume=True, batch_size=2)
    assert server.stats()["requests"] == total
    after = read_jsonl(run_dir / "trajectories.jsonl")
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, after)) == sorted(map(key, before_records))

    # and a prompt added to the reordered dataset is the only one that runs
    write_jsonl(dataset, ["zeta task", *shuffled])
    run(server, dataset, out, resume=True, batch_size=2)
    assert server.stats()["requests"] == total + 3
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 7


def test_discards_stay_done_failures_rerun_and_rerun_discarded_flag(server, tmp_path):
    prompts = ["keep me", "skip reasoning [no_reasoning]", "server down [error:500]", "keep me too"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, batch_size=2)
    assert len(read_jsonl(run_dir / "failed.jsonl")) == 1
    assert len(read_jsonl(run_dir / "discarded.jsonl")) == 1

    before = requests(server)
    run(server, dataset, out, resume=True, batch_size=2)
    new = requests(server) - before
    assert set(new) == {"server down [error:500]"}  # failures re-run; discards and trajectories do not
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert [r["error_class"] for r in failed] == ["http_500", "http_500"]
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["failed_attempts"] == {"total": 2, "by_class": {"http_500": 2}}  # across both runs
    assert stats["discarded"]["by_reason"] == {"no_reasoning": 1}
    assert stats["trajectories"] == 2

    before = requests(server)
    run(server, dataset, out, resume=True, batch_size=2, rerun_discarded=True)
    new = requests(server) - before
    assert set(new) == {"skip reasoning [no_reasoning]", "server down [error:500]"}
    assert new["skip reasoning [no_reasoning]"] == 3
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in trajectories) == ["keep me", "keep me too"]


def test_torn_last_line_is_skipped_at_merge_and_later_appends_stay_valid(server, tmp_path):
    prompts = ["one thing", "two things", "three things", "four things"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, batch_size=2)
    b0 = run_dir / "batch_0.jsonl"
    line = b0.read_text("utf-8").splitlines()[0]
    with b0.open("a", encoding="utf-8") as fh:
        fh.write(line[: len(line) // 2])  # a crash mid-append: half a line, no newline

    total = server.stats()["requests"]
    run(server, dataset, out, resume=True, batch_size=2)
    assert server.stats()["requests"] == total
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in records) == sorted(prompts)
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    assert stats["dropped_at_merge"]["invalid_lines"] == 1
    assert stats["trajectories"] == 4
    assert sorted(_checkpoint(run_dir)["completed_prompts"]) == [0, 1, 2, 3]

    # The next append to the torn file starts on a fresh line: the new record is intact.
    rec = json.loads(line)
    append_jsonl(b0, rec, Redactor(None, environ={}))
    raw = b0.read_bytes().split(b"\n")
    assert raw[-1] == b""
    assert json.loads(raw[-2]) == rec
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw[-3])


def test_a_truncated_record_is_run_again_on_resume(server, tmp_path):
    prompts = ["first job", "second job", "third job", "fourth job"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, batch_size=2)
    b1 = run_dir / "batch_1.jsonl"
    data = b1.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    torn_prompt = first_human(json.loads(data[last_start:])["conversations"])
    b1.write_bytes(data[: last_start + (len(data) - last_start) // 2])

    before = requests(server)
    run(server, dataset, out, resume=True, batch_size=2)
    assert requests(server) - before == {torn_prompt: 3}
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in records) == sorted(prompts)
    assert json.loads((run_dir / "checkpoint.json").read_text("utf-8"))["run_name"] == "run"


def test_a_secret_inside_a_prompt_is_redacted_in_every_file(server, tmp_path, monkeypatch):
    monkeypatch.setenv("DATASET_SECRET", PROMPT_SECRET)
    dataset = write_jsonl(tmp_path / "d.jsonl", [SECRET_PROMPT, f"{PROMPT_SECRET} [no_reasoning]"])
    out = tmp_path / "data"
    run(server, dataset, out)
    # the model saw it (it is the user's own prompt), wrote it to a file and read it back
    assert server.stats()["requests_by_prompt"][SECRET_PROMPT] == 3
    files = [p for p in (out / "run").rglob("*") if p.is_file()]
    assert {"trajectories.jsonl", "discarded.jsonl"} <= {p.name for p in files}
    for path in files:
        assert PROMPT_SECRET.encode() not in path.read_bytes(), path.name
    (rec,) = read_jsonl(out / "run" / "trajectories.jsonl")
    assert first_human(rec["conversations"]) == SECRET_PROMPT.replace(PROMPT_SECRET, "[REDACTED]")
    assert "[REDACTED]" in rec["conversations"][-1]["value"] or any(
        "[REDACTED]" in c["value"] for c in rec["conversations"] if c["from"] == "tool"
    )


def test_resume_recognises_a_prompt_whose_secret_was_redacted(server, tmp_path, monkeypatch):
    monkeypatch.setenv("DATASET_SECRET", PROMPT_SECRET)
    dataset = write_jsonl(tmp_path / "d.jsonl", [SECRET_PROMPT, "plain one"])
    out = tmp_path / "data"
    run(server, dataset, out)
    total = server.stats()["requests"]
    run(server, dataset, out, resume=True)
    assert server.stats()["requests"] == total
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 2


def test_merge_follows_numeric_batch_order(server, tmp_path):
    prompts = [f"numbered task {i}" for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"{p} [calls:0]" for p in prompts])
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=1)
    nums = [r["metadata"]["batch_num"] for r in read_jsonl(out / "run" / "trajectories.jsonl")]
    assert nums == sorted(nums) == list(range(12))


# ----------------------------------------------------------------------------- outcomes and limits


def test_loop_truncate_garbage_and_hangup(server, tmp_path):
    prompts = [
        "Loop forever [loop]",
        "Cut off [truncate]",
        "Exactly three calls",
        "Garbage reply [garbage]",
        "Hang up [hangup]",
        "Fine afterwards [calls:1]",
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run(server, dataset, out, max_turns=3, max_retries=1, batch_size=3)
    recs = by_prompt(read_jsonl(out / "run" / "trajectories.jsonl"))
    (loop,) = recs["Loop forever [loop]"]
    assert (loop["completed"], loop["partial"], loop["api_calls"]) == (False, True, 3)
    assert loop["tool_stats"]["terminal"]["count"] == 3
    assert loop["metadata"]["stop_reason"] == "max_turns"
    assert server.stats()["requests_by_prompt"]["Loop forever [loop]"] == 3
    (cut,) = recs["Cut off [truncate]"]
    assert (cut["completed"], cut["partial"], cut["api_calls"]) == (False, True, 1)
    assert cut["metadata"]["stop_reason"] == "truncated"
    (three,) = recs["Exactly three calls"]
    assert (three["completed"], three["partial"], three["api_calls"]) == (True, False, 3)
    assert recs["Fine afterwards [calls:1]"][0]["completed"] is True
    failed = {r["prompt"]: r for r in read_jsonl(out / "run" / "failed.jsonl")}
    assert failed["Garbage reply [garbage]"]["error_class"] == "bad_response"
    assert failed["Hang up [hangup]"]["error_class"] == "connection"
    assert set(failed) == {"Garbage reply [garbage]", "Hang up [hangup]"}
    assert all(r["error"] for r in failed.values())


def test_wrong_api_key_stops_the_run_before_any_model_call(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["first try", "second try"])
    out = tmp_path / "data"
    with FakeModelServer(latency_s=0, api_key="the-right-key") as srv:
        with pytest.raises(SystemExit) as info:
            run(srv, dataset, out, api_key="the-wrong-key-1234")
        stats = srv.stats()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "401" in err and "API key" in err
    assert "the-wrong-key-1234" not in err
    assert stats["requests_by_prompt"] == {}  # no prompt was sent, no token spent
    assert not read_jsonl(out / "run" / "trajectories.jsonl")
    for path in (out / "run").rglob("*"):
        if path.is_file():
            assert b"the-wrong-key-1234" not in path.read_bytes()


def test_the_same_command_works_after_a_run_that_never_started(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["first try [calls:0]"])
    out = tmp_path / "data"
    with FakeModelServer(latency_s=0, api_key="the-right-key") as srv:
        with pytest.raises(SystemExit):
            run(srv, dataset, out, api_key="the-wrong-key-1234")
        run(srv, dataset, out, api_key="the-right-key")  # fixed the key, same command otherwise
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 1


def test_too_many_failures_exit_3_and_say_so(server, tmp_path, capsys):
    dataset = write_jsonl(
        tmp_path / "d.jsonl", ["down one [error:500]", "down two [error:502]", "fine [calls:0]"]
    )
    out = tmp_path / "data"
    with pytest.raises(SystemExit) as info:
        run(server, dataset, out, max_failure_rate=0.5, max_retries=0)
    assert info.value.code == 3
    assert "2 of 3 prompts failed" in capsys.readouterr().err
    failed = read_jsonl(out / "run" / "failed.jsonl")
    assert sorted(r["error_class"] for r in failed) == ["http_500", "http_502"]
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 1  # what finished is kept


def test_failure_rate_at_the_threshold_exits_zero(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["ok [calls:0]", "bad [error:400]"])
    run(server, dataset, tmp_path / "data", max_failure_rate=0.5)  # 1 of 2 is not *more* than half


def test_rate_limits_are_waited_out_by_the_client_with_default_flags(server, tmp_path):
    """Default --max_retries=3, --prompt_timeout and --request_timeout: three 429s in a row are retried."""
    prompts = ["Rate limited at first [flaky:3]", "Rate limited once [flaky:1] [calls:1]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(server, dataset, tmp_path / "data")
    recs = by_prompt(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl"))
    assert not read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    seen = server.stats()["requests_by_prompt"]
    assert [r["api_calls"] for r in recs[prompts[0]]] == [3]
    assert seen[prompts[0]] == 3 + 3  # the three 429s were retried, not paid as turns
    assert seen[prompts[1]] == 2 + 1


def test_rate_limits_are_retried_when_prompt_timeout_is_below_request_timeout(server, tmp_path):
    """A 429 answered in a millisecond must be retried even with a per-prompt limit under --request_timeout."""
    prompts = ["Rate limited with a short budget [flaky:2] [calls:0]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(server, dataset, tmp_path / "data", prompt_timeout=60)  # --request_timeout stays 600
    assert not read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1


def test_prompt_timeout_bounds_the_whole_prompt(server, tmp_path):
    """--prompt_timeout is wall clock for the prompt, retries included, and fails as prompt_timeout."""
    import time

    dataset = write_jsonl(tmp_path / "d.jsonl", ["very slow [slow:3] [calls:0]"])
    started = time.monotonic()
    run(server, dataset, tmp_path / "data", prompt_timeout=1, max_retries=3)
    elapsed = time.monotonic() - started
    failed = read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    assert failed[0]["error_class"] == "prompt_timeout"
    assert elapsed < 4.0  # 1 s limit + pool start-up, preflight and merge


def test_model_calls_of_failed_prompts_are_counted(server, tmp_path):
    prompt = "slowish [slow:0.6] [calls:3]"
    dataset = write_jsonl(tmp_path / "d.jsonl", [prompt])
    run(server, dataset, tmp_path / "data", prompt_timeout=1, max_retries=0)
    (failed,) = read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    assert failed["error_class"] == "prompt_timeout"
    served = server.stats()["requests_by_prompt"][prompt]
    assert served >= 1
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text("utf-8"))
    assert stats["this_run"]["api_calls"] == served


# ----------------------------------------------------------------------------- extra_body from the flags


def _last_request(server: FakeModelServer) -> dict:
    return server.stats()["last_requests"][-1]


def test_flags_reach_the_request_as_extra_body(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["route me [calls:0]"])
    run(
        server,
        dataset,
        tmp_path / "data",
        providers_allowed="a,b",
        provider_sort="price",
        reasoning_effort="high",
        max_tokens=321,
    )
    req = _last_request(server)
    assert req["provider"] == {"only": ["a", "b"], "sort": "price"}
    assert req["reasoning"] == {"enabled": True, "effort": "high"}
    assert req["max_tokens"] == 321
    assert req["model"] == "fake-model"


def test_reasoning_disabled_wins_over_effort(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["think less [calls:0]"])
    run(
        server,
        dataset,
        tmp_path / "data",
        reasoning_effort="high",
        reasoning_disabled=True,
        providers_ignored="x",
    )
    req = _last_request(server)
    assert req["reasoning"] == {"effort": "none"}
    assert req["provider"] == {"ignore": ["x"]}


def test_no_openrouter_fields_without_flags(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["plain endpoint [calls:0]"])
    run(server, dataset, tmp_path / "data")
    req = _last_request(server)
    assert "provider" not in req and "reasoning" not in req and "max_tokens" not in req


# ----------------------------------------------------------------------------- toolset sampling


def test_same_seed_gives_each_prompt_the_same_toolsets(server, tmp_path):
    prompts = [f"sampled prompt {i} [calls:0]" for i in range(10)] + ["sampled prompt 0 [calls:0]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run(server, dataset, out, run_name="first", distribution="balanced", seed=7)
    run(server, dataset, out, run_name="second", distribution="balanced", seed=7)
    first = read_jsonl(out / "first" / "trajectories.jsonl")
    second = read_jsonl(out / "second" / "trajectories.jsonl")
    key = lambda r: r["prompt_index"]  # noqa: E731
    assert [r["toolsets_used"] for r in sorted(first, key=key)] == [
        r["toolsets_used"] for r in sorted(second, key=key)
    ]
    occurrences: collections.Counter[str] = collections.Counter()
    kept: set[str] = set()
    not_offered: set[str] = set()
    for rec in sorted(first, key=key):
        prompt = prompts[rec["prompt_index"]]
        sampled = sample_toolsets_from_distribution("balanced", prompt_rng(7, prompt, occurrences[prompt]))
        occurrences[prompt] += 1
        used = rec["toolsets_used"]
        # toolsets_used: the sampled toolsets this installation can offer, in sampled order
        assert used == [t for t in sampled if t in used]
        kept.update(used)
        not_offered.update(set(sampled) - set(used))
        offered = [t["name"] for t in offered_in_system(rec["conversations"][0]["value"])]
        assert offered == [t.name for t in tools_for_toolsets(used)]
    assert not kept & not_offered  # a toolset is either available to every prompt or to none
    assert {"terminal", "file"} & kept and not {"terminal", "file"} & not_offered
    assert len({tuple(r["toolsets_used"]) for r in first}) > 1  # the coins really vary by prompt
    stats = json.loads((out / "first" / "statistics.json").read_text("utf-8"))
    offered_counts = collections.Counter(t for r in first for t in r["toolsets_used"])
    assert stats["this_run"]["toolsets_offered"] == dict(offered_counts)


def test_a_different_seed_changes_the_draws():
    prompts = [f"sampled prompt {i} [calls:0]" for i in range(10)]
    draws = {
        seed: [sample_toolsets_from_distribution("balanced", prompt_rng(seed, p)) for p in prompts]
        for seed in (7, 8)
    }
    assert draws[7] != draws[8]


# ----------------------------------------------------------------------------- secrets in logs


def test_verbose_previews_never_show_part_of_a_secret(server, tmp_path, monkeypatch, capsys):
    import hashlib

    monkeypatch.setenv("DATASET_SECRET", PROMPT_SECRET)
    prompt = f"Store {PROMPT_SECRET} [calls:2]"
    dataset = write_jsonl(tmp_path / "d.jsonl", [prompt])
    # The fake's second [calls:2] step is write_file with "Notes for: <prompt without directives>";
    # aim the preview's cut 10 characters into the secret, in the arguments and in the whole line.
    hash8 = hashlib.sha256(prompt.encode()).hexdigest()[:8]
    args_head = '{"path": "notes/answer_' + hash8 + '.txt", "content": "Notes for: Store '
    for cut in (len(args_head) + 10, len("tool write_file(") + len(args_head) + 10):
        run(server, dataset, tmp_path / "data", run_name=f"cut{cut}", verbose=True, log_prefix_chars=cut)
    err = capsys.readouterr().err
    assert "write_file" in err and "notes/answer_" in err  # previews were logged
    assert PROMPT_SECRET[:10] not in err


# ----------------------------------------------------------------------------- flags that reach the sandbox


def test_sandbox_network_flag_reaches_the_sandbox_spec(server, tmp_path, monkeypatch):

    import batchrun.prompt.run as runner_mod
    from batchrun.prompt.llm import LLMClient
    from batchrun.prompt.run import run_prompt
    from batchrun.protocol import PromptJob

    specs = []
    real = runner_mod.create_sandbox

    def spy(name, spec, options=None):
        specs.append(spec)
        return real(name, spec, options)

    monkeypatch.setattr(runner_mod, "create_sandbox", spy)
    config = RunConfig.from_flags(
        dataset_file=str(write_jsonl(tmp_path / "d.jsonl", ["x"])),
        batch_size=1,
        run_name="net",
        output_dir=str(tmp_path / "out"),
        base_url=server.base_url,
        api_key="k",
        distribution="terminal_only",
        sandbox_network=False,
    )
    llm = config.llm_config(server.base_url)
    settings = worker_settings(
        config, llm, config.sandbox_options(), tool_settings(config, llm.base_url, llm.api_key)
    )
    job = PromptJob(batch_num=0, prompt_index=0, prompt="offline please [calls:1]", toolsets=("terminal",))
    outcome = run_prompt(job, settings, LLMClient(settings.llm))
    assert outcome.kind == "trajectory"
    assert specs and all(spec.network is False for spec in specs)


def test_a_second_runner_on_the_same_run_directory_is_refused(server, tmp_path, capsys):
    """Two runners on one run directory would pay for and write the same prompts twice."""
    import fcntl

    dataset = write_jsonl(tmp_path / "d.jsonl", ["only once [calls:0]"])
    run_dir = tmp_path / "data" / "run"
    run_dir.mkdir(parents=True)
    with (run_dir / ".lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a live runner holds
        held.write("pid 4242 on elsewhere\n")
        held.flush()
        with pytest.raises(SystemExit) as info:
            run(server, dataset, tmp_path / "data")
        assert info.value.code == 2
        assert "in use by a running batch_runner" in capsys.readouterr().err
    assert server.stats()["requests"] == 0
    run(server, dataset, tmp_path / "data")  # the lock died with its holder: the run goes ahead
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 1
