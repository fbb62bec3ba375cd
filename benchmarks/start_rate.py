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
    python benchmarks/start_rate.py --load 400 16 --nice -10   # beside commands run in 400 other
                                                           # sandboxes, the starts at nice -10

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sandbox_cpu import machine_busy_s  # noqa: E402

from batchrun.prompt.sandboxes.base import SandboxSpec  # noqa: E402
from batchrun.prompt.sandboxes.local import LocalSandbox, bwrap_problem, launcher, network_hub  # noqa: E402


def stop_all(boxes: list[LocalSandbox], threads: int) -> None:
    """Stop ``boxes`` on ``threads`` threads, then this process's network hub (its slirp4netns)."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda box: box.stop(), boxes))
    network_hub.close_hub()


def load(count: int, threads: int, network: bool, options: dict) -> None:
    """The prompts' work beside the starts: ``count`` sandboxes started before the go, then, until
    "stop", commands in them (the scale workload's ``echo <slug> && pwd``) from ``threads`` threads."""
    LocalSandbox.prepare_process()
    boxes = [
        LocalSandbox(SandboxSpec("start-rate-load", i, network=network), **options) for i in range(count)
    ]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda box: box.start(), boxes))
    print("ready", flush=True)
    sys.stdin.readline()
    done = [0] * threads
    stop = threading.Event()

    def work(k: int) -> None:
        while not stop.is_set():
            boxes[(done[k] * threads + k) % count].run(f"echo slug{k} && pwd", timeout_s=60)
            done[k] += 1

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    sys.stdin.readline()
    stop.set()
    for w in workers:
        w.join()
    print(json.dumps({"commands_per_s": sum(done) / (time.monotonic() - t0)}), flush=True)
    stop_all(boxes, 8)


def child(first: int, count: int, threads: int, network: bool, options: dict, nice: int = 0) -> None:
    """One worker's share: start ``count`` sandboxes on ``threads`` threads after "go", keep them,
    stop them after "stop"."""
    if nice:
        os.nice(nice)
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
    stop_all(boxes, threads)
    print(json.dumps({"stopped": time.monotonic()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--processes", type=int, default=4, help="as the run's workers (scale.py: 4)")
    ap.add_argument("--threads", type=int, default=2, help="starts at once per process (a run: 8 / workers)")
    ap.add_argument("--network", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--nice", type=int, default=0, help="the starting processes' nice value (-10: ahead of the load)"
    )
    ap.add_argument(
        "--load", type=int, nargs=2, default=(0, 0), metavar=("SANDBOXES", "THREADS"),
        help="beside the starts, a process at nice 0 running commands in SANDBOXES sandboxes from THREADS threads",
    )  # fmt: skip
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--load_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        first, count, threads, options, nice = args.child
        child(int(first), int(count), int(threads), args.network, json.loads(options), int(nice))
        return
    if args.load_child:
        count, threads, options = args.load_child
        load(int(count), int(threads), args.network, json.loads(options))
        return
    if bwrap_problem():
        raise SystemExit(f"bubblewrap: {bwrap_problem()}")
    options = LocalSandbox.prepare_run("start-rate", {"isolation": "bwrap"}, workers_here=True)
    # Built here once, so the children find it; named in the figures: a launcher.c that does not
    # compile makes every sandbox with bwrap instead, at about twice the CPU (launcher.py).
    made_by = "br-launch" if launcher.launcher_path() else f"bwrap ({launcher.problem or 'not root'})"
    share = [
        args.sandboxes // args.processes + (i < args.sandboxes % args.processes)
        for i in range(args.processes)
    ]
    procs = []
    loader = None
    try:
        first = 0
        for count in share:
            argv = [sys.executable, __file__, "--child", str(first), str(count), str(args.threads), json.dumps(options),
                    str(args.nice), "--network" if args.network else "--no-network"]  # fmt: skip
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            first += count
        if args.load[0] > 0:
            argv = [sys.executable, __file__, "--load_child", str(args.load[0]), str(args.load[1]), json.dumps(options),
                    "--network" if args.network else "--no-network"]  # fmt: skip
            loader = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if loader.stdout.readline().strip() != "ready":
                raise SystemExit("the load did not get ready")
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a child did not get ready")
        busy0, t0 = machine_busy_s(), time.monotonic()
        for p in [*procs, *([loader] if loader else [])]:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]
        t1 = max(r["done"] for r in results)
        busy1 = machine_busy_s()
        load_rate = None
        if loader is not None:
            loader.stdin.write("stop\n")
            loader.stdin.flush()
            load_rate = json.loads(loader.stdout.readline())["commands_per_s"]
            loader.wait()
        for p in procs:
            p.stdin.write("stop\n")
            p.stdin.flush()
        stopped = max(json.loads(p.stdout.readline())["stopped"] for p in procs)
        busy2 = machine_busy_s()
        for p in procs:
            p.wait()
    finally:
        for p in [*procs, *([loader] if loader else [])]:
            if p.poll() is None:
                p.kill()
        LocalSandbox.sweep(options)
    n = args.sandboxes
    took = sorted(x for r in results for x in r["took"])
    print(
        f"{n} sandboxes, {args.processes} processes x {args.threads} starts at once, network "
        f"{'on' if args.network else 'off'}, made by {made_by}; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if load_rate is not None:
        print(
            f"  beside them      {load_rate:6.1f} commands a second in {args.load[0]} other sandboxes, at nice 0; starts at nice {args.nice}"
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
