#!/usr/bin/env python3
"""The Docker engine's own container rate against the runner's sandbox rate, and the cost of one command.

    python benchmarks/docker_rate.py --containers 40 --clients 4
    python benchmarks/docker_rate.py --containers 40 --clients 4 --network bridge --commands 100

Three container loops, each ``--containers`` containers over ``--clients`` threads, with the
limits the runner gives a prompt's container (CPU, memory and swap, pids, tmpfs disk cap at the
working directory, network mode, labels, docker-init, the keep-alive entrypoint, no log driver):

* **engine (API)**: create, start, remove (force) through docker-py, the API the runner uses;
* **engine (CLI)**: ``docker run -d`` then ``docker rm -f``, for comparison;
* **runner**: ``DockerSandbox.start()``, one command (``true``), ``stop()``: what a prompt costs.

The ratio runner / engine (API) is the share of the engine's rate the runner keeps. Then, in one
started sandbox, ``--commands`` commands one after another, through ``docker exec`` (what the
runner did before the command server) and through the command server: latency percentiles, the
engine's CPU (dockerd, containerd and its shims, read from /proc) and this process's CPU per command.

The image is ``batch-runner-test:latest`` (``tests/docker_image/build.sh``). Wall times move with
the machine's load (other sessions share its 2 cores): run it a few times.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from docker.errors import APIError, NotFound  # noqa: E402

from batchrun.prompt.sandboxes.base import SandboxSpec  # noqa: E402
from batchrun.prompt.sandboxes.docker import sandbox as docker_backend  # noqa: E402
from batchrun.prompt.sandboxes.docker.engine import LABEL_RUN  # noqa: E402
from batchrun.prompt.sandboxes.docker.sandbox import DockerSandbox, docker_client  # noqa: E402

IMAGE = "batch-runner-test:latest"
CLK_TCK = os.sysconf("SC_CLK_TCK")
ENGINE_PROCESSES = (
    "dockerd",
    "containerd",
    "containerd-shim",
    "containerd-shim-runc-v2",
    "runc",
    "docker-init",
)


def engine_cpu_s() -> float:
    """CPU seconds of the engine's processes alive now (dockerd, containerd, shims), and their reaped children."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name in ENGINE_PROCESSES:
            fields = stat.rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / CLK_TCK


def own_cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


HUB = {"on": True}  # --network_hub: containers on "bridge" get a link into the worker's slirp4netns instead


def sandbox_options(network: str) -> dict:
    return {
        "default_image": IMAGE,
        "network_mode": network,
        "network_hub": HUB["on"],
        "disk_cap": "tmpfs",  # what the runner uses on engines that cannot cap a layer (most)
        "lifetime_s": 600.0,
    }


def engine_create_kwargs(box: DockerSandbox, name: str) -> dict:
    """The create arguments the runner uses for ``box`` (its limits, labels, entrypoint)."""
    return box.create_kwargs(name)


def timed_loop(count: int, clients: int, one: Callable[[int], None]) -> float:
    """Run ``one(i)`` for i < count on ``clients`` threads; containers per second."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for future in [pool.submit(one, i) for i in range(count)]:
            future.result()
    return count / (time.monotonic() - started)


def engine_api_rate(count: int, clients: int, run: str, network: str) -> tuple[float, int]:
    """Containers per second, and how many of them the engine botched (their process never ran)."""
    client = docker_client()
    loop_run = f"{run}-{uuid.uuid4().hex[:4]}"
    since = datetime.now(timezone.utc) - timedelta(seconds=1)

    def one(i: int) -> None:
        box = DockerSandbox(SandboxSpec(loop_run, i, network=network != "none"), **sandbox_options(network))
        container = client.containers.create(
            box.image, **engine_create_kwargs(box, f"br-rate-{loop_run}-{i}")
        )
        container.start()
        try:
            client.api.remove_container(container.id, force=True, v=True)
        except (NotFound, APIError):  # it ended and removed itself already
            pass

    rate = timed_loop(count, clients, one)
    # Killed by the removal, a container dies of SIGKILL (137); one that died of anything else never
    # ran its entrypoint (on this engine: started on an empty root, "exec sh failed").
    events = client.api.events(
        since=since, until=datetime.now(timezone.utc) + timedelta(seconds=1), decode=True,
        filters={"event": "die", "label": f"{LABEL_RUN}={loop_run}"},
    )  # fmt: skip
    botched = sum(1 for e in events if e.get("Actor", {}).get("Attributes", {}).get("exitCode") != "137")
    return rate, botched


def engine_cli_rate(count: int, clients: int, run: str, network: str) -> float:
    box = DockerSandbox(SandboxSpec(run, 0, network=network != "none"), **sandbox_options(network))
    kw = engine_create_kwargs(box, "x")
    argv = [
        "docker", "run", "-d", "-i", "--rm", "--init", f"--network={network}",
        f"--cpus={box.options.cpus}", f"--memory={box.options.memory_mb}m",
        f"--memory-swap={box.options.memory_mb}m", f"--pids-limit={box.options.pids_limit}",
        "--log-driver=none", f"-w={box.workdir}", f"--entrypoint={kw['entrypoint'][0]}",
    ]  # fmt: skip
    for path, how in kw.get("tmpfs", {}).items():
        argv.append(f"--tmpfs={path}:{how}")
    for key, value in kw["labels"].items():
        argv.append(f"--label={key}={value}")

    def one(i: int) -> None:
        cid = subprocess.run(
            [*argv, f"--name=br-cli-{run}-{i}", IMAGE, *kw["entrypoint"][1:]],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)  # may have removed itself already

    return timed_loop(count, clients, one)


class _Retries(logging.Handler):
    """Counts the starts the backend tried again (the engine botched a container, see START_ATTEMPTS)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "trying again" in record.getMessage() or "before its first command" in record.getMessage():
            self.count += 1


