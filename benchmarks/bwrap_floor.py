"""What bubblewrap itself costs, against the local sandbox's own command line: the floor of a start.

Runs ``bwrap ... /bin/true`` many times with three command lines and prints the CPU of the whole
process tree per run (bwrap orphans a process, so this script is a child subreaper and reaps it):

- ``floor``: ``bwrap --unshare-all`` with a usable root (``/usr``, its links, ``--dev``, ``--proc``,
  a tmpfs ``/tmp``): what any per-prompt bubblewrap sandbox pays;
- ``namespaces``: the sandbox's namespace flags (``local.system_view.NAMESPACES``) on that root;
- ``sandbox``: the local sandbox's whole command line (every mount, the /etc view, the masks, the
  size-capped tmpfs mounts, ``--remount-ro /``), as ``LocalSandbox`` builds it, network off.

    python benchmarks/bwrap_floor.py --runs 150

CPU, not wall time: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import become_subreaper, children_cpu_s, reap_descendants  # noqa: E402

from batchrun.prompt.sandboxes.base import SandboxSpec  # noqa: E402
from batchrun.prompt.sandboxes.local import LocalSandbox, bwrap_problem  # noqa: E402
from batchrun.prompt.sandboxes.local.system_view import NAMESPACES  # noqa: E402


def usable_root() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib64"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
    return [*args, "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]


def sandbox_argv(base_dir: str) -> list[str]:
    """The local sandbox's bwrap command line, without starting a sandbox."""
    box = LocalSandbox(SandboxSpec("bwrap-floor", 0, network=False), isolation="bwrap", base_dir=base_dir)
    box._root = tempfile.mkdtemp(dir=base_dir)
    os.mkdir(os.path.join(box._root, "ctl"))
    box.workdir = "/workspace"
    return box._launch_argv()


def cpu_ms(argv: list[str], runs: int, exclude: frozenset[int] = frozenset()) -> float:
    """CPU of the whole reaped tree per run of ``argv``; ``exclude``: children of ours that live on."""
    before = children_cpu_s()
    for _ in range(runs):
        subprocess.run(argv, check=True)
    reap_descendants(set(exclude))
    return (children_cpu_s() - before) / runs * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if bwrap_problem():
        sys.exit(f"bubblewrap does not work here: {bwrap_problem()}")
    become_subreaper()
    base = tempfile.mkdtemp(prefix="bwrap-floor-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        lines = {
            "floor": ["bwrap", "--unshare-all", *usable_root(), "/bin/true"],
            "namespaces": ["bwrap", *NAMESPACES, *usable_root(), "/bin/true"],
            "sandbox": [*sandbox_argv(base), "/bin/true"],
        }
        load = os.getloadavg()[0]
        print(f"{args.runs} runs per line, load average {load:.1f}; ms of CPU per bwrap run, whole tree")
        for r in range(args.rounds):
            print(
                f"  round {r + 1}: " + "  ".join(f"{k} {cpu_ms(v, args.runs):.2f}" for k, v in lines.items())
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
