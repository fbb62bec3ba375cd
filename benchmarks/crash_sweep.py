#!/usr/bin/env python3
"""Kill the whole runner (SIGKILL to its process group) at a sweep of instants or just before each of its
durable steps, resume, and compare every output file with an uninterrupted run's.

    python benchmarks/crash_sweep.py --writes -1            # before every fsync/rename of the parent
    python benchmarks/crash_sweep.py --writes 30 --samples 2 --flag=--stop_after_passes=1
    python benchmarks/crash_sweep.py --writes 25 --torn     # the kill tears the line being appended
    python benchmarks/crash_sweep.py --writes 25 --signal TERM --parent_only   # SIGTERM instead, and a clean stop
    python benchmarks/crash_sweep.py --points 40            # 40 timed instants over the whole run
    python benchmarks/crash_sweep.py --at 1.23 --at 1.31    # chosen instants (seconds after start)

Write mode (``--writes``): a ``sitecustomize.py`` on the runner's PYTHONPATH counts the parent's durable
steps (each ``os.fsync`` and ``os.replace``: every append of an outcome, every state file, the merge, the
report) and kills the group just before step N (or the first step of a name: :func:`kill_and_resume`),
for N spread over an uninterrupted run's steps and every step of its finish phase; ``--parent_only``
kills the parent alone. Timed mode: the baseline's files' instants are printed (the finish phase is from
the merge's temp file to the exit) and the runner is killed that long after its start.

Each point: a fresh run directory, the run killed, every third time (``--double_every``) the first resume
killed too, then ``--resume`` until it exits by itself. Its outputs must equal the baseline's: the samples
in trajectories.jsonl (row identity + sample index -> conversations, score, completed/partial, calls),
each sample's outcome (kept, discarded with its reason, or failed: exactly one, and no sample in two
files; failed.jsonl grows by one line a failed sample per invocation: failures run again on resume),
checkpoint.json's completed prompts, statistics.json but for the invocation's own figures
(:data:`STATS_OWN`), status.json finished, report.html there, no temp file left, nothing of any invocation's
sandboxes left (:func:`sandbox_leftovers`: directories, cgroups, containers); the books' tokens
against what the endpoint served (:func:`spend_problems`), and the prompt tokens it served from its cache
(:func:`cache_problems`). Prints one line per point and exits non-zero on any divergence. Against the
fake endpoint (batchrun/fakes), run in this process; sandboxes local (bubblewrap, ``--isolation none``)
or ``--isolation docker``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchrun.fakes.fake_model import FakeModelServer  # noqa: E402
from batchrun.identity import outcome_sample, record_sample  # noqa: E402

RUN = "sweep"
KNOWN_FILES = {
    ".lock", "README.md", "checkpoint.json", "discarded.jsonl", "failed.jsonl", "report.html", "run_manifest.json",
    "statistics.json", "status.json", "trajectories.jsonl",
}  # fmt: skip


def rows() -> list[dict]:
    """Rows with answers (right and wrong), verify commands, a twin, discards and failures."""
    out: list[dict] = []
    for i in range(8):
        want = 42 if i % 3 else 41  # one in three answers wrong
        out.append(
            {
                "id": f"sum-{i}",
                "prompt": f"Add the numbers of task {i} [slow:0.1] [answer:42]",
                "answer": want,
            }
        )
    out.append(
        {
            "id": "made",
            "prompt": "Write made into out.txt [run:echo made > out.txt]",
            "verify": "grep -qx made out.txt",
        }
    )
    out.append(
        {
            "id": "maid",
            "prompt": "Write made, carelessly [run:echo maid > out.txt]",
            "verify": "grep -qx made out.txt",
        }
    )
    out.append({"id": "plain", "prompt": "Describe the working directory [slow:0.2]"})
    out.append({"id": "plain", "prompt": "Describe the working directory [slow:0.2]"})  # a twin: runs twice
    out.append({"id": "noreason", "prompt": "Answer without thinking [no_reasoning] [answer:7]", "answer": 7})
    out.append({"id": "hallu", "prompt": "Use a tool you were not given [hallucinate]"})
    out.append({"id": "refused", "prompt": "A request the endpoint refuses [error:400]"})
    out.append({"id": "filtered", "prompt": "A reply the provider filters [finish:content_filter]"})
    for i in range(6):
        out.append({"id": f"tail-{i}", "prompt": f"Note about topic {i} [slow:0.15]"})
    out.append(
        {"id": "loop", "prompt": "Never stop calling tools [loop]", "max_turns": 3}
    )  # partial: max_turns
    return out


def argv(
    dataset: Path, out: Path, server: FakeModelServer, args: argparse.Namespace, resume: bool
) -> list[str]:
    cmd = [
        sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=4",
        f"--run_name={RUN}", f"--output_dir={out}", "--model=fake-model", f"--base_url={server.base_url}",
        "--api_key=sk-sweep-test", "--distribution=terminal_only", f"--num_workers={args.workers}",
        "--prompts_per_worker=2", f"--samples_per_prompt={args.samples}", "--max_failure_rate=1.0",
        *(
            [f"--local_isolation={args.isolation}"]
            if args.isolation != "docker"
            else ["--sandbox=docker", "--default_image=batch-runner-test:latest"]
        ),
    ]  # fmt: skip
    return cmd + args.flag + (["--resume"] if resume else [])


# Loaded by the runner's processes (PYTHONPATH) in the write mode: the parent, the only writer (the leader
# of its process group), counts its durable steps (each fsync and each rename: every append of an outcome,
# every atomic replace of a state file, the merge's, the report's) and kills its whole group just before
# step CRASH_SWEEP_KILL_AT; at exit it writes the count to CRASH_SWEEP_COUNT_FILE.
HOOK = """
import atexit, os, re, signal

