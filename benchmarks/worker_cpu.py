#!/usr/bin/env python3
"""The worker's own CPU per prompt, measured in one process: the prompt code as a worker runs it
(``run_prompt``: the agent loop, the model client, the local sandbox's host side, the tools, the
record), several prompts at a time on threads, against the fake endpoint in its own process.

    python benchmarks/worker_cpu.py                      # 200 prompts a round, 5 rounds, network on
    python benchmarks/worker_cpu.py --network 0          # --sandbox_network=False
    python benchmarks/worker_cpu.py --in_flight 250 --latency 0.5  # many prompts really in flight
    python benchmarks/worker_cpu.py --profile 40         # and the split: the 40 largest steps (yappi)

"own" is this process's CPU (user + system, every thread): what a worker spends itself, without the
sandbox's processes (bwrap, the command server, slirp4netns), the parent, or the pipe to it. The
workload is ``throughput.py``'s (``terminal_only``: three model calls, ``terminal``, ``write_file``,
``read_file``). Without the parent, the run's other workers and a thousand threads, this figure
moves a few per cent from round to round where a whole run moves tens of per cent: it is the one to
compare two versions of the worker's code with (alternate them). ``--profile`` needs ``pip install
yappi`` (a CPU clock over all threads); its figures are inflated several times by the profiler, most
where a step makes many small calls: read them as shares, not as milliseconds.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import Endpoint, become_subreaper, reap_descendants  # noqa: E402

from batchrun.prompt.attempt import WorkerSettings, run_prompt  # noqa: E402
from batchrun.prompt.llm import LLMClient, LLMConfig  # noqa: E402
from batchrun.prompt.loop import LoopLimits  # noqa: E402
from batchrun.prompt.sandboxes.local import network_hub  # noqa: E402
from batchrun.prompt.sandboxes.local.host import bwrap_problem  # noqa: E402
from batchrun.prompt.sandboxes.local.sandbox import LocalSandbox  # noqa: E402
from batchrun.protocol import PromptJob  # noqa: E402

TOPICS = ["disk usage", "log rotation", "a CSV summary", "cron syntax", "file permissions", "a backup plan"]
# The steps the split names (cumulative): each is a part of a prompt's path through the worker.
STEPS = [
    ("run_prompt", "the prompt's own thread"),
    ("LLMClient.chat", "  model calls (request JSON, HTTP, answer JSON, the turn)"),
    ("Client.request", "    of it the HTTP client"),
    ("BackgroundStart._start", "  sandbox start (host side)"),
    ("CommandServer.connect_network", "    of it the network"),
    ("execute_tool_call", "  tool calls"),
    ("_record", "  the record"),
    ("quality_problem", "  the sample's checks"),
    ("PromptSandbox._stop", "  sandbox stop"),
]


def job(i: int) -> PromptJob:
    prompt = (
        f"Task {i}: inspect the working directory and write a short note about {TOPICS[i % len(TOPICS)]}."
    )
    return PromptJob(batch_num=0, prompt_index=i, prompt=prompt, toolsets=("terminal", "file"))


def own_cpu_s() -> tuple[float, float]:
    """This process's user and system CPU, every thread."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime, me.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200, help="prompts a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--in_flight", type=int, default=8, help="prompts at a time (threads)")
    ap.add_argument("--network", type=int, choices=(0, 1), default=1)
    ap.add_argument("--latency", type=float, default=0.0, help="the endpoint's seconds a call (0: none)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="then one profiled round: N steps")
    args = ap.parse_args()
    if bwrap_problem():
        raise SystemExit(f"bubblewrap: {bwrap_problem()}")
    become_subreaper()
    endpoint = Endpoint(args.latency)
    options = LocalSandbox.prepare_run("worker-cpu", {"isolation": "bwrap"}, workers_here=True)
    settings = WorkerSettings(
        run_name="worker-cpu",
        llm=LLMConfig(model="fake", base_url=endpoint.base_url, api_key="sk-benchmark"),
        limits=LoopLimits(max_turns=6, prompt_timeout_s=120, tool_timeout_s=60),
        sandbox_backend="local",
        sandbox_options=options,
        sandbox_network=bool(args.network),
    )
    llm = LLMClient(settings.llm)
    pool = ThreadPoolExecutor(args.in_flight)
    counter = iter(range(10**9))

    kernel: list[float] = []  # each round's system CPU a prompt (ms)

    def one_round(n: int) -> float:
        jobs = [job(next(counter)) for _ in range(n)]
        user0, sys0 = own_cpu_s()
        outcomes = list(pool.map(lambda j: run_prompt(j, settings, llm), jobs))
        user1, sys1 = own_cpu_s()
        spent = (user1 - user0) + (sys1 - sys0)
        kernel.append((sys1 - sys0) / n * 1000)
        bad = [o for o in outcomes if o.kind != "trajectory"]
        if bad:
            raise SystemExit(f"{len(bad)} prompt(s) did not end as trajectories: {bad[0]}")
        network_hub.close_hub()  # the worker's slirp4netns (network_hub) would outlive the round
        reap_descendants(exclude={endpoint.proc.pid})
        return spent / n * 1000

    try:
        one_round(20)  # warm-up: imports, connections, the first sandbox's set-up
        kernel.clear()
        figures = [one_round(args.prompts) for _ in range(args.rounds)]
        print(
            f"{args.prompts} prompts a round, {args.in_flight} at a time, network {'on' if args.network else 'off'}, "
            f"{args.latency} s a call; "
            f"the worker's own CPU per prompt (ms): {' '.join(f'{f:.2f}' for f in figures)}; "
            f"median {statistics.median(figures):.2f}, of it in the kernel (system time) "
            f"{statistics.median(kernel):.2f}"
        )
        if args.profile:
            profile(one_round, args.prompts, args.profile)
    finally:
        LocalSandbox.sweep(options)
        endpoint.proc.kill()


def profile(one_round, prompts: int, top: int) -> None:
    try:
        import yappi
    except ImportError:
        raise SystemExit("--profile needs yappi: pip install yappi") from None
    yappi.set_clock_type("cpu")
    yappi.start()
    per_prompt = one_round(prompts)
    yappi.stop()
    stats = {f.name: f for f in yappi.get_func_stats()}
    total = per_prompt * prompts / 1000  # the round's CPU, every thread (the start runs on its own)
    print(f"profiled round: {per_prompt:.2f} ms a prompt (the profiler's own cost included); shares of it:")
    for name, label in STEPS:
        if name in stats and total:
            print(f"  {label:<62} {stats[name].ttot / total:6.1%}")
    print(f"the {top} functions with the most CPU of their own (ms a prompt, profiled):")
    for f in sorted(stats.values(), key=lambda f: -f.tsub)[:top]:
        print(f"  {f.tsub / prompts * 1000:7.3f}  {f.name} ({Path(f.module).name})")
    yappi.clear_stats()


if __name__ == "__main__":
    main()
