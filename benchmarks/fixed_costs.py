#!/usr/bin/env python3
"""The parent's fixed costs: launch -> the endpoint's first request, and its last response -> the runner's exit.

    python benchmarks/fixed_costs.py --runs 8
    python benchmarks/fixed_costs.py --runs 8 --trees /path/to/base/checkout .   # alternated A/B

``batch_runner.py`` runs as ``throughput.py`` runs it (its ``runner_argv``, 200 prompts, 40 in flight
over 4 workers, the fake endpoint at 0.1 s a call), output discarded. "start" is from just before the
process is spawned to the endpoint's first counted request (``/stats``: the start check's call is not
counted); "end" from its last response to the moment the runner is a zombie (``waitid`` without
reaping, as ``throughput.py`` measures the whole command). Both are wall time: ``--trees`` runs each
checkout's ``batch_runner.py`` in turn, run by run, with its own package (``PYTHONPATH``), so that two
versions are compared in the same minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import ROOT, runner_argv, start_benchmark  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--latency", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--in_flight", type=int, default=40)
    p.add_argument("--trees", nargs="+", type=Path, default=[ROOT], help="checkouts to alternate")
    args = p.parse_args()
    tmp, dataset, endpoint = start_benchmark(p, args, "br-fixed-")
    figures: dict[Path, dict[str, list[float]]] = {t: {"start": [], "end": []} for t in args.trees}
    try:
        for i in range(args.runs):
            for tree in args.trees:
                cmd = runner_argv(
                    dataset, tmp, f"fc_{i}", endpoint, 10, "terminal_only", args.workers,
                    args.in_flight // args.workers, "local", "", "--max_sandbox_starts=8",
                )  # fmt: skip
                cmd[1] = str(tree.resolve() / "batch_runner.py")
                env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
                shutil.rmtree(tmp / f"fc_{i}", ignore_errors=True)
                endpoint.reset()
                t0 = time.time()
                proc = subprocess.Popen(
                    cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                t1 = time.time()
                code = proc.wait()
                stats = endpoint.stats()
                start, end = stats["first_request_at"] - t0, t1 - stats["last_response_at"]
                figures[tree]["start"].append(start)
                figures[tree]["end"].append(end)
                print(
                    f"{tree}: run {i}: start {start:.3f} s  end {end:.3f} s  whole {t1 - t0:.3f} s  "
                    f"(exit code {code}, load {os.getloadavg()[0]:.1f})"
                )
    finally:
        endpoint.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for tree, fig in figures.items():
        for name, v in fig.items():
            print(
                f"{tree}: {name} median {statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f}, n={len(v)})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
