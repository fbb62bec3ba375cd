"""What a sandbox made without bubblewrap would cost, beside the local sandbox's bubblewrap line.

Issue 26 sketches a sandbox "made from parts prepared once": a long-lived template process per
worker that holds the read-only system view and makes each prompt's namespaces itself, instead of
one ``bwrap`` run per prompt. This measures that design's primitive before anyone builds it, with
``template_floor.c`` (compiled here with ``cc``), each sandbox with the isolation the bubblewrap
line gives (see the C file: namespaces, a tmpfs root with the system directories read-only, its own
/dev and /proc, size-capped /tmp and working directory, the control directory read-only, no
capabilities), running ``sh -c true``:

- ``bubblewrap``: the local sandbox's own command line (``LocalSandbox._launch_argv``), one run each;
- ``launcher``: the same sandbox from a small program of ours run once per sandbox, as bwrap is;
- ``template``: one process prepares the view once and ``clone()``s every sandbox (with and without
  a network namespace).

CPU of the whole reaped tree per sandbox (the template's share of its own start included); rounds
alternate.

    sudo python benchmarks/template_floor.py --runs 300 --rounds 3
    sudo python benchmarks/template_floor.py --idle_tasks 3000   # as many tasks as 1,000 prompts in flight

``--idle_tasks``: that many sleeping threads in this process while both are measured. bubblewrap's
``pivot_root`` walks every task on the machine (``chroot_fs_refs``); the template moves its root
instead. Root only: the template makes namespaces without a user namespace of its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bwrap_floor import sandbox_argv  # noqa: E402
from throughput import become_subreaper, children_cpu_s, reap_descendants  # noqa: E402

from batchrun.prompt.sandboxes.local import bwrap_problem  # noqa: E402
from batchrun.prompt.sandboxes.local.system_view import run_etc_view  # noqa: E402

HERE = Path(__file__).resolve().parent


def bwrap_ms(argv: list[str], runs: int) -> float:
    before = children_cpu_s()
    for _ in range(runs):
        subprocess.run(argv, check=True)
    reap_descendants(set())
    return (children_cpu_s() - before) / runs * 1000


def launcher_ms(binary: str, runs: int, etc: str, ctl: str, root: str) -> float:
    return bwrap_ms([binary, "launch", "true", etc, ctl, root], runs)


def template_ms(binary: str, runs: int, network: bool, etc: str, ctl: str, root: str) -> tuple[float, float]:
    """CPU per sandbox of the whole template tree, and the share of it the sandboxes themselves took."""
    before = children_cpu_s()
    out = subprocess.run(
        [binary, "template", str(runs), "1" if network else "0", "true", etc, ctl, root],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    reap_descendants(set())
    total = (children_cpu_s() - before) / runs * 1000
    _template, sandboxes = (float(x) for x in out.stdout.split())
    return total, sandboxes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle_tasks", type=int, default=0, help="sleeping threads while measuring")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the template needs root (it makes namespaces without a user namespace)")
    if bwrap_problem():
        sys.exit(f"bubblewrap does not work here: {bwrap_problem()}")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("no C compiler (cc, gcc) to build template_floor.c")
    become_subreaper()
    base = tempfile.mkdtemp(prefix="template-floor-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    stop = threading.Event()
    try:
        binary = os.path.join(base, "template_floor")
        subprocess.run([cc, "-O2", "-o", binary, str(HERE / "template_floor.c")], check=True)
        threading.stack_size(64 << 10)
        for _ in range(args.idle_tasks):
            threading.Thread(target=stop.wait, daemon=True).start()
        etc = run_etc_view(base) or "/etc"
        ctl = os.path.join(base, "ctl")
        root = os.path.join(base, "root")
        os.mkdir(ctl)
        os.mkdir(root)
        bwrap = [*sandbox_argv(base), "/bin/sh", "-c", "true"]
        tasks = len(os.listdir("/proc"))  # processes, roughly; each thread of ours is a task too
        print(
            f"{args.runs} sandboxes per figure, sh -c true in each; ms of CPU per sandbox, whole tree; "
            f"load average {os.getloadavg()[0]:.1f}, ~{tasks} processes + {args.idle_tasks} idle threads"
        )
        for r in range(args.rounds):
            b = bwrap_ms(bwrap, args.runs)
            launched = launcher_ms(binary, args.runs, etc, ctl, root)
            t_net, s_net = template_ms(binary, args.runs, True, etc, ctl, root)
            t_off, _ = template_ms(binary, args.runs, False, etc, ctl, root)
            print(
                f"  round {r + 1}: bubblewrap {b:.2f} | launcher {launched:.2f} ({launched / b:.2f}x) | "
                f"template {t_net:.2f} ({t_net / b:.2f}x; the sandboxes' own {s_net:.2f}), "
                f"without a network namespace {t_off:.2f}"
            )
    finally:
        stop.set()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
