"""Exports that use scores: score columns, --only_passed and --min_score, and the preference and
rewards formats, each loaded back with `datasets`."""

from __future__ import annotations

import json
import shutil

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


def _set(message: dict) -> dict:
    """A message with its null keys left out (the scored formats carry every key, ``messages`` not)."""
    calls = message.get("tool_calls")
    if calls:
        message = {**message, "tool_calls": [{k: v for k, v in c.items() if v is not None} for c in calls]}
    return {k: v for k, v in message.items() if v is not None}


@pytest.mark.parametrize("mode", ["field", "think", "drop"])
def test_reasoning_applies_to_chosen_rejected_and_completions_as_in_messages(flip_runs, tmp_path, mode):
    """--reasoning was accepted and ignored by preference and rewards: the pairs kept reasoning_content
    whatever was asked, so a --reasoning=drop export still trained on the model's thinking."""
    a, _ = flip_runs
    flag = f"--reasoning={mode}"
    assert export.main([str(a), "--format=messages", flag, f"--out={tmp_path / 'm'}"]) == 0
    as_messages = {}
    for row in _load(tmp_path / "m", tmp_path):
        cut = next(i for i, m in enumerate(row["messages"]) if m["role"] == "user") + 1
        as_messages[(row["row_id"], row["sample_index"])] = [_set(m) for m in row["messages"][cut:]]
    assert export.main([str(a), "--format=preference", flag, f"--out={tmp_path / 'p'}"]) == 0
    assert export.main([str(a), "--format=rewards", flag, f"--out={tmp_path / 'r'}"]) == 0
    (pair,) = _read(tmp_path / "p")
    sides = [(pair["chosen"], pair["chosen_sample_index"]), (pair["rejected"], pair["rejected_sample_index"])]
    sides += [
        (c["messages"], c["sample_index"])
        for g in _read(tmp_path / "r")
        if g["row_id"] == "flip"
        for c in g["completions"]
    ]
    assert len(sides) == 4
    for messages, index in sides:
        assert [_set(m) for m in messages] == as_messages[("flip", index)]
    turns = [m for messages, _ in sides for m in messages if m["role"] == "assistant"]
    with_reasoning = [m for m in turns if m["reasoning_content"]]
    thinking = [m for m in turns if (m["content"] or "").startswith("<think>\n")]
    assert (len(with_reasoning), len(thinking)) == {
        "field": (len(turns), 0),
        "think": (0, len(turns)),
        "drop": (0, 0),
    }[mode]


def _read(out) -> list[dict]:
    return [
        json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text("utf-8").splitlines()
    ]


