#!/usr/bin/env python3
"""How long ``python -m batchrun.views.compare`` takes over two large runs, piece by piece.

    python benchmarks/compare_speed.py                         # 100,000 pairs: 1 a row, then 10 a row
    python benchmarks/compare_speed.py --bootstrap 1000 --tree /tmp/old-checkout   # another version
    python benchmarks/compare_speed.py --command               # also the whole command on two run dirs

Two models alike on average, not row by row (each row's two pass probabilities drawn from
Beta(0.5, 0.5) and given to A and B in random order), ``--pairs`` pairs in rows of ``--per_row``, each
row in one of ``--mixes`` toolset mixes. Timed, as ``compare_runs`` makes them: ``compare_pairs`` over
all the pairs, then over each mix's (the printed per-toolset lines), and inside it the three
statistics (the paired bootstrap, McNemar's exact test, the sign-flip test by row). ``--command``
writes the two runs as run directories of small records (one short exchange each: the statistics'
share shows; real records of ~17 KB make reading them the bigger part, see large_run.py's
``json.loads`` floor) and times the command in a subprocess. CPU time beside wall time: the machine
is shared.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_measured(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """``argv`` run in ``cwd`` to its end: what it did, its wall time and the CPU of it and its children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def simulated(pairs: int, per_row: int, mixes: int, seed: int) -> tuple[list, list, list]:
    """(verdict pairs, each pair's row, each pair's toolset mix)."""
    rng = random.Random(seed)
    verdicts, rows, mix = [], [], []
    for row in range(pairs // per_row):
        q1, q2 = rng.betavariate(0.5, 0.5), rng.betavariate(0.5, 0.5)
        qa, qb = (q1, q2) if rng.random() < 0.5 else (q2, q1)
        m = f"mix{rng.randrange(mixes)}"
        for _ in range(per_row):
            verdicts.append((rng.random() < qa, rng.random() < qb))
            rows.append(f"row{row}")
            mix.append(m)
    return verdicts, rows, mix


class Timed:
    """Wraps a function of ``module``: its calls' wall and CPU time, added up."""

    def __init__(self, module, name: str):
        self.module, self.name, self.fn = module, name, getattr(module, name)
        self.wall = self.cpu = 0.0
        setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        w, c = time.perf_counter(), time.process_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.wall += time.perf_counter() - w
            self.cpu += time.process_time() - c


def measure(args: argparse.Namespace, per_row: int) -> None:
    from batchrun.views import compare

    verdicts, rows, mix = simulated(args.pairs, per_row, args.mixes, args.seed)
    parts = [Timed(compare, name) for name in ("paired_bootstrap", "mcnemar_exact", "sign_flip_p")]
    by_mix = collections.defaultdict(list)
    for i, m in enumerate(mix):
        by_mix[m].append(i)
    w, c = time.perf_counter(), time.process_time()
    whole = compare.compare_pairs(verdicts, args.bootstrap, rows=rows)
    whole_wall, whole_cpu = time.perf_counter() - w, time.process_time() - c
    for ix in by_mix.values():
        compare.compare_pairs([verdicts[i] for i in ix], args.bootstrap, rows=[rows[i] for i in ix])
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    for part in parts:
        setattr(compare, part.name, part.fn)
    lo, hi = whole["difference_95ci"]
    print(
        f"{args.pairs:,} pairs, {per_row} a row ({whole['rows']:,} rows), {len(by_mix)} mixes, "
        f"--bootstrap {args.bootstrap}: B - A {whole['difference']:+.4f} ({lo:+.4f} to {hi:+.4f}), "
        f"{whole['p_value_test']} p = {whole['p_value']:.4g}, discordant pairs "
        f"{whole['passed_only_in_a'] + whole['passed_only_in_b']:,}"
    )
    print(f"  all pairs:          {whole_wall:8.2f} s wall {whole_cpu:8.2f} s CPU")
    print(f"  all + each mix:     {wall:8.2f} s wall {cpu:8.2f} s CPU")
    for part in parts:
        print(f"    {part.name + ':':18s}{part.wall:8.2f} s wall {part.cpu:8.2f} s CPU")


def write_run(run_dir: Path, verdicts: list, rows: list, mix: list, side: int) -> None:
    """A run directory of small records: row ``rows[i]``'s sample, judged ``verdicts[i][side]``; the
    batch file holds them too, as a run's batch files hold every record its merge wrote out."""
    from batchrun.identity import row_key

    run_dir.mkdir(parents=True)
    index: collections.Counter[str] = collections.Counter()
    with open(run_dir / "trajectories.jsonl", "w", encoding="utf-8") as out:
        for (a, b), row, m in zip(verdicts, rows, mix, strict=True):
            passed = (a, b)[side]
            rec = {
                "prompt_index": 0,
                "conversations": [
                    {"from": "system", "value": "You are a helpful assistant."},
                    {"from": "human", "value": f"Solve task {row}."},
                    {"from": "gpt", "value": "<think>\nok\n</think>\nANSWER: 42"},
                ],
                "metadata": {
                    "sample_index": index[row],
                    "row_id": row,
                    "row_key": row_key(f"Solve task {row}."),
                    "row_fields": json.dumps({"answer": "42", "id": row}),
                },
                "completed": True,
                "partial": False,
                "toolsets_used": m.split("+"),
                "score": {
                    "status": "passed" if passed else "failed",
                    "value": float(passed),
                    "passed": passed,
                    "scorer": "exact",
                },
            }
            index[row] += 1
            out.write(json.dumps(rec) + "\n")
    (run_dir / "batch_0.jsonl").write_bytes((run_dir / "trajectories.jsonl").read_bytes())


def command(args: argparse.Namespace, per_row: int, tree: Path) -> None:
    verdicts, rows, mix = simulated(args.pairs, per_row, args.mixes, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        write_run(a, verdicts, rows, mix, 0)
        write_run(b, verdicts, rows, mix, 1)
        done, wall, cpu = run_measured(
            [sys.executable, "-m", "batchrun.views.compare", str(a), str(b), f"--out={Path(tmp) / 'c.html'}"]
            + [f"--bootstrap={args.bootstrap}"],
            tree,
        )
        size = (a / "trajectories.jsonl").stat().st_size / 1e6
        print(
            f"  the command, two runs of {size:.0f} MB: {wall:8.2f} s wall {cpu:8.2f} s CPU (exit {done.returncode})"
        )
        headline = [line for line in done.stdout.splitlines() if "B - A" in line or " p = " in line][:2]
        for line in headline:
            print(f"    {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--per_row", type=int, nargs="+", default=[1, 10], help="pairs a row (layouts)")
    parser.add_argument("--mixes", type=int, default=4, help="toolset mixes (the per-toolset lines)")
    parser.add_argument("--bootstrap", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose batchrun is timed")
    parser.add_argument("--command", action="store_true", help="also time the whole command")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    for per_row in args.per_row:
        measure(args, per_row)
        if args.command:
            command(args, per_row, args.tree.resolve())


if __name__ == "__main__":
    main()
