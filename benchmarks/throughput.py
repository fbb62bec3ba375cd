#!/usr/bin/env python3
"""Throughput of the runner, run as a user runs it, against the fake endpoint with a set latency.

    python benchmarks/throughput.py --prompts 200 --latency 0.1 --workers 4 --in_flight 40
    python benchmarks/throughput.py --prompts 2000 --in_flight 200 --no-reference
    python benchmarks/throughput.py --prompts 100 --in_flight 40 --sandbox docker

The fake endpoint (``python -m batchrun.fakes.fake_model``) runs in its own process. ``batch_runner.py``
runs as a subprocess with the real pool, twice on the same dataset: with ``--in_flight`` prompts
in flight (``--prompts_per_worker = in_flight / workers``), then with reference-style scheduling
(``--prompts_per_worker=1``: one prompt per worker process at a time). For each run it prints:

* wall time of the whole command, and of the dispatch phase (the endpoint's first request to its
  last response, from ``/stats``);
* the most requests in flight the endpoint saw, and the limit;
* efficiency = ideal / actual, ideal = model calls x latency / in-flight limit (dispatch phase,
  and whole command);
* CPU seconds per prompt of the runner's process tree: exact for the whole command (this script
  is a child subreaper and reaps every descendant, so ``RUSAGE_CHILDREN`` holds them all), split
  by sampling ``/proc`` every ``--sample_s`` into the parent, the worker processes (Python) and
  the tool processes the workers ran (bwrap, bash, ...); the same split over the dispatch phase;
* the parent's CPU share (of one core, over the dispatch phase);
* the endpoint's own CPU (it shares the machine's cores with the runner).

With ``--sandbox docker`` (image batch-runner-test:latest, see tests/docker_image/build.sh) it
also prints the per-prompt sandbox overhead: from the records' ``metadata.sandbox_start_s`` /
``sandbox_stop_s`` when the runner writes them, else from the engine's container events
(create -> start, and kill -> destroy), per container; and what each prompt itself waited:
``sandbox_start_blocked_s`` (its first tool call waiting for a start that overlapped its first
model call) and that plus ``sandbox_stop_s`` (the stop runs in the background).

Numbers vary with the machine's load: the CPU per prompt is the steadier figure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36
DOCKER_IMAGE = "batch-runner-test:latest"
KINDS = ("parent", "workers", "tools", "helpers")


# ----------------------------------------------------------------------------- the endpoint


class Endpoint:
    """``python -m batchrun.fakes.fake_model`` in its own process."""

    def __init__(self, latency_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchrun.fakes.fake_model", "--port", "0", "--latency", str(latency_s)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.base_url = self.proc.stdout.readline().strip()
        if not self.base_url.startswith("http"):
            raise RuntimeError(f"fake endpoint did not start: {self.base_url!r}")

    def _call(self, method: str, path: str) -> dict:
        url = self.base_url.rsplit("/v1", 1)[0] + path
        req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict:
        return self._call("GET", "/stats")

    def reset(self) -> None:
        self._call("POST", "/reset")

    def cpu_s(self) -> float:
        return sum(_stat(self.proc.pid)[3:5]) / CLK_TCK if _stat(self.proc.pid) else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


# ----------------------------------------------------------------------------- CPU of a process tree


def _stat(pid: int) -> tuple[str, str, int, int, int, int, int, int] | None:
    """(comm, state, ppid, utime, stime, cutime, cstime, starttime) from /proc/<pid>/stat, in ticks."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    f = text[text.rindex(")") + 2 :].split()
    return comm, f[0], int(f[1]), int(f[11]), int(f[12]), int(f[13]), int(f[14]), int(f[19])


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out.update(int(c) for c in fh.read().split())
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Proc:
    role: str  # parent | forkserver | worker | helper
    self_ticks: int = 0  # utime + stime
    child_ticks: int = 0  # cutime + cstime: the processes it reaped (tool commands, for a worker)


@dataclass
class Sample:
    """CPU seconds used so far (or over a phase), by kind of process."""

    t: float  # time.time() (or, for a phase, its length)
    parent: float
    workers: float  # the worker processes' own CPU
    tools: float  # the tool commands they ran (bwrap, bash, ...), orphans included
    helpers: float  # forkserver, resource tracker


