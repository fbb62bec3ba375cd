#!/usr/bin/env python3
"""Scale: many prompts in flight on one small machine, against the fake endpoint with a set latency.

    python benchmarks/scale.py                                    # 1,000 prompts, 2 s per call, 1,000 in flight
    python benchmarks/scale.py --prompts 200 --latency 0.1 --in_flight 40
    python benchmarks/scale.py --prompts 10000 --in_flight 1000   # long: minutes
    python benchmarks/scale.py --backend docker --prompts 100 --in_flight 40 --latency 2

Runs ``batch_runner.py`` once as a user runs it (``--distribution=terminal_only``: 3 model calls and
3 tool calls per prompt) against ``python -m batchrun.fakes.fake_model --latency L`` in its own
process, and prints:

* **first request**: seconds from launching the command to the endpoint's first model request;
* **wall** time of the whole command, the **ideal** (model calls x latency / in-flight limit) and the
  **efficiency** (ideal / wall), and the same over the dispatch phase (first request to last response);
* the most **requests in flight** the endpoint saw at once;
* **CPU per prompt** of the whole process tree (exact: this script is a child subreaper and reaps
  every descendant, so ``RUSAGE_CHILDREN`` holds them all, bwrap's orphans included), and the
  endpoint's own CPU (same cores);
* the **bound** the run cannot beat (the larger of the ideal and the tree's CPU over the cores) and
  wall / bound, and the same bound with the endpoint's CPU counted (it takes the same cores here,
  which a remote endpoint does not), and with the cores the launch and the end of the run leave
  idle counted as well (what is left is what the dispatch's schedule loses); the **machine's CPU**
  (``/proc/stat``, every process: busy and idle core-seconds, busy cores in each second) and when the
  **last sandbox started** (from the records), with the idle core-seconds before and after it: bound
  by the CPU until then, by the endpoint after; the **starts in each second** (records, to the
  second: against ``start_rate.py``'s rate with nothing else running); and the **tail** from that
  start to the exit, with how early the last start would have to come for wall / bound <= 1.25;
* **peak PSS** of the tree (parent, forkserver, workers, sandboxes, their helpers), sampled every
  ``--pss_s`` from ``/proc/<pid>/smaps_rollup``, and the PSS per prompt in flight at that moment;
* the **sandbox wait** percentiles from the records' metadata: ``sandbox_start_wait_s`` (queueing for
  a start-up slot), ``sandbox_start_s`` (the start itself), ``sandbox_start_blocked_s`` (what the
  prompt's own thread waited for its sandbox).

With ``--floor``, the **floor** of one prompt (``floor.py``: its primitives measured just before and
just after the run, added up as issue 26 does) and the CPU per prompt over it: the machine's speed
drifts, and a figure means most next to a floor of the same minutes.

Reading ``smaps_rollup`` of thousands of processes costs CPU of its own (this script's, not the
tree's): ``--pss_s 0`` turns the memory sampling off.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floor  # noqa: E402 - the prompt's floor from its primitives (floor.py)
from throughput import (  # noqa: E402 - the shared pieces of the throughput benchmark
    DOCKER_IMAGE,
    ROOT,
    Endpoint,
    _children,
    children_cpu_s,
    reap_descendants,
    runner_argv,
    start_benchmark,
)

from batchrun.config import parse_bool  # noqa: E402


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class PssMeter:
    """Samples the PSS of the runner's process tree (and of orphans reparented to this script)."""

    def __init__(self, root: int, exclude: set[int], interval_s: float, endpoint: Endpoint):
        self.root, self.exclude, self.interval_s, self.endpoint = root, exclude, interval_s, endpoint
        self.peak_kb = 0
        self.peak_in_flight = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pss-meter", daemon=True)

    def start(self) -> PssMeter:
        if self.interval_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            pids = self._tree()
            total = sum(_pss_kb(p) for p in pids)
            if total > self.peak_kb:
                self.peak_kb, self.peak_processes = total, len(pids)
                try:
                    self.peak_in_flight = self.endpoint.stats()["in_flight"]
                except Exception:
                    pass

    def _tree(self) -> set[int]:
        todo = [self.root, *(_children(os.getpid()) - self.exclude - {self.root})]
        seen: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                todo.extend(_children(pid))
        return seen


