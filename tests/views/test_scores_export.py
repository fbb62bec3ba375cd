"""Exports that use scores: score columns, --only_passed and --min_score, and the preference and
rewards formats, each loaded back with `datasets`."""

from __future__ import annotations

import json

import datasets
import pytest
from helpers import run, write_rows

from batchrun.views import export

# The fake model answers 42 to each row (and 4 beside it to row four); run "exact" judges with exact,
# run "includes" with includes.
ROWS = [
    {"id": "right", "prompt": "Say 42 [calls:1] [answer:42]", "answer": "42"},  # passes in both runs
    {"id": "four", "prompt": "Say 4 [calls:1] [answer:42, 4]", "answer": "4"},  # fails, then passes
    {"id": "seven", "prompt": "Say 7 [calls:1] [answer:42]", "answer": "7"},  # fails in both
    {"id": "free", "prompt": "Say hi [calls:1]"},  # never judged
]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scored")
    dataset = write_rows(tmp / "d.jsonl", ROWS)
    out = tmp / "data"
    run(None, dataset, out, run_name="exact", samples_per_prompt=2)
    run(None, dataset, out, run_name="includes", samples_per_prompt=2, scorer="includes", keep="passed")
    return out / "exact", out / "includes"


def _load(path, tmp_path):
    return datasets.load_dataset(str(path), split="train", cache_dir=str(tmp_path / "hf"))


@pytest.mark.parametrize("fmt", ["openai", "parquet", "sharegpt"])
def test_score_columns_and_filters(two_runs, tmp_path, fmt):
    exact, _ = two_runs
    assert export.main([str(exact), f"--format={fmt}", f"--out={tmp_path / 'all'}"]) == 0
    ds = _load(tmp_path / "all", tmp_path)
    assert ds.features["score_value"].dtype == "float64" and ds.features["score_passed"].dtype == "bool"
    got = sorted((r["row_id"], r["score_status"], r["score_passed"], r["scorer"]) for r in ds)
    assert got == sorted(
        [("right", "passed", True, "exact")] * 2
        + [("four", "failed", False, "exact")] * 2
        + [("seven", "failed", False, "exact")] * 2
        + [("free", "unscored", False, "none")] * 2  # no verdict: the status says so, the columns stay typed
    )
    assert export.main([str(exact), f"--format={fmt}", "--only_passed", f"--out={tmp_path / 'ok'}"]) == 0
    assert [r["row_id"] for r in _load(tmp_path / "ok", tmp_path)] == ["right", "right"]
    assert export.main([str(exact), f"--format={fmt}", "--min_score=0.5", f"--out={tmp_path / 'min'}"]) == 0
    assert _load(tmp_path / "min", tmp_path).num_rows == 2
    card = (tmp_path / "ok" / "README.md").read_text("utf-8")
    assert "6 not passed (--only_passed)" in card


@pytest.fixture(scope="module")
def flip_runs(tmp_path_factory):
    """Two runs judged alike (exact), whose row fails on sample 0 and passes on sample 1."""
    tmp = tmp_path_factory.mktemp("flips")
    rows = [
        {"id": "flip", "prompt": "Say 42, try 0 [calls:1] [answers:42|41]", "answer": "42"},
        {"id": "right", "prompt": "Say 7 [calls:1] [answer:7]", "answer": "7"},  # never fails
    ]
    dataset = write_rows(tmp / "d.jsonl", rows)
    out = tmp / "data"
    flags = dict(samples_per_prompt=2, seed_per_request=True)
    run(None, dataset, out, run_name="a", **flags)
    run(None, dataset, out, run_name="b", keep="passed", **flags)
    return out / "a", out / "b"


def test_preference_pairs_a_passing_and_a_failing_sample_of_one_row(flip_runs, tmp_path):
    a, b = flip_runs
    # The failing sample of run b was discarded (--keep=passed): it is read too.
    assert export.main([str(a), str(b), "--format=preference", f"--out={tmp_path / 'p'}"]) == 0
    ds = _load(tmp_path / "p", tmp_path)
    # Row flip: a pass and a failure in each run -> 2 pairs. Row right never fails: no pair.
    assert ds.num_rows == 2 and set(ds["row_id"]) == {"flip"}
    sides = []
    for row in ds:
        assert row["prompt"][-1]["role"] == "user" and row["prompt"][-1]["content"].startswith("Say 42")
        assert row["chosen"][0]["role"] == "assistant" and row["rejected"][0]["role"] == "assistant"
        assert (row["chosen_score"], row["rejected_score"]) == (1.0, 0.0)
        assert row["chosen"][-1]["content"] != row["rejected"][-1]["content"]
        sides.append((row["chosen_run_name"], row["chosen_sample_index"]))
        sides.append((row["rejected_run_name"], row["rejected_sample_index"]))
        assert set(row["run_names"]) == {row["chosen_run_name"], row["rejected_run_name"]}
        # Both completions hold the tool call and its result, as the model made them.
        assert row["chosen"][0]["tool_calls"][0]["function"]["name"] == "terminal"
        assert [m["role"] for m in row["chosen"]] == ["assistant", "tool", "assistant"]
        assert json.loads(row["tools"])[0]["function"]["name"] == "terminal"
    # Each side says which run's sample it is: every sample of the row once.
    assert sorted(sides) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    # TRL's conversational preference layout: lists of {role, content} messages under these keys.
    assert {"prompt", "chosen", "rejected"} <= set(ds.column_names)


