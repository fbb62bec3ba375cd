"""batchrun/run/resume.py: --resume by row identity (text, image, cwd), duplicates, discards, the manifest."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import (
    OK_REPLY,
    ScriptedEndpoint,
    default_sigint,
    exit_code,
    lines_written,
    read_jsonl,
    requests,
    run,
    runner_argv,
    stats_of,
    wait_for,
    write_jsonl,
    write_rows,
)

from batchrun.identity import row_key
from batchrun.run import resume
from batchrun.secrets import Redactor
from batchrun.sharegpt import first_human
from batchrun.storage import append_jsonl

RESUME = ["alpha task", "beta task", "gamma task", "alpha task", "delta task", "epsilon task"]

PROMPT_SECRET = "ds.secret.value.777"  # an env secret that also appears inside one prompt
SECRET_PROMPT = f"Remember the code {PROMPT_SECRET} in a note"


def _checkpoint(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoint.json").read_text("utf-8"))


def test_checkpoint_lists_discarded_prompts_as_finished_and_failed_ones_not(server, tmp_path):
    """checkpoint.json's ``completed_prompts`` holds the finished prompts (SPEC), as the reference's does
    for a sample it discarded for no reasoning: a discard is finished (--resume does not pay for it again).
    It listed trajectories only, so a script reading the checkpoint saw 1 of 2 finished prompts and would
    run the discard again; the failed prompt, which --resume runs again, stays out."""
    dataset = write_jsonl(
        tmp_path / "d.jsonl", ["kept task", "thinks not [no_reasoning]", "fails [error:400]"]
    )
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=2)
    assert _checkpoint(out / "run")["completed_prompts"] == [0, 1]
    assert _checkpoint(out / "run")["batch_stats"]["0"]["discarded_no_reasoning"] == 1
    before = requests(server)
    run(
        server, dataset, out, resume=True, batch_size=2
    )  # a new invocation reads the discard back from its file
    assert requests(server) - before == {"fails [error:400]": 1}
    assert _checkpoint(out / "run")["completed_prompts"] == [0, 1]


def test_checkpoint_counts_a_discard_run_again_once_as_statistics_do(server, tmp_path):
    """A discard run again by --rerun_discarded and discarded again: batch_stats counted it in both batches
    (discarded 1 + 1, processed 2 + 1 for 2 samples) where statistics.json counts the sample once (1
    discard). A record the merge set aside (unknown_tool) counted as its batch's trajectory and discard."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["terse [no_reasoning]", "fine [calls:1]"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    run(server, dataset, out, resume=True, rerun_discarded=True)
    stats = _checkpoint(run_dir)["batch_stats"]
    assert (stats["0"]["processed"], stats["0"]["discarded"], stats["0"]["discarded_no_reasoning"]) == (
        1,
        0,
        0,
    )
    assert (stats["1"]["processed"], stats["1"]["discarded"], stats["1"]["discarded_no_reasoning"]) == (
        1,
        1,
        1,
    )
    assert sum(b["discarded"] for b in stats.values()) == stats_of(run_dir)["discarded"]["total"] == 1
    (rec,) = read_jsonl(run_dir / "batch_0.jsonl")
    rec["conversations"][2]["tool_calls"][0]["function"]["name"] = "gone_plugin_tool"
    (run_dir / "batch_0.jsonl").write_text(json.dumps(rec) + "\n", "utf-8")
    run(server, dataset, out, resume=True)  # the merge sets it aside
    assert _checkpoint(run_dir)["batch_stats"]["0"] == {
        "processed": 1,
        "skipped": 0,
        "discarded_no_reasoning": 0,
        "trajectories": 0,
        "discarded": 1,
    }


def test_checkpoint_lists_the_rows_that_finished_not_the_lines_outcomes_were_written_at(server, tmp_path):
    """Rows x, y (discarded) and z (fails); x removed: y's discard stands for y, now at line 0, and its old
    line 1 is z's, which failed again. completed_prompts listed [0, 1]: line 0 for x's record, line 1 for
    y's discard, so z (which --resume runs again) was listed finished and y was listed for x."""
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, write_jsonl(tmp_path / "d0.jsonl", ["x [calls:0]", "y [no_reasoning]", "z [error:500]"]), out)
    assert _checkpoint(run_dir)["completed_prompts"] == [0, 1]
    run(server, write_jsonl(tmp_path / "d1.jsonl", ["z [error:500]", "y [no_reasoning]"]), out, resume=True)
    assert _checkpoint(run_dir)["completed_prompts"] == [1]
    assert stats_of(run_dir)["remaining_for_resume"] == 1


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
    """A sample holding a secret is never kept (kept text is never rewritten): it is a discard
    (``secret_in_output``), redacted in discarded.jsonl, like every other file."""
    monkeypatch.setenv("DATASET_SECRET", PROMPT_SECRET)
    dataset = write_jsonl(tmp_path / "d.jsonl", [SECRET_PROMPT, f"{PROMPT_SECRET} [no_reasoning]"])
    out = tmp_path / "data"
    run(server, dataset, out)
    # the model saw it (it is the user's own prompt) and wrote it to a file; the tool result that read it
    # back held it, so the prompt ended there (a secret is never sent on in a tool result)
    assert server.stats()["requests_by_prompt"][SECRET_PROMPT] == 2
    files = [p for p in (out / "run").rglob("*") if p.is_file()]
    assert {"trajectories.jsonl", "discarded.jsonl"} <= {p.name for p in files}
    for path in files:
        assert PROMPT_SECRET.encode() not in path.read_bytes(), path.name
    assert read_jsonl(out / "run" / "trajectories.jsonl") == []
    # Both end at the tool result that holds the secret (the second before its missing reasoning counts).
    discards = {
        first_human(d["record"]["conversations"]): d for d in read_jsonl(out / "run" / "discarded.jsonl")
    }
    redacted = SECRET_PROMPT.replace(PROMPT_SECRET, "[REDACTED]")
    assert set(discards) == {redacted, "[REDACTED] [no_reasoning]"}
    assert {d["reason"] for d in discards.values()} == {"secret_in_output"}
    stats = json.loads((out / "run" / "statistics.json").read_text("utf-8"))
    assert stats["discarded"]["by_reason"] == {"secret_in_output": 2}