class MachineMeter:
    """The whole machine's CPU (``/proc/stat``: every process, kernel threads included, other users'
    too), sampled every ``interval_s``: busy cores over time, to tell the part of a run bound by the
    CPU from its tail, where the last prompts wait on the endpoint with cores idle."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []  # (time, busy core-s, idle core-s) so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="machine-meter", daemon=True)

    @staticmethod
    def _read() -> tuple[float, float]:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:9]]
        user, nice, system, idle, iowait, irq, softirq, steal = fields
        tick = os.sysconf("SC_CLK_TCK")
        return (user + nice + system + irq + softirq + steal) / tick, (idle + iowait) / tick

    def start(self) -> MachineMeter:
        self.samples.append((time.time(), *self._read()))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.time(), *self._read()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append((time.time(), *self._read()))

    def between(self, t0: float, t1: float) -> tuple[float, float]:
        """Busy and idle core-seconds between two instants (to the nearest samples)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples[-1:]
        first = max((s for s in self.samples if s[0] <= t0), default=inside[0])
        last = inside[-1]
        return last[1] - first[1], last[2] - first[2]

    def per_second(self, t0: float) -> list[float]:
        """Busy cores in each whole second after ``t0``."""
        out = []
        t = t0
        while t + 1 <= self.samples[-1][0] + 1e-9:
            busy, idle = self.between(t, t + 1)
            out.append(busy / max(busy + idle, 1e-9) * (os.cpu_count() or 1))
            t += 1
        return out


def _sandbox_ready_at(meta: dict) -> float | None:
    """When a prompt's sandbox had started, from its record (its end, to the second, less its duration,
    plus its wait for a start slot and the start itself)."""
    try:
        end = dt.datetime.fromisoformat(meta["timestamp"]).timestamp()
        return end - meta["duration_s"] + meta["sandbox_start_wait_s"] + meta["sandbox_start_s"]
    except (KeyError, TypeError, ValueError):
        return None


def percentiles(values: list[float]) -> str:
    if not values:
        return "no data"
    v = sorted(values)

    def at(q: float) -> float:
        return v[min(len(v) - 1, int(q * len(v)))]

    return (
        f"median {statistics.median(v):.3f} s, p90 {at(0.9):.3f} s, p99 {at(0.99):.3f} s, max {v[-1]:.3f} s"
    )