def test_preference_never_pairs_samples_two_runs_judged_with_other_scorers(two_runs, tmp_path, capsys):
    """Row four's reply (42, 4) fails exact and passes includes: the same reply as chosen and rejected,
    its two verdicts saying nothing of it (views.compare leaves such pairs out too)."""
    exact, includes = two_runs
    assert export.main([str(exact), str(includes), "--format=preference", f"--out={tmp_path / 'p'}"]) == 1
    assert "no row has both a passing and a failing sample" in capsys.readouterr().err


def test_rewards_groups_each_rows_samples_with_their_scores(two_runs, tmp_path):
    exact, includes = two_runs
    assert export.main([str(exact), str(includes), "--format=rewards", f"--out={tmp_path / 'r'}"]) == 0
    ds = _load(tmp_path / "r", tmp_path)
    by_row = {}
    for r in ds:
        by_row.setdefault(r["row_id"], []).append(r)
    assert set(by_row) == {"right", "four", "seven"}  # "free" was never judged
    # One group per run: exact and includes judge row four's one reply differently, never in one group.
    four = sorted(by_row["four"], key=lambda r: r["run_names"])
    assert [(g["run_names"], g["rewards"]) for g in four] == [
        (["exact"], [0.0, 0.0]),
        (["includes"], [1.0, 1.0]),
    ]
    assert [c["run_name"] for c in four[1]["completions"]] == ["includes", "includes"]
    by_row = {rows[0]["row_id"]: rows[0] for rows in by_row.values()}
    assert all(c["messages"][-1]["role"] == "assistant" for c in by_row["seven"]["completions"])
    assert by_row["right"]["prompt"][-1]["content"].startswith("Say 42")


def test_preference_without_any_pair_is_a_clear_error(two_runs, tmp_path, capsys):
    # Nothing to write, as any export with every sample left out: exit 1 (2 is a bad request).
    exact, _ = two_runs
    assert export.main([str(exact), "--format=preference", f"--out={tmp_path / 'none'}"]) == 1
    assert "no row has both a passing and a failing sample" in capsys.readouterr().err


def test_a_sample_rerun_by_rerun_discarded_is_one_completion_of_its_group(tmp_path):
    """--rerun_discarded leaves the old discard in discarded.jsonl beside the new run of its sample (the
    same seed: here the same failing answer). statistics.json counts the sample once; the rewards group
    held it twice, a duplicate completion weighing twice in a trainer's group."""
    rows = [{"id": "r", "prompt": "Say [calls:0] [answers:42|41]", "answer": "42"}]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    flags = dict(keep="passed", samples_per_prompt=2, seed_per_request=True)
    run(None, dataset, out, **flags)
    run(None, dataset, out, resume=True, rerun_discarded=True, **flags)
    export.main([str(out / "run"), "--format=rewards", f"--out={tmp_path / 'groups'}"])
    (group,) = [json.loads(line) for line in (tmp_path / "groups" / "train.jsonl").read_text().splitlines()]
    assert sorted((c["sample_index"], c["passed"]) for c in group["completions"]) == [(0, True), (1, False)]


def test_samples_judged_against_different_checks_are_never_grouped(tmp_path):
    """Two runs of one prompt whose datasets give it different answers (a wrong answer key fixed
    between the runs): the same reply (42) passes in one run and fails in the other. The check is
    not part of a row's identity, but samples judged against different checks are not comparable:
    paired, they make a preference pair of two identical answers, one chosen and one rejected, and a
    rewards group that scores the same answer 1 and 0."""
    out = tmp_path / "data"
    for name, answer in (("old_key", "7"), ("new_key", "42")):
        rows = [{"id": "q", "prompt": "Say 42 [calls:1] [answer:42]", "answer": answer}]
        run(None, write_rows(tmp_path / f"{name}.jsonl", rows), out, run_name=name)
    dirs = [str(out / "old_key"), str(out / "new_key")]
    # No row has a passing and a failing sample judged alike: no pair at all.
    assert export.main([*dirs, "--format=preference", f"--out={tmp_path / 'p'}"]) == 1  # nothing to write
    assert export.main([*dirs, "--format=rewards", f"--out={tmp_path / 'r'}"]) == 0
    groups = _load(tmp_path / "r", tmp_path)
    assert sorted((g["rewards"], g["run_names"]) for g in groups) == [
        ([0.0], ["old_key"]),
        ([1.0], ["new_key"]),
    ]


@pytest.mark.parametrize("fmt", ["preference", "rewards"])
def test_scored_rows_of_two_runs_load_together_in_either_order_with_arguments_as_objects(
    flip_runs, tmp_path, fmt
):
    """Each call's arguments are a JSON object, as in ``messages`` (a string was double-encoded by
    ``tojson`` templates); the files of two runs' exports still load together with plain datasets."""
    files = []
    for one in flip_runs:
        assert export.main([str(one), f"--format={fmt}", f"--out={tmp_path / one.name}"]) == 0
        files.append(str(tmp_path / one.name / "train.jsonl"))
    loaded = [
        datasets.load_dataset("json", data_files=order, split="train", cache_dir=str(tmp_path / f"c{i}"))
        for i, order in enumerate((files, files[::-1]))
    ]
    rows = {"preference": 2, "rewards": 4}[fmt]  # a pair per run; a group per row and run
    assert loaded[0].features == loaded[1].features and loaded[0].num_rows == loaded[1].num_rows == rows
    for row in loaded[0]:
        messages = row["chosen"] if fmt == "preference" else row["completions"][0]["messages"]
        call = messages[0]["tool_calls"][0]["function"]
        assert call["name"] == "terminal" and call["arguments"] == {"command": "echo step 1 of 1"}
