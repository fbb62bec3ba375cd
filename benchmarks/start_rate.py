"""How fast this machine can start a run's local sandboxes when it does nothing else: the floor under
the last sandbox start of ``scale.py``.

At 1,000 prompts in flight every prompt wants its sandbox within the first seconds, and the run
cannot end before its last-started prompt has made its remaining calls. This script starts N
sandboxes as a run's workers do (``--processes`` processes, each with its own network hub, with
``--threads`` starts at once each; the run's directory and parent cgroup), keeps every one of them
alive until all are started (as at 1,000 in flight, where they accumulate), then stops them all.
No model, no commands, no other work: what it prints is how early the last start can come on this
machine with these sandboxes, whatever the runner does around them.

    python benchmarks/start_rate.py                        # 1,000 sandboxes, network on, 4 x 2
    python benchmarks/start_rate.py --no-network
    python benchmarks/start_rate.py --threads 8            # more at once

Figures: the seconds from the go to the last start, starts a second, and the whole machine's busy
CPU over that time (``/proc/stat``: every process and kernel thread, the namespaces' teardown
included) per start; then the same for the stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sandbox_cpu import machine_busy_s  # noqa: E402

from batchrun.prompt.sandboxes.base import SandboxSpec  # noqa: E402
from batchrun.prompt.sandboxes.local import LocalSandbox, bwrap_problem, network_hub  # noqa: E402


def child(first: int, count: int, threads: int, network: bool, options: dict) -> None:
    """One worker's share: start ``count`` sandboxes on ``threads`` threads after "go", keep them,
    stop them after "stop"."""
    LocalSandbox.prepare_process()
    if network:  # the hub is made before the go, as a worker's first start made it long before the last
        warm = LocalSandbox(SandboxSpec("start-rate", first, network=True), **options)
        warm.start()
        warm.stop()
    print("ready", flush=True)
    sys.stdin.readline()
    boxes = [
        LocalSandbox(SandboxSpec("start-rate", first + i, network=network), **options) for i in range(count)
    ]
    took: list[float] = []

    def start(box: LocalSandbox) -> None:
        t = time.monotonic()
        box.start()
        took.append(time.monotonic() - t)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(start, boxes))
    print(json.dumps({"done": time.monotonic(), "took": sorted(took)}), flush=True)
    sys.stdin.readline()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda box: box.stop(), boxes))
    network_hub.close_hub()
    print(json.dumps({"stopped": time.monotonic()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--processes", type=int, default=4, help="as the run's workers (scale.py: 4)")
    ap.add_argument("--threads", type=int, default=2, help="starts at once per process (a run: 8 / workers)")
    ap.add_argument("--network", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        first, count, threads, options = args.child
        child(int(first), int(count), int(threads), args.network, json.loads(options))
        return
    if bwrap_problem():
        raise SystemExit(f"bubblewrap: {bwrap_problem()}")
    options = LocalSandbox.prepare_run("start-rate", {"isolation": "bwrap"}, workers_here=True)
    share = [
        args.sandboxes // args.processes + (i < args.sandboxes % args.processes)
        for i in range(args.processes)
    ]
    procs = []
    try:
        first = 0
        for count in share:
            argv = [sys.executable, __file__, "--child", str(first), str(count), str(args.threads), json.dumps(options),
                    "--network" if args.network else "--no-network"]  # fmt: skip
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            first += count
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a child did not get ready")
        busy0, t0 = machine_busy_s(), time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]
        t1 = max(r["done"] for r in results)
        busy1 = machine_busy_s()
        for p in procs:
            p.stdin.write("stop\n")
            p.stdin.flush()
        stopped = max(json.loads(p.stdout.readline())["stopped"] for p in procs)
        busy2 = machine_busy_s()
        for p in procs:
            p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        LocalSandbox.sweep(options)
    n = args.sandboxes
    took = sorted(x for r in results for x in r["took"])
    print(
        f"{n} sandboxes, {args.processes} processes x {args.threads} starts at once, network "
        f"{'on' if args.network else 'off'}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"  all started      {t1 - t0:6.2f} s after the go: {n / (t1 - t0):6.1f} starts a second")
    print(f"  machine CPU      {busy1 - busy0:6.2f} core-s busy while starting: {(busy1 - busy0) / n * 1000:5.2f} ms a start "
          f"({(busy1 - busy0) / (t1 - t0):.2f} cores busy)")  # fmt: skip
    print(f"  one start        median {took[n // 2] * 1000:.1f} ms, p90 {took[int(n * 0.9)] * 1000:.1f} ms")
    print(
        f"  all stopped      {stopped - t1:6.2f} s later, {(busy2 - busy1) / n * 1000:5.2f} ms of the machine's CPU a stop"
    )


if __name__ == "__main__":
    main()