def test_resume_recognises_a_prompt_whose_secret_was_redacted(server, tmp_path, monkeypatch):
    monkeypatch.setenv("DATASET_SECRET", PROMPT_SECRET)
    dataset = write_jsonl(tmp_path / "d.jsonl", [SECRET_PROMPT, "plain one"])
    out = tmp_path / "data"
    run(server, dataset, out)
    total = server.stats()["requests"]
    run(server, dataset, out, resume=True)
    assert server.stats()["requests"] == total  # the secret's discard is not redone
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 1
    assert [d["reason"] for d in read_jsonl(out / "run" / "discarded.jsonl")] == ["secret_in_output"]


def test_merge_follows_numeric_batch_order(server, tmp_path):
    prompts = [f"numbered task {i}" for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"{p} [calls:0]" for p in prompts])
    out = tmp_path / "data"
    run(server, dataset, out, batch_size=1)
    nums = [r["metadata"]["batch_num"] for r in read_jsonl(out / "run" / "trajectories.jsonl")]
    assert nums == sorted(nums) == list(range(12))


def test_same_instruction_in_n_repositories_resume_runs_the_lost_row_not_its_twin(server, tmp_path):
    """Rows differ only by cwd: the one whose record is missing is the one that runs again."""
    repos = [tmp_path / "repos" / name for name in ("a", "b", "c")]
    for repo in repos:
        repo.mkdir(parents=True)
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "fix the bug", "cwd": str(r)} for r in repos])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    records = read_jsonl(run_dir / "batch_0.jsonl")
    assert sorted(r["metadata"]["cwd"] for r in records) == sorted(map(str, repos))
    for rec in records:
        meta = rec["metadata"]
        assert meta["image"] == ""  # none of its own (written "", read back as none)
        assert meta["row_key"] == row_key("fix the bug", None, meta["cwd"])

    # The record of the first row (repo a) is lost; b and c are done.
    lost = next(r for r in records if r["metadata"]["cwd"] == str(repos[0]))
    kept = [r for r in records if r is not lost]
    (run_dir / "batch_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept), "utf-8")

    before = server.stats()["requests"]
    run(server, dataset, out, resume=True)
    assert server.stats()["requests"] - before == 3  # one prompt's three model calls
    new = read_jsonl(run_dir / "batch_1.jsonl")
    assert [r["metadata"]["cwd"] for r in new] == [str(repos[0])]
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["metadata"]["cwd"] for r in merged) == sorted(map(str, repos))


def test_identical_rows_resume_runs_the_copy_whose_sample_is_missing(server, tmp_path):
    """Identical rows differ in their occurrence (the request seed, the toolset draw) and prompt_index:
    when the second copy finished and the first did not (the first failed, or the run was killed while
    it was in flight), a resume runs the first copy, not the second one again."""
    rows = [{"prompt": "Dup row [answers:A|B|C|D|E|F|G]", "answer": "A"}] * 2
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / "run"
    kw = dict(seed_per_request=True, num_workers=1)
    run(server, dataset, out, **kw)
    reference = sorted(
        (r["prompt_index"], r["conversations"][-1]["value"])
        for r in read_jsonl(run_dir / "trajectories.jsonl")
    )
    assert [i for i, _ in reference] == [0, 1] and reference[0][1] != reference[1][1]
    batch = run_dir / "batch_0.jsonl"
    batch.write_text(
        "".join(json.dumps(r) + "\n" for r in read_jsonl(batch) if r["prompt_index"] == 1), "utf-8"
    )
    run(server, dataset, out, resume=True, **kw)
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted((r["prompt_index"], r["conversations"][-1]["value"]) for r in merged) == reference
    assert stats_of(run_dir)["remaining_for_resume"] == 0


@pytest.mark.parametrize("edit", ["row_removed_above", "row_added_above"])
def test_identical_rows_that_moved_run_the_copy_that_did_not_finish(server, tmp_path, edit):
    """Identical rows differ only in their occurrence (their request seeds and toolset draw), which records
    did not save. One copy finished, the other was in flight when the run was killed; then a row above
    them was removed (or added): matched by line, the copy that had finished took its twin's place and ran
    again with its own seeds (the same conversation twice in trajectories.jsonl) while the lost copy never
    ran. Each record now says its occurrence (metadata.occurrence), so the lost copy is the one that runs:
    the same final answers as an uninterrupted run of the edited dataset."""
    dup = {"prompt": "Dup row [answers:A|B|C|D|E|F|G]"}
    intro = {"prompt": "intro row [calls:0]"}
    first, edited, lost = {
        "row_removed_above": ([intro, dup, dup], [dup, dup], 2),  # the first copy finished
        "row_added_above": ([dup, dup], [intro, dup, dup], 0),  # the second copy finished
    }[edit]
    out = tmp_path / "data"
    kw = dict(seed_per_request=True, num_workers=1)
    d1 = write_rows(tmp_path / "d1.jsonl", edited)
    run(server, d1, out, run_name="whole", **kw)

    def twins(run_name: str) -> list[str]:
        merged = read_jsonl(out / run_name / "trajectories.jsonl")
        return sorted(
            r["conversations"][-1]["value"] for r in merged if r["conversations"][1]["value"] == dup["prompt"]
        )

    whole = twins("whole")
    assert len(set(whole)) == 2
    run_dir = out / "run"
    run(server, write_rows(tmp_path / "d0.jsonl", first), out, **kw)
    batch = run_dir / "batch_0.jsonl"
    kept = [r for r in read_jsonl(batch) if r["prompt_index"] != lost]  # as a kill -9 leaves it
    batch.write_text("".join(json.dumps(r) + "\n" for r in kept), "utf-8")
    before = requests(server)[dup["prompt"]]
    run(server, d1, out, resume=True, **kw)
    assert requests(server)[dup["prompt"]] - before == 3  # one copy's three model calls
    assert twins("run") == whole
    assert stats_of(run_dir)["remaining_for_resume"] == 0
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["metadata"]["occurrence"] for r in merged) == [
        0,
        0,
        1,
    ]  # the intro row's, then the twins'
    before = requests(server)[dup["prompt"]]
    run(server, d1, out, resume=True, **kw)
    assert requests(server)[dup["prompt"]] == before  # two copies' records at one line are two samples
    assert twins("run") == whole