@dataclass
class TreeMeter:
    """Samples the CPU of the runner's Python processes and, through the workers, of their tool commands.

    Tool commands (bwrap, bash, ...) live milliseconds; their CPU is read as the workers'
    cutime + cstime once the worker reaped them, so they are never sampled themselves.
    """

    root: int
    exclude: set[int]
    interval_s: float
    procs: dict[tuple[int, int], Proc] = field(default_factory=dict)
    orphan_s: float = 0.0  # CPU of reaped orphans (tool processes)
    orphans: int = 0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> TreeMeter:
        self._thread = threading.Thread(target=self._loop, name="tree-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        self._reap_orphans()
        # Python processes of the tree: the parent, what it started, and orphans reparented to us.
        todo = [self.root, *(_children(os.getpid()) - self.exclude - {self.root})]
        seen: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            st = _stat(pid)
            if st is None or not st[0].startswith("python"):
                continue
            comm, state, ppid, ut, stime, cut, cst, start = st
            key = (pid, start)
            proc = self.procs.get(key)
            if proc is None:
                proc = self.procs[key] = Proc(self._role(pid, ppid))
            if state != "Z":  # a zombie's cutime may already be folded in; keep the last live reading
                proc.self_ticks, proc.child_ticks = ut + stime, cut + cst
            if proc.role in ("parent", "forkserver", "helper"):
                todo.extend(_children(pid))
        self.samples.append(self._totals(time.time()))

    def _reap_orphans(self) -> None:
        """Reap tool processes orphaned to us: bwrap leaves one process per command that its own
        parent never waits for (without a subreaper, init reaps it and its CPU shows nowhere)."""
        for pid in _children(os.getpid()) - self.exclude - {self.root}:
            st = _stat(pid)
            if st is None or st[1] != "Z" or st[0].startswith("python"):
                continue
            try:
                _, _, ru = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            self.orphan_s += ru.ru_utime + ru.ru_stime
            self.orphans += 1

    def _role(self, pid: int, ppid: int) -> str:
        if pid == self.root:
            return "parent"
        cmd = _cmdline(pid)
        if "multiprocessing.forkserver" in cmd:
            forkservers = {k[0] for k, p in self.procs.items() if p.role == "forkserver"}
            return "worker" if ppid in forkservers else "forkserver"
        return "helper"  # resource tracker, ...

    def _totals(self, t: float) -> Sample:
        by = {"parent": 0.0, "workers": 0.0, "tools": self.orphan_s, "helpers": 0.0}
        for p in self.procs.values():
            if p.role == "parent":
                by["parent"] += p.self_ticks / CLK_TCK
            elif p.role == "worker":
                by["workers"] += p.self_ticks / CLK_TCK
                by["tools"] += p.child_ticks / CLK_TCK
            else:
                by["helpers"] += p.self_ticks / CLK_TCK
        return Sample(t, **by)

    def at(self, t: float) -> Sample:
        """The totals at time ``t``, interpolated between samples."""
        s = self.samples
        if not s:
            return Sample(t, 0.0, 0.0, 0.0, 0.0)
        if t <= s[0].t:
            return s[0]
        for a, b in zip(s, s[1:], strict=False):
            if a.t <= t <= b.t:
                w = (t - a.t) / (b.t - a.t) if b.t > a.t else 0.0
                mix = {k: getattr(a, k) + w * (getattr(b, k) - getattr(a, k)) for k in KINDS}
                return Sample(t, **mix)
        return s[-1]


def become_subreaper() -> None:
    """Orphaned descendants (the forkserver, workers ended by terminate) are reparented to us, so
    reaping them folds their CPU into our RUSAGE_CHILDREN."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_descendants(exclude: set[int], timeout_s: float = 30.0) -> None:
    """Wait for every child of ours but ``exclude`` (orphans keep arriving while the tree winds down)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = _children(os.getpid()) - exclude
        if not kids:
            return
        for pid in kids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.02)
    print(f"warning: descendants still alive after {timeout_s} s: {sorted(kids)}", file=sys.stderr)


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    label: str
    prompts: int
    in_flight_limit: int
    wall_s: float
    dispatch_s: float
    model_calls: int
    max_in_flight: int
    tree_cpu_s: float  # exact: everything the command ran
    parent_cpu_s: float  # exact: the parent process alone
    whole: Sample  # sampled split over the whole command (last reading of every process)
    dispatch: Sample  # sampled split over the dispatch phase
    endpoint_cpu_s: float
    exit_code: int
    records: list[dict]
    run_dir: Path
    engine_events: list[dict] = field(default_factory=list)  # docker events seen during the run


