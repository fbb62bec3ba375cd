#!/usr/bin/env python3
"""Spend against a run-wide budget at many prompts in flight: what the endpoint itself counted, against the cap.

    python benchmarks/budget_cap.py                                   # 200 in flight, --budget_tokens=500000
    python benchmarks/budget_cap.py --in_flight 200 --budget_tokens 50000 --max_tokens 256

The fake endpoint runs in its own process (``--latency`` seconds per call); the runner runs with
``--in_flight`` prompts in flight (``--workers`` processes) and the budget, over more prompts than the
budget can pay for. Printed: the tokens the endpoint counted (its ``/stats``), the cap, spend / cap, the
prompts that ran, and the wall time. Before reservations the overshoot was one call per prompt in
flight (5.2x a 50,000 cap at 200 in flight).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import runner_argv, start_benchmark  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--in_flight", type=int, default=200)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--latency", type=float, default=0.5)
    p.add_argument("--budget_tokens", type=int, default=500_000)
    p.add_argument("--max_tokens", type=int, default=256, help="per-call completion limit (0: derived)")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    tmp, dataset, endpoint = start_benchmark(p, args, "budget-cap-")
    try:
        extra = [f"--budget_tokens={args.budget_tokens}", "--max_failure_rate=1.0"]
        if args.max_tokens:
            extra.append(f"--max_tokens={args.max_tokens}")
        cmd = runner_argv(
            dataset, tmp / "out", "cap", endpoint, 50, "terminal_only", args.workers,
            args.in_flight // args.workers, "local", "", *extra,
        )  # fmt: skip
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        stats = endpoint.stats()
        spent = stats["prompt_tokens"] + stats["completion_tokens"]
        run_stats = json.loads((tmp / "out" / "cap" / "statistics.json").read_text())
        this_run = run_stats["this_run"]
        print(f"  in flight {args.in_flight}, cap {args.budget_tokens:,} tokens, latency {args.latency:g} s")
        print(
            f"  endpoint counted {spent:,} tokens in {stats['requests']:,} requests: {spent / args.budget_tokens:.1%} of the cap"
        )
        print(
            f"  runner counted {this_run['budget']['spent_tokens']:,} tokens; prompts attempted {this_run['attempted']}, "
            f"trajectories {this_run['trajectories']}, not started {this_run['skipped_for_budget']}"
        )
        print(f"  exit code {done.returncode}, wall {wall:.1f} s")
        return 0
    finally:
        endpoint.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