def runner_rate(count: int, clients: int, run: str, network: str) -> tuple[float, int]:
    """Sandboxes per second, and how many container starts the backend had to try again."""
    retries = _Retries()
    logger = logging.getLogger(docker_backend.__name__)
    logger.addHandler(retries)
    logger.setLevel(logging.INFO)

    def one(i: int) -> None:
        box = DockerSandbox(SandboxSpec(run, i, network=network != "none"), **sandbox_options(network))
        box.start()
        try:
            result = box.run("true", timeout_s=60)
            assert result.exit_code == 0, result
        finally:
            box.stop()

    try:
        return timed_loop(count, clients, one), retries.count
    finally:
        logger.removeHandler(retries)


def command_costs(commands: int, run: str, network: str) -> dict[str, dict[str, float]]:
    """Per-command latency and CPU, through docker exec and through the command server."""
    box = DockerSandbox(SandboxSpec(run, 0, network=network != "none"), **sandbox_options(network))
    box.start()
    out = {}
    try:
        for name, call in (("exec", box.run_exec), ("server", box.run)):
            for _ in range(3):  # warm-up
                call("echo warm", timeout_s=60)
            lat = []
            e0, o0 = engine_cpu_s(), own_cpu_s()
            for i in range(commands):
                t0 = time.perf_counter()
                res = call(f"echo {i}", timeout_s=60)
                lat.append(time.perf_counter() - t0)
                assert res.output == f"{i}\n", res
            e1, o1 = engine_cpu_s(), own_cpu_s()
            lat.sort()
            out[name] = {
                "p50_ms": 1000 * statistics.median(lat),
                "p90_ms": 1000 * lat[int(0.9 * (len(lat) - 1))],
                "engine_cpu_ms": 1000 * (e1 - e0) / commands,
                "own_cpu_ms": 1000 * (o1 - o0) / commands,
            }
    finally:
        box.stop()
    return out


def _rates(rates: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in rates)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--containers", type=int, default=40, help="containers per loop")
    parser.add_argument("--clients", type=int, default=4, help="threads creating containers at once")
    parser.add_argument("--network", default="none", help="network mode: none (network off) or bridge")
    parser.add_argument(
        "--network_hub", default="on", choices=("on", "off"),
        help="with --network bridge: each container on a link into this process's slirp4netns (the "
        "runner's default where it may use one) or on Docker's bridge itself",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="engine and runner loops, taking turns")
    parser.add_argument("--commands", type=int, default=100, help="commands for the per-command figures")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: cli, commands")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    HUB["on"] = args.network_hub == "on"
    run = f"rate-{uuid.uuid4().hex[:6]}"
    print(f"Docker engine {docker_client().version().get('Version')}, image {IMAGE}, network {args.network} (hub {args.network_hub}), "
          f"{args.containers} containers over {args.clients} clients, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    # One warm-up container each way: the first create pays for caches the others do not.
    runner_rate(2, 1, run, args.network)
    # Engine and runner loops take turns, so that a change in the machine's load hits both alike.
    engines, runners, botched, retried = [], [], 0, 0
    for _ in range(args.rounds):
        rate, n = engine_api_rate(args.containers, args.clients, run, args.network)
        engines.append(rate)
        botched += n
        rate, n = runner_rate(args.containers, args.clients, run, args.network)
        runners.append(rate)
        retried += n
    engine, runner = statistics.mean(engines), statistics.mean(runners)
    rounds = f"mean of {args.rounds} rounds"
    print(f"engine (API, create+start+remove):   {engine:6.2f} containers/s  "
          f"({rounds}: {_rates(engines)}; {botched} botched: their entrypoint never ran)")  # fmt: skip
    if "cli" not in skip:
        cli = engine_cli_rate(args.containers, args.clients, run, args.network)
        print(f"engine (CLI, docker run -d + rm -f): {cli:6.2f} containers/s")
    print(f"runner (start + one command + stop): {runner:6.2f} sandboxes/s   "
          f"({rounds}: {_rates(runners)}; {retried} starts tried again)")  # fmt: skip
    print(f"ratio runner / engine (API):         {runner / engine:6.2f}")
    if "commands" not in skip:
        costs = command_costs(args.commands, run, args.network)
        print(f"per command ({args.commands} x `echo`, one container):")
        for name, c in costs.items():
            print(
                f"  {name:<7} p50 {c['p50_ms']:6.1f} ms  p90 {c['p90_ms']:6.1f} ms  "
                f"engine CPU {c['engine_cpu_ms']:5.1f} ms  runner CPU {c['own_cpu_ms']:5.1f} ms"
            )
    docker_backend.remove_owned_containers(docker_backend.default_owner())
    return 0


if __name__ == "__main__":
    sys.exit(main())