def make_dataset(path: Path, n: int) -> None:
    topics = [
        "disk usage",
        "log rotation",
        "a CSV summary",
        "cron syntax",
        "file permissions",
        "a backup plan",
    ]
    with path.open("w") as fh:
        for i in range(n):
            prompt = f"Task {i}: inspect the working directory and write a short note about {topics[i % len(topics)]}."
            fh.write(json.dumps({"prompt": prompt}) + "\n")


def runner_argv(
    dataset: Path,
    out: Path,
    run_name: str,
    endpoint: Endpoint,
    batch_size: int,
    distribution: str,
    workers: int,
    per_worker: int,
    sandbox: str,
    image: str,
    *extra: str,
) -> list[str]:
    """``batch_runner.py`` as the benchmarks run it against the fake endpoint; ``extra``: more flags."""
    cmd = [
        sys.executable, str(ROOT / "batch_runner.py"),
        f"--dataset_file={dataset}", f"--batch_size={batch_size}", f"--run_name={run_name}",
        "--model=fake", f"--base_url={endpoint.base_url}", "--api_key=sk-benchmark",
        f"--distribution={distribution}", f"--num_workers={workers}",
        f"--prompts_per_worker={per_worker}", f"--sandbox={sandbox}", f"--output_dir={out}", *extra,
    ]  # fmt: skip
    if sandbox == "docker":
        cmd.append(f"--default_image={image}")
    return cmd


def start_benchmark(
    p: argparse.ArgumentParser, args: argparse.Namespace, prefix: str
) -> tuple[Path, Path, Endpoint]:
    """The common start: in-flight check, subreaper, a temp directory with the dataset, the endpoint."""
    if args.in_flight % args.workers:
        p.error("--in_flight must be a multiple of --workers")
    become_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    dataset = tmp / "prompts.jsonl"
    make_dataset(dataset, args.prompts)
    return tmp, dataset, Endpoint(args.latency)