def test_discards_of_identical_rows_at_one_line_are_two_samples(server, tmp_path):
    """Both copies of a row discarded (no reasoning), the second one's discard lost to a kill, then the row
    above removed: the resume runs the second copy, whose discard is written at the line the first copy's
    was. Two samples, each counted (statistics.json, batch_stats, completed_prompts), as in an
    uninterrupted run of the edited dataset; not one sample discarded twice."""
    dup = {"prompt": "Dup terse [no_reasoning] [answers:A|B|C|D|E|F|G]"}
    out = tmp_path / "data"
    run_dir = out / "run"
    kw = dict(seed_per_request=True, num_workers=1)
    run(server, write_rows(tmp_path / "d0.jsonl", [{"prompt": "intro [calls:0]"}, dup, dup]), out, **kw)
    discards = run_dir / "discarded.jsonl"
    discards.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(discards) if r["prompt_index"] != 2))
    edited = write_rows(tmp_path / "d1.jsonl", [dup, dup])
    run(server, edited, out, resume=True, **kw)
    assert sorted((d["prompt_index"], d["occurrence"]) for d in read_jsonl(discards)) == [(1, 0), (1, 1)]
    stats = stats_of(run_dir)
    assert (stats["discarded"]["total"], stats["remaining_for_resume"]) == (2, 0)
    checkpoint = _checkpoint(run_dir)
    assert checkpoint["completed_prompts"] == [0, 1]
    assert sum(b["discarded"] for b in checkpoint["batch_stats"].values()) == 2
    before = requests(server)[dup["prompt"]]
    run(server, edited, out, resume=True, **kw)
    assert requests(server)[dup["prompt"]] == before


def test_records_without_their_occurrence_resume_as_before(server, tmp_path):
    """Records written before metadata.occurrence existed: matched by line, fields and content, as they
    were (the copy at the finished copy's line is taken for it); none is run twice, none is lost, and the
    merge writes them with occurrence -1 (not recorded) in trajectories.jsonl."""
    dup = {"prompt": "old twin [answers:A|B|C]"}
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, write_rows(tmp_path / "d0.jsonl", [dup, dup]), out, max_samples=1)
    batch = run_dir / "batch_0.jsonl"
    (rec,) = read_jsonl(batch)
    del rec["metadata"]["occurrence"]
    batch.write_text(json.dumps(rec) + "\n", "utf-8")
    before = requests(server)[dup["prompt"]]
    run(server, write_rows(tmp_path / "d0.jsonl", [dup, dup]), out, resume=True)
    assert requests(server)[dup["prompt"]] - before == 3  # the second copy
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted((r["prompt_index"], r["metadata"]["occurrence"]) for r in merged) == [(0, -1), (1, 1)]
    assert stats_of(run_dir)["remaining_for_resume"] == 0


@pytest.mark.parametrize("edit", ["row_removed_above", "reordered"])
def test_rows_of_one_prompt_that_moved_each_keep_their_own_sample(server, tmp_path, edit):
    """Rows with one prompt but their own ``id`` / ``answer`` (one question of several sets) are one
    identity; resume matched their outcomes to rows by line, then by content. After a row above them
    was removed (every line moved up one), each row took its upper neighbour's outcome: q0 ran a second
    time and q2 never ran (trajectories.jsonl: q0 twice, q2 missing; 2 paid samples of the wrong row).
    Reordered, the same: the sample of the row that did not finish was never run."""
    q = "What is 2+2? [answers:3|4|5|6|7]"
    rows = [{"prompt": q, "id": f"q{i}", "answer": str(3 + i)} for i in range(4)]
    first = [{"prompt": "intro [calls:0]", "id": "x"}, *rows]
    out = tmp_path / "data"
    run_dir = out / "run"
    if edit == "row_removed_above":
        run(server, write_rows(tmp_path / "d0.jsonl", first), out, max_samples=3)  # x, q0, q1
        edited = rows
    else:
        run(server, write_rows(tmp_path / "d0.jsonl", rows), out, max_samples=2)  # q0, q1
        edited = rows[::-1]
    before = requests(server)[q]
    run(server, write_rows(tmp_path / "d1.jsonl", edited), out, resume=True)
    assert requests(server)[q] - before == 2 * 3  # q2 and q3, three model calls each
    ids = collections.Counter(
        r["metadata"]["row_id"]
        for r in read_jsonl(run_dir / "trajectories.jsonl")
        if first_human(r["conversations"]) == q
    )
    assert ids == {"q0": 1, "q1": 1, "q2": 1, "q3": 1}
    assert stats_of(run_dir)["remaining_for_resume"] == 0
    before = requests(server)[q]
    run(server, write_rows(tmp_path / "d1.jsonl", edited), out, resume=True)
    assert requests(server)[q] == before  # two lines' outcomes at one line number are not one sample redone


