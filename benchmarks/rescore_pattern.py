#!/usr/bin/env python3
"""How long ``python -m batchrun.views.score`` takes to re-score a run with the user's regular expressions.

    python benchmarks/rescore_pattern.py                       # 10,000 samples
    python benchmarks/rescore_pattern.py --samples 2000 --tree /tmp/old-checkout   # another version

Writes a run directory of ``--samples`` small records (one short exchange each, ``ANSWER: 42`` or
``ANSWER: 41``), then times the whole command in a subprocess, three ways: ``--scorer=exact`` alone (no
regular expression: the floor), ``--scorer=exact --answer_pattern='ANSWER: (.*)'`` (the pattern is the
user's, run where a catastrophic one cannot hang the command), and ``--scorer=regex`` against rows whose
``answer`` is a pattern (the row's, run alike; with the pattern, two searches a sample). CPU time beside wall time: the machine is shared.

``--ways=runaway`` (not among the default ways: before, it took a --verify_timeout a sample) re-scores
``--runaway_samples`` samples (200 by default) whose answers end ``ANSWER: 4444...4x`` (30 digits) with
``--answer_pattern='ANSWER: ((\\d+)+$)'``, which backtracks on every one of them for minutes, at
``--verify_timeout=1``: each sample took its second, one after another; now the pattern is given up after it
ran away on three rows' answers in a row (rows of 4 samples: 9 searches), the rest unscored at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_speed import run_measured  # noqa: E402


def write_run(run_dir: Path, samples: int, answer: str, said: str | None = None) -> None:
    """A run directory of ``samples`` records over rows of 4 samples, every third one answering 41 (or
    each saying ``said``)."""
    sys.path.insert(0, str(ROOT))
    from batchrun.identity import row_key

    run_dir.mkdir(parents=True)
    (run_dir / "run_manifest.json").write_text(json.dumps({"format_version": 1}))
    (run_dir / "statistics.json").write_text(json.dumps({"runs": [], "scores": {}}))
    with open(run_dir / "trajectories.jsonl", "w", encoding="utf-8") as out:
        for i in range(samples):
            row = f"r{i // 4}"
            rec = {
                "prompt_index": i // 4,
                "conversations": [
                    {"from": "system", "value": "You are a helpful assistant."},
                    {"from": "human", "value": f"Solve task {row}."},
                    {
                        "from": "gpt",
                        "value": "<think>\nok\n</think>\nSo.\n"
                        + (said or f"ANSWER: {41 if i % 3 == 0 else 42}"),
                    },
                ],
                "metadata": {
                    "sample_index": i % 4,
                    "row_id": row,
                    "row_key": row_key(f"Solve task {row}."),
                    "row_fields": json.dumps({"answer": answer, "id": row}),
                },
                "completed": True,
                "partial": False,
                "toolsets_used": ["terminal"],
                "score": {"status": "passed", "value": 1.0, "passed": True, "scorer": "exact"},
            }
            out.write(json.dumps(rec) + "\n")


def timed(tree: Path, run_dir: Path, flags: list[str]) -> None:
    done, wall, cpu = run_measured([sys.executable, "-m", "batchrun.views.score", str(run_dir), *flags], tree)
    said = (done.stdout.splitlines() or [done.stderr.strip()[-200:]])[0]
    print(f"  {' '.join(flags):62} {wall:8.2f} s wall {cpu:8.2f} s CPU (exit {done.returncode})")
    print(f"    {said}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose batchrun is timed")
    parser.add_argument("--runaway_samples", type=int, default=200, help="the samples of --ways=runaway")
    parser.add_argument(
        "--ways",
        default="floor,pattern,regex",
        help="which of floor, pattern, regex, runaway to time (comma-separated)",
    )
    args = parser.parse_args()
    ways = args.ways.split(",")
    tree = args.tree.resolve()
    print(f"{args.samples} samples, {tree}")
    with tempfile.TemporaryDirectory() as tmp:
        plain, patterns = Path(tmp) / "plain", Path(tmp) / "patterns"
        write_run(plain, args.samples, "42")
        write_run(patterns, args.samples, r"^4[2-9]$")
        if "floor" in ways:
            timed(tree, plain, ["--scorer=exact", "--name=floor"])
        if "pattern" in ways:
            timed(tree, plain, ["--scorer=exact", "--answer_pattern=ANSWER: (.*)", "--name=pattern"])
        if "regex" in ways:
            timed(tree, patterns, ["--scorer=regex", "--answer_pattern=ANSWER: (.*)", "--name=regex"])
        if "runaway" in ways:
            runaway = Path(tmp) / "runaway"
            write_run(runaway, args.runaway_samples, "42", said="ANSWER: " + "4" * 30 + "x")
            flags = ["--scorer=exact", r"--answer_pattern=ANSWER: ((\d+)+$)", "--verify_timeout=1"]
            timed(tree, runaway, [*flags, "--name=runaway"])


if __name__ == "__main__":
    main()