def run_once(
    label: str, args: argparse.Namespace, endpoint: Endpoint, dataset: Path, out: Path, per_worker: int
) -> RunResult:
    run_name = f"tp_{label}"
    cmd = runner_argv(
        dataset, out, run_name, endpoint, args.batch_size, args.distribution, args.workers, per_worker,
        args.sandbox, args.image, f"--max_sandbox_starts={args.max_sandbox_starts}",
    )  # fmt: skip
    events = EngineEvents(run_name) if args.sandbox == "docker" else None
    endpoint.reset()
    endpoint_cpu0 = endpoint.cpu_s()
    cpu0 = children_cpu_s()
    log = (out / f"{run_name}.log").open("w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    meter = TreeMeter(root=proc.pid, exclude={endpoint.proc.pid}, interval_s=args.sample_s).start()
    # Wait without reaping: the zombie's /proc/<pid>/stat still holds the parent's own CPU.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    wall = time.time() - t0
    meter.stop()
    meter.sample()
    st = _stat(proc.pid)
    parent_cpu = (st[3] + st[4]) / CLK_TCK if st else float("nan")
    code = proc.wait()
    log.close()
    engine_events = events.stop() if events is not None else []
    reap_descendants(exclude={endpoint.proc.pid})
    tree_cpu = children_cpu_s() - cpu0
    stats = endpoint.stats()
    endpoint_cpu = endpoint.cpu_s() - endpoint_cpu0
    first, last = stats.get("first_request_at"), stats.get("last_response_at")
    dispatch_s = (last - first) if first and last else float("nan")
    t_end = meter.samples[-1]
    a, b = (meter.at(first), meter.at(last)) if first and last else (t_end, t_end)
    dispatch = Sample(dispatch_s, *(getattr(b, k) - getattr(a, k) for k in KINDS))
    if code != 0:
        tail = (out / f"{run_name}.log").read_text(errors="replace").replace("\r", "\n").splitlines()[-15:]
        print(
            f"runner exited with {code}; last lines of {out / run_name}.log:",
            *tail,
            sep="\n  ",
            file=sys.stderr,
        )
    records = []
    merged = out / run_name / "trajectories.jsonl"
    if merged.exists():
        with merged.open() as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    return RunResult(
        label=label,
        prompts=args.prompts,
        in_flight_limit=args.workers * per_worker,
        wall_s=wall,
        dispatch_s=dispatch_s,
        model_calls=stats["requests"],
        max_in_flight=stats["max_in_flight"],
        tree_cpu_s=tree_cpu,
        parent_cpu_s=parent_cpu,
        whole=t_end,
        dispatch=dispatch,
        endpoint_cpu_s=endpoint_cpu,
        exit_code=code,
        records=records,
        run_dir=out / run_name,
        engine_events=engine_events,
    )


# ----------------------------------------------------------------------------- docker overhead


class EngineEvents:
    """The engine's events for this run's containers, streamed while it runs (the engine keeps
    too few past events to ask for them afterwards)."""

    def __init__(self, run_name: str):
        import docker

        self._client = docker.from_env()
        self._stream = self._client.events(
            decode=True, filters={"type": "container", "label": f"batch_runner.run_name={run_name}"}
        )
        self.events: list[dict] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for ev in self._stream:
                self.events.append(ev)
        except Exception:  # the stream was closed by stop()
            pass

    def stop(self) -> list[dict]:
        time.sleep(1.0)  # the last removals' events
        self._stream.close()
        self._thread.join(timeout=5)
        self._client.close()
        return list(self.events)


def docker_overhead(run: RunResult, events: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per-prompt sandbox overhead, from the records' metadata and from the engine's container events.

    The metadata's ``sandbox_start_s`` is the backend's start, ``sandbox_start_wait_s`` the wait for a
    start-up slot before it, ``sandbox_start_blocked_s`` what the prompt itself waited for the start
    (the start overlaps its first model call) and ``sandbox_stop_s`` what it waited for the stop (a
    hand-off when ``sandbox_stop_background``). The engine's events time its own work: create ->
    start, and kill (or die) -> destroy (``events``: from :class:`EngineEvents`).
    """
    out: dict[str, dict[str, list[float]]] = {}
    metas = [r.get("metadata", {}) for r in run.records]
    if metas and all("sandbox_start_s" in m and "sandbox_stop_s" in m for m in metas):
        out["records' metadata"] = {
            "start": [m["sandbox_start_s"] for m in metas],
            "stop": [m["sandbox_stop_s"] for m in metas],
        }
        if all("sandbox_start_wait_s" in m for m in metas):
            out["records' metadata"]["waited for a start slot"] = [m["sandbox_start_wait_s"] for m in metas]
        if all("sandbox_start_blocked_s" in m for m in metas):
            # What the prompt itself waited: the start overlaps its first model call, the stop runs after
            # its outcome was sent (sandbox_stop_s is then the hand-off).
            blocked = [m["sandbox_start_blocked_s"] for m in metas]
            out["records' metadata"]["start blocked (prompt waited)"] = blocked
            out["records' metadata"]["overhead waited: blocked+stop"] = [
                b + m["sandbox_stop_s"] for b, m in zip(blocked, metas, strict=True)
            ]
    if not events:
        return out
    times: dict[str, dict[str, float]] = {}
    for ev in events:
        times.setdefault(ev["id"], {}).setdefault(ev["Action"], ev["timeNano"] / 1e9)
    start, stop = [], []
    for t in times.values():
        end = t.get("kill", t.get("die"))
        if "create" in t and "start" in t and end is not None and "destroy" in t:
            start.append(t["start"] - t["create"])
            stop.append(t["destroy"] - end)
    out["engine events"] = {"start": start, "stop": stop}
    return out


def engine_rate(containers: int) -> float:
    """The bare engine's containers per second with the runner's limits (docker_rate.py's engine loop),
    on the default bridge network, as the run's prompts get it (each is offered the terminal, and
    ``--sandbox_network`` is on by default): a container on the bridge costs the engine a veth pair
    and its firewall rules, one with network ``none`` neither."""
    from docker_rate import engine_api_rate  # this directory's; imports docker only when asked

    return engine_api_rate(containers, 4, f"tp-{os.getpid()}", "bridge")[0]


def container_rates(run: RunResult, engine_rates: list[float]) -> None:
    """The run's own container rate against the engine's, measured just before and after it.

    Two figures: over the dispatch phase (what a user waits: it includes the first start's latency and
    the last prompts' model calls and stop, where no container is made), and in the steady state, the
    engine's ``create`` events between the 10th and the 90th percentile of their times."""
    creates = sorted(e["timeNano"] / 1e9 for e in run.engine_events if e.get("Action") == "create")
    if len(creates) < 10:
        return
    whole = len(creates) / run.dispatch_s
    lo, hi = int(0.1 * len(creates)), int(0.9 * len(creates))
    steady = (hi - lo) / (creates[hi] - creates[lo])
    line = (
        f"  container rate        {whole:.2f}/s over dispatch, {steady:.2f}/s steady (create events, p10-p90)"
    )
    if engine_rates:
        engine = statistics.mean(engine_rates)
        line += (
            f"; engine alone {engine:.2f}/s (before {engine_rates[0]:.2f}, after {engine_rates[-1]:.2f}):"
            f" {whole / engine:.2f} and {steady / engine:.2f} of it"
        )
    print(line)


# ----------------------------------------------------------------------------- report


def report(run: RunResult, latency_s: float) -> dict:
    """Print one run's figures; returns them as a dict."""
    n = run.prompts
    ideal = run.model_calls * latency_s / run.in_flight_limit
    d, w = run.dispatch, run.whole
    ms = lambda seconds: 1000 * seconds / n  # noqa: E731 - per prompt, in ms
    own = d.parent + d.workers + d.helpers
    busy = own + d.tools
    out = {
        "label": run.label,
        "prompts": n,
        "in_flight_limit": run.in_flight_limit,
        "wall_s": round(run.wall_s, 3),
        "dispatch_s": round(run.dispatch_s, 3),
        "model_calls": run.model_calls,
        "max_in_flight": run.max_in_flight,
        "ideal_s": round(ideal, 3),
        "efficiency_dispatch": round(ideal / run.dispatch_s, 3),
        "efficiency_whole": round(ideal / run.wall_s, 3),
        "tree_cpu_ms_per_prompt": round(ms(run.tree_cpu_s), 2),
        "dispatch_python_cpu_ms_per_prompt": round(ms(own), 2),
        "dispatch_tool_cpu_ms_per_prompt": round(ms(d.tools), 2),
        "parent_cpu_share_dispatch": round(d.parent / run.dispatch_s, 4),
    }
    print(f"\n== {run.label}: {n} prompts, in-flight limit {run.in_flight_limit} (exit code {run.exit_code})")
    print(
        f"  wall time          {run.wall_s:7.2f} s whole command; {run.dispatch_s:.2f} s dispatch (endpoint's first request -> last response)"
    )
    print(
        f"  model calls        {run.model_calls:7d}   max in flight {run.max_in_flight} of {run.in_flight_limit}"
    )
    print(
        f"  ideal              {ideal:7.2f} s   = {run.model_calls} calls x {latency_s:g} s / {run.in_flight_limit}"
    )
    print(
        f"  efficiency         {ideal / run.dispatch_s:7.2f}   over dispatch; {ideal / run.wall_s:.2f} over the whole command"
    )
    print(
        f"  CPU, whole command {run.tree_cpu_s:7.2f} s   exact, whole process tree = {ms(run.tree_cpu_s):.1f} ms/prompt (parent alone {run.parent_cpu_s:.2f} s)"
    )
    print(
        f"    ms/prompt        parent {ms(w.parent):.1f} | workers {ms(w.workers):.1f} | tool processes {ms(w.tools):.1f} | forkserver+helpers {ms(w.helpers):.1f}  (sampled)"
    )
    print(
        f"  CPU, dispatch      {busy:7.2f} s   = {busy / run.dispatch_s:.2f} cores busy on average (sampled)"
    )
    print(
        f"    ms/prompt        parent {ms(d.parent):.1f} | workers {ms(d.workers):.1f} | tool processes {ms(d.tools):.1f}  -> runner's own (Python) CPU {ms(own):.1f} ms/prompt"
    )
    print(
        f"  parent CPU share   {d.parent / run.dispatch_s:7.1%}   of one core over dispatch ({d.parent / busy if busy else 0:.0%} of the tree's CPU then)"
    )
    print(
        f"  endpoint CPU       {run.endpoint_cpu_s:7.2f} s   ({1000 * run.endpoint_cpu_s / max(run.model_calls, 1):.2f} ms/call, on the same cores)"
    )
    kinds: dict[str, int] = {}
    for r in run.records:
        reason = r.get("metadata", {}).get("stop_reason", "?")
        kinds[reason] = kinds.get(reason, 0) + 1
    print(f"  trajectories       {len(run.records):7d}   {kinds}")
    return out


def _summary(values: list[float]) -> str:
    if not values:
        return "no data"
    v = sorted(values)
    p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
    return f"median {statistics.median(v):.3f} s, p90 {p90:.3f} s, max {v[-1]:.3f} s (n={len(v)})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--latency", type=float, default=0.1, help="seconds the endpoint takes per call")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--in_flight", type=int, default=40, help="prompts in flight in all (per worker: / workers)"
    )
    p.add_argument("--batch_size", type=int, default=10)
    p.add_argument("--max_sandbox_starts", type=int, default=8)
    p.add_argument("--sandbox", choices=("local", "docker"), default="local")
    p.add_argument("--image", default=DOCKER_IMAGE, help="image for --sandbox docker")
    p.add_argument("--distribution", default="terminal_only")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also run reference-style scheduling (--prompts_per_worker=1)")  # fmt: skip
    p.add_argument("--sample_s", type=float, default=0.1, help="CPU sampling interval")
    p.add_argument("--keep", action="store_true", help="keep the output directory")
    p.add_argument("--engine_rate", type=int, default=40, metavar="N",
                   help="--sandbox docker: the engine's own rate (docker_rate.py's engine loop, N "
                        "containers over 4 clients) just before and just after each run; 0: off")  # fmt: skip
    args = p.parse_args()
    tmp, dataset, endpoint = start_benchmark(p, args, "br-throughput-")
    print(
        f"{args.prompts} prompts, {args.distribution}, sandbox {args.sandbox}, {args.workers} workers, "
        f"latency {args.latency:g} s, endpoint {endpoint.base_url}, output in {tmp}; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    try:
        runs = []
        for label, per_worker in (("concurrent", args.in_flight // args.workers), ("reference", 1)):
            if label == "reference" and not args.reference:
                continue
            engine_rates = []
            if args.sandbox == "docker" and args.engine_rate:
                engine_rates.append(engine_rate(args.engine_rate))
            run = run_once(label, args, endpoint, dataset, tmp, per_worker)
            if engine_rates:
                engine_rates.append(engine_rate(args.engine_rate))
            report(run, args.latency)
            if args.sandbox == "docker":
                container_rates(run, engine_rates)
                for source, o in docker_overhead(run, run.engine_events).items():
                    print(f"  sandbox overhead per prompt ({source}):")
                    for what, values in o.items():
                        print(f"    {what:<31}{_summary(values)}")
                    both = [a + b for a, b in zip(o["start"], o["stop"], strict=True)]
                    print(f"    {'start + stop':<31}{_summary(both)}")
                    later = sum(bool(r["metadata"].get("sandbox_stop_background")) for r in run.records)
                    if source == "records' metadata" and later:
                        print(
                            f"    ({later} of {len(run.records)} stops ran in the background: 'stop' is the"
                            " hand-off; starts ran alongside the first model call)"
                        )
            runs.append(run)
        if len(runs) == 2:
            c, r = runs
            print(
                f"\nreference / concurrent: {r.wall_s / c.wall_s:.1f}x whole command, "
                f"{r.dispatch_s / c.dispatch_s:.1f}x dispatch phase, with {args.workers} worker processes each"
            )
    finally:
        endpoint.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
