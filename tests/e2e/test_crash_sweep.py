"""kill -9 of the whole runner at chosen durable steps, then --resume: the same outputs as an uninterrupted
run (benchmarks/crash_sweep.py, whose full sweep kills before every step; this is a few of them).

The runner's parent is killed (its process group, SIGKILL) just before its Nth fsync or rename, or the
first of a name, counted by a sitecustomize.py the sweep puts on its PYTHONPATH: the same instants every
time, whatever the machine's load.
Compared with the uninterrupted run: each sample's one outcome (kept with its conversation and score,
discarded with its reason, or failed), checkpoint.json's completed prompts, statistics.json (all but
timings, spend and per-invocation counts), status.json finished, report.html there, no temp file left; and
the books' tokens (and prompt tokens served from its cache) against the endpoint's."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import signal
from pathlib import Path

import pytest
from helpers import ROOT

from batchrun.fakes.fake_model import FakeModelServer

pytestmark = [pytest.mark.slow, pytest.mark.bwrap]


def _sweep():
    spec = importlib.util.spec_from_file_location("crash_sweep", ROOT / "benchmarks" / "crash_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kill_9_before_chosen_durable_steps_then_resume_gives_the_uninterrupted_output(tmp_path):
    sweep = _sweep()
    args = argparse.Namespace(samples=2, workers=2, isolation="bwrap", flag=[], keep=None)
    dataset = tmp_path / "dataset.jsonl"
    rows = sweep.rows()
    rows = rows[:4] + rows[8:16]  # answers right and wrong, verify commands, a twin, discards, a failure
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FakeModelServer(latency_s=0.01, prompt_cache=True) as server:
        base_out = tmp_path / "base"
        base_out.mkdir()
        code, err = sweep.run_to_end(sweep.argv(dataset, base_out, server, args, False), base_out)
        assert code == 0, err[-2000:]
        base = sweep.summary(base_out / sweep.RUN)
        assert len(base["kept"]) > 10 and base["discarded"] and base["failed"]
        assert base["stats"]["scores"]["scored"] > 0
        assert base["stats"]["usage_in_trajectories"]["cached_tokens"] > 0  # compared, and the books' too

        # Steps by number where the instant may move with the machine's load (a periodic status.json is
        # one step more or less), by name where it must not.
        names = sweep.durable_steps(args, tmp_path, dataset, server)
        merge = names.index("fsync .trajectories.jsonl.tmp") + 1
        first_outcome = names.index("fsync batch_0.jsonl") + 1
        points = [
            (1, {}),  # before anything was written
            (first_outcome, {"torn": True}),  # the first outcome's line torn in half
            ((first_outcome + merge) // 2, {"resume_at": 4}),  # mid-run, and the resume killed at its start
            ("fsync .trajectories.jsonl.tmp", {"strict_spend": True}),  # every outcome in, the merge written
            ("rename trajectories.jsonl", {"strict_spend": True}),  # not yet renamed into place
            ("rename statistics.json", {"strict_spend": True}),
            (
                "rename status.json@rename statistics.json",
                {"strict_spend": True},
            ),  # statistics written, not status
            ("rename report.html", {"strict_spend": True}),
            # Ctrl-C (SIGINT to the group) mid-run, SIGTERM in the merge: the run stops by itself (exit 130)
            ((first_outcome + merge) // 2, {"sig": signal.SIGINT}),
            ("rename trajectories.jsonl", {"sig": signal.SIGTERM, "strict_spend": True}),
        ]
        for at, how in points:
            rounds, problems = sweep.kill_and_resume(args, tmp_path, dataset, server, base, at, **how)
            sig = how.get("sig")
            assert rounds[0] == (
                f"{sig.name} before step {at}: exit 130" if sig else f"killed before step {at}"
            ), rounds
            assert not problems, f"{at}: {rounds}: {problems}"


def test_kill_9_after_the_last_outcome_then_a_resume_with_nothing_to_run_sweeps_the_sandboxes_left(tmp_path):
    """A runner killed once every outcome is in (here just before the last one's fsync: its line is written)
    leaves its sandboxes' run directory (bash and sh copies, ~1.3 MiB a worker, in /dev/shm: memory) and
    its parent cgroups. The resume has nothing to run (no failure to retry: samples of rows that already
    passed are skipped), and it swept nothing before: they stayed until a run of that name had work again.
    With --samples_per_prompt=3 --stop_after_passes=1, which the sweep above does not use."""
    sweep = _sweep()
    args = argparse.Namespace(
        samples=3,
        workers=2,
        isolation="bwrap",
        flag=["--stop_after_passes=1", "--seed_per_request"],
        keep=None,
    )
    rows = [{"id": f"p{i}", "prompt": f"Sum {i} [answers:41|42|43]", "answer": 42} for i in range(4)]
    rows.append({"id": "never", "prompt": "Sum never [answers:1|2]", "answer": 42})
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FakeModelServer(latency_s=0.01) as server:
        base_out = tmp_path / "base"
        base_out.mkdir()
        code, err = sweep.run_to_end(sweep.argv(dataset, base_out, server, args, False), base_out)
        assert code == 0, err[-2000:]
        base = sweep.summary(base_out / sweep.RUN)
        assert not base["failed"] and any(
            reasons == ["skipped_after_passes"] for reasons in base["discarded"].values()
        )
        names = sweep.durable_steps(args, tmp_path, dataset, server)
        merge = names.index("fsync .trajectories.jsonl.tmp")
        last_outcome = max(n for n, step in enumerate(names[:merge]) if step.startswith("fsync batch_")) + 1
        rounds, problems = sweep.kill_and_resume(args, tmp_path, dataset, server, base, last_outcome)
        assert rounds[0] == f"killed before step {last_outcome}", rounds
        assert not problems, f"{rounds}: {problems}"


@pytest.mark.parametrize(
    ("isolation", "signame"),
    [("bwrap", "SIGTERM"), ("bwrap", "SIGINT"), pytest.param("docker", "SIGTERM", marks=pytest.mark.docker)],
)
def test_a_signal_before_the_workers_start_leaves_no_sandbox_behind(tmp_path, isolation, signame):
    """SIGTERM or Ctrl-C (SIGINT) while the run writes its manifest, after the backend prepared the run
    (local: its sandbox directory in /dev/shm; Docker: the run's cgroup, in every hierarchy, with its
    limits) and before any worker started: the run stopped (exit 130) and nothing swept them, until a
    later run did. The workers' end sweeps after them; here no worker had started."""
    sweep = _sweep()
    args = argparse.Namespace(samples=1, workers=2, isolation=isolation, flag=[], keep=None)
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in sweep.rows()[:4]))
    out = tmp_path / "out"
    out.mkdir()
    env = sweep.hooked_env(
        sweep.install_hook(tmp_path),
        kill_before="fsync .run_manifest.json.tmp",
        signal=int(getattr(signal, signame)),
        parent_only=1,
    )
    with FakeModelServer(latency_s=0.01) as server:
        proc = sweep.start(sweep.argv(dataset, out, server, args, False), out, env)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err.decode()[-2000:]
        assert server.stats()["requests"] == 0  # no prompt ran (the start check is counted apart)
        assert sweep.sandbox_leftovers([proc.pid]) == []


