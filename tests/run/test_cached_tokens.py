"""Prompt tokens an endpoint served from its prompt cache (and wrote to it): read from each answer,
streamed or not, kept in the record's usage and the judge's, summed in statistics.json and status.json.

Against the fake model (OpenAI/OpenRouter-style ``prompt_tokens_details``; hostile shapes of it). The real
llama.cpp server's own report is tested in tests/e2e/test_llama_server.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
from helpers import read_jsonl, run, stats_of, write_jsonl, write_rows

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.llm import Usage, credible_usage
from batchrun.record import JUDGE_USAGE, USAGE, load_runs, record_features

CACHE_KEYS = ("cached_tokens", "cache_write_tokens")


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("usage", "timings", "want"),
    [
        # OpenAI, vLLM, llama.cpp; OpenRouter adds its writes.
        ({"prompt_tokens_details": {"cached_tokens": 80}}, None, {"cached_tokens": 80}),
        (
            {"prompt_tokens_details": {"cached_tokens": 60, "cache_write_tokens": 30}},
            None,
            {"cached_tokens": 60, "cache_write_tokens": 30},
        ),
        # Anthropic-compatible names, at the top of usage (LiteLLM passes them through).
        (
            {"cache_read_input_tokens": 70, "cache_creation_input_tokens": 20},
            None,
            {"cached_tokens": 70, "cache_write_tokens": 20},
        ),
        # llama.cpp's timings, when its usage does not say (servers before prompt_tokens_details).
        ({}, {"cache_n": 55, "prompt_n": 45}, {"cached_tokens": 55}),
        ({"prompt_tokens_details": {"cached_tokens": 10}}, {"cache_n": 55}, {"cached_tokens": 10}),
        # Never more than the prompt, nor both together: such a count is left out, not clipped to the prompt
        # (100 of 100 cached was said of an answer whose endpoint said 500).
        ({"prompt_tokens_details": {"cached_tokens": 500, "cache_write_tokens": 9}}, None, {"cache_write_tokens": 9}),
        ({"prompt_tokens_details": {"cached_tokens": 95, "cache_write_tokens": 9}}, None, {"cached_tokens": 95}),
        ({"prompt_tokens_details": {"cached_tokens": 100, "cache_write_tokens": 0}}, None, {"cached_tokens": 100, "cache_write_tokens": 0}),
        # Hostile: unreported, never a crash, never added.
        ({"prompt_tokens_details": {"cached_tokens": -5}}, None, {}),
        ({"prompt_tokens_details": {"cached_tokens": "80"}}, None, {}),
        ({"prompt_tokens_details": {"cached_tokens": 2.5}}, None, {}),
        ({"prompt_tokens_details": {"cached_tokens": float("nan")}}, None, {}),
        ({"prompt_tokens_details": {"cached_tokens": 10**30}}, None, {}),
        ({"prompt_tokens_details": {"cached_tokens": {"n": 1}}}, None, {}),
        ({"prompt_tokens_details": {"cached_tokens": True}}, None, {}),
        ({"prompt_tokens_details": "cached"}, None, {}),
        ({"prompt_tokens_details": [80]}, None, {}),
        ({"prompt_tokens_details": None}, None, {}),
        ({"prompt_tokens_details": {"cached_tokens": -1}, "cache_read_input_tokens": 50}, None, {}),
        ({}, {"cache_n": -3}, {}),
        ({}, "timings", {}),
    ],
)  # fmt: skip
def test_the_cache_s_counts_are_read_where_endpoints_say_them_and_only_when_credible(usage, timings, want):
    clean, fault = credible_usage({"prompt_tokens": 100, "completion_tokens": 5, **usage}, 1, 1, timings)
    assert fault is None  # the cache's counts change no spend: a bad one is unreported, not an estimate
    assert clean.get("prompt_tokens_details", {}) == want
    assert (clean["prompt_tokens"], clean["completion_tokens"]) == (100, 5)
    tally = Usage()
    tally.add(clean)
    tally.add(clean)
    got = tally.as_dict()
    for key in CACHE_KEYS:
        assert got[key] == (2 * want[key] if key in want else None), key


def test_a_tally_counts_the_cache_of_every_answer_and_names_it_unreported_when_none_said():
    tally = Usage()
    tally.add(credible_usage({"prompt_tokens": 10, "completion_tokens": 1}, 1, 1)[0])
    assert tally.as_dict()["cached_tokens"] is None  # no answer said: typed 0 and named in unreported
    tally.add(credible_usage({"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 9}}, 1, 1)[0])  # fmt: skip
    assert tally.as_dict()["cached_tokens"] == 9 and tally.as_dict()["cache_write_tokens"] is None


@pytest.mark.parametrize(
    ("usage", "prompt", "want"),
    [
        # Anthropic's own convention: input_tokens are the part neither read from the cache nor written to it.
        ({"input_tokens": 12, "cache_read_input_tokens": 2495, "cache_creation_input_tokens": 0}, 2507,
         {"cached_tokens": 2495, "cache_write_tokens": 0}),
        ({"input_tokens": 12, "cache_creation_input_tokens": 2495}, 2507, {"cache_write_tokens": 2495}),
        # A bad count is unreported and adds nothing to the prompt; images' usage (no cache) is as it was.
        ({"input_tokens": 12, "cache_read_input_tokens": -4, "cache_creation_input_tokens": 30}, 42,
         {"cache_write_tokens": 30}),
        ({"input_tokens": 12}, 12, {}),
        # Beside prompt_tokens (OpenAI's convention, LiteLLM's), the prompt holds them already.
        ({"prompt_tokens": 2507, "cache_read_input_tokens": 2495}, 2507, {"cached_tokens": 2495}),
        ({"prompt_tokens": 2495, "cache_read_input_tokens": 2495, "cache_creation_input_tokens": 0}, 2495,
         {"cached_tokens": 2495, "cache_write_tokens": 0}),
        # A gateway passing Anthropic's input_tokens on as prompt_tokens, below the cache's counts (as one
        # chat gateway's Anthropic usage chunk says: 8 prompt tokens, 18,901 read, 1,367 written), or those
        # with the reads (another's): raised to the cache's sum, short of the uncached few (8 or 5) alone.
        ({"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 18901}, "cache_read_input_tokens": 18901,
          "cache_creation_input_tokens": 1367}, 20268, {"cached_tokens": 18901, "cache_write_tokens": 1367}),
        ({"prompt_tokens": 2500, "cache_read_input_tokens": 2495, "cache_creation_input_tokens": 1000}, 3495,
         {"cached_tokens": 2495, "cache_write_tokens": 1000}),
    ],
)  # fmt: skip
def test_anthropic_s_input_tokens_leave_out_the_cached_part_of_the_prompt(usage, prompt, want):
    clean, fault = credible_usage({"output_tokens": 50, **usage}, 1, 1)
    assert fault is None
    assert clean["prompt_tokens"] == prompt and clean["total_tokens"] == prompt + 50
    assert clean.get("prompt_tokens_details", {}) == want


def test_an_anthropic_style_endpoint_s_cached_prompts_are_counted_whole(tmp_path):
    """An endpoint counting as Anthropic does (input_tokens without the cache's tokens, which
    cache_read_input_tokens and cache_creation_input_tokens say): the record's prompt_tokens are what it
    served, streamed or not. Before, input_tokens were taken for the whole prompt and the cache's counts cut
    down to them: every prompt_tokens was 0 (the fake's messages are all cached or written) and the budget
    counted the replies alone."""
    with FakeModelServer(prompt_cache=True, anthropic_usage=True) as server:
        made = _runs(server, tmp_path)
        served = server.stats()
    for run_dir in made.values():
        for rec in read_jsonl(run_dir / "trajectories.jsonl"):
            usage = rec["metadata"]["usage"]
            assert usage["cached_tokens"] > 0 and usage["cache_write_tokens"] > 0
            assert usage["cached_tokens"] + usage["cache_write_tokens"] == usage["prompt_tokens"]
            assert usage["estimated_calls"] == 0
    totals = [stats_of(d)["usage_in_trajectories"] for d in made.values()]
    for key in ("prompt_tokens", "cached_tokens"):
        assert sum(t[key] for t in totals) == served[key], key


def _runs(server: FakeModelServer, tmp_path: Path, **kw) -> dict[bool, Path]:
    dataset = write_jsonl(tmp_path / "d.jsonl", ["Three turns [calls:2]", "Two turns [calls:1]"])
    made = {}
    for stream in (False, True):
        run(
            server,
            dataset,
            tmp_path / "data",
            run_name=f"stream_{stream}",
            stream=stream,
            num_workers=1,
            **kw,
        )
        made[stream] = tmp_path / "data" / f"stream_{stream}"
    return made


def test_cached_prompt_tokens_are_recorded_per_prompt_and_summed_in_the_statistics_and_status(tmp_path):
    """Each turn resends the conversation: the endpoint's cached prompt tokens of every call, streamed or
    not, are the record's, and the run's totals are their sums (before, none was recorded anywhere)."""
    with FakeModelServer(prompt_cache=True) as server:
        made = _runs(server, tmp_path)
        served_cached = server.stats()["cached_tokens"]
    assert served_cached > 0
    records = {}
    for stream, run_dir in made.items():
        recs = read_jsonl(run_dir / "trajectories.jsonl")
        records[stream] = sorted(recs, key=lambda r: r["prompt_index"])
        stats = stats_of(run_dir)
        status = json.loads((run_dir / "status.json").read_text("utf-8"))
        for rec in recs:
            usage = rec["metadata"]["usage"]
            assert list(usage) == list(USAGE)
            assert usage["cached_tokens"] > 0 and usage["cache_write_tokens"] > 0
            assert usage["cached_tokens"] + usage["cache_write_tokens"] == usage["prompt_tokens"]
            assert not set(CACHE_KEYS) & set(json.loads(usage["unreported"]))
        for key in CACHE_KEYS:
            total = sum(r["metadata"]["usage"][key] for r in recs)
            assert stats["usage_in_trajectories"][key] == total, key
            assert stats["this_run"]["usage"][key] == total, key
            assert stats["runs"][-1][key] == stats["run_totals"][key] == total, key
            assert status[key] == total, key
    # Streamed and plain answers give the same counts.
    for plain, streamed in zip(records[False], records[True], strict=True):
        assert {k: plain["metadata"]["usage"][k] for k in CACHE_KEYS} == {
            k: streamed["metadata"]["usage"][k] for k in CACHE_KEYS
        }
        report = (run_dir / "report.html").read_text("utf-8")
        assert f"{stats['usage_in_trajectories']['cached_tokens']:,} from the endpoint" in report
        # And those written to the cache (billed above the rest by Anthropic): before, no word of them.
        assert f"{stats['usage_in_trajectories']['cache_write_tokens']:,} written to it" in report
    # What the endpoint served (its start checks' one-message calls are cached nothing).
    assert (
        sum(r["metadata"]["usage"]["cached_tokens"] for recs in records.values() for r in recs)
        == served_cached
    )


def test_the_judge_s_cached_tokens_are_kept_apart_in_its_usage(tmp_path):
    rows = [{"id": "g", "prompt": 'Grade me [calls:1] [verdict:{"score": 1, "passed": true}]', "rubric": "r"}]
    with FakeModelServer(prompt_cache=True) as server:
        judge = dict(scorer="judge", judge_model="judge-model", judge_base_url=server.base_url)
        run(server, write_rows(tmp_path / "d.jsonl", rows), tmp_path / "data", **judge)
    (rec,) = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    agent, judged = rec["metadata"]["usage"], rec["score"]["judge_usage"]
    assert list(judged) == list(JUDGE_USAGE)
    assert judged["calls"] == 1 and 0 < judged["cached_tokens"] < judged["prompt_tokens"]
    assert agent["calls"] == 2 and agent["cached_tokens"] > 0
    # The run spent both: this_run counts the judge's beside the agent's.
    this_run = stats_of(tmp_path / "data" / "run")["this_run"]["usage"]
    assert this_run["cached_tokens"] == agent["cached_tokens"] + judged["cached_tokens"]


def test_the_judge_s_usage_names_what_its_endpoint_did_not_report_as_the_agent_s_does(tmp_path):
    """score.judge_usage gave a count the judge's endpoint never reported as 0 with nothing to tell it from
    a reported 0 (a judge that reports no cost read as free), where metadata.usage names such counts in
    ``unreported``. It now has its own ``unreported``; "[]" for a sample no judge was asked about."""
    rows = [
        {"id": "g", "prompt": 'Grade me [calls:1] [verdict:{"score": 1, "passed": true}]', "rubric": "r"},
        {"id": "n", "prompt": "No judge [calls:0]", "answer": "x"},
    ]
    with FakeModelServer() as server:  # reports no cost, nor the cache's counts
        judge = dict(scorer="judge", judge_model="judge-model", judge_base_url=server.base_url)
        run(server, write_rows(tmp_path / "d.jsonl", rows[:1]), tmp_path / "data", **judge)
        run(server, write_rows(tmp_path / "e.jsonl", rows[1:]), tmp_path / "data2")
    (rec,) = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    agent, judged = json.loads(rec["metadata"]["usage"]["unreported"]), rec["score"]["judge_usage"]
    assert "cost_usd" in agent and judged["calls"] == 1
    assert json.loads(judged["unreported"]) == [k for k in agent if k in JUDGE_USAGE], judged
    (plain,) = read_jsonl(tmp_path / "data2" / "run" / "trajectories.jsonl")
    assert plain["score"]["judge_usage"]["unreported"] == "[]"


@pytest.mark.parametrize(
    "details",
    [
        {"cached_tokens": -500, "cache_write_tokens": "9"},
        {"cached_tokens": 10**30},
        {"cached_tokens": 5_000_000, "cache_write_tokens": 5_000_000},
        {"cached_tokens": 2.5},
        {"cached_tokens": {"nested": [1, 2]}, "cache_write_tokens": [3]},
        "cached",
        [1, 2, 3],
    ],
    ids=["negative_and_string", "huge", "above_the_prompt", "float", "nested", "string", "list"],
)
def test_hostile_cache_counts_are_unreported_and_poison_no_total(tmp_path, details):
    with FakeModelServer(prompt_tokens_details=details) as server:
        made = _runs(server, tmp_path)
    for run_dir in made.values():
        stats = _strict((run_dir / "statistics.json").read_text("utf-8"))
        recs = [_strict(line) for line in (run_dir / "trajectories.jsonl").read_text("utf-8").splitlines()]
        assert len(recs) == 2
        for rec in recs:
            usage = rec["metadata"]["usage"]
            assert (usage["cached_tokens"], usage["cache_write_tokens"]) == (0, 0)
            assert set(CACHE_KEYS) <= set(json.loads(usage["unreported"]))
            assert usage["estimated_calls"] == 0  # the spend's own counts were credible: not estimated
        for where in (stats["usage_in_trajectories"], stats["this_run"]["usage"], stats["run_totals"]):
            assert (where["cached_tokens"], where["cache_write_tokens"]) == (0, 0)


def _as_an_earlier_version_wrote(run_dir: Path) -> None:
    """The run's files as a version before the cache's counts wrote them: no such keys anywhere."""
    for path in [run_dir / "trajectories.jsonl", *run_dir.glob("batch_*.jsonl")]:
        lines = []
        for rec in read_jsonl(path):
            for key in CACHE_KEYS:
                del rec["metadata"]["usage"][key]
                del rec["score"]["judge_usage"][key]
            rec["metadata"]["usage"]["unreported"] = json.dumps(
                [k for k in json.loads(rec["metadata"]["usage"]["unreported"]) if k not in CACHE_KEYS]
            )
            lines.append(json.dumps(rec) + "\n")
        path.write_text("".join(lines), "utf-8")
    stats = stats_of(run_dir)
    for entry in (*stats["runs"], stats["run_totals"], stats["usage_in_trajectories"]):
        for key in CACHE_KEYS:
            entry.pop(key, None)
    (run_dir / "statistics.json").write_text(json.dumps(stats), "utf-8")


def test_a_run_written_before_the_cache_s_counts_resumes_and_loads_beside_a_new_one(tmp_path):
    with FakeModelServer(prompt_cache=True) as server:
        old_dataset = write_jsonl(tmp_path / "old.jsonl", ["Old one [calls:1]"])
        run(server, old_dataset, tmp_path / "data", run_name="old")
        _as_an_earlier_version_wrote(tmp_path / "data" / "old")
        run(
            server,
            write_jsonl(tmp_path / "new.jsonl", ["New one [calls:1]"]),
            tmp_path / "data",
            run_name="new",
        )
        # A resume of (a copy of) the old run with one more prompt: its old record is merged as it is.
        shutil.copytree(tmp_path / "data" / "old", tmp_path / "data" / "resumed")
        more = write_jsonl(tmp_path / "more.jsonl", ["Old one [calls:1]", "One more [calls:1]"])
        run(server, more, tmp_path / "data", run_name="resumed", resume=True)
    old, new, resumed = (tmp_path / "data" / name for name in ("old", "new", "resumed"))
    (new_rec,) = read_jsonl(new / "trajectories.jsonl")
    assert new_rec["metadata"]["usage"]["cached_tokens"] > 0
    was, added = sorted(read_jsonl(resumed / "trajectories.jsonl"), key=lambda r: r["prompt_index"])
    # The merge types the old record as today's schema: the counts it never had are 0 and unreported.
    assert was["metadata"]["usage"]["cached_tokens"] == 0 and added["metadata"]["usage"]["cached_tokens"] > 0
    assert set(CACHE_KEYS) <= set(json.loads(was["metadata"]["usage"]["unreported"]))
    stats = stats_of(resumed)
    cached = added["metadata"]["usage"]["cached_tokens"]
    assert stats["usage_in_trajectories"]["cached_tokens"] == stats["run_totals"]["cached_tokens"] == cached
    assert stats["usage_in_trajectories"]["prompt_tokens"] == sum(
        r["metadata"]["usage"]["prompt_tokens"] for r in (was, added)
    )
    # load_runs types both, in either order: the old record's counts are 0 and named unreported.
    for i, order in enumerate(((old, new), (new, old))):
        both = load_runs(*order, cache_dir=str(tmp_path / f"runs{i}"))
        by_run = {r["run_name"]: r["metadata"]["usage"] for r in both}
        assert by_run["old"]["cached_tokens"] == 0 and "cached_tokens" in json.loads(
            by_run["old"]["unreported"]
        )
        assert by_run["new"]["cached_tokens"] == new_rec["metadata"]["usage"]["cached_tokens"]
    files = [str(old / "trajectories.jsonl"), str(new / "trajectories.jsonl")]
    schema = record_features(list(new_rec["tool_stats"]))
    for i, order in enumerate((files, files[::-1])):  # with the schema, either order
        ds = datasets.load_dataset("json", data_files=order, features=schema, split="train", cache_dir=str(tmp_path / f"f{i}"))  # fmt: skip
        assert ds.num_rows == 2
    # Exported together: one schema, the old sample's cache counts 0.
    from batchrun.views import export

    assert export.main([str(old), str(new), "--format=parquet", f"--out={tmp_path / 'exp'}"]) == 0
    exported = datasets.load_dataset(str(tmp_path / "exp"), split="train", cache_dir=str(tmp_path / "e"))
    got = {r["run_name"]: r["usage"]["cached_tokens"] for r in exported}
    assert got == {"old": 0, "new": new_rec["metadata"]["usage"]["cached_tokens"]}
    # Plain, the new run first: the old one's usage lacks keys, which the loader fills with null.
    plain = datasets.load_dataset(
        "json", data_files=files[::-1], split="train", cache_dir=str(tmp_path / "p")
    )
    assert plain.num_rows == 2 and plain[1]["metadata"]["usage"]["cached_tokens"] is None


def test_the_cache_s_counts_of_prompts_in_flight_are_in_status_as_their_tokens_are(tmp_path):
    """With a run-wide budget each answered call's spend reaches the parent at once and status.json counts
    its prompt_tokens; its cached counts waited for the prompt's outcome, so status.json said 0 cached
    tokens of a long prompt's 9,000 served from the cache (and so did a killed invocation's runs entry,
    read from it). Now they are counted with the call, and the outcome adds only the rest."""
    from batchrun.identity import RowIdentity
    from batchrun.protocol import FAILED, Outcome
    from batchrun.run.recorder import Recorder
    from batchrun.run.worker import spend_of_usage
    from batchrun.secrets import Redactor

    clean, fault = credible_usage(
        {"prompt_tokens": 10_000, "completion_tokens": 50, "prompt_tokens_details": {"cached_tokens": 9_000}},
        10,
        10,
    )
    assert fault is None
    recorder = Recorder(tmp_path / "run", "run", Redactor(None), budget_tokens=10**6)
    recorder.run_dir.mkdir()
    recorder.add_live_spend(spend_of_usage(clean, 1, 0, 0, reservation=None))
    recorder.write_status("running", force=True)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["prompt_tokens"], status["cached_tokens"], status["cache_write_tokens"]) == (
        10_000,
        9_000,
        0,
    )
    # The prompt ends after one more call: its outcome carries both, and nothing is counted twice.
    usage = {"calls": 2, "prompt_tokens": 20_100, "completion_tokens": 90, "cached_tokens": 19_000,
             "cache_write_tokens": 1_000, "cost_usd": None}  # fmt: skip
    recorder.record(Outcome(FAILED, 1, 0, RowIdentity("p"), usage, error_class="timeout", error="late"))
    recorder.write_status("finished", force=True)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["prompt_tokens"], status["cached_tokens"], status["cache_write_tokens"]) == (
        20_100,
        19_000,
        1_000,
    )
