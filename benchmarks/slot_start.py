#!/usr/bin/env python3
"""Sandboxes alive at once while prompts wait for a request slot: a real llama-server, few slots.

    python benchmarks/slot_start.py --prompts 20 --slots 1 --runs 3
    python benchmarks/slot_start.py --trees /tmp/old /work/wt/mine   # alternate checkouts, run by run
    python benchmarks/slot_start.py --sandbox docker   # containers, counted through the engine

A llama.cpp ``llama-server`` (tests/llama: a tiny scripted model, built by tests/llama/build_server.sh)
serves ``--slots`` slots without a prompt cache (each call a full prompt evaluation); every prompt
calls the terminal once, then answers. ``batch_runner.py`` runs it as a user does (one worker,
every prompt in flight at once, the local sandbox), with ``TMPDIR`` set to a directory of its own:
each local sandbox is a ``br-*`` directory there from its start to its stop, counted every 5 ms
(``--sandbox docker``: the run's containers, by its label, as ``docker ps`` lists them every 0.1 s).
Prints, per run: the wall time of the command, the CPU of its process tree per prompt, the most
sandboxes alive at once, the records written, and the mean of their ``sandbox_start_blocked_s`` (what
a prompt's first tool call waited for its sandbox's start).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from llama.model import Script, write_model  # noqa: E402
from llama.server import LlamaServer, find_binary  # noqa: E402

DOCKER_IMAGE = "batch-runner-test:latest"  # tests/docker_image/build.sh


def count_alive(tmpdir: Path, run_name: str, docker: bool, done: threading.Event, peak: list[int]) -> None:
    label = f"label=batch_runner.run_name={run_name}"
    while not done.is_set():
        if docker:
            listed = subprocess.run(["docker", "ps", "-q", "--filter", label], capture_output=True, text=True)
            alive = len(listed.stdout.split())
        else:
            alive = sum(1 for _ in tmpdir.glob("*/br-*"))
        peak[0] = max(peak[0], alive)
        time.sleep(0.1 if docker else 0.005)


def one_run(
    tree: Path, base_url: str, dataset: Path, prompts: int, work: Path, run_name: str, sandbox: str
) -> dict:
    tmpdir = Path(tempfile.mkdtemp(prefix="tmp-", dir=work))
    out = work / "out"
    cmd = [
        sys.executable, str(tree / "batch_runner.py"), f"--dataset_file={dataset}",
        f"--batch_size={prompts}", f"--run_name={run_name}", "--model=local-model",
        f"--base_url={base_url}", f"--output_dir={out}", "--num_workers=1",
        f"--prompts_per_worker={prompts}", "--distribution=terminal_only", "--max_turns=4",
        "--keep_no_reasoning", "--max_failure_rate=1.0", "--prompt_timeout=120", f"--sandbox={sandbox}",
    ]  # fmt: skip
    if sandbox == "docker":
        cmd.append(f"--default_image={DOCKER_IMAGE}")
    env = {**os.environ, "PYTHONPATH": str(tree), "TMPDIR": str(tmpdir), "OPENAI_API_KEY": "sk-local"}
    done, peak = threading.Event(), [0]
    poller = threading.Thread(
        target=count_alive, args=(tmpdir, run_name, sandbox == "docker", done, peak), daemon=True
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    poller.start()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    done.set()
    poller.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    traj = out / run_name / "trajectories.jsonl"
    rows = [json.loads(line) for line in traj.read_text().splitlines()] if traj.exists() else []
    blocked = [r["metadata"]["sandbox_start_blocked_s"] for r in rows]
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
    return {
        "wall_s": wall,
        "cpu_ms_per_prompt": 1000 * cpu / prompts,
        "peak_alive": peak[0],
        "records": len(rows),
        "blocked_s": sum(blocked) / max(1, len(blocked)),  # its first tool call's wait for the start
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sandbox", choices=("local", "docker"), default="local")
    p.add_argument("--trees", nargs="+", type=Path, default=[ROOT], help="checkouts to alternate")
    args = p.parse_args()
    binary = find_binary()
    if binary is None:
        sys.exit("no llama-server binary: run tests/llama/build_server.sh (or set LLAMA_SERVER)")
    work = Path(tempfile.mkdtemp(prefix="slot_start-"))
    script = Script(calls=[("terminal", {"command": "echo hello"})], answer="Done.")
    model = write_model(work / "model.gguf", script)
    server = LlamaServer(
        binary, model, work / "server.log", alias="tiny-scripted-llama", slots=args.slots,
        extra_args=("--no-cache-prompt",),
    ).start()  # fmt: skip
    dataset = work / "rows.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": f"Say hello ({i})."}) + "\n" for i in range(args.prompts))
    )
    try:
        for run in range(args.runs):
            for tree in args.trees:
                name = f"slotstart-{os.getpid()}-{run}-{tree.name}"
                r = one_run(tree, server.base_url, dataset, args.prompts, work, name, args.sandbox)
                print(
                    f"{tree}: wall {r['wall_s']:.1f} s, CPU {r['cpu_ms_per_prompt']:.0f} ms/prompt, "
                    f"peak sandboxes alive {r['peak_alive']}, records {r['records']}/{args.prompts}, "
                    f"mean sandbox_start_blocked_s {r['blocked_s']:.3f}",
                    flush=True,
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
