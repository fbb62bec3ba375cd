#!/usr/bin/env python3
"""Kill the runner at random instants, resume, and compare with an uninterrupted run.

    python benchmarks/crash_resume.py --prompts 60 --kills 10 --seed 1

Each round starts ``batch_runner.py --resume`` as a subprocess against the fake endpoint, waits a
random time, then kills it with SIGKILL: the parent, one worker, or the whole process group
(chosen at random). Rounds repeat until a run ends by itself. Then the merged trajectories must
hold every dataset prompt exactly as many times as the dataset does, and no prompt may have been
paid for twice (the endpoint's per-prompt request counts are compared with a clean run's).
Prints one line per round and a verdict; exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchrun.fakes.fake_model import FakeModelServer  # noqa: E402


def make_dataset(path: Path, n: int) -> list[str]:
    prompts = [f"Crash-check task {i}: write a note about topic {i % 7}" for i in range(n)]
    prompts += prompts[:3]  # intentional duplicates: each must come back twice
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


def runner_cmd(dataset: Path, out: Path, base_url: str, resume: bool) -> list[str]:
    cmd = [
        sys.executable,
        str(ROOT / "batch_runner.py"),
        f"--dataset_file={dataset}",
        "--batch_size=5",
        "--run_name=crash",
        "--model=fake",
        f"--base_url={base_url}",
        "--api_key=sk-crash-test",
        "--distribution=terminal_only",
        "--num_workers=3",
        "--prompts_per_worker=4",
        f"--output_dir={out}",
    ]
    return cmd + (["--resume"] if resume else [])


def children_of(pid: int) -> list[int]:
    """Every descendant pid of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
    except OSError:
        return "?"


def trajectories(out: Path) -> collections.Counter[str]:
    got: collections.Counter[str] = collections.Counter()
    path = out / "crash" / "trajectories.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            got[rec["conversations"][1]["value"]] += 1
    return got


def run_until_done(
    dataset: Path, out: Path, server: FakeModelServer, kills: int, rng: random.Random, log
) -> int:
    rounds = 0
    while True:
        resume = (out / "crash").exists()
        proc = subprocess.Popen(
            runner_cmd(dataset, out, server.base_url, resume),
            cwd=out,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        rounds += 1
        if rounds <= kills:
            time.sleep(rng.uniform(0.2, 2.5))
            victims = children_of(proc.pid)
            how = rng.choice(["parent", "worker", "group"])
            if proc.poll() is None:
                if how == "parent":
                    os.kill(proc.pid, signal.SIGKILL)
                elif how == "worker" and victims:
                    victim = rng.choice(victims)
                    how += " " + _cmdline(victim)
                    os.kill(victim, signal.SIGKILL)
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
            log(f"round {rounds}: killed {how}")
        try:
            _, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError("runner hung for 180 s") from None
        if proc.returncode == 0 and rounds > kills:
            return rounds
        if proc.returncode not in (0, 3, -9, 137, 130) and rounds > kills:
            raise RuntimeError(f"runner failed with {proc.returncode}: {err.decode()[-2000:]}")
        if rounds > kills + 5:
            raise RuntimeError(f"no clean finish after {rounds} rounds: {err.decode()[-2000:]}")


def check(prompts: list[str], out: Path, server: FakeModelServer, calls_per_prompt: int) -> list[str]:
    problems = []
    want = collections.Counter(prompts)
    got = trajectories(out)
    if got != want:
        missing = want - got
        extra = got - want
        problems.append(f"trajectories differ: {sum(missing.values())} missing, {sum(extra.values())} extra")
    # Orphans: no process may still be running from this run's directory.
    time.sleep(1.0)
    stats = server.stats()
    in_flight = stats["in_flight"]
    if in_flight:
        problems.append(
            f"{in_flight} model requests still in flight after the run: an orphan worker is running"
        )
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.05)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp, FakeModelServer(latency_s=args.latency) as server:
        out = Path(tmp)
        dataset = out / "dataset.jsonl"
        prompts = make_dataset(dataset, args.prompts)
        rounds = run_until_done(dataset, out, server, args.kills, rng, print)
        problems = check(prompts, out, server, 3)
        stats = json.loads((out / "crash" / "statistics.json").read_text())
        print(
            f"{rounds} rounds, {args.kills} kills: {stats['trajectories']} trajectories for {len(prompts)} dataset rows; "
            f"{server.stats()['requests']} model requests in all; failed attempts {stats['failed_attempts']['total']}"
        )
        for p in problems:
            print("PROBLEM:", p)
        print("OK: same trajectories as an uninterrupted run" if not problems else "FAILED")
        return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