_at = int(os.environ.get("CRASH_SWEEP_KILL_AT", "0"))
_torn = os.environ.get("CRASH_SWEEP_TORN") == "1"
_parent_only = os.environ.get("CRASH_SWEEP_PARENT_ONLY") == "1"
# Another signal than SIGKILL (SIGTERM, SIGINT: a service manager, a Ctrl-C) is sent once, and the step goes on.
_signal = int(os.environ.get("CRASH_SWEEP_SIGNAL", signal.SIGKILL))
_sent = []
# Or by name, whatever the timing ("rename status.json@rename statistics.json": the first after that one).
_before, _, _after = os.environ.get("CRASH_SWEEP_KILL_BEFORE", "").partition("@")
_log_file = os.environ.get("CRASH_SWEEP_STEPS_FILE")
_steps = []
_fsync = os.fsync


def _name(real, args):
    try:
        target = os.readlink(f"/proc/self/fd/{args[0]}") if real is _fsync else os.fspath(args[1])
        return re.sub(r"\\.\\d+\\.tmp$", ".tmp", os.path.basename(target))  # the temp files' pid left out
    except (OSError, IndexError, TypeError):
        return "?"


def _tear(fd):
    # A kill in the middle of a large append's write: the line's second half never reached the file.
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not path.endswith(".jsonl"):
            return
        size = os.fstat(fd).st_size
        tail = os.pread(fd, min(size, 1 << 22), max(0, size - (1 << 22)))
        start = tail.rfind(b"\\n", 0, len(tail) - 1) + 1
        os.ftruncate(fd, size - (len(tail) - start) // 2)
    except OSError:
        pass


def _step(real):
    def step(*args, **kwargs):
        if os.getpid() == os.getpgrp():
            name = ("fsync " if real is _fsync else "rename ") + _name(real, args)
            _steps.append(name)
            hit = len(_steps) == _at or name == _before and (not _after or _after in _steps[:-1])
            if hit and _signal != signal.SIGKILL and not _sent:
                _sent.append(name)
                if _parent_only:
                    os.kill(os.getpid(), _signal)
                else:
                    os.killpg(0, _signal)
            elif hit and _signal == signal.SIGKILL:
                if _torn and real is _fsync and args:
                    _tear(args[0])
                if _parent_only:
                    os.kill(os.getpid(), signal.SIGKILL)
                os.killpg(0, signal.SIGKILL)
        return real(*args, **kwargs)

    return step


if _at or _before or _log_file:
    os.fsync = _step(os.fsync)
    os.replace = _step(os.replace)
if _log_file:
    _leader = os.getpid()

    @atexit.register
    def _save():
        if os.getpid() == _leader:
            with open(_log_file, "w") as fh:
                fh.write("".join(step + "\\n" for step in _steps))
"""


def start(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env
    )


def hooked_env(hook_dir: Path, **values: object) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update({f"CRASH_SWEEP_{k.upper()}": str(v) for k, v in values.items()})
    return env


def killed_after(proc: subprocess.Popen, delay_s: float) -> bool:
    """SIGKILL ``proc``'s whole group ``delay_s`` after it started; whether it was still running."""
    time.sleep(delay_s)
    alive = proc.poll() is None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return alive


def run_to_end(
    cmd: list[str],
    cwd: Path,
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
    pids: list[int] | None = None,
) -> tuple[int, str]:
    proc = start(cmd, cwd, env)
    if pids is not None:
        pids.append(proc.pid)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"the runner hung for {timeout_s} s") from None
    # Whatever a worker or sandbox left in the group, gone before the next round.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.returncode, err.decode(errors="replace")