def _network_on(extra: list[str]) -> bool:
    """Whether the run's prompts get the network: ``--sandbox_network`` among the runner's flags, read
    as batch_runner.py reads it (on when not given)."""
    on = True
    for flag in extra:
        name, _, value = flag.partition("=")
        if name == "--sandbox_network":
            on = parse_bool(value, name) if value else True
    return on


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--latency", type=float, default=2.0, help="seconds the endpoint takes per call")
    p.add_argument("--in_flight", type=int, default=1000, help="prompts in flight in all")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=100)
    p.add_argument("--backend", choices=("local", "docker"), default="local")
    p.add_argument("--image", default=DOCKER_IMAGE, help="image for --backend docker")
    p.add_argument("--max_sandbox_starts", type=int, default=None, help="default: the runner's own")
    p.add_argument("--distribution", default="terminal_only")
    p.add_argument("--pss_s", type=float, default=1.0, help="PSS sampling interval; 0: off")
    p.add_argument("--extra", action="append", default=[], help="another flag for batch_runner.py")
    p.add_argument("--keep", action="store_true", help="keep the output directory")
    p.add_argument("--floor", action="store_true",
                   help="measure the prompt's floor (floor.py) just before and just after the run")  # fmt: skip
    args = p.parse_args()
    tmp, dataset, endpoint = start_benchmark(p, args, "br-scale-")
    per_worker = args.in_flight // args.workers
    print(
        f"{args.prompts} prompts, {args.distribution}, backend {args.backend}, {args.workers} workers x "
        f"{per_worker} = {args.in_flight} in flight, latency {args.latency:g} s; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    run_name = "scale"
    starts = [] if args.max_sandbox_starts is None else [f"--max_sandbox_starts={args.max_sandbox_starts}"]
    cmd = runner_argv(
        dataset, tmp, run_name, endpoint, args.batch_size, args.distribution, args.workers, per_worker,
        args.backend, args.image, *args.extra, *starts,
    )  # fmt: skip
    floors = [floor.measure(exclude=frozenset({endpoint.proc.pid}))] if args.floor else []
    try:
        endpoint.reset()
        endpoint_cpu0 = endpoint.cpu_s()
        cpu0 = children_cpu_s()
        log_path = tmp / "run.log"
        with log_path.open("w") as log:
            machine = MachineMeter(interval_s=0.1).start()  # fine enough for the launch and the end
            t0 = time.time()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            pss = PssMeter(proc.pid, {endpoint.proc.pid}, args.pss_s, endpoint).start()
            code = proc.wait()
            wall = time.time() - t0
            pss.stop()
            machine.stop()
        reap_descendants(exclude={endpoint.proc.pid})
        tree_cpu = children_cpu_s() - cpu0
        stats = endpoint.stats()
        endpoint_cpu = endpoint.cpu_s() - endpoint_cpu0
        if code != 0:
            tail = log_path.read_text(errors="replace").replace("\r", "\n").splitlines()[-15:]
            print(f"runner exited with {code}:", *tail, sep="\n  ", file=sys.stderr)
        if args.floor:
            floors.append(floor.measure(exclude=frozenset({endpoint.proc.pid})))
        records = []
        merged = tmp / run_name / "trajectories.jsonl"
        if merged.exists():
            with merged.open() as fh:
                records = [json.loads(line) for line in fh if line.strip()]
    finally:
        endpoint.stop()
    n = args.prompts
    calls = stats["requests"]
    limit = min(args.in_flight, n)
    ideal = calls * args.latency / limit
    first, last = stats.get("first_request_at"), stats.get("last_response_at")
    dispatch = (last - first) if first and last else float("nan")
    metas = [r["metadata"] for r in records]
    print(f"  exit code          {code}; {len(records)} trajectories of {n}")
    print(f"  first request      {first - t0 if first else float('nan'):7.2f} s after launch")
    print(
        f"  wall               {wall:7.2f} s whole command; {dispatch:.2f} s first request -> last response"
    )
    print(f"  ideal              {ideal:7.2f} s = {calls} calls x {args.latency:g} s / {limit} in flight")
    print(f"  efficiency         {ideal / wall:7.2f} whole command; {ideal / dispatch:.2f} dispatch")
    print(
        f"  max in flight      {stats['max_in_flight']:7d} requests at the endpoint at once (limit {limit})"
    )
    print(
        f"  CPU                {tree_cpu:7.2f} s whole tree, exact = {1000 * tree_cpu / n:.1f} ms/prompt; "
        f"endpoint {endpoint_cpu:.2f} s ({1000 * endpoint_cpu / max(calls, 1):.2f} ms/call, same cores)"
    )
    if floors:
        network = _network_on(args.extra)
        each = [f.with_network if network else f.without_network for f in floors]
        mean = statistics.mean(each)
        print(
            f"  floor              {mean:7.1f} ms/prompt {'with' if network else 'without'} the network "
            f"(before {each[0]:.1f}, after {each[-1]:.1f}; floor.py); CPU / floor {1000 * tree_cpu / n / mean:.2f}"
        )
        for when, f in zip(("before", "after"), floors, strict=False):
            print(f"    {when:<6} {f.line()}")
    cores = os.cpu_count() or 1
    bound = max(ideal, tree_cpu / cores)
    print(
        f"  bound              {bound:7.2f} s = max(ideal, tree CPU / {cores} cores); wall / bound "
        f"{wall / bound:.2f} whole command, {dispatch / bound:.2f} dispatch"
    )
    # The fake endpoint runs on the same cores (a real one does not): the cores the machine gives the
    # run are what the endpoint leaves, so the bound the run itself cannot beat counts the endpoint's
    # CPU too, (tree + endpoint) / cores. Both lines are printed; the first is issue 26's letter.
    shared = max(ideal, (tree_cpu + endpoint_cpu) / cores)
    print(
        f"  bound, endpoint in {shared:7.2f} s = max(ideal, (tree + endpoint CPU) / {cores} cores); wall / bound "
        f"{wall / shared:.2f} whole command, {dispatch / shared:.2f} dispatch"
    )
    if first and last:
        # The launch (to the first request) and the end (from the last response) are mostly one
        # process's work: the cores they leave idle no schedule of the dispatch can use. Counted in,
        # the bound is what the dispatch itself could reach with the run's launch and end as they are.
        idle_launch, idle_end = machine.between(t0, first)[1], machine.between(last, t0 + wall)[1]
        ends = max(ideal, (tree_cpu + endpoint_cpu + idle_launch + idle_end) / cores)
        print(
            f"  launch and end     {first - t0:.2f} s and {t0 + wall - last:.2f} s, leaving {idle_launch:.2f} and "
            f"{idle_end:.2f} core-s idle"
        )
        print(
            f"  bound, ends in     {ends:7.2f} s = max(ideal, (tree + endpoint CPU + that idle) / {cores} cores); "
            f"wall / bound {wall / ends:.2f}: what the dispatch's schedule loses"
        )
    busy, idle = machine.between(t0, t0 + wall)
    print(f"  machine CPU        {busy:7.2f} core-s busy, {idle:.2f} idle over the command (every process)")
    # Every process's work of the run (the tree's, the endpoint's on the same cores, the kernel threads'
    # teardown of the sandboxes' namespaces) takes its CPU whatever the schedule: no schedule that does
    # this work on these cores ends before it is done, and that floor holds the ratio however the work
    # is ordered (what else ran on the machine meanwhile is counted too: measure it idle).
    print(
        f"  machine floor      {busy / cores:7.2f} s = that busy / {cores} cores: {busy / cores / bound:.2f} x bound "
        "however scheduled (wall <= 1.25 x bound needs it at most 1.25)"
    )
    # The fake endpoint's share is what a remote endpoint would not take from these cores.
    remote = (busy - endpoint_cpu) / cores
    print(
        f"                     less the endpoint's CPU (a remote endpoint's): {remote:.2f} s = "
        f"{remote / bound:.2f} x bound"
    )
    ready = [r for r in map(_sandbox_ready_at, metas) if r is not None]
    if ready:
        last_ready = max(ready)
        before, after = machine.between(t0, last_ready), machine.between(last_ready, t0 + wall)
        print(
            f"  last sandbox start {last_ready - t0:7.2f} s after launch (records, to the second): idle "
            f"{before[1]:.2f} core-s before it, {after[1]:.2f} after it"
        )
        # How the starts spread over the run (records: to the second), against how fast the machine
        # starts them doing nothing else (benchmarks/start_rate.py).
        per_second = [0] * (int(last_ready - t0) + 1)
        for r in ready:
            per_second[max(0, int(r - t0))] += 1
        print(f"  starts / second    {' '.join(str(n) for n in per_second)}")
        # Its prompt still makes its later calls after it, whatever the schedule (two of 2 s here), and
        # the run ends after that: wall / bound <= 1.25 needs the last start this early, with this tail.
        tail = t0 + wall - last_ready
        print(
            f"  tail               {tail:7.2f} s from the last start to the exit: wall <= 1.25 x bound needs "
            f"the last start by {1.25 * bound - tail:.2f} s ({1.25 * shared - tail:.2f} s with the endpoint in)"
        )
    last_sent = stats.get("last_request_at")
    if last_sent and last:
        # Whatever the schedule, the run ends one call after its last call was sent, and the work that
        # must come before each prompt's last call (its start, its commands, its earlier calls and the
        # endpoint's answers to them) is all done by then. So no schedule of this work ends before
        # (that work) / cores + one call. Until the last send the machine was busy `busy_before`; part
        # of it was work that could have come after (what the prompts done by then did after their own
        # last call: the answer read, the record, the sandbox's stop), estimated per prompt from the
        # prompts that ended after the last send (their work between it and the last response).
        busy_before = machine.between(t0, last_sent)[0]
        busy_after = machine.between(last_sent, last)[0]
        ended_after = sum(
            1 for m in metas if dt.datetime.fromisoformat(m["timestamp"]).timestamp() >= int(last_sent)
        )
        movable = busy_after / max(ended_after, 1) * (len(metas) - ended_after)
        floor_s = max(busy_before - movable, 0.0) / cores + args.latency
        print(
            f"  schedule floor     {floor_s:7.2f} s = (machine busy {busy_before:.2f} core-s until the last call "
            f"was sent at {last_sent - t0:.2f} s, less {movable:.2f} that could come after it: {ended_after} "
            f"prompts ended after it, {busy_after:.2f} core-s) / {cores} cores + one call"
        )
        print(
            f"                     wall / floor {wall / floor_s:.2f} (what the schedule loses), floor / bound "
            f"{floor_s / bound:.2f} (the work itself: 1.25 needs it below)"
        )
    timeline = " ".join(f"{c:.1f}" for c in machine.per_second(t0))
    print(f"  busy cores/second  {timeline}")
    if pss.peak_kb:
        per = pss.peak_kb / 1024 / max(pss.peak_in_flight, 1)
        print(
            f"  peak PSS           {pss.peak_kb / 1024:7.0f} MB of the tree ({pss.peak_processes} processes), "
            f"{pss.peak_in_flight} requests in flight then: {per:.2f} MB per prompt in flight"
        )
    for key in ("sandbox_start_wait_s", "sandbox_start_s", "sandbox_start_blocked_s"):
        print(f"  {key:<24} {percentiles([m[key] for m in metas if key in m])}")
    if args.keep:
        print(f"  output in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
