#!/usr/bin/env python3
"""A budget run killed with kill -9 again and again, resumed each time: what the endpoint served, against the cap and the books.

    python benchmarks/budget_crash.py                       # 150 prompts, --budget_tokens=100000, 15 kills
    python benchmarks/budget_crash.py --kills 12 --latency 0.4 --workers 2 --per_worker 8

Each round starts ``batch_runner.py`` (``--resume`` after the first) against the fake endpoint (in this
process, ``--latency`` seconds a call; prompts of 4 calls, ``terminal_only``) and, for the first
``--kills`` rounds, kills the runner with SIGKILL after a random 2-5 s; the rounds after run until the
runner exits by itself (exit 2 once the books say the budget is spent). Printed per round: the exit
code and the tokens served so far; at the end the tokens the endpoint served (prompts, completions,
start checks and probes) against the cap, and what the books say was spent, as a resume reads them
(``statistics.json``'s ``runs`` and the invocations killed since: tokens answered plus
``unanswered_tokens``). Before the spend journal (batchrun/run/journal.py) each
kill lost the calls of its last seconds from the books, and the resumes spent them again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchrun.fakes.fake_model import FakeModelServer  # noqa: E402


def served(server: FakeModelServer) -> int:
    stats = server.stats()
    return stats["prompt_tokens"] + stats["completion_tokens"] + stats["check_tokens"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=150)
    p.add_argument("--budget_tokens", type=int, default=100_000)
    p.add_argument("--kills", type=int, default=15)
    p.add_argument("--latency", type=float, default=0.3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--per_worker", type=int, default=4, help="--prompts_per_worker")
    p.add_argument("--max_tokens", type=int, default=300)
    p.add_argument("--kill_after", type=float, nargs=2, default=(2.0, 5.0), metavar=("MIN_S", "MAX_S"))
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    rnd = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="budget-crash-"))
    dataset = tmp / "d.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": f"Task {i} [calls:3]"}) + "\n" for i in range(args.prompts))
    )
    server = FakeModelServer(latency_s=args.latency).start()
    cmd = [
        sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=10",
        "--run_name=crash", f"--output_dir={tmp / 'out'}", "--model=fake-model", f"--base_url={server.base_url}",
        "--api_key=sk-budget-crash", "--distribution=terminal_only", f"--num_workers={args.workers}",
        f"--prompts_per_worker={args.per_worker}", f"--budget_tokens={args.budget_tokens}",
        f"--max_tokens={args.max_tokens}", "--max_failure_rate=1.0",
    ]  # fmt: skip
    try:
        rounds = 0
        while True:
            proc = subprocess.Popen(
                cmd + (["--resume"] if rounds else []),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                code = proc.wait(rnd.uniform(*args.kill_after) if rounds < args.kills else None)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                code = proc.wait()
            rounds += 1
            print(f"  round {rounds:2d}: exit {code:3d}, served {served(server):,} tokens", flush=True)
            if code == 2 or (code != -signal.SIGKILL and rounds > args.kills):
                break
        time.sleep(args.latency + 1)  # calls in flight at the last kill are answered (billed) all the same
        total = served(server)
        from batchrun.run.journal import read_journal
        from batchrun.run.recorder import earlier_runs, lost_runs, spend_of
        from batchrun.storage import read_json_object

        # The books as a resume reads them: statistics.json's runs, and the invocations killed since.
        run_dir = tmp / "out" / "crash"
        earlier = earlier_runs(run_dir / "statistics.json")
        lost = lost_runs(read_json_object(run_dir / "status.json"), earlier, read_journal(run_dir))
        books = spend_of([*earlier, *lost])[0]
        print(
            f"  cap {args.budget_tokens:,} tokens; the endpoint served {total:,} ({total / args.budget_tokens:.2f}x)"
        )
        print(f"  the books (every invocation's runs entry, as a resume reads them): {books:,} tokens")
        print(f"  books >= served: {books >= total}; served <= cap: {total <= args.budget_tokens}")
        return 0
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
