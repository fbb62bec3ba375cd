"""CPU that one prompt's tool calls cost in the local sandbox, piece by piece, whole process tree.

The throughput benchmark's workload (``terminal_only`` against the fake model) makes three tool
calls per prompt: ``terminal`` (``echo <slug> && pwd``), ``write_file`` and ``read_file``. This
script runs exactly those calls, without a model, in a loop of fresh sandboxes, and adds them one
at a time, so each line's figure is the difference it makes:

    python benchmarks/sandbox_cpu.py --prompts 200
    python benchmarks/sandbox_cpu.py --prompts 200 --isolation none
    python benchmarks/sandbox_cpu.py --prompts 200 --network      # with the network a run gives by default

The sandboxes are a run's, as a worker makes them (``LocalSandbox.prepare_run``: the run's
directory and parent cgroup, whose emptied prompt cgroups are kept for the next prompt); the run is
swept at the end. The script makes itself a child subreaper, so the CPU of every process the sandbox starts (bwrap
orphans one) ends up in ``RUSAGE_CHILDREN`` when it is reaped. "python" is this process's own CPU
(starting processes, reading their output, the tools' Python code). CPU, not wall time: the
machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import become_subreaper, children_cpu_s, reap_descendants  # noqa: E402

from batchrun.prompt.sandboxes.base import SandboxSpec  # noqa: E402
from batchrun.prompt.sandboxes.local import LocalSandbox, bwrap_problem, network_hub  # noqa: E402
from batchrun.prompt.tools.catalog import execute_tool_call, tools_for_toolsets
from batchrun.prompt.tools.registry import ToolContext

OFFERED = {t.name for t in tools_for_toolsets(["terminal", "file"])}
CALLS = [
    ("terminal", lambda i: {"command": f"echo slug{i} && pwd"}),
    ("write_file", lambda i: {"path": f"notes/slug{i}.txt", "content": f"slug {i}\n" * 20}),
    ("read_file", lambda i: {"path": f"notes/slug{i}.txt"}),
]


def _cpu() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime, children_cpu_s()


def machine_busy_s() -> float:
    """The whole machine's busy CPU so far (``/proc/stat``: all but idle and iowait), kernel threads
    included: a network namespace is torn down by one, outside any process tree."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run(prompts: int, calls: int, options: dict, network: bool = False) -> tuple[float, float, float]:
    """Per-prompt CPU (own, children, whole machine) of start + the first ``calls`` tool calls + stop.
    The worker's network hub (one slirp4netns, see network_hub) is made again each time and ended
    before the figures are read, so its slirp4netns is counted too."""
    own0, kids0, busy0 = *_cpu(), machine_busy_s()
    for i in range(prompts):
        box = LocalSandbox(SandboxSpec("cpu-bench", i, network=network), **options)
        ctx = ToolContext(sandbox=box, tool_timeout_s=60.0)
        box.start()
        try:
            for name, args in CALLS[:calls]:
                out = json.loads(execute_tool_call(name, json.dumps(args(i)), ctx, OFFERED))
                if out.get("error"):
                    raise SystemExit(f"{name} failed: {out['error']}")
        finally:
            box.stop()
    network_hub.close_hub()
    reap_descendants(exclude=set())  # orphans bwrap left finish and are reaped by us, the subreaper
    own1, kids1, busy1 = *_cpu(), machine_busy_s()
    return (own1 - own0) / prompts * 1000, (kids1 - kids0) / prompts * 1000, (busy1 - busy0) / prompts * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap")
    ap.add_argument("--base_dir", default=None, help="where sandbox directories go (default: the temp dir)")
    ap.add_argument(
        "--network", action="store_true", help="the prompt's network on (slirp4netns), as in a run"
    )
    ap.add_argument(
        "--hub", action=argparse.BooleanOptionalAction, default=True,
        help="with --network as root: one slirp4netns for all prompts, each on a link of its own (as a "
        "run does); --no-hub: a slirp4netns per prompt",
    )  # fmt: skip
    args = ap.parse_args()
    if args.isolation == "bwrap" and bwrap_problem():
        raise SystemExit(f"bubblewrap: {bwrap_problem()}")
    network_hub.ENABLED = args.hub
    become_subreaper()
    options = LocalSandbox.prepare_run("cpu-bench", {"isolation": args.isolation}, workers_here=True)
    made = options["base_dir"]
    if args.base_dir:
        options["base_dir"] = args.base_dir
    try:
        measure(args, options)
    finally:
        LocalSandbox.sweep({**options, "base_dir": made})


def measure(args: argparse.Namespace, options: dict) -> None:
    # Warm-up: imports, the first tool call's set-up.
    run(5, len(CALLS), options, args.network)
    print(
        f"{args.prompts} prompts per line, local sandbox, isolation {args.isolation}, network {args.network}"
        f"{' (hub)' if args.network and args.hub else ''}, "
        f"load average {os.getloadavg()[0]:.1f}; ms of CPU per prompt"
    )
    print(
        f"  {'step':<34} {'python':>7} {'children':>9} {'total':>7}   {'added by the step':>17}"
        f"   {'machine':>7}"
    )
    previous = 0.0
    labels = ["sandbox start + stop"] + [f"+ {name}" for name, _ in CALLS]
    for calls, label in enumerate(labels):
        own, kids, machine = run(args.prompts, calls, options, args.network)
        total = own + kids
        print(
            f"  {label:<34} {own:7.2f} {kids:9.2f} {total:7.2f}   {total - previous:17.2f}   {machine:7.2f}"
        )
        previous = total


if __name__ == "__main__":
    main()