def test_merge_keeps_the_sample_of_the_row_still_there_not_its_edited_twins(server, tmp_path):
    """Two rows of one prompt (ids 1 and 2), both finished; the user then edits row 2's prompt. The
    dataset wants one sample of the old prompt: the merge kept the first record in file order, row 2's
    (it finished first), and dropped row 1's: trajectories.jsonl held row 2 twice (old and new prompt)
    and row 1 not at all, its score left out of the pass rate."""
    p = "What is 2+2? [answers:4]"
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, write_rows(tmp_path / "d0.jsonl", [{"prompt": p, "id": 2, "answer": "4"}]), out)
    both = [{"prompt": p, "id": 1, "answer": "4"}, {"prompt": p, "id": 2, "answer": "4"}]
    run(server, write_rows(tmp_path / "d1.jsonl", both), out, resume=True)  # row 1 runs, after row 2
    edited = [both[0], {"prompt": "What is 3+3? [answers:6]", "id": 2, "answer": "6"}]
    run(server, write_rows(tmp_path / "d2.jsonl", edited), out, resume=True)
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted((first_human(r["conversations"]), r["metadata"]["row_id"]) for r in merged) == [
        (p, "1"),
        ("What is 3+3? [answers:6]", "2"),
    ]
    stats = stats_of(run_dir)
    assert stats["dropped_at_merge"]["duplicate"] == 1
    assert stats["remaining_for_resume"] == 0


def test_trajectories_of_rows_the_dataset_no_longer_has_are_kept_and_said(server, tmp_path, capsys):
    """A row's prompt edited, then --samples_per_prompt lowered: the old prompt's sample and the second
    samples stay in trajectories.jsonl as they are (7, then 13 records for a dataset of 6 rows), and
    nothing said so: statistics.json's trajectories equalled neither dataset_prompts nor dataset_samples."""
    rows = [f"row {i} [calls:0]" for i in range(6)]
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, write_jsonl(tmp_path / "d0.jsonl", rows), out)
    rows[2] = "row 2 edited [calls:0]"
    edited = write_jsonl(tmp_path / "d1.jsonl", rows)
    capsys.readouterr()
    run(server, edited, out, resume=True)
    stats = stats_of(run_dir)
    assert (stats["trajectories"], stats["dataset_samples"], stats["trajectories_not_in_dataset"]) == (
        7,
        6,
        1,
    )
    assert "Kept as they are: 1 of the trajectories" in capsys.readouterr().out
    run(server, edited, out, resume=True, samples_per_prompt=2)
    run(server, edited, out, resume=True, samples_per_prompt=1)
    stats = stats_of(run_dir)
    assert (stats["trajectories"], stats["dataset_samples"], stats["trajectories_not_in_dataset"]) == (
        13,
        6,
        7,
    )
    run(server, edited, out, resume=True, samples_per_prompt=1, exclude_partial=True)
    assert stats_of(run_dir)["trajectories_not_in_dataset"] == 7  # none is partial


def test_a_record_the_merge_set_aside_does_not_stand_for_its_identical_twin(server, tmp_path):
    """A record calling a tool no longer known stays in its batch file and is set aside in discarded.jsonl:
    one outcome of one line, counted once, so its identical twin's sample still runs. The set-aside row
    names the row's fields as every discard does (read from its record where it was written without)."""
    twin = "twin row [calls:1]"
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": twin, "id": 7}] * 2)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, max_samples=1)
    (rec,) = read_jsonl(run_dir / "batch_0.jsonl")
    rec["conversations"][2]["tool_calls"][0]["function"]["name"] = "gone_plugin_tool"
    (run_dir / "batch_0.jsonl").write_text(json.dumps(rec) + "\n", "utf-8")
    run(server, dataset, out, max_samples=1, resume=True)  # the merge sets it aside
    (aside,) = read_jsonl(run_dir / "discarded.jsonl")
    assert (aside["reason"], aside["row_id"], aside["row_fields"]) == ("unknown_tool", "7", '{"id": 7}')
    before = requests(server)[twin]
    run(server, dataset, out, resume=True)
    assert requests(server)[twin] - before == 2  # the second copy ran
    assert sorted(r["prompt_index"] for r in read_jsonl(run_dir / "trajectories.jsonl")) == [1]
    assert stats_of(run_dir)["remaining_for_resume"] == 0


def test_a_sample_redone_by_rerun_discarded_does_not_stand_for_its_identical_twin(server, tmp_path, capsys):
    """--rerun_discarded runs a discarded sample again and, discarded again, it has two lines in
    discarded.jsonl: both are outcomes of one dataset line's one sample. Counted as two, they made the
    identical row's sample, which never ran, finished: a resume never ran it (0 to run)."""
    twin = "terse twin [no_reasoning]"
    dataset = write_jsonl(tmp_path / "d.jsonl", [twin, twin])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, max_samples=1)  # the first copy only: discarded (no reasoning)
    run(server, dataset, out, max_samples=1, resume=True, rerun_discarded=True)  # discarded again
    assert [d["prompt_index"] for d in read_jsonl(run_dir / "discarded.jsonl")] == [0, 0]
    before = requests(server)
    capsys.readouterr()
    run(server, dataset, out, resume=True)
    assert "1 prompt(s) already finished, 1 to run" in capsys.readouterr().out
    assert requests(server) - before == {twin: 3}  # the second copy runs (three model calls)
    assert sorted(d["prompt_index"] for d in read_jsonl(run_dir / "discarded.jsonl")) == [0, 0, 1]
    assert stats_of(run_dir)["remaining_for_resume"] == 0