def test_kill_9_in_a_rerun_round_then_the_same_command_runs_each_discard_again_once(tmp_path):
    """A --resume --rerun_discarded invocation killed mid-round (its outcomes partly written), then the same
    command: it ran every discard again, those the killed round had run again a second time (two lines
    more in discarded.jsonl, paid twice), as nothing said a round was under way. Now the round is in
    checkpoint.json before its first outcome, each discard it writes says its round, and the same command
    continues it: the same outputs as the round run uninterrupted, killed before the round was marked,
    mid-round, in its merge, or just before its last step (the round marked finished)."""
    sweep = _sweep()
    args = argparse.Namespace(samples=1, workers=2, isolation="bwrap", flag=[], keep=None)
    rows = sweep.rows()
    rows = (
        rows[:2]
        + rows[12:16]
        + [{"id": f"terse-{i}", "prompt": f"Answer tersely {i} [no_reasoning] [slow:0.1]"} for i in range(5)]
    )
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FakeModelServer(latency_s=0.01) as server:
        first = tmp_path / "first"
        first.mkdir()
        code, err = sweep.run_to_end(sweep.argv(dataset, first, server, args, False), first)
        assert code == 0, err[-2000:]

        def copy(name: str) -> tuple[Path, list[str]]:
            out = tmp_path / name
            shutil.copytree(first, out)
            return out, [*sweep.argv(dataset, out, server, args, True), "--rerun_discarded"]

        base_out, cmd = copy("base")
        code, err = sweep.run_to_end(cmd, base_out)
        assert code == 0, err[-2000:]
        base = sweep.summary(base_out / sweep.RUN)
        # Each discard run again once (the twin-free rows: one sample each), discarded again.
        assert len(base["discard_lines"]) >= 6 and set(base["discard_lines"].values()) == {2}
        base_round = json.loads((base_out / sweep.RUN / "checkpoint.json").read_text())["rerun_round"]
        assert base_round == {"round": 1, "finished": True}

        steps_out, cmd = copy("steps")
        log = tmp_path / "rerun_steps.txt"
        sweep.run_to_end(cmd, steps_out, env=sweep.hooked_env(sweep.install_hook(tmp_path), steps_file=log))
        names = log.read_text().splitlines()
        discards = [n + 1 for n, step in enumerate(names) if step == "fsync discarded.jsonl"]
        # The round closed last (the directory's fsync after): a kill after it ended a finished round.
        assert len(discards) == len(base["discard_lines"]) and names[-2:] == [
            "rename checkpoint.json",
            "fsync sweep",
        ]
        points = [
            names.index("rename checkpoint.json") + 1,  # the round not marked open yet
            discards[2],  # two discards run again, the third's line not yet durable
            names.index("fsync .trajectories.jsonl.tmp") + 1,  # every outcome in, the merge
            len(names) - 1,  # everything written but the round's end
        ]
        for at in points:
            out, cmd = copy(f"kill_{at}")
            proc = sweep.start(cmd, out, env=sweep.hooked_env(sweep.install_hook(tmp_path), kill_at=at))
            proc.wait()
            assert proc.returncode == -signal.SIGKILL, at
            code, err = sweep.run_to_end(cmd, out)
            assert code == 0, err[-2000:]
            got = sweep.summary(out / sweep.RUN)
            assert not sweep.compare(base, got), f"killed before step {at} ({names[at - 1]})"
            assert got["discard_lines"] == base["discard_lines"], at
            checkpoint = json.loads((out / sweep.RUN / "checkpoint.json").read_text())
            assert checkpoint["rerun_round"] == base_round, at
