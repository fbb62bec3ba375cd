"""Several samples per row (--samples_per_prompt, a row's ``samples``) and the sampling parameters
(--temperature, --top_p, --seed_per_request): what the endpoint received, each sample exactly once
through interruptions and resumes, the manifest."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ROOT, exit_code, read_jsonl, run, runner_argv, stats_of, write_jsonl, write_rows

from batchrun.config import RunConfig, UsageError
from batchrun.distributions import get_distribution, prompt_rng, sample_toolsets_from_distribution
from batchrun.fakes.fake_model import FakeModelServer, find_prompt
from batchrun.identity import record_sample
from batchrun.identity import toolset_rng as sample_rng
from batchrun.prompt.tools.catalog import available_toolsets
from batchrun.record import valid_record
from batchrun.run.dataset import load_dataset
from batchrun.run.plan import make_plan
from batchrun.run.resume import all_samples
from batchrun.sharegpt import first_human
from batchrun.storage import batch_files


def _samples(run_dir: Path) -> collections.Counter:
    """(prompt, sample_index) -> records in trajectories.jsonl."""
    return collections.Counter(
        (first_human(r["conversations"]), r["metadata"].get("sample_index", 0))  # older records: 0
        for r in read_jsonl(run_dir / "trajectories.jsonl")
    )


def _batch_trajectories(run_dir: Path) -> collections.Counter:
    """(row identity, sample_index) -> trajectories in every batch file: a sample run twice shows here."""
    found: collections.Counter = collections.Counter()
    for _, path in batch_files(run_dir):
        for rec in read_jsonl(path):
            if valid_record(rec):
                found[record_sample(rec)] += 1
    return found


# ----------------------------------------------------------------------------- the plan


def test_each_sample_draws_its_own_toolsets_and_batches_are_full(tmp_path):
    prompts = [f"task number {i}" for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    rows, _ = load_dataset(str(dataset))
    config = RunConfig.from_flags(
        dataset_file=str(dataset),
        batch_size=5,
        run_name="p",
        output_dir=str(tmp_path / "data"),
        distribution="balanced",
        seed=7,
        samples_per_prompt=4,
    )
    plan = make_plan(all_samples(rows, 4), config, tmp_path / "none")
    jobs = [j for b in plan.batches for j in b]
    assert len(jobs) == 48
    assert collections.Counter((j.prompt_index, j.sample_index) for j in jobs) == {
        (i, s): 1 for i in range(12) for s in range(4)
    }
    assert [len(b) for b in plan.batches] == [5] * 9 + [3]  # batches are full, whatever rows they span
    # Sample-major: every row's sample 0 comes before any sample 1.
    assert [j.sample_index for j in jobs] == sorted(j.sample_index for j in jobs)
    # Sample 0 draws what a run without samples drew; later samples draw on their own, reproducibly.
    available = available_toolsets()

    def drawn(rng) -> list[str]:
        missing: list[str] = []
        usable = sample_toolsets_from_distribution("balanced", rng, available, missing)
        return [t for t in get_distribution("balanced").probabilities if t in usable or t in missing]

    for job in jobs:
        row = rows[job.prompt_index]
        assert list(job.toolsets_sampled) == drawn(sample_rng(7, row, job.sample_index))
        if job.sample_index == 0:
            assert list(job.toolsets_sampled) == drawn(prompt_rng(7, row.prompt))
    draws = collections.defaultdict(set)
    for job in jobs:
        draws[job.prompt_index].add(job.toolsets_sampled)
    assert sum(len(d) > 1 for d in draws.values()) >= 9  # balanced: 2^7 outcomes, 4 draws per row
    again = make_plan(all_samples(rows, 4), config, tmp_path / "none")
    assert [j.toolsets_sampled for b in again.batches for j in b] == [j.toolsets_sampled for j in jobs]


# ----------------------------------------------------------------------------- runs


ROWS = [
    {"prompt": "alpha task"},
    {"prompt": "beta task"},
    {"prompt": "beta task"},  # a duplicate row: it wants its own samples
    {"prompt": "gamma task", "samples": 1},
]
WANTED = (
    {("alpha task", s): 1 for s in range(3)}
    | {("beta task", s): 2 for s in range(3)}
    | {("gamma task", 0): 1}
)


def test_samples_per_prompt_gives_every_sample_its_own_record(server, tmp_path):
    dataset = write_rows(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "data"
    run(server, dataset, out, samples_per_prompt=3)
    run_dir = out / "run"
    assert _samples(run_dir) == WANTED
    assert server.stats()["requests_by_prompt"] == {"alpha task": 9, "beta task": 18, "gamma task": 3}
    recs = read_jsonl(run_dir / "trajectories.jsonl")
    assert all(r["completed"] and r["api_calls"] == 3 for r in recs)
    # Two samples of one row are two rows' worth of work in every file: one row_key per row, not per sample.
    assert len({r["metadata"]["row_key"] for r in recs}) == 3
    stats = stats_of(run_dir)
    assert (
        stats["dataset_prompts"] == 4 and stats["dataset_samples"] == 10 and stats["samples_per_prompt"] == 3
    )
    assert stats["trajectories"] == 10 and stats["remaining_for_resume"] == 0


def test_a_budget_stop_then_resume_runs_each_sample_exactly_once(server, tmp_path, capsys):
    dataset = write_rows(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "data"
    run_dir = out / "run"
    one_at_a_time = dict(num_workers=1, prompts_per_worker=1, batch_size=3, samples_per_prompt=3)
    run(server, dataset, out, budget_tokens=12_000, **one_at_a_time)  # about three samples' worth
    first = _samples(run_dir)
    assert 0 < sum(first.values()) < 10
    assert stats_of(run_dir)["remaining_for_resume"] == 10 - sum(first.values())

    capsys.readouterr()
    run(server, dataset, out, resume=True, **one_at_a_time)
    assert f"{sum(first.values())} sample(s) already finished, {10 - sum(first.values())} to run" in (
        capsys.readouterr().out
    )
    assert _samples(run_dir) == WANTED
    # No sample ran to the end twice: the batch files hold one trajectory per wanted sample.
    assert sum(_batch_trajectories(run_dir).values()) == 10
    assert stats_of(run_dir)["remaining_for_resume"] == 0

    # A lost record: only that sample runs again, with its own sample index.
    batch = run_dir / "batch_0.jsonl"
    lines = batch.read_text("utf-8").splitlines(keepends=True)
    lost = json.loads(lines[0])
    batch.write_text("".join(lines[1:]), "utf-8")
    before = collections.Counter(server.stats()["requests_by_prompt"])
    run(server, dataset, out, resume=True, **one_at_a_time)
    assert collections.Counter(server.stats()["requests_by_prompt"]) - before == {
        first_human(lost["conversations"]): 3
    }
    assert _samples(run_dir) == WANTED
    before = server.stats()["requests"]
    run(server, dataset, out, resume=True, **one_at_a_time)
    assert server.stats()["requests"] == before


@pytest.mark.slow
def test_a_killed_run_resumes_with_each_sample_exactly_once(tmp_path):
    """SIGKILL of the runner mid-run (no clean-up at all), then --resume: every sample once."""
    prompts = [f"row {i} [slow:0.3]" for i in range(4)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run_dir = out / "run"
    with FakeModelServer() as server:
        args = runner_argv(
            dataset, out, server, "--batch_size=2", "--prompts_per_worker=2", "--samples_per_prompt=3",
            "--max_failure_rate=1",
        )  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and sum(_batch_trajectories(run_dir).values()) < 3:
                time.sleep(0.1)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
        done_before = sum(_batch_trajectories(run_dir).values())
        assert 3 <= done_before < 12
        resumed = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _samples(run_dir) == {(p, s): 1 for p in prompts for s in range(3)}
    assert sum(_batch_trajectories(run_dir).values()) == 12


def test_records_of_a_run_before_samples_count_as_sample_0(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing", "two things"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    # As an older version wrote them: no sample_index, no row_* fields.
    for _, path in batch_files(run_dir):
        recs = read_jsonl(path)
        for rec in recs:
            for key in ("sample_index", "row_toolsets", "row_tools", "row_system_sha256", "row_max_turns"):
                del rec["metadata"][key]
        path.write_text("".join(json.dumps(r) + "\n" for r in recs), "utf-8")
    before = collections.Counter(server.stats()["requests_by_prompt"])
    capsys.readouterr()
    run(server, dataset, out, resume=True)
    assert "2 prompt(s) already finished, 0 to run" in capsys.readouterr().out
    run(server, dataset, out, resume=True, samples_per_prompt=2)  # more samples: only sample 1 runs
    assert collections.Counter(server.stats()["requests_by_prompt"]) - before == {
        "one thing": 3,
        "two things": 3,
    }
    assert _samples(run_dir) == {(p, s): 1 for p in ("one thing", "two things") for s in (0, 1)}


# ----------------------------------------------------------------------------- sampling parameters


def _bodies(server) -> list[dict]:
    return server.stats()["last_requests"]


def test_temperature_top_p_and_seeds_reach_the_endpoint(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["seeded task"])
    out = tmp_path / "data"
    run(server, dataset, out, samples_per_prompt=2)
    assert all(
        not {"temperature", "top_p", "seed"} & set(b) for b in _bodies(server)
    )  # the endpoint's defaults

    def seeds(run_name: str, **kw) -> dict[tuple[int, int], int]:
        server.reset_stats()
        run(
            server,
            dataset,
            out,
            run_name,
            samples_per_prompt=2,
            temperature=0.7,
            top_p=0.9,
            seed_per_request=True,
            **kw,
        )
        bodies = _bodies(server)
        assert len(bodies) == 6 and all(b["temperature"] == 0.7 and b["top_p"] == 0.9 for b in bodies)
        assert all(find_prompt(b["messages"])[1] == "seeded task" for b in bodies)
        recs = read_jsonl(out / run_name / "trajectories.jsonl")
        assert sorted(r["metadata"]["sample_index"] for r in recs) == [0, 1]
        return [b["seed"] for b in bodies]

    a = seeds("a")
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in a)
    assert len(set(a)) == 6  # every (sample, turn) its own seed
    assert sorted(seeds("b")) == sorted(a)  # the same run seed: the same seeds
    assert not set(seeds("c", seed=1)) & set(a)  # another --seed: others


def test_a_resume_with_another_temperature_is_refused_unless_forced(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, temperature=0.5, top_p=0.95, seed_per_request=True)
    manifest = json.loads((run_dir / "run_manifest.json").read_text("utf-8"))
    assert (manifest["temperature"], manifest["top_p"], manifest["seed_per_request"]) == (0.5, 0.95, True)
    for change in ({"temperature": 0.7}, {"temperature": None}, {"top_p": 1.0}, {"seed_per_request": False}):
        capsys.readouterr()
        kw = {"temperature": 0.5, "top_p": 0.95, "seed_per_request": True, **change}
        assert exit_code(server, dataset, out, resume=True, **kw) == 2
        err = capsys.readouterr().err
        assert "would mix two datasets" in err and next(iter(change)) in err
    run(
        server,
        dataset,
        out,
        resume=True,
        temperature=0.7,
        top_p=0.95,
        seed_per_request=True,
        force_resume=True,
    )
    after = json.loads((run_dir / "run_manifest.json").read_text("utf-8"))
    assert after["temperature"] == 0.7 and after["history"][0]["settings"]["temperature"] == 0.5


def test_a_manifest_from_before_the_sampling_flags_stands_for_their_defaults(server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one thing"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out)
    path = run_dir / "run_manifest.json"
    old = json.loads(path.read_text("utf-8"))
    for key in ("temperature", "top_p", "seed_per_request", "samples_per_prompt"):
        del old[key]
    path.write_text(json.dumps(old), "utf-8")
    run(server, dataset, out, resume=True)  # the defaults: what that run used
    path.write_text(json.dumps(old), "utf-8")
    capsys.readouterr()
    assert exit_code(server, dataset, out, resume=True, temperature=0.5) == 2
    assert "temperature: None -> 0.5" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5),
     ("samples_per_prompt", 0), ("samples_per_prompt", "two"), ("seed_per_request", "maybe")],
)  # fmt: skip
def test_sampling_flags_out_of_range_are_refused_naming_the_flag(tmp_path, flag, value):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["x"])
    with pytest.raises(UsageError, match=f"--{flag}"):
        RunConfig.from_flags(
            dataset_file=str(dataset), batch_size=1, run_name="r", output_dir=str(tmp_path), **{flag: value}
        )


def test_discards_and_duplicate_lines_count_per_sample(server, tmp_path, capsys):
    dataset = write_rows(
        tmp_path / "d.jsonl", [{"prompt": "[no_reasoning] quiet one"}, {"prompt": "loud one"}]
    )
    out = tmp_path / "data"
    run_dir = out / "run"
    run(server, dataset, out, samples_per_prompt=2)
    discards = read_jsonl(run_dir / "discarded.jsonl")
    assert sorted((d["prompt"], d["sample_index"], d["reason"]) for d in discards) == [
        ("[no_reasoning] quiet one", 0, "no_reasoning"),
        ("[no_reasoning] quiet one", 1, "no_reasoning"),
    ]
    # A copied line (as a crash between write and checkpoint could leave) is one sample, kept once.
    batch = run_dir / "batch_0.jsonl"
    batch.write_text(batch.read_text("utf-8") * 2, "utf-8")
    before = server.stats()["requests"]
    run(server, dataset, out, resume=True, samples_per_prompt=2)
    assert server.stats()["requests"] == before  # discards are finished samples
    assert _samples(run_dir) == {("loud one", 0): 1, ("loud one", 1): 1}
    # batch_0 holds both samples of the row that finished: two copied lines, each dropped at the merge.
    assert stats_of(run_dir)["dropped_at_merge"]["duplicate"] == 2
    before = collections.Counter(server.stats()["requests_by_prompt"])
    run(server, dataset, out, resume=True, samples_per_prompt=2, rerun_discarded=True)
    # Both samples again, once each (three calls a sample), and nothing else.
    assert collections.Counter(server.stats()["requests_by_prompt"]) - before == {
        "[no_reasoning] quiet one": 6
    }


def test_one_row_many_samples_fill_one_batch_each_sample_once(server, tmp_path):
    """Samples of one row share a batch (the dispatch keys a job by row and sample): one batch file,
    not one per sample, and every sample recorded once with its own index."""
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "only row [calls:1]"}])
    out = tmp_path / "data"
    run(server, dataset, out, samples_per_prompt=5, batch_size=10, num_workers=2)
    run_dir = out / "run"
    assert [p.name for _, p in batch_files(run_dir)] == ["batch_0.jsonl"]
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["metadata"]["sample_index"] for r in records) == [0, 1, 2, 3, 4]
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text("utf-8"))
    assert (checkpoint["batches"], checkpoint["completed_prompts"]) == ([0], [0])


def test_more_samples_than_the_machine_can_plan_exit_2_before_any_request(
    server, tmp_path, monkeypatch, capsys
):
    # --samples_per_prompt=10000 over 100 rows: 1,000,000 jobs planned before the start check (520 MB, 14 s);
    # under a 400 MB memory cgroup the runner was OOM-killed there, and a larger dataset fills any machine.
    # Here each sample is made to weigh the machine's whole memory, so that any planned sample is too many.
    import batchrun.config as config_mod
    from batchrun.prompt.sandboxes.local.limits import host_limits

    monkeypatch.setattr(config_mod, "SAMPLE_BYTES", host_limits(own_cgroup=True)[0], raising=False)
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "one"}, {"prompt": "two", "samples": 3}])
    with pytest.raises(SystemExit) as info:
        run(server, dataset, tmp_path / "data", samples_per_prompt=2)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--samples_per_prompt=2 over the dataset's 2 rows (with the rows' own 'samples') makes 5 samples"
        in err
    )
    assert server.stats()["requests"] == 0
    assert not (tmp_path / "data" / "run").exists()
