"""The floor of one prompt of the scale workload, from its primitives measured now, on this machine.

Issue 26 sets its CPU targets as 1.25x of what a prompt's isolation and work really need: one fresh
sandbox with its own namespaces and cgroup, two terminal commands, three model calls, one record
and ~1 ms of loop Python, plus the outside network when a run gives it. It measured that floor at
~15 ms (~20 ms with the network) on a loaded machine. This machine's speed drifts (other virtual
machines on the host: the same 1,000-prompt command measured 17 and 35 ms a prompt within an
hour), so a figure of CPU per prompt says little next to a floor measured another day. This script
measures each primitive (CPU of the whole reaped process tree, or of this process for in-process
work) and adds them up as the issue does:

- ``sandbox``: ``bwrap --unshare-all`` with a usable root (``bwrap_floor.py``'s floor) + a cgroup
  with three limits made and removed;
- ``commands``: 2 x ``bash -c true``;
- ``model calls``: 3 x one chat request on a keep-alive connection (``http.client``; the body, with
  the terminal and file tools' schemas and 0, 1 and 2 tool turns, encoded, the answer decoded; the
  endpoint's own CPU is not counted, as in ``scale.py``);
- ``record``: one ~4 KB line appended, flushed and fsynced;
- ``loop``: 1 ms, the issue's figure;
- ``network``: one ``slirp4netns`` connecting a network namespace and ending (a namespace's holder
  measured alone and taken off).

    python benchmarks/floor.py            # also: import floor; floor.measure()

``scale.py --floor`` measures it just before and just after its run and prints CPU per prompt over it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bwrap_floor import cpu_ms, usable_root  # noqa: E402
from throughput import Endpoint, become_subreaper, children_cpu_s, reap_descendants  # noqa: E402

from batchrun.prompt.sandboxes.local.limits import (  # noqa: E402
    CgroupLayout,
    Limits,
    PromptCgroup,
    cgroup_layout,
)
from batchrun.prompt.tools.catalog import tools_for_toolsets  # noqa: E402

LOOP_MS = 1.0


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cgroup_ms(runs: int) -> float:
    layout = cgroup_layout()
    if not isinstance(layout, CgroupLayout):
        return 0.0
    limits = Limits(cpus=1.0, memory_mb=2048, pids_limit=512, disk_mb=1024)
    parent = f"batch-runner-floor-{os.getpid()}"
    before = _self_cpu()
    for i in range(runs):
        PromptCgroup(layout, parent, f"p{i}", limits).remove()
    return (_self_cpu() - before) / runs * 1000


def chat_ms(runs: int) -> float:
    endpoint = Endpoint(0.0)
    try:
        url = urlsplit(endpoint.base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        tools = [t.openai_schema() for t in tools_for_toolsets(["terminal", "file"])]
        path = url.path.rstrip("/") + "/chat/completions"
        prompt = "Task 1: inspect the working directory and write a short note about disk usage."
        turn = [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "terminal", "arguments": json.dumps({"command": "echo slug && pwd"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"output": "slug\n/workspace\n", "exit_code": 0})},
        ]  # fmt: skip

        def call(done_turns: int) -> None:
            messages = [{"role": "user", "content": prompt}, *turn * done_turns]
            body = json.dumps({"model": "fake", "messages": messages, "tools": tools}).encode()
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            json.loads(conn.getresponse().read())

        call(0)  # the connection, opened once
        before = _self_cpu()
        for i in range(runs):
            call(i % 3)  # a prompt's three requests: 0, 1 and 2 tool turns in
        return (_self_cpu() - before) / runs * 1000
    finally:
        endpoint.stop()


def record_ms(runs: int) -> float:
    line = json.dumps({"conversations": [{"from": "gpt", "value": "x" * 4000}]}) + "\n"
    with tempfile.NamedTemporaryFile("a", dir=os.environ.get("TMPDIR", "/tmp"), delete=True) as f:
        before = _self_cpu()
        for _ in range(runs):
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        return (_self_cpu() - before) / runs * 1000


def _holder() -> subprocess.Popen:
    proc = subprocess.Popen(
        ["unshare", "--net", "--", "sh", "-c", "echo; exec sleep 600"], stdout=subprocess.PIPE
    )
    proc.stdout.readline()
    return proc


def network_ms(runs: int, exclude: frozenset[int] = frozenset()) -> float:
    """slirp4netns as the sandbox starts it (root: with its own sandbox), minus the holder alone."""

    def holders(n: int) -> None:
        for _ in range(n):
            h = _holder()
            h.kill()
            h.wait()

    def slirps(n: int) -> None:
        for _ in range(n):
            h = _holder()
            exit_r, exit_w = os.pipe()
            ready_r, ready_w = os.pipe()
            argv = ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
                    "--enable-sandbox" if os.geteuid() == 0 else "--enable-seccomp",
                    f"--exit-fd={exit_r}", f"--ready-fd={ready_w}", str(h.pid), "tap0"]  # fmt: skip
            s = subprocess.Popen(
                argv, pass_fds=(exit_r, ready_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            os.close(exit_r)
            os.close(ready_w)
            ready = os.read(ready_r, 1)
            os.close(ready_r)
            os.close(exit_w)
            s.wait()
            h.kill()
            h.wait()
            if ready != b"1":
                raise RuntimeError("slirp4netns did not connect the namespace")

    def cpu(fn) -> float:
        before = children_cpu_s()
        fn(runs)
        time.sleep(0.2)
        reap_descendants(set(exclude))
        return (children_cpu_s() - before) / runs * 1000

    return max(0.0, cpu(slirps) - cpu(holders))


@dataclass
class Floor:
    sandbox: float
    commands: float
    model_calls: float
    record: float
    network: float

    @property
    def without_network(self) -> float:
        return self.sandbox + self.commands + self.model_calls + self.record + LOOP_MS

    @property
    def with_network(self) -> float:
        return self.without_network + self.network

    def line(self) -> str:
        return (
            f"{self.without_network:.1f} ms without the network, {self.with_network:.1f} with it = sandbox "
            f"{self.sandbox:.2f} + 2 commands {self.commands:.2f} + 3 model calls {self.model_calls:.2f} + "
            f"record {self.record:.2f} + loop {LOOP_MS:.0f} (+ network {self.network:.2f})"
        )


def measure(runs: int = 100, exclude: frozenset[int] = frozenset()) -> Floor:
    """Each primitive ``runs`` times (the caller is a child subreaper: bwrap orphans a process);
    ``exclude``: the caller's own children that live on (not waited for)."""
    bwrap = cpu_ms(["bwrap", "--unshare-all", *usable_root(), "/bin/true"], runs, exclude)
    return Floor(
        sandbox=bwrap + cgroup_ms(runs),
        commands=2 * cpu_ms(["bash", "-c", "true"], runs, exclude),
        model_calls=3 * chat_ms(runs),
        record=record_ms(runs),
        network=network_ms(max(20, runs // 2), exclude),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    become_subreaper()
    print(f"floor of one scale-workload prompt, load average {os.getloadavg()[0]:.1f}")
    for _ in range(args.rounds):
        print(f"  {measure(args.runs).line()}", flush=True)


if __name__ == "__main__":
    main()