@pytest.mark.slow
def test_an_interrupted_rerun_of_discards_says_what_each_command_does_with_those_not_run_again(
    server, tmp_path
):
    """A --rerun_discarded resume interrupted (Ctrl-C) after it ran 2 of its 4 discards again: the 2 it
    did not reach keep their discards, so the resume command it printed (without the flag, which would
    pay for the 2 again) runs nothing and leaves them as they are, and --rerun_discarded again runs all
    4. It exited 130 saying neither: remaining_for_resume 0, no command, nothing in statistics.json.
    Now it says how many did not run again and what each command does with them; --rerun_discarded
    continues the round: the 2 it did not reach run, the 2 it ran again do not (they were paid twice)."""
    rows = [f"terse {i} [no_reasoning] [slow:1]" for i in range(4)]
    dataset = write_jsonl(tmp_path / "d.jsonl", [*rows, "fine [calls:0]"])
    out = tmp_path / "data"
    run_dir = out / "run"
    argv = runner_argv(
        dataset, out, server, "--prompts_per_worker=1", "--batch_size=8", "--max_failure_rate=1"
    )
    subprocess.run(argv, check=True, capture_output=True)
    assert lines_written(run_dir / "discarded.jsonl") == 4
    proc = subprocess.Popen(
        [*argv, "--resume", "--rerun_discarded"],
        preexec_fn=default_sigint,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: lines_written(run_dir / "discarded.jsonl") >= 6, 60)  # 2 run again, a third under way
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output[-2000:]
    assert (
        "--rerun_discarded: 2 of the 4 discarded sample(s) this run was to run again (round 1) did not run"
        in output
    )
    said = output.split("--rerun_discarded: 2 of the 4", 1)[1].splitlines()
    assert said[1].endswith("--resume") and "leaves them discarded" in said[2]
    assert said[3].endswith("--resume --rerun_discarded")
    assert "continues round 1: runs only them, not again those the round ran again already" in said[4]
    stats = stats_of(run_dir)
    assert stats["this_run"]["rerun_discarded"] == {
        "round": 1,
        "continued": False,
        "to_rerun": 4,
        "kept": 0,
        "discarded_again": 2,
        "not_rerun": 2,
        "finished": False,
    }
    assert stats["remaining_for_resume"] == 0
    assert _checkpoint(run_dir)["rerun_round"] == {"round": 1, "finished": False}
    # Continued by the same command, the round runs the 2 it did not reach, once each (it ran all 4 again,
    # 2 of them for the second time in the round: today's files could not tell an interrupted round from
    # a finished one), and it is finished: a --rerun_discarded after it starts round 2, which runs all 4
    # again, as a user who wants another try asks.
    before = requests(server)
    subprocess.run([*argv, "--resume", "--rerun_discarded"], check=True, capture_output=True)
    ran = requests(server) - before
    discards = collections.Counter(d["prompt_index"] for d in read_jsonl(run_dir / "discarded.jsonl"))
    assert discards == {0: 2, 1: 2, 2: 2, 3: 2}  # each discard run again once in the round
    assert len(ran) == 2 and set(ran) < set(rows) and len(set(ran.values())) == 1
    stats = stats_of(run_dir)
    assert stats["this_run"]["rerun_discarded"] == {
        "round": 1,
        "continued": True,
        "to_rerun": 2,
        "kept": 0,
        "discarded_again": 2,
        "not_rerun": 0,
        "finished": True,
    }
    assert [d.get("rerun_round") for d in read_jsonl(run_dir / "discarded.jsonl")] == [None] * 4 + [1] * 4
    assert _checkpoint(run_dir)["rerun_round"] == {"round": 1, "finished": True}
    # A plain resume carries the round on; the next --rerun_discarded starts round 2: every discard.
    subprocess.run([*argv, "--resume"], check=True, capture_output=True)
    assert _checkpoint(run_dir)["rerun_round"] == {"round": 1, "finished": True}
    before = requests(server)
    subprocess.run([*argv, "--resume", "--rerun_discarded"], check=True, capture_output=True)
    assert requests(server) - before == {row: ran[next(iter(ran))] for row in rows}
    assert stats_of(run_dir)["this_run"]["rerun_discarded"]["round"] == 2
    assert [d.get("rerun_round") for d in read_jsonl(run_dir / "discarded.jsonl")][8:] == [2] * 4