def sandbox_leftovers(pids: list[int]) -> list[str]:
    """What the runners ``pids`` (the kill's and the resumes', all ended) left of their sandboxes: the local
    backend's run directories and parent cgroups (``batch-runner-<run>-<pid>-*``), Docker's containers
    (owner label) and run cgroups (``batch-runner-docker-<pid>-*``). The resume's start sweeps those of
    runners that are gone, whatever it has left to run (README: "What a runner that was killed outright
    left is removed ... by the next run of the same name")."""
    from batchrun.prompt.sandboxes.docker.engine import LABEL_OWNER, RUN_CGROUP_PREFIX, _hierarchies
    from batchrun.prompt.sandboxes.local.limits import run_cgroup_names
    from batchrun.prompt.sandboxes.local.system_view import runtime_dir

    ours = tuple(f"batch-runner-{RUN}-{pid}-" for pid in pids)
    docker_ours = tuple(f"{RUN_CGROUP_PREFIX}{pid}-" for pid in pids)
    left = []
    for where in dict.fromkeys((runtime_dir(), tempfile.gettempdir())):
        left += [f"{where}/{name}" for name in os.listdir(where) if name.startswith(ours)]
    left += [f"cgroup {name}" for name in run_cgroup_names() if name.startswith(ours)]
    for hierarchy in _hierarchies():
        try:
            left += [f"{hierarchy}/{e.name}" for e in os.scandir(hierarchy) if e.name.startswith(docker_ours)]
        except OSError:
            continue
    try:
        owners = subprocess.run(
            [
                "docker",
                "ps",
                "-a",
                "--filter",
                f"label={LABEL_OWNER}",
                "--format",
                f'{{{{.Label "{LABEL_OWNER}"}}}}',
            ],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
    except OSError:  # no docker command here
        owners = []
    left += [f"container of {o}" for o in owners if o.split(":")[0].split("@")[0] in map(str, pids)]
    return left


def read_jsonl(path: Path) -> list[dict]:
    """The file's records; a torn line (--torn) is skipped, as every reader of the runner's skips it."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text("utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def summary(run_dir: Path) -> dict:
    """What must be the same after any kill and resume: a dict of comparable parts."""
    kept: dict[tuple[str, int], list] = collections.defaultdict(list)
    for rec in read_jsonl(run_dir / "trajectories.jsonl"):
        kept[record_sample(rec)].append(
            json.dumps(
                [rec["conversations"], rec["score"], rec["completed"], rec["partial"], rec["api_calls"]]
            )
        )
    discarded: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for row in read_jsonl(run_dir / "discarded.jsonl"):
        discarded[outcome_sample(row)].append(row.get("reason"))
    failed: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for row in read_jsonl(run_dir / "failed.jsonl"):
        failed[outcome_sample(row)].append(row.get("error_class"))
    stats = (
        json.loads((run_dir / "statistics.json").read_text())
        if (run_dir / "statistics.json").exists()
        else {}
    )
    checkpoint = (
        json.loads((run_dir / "checkpoint.json").read_text())
        if (run_dir / "checkpoint.json").exists()
        else {}
    )
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    # .lock stays (a runner holds it with flock while it works there; an uninterrupted run leaves it too)
    leftovers = sorted(
        p.name
        for p in run_dir.iterdir()
        if ".tmp" in p.name or (p.name not in KNOWN_FILES and not re.fullmatch(r"batch_\d+\.jsonl", p.name))
    )
    return {
        "kept": {k: sorted(v) for k, v in kept.items()},
        "discarded": {k: sorted(set(v)) for k, v in discarded.items()},
        "discard_lines": {k: len(v) for k, v in discarded.items()},
        "failed": {k: sorted(set(v)) for k, v in failed.items()},
        "stats": stats,
        "completed_prompts": sorted(checkpoint.get("completed_prompts", [])),
        "status": (status.get("state"), status.get("exit_code")),
        "report": (run_dir / "report.html").exists(),
        "leftovers": leftovers,
    }


# statistics.json fields that may differ after a kill: timings, spend (the killed invocations' calls were
# real calls), this invocation's own counts, and the batch count (a resume numbers its batches after the
# files there).
# failed_attempts counts attempts (README: a prompt that failed twice counts twice), and every resume runs
# the failed samples again.
STATS_OWN = (
    "completed_at",
    "duration_seconds",
    "run_totals",
    "runs",
    "this_run",
    "total_batches",
    "failed_attempts",
)


# With --torn: the torn line stays in its file, skipped and counted by every reader (README: "A line of any
# run file that is torn ... is skipped and counted").
STATS_TORN = ("dropped_at_merge", "invalid_lines_skipped")
OWN = set(STATS_OWN)


def stat_view(stats: dict, own: set[str] = OWN) -> dict:
    return {k: v for k, v in stats.items() if k not in own}


def compare(base: dict, got: dict, own: set[str] = OWN) -> list[str]:
    problems = []
    for part in ("kept", "discarded", "completed_prompts", "status", "report", "leftovers"):
        if base[part] != got[part]:
            if isinstance(base[part], dict):
                missing = sorted(set(base[part]) - set(got[part]))
                extra = sorted(set(got[part]) - set(base[part]))
                changed = sorted(k for k in set(base[part]) & set(got[part]) if base[part][k] != got[part][k])
                problems.append(
                    f"{part}: {len(missing)} missing, {len(extra)} extra, {len(changed)} changed"
                    + (
                        f" e.g. {base[part].get(changed[0])!r:.200} -> {got[part].get(changed[0])!r:.200}"
                        if changed
                        else ""
                    )
                )
            else:
                problems.append(f"{part}: {base[part]!r:.300} -> {got[part]!r:.300}")
    if set(base["failed"]) != set(got["failed"]):
        problems.append(f"failed samples: {sorted(base['failed'])} -> {sorted(got['failed'])}")
    for k, n in got["discard_lines"].items():
        if n != base["discard_lines"].get(k):  # one a sample (twin rows: one each)
            problems.append(f"discarded {k}: {n} lines, {base['discard_lines'].get(k)} uninterrupted")
    sets = [set(got["kept"]), set(got["discarded"]), set(got["failed"])]
    for a, b, name in ((0, 1, "kept+discarded"), (0, 2, "kept+failed"), (1, 2, "discarded+failed")):
        if sets[a] & sets[b]:
            problems.append(f"{name}: {len(sets[a] & sets[b])} samples with two outcomes")
    for k, v in got["kept"].items():
        if len(v) != len(base["kept"].get(k, [])):
            problems.append(f"kept {k}: {len(v)} records")
    sb, sg = stat_view(base["stats"], own), stat_view(got["stats"], own)
    for field in sb:
        if sb[field] != sg[field]:
            problems.append(
                f"statistics {field}: {json.dumps(sb[field])[:300]} -> {json.dumps(sg[field])[:300]}"
            )
    return problems


def watch_baseline(cmd: list[str], cwd: Path, run_dir: Path) -> tuple[float, dict[str, float], int]:
    """Run uninterrupted, noting when each output first appears (polled every 2 ms)."""
    seen: dict[str, float] = {}
    t0 = time.monotonic()
    proc = start(cmd, cwd)
    marks = {
        "batch_0.jsonl": "first outcome",
        "trajectories.jsonl": "merge done",
        "statistics.json": "statistics",
        "report.html": "report",
    }
    while proc.poll() is None:
        now = time.monotonic() - t0
        if run_dir.exists():
            for p in run_dir.iterdir():
                name = p.name
                if name.startswith(".trajectories.jsonl") and "merge start" not in seen:
                    seen["merge start"] = now
                if name in marks and marks[name] not in seen:
                    seen[marks[name]] = now
        time.sleep(0.002)
    end = time.monotonic() - t0
    proc.communicate()
    return end, seen, proc.returncode


def install_hook(tmp: Path) -> Path:
    hook_dir = tmp / "hook"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    return hook_dir


def durable_steps(args: argparse.Namespace, tmp: Path, dataset: Path, server: FakeModelServer) -> list[str]:
    """The parent's durable steps in an uninterrupted run, in order: ``fsync <file>`` or ``rename <file>``."""
    out = tmp / "steps"
    out.mkdir(exist_ok=True)
    log = tmp / "steps.txt"
    hooked = hooked_env(install_hook(tmp), steps_file=log)
    run_to_end(argv(dataset, out, server, args, False), out, env=hooked)
    return log.read_text().splitlines()


def kill_and_resume(
    args: argparse.Namespace,
    tmp: Path,
    dataset: Path,
    server: FakeModelServer,
    base: dict,
    at: int | str,
    *,
    resume_at: int | None = None,
    torn: bool = False,
    strict_spend: bool = False,
    sig: int = signal.SIGKILL,
) -> tuple[list[str], list[str]]:
    """Kill the run just before its step ``at`` (tearing the line it appends: ``torn``; or send it ``sig``,
    SIGTERM or SIGINT, and let it stop by itself), the first resume before its step ``resume_at`` too, then
    resume to the end and compare with ``base``: (what happened, the divergences)."""
    hook_dir = install_hook(tmp)
    out = tmp / f"step_{re.sub(r'[^a-z0-9]+', '_', str(at))}"
    out.mkdir(exist_ok=True)
    rounds = []
    pids: list[int] = []  # every invocation's runner: what their sandboxes left is looked for at the end
    served_before, cached_before = served_tokens(server), server.stats()["cached_tokens"]
    kill = {"kill_at": at} if isinstance(at, int) else {"kill_before": at}
    proc = start(
        argv(dataset, out, server, args, False),
        out,
        env=hooked_env(
            hook_dir,
            **kill,
            torn=int(torn),
            parent_only=int(getattr(args, "parent_only", False)),
            signal=int(sig),
        ),
    )
    pids.append(proc.pid)
    proc.wait()
    if sig != signal.SIGKILL:
        rounds.append(f"{signal.Signals(sig).name} before step {at}: exit {proc.returncode}")
    else:
        rounds.append(
            f"killed before step {at}" if proc.returncode == -signal.SIGKILL else f"exit {proc.returncode}"
        )
    if resume_at and (out / RUN).exists():
        proc = start(argv(dataset, out, server, args, True), out, env=hooked_env(hook_dir, kill_at=resume_at))
        pids.append(proc.pid)
        proc.wait()
        ended = proc.returncode != -signal.SIGKILL
        rounds.append("resume ended" if ended else f"resume killed before its step {resume_at}")
        strict_spend = strict_spend and ended
    code, err = run_to_end(argv(dataset, out, server, args, (out / RUN).exists()), out, pids=pids)
    rounds.append(f"resume exit {code}")
    problems = [f"exit {code}: {err[-600:]}"] if code != 0 else []
    own = OWN | set(STATS_TORN) if torn else OWN  # the torn line stays, skipped and counted
    problems += compare(base, summary(out / RUN), own) if (out / RUN).exists() else ["no run directory"]
    problems += [f"left behind: {what}" for what in sandbox_leftovers(pids)]
    problems += spend_problems(out / RUN, served_tokens(server) - served_before, strict_spend, args)
    problems += cache_problems(out / RUN, server.stats()["cached_tokens"] - cached_before, strict_spend)
    if not args.keep and not problems:
        subprocess.run(["rm", "-rf", str(out)], check=False)
    return rounds, problems


def sweep_writes(
    args: argparse.Namespace, tmp: Path, dataset: Path, server: FakeModelServer, base: dict
) -> int:
    """Kill the parent's group just before its Nth durable step, for N over the run's steps; resume; compare."""
    names = durable_steps(args, tmp, dataset, server)
    steps = len(names)
    finish_from = next(n for n, step in enumerate(names) if ".trajectories.jsonl." in step)
    print(
        f"an uninterrupted run takes {steps} durable steps; the finish phase starts after step {finish_from}:"
    )
    print("   " + ", ".join(f"{n + 1} {step}" for n, step in enumerate(names) if n >= finish_from))
    every = steps if args.writes < 0 else args.writes
    points = sorted({1 + round((steps - 1) * i / max(1, every - 1)) for i in range(every)})
    if args.every_finish_step:
        points = sorted({*points, *range(finish_from + 1, steps + 1)})
    bad = 0
    for n, at in enumerate(points):
        double = args.double_every and n % args.double_every == args.double_every - 1
        phase = "finish" if at > finish_from else "run"
        rounds, problems = kill_and_resume(
            args, tmp, dataset, server, base, at,
            resume_at=1 + (at * 7) % steps if double else None, torn=args.torn, strict_spend=phase == "finish",
            sig=getattr(signal, f"SIG{args.signal}"),
        )  # fmt: skip
        bad += bool(problems)
        verdict = "OK" if not problems else "DIVERGES"
        print(
            f"[{at:3d}/{steps}] {phase:6s} {names[at - 1]:28.28s} {'; '.join(rounds)}: {verdict}", flush=True
        )
        for p in problems:
            print("      ", p)
    print(f"{len(points)} kill steps, {bad} diverging")
    return bad


def served_tokens(server: FakeModelServer) -> int:
    stats = server.stats()
    return stats["prompt_tokens"] + stats["completion_tokens"] + stats["check_tokens"]


def spend_problems(run_dir: Path, served: int, strict: bool, args: argparse.Namespace) -> list[str]:
    """run_totals against what the endpoint served: equal when every kill came after the last call (the
    finish phase; no resume killed in turn); otherwise a lower bound without a budget (a killed invocation
    is counted from its last status.json) and an upper bound with one (its journal)."""
    try:
        stats = json.loads((run_dir / "statistics.json").read_text())
        books, unanswered = stats["run_totals"]["total_tokens"], stats["run_totals"]["unanswered_tokens"]
        invocations = [r.get("invocation") for r in stats["runs"]]
    except (OSError, ValueError, KeyError):
        return ["statistics.json has no run_totals"]
    if len(set(invocations)) != len(invocations):
        return [f"an invocation counted twice in runs: {invocations}"]
    budget = any(f.startswith(("--budget_tokens", "--budget_usd")) for f in args.flag)
    if strict and books != served:
        return [f"run_totals.total_tokens {books}, the endpoint served {served}"]
    # A budget run's books hold the calls in flight at a kill at their reservations (unanswered_tokens).
    if budget and books + unanswered < served or not budget and books > served:
        return [f"run_totals.total_tokens {books} (+{unanswered} unanswered), the endpoint served {served}"]
    return []


def cache_problems(run_dir: Path, served: int, strict: bool) -> list[str]:
    """run_totals.cached_tokens against the prompt tokens the endpoint said it served from its cache (the
    fake's prompt_cache): equal when every kill came after the last call, else never more (an invocation
    killed is counted from its last status.json, which holds the outcomes recorded by then)."""
    try:
        books = json.loads((run_dir / "statistics.json").read_text())["run_totals"]["cached_tokens"]
    except (OSError, ValueError, KeyError):
        return ["statistics.json has no run_totals.cached_tokens"]
    if books > served or strict and books != served:
        return [f"run_totals.cached_tokens {books}, the endpoint served {served} from its cache"]
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=30, help="kill instants, spread over the baseline's time")
    ap.add_argument("--finish_points", type=int, default=8, help="extra instants inside the finish phase")
    ap.add_argument("--at", type=float, action="append", default=[], help="a chosen instant (s); repeatable")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--isolation", default="bwrap", help="bwrap, none, or docker (the Docker backend)")
    ap.add_argument("--double_every", type=int, default=3, help="every Nth instant kills the resume too")
    ap.add_argument(
        "--flag", action="append", default=[], help="a runner flag to add, e.g. --flag=--keep=passed"
    )
    ap.add_argument(
        "--every_finish_step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write mode: kill before every step of the finish phase too",
    )
    ap.add_argument(
        "--parent_only",
        action="store_true",
        help="write mode: kill the parent alone (its workers die with it)",
    )
    ap.add_argument("--torn", action="store_true", help="write mode: the kill tears the line being appended")
    ap.add_argument(
        "--signal",
        default="KILL",
        choices=("KILL", "TERM", "INT"),
        help="write mode: send this signal instead of SIGKILL (to the group, or the parent with --parent_only) "
        "and let the run stop by itself",
    )
    ap.add_argument("--keep", help="keep run directories under this path")
    ap.add_argument(
        "--writes",
        type=int,
        default=0,
        help="instead of instants: kill just before the parent's Nth durable step (fsync or rename), for N "
        "spread over all of a run's steps (0: the timed sweep; -1: every step)",
    )
    args = ap.parse_args()
    if args.torn:
        OWN.update(STATS_TORN)
    tmp_ctx = tempfile.TemporaryDirectory()
    tmp = Path(args.keep) if args.keep else Path(tmp_ctx.name)
    tmp.mkdir(parents=True, exist_ok=True)
    dataset = tmp / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    bad = 0
    with FakeModelServer(latency_s=0.01, prompt_cache=True) as server:
        base_out = tmp / "base"
        base_out.mkdir(exist_ok=True)
        end, seen, code = watch_baseline(
            argv(dataset, base_out, server, args, False), base_out, base_out / RUN
        )
        print(
            f"baseline: exit {code} after {end:.2f} s; " + ", ".join(f"{k} {v:.2f}" for k, v in seen.items())
        )
        base = summary(base_out / RUN)
        # A second uninterrupted run: the fake model and the sandbox must be deterministic for the compare.
        again_out = tmp / "again"
        again_out.mkdir(exist_ok=True)
        run_to_end(argv(dataset, again_out, server, args, False), again_out)
        for p in compare(base, summary(again_out / RUN)):
            print("NOT DETERMINISTIC:", p)
            bad += 1
        if args.writes:
            return bad + sweep_writes(args, tmp, dataset, server, base)
        finish_start = seen.get("merge start", seen.get("merge done", end * 0.9))
        instants = args.at or sorted(
            [0.01 + (end - 0.01) * i / max(1, args.points - 1) for i in range(args.points)]
            + [
                finish_start + (end - finish_start) * (i + 0.5) / args.finish_points
                for i in range(args.finish_points)
            ]
        )
        for n, at in enumerate(instants):
            out = tmp / f"kill_{n}"
            out.mkdir(exist_ok=True)
            rounds = []
            alive = killed_after(start(argv(dataset, out, server, args, False), out), at)
            rounds.append(f"killed at {at:.3f}s" + ("" if alive else " (had ended)"))
            if args.double_every and n % args.double_every == args.double_every - 1 and (out / RUN).exists():
                second = end * (0.2 + 0.6 * ((n * 7) % 10) / 10)
                alive = killed_after(start(argv(dataset, out, server, args, True), out), second)
                rounds.append(f"resume killed at {second:.3f}s" + ("" if alive else " (had ended)"))
            code, err = run_to_end(argv(dataset, out, server, args, (out / RUN).exists()), out)
            rounds.append(f"resume exit {code}")
            problems = [f"exit {code}: {err[-600:]}"] if code != 0 else []
            if (out / RUN).exists():
                problems += compare(base, summary(out / RUN))
            else:
                problems.append("no run directory")
            bad += bool(problems)
            phase = "finish" if at >= finish_start else "run"
            print(f"[{n:2d}] {phase:6s} {'; '.join(rounds)}: {'OK' if not problems else 'DIVERGES'}")
            for p in problems:
                print("      ", p)
            if not args.keep and not problems:
                subprocess.run(["rm", "-rf", str(out)], check=False)
    print(f"{len(instants)} instants, {bad} diverging")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