@pytest.mark.parametrize("fmt", ["preference", "rewards"])
@pytest.mark.parametrize("flag", ["--only_passed", "--min_score=0.5"])
def test_score_filters_are_refused_by_the_scored_formats(flip_runs, tmp_path, capsys, fmt, flag):
    """--only_passed and --min_score were accepted and ignored: a pair needs the failing sample they
    would leave out, and a rewards group whose low scores are left out says nothing about which
    completion was better. Refused (exit 2) before anything is written."""
    a, _ = flip_runs
    assert export.main([str(a), f"--format={fmt}", flag, f"--out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert flag.split("=")[0] in err and f"--format={fmt}" in err
    assert not (tmp_path / "out").exists()


def _with_stop_reason(run_dir, dest, stop_reason: str):
    """A copy of ``run_dir`` whose failing kept samples stopped for ``stop_reason``."""
    shutil.copytree(run_dir, dest)
    path = dest / "trajectories.jsonl"
    records = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    for rec in records:
        if not rec["score"]["passed"]:
            rec["metadata"]["stop_reason"] = stop_reason
    path.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    return dest


def test_stop_reason_filters_choose_the_samples_a_pair_or_group_is_made_of(flip_runs, tmp_path, capsys):
    """--stop_reasons and --exclude_stop_reasons were ignored by preference and rewards. They filter the
    samples before pairing; without them, every stop reason is read (a cut reply is a failed sample)."""
    cut = _with_stop_reason(flip_runs[0], tmp_path / "runs" / "cut", "truncated")
    assert export.main([str(cut), "--format=preference", f"--out={tmp_path / 'all'}"]) == 0
    assert _read(tmp_path / "all")[0]["rejected_sample_index"] == 0
    for flag in ("--exclude_stop_reasons=truncated", "--stop_reasons=final_answer"):
        assert export.main([str(cut), "--format=preference", flag, f"--out={tmp_path / 'p'}"]) == 1
        assert "1 stop_reason truncated" in capsys.readouterr().err
    assert (
        export.main([str(cut), "--format=rewards", "--stop_reasons=truncated", f"--out={tmp_path / 'r'}"])
        == 0
    )
    (group,) = _read(tmp_path / "r")
    assert [(c["sample_index"], c["passed"]) for c in group["completions"]] == [(0, False)]


def test_dedup_leaves_a_sample_out_of_a_pair_or_group_that_holds_it_already(flip_runs, tmp_path):
    """--dedup was ignored by preference and rewards: two byte-identical runs gave each pair twice and
    each group every completion twice. A sample whose conversation is one its group holds already is
    left out (per group: one conversation judged against another check is another sample)."""
    a, _ = flip_runs
    twin = tmp_path / "runs" / "twin"
    shutil.copytree(a, twin)
    dirs = [str(a), str(twin)]
    assert export.main([*dirs, "--format=preference", f"--out={tmp_path / 'p2'}"]) == 0
    assert len(_read(tmp_path / "p2")) == 2
    assert export.main([*dirs, "--format=preference", "--dedup", f"--out={tmp_path / 'p'}"]) == 0
    (pair,) = _read(tmp_path / "p")
    assert pair["run_names"] == ["a"]
    assert export.main([*dirs, "--format=rewards", "--dedup", f"--out={tmp_path / 'r'}"]) == 0
    groups = _read(tmp_path / "r")
    # Row flip: its two samples once; row right: its two samples are one conversation (one answer).
    assert sorted((g["row_id"], len(g["completions"])) for g in groups) == [("flip", 2), ("right", 1)]
    assert "5 duplicate" in (tmp_path / "r" / "README.md").read_text("utf-8")


def test_the_scored_formats_count_the_samples_whose_markup_stays_unsplit(tmp_path, capsys):
    """Scored ambiguous_markup discards (--include_discarded) keep their assistant text unsplit in the
    groups too, so --reasoning=drop is not applied to them: one warning line counts them."""
    # Judged by verify: the text scorers give a final answer with a literal <tool_call> no verdict.
    rows = [{"id": "x", "prompt": "Say 42 [literal_tool_call] [calls:1]", "verify": "true"}]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out, samples_per_prompt=2, seed_per_request=True)
    flags = ["--format=rewards", "--include_discarded", "--reasoning=drop"]
    assert export.main([str(out / "run"), *flags, f"--out={tmp_path / 'r'}"]) == 0
    (group,) = _read(tmp_path / "r")
    assert all("<think>" in c["messages"][-1]["content"] for c in group["completions"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: 2 exported samples (ambiguous_markup discards) kept their assistant text unsplit, "
        "<think> markup included: --reasoning=drop was not applied to them"
    ]


def test_an_exclusion_list_says_nothing_of_defaults_the_scored_formats_do_not_have(
    flip_runs, tmp_path, capsys
):
    """preference and rewards leave out no stop reason by default: --exclude_stop_reasons replaces
    nothing there, so no note about the message formats' default."""
    a, _ = flip_runs
    assert (
        export.main(
            [str(a), "--format=rewards", "--exclude_stop_reasons=max_turns", f"--out={tmp_path / 'r'}"]
        )
        == 0
    )
    assert "note:" not in capsys.readouterr().err