def test_discards_of_no_round_are_run_again_by_the_first_round_and_each_finished_round_starts_another(
    server, tmp_path
):
    """Discards written before rounds existed (no rerun_round, a checkpoint without one) are discards of
    no round: the first --rerun_discarded starts round 1 and runs each again, as before; finished, the
    next starts round 2 and runs each again once more. A round started with a checkpoint lost or damaged
    numbers itself after the rounds its discards name."""
    terse = ["terse a [no_reasoning]", "terse b [no_reasoning]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", [*terse, "fine [calls:0]"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    assert "rerun_round" not in _checkpoint(run_dir)
    for n in (1, 2):
        before = requests(server)
        run(server, dataset, out, resume=True, rerun_discarded=True)
        assert requests(server) - before == {t: 3 for t in terse}  # three model calls each
        rerun = stats_of(run_dir)["this_run"]["rerun_discarded"]
        assert (rerun["round"], rerun["continued"], rerun["to_rerun"], rerun["finished"]) == (
            n,
            False,
            2,
            True,
        )
        assert _checkpoint(run_dir)["rerun_round"] == {"round": n, "finished": True}
    (run_dir / "checkpoint.json").write_text("{damaged", "utf-8")
    run(server, dataset, out, resume=True, rerun_discarded=True)
    assert stats_of(run_dir)["this_run"]["rerun_discarded"]["round"] == 3
    assert [d.get("rerun_round") for d in read_jsonl(run_dir / "discarded.jsonl")] == [None] * 2 + [
        1,
        1,
        2,
        2,
        3,
        3,
    ]


def test_a_discard_whose_rerun_failed_keeps_the_round_open_and_the_round_continued_runs_it_alone(tmp_path):
    """A failure is no outcome of a rerun round (it says nothing of the sample, and --resume runs
    failures again): the round whose rerun of one discard failed stays open, and --rerun_discarded
    continues it, running that one alone, not the discard the round already ran again."""
    phase = {"fail": None}

    def answer(call: dict, calls: list[dict]):
        prompt = json.dumps((call["body"] or {}).get("messages", []))
        if phase["fail"] and phase["fail"] in prompt and not call["check"]:
            return 400, {"error": {"message": "refused", "type": "invalid_request_error"}}
        return 200, OK_REPLY  # no reasoning: discarded

    dataset = write_jsonl(tmp_path / "d.jsonl", ["alpha task", "beta task"])
    out = tmp_path / "data"
    run_dir = out / "run"
    with ScriptedEndpoint(answer, get=(200, {"data": []})) as endpoint:
        flags = dict(model="m", base_url=endpoint.base_url, api_key="sk-local-test")

        def ran() -> collections.Counter:
            """Prompt calls so far, by the row's prompt (the start check left out)."""
            return collections.Counter(
                name
                for c in endpoint.calls
                if not c["check"]
                for name in ("alpha", "beta")
                if name in json.dumps((c["body"] or {}).get("messages", []))
            )

        run(None, dataset, out, **flags)
        assert [d["reason"] for d in read_jsonl(run_dir / "discarded.jsonl")] == ["no_reasoning"] * 2
        phase["fail"] = "beta task"
        run(None, dataset, out, resume=True, rerun_discarded=True, **flags)
        rerun = stats_of(run_dir)["this_run"]["rerun_discarded"]
        assert (rerun["round"], rerun["discarded_again"], rerun["not_rerun"], rerun["finished"]) == (
            1,
            1,
            1,
            False,
        )
        assert _checkpoint(run_dir)["rerun_round"] == {"round": 1, "finished": False}
        phase["fail"], before = None, ran()
        run(None, dataset, out, resume=True, rerun_discarded=True, **flags)
        assert set(ran() - before) == {"beta"}  # alpha's discard the round ran again already
        rerun = stats_of(run_dir)["this_run"]["rerun_discarded"]
        assert (rerun["round"], rerun["continued"], rerun["to_rerun"], rerun["finished"]) == (
            1,
            True,
            1,
            True,
        )
    written = [(d["prompt_index"], d.get("rerun_round")) for d in read_jsonl(run_dir / "discarded.jsonl")]
    # the first run's two discards in the order its prompts ended; then the round's, alpha's before beta's
    assert sorted(written[:2]) == [(0, None), (1, None)] and written[2:] == [(0, 1), (1, 1)]


def test_a_resume_that_reran_its_discards_leaves_none_of_them_pending(server, tmp_path, capsys, monkeypatch):
    """A --rerun_discarded resume whose samples were discarded again: they have their outcome. They were
    counted as left to run (remaining_for_resume 1, scores.samples_pending 1, samples_planned 3 of the 2
    the dataset wants) and the closing summary offered a command, --rerun_discarded still in it, that
    paid for them once more, and said the same again after it."""
    terse, fine = "terse [no_reasoning]", "fine"
    dataset = write_jsonl(tmp_path / "d.jsonl", [terse, fine, "flaky [error:500]"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, max_samples=2)
    argv = [f"--dataset_file={dataset}", "--batch_size=4", "--run_name=run", "--rerun_discarded", "--resume"]
    monkeypatch.setattr(resume, "COMMAND_LINE", argv)  # as batchrun.cli.cli sets it for the command line
    capsys.readouterr()
    run(server, dataset, out, max_samples=2, resume=True, rerun_discarded=True)  # discarded again
    assert "remain; continue with" not in capsys.readouterr().out
    stats = stats_of(run_dir)
    assert stats["remaining_for_resume"] == 0
    assert stats["scores"]["samples_pending"] == 0
    # Rows with nothing to judge them by: unscored, outside the planned figure (which once counted them).
    assert (stats["scores"]["unscored"], stats["scores"]["samples_planned"]) == (2, 0)
    before = requests(server)
    run(server, dataset, out, max_samples=2, resume=True)
    assert requests(server) == before  # nothing was left to run
    # With a failure left, the command offered runs that alone, not every discard again.
    run(server, dataset, out, resume=True, rerun_discarded=True)
    summary = capsys.readouterr().out
    assert stats_of(run_dir)["remaining_for_resume"] == 1
    assert "1 prompt(s) remain; continue with:" in summary
    command = summary.split("continue with:")[1].splitlines()[1]
    assert "--rerun_discarded" not in command and command.endswith(" --resume")


@pytest.mark.docker
def test_same_instruction_in_two_images_resume_runs_exactly_the_failed_row(
    server, tmp_path, docker_test_image, capsys
):
    """The row whose image is missing fails (first in the dataset); its twin in a good image succeeds.
    A resume runs the failed row only: no model call for the finished twin."""
    run_name = f"ident-{os.getpid()}"
    missing = "127.0.0.1:9/batch-runner-missing:never"  # a registry on loopback that refuses at once
    rows = [
        {"prompt": "fix the bug", "image": missing},
        {"prompt": "fix the bug", "image": docker_test_image},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / run_name
    kw = dict(run_name=run_name, sandbox="docker", default_image=docker_test_image, num_workers=1)
    run(server, dataset, out, **kw)
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert (failed["error_class"], failed["image"]) == ("preflight", missing)
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["metadata"]["image"] == docker_test_image
    calls = server.stats()["requests"]
    capsys.readouterr()
    run(server, dataset, out, resume=True, **kw)
    assert "1 prompt(s) already finished, 1 to run" in capsys.readouterr().out
    assert server.stats()["requests"] == calls  # the twin did not run again (the failed row makes no call)
    assert [r["image"] for r in read_jsonl(run_dir / "failed.jsonl")] == [missing, missing]
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 1


def test_merge_keeps_one_record_per_identity_and_counts_duplicates_per_identity(server, tmp_path):
    repo_a, repo_b = tmp_path / "a", tmp_path / "b"
    repo_a.mkdir(), repo_b.mkdir()
    rows = [
        {"prompt": "same words", "cwd": str(repo_a)},
        {"prompt": "same words", "cwd": str(repo_b)},
        {"prompt": "same words", "cwd": str(repo_b)},  # an intentional duplicate of the row above
        {"prompt": "same words"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 4
    # An extra copy of repo a's record (say, from a crashed earlier attempt) is dropped at merge.
    batch = run_dir / "batch_0.jsonl"
    extra = next(r for r in read_jsonl(batch) if r["metadata"]["cwd"] == str(repo_a))
    with batch.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(extra) + "\n")
    before = server.stats()["requests"]
    run(server, dataset, out, resume=True)
    assert server.stats()["requests"] == before
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert collections.Counter(r["metadata"]["cwd"] for r in merged) == {
        str(repo_a): 1,
        str(repo_b): 2,
        "": 1,
    }
    assert stats_of(run_dir)["dropped_at_merge"]["duplicate"] == 1


def test_failed_and_discarded_rows_carry_the_identity(server, tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    rows = [
        {"prompt": "down [error:500]", "cwd": str(repo)},
        {"prompt": "down [error:500]"},
        {"prompt": "terse [no_reasoning]", "image": "some/image:1"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert sorted((r["cwd"] or "") for r in failed) == ["", str(repo)]
    assert all(r["row_key"] == row_key(r["prompt"], r["image"], r["cwd"]) for r in failed)
    (discard,) = read_jsonl(run_dir / "discarded.jsonl")
    assert (discard["image"], discard["cwd"]) == ("some/image:1", None)
    assert discard["record"]["metadata"]["image"] == "some/image:1"
    before = collections.Counter(server.stats()["requests_by_prompt"])
    run(server, dataset, out, resume=True)
    new = collections.Counter(server.stats()["requests_by_prompt"]) - before
    assert set(new) == {"down [error:500]"}  # both failed rows again, the discard not
    assert len(read_jsonl(run_dir / "failed.jsonl")) == 4


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_manifest.json").read_text("utf-8"))


def test_resume_refuses_changed_data_settings_and_forced_keeps_a_history(server, tmp_path, capsys):
    secret_prompt = "SYSTEM-SECRET marker-9d2e: answer in French"
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing", "two things"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, ephemeral_system_prompt=secret_prompt)
    first = _manifest(run_dir)
    for key in ("sandbox", "keep_no_reasoning", "ephemeral_system_prompt_sha256", "prefill_sha256"):
        assert key in first
    assert first["keep_no_reasoning"] is False and first["prefill_sha256"] is None
    assert "marker-9d2e" not in (run_dir / "run_manifest.json").read_text("utf-8")

    prefill = tmp_path / "prefill.json"
    prefill.write_text(json.dumps([{"role": "user", "content": "PREFILL marker-77aa example"}]), "utf-8")
    changes = [
        {"keep_no_reasoning": True},
        {"ephemeral_system_prompt": "another system prompt entirely"},
        {"ephemeral_system_prompt": None},
        {"prefill_messages_file": str(prefill)},
    ]
    for change in changes:
        capsys.readouterr()
        kw = {"ephemeral_system_prompt": secret_prompt, **change}
        assert exit_code(server, dataset, out, resume=True, **kw) == 2
        err = capsys.readouterr().err
        assert "would mix two datasets" in err
        assert "marker-9d2e" not in err and "marker-77aa" not in err
    assert _manifest(run_dir) == first

    capsys.readouterr()
    run(server, dataset, out, resume=True, keep_no_reasoning=True, force_resume=True)
    after = _manifest(run_dir)
    assert after["keep_no_reasoning"] is True and after["ephemeral_system_prompt_sha256"] is None
    (entry,) = after["history"]
    assert entry["settings"]["keep_no_reasoning"] is False
    assert entry["settings"]["ephemeral_system_prompt_sha256"] == first["ephemeral_system_prompt_sha256"]
    assert entry["replaced_at"]
    # The next resume compares with the latest settings and keeps the history.
    run(server, dataset, out, resume=True, keep_no_reasoning=True)
    assert _manifest(run_dir)["history"] == after["history"]


def test_a_manifest_of_an_older_version_still_resumes(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    old = _manifest(run_dir)
    for key in ("keep_no_reasoning", "ephemeral_system_prompt_sha256", "prefill_sha256"):
        del old[key]
    (run_dir / "run_manifest.json").write_text(json.dumps(old), "utf-8")
    run(server, dataset, out, resume=True)
    assert _manifest(run_dir)["keep_no_reasoning"] is False


@pytest.mark.parametrize("content", ["null", "[1]", "{not json"])
def test_a_damaged_manifest_stops_the_resume_with_exit_2(server, tmp_path, capsys, content):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    out = tmp_path / "data"
    run(server, dataset, out)
    (out / "run" / "run_manifest.json").write_text(content, "utf-8")
    capsys.readouterr()
    assert exit_code(server, dataset, out, resume=True) == 2
    assert "the resume cannot check its settings" in capsys.readouterr().err


def test_resume_of_a_name_that_holds_no_run_says_so_and_names_close_runs(server, tmp_path, capsys):
    """Scripts pass --resume every time ("run or continue"): a mistyped name is not refused, but said,
    with the runs of a close name, before a second run pays for the same prompts."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one", "two"])
    out = tmp_path / "data"
    run(server, dataset, out, run_name="my_run")
    capsys.readouterr()
    run(server, dataset, out, run_name="my_rnu", resume=True)
    err = capsys.readouterr().err
    assert f"--resume: {out / 'my_rnu'} holds no run yet (runs with a close name there: my_run)" in err, err
    run(server, dataset, out, run_name="my_rnu", resume=True)  # now it holds one: nothing said
    assert "holds no run" not in capsys.readouterr().err
    run(server, dataset, out, run_name="other", resume=True)
    assert "holds no run yet; starting it" in capsys.readouterr().err


def test_the_refusal_of_changed_settings_suggests_only_flags_that_exist(server, tmp_path, capsys):
    """The refusal named a flag for every changed setting, derived ones too: --distribution_probabilities=
    '{...}' (no such flag: pasted back, exit 2 "unknown flag") beside --distribution, or alone when a
    --distribution_file's numbers were edited."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one [calls:0]"])
    dists = tmp_path / "dists.json"
    dists.write_text(json.dumps({"mine": {"probabilities": {"terminal": 50}}}), "utf-8")
    out = tmp_path / "data"
    run(server, dataset, out, distribution="mine", distribution_file=str(dists))
    for kw in ({"distribution": "terminal_only"}, {"distribution": "mine", "distribution_file": str(dists)}):
        if "distribution_file" in kw:
            dists.write_text(json.dumps({"mine": {"probabilities": {"terminal": 90}}}), "utf-8")
        capsys.readouterr()
        assert exit_code(server, dataset, out, resume=True, **kw) == 2
        err = capsys.readouterr().err
        original = err.split("resume with the original settings (", 1)[1]
        assert "--distribution_probabilities" not in original
        if "distribution_file" in kw:
            assert "--distribution_file as it was" in original
        else:
            assert original.startswith("--distribution=mine)")


def test_outcomes_held_as_bits_at_their_own_places_match_as_the_places_do():
    """The merge holds a record at its row's own place (its line, fields and occurrence) as one bit
    (``own``), not as a place in ``done`` and ``done_at``: every sample must take and leave what it takes
    and leaves from the places themselves, in the same order, for duplicate rows, moved lines, edited
    fields, outcomes without an occurrence and discards beside a record at one place. Randomised."""
    from batchrun.run.dataset import Row
    from batchrun.run.resume import (
        OwnPlaces,
        fields_digest,
        match_outcomes,
        own_place,
        own_position,
    )
    from batchrun.secrets import Redactor

    redact = Redactor("sk-secret-xyz")
    texts = ["{}", '{"id": "a"}', '{"id": "b"}']
    taken_by_place = 0
    for trial in range(400):
        rng = random.Random(trial)
        seen: collections.Counter[str] = collections.Counter()
        rows = []
        n = rng.randint(1, 8)
        lines = sorted(rng.sample(range(n + 4), n))
        for i in range(n):
            prompt = f"p{rng.randint(0, 2)}"
            fields = rng.choice([None, *texts[1:]])
            rows.append(
                Row(lines[i], prompt, None, None, seen[prompt], fields, samples=rng.choice([None, 2]))
            )
            seen[prompt] += 1
        spp = rng.choice([1, 2])
        done: collections.Counter = collections.Counter()
        at: collections.Counter = collections.Counter()
        for _ in range(rng.randint(0, 12)):
            row = rng.choice(rows)
            key, s = row.saved_key(redact), rng.randint(0, 1)
            line = row.index if rng.random() < 0.8 else rng.randint(0, n + 4)
            fields = fields_digest(redact(rng.choice([row.row_fields or "{}", *texts])))
            done[key, s] += 1
            at[key, s, line, fields, rng.choice([row.occurrence, row.occurrence, None, 0])] += 1
        whole = match_outcomes(rows, done, redact, spp, at)
        taken_by_place += sum(place is not None for place in whole.taken.values())
        # As the merge holds them: a bit for the records at their own places, the rest counted, and
        # now and then a discard at one of those places beside its record (add_discards counts it).
        own = OwnPlaces(rows, spp, redact)
        split_done, split_at = collections.Counter(done), collections.Counter()
        for place, count in at.items():
            p = own_position(place, own.by_line, redact, spp)
            if p is None or rng.random() < 0.3:
                split_at[place] += count
                continue
            own.bits.set(p, place[1])
            split_done[place[:2]] -= count
            if rng.random() < 0.3:
                split_done[place[:2]] += 1
                split_at[place] += 1
        split = match_outcomes(rows, split_done, redact, spp, split_at, consume=True, own=own)
        assert [(r.index, s) for r, s in split.left] == [(r.index, s) for r, s in whole.left], trial
        # A sample given its own place by its bit is in no ``taken`` (nothing there to compare).
        position = {row.index: p for p, row in enumerate(rows)}
        by_bit = {(i, s): place for (i, s), place in whole.taken.items() if own.bits[position[i], s]}
        assert all(place == own_place(rows[position[i]], s, redact) for (i, s), place in by_bit.items())
        assert list(split.taken.items()) == [item for item in whole.taken.items() if item[0] not in by_bit]
        assert split.spare == whole.spare, trial
        bare = match_outcomes(rows, done, redact, spp, at, with_places=False)
        assert [(r.index, s) for r, s in bare.left] == [(r.index, s) for r, s in whole.left], trial
        assert not bare.taken and not bare.spare
    assert taken_by_place > 400  # the places did the matching, not content alone


def test_the_resume_scan_holds_a_bit_for_each_record_at_its_rows_own_place(tmp_path):
    """The resume's scan counted every record in three tables (its sample, its place, the fields it was
    judged with: ~450 bytes a record, 100,000 at issue 5's scale); a record at its row's own place is a
    bit of ``own`` instead, and what the resume runs is the same: here nothing, then the row moved."""
    from batchrun.run.dataset import load_dataset
    from batchrun.run.resume import OwnPlaces, resume_filter, scan_finished
    from batchrun.secrets import Redactor

    prompts = [f"Task {i} [calls:0]" for i in range(12)] + ["Task 3 [calls:0]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(None, dataset, tmp_path / "out", "r", num_workers=1)
    run_dir = tmp_path / "out" / "r"
    rows, _ = load_dataset(str(dataset))
    redact = Redactor(None)
    own = OwnPlaces(rows, 1, redact)
    at: collections.Counter = collections.Counter()
    checks: dict = {}
    done = scan_finished(run_dir, rerun_discarded=False, at=at, checks=checks, own=own)
    assert not done and not at and not checks
    assert all(own.bits[p, 0] for p in range(len(rows)))
    assert resume_filter(rows, run_dir, redact, rerun_discarded=False) == []
    # Two rows swapped: their records are at other lines now, counted by place, and matched all the same.
    moved = [prompts[1], prompts[0], *prompts[2:]]
    rows, _ = load_dataset(str(write_jsonl(tmp_path / "d.jsonl", moved)))
    own = OwnPlaces(rows, 1, redact)
    done = scan_finished(run_dir, rerun_discarded=False, at=collections.Counter(), own=own)
    assert sum(done.values()) == 2 and not own.bits[0, 0] and own.bits[2, 0]
    assert resume_filter(rows, run_dir, redact, rerun_discarded=False) == []
