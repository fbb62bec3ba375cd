#!/usr/bin/env python3
"""Batch runner: drive a tool-using agent through a JSONL dataset of prompts in parallel.

    python batch_runner.py --dataset_file=data/prompts.jsonl --batch_size=10 --run_name=my_run

Flow (``BatchRunner.run``): load → resume filter → preflight → dispatch to the pool → merge →
statistics. The parent process is the only writer of everything under ``data/<run_name>/``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import hashlib
import json
import multiprocessing as mp
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

from agent.limiter import Limiter
from agent.llm import NO_KEY, PROVIDER_SORTS, REASONING_EFFORTS, LLMClient, LLMConfig
from agent.loop import LoopLimits
from agent.runner import DISCARDED, FAILED, TRAJECTORY, PromptJob, RunSettings, run_prompt
from agent.sandbox_lifecycle import BackgroundStopper
from agent.sandboxes import BACKENDS, SandboxSpec, create_sandbox
from agent.sandboxes.local import safe_run_name
from agent.storage import (
    append_jsonl,
    batch_files,
    fsync_dir,
    iter_jsonl,
    iter_jsonl_raw,
    pid_alive,
    write_json_atomic,
)
from agent.tools.registry import BUILTIN_TOOL_MODULES, available_toolsets, known_tool_names
from agent.trajectory import first_human, reasoning_counts, used_tool_names
from toolset_distributions import (
    format_distributions,
    get_distribution,
    prompt_rng,
    sample_toolsets_from_distribution,
)

DEFAULT_MODEL = "anthropic/claude-sonnet-4.6"
DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
MOCK_MODEL = "mock"
DEFAULT_DOCKER_IMAGE = "python:3.11-slim"
DOCKER_LIFETIME_MARGIN_S = 600.0  # a container ends itself after 2 x --prompt_timeout + this
# Settings that define what the data is; a resume with other values would mix two datasets.
PRELOAD_MODULES = ["httpcore2", "h11"]  # imported lazily by the SDK's first client: once in the forkserver
LOCK_NAME = ".lock"  # held (flock) by the one runner working in a run directory
STATUS_EVERY_S = 2.0  # status.json refresh period during a run
POOL_DEAD_AFTER_S = 20.0  # no live worker for this long: the pool is broken (e.g. its forkserver was killed)
STOPS_DRAIN_S = 120.0  # after the last outcome: longest wait for the workers' background sandbox stops
MANIFEST_KEYS = ("model", "distribution", "max_turns", "seed", "reasoning_effort", "reasoning_disabled")
SECRET_NAME = re.compile(r"(_KEY|_TOKEN|_SECRET|PASSWORD|_PASS)$|^(API_KEY|TOKEN|SECRET)$", re.IGNORECASE)


class UsageError(ValueError):
    """A flag or input the run cannot start with; printed without a traceback, exit code 2."""


# ----------------------------------------------------------------------------- dataset


@dataclasses.dataclass(frozen=True)
class Row:
    index: int  # 0-based line number in the dataset file: stable whatever else is skipped
    prompt: str
    image: str | None
    cwd: str | None
    occurrence: int  # how many earlier rows hold the same prompt text


def load_dataset(path: str, max_samples: int | None = None) -> tuple[list[Row], list[str]]:
    """Read the JSONL dataset. Bad lines are reported by number and skipped; no usable row is an error."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"dataset file not found: {path}")
    rows: list[Row] = []
    problems: list[str] = []
    seen: collections.Counter[str] = collections.Counter()
    with p.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            problem, row = _parse_line(raw, line_no, seen)
            if problem:
                problems.append(f"{path}:{line_no}: {problem}")
            elif row:
                rows.append(row)
    if not rows:
        detail = f" ({len(problems)} bad line(s); first: {problems[0]})" if problems else ""
        raise UsageError(f"dataset {path} has no usable rows{detail}")
    return rows, problems


def _parse_line(raw: bytes, line_no: int, seen: collections.Counter[str]) -> tuple[str | None, Row | None]:
    if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte order mark is harmless; accept it
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start})", None
    if not text.strip():
        return None, None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg} at column {exc.colno}", None
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}", None
    prompt = obj.get("prompt")
    if prompt is None:
        return "field 'prompt' is missing", None
    if not isinstance(prompt, str):
        return f"field 'prompt' must be a string, got {type(prompt).__name__}", None
    if not prompt.strip():
        return "field 'prompt' is empty", None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        return (
            "field 'prompt' holds an unpaired surrogate escape (\\ud800-\\udfff), not valid Unicode text",
            None,
        )
    image = obj.get("image") or obj.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        return "field 'image'/'docker_image' must be a non-empty string", None
    cwd = obj.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd):
        return "field 'cwd' must be an absolute path string", None
    row = Row(index=line_no - 1, prompt=prompt, image=image, cwd=cwd, occurrence=seen[prompt])
    seen[prompt] += 1
    return None, row


# ----------------------------------------------------------------------------- durable files


class Redactor:
    """Replaces secret values (the API key, secret-looking environment variables) before any write."""

    def __init__(self, api_key: str | None, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        values = {v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8}
        if api_key and api_key != NO_KEY and len(api_key) >= 6:  # "x" for a local server is no secret
            values.add(api_key)
        # Also their JSON-escaped forms, since lines are redacted after serialisation.
        forms = values | {json.dumps(v)[1:-1] for v in values}
        self._pattern = (
            re.compile("|".join(re.escape(v) for v in sorted(forms, key=len, reverse=True)))
            if forms
            else None
        )

    def __call__(self, text: str) -> str:
        return self._pattern.sub("[REDACTED]", text) if self._pattern else text


def _key(text: str) -> bytes:
    """A prompt's identity for resume and de-duplication: a digest, so memory does not grow with prompt size."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


# ----------------------------------------------------------------------------- worker processes

_WORKER: dict[str, Any] = {}


# <tmp>/batch-runner-<run>-<pid>-<random>: one run's local sandboxes
LOCAL_SANDBOX_DIR_PREFIX = "batch-runner-"
FORKSERVER_PRELOAD = ["openai", "agent.runner", *PRELOAD_MODULES, *BUILTIN_TOOL_MODULES]


def start_forkserver() -> None:
    """Start the worker pool's forkserver now, so that its imports run while the parent works.

    The pool made later in ``dispatch`` uses the same server. If nothing is dispatched, the server
    exits with this process.
    """
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver.ensure_running()


def _worker_init(
    settings: RunSettings, inbox: tuple[Any, bytes], slots: int, start_slots: int, parent_pid: int
) -> None:
    """Once per worker process: client, registry and thread pool, so no prompt pays for them."""
    address, authkey = inbox
    remote = isinstance(address, tuple)  # a TCP inbox (Ray): the runner may be on another machine
    _die_with_parent(None if remote else parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    known_tool_names()
    conn = Client(address, authkey=authkey)
    if remote:
        _tcp_keepalive(conn.fileno())  # a runner machine that vanishes breaks the connection too
    _WORKER.update(
        settings=settings,
        conn=conn,
        send_lock=threading.Lock(),
        sandbox_starts=threading.BoundedSemaphore(start_slots),
        llm=LLMClient(
            settings.llm, Limiter(settings.rpm_per_worker, settings.requests_per_worker, _report_pause)
        ),
        stop=threading.Event(),
        slots=threading.BoundedSemaphore(slots),
        threads=ThreadPoolExecutor(max_workers=slots, thread_name_prefix="prompt"),
        # Sandbox stops after the prompt reported (not local: it stops in a few ms on the prompt's thread).
        # The parent counts queued and finished stops and ends the workers only once all are done.
        stopper=BackgroundStopper(
            threads=start_slots,
            max_pending=slots,
            on_queued=lambda: _send({"kind": "stop_queued"}),
            on_done=lambda: _send({"kind": "stopped"}),
        ),
    )
    threading.Thread(target=_listen_to_parent, name="parent-listener", daemon=True).start()


def _listen_to_parent() -> None:
    """Messages from the parent: a run-wide pause (429 elsewhere), or stop starting prompts (budget)."""
    conn = _WORKER["conn"]
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(1)  # the parent is gone: nobody would write our results
        if message.get("kind") == "pause":
            _WORKER["llm"].limiter.pause_until(message["until"])
        elif message.get("kind") == "stop":
            _WORKER["stop"].set()


def _report_pause(until: float) -> None:
    _send({"kind": "pause", "until": until})


def _send(event: dict[str, Any]) -> None:
    event["pid"] = os.getpid()
    with _WORKER["send_lock"]:
        _WORKER["conn"].send(event)


def _die_with_parent(parent_pid: int | None) -> None:
    """End this worker as soon as the runner dies, so no orphan keeps running prompts or spending.

    The kernel signal covers our direct parent (the forkserver, which exits with the runner);
    the watchdog thread covers the runner itself. ``None``: a worker that may run on another
    machine (Ray), where the runner's pid means nothing; it ends when its inbox connection
    closes or breaks (``_listen_to_parent``, with TCP keepalive for a machine that vanishes).
    """
    if parent_pid is None:
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watchdog() -> None:
        while pid_alive(parent_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()


def _tcp_keepalive(fd: int, idle_s: int = 15, interval_s: int = 5, probes: int = 4) -> None:
    """Probe an idle TCP connection, so a peer that vanished (machine down, network cut) ends it within a minute."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", probes)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.close()


def _worker_run_batch(jobs: list[PromptJob]) -> int:
    """Claim a batch and start its prompts as slots free up; returns once all are started."""
    _send({"kind": "claim", "batch_num": jobs[0].batch_num})
    for job in jobs:
        _WORKER["slots"].acquire()
        _WORKER["threads"].submit(_worker_run_one, job)
    return len(jobs)


def _worker_run_one(job: PromptJob) -> None:
    try:
        if _WORKER["stop"].is_set():  # the budget is spent: leave this prompt for a later --resume
            _send({"kind": "skipped", "batch_num": job.batch_num, "prompt_index": job.prompt_index})
            return
        log = (
            (lambda entry: _send({"kind": "log", "prompt_index": job.prompt_index, **entry}))
            if _WORKER["settings"].verbose
            else None
        )
        outcome = run_prompt(
            job,
            _WORKER["settings"],
            _WORKER["llm"],
            sandbox_starts=_WORKER["sandbox_starts"],
            stop_in_background=_WORKER["stopper"].submit,
            log=log,
        )
        _send(outcome)
    finally:
        _WORKER["slots"].release()


class MergeTotals:
    """Statistics accumulated over the merged records, one record at a time."""

    def __init__(self, tool_names: list[str]):
        self.tool_stats = {n: {"count": 0, "success": 0, "failure": 0} for n in tool_names}
        self.dropped: collections.Counter[str] = collections.Counter()
        self.finished: collections.Counter[bytes] = (
            collections.Counter()
        )  # prompt key -> records in batch files
        self.kept = self.completed = self.partial = self.api_calls = 0
        self.with_reasoning = self.without_reasoning = 0
        self.usage: collections.Counter[str] = collections.Counter()

    def add(self, rec: dict[str, Any]) -> None:
        self.kept += 1
        for name, s in (rec.get("tool_stats") or {}).items():
            t = self.tool_stats.setdefault(name, {"count": 0, "success": 0, "failure": 0})
            t["count"] += s.get("count", 0)
            t["success"] += s.get("success", 0)
            t["failure"] += s.get("failure", 0)
        w, n = reasoning_counts(rec.get("conversations", []))
        self.with_reasoning += w
        self.without_reasoning += n - w
        self.completed += bool(rec.get("completed"))
        self.partial += bool(rec.get("partial"))
        self.api_calls += rec.get("api_calls", 0) or 0
        usage = (rec.get("metadata") or {}).get("usage") or {}
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cost_usd"):
            value = usage.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.usage[key] += value

    def summary(self) -> dict[str, Any]:
        tools = {
            name: {**t, "success_rate": round(t["success"] / t["count"], 4) if t["count"] else None}
            for name, t in self.tool_stats.items()
        }
        turns = self.with_reasoning + self.without_reasoning
        return {
            "trajectories": self.kept,
            "completed": self.completed,
            "partial": self.partial,
            "api_calls_in_trajectories": self.api_calls,
            "usage_in_trajectories": {
                "prompt_tokens": self.usage["prompt_tokens"],
                "completion_tokens": self.usage["completion_tokens"],
                "reasoning_tokens": self.usage["reasoning_tokens"],
                "cost_usd": round(self.usage["cost_usd"], 6),
            },
            "dropped_at_merge": {
                k: self.dropped.get(k, 0) for k in ("invalid_lines", "unknown_tool", "duplicate")
            },
            "tool_stats": tools,
            "reasoning": {
                "turns_with_reasoning": self.with_reasoning,
                "turns_without_reasoning": self.without_reasoning,
                "coverage": round(self.with_reasoning / turns, 4) if turns else None,
            },
        }


class Inbox:
    """Where outcomes arrive: one private connection per worker.

    Unlike a shared multiprocessing.Queue (one lock for all writers), a worker killed mid-send
    cannot block the others, and the end of its connection tells the parent at once that it died.
    With ``host`` (workers on other machines: Ray) it listens on TCP on every interface (``port``, 0: any
    free one) and tells workers to connect to ``host``; the authkey keeps other clients out.
    """

    def __init__(self, host: str | None = None, port: int = 0) -> None:
        authkey = os.urandom(16)
        self.remote = host is not None
        if self.remote:
            family, bind = ("AF_INET6", "::") if ":" in host else ("AF_INET", "0.0.0.0")
            self._listener = Listener((bind, port), family=family, authkey=authkey)
            self.address = ((host, self._listener.address[1]), authkey)
        else:
            self._listener = Listener(family="AF_UNIX", authkey=authkey)
            self.address = (self._listener.address, authkey)
        self._ids: set[int] = set()  # remote workers' ids: pids, made unique across machines
        self._closed = False
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.open_connections = 0  # live workers; 0 for long means the pool can no longer make any
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[Any, threading.Lock]] = {}
        threading.Thread(target=self._accept, name="inbox-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, mp.AuthenticationError):
                if self._closed:
                    return
                time.sleep(0.05)
                continue  # a client that failed the handshake (wrong key, hung up): not one of ours
            if self.remote:
                _tcp_keepalive(conn.fileno())  # a machine that vanishes ends its connection too
            with self._lock:
                self.open_connections += 1
                self._conns[id(conn)] = (conn, threading.Lock())
            threading.Thread(target=self._read, args=(conn,), name="inbox-read", daemon=True).start()

    def _read(self, conn: Any) -> None:
        pid = None
        try:
            while True:
                ev = conn.recv()
                if self.remote:  # two machines may run workers with the same pid
                    pid = ev["pid"] = pid if pid is not None else self._unique_id(ev.get("pid"))
                else:
                    pid = ev.get("pid", pid)
                self.events.put(ev)
        except (EOFError, OSError):
            self.events.put({"kind": "worker_exit", "pid": pid})
        finally:
            with self._lock:
                self.open_connections -= 1
                self._conns.pop(id(conn), None)
                self._ids.discard(pid)
            conn.close()

    def _unique_id(self, pid: Any) -> int:
        """The worker's pid, or a number above any Linux pid when a worker elsewhere already has it."""
        with self._lock:
            if not isinstance(pid, int) or pid in self._ids:
                pid = max(self._ids | {1 << 22}) + 1
            self._ids.add(pid)
        return pid

    def broadcast(self, message: dict[str, Any]) -> None:
        """Tell every live worker (a run-wide pause, or: start no new prompt)."""
        with self._lock:
            conns = list(self._conns.values())
        for conn, lock in conns:
            try:
                with lock:
                    conn.send(message)
            except (OSError, ValueError):
                pass  # that worker is gone; its exit is reported by its reader

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# ----------------------------------------------------------------------------- the runner


@dataclasses.dataclass
class Options:
    """Validated run options (the CLI flags plus the additions documented in the README)."""

    dataset_file: str
    batch_size: int
    run_name: str
    distribution: str = "default"
    num_workers: int = 4
    resume: bool = False
    max_samples: int | None = None
    seed: int = 0
    prompts_per_worker: int = 16
    max_sandbox_starts: int = 8
    output_dir: str = "data"
    rerun_discarded: bool = False
    force_resume: bool = False
    max_failure_rate: float = 0.5
    budget_usd: float | None = None
    budget_tokens: int | None = None
    report_max_trajectories: int = 500
    verbose: bool = False
    ray_address: str | None = None  # workers on a Ray cluster instead of local processes


class BatchRunner:
    def __init__(
        self,
        opts: Options,
        settings: RunSettings,
        manifest: dict[str, Any],
        redact: Redactor,
        mock_server: Any = None,
    ):
        self.opts = opts
        self.settings = settings
        self.manifest = manifest
        self.redact = redact
        self.mock_server = mock_server
        self.run_dir = Path(opts.output_dir) / opts.run_name
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.discards: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()
        self.pbar = None
        self.done_indices: set[int] | None = None
        self.local_sandbox_dir: str | None = None  # this run's local sandboxes (see make_local_sandbox_dir)
        self.spend: collections.Counter[str] = collections.Counter()  # this run's usage, all outcomes
        self.budget_hit = False
        self.in_flight_total = 0
        self.status_written = 0.0
        self.started_at = dt.datetime.now().isoformat(timespec="seconds")
        self.last_event_at: str | None = None
        self.isolation = "unknown"
        self.disk_cap: str | None = None  # the Docker disk cap in force, for the start and statistics
        self._lock_file: Any = None

    # -- the steps, top-down

    def run(self) -> int:
        try:
            return self.run_locked()
        finally:
            self.unlock_run_dir()

    def run_locked(self) -> int:
        rows, problems = load_dataset(self.opts.dataset_file, self.opts.max_samples)
        self.report_bad_lines(problems)
        self.prepare_run_dir()
        todo = self.resume_filter(rows) if self.opts.resume else rows
        if todo and not self.opts.ray_address:
            start_forkserver()  # its imports (~1 s) overlap with the parent's own and with preflight
        jobs = self.make_jobs(todo)
        self.print_plan(rows, jobs)
        jobs = self.preflight(jobs)
        self.write_manifest()  # only once the run can start: a rejected start leaves the name free
        interrupted = False
        if jobs:
            try:
                self.dispatch(jobs)
            except KeyboardInterrupt:
                interrupted = True
                print(
                    "\nInterrupted: stopped scheduling, workers ended. Finished prompts are saved.",
                    file=sys.stderr,
                )
        totals = self.merge(rows)
        stats = self.statistics(rows, totals)
        self.write_status("interrupted" if interrupted else "finished", force=True)
        self.write_report()
        self.print_summary(stats, interrupted)
        return self.exit_code(stats, interrupted)

    def report_bad_lines(self, problems: list[str]) -> None:
        for msg in problems[:20]:
            print(f"warning: skipped {msg}", file=sys.stderr)
        if len(problems) > 20:
            print(f"warning: ... and {len(problems) - 20} more bad lines", file=sys.stderr)
        self.counts["bad_lines"] = len(problems)

    def prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock_run_dir()
        existing = any(p.name != LOCK_NAME for p in self.run_dir.iterdir())
        if existing and not self.opts.resume:
            raise UsageError(
                f"{self.run_dir} already holds a run; add --resume to continue it, or choose another --run_name"
            )
        manifest_path = self.run_dir / "run_manifest.json"
        if manifest_path.exists():
            self.check_manifest(json.loads(manifest_path.read_text()))

    def lock_run_dir(self) -> None:
        """One runner per run directory: a second one would write the same prompts twice."""
        import fcntl

        self._lock_file = (self.run_dir / LOCK_NAME).open("a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            owner = self._lock_file.read().strip() or "another process"
            raise UsageError(
                f"{self.run_dir} is in use by a running batch_runner ({owner}); wait for it or stop it"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._lock_file.flush()  # the lock itself dies with the process: nothing to clean up after a crash

    def unlock_run_dir(self) -> None:
        lock, self._lock_file = self._lock_file, None
        if lock is not None:
            lock.close()  # closing the descriptor releases the flock

    def write_manifest(self) -> None:
        write_json_atomic(self.run_dir / "run_manifest.json", self.manifest, self.redact)

    def check_manifest(self, old: dict[str, Any]) -> None:
        changed = [k for k in MANIFEST_KEYS if old.get(k) != self.manifest.get(k)]
        if changed:
            detail = ", ".join(f"{k}: {old.get(k)!r} -> {self.manifest.get(k)!r}" for k in changed)
            if not self.opts.force_resume:
                original = " ".join(_flag(k, old.get(k)) for k in changed)
                raise UsageError(
                    f"--resume with settings that differ from the first run ({detail}) would mix two datasets; "
                    f"resume with the original settings ({original}), or add --force_resume to mix them deliberately"
                )
            print(f"warning: resuming with changed settings ({detail}), as forced", file=sys.stderr)
        if old.get("dataset_sha256") != self.manifest.get("dataset_sha256"):
            print(
                "note: the dataset file changed since the first run; prompts are matched by their text",
                file=sys.stderr,
            )
        self.manifest["created"] = old.get("created", self.manifest.get("created"))

    def resume_filter(self, rows: list[Row]) -> list[Row]:
        """Keep the rows whose prompt has no finished outcome yet, counting duplicates by text."""
        todo = self.unfinished(rows, self.scan_finished())
        print(f"Resume: {len(rows) - len(todo)} prompt(s) already finished, {len(todo)} to run")
        return todo

    def unfinished(self, rows: list[Row], done: collections.Counter[bytes]) -> list[Row]:
        """The rows left once each finished outcome has taken one row of its prompt (duplicates count)."""
        done = collections.Counter(done)
        left = []
        for row in rows:
            key = self.prompt_key(row.prompt)
            if done[key] > 0:
                done[key] -= 1
            else:
                left.append(row)
        return left

    def prompt_key(self, prompt: str) -> bytes:
        """A dataset prompt's key as it appears in saved records (secrets in it were redacted there)."""
        return _key(self.redact(prompt))

    def scan_finished(self) -> collections.Counter[bytes]:
        """Prompt key → number of finished outcomes (trajectories, and discards unless re-run)."""
        done: collections.Counter[bytes] = collections.Counter()
        for _, path in batch_files(self.run_dir):
            for rec in iter_jsonl(path):
                text = first_human(rec.get("conversations", [])) if rec else None
                if text is not None:
                    done[_key(text)] += 1
        self.add_discards(done)
        return done

    def add_discards(self, done: collections.Counter[bytes]) -> None:
        """Discarded prompts count as finished unless --rerun_discarded (they cost money to redo)."""
        discards = self.run_dir / "discarded.jsonl"
        if discards.exists() and not self.opts.rerun_discarded:
            for rec in iter_jsonl(discards):
                if rec and isinstance(rec.get("prompt"), str):
                    done[_key(rec["prompt"])] += 1

    def make_jobs(self, rows: list[Row]) -> list[list[PromptJob]]:
        """Sample toolsets (reproducibly per prompt) and cut the rows into new batches."""
        first = max((n for n, _ in batch_files(self.run_dir)), default=-1) + 1
        try:
            offered = available_toolsets(self.settings.tool_extra)
        except ValueError as exc:
            raise UsageError(f"toolset configuration: {exc}") from None
        dist = get_distribution(self.opts.distribution)
        # The at-least-one guarantee must hold for what is really offered: the most probable available toolset.
        fallback = max(
            (t for t in dist.probabilities if t in offered), key=dist.probabilities.get, default=None
        )
        if fallback is None and rows:
            print(
                f"warning: no toolset of distribution {self.opts.distribution!r} is available here "
                f"({', '.join(dist.probabilities)}); prompts run without tools",
                file=sys.stderr,
            )
        missing: collections.Counter[str] = collections.Counter()
        batches: list[list[PromptJob]] = []
        for i, row in enumerate(rows):
            rng = prompt_rng(self.opts.seed, row.prompt, row.occurrence)
            sampled = sample_toolsets_from_distribution(self.opts.distribution, rng)
            usable = [t for t in sampled if t in offered]
            missing.update(t for t in sampled if t not in offered)
            if not usable and fallback:
                usable = [fallback]
            self.counts.update(f"toolset:{t}" for t in usable)
            job = PromptJob(
                batch_num=first + i // self.opts.batch_size,
                prompt_index=row.index,
                prompt=row.prompt,
                toolsets=tuple(usable),
                image=row.image,
                cwd=row.cwd,
            )
            if i % self.opts.batch_size == 0:
                batches.append([])
            batches[-1].append(job)
        if missing:
            names = ", ".join(f"{t} ({n} prompts)" for t, n in sorted(missing.items()))
            print(f"note: toolsets sampled but not available in this installation, not offered: {names}")
        self.counts.update({f"toolset_missing:{t}": n for t, n in missing.items()})
        return batches

    def print_plan(self, rows: list[Row], jobs: list[list[PromptJob]]) -> None:
        n = sum(len(b) for b in jobs)
        in_flight = min(self.opts.num_workers * self.opts.prompts_per_worker, max(n, 1))
        print(
            f"Run {self.opts.run_name}: {len(rows)} prompts in dataset, {n} to run in {len(jobs)} batches | "
            f"model {self.settings.llm.model} at {self.settings.llm.base_url} | sandbox {self.settings.sandbox_backend} | "
            f"{self.opts.num_workers} workers x {self.opts.prompts_per_worker} prompts = up to {in_flight} in flight, "
            f"{self.opts.max_sandbox_starts} concurrent sandbox start-ups"
        )
        if self.opts.ray_address and jobs:
            from agent.ray_pool import RaySetupError, connect

            try:
                print(connect(self.opts.ray_address, self.opts.num_workers))
            except RaySetupError as exc:
                raise UsageError(str(exc)) from None

    def preflight(self, batches: list[list[PromptJob]]) -> list[list[PromptJob]]:
        """Before any token is spent: the endpoint answers, the backend works, every image is present.

        Fatal problems stop the run here; a missing image fails only its own prompts (no model call).
        """
        if batches:
            self.check_endpoint()
        backend = self.settings.sandbox_backend
        if backend == "local":
            self.preflight_local(batches)
            if batches and not self.opts.ray_address:
                self.make_local_sandbox_dir()
            return batches
        if backend == "singularity":
            from agent.sandboxes.singularity import find_executable

            try:
                print(
                    f"Singularity/Apptainer CLI: {find_executable(self.settings.sandbox_options.get('executable', ''))}"
                )
            except Exception as exc:
                raise UsageError(f"--sandbox=singularity: {exc}") from None
            return batches
        if backend == "modal":
            try:
                import modal  # noqa: F401
            except ImportError:
                raise UsageError(
                    "--sandbox=modal needs the modal SDK: pip install 'batch-runner[modal]'"
                ) from None
            return batches
        return self.preflight_docker(batches)

    def choose_docker_disk_cap(self, image: str | None) -> None:
        """Ask the engine once whether it caps a container's disk itself; else a tmpfs at the workdir."""
        from agent.sandboxes.docker import storage_size_supported, tmpfs_size_mb

        options = self.settings.sandbox_options
        cap = options.get("disk_cap", "auto")
        if cap == "auto":
            cap = "storage-opt" if image is not None and storage_size_supported(image) else "tmpfs"
        mb = options["disk_mb"]
        if cap == "storage-opt":
            self.disk_cap = f"storage-opt {mb} MiB (the engine caps each container's writable layer)"
        else:
            size = tmpfs_size_mb(mb, options["memory_mb"])
            self.disk_cap = (
                f"tmpfs {size} MiB at the working directory (the engine cannot cap a container's layer; "
                "a tmpfs lives in the container's memory: at most half of --container_memory_mb)"
            )
        print(f"Docker disk cap per container: {self.disk_cap}")
        self.settings = dataclasses.replace(self.settings, sandbox_options={**options, "disk_cap": cap})

    def check_endpoint(self) -> None:
        """One cheap request: an unreachable endpoint or a rejected key is a clear error, once."""
        import openai

        cfg = self.settings.llm
        client = openai.OpenAI(
            base_url=cfg.base_url, api_key=cfg.api_key or NO_KEY, max_retries=1, timeout=15
        )
        try:
            client.models.list()
        except openai.AuthenticationError as exc:
            raise UsageError(
                f"the endpoint {cfg.base_url} rejected the API key (HTTP {exc.status_code})"
            ) from None
        except openai.APIConnectionError as exc:
            raise UsageError(f"cannot reach the endpoint {cfg.base_url}: {exc}") from None
        except Exception:
            pass  # some servers have no /models; the first real request will tell

    def preflight_local(self, batches: list[list[PromptJob]]) -> None:
        from agent.sandboxes.local import bwrap_problem

        isolation = self.settings.sandbox_options.get("isolation", "auto")
        problem = bwrap_problem() if isolation != "none" else "isolation disabled (--local_isolation=none)"
        self.isolation = "none" if problem else "bwrap"
        if problem:
            if isolation == "bwrap":
                raise UsageError(f"--local_isolation=bwrap: {problem}")
            print(
                f"warning: the local sandbox has NO isolation: commands run on this machine as this user ({problem})"
            )
        else:
            print(
                "Local sandbox isolation: bubblewrap (host read-only, private workdir and /tmp, own PID namespace)"
            )
        with_image = sum(1 for b in batches for j in b if j.image)
        if with_image:
            print(
                f"warning: {with_image} prompt(s) name a container image, which the local backend ignores; "
                "use --sandbox=docker to run them in their images"
            )

    def preflight_docker(self, batches: list[list[PromptJob]]) -> list[list[PromptJob]]:
        from agent.sandboxes.docker_engine import check_engine, ensure_images, sweep_containers

        try:
            version = check_engine()
        except Exception as exc:
            raise UsageError(str(exc)) from None
        print(f"Docker engine {version}")
        self.isolation = "docker"
        removed = sweep_containers()
        if removed:
            print(f"Removed {len(removed)} leftover container(s) of runners that are gone (any run name)")
        default = self.settings.sandbox_options["default_image"]
        images = sorted({j.image or default for b in batches for j in b})
        if not images:
            return batches
        print(f"Checking {len(images)} image(s); missing ones are pulled once")
        status = ensure_images(images, max_concurrent=4, progress=lambda m: print(f"  {m}"))
        width = max(len(i) for i in images)
        for image in images:
            print(
                f"  {image:<{width}}  {'ready' if status[image] is None else 'NOT AVAILABLE: ' + str(status[image])}"
            )
        bad = {i: e for i, e in status.items() if e is not None}
        self.choose_docker_disk_cap(next((i for i in images if i not in bad), None))
        if not bad:
            return batches
        out = []
        for batch in batches:
            out.append(
                [
                    dataclasses.replace(
                        j,
                        fail_reason=f"image {(j.image or default)!r} not available: {bad[j.image or default]}",
                    )
                    if (j.image or default) in bad
                    else j
                    for j in batch
                ]
            )
        n = sum(1 for b in out for j in b if j.fail_reason)
        print(
            f"warning: {n} prompt(s) will fail without a model call because their image is missing; --resume runs them once it exists"
        )
        return out

    def dispatch(self, batches: list[list[PromptJob]]) -> None:
        """Fan batches out to the pool and write every outcome the moment it arrives."""
        from tqdm import tqdm

        # forkserver: workers fork from a clean, single-threaded server that has already imported
        # the heavy modules, so each worker starts in milliseconds and inherits no parent threads.
        ctx = mp.get_context("forkserver")
        if self.opts.ray_address:  # workers on any node of a Ray cluster: they report over TCP
            from agent.ray_pool import inbox_endpoint

            inbox = Inbox(*inbox_endpoint())
        else:
            inbox = Inbox()
        self.in_flight_total = sum(len(b) for b in batches)
        outstanding = {b[0].batch_num: {j.prompt_index for j in b} for b in batches}
        by_num = {b[0].batch_num: b for b in batches}
        claims: dict[int, set[int]] = collections.defaultdict(set)  # worker pid -> batches it took
        stops: collections.Counter[Any] = collections.Counter()  # worker pid -> sandbox stops not done yet
        remaining = sum(len(b) for b in batches)
        self.pbar = tqdm(total=remaining, unit="prompt", dynamic_ncols=True, file=sys.stderr)
        start_slots = max(1, self.opts.max_sandbox_starts // self.opts.num_workers)
        initargs = (self.settings, inbox.address, self.opts.prompts_per_worker, start_slots, os.getpid())
        if self.opts.ray_address:
            from agent.ray_pool import RayPool, RaySetupError

            try:
                pool = RayPool(
                    self.opts.ray_address, self.opts.num_workers, _worker_init, initargs, inbox.events
                )
            except RaySetupError as exc:
                inbox.close()
                raise UsageError(str(exc)) from None
        else:
            start_forkserver()  # started already by run_locked when it had prompts: then a no-op
            pool = ctx.Pool(self.opts.num_workers, initializer=_worker_init, initargs=initargs)
        previous_term = signal.signal(signal.SIGTERM, _interrupt)
        try:
            for batch in batches:
                pool.apply_async(_worker_run_batch, (batch,))
            last_alive = time.monotonic()
            exits_without_progress = 0
            while remaining:
                try:
                    ev = inbox.events.get(timeout=1.0)
                except queue.Empty:
                    if inbox.open_connections:
                        last_alive = time.monotonic()
                    elif time.monotonic() - last_alive > POOL_DEAD_AFTER_S:
                        remaining -= self.fail_all_outstanding(outstanding, by_num)
                        print(
                            "error: no worker process has been alive for a while; the pool is broken",
                            file=sys.stderr,
                        )
                    self.write_status("running")
                    continue
                if ev["kind"] == "claim":
                    claims[ev["pid"]].add(ev["batch_num"])
                elif ev["kind"] in ("stop_queued", "stopped"):
                    self.count_stop(ev, stops)
                elif ev["kind"] == "pause":  # one worker was told to slow down: the whole run does
                    self.counts["rate_limit_pauses"] += 1
                    inbox.broadcast({"kind": "pause", "until": ev["until"]})
                elif ev["kind"] == "worker_exit":
                    stops.pop(ev["pid"], None)  # what it was stopping is the leftover sweep's now
                    remaining -= self.fail_lost_prompts(
                        claims.pop(ev["pid"], set()), ev["pid"], outstanding, by_num
                    )
                    exits_without_progress += 1
                    if exits_without_progress > 2 * self.opts.num_workers + 2:
                        # Workers die as fast as the pool replaces them (e.g. at start-up): stop, don't spin.
                        print("error: worker processes keep dying; giving up on this run", file=sys.stderr)
                        remaining -= self.fail_all_outstanding(outstanding, by_num)
                else:
                    settled = self.handle_event(ev, outstanding)
                    remaining -= settled
                    exits_without_progress = 0 if settled else exits_without_progress
                    self.check_budget(inbox)
                self.write_status("running")
            self.wait_for_sandbox_stops(inbox, stops)
        finally:
            # Every outcome is in, and every sandbox stop the workers ran after sending one is done,
            # so ending the workers loses nothing. Not close()+join(): join waits forever on a pool
            # whose forkserver died.
            signal.signal(signal.SIGTERM, previous_term)
            pool.terminate()
            inbox.close()
            self.remove_leftover_sandboxes()
            self.pbar.close()

    @staticmethod
    def count_stop(ev: dict[str, Any], stops: collections.Counter[Any]) -> None:
        """A worker queued a sandbox stop or finished one. A stop is queued just before its prompt's
        outcome is sent, on the same connection, so once every outcome is in every queued stop is counted."""
        stops[ev["pid"]] += 1 if ev["kind"] == "stop_queued" else -1
        if not stops[ev["pid"]]:
            del stops[ev["pid"]]

    def wait_for_sandbox_stops(self, inbox: Inbox, stops: collections.Counter[Any]) -> None:
        """Workers stop sandboxes (remove containers) in the background, while the prompt's outcome goes
        out: wait for the last of those before the workers are ended, so none outlives the run. What a
        worker that dies or hangs leaves is for ``remove_leftover_sandboxes``."""
        deadline = time.monotonic() + STOPS_DRAIN_S
        while stops and inbox.open_connections and time.monotonic() < deadline:
            try:
                ev = inbox.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if ev["kind"] in ("stop_queued", "stopped"):
                self.count_stop(ev, stops)
            elif ev["kind"] == "worker_exit":
                stops.pop(ev["pid"], None)
        if stops and inbox.open_connections:
            print(
                f"warning: {sum(stops.values())} sandbox stop(s) still running after {STOPS_DRAIN_S:g} s; "
                "ending the workers",
                file=sys.stderr,
            )

    def make_local_sandbox_dir(self) -> None:
        """One directory holds this run's local sandboxes, so none outlives it.

        The workers' sandboxes go under ``<tmp>/batch-runner-<run>-<pid>-<random>``. After the pool
        ends (normally, on Ctrl-C or after a worker died mid-prompt) the parent removes it; one left
        by a runner that was killed outright is removed by the next run of the same name, once its
        pid is gone. (Ray workers may run on other machines: they keep their own temp dirs.)
        """
        prefix = f"{LOCAL_SANDBOX_DIR_PREFIX}{safe_run_name(self.opts.run_name)}-"
        leftover = re.compile(re.escape(prefix) + r"(\d+)-[A-Za-z0-9_]{8}")
        removed = 0
        for entry in os.scandir(tempfile.gettempdir()):
            m = leftover.fullmatch(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not pid_alive(int(m.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
        if removed:
            print(
                f"Removed {removed} sandbox director(ies) left by an earlier run named {self.opts.run_name}"
            )
        self.local_sandbox_dir = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
        options = {**self.settings.sandbox_options, "base_dir": self.local_sandbox_dir}
        self.settings = dataclasses.replace(self.settings, sandbox_options=options)

    def remove_leftover_sandboxes(self) -> None:
        """After the pool ends (normally, Ctrl-C or a crash of a worker): no sandbox of ours survives."""
        if self.local_sandbox_dir is not None:
            # The workers are gone, and their bubblewrap namespaces die with them (SIGKILL, from the
            # kernel); a process still dying may write a last file: try again a few times.
            for attempt in range(5):
                shutil.rmtree(self.local_sandbox_dir, ignore_errors=True)
                if not os.path.exists(self.local_sandbox_dir):
                    break
                time.sleep(0.1 * (attempt + 1))
            self.local_sandbox_dir = None
        if self.settings.sandbox_backend != "docker":
            return
        from agent.sandboxes.docker_engine import remove_owned_containers

        removed = remove_owned_containers(self.settings.sandbox_options["run_owner"])
        if removed:
            print(f"Removed {len(removed)} container(s) left by interrupted prompts", file=sys.stderr)

    def handle_event(self, ev: dict[str, Any], outstanding: dict[int, set[int]]) -> int:
        """Record one outcome (or print a log line); returns how many prompts it settled."""
        kind = ev["kind"]
        if kind == "log":
            self.pbar.write(self.format_log(ev), file=sys.stderr)
            return 0
        batch_num, index = ev["batch_num"], ev["prompt_index"]
        if index not in outstanding.get(batch_num, ()):
            return 0
        if kind == "skipped":
            self.counts["skipped_budget"] += 1
        else:
            self.record_outcome(ev)
        outstanding[batch_num].discard(index)
        if not outstanding[batch_num]:
            del outstanding[batch_num]
            self.write_checkpoint()
        self.pbar.update(1)
        self.pbar.set_postfix_str(self.progress_text(), refresh=False)
        return 1

    def progress_text(self) -> str:
        minutes = max((time.monotonic() - self.started) / 60, 1e-6)
        text = (
            f"done={self.counts[TRAJECTORY]} failed={self.counts[FAILED]} discarded={self.counts[DISCARDED]} "
            f"tools={self.counts['tool_calls']} tok/min={self.spend['total_tokens'] / minutes:,.0f}"
        )
        if self.spend["cost_usd"]:
            text += f" spent=${self.spend['cost_usd']:.4f}"
        return text

    def check_budget(self, inbox: Inbox) -> None:
        """Once the run's budget is spent, start no new prompt; those in flight finish. Resume later."""
        if self.budget_hit:
            return
        o = self.opts
        hit = (o.budget_usd is not None and self.spend["cost_usd"] >= o.budget_usd) or (
            o.budget_tokens is not None and self.spend["total_tokens"] >= o.budget_tokens
        )
        if hit:
            self.budget_hit = True
            inbox.broadcast({"kind": "stop"})
            self.pbar.write(
                f"Budget reached (${self.spend['cost_usd']:.4f}, {self.spend['total_tokens']:,} tokens): "
                "no new prompts start; the ones in flight finish. Continue later with --resume.",
                file=sys.stderr,
            )

    def write_status(self, state: str, force: bool = False) -> None:
        """status.json for a second terminal (python -m agent.status data/<run>), every few seconds."""
        now = time.monotonic()
        if not force and now - self.status_written < STATUS_EVERY_S:
            return
        self.status_written = now
        elapsed = now - self.started
        settled = (
            self.counts[TRAJECTORY]
            + self.counts[FAILED]
            + self.counts[DISCARDED]
            + self.counts["skipped_budget"]
        )
        rate = settled / elapsed * 60 if elapsed > 0 else 0.0
        left = self.in_flight_total - settled
        status = {
            "run_name": self.opts.run_name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": self.started_at,
            "updated_at": dt.datetime.now().isoformat(timespec="seconds"),
            "state": state,
            "total": self.in_flight_total,
            "done": self.counts[TRAJECTORY],
            "failed": self.counts[FAILED],
            "discarded": self.counts[DISCARDED],
            "skipped_budget": self.counts["skipped_budget"],
            "in_flight": max(0, left) if state == "running" else 0,
            "api_calls": self.spend["requests"],
            "tool_calls": self.counts["tool_calls"],
            "prompt_tokens": self.spend["prompt_tokens"],
            "completion_tokens": self.spend["completion_tokens"],
            "cost_usd": round(self.spend["cost_usd"], 6),
            "tokens_per_min": round(self.spend["total_tokens"] / elapsed * 60, 1) if elapsed > 0 else 0.0,
            "rate_per_min": round(rate, 2),
            "eta_s": round(left / rate * 60, 1) if rate > 0 and left > 0 else None,
            "rate_limit_pauses": self.counts["rate_limit_pauses"],
            "budget": {
                "usd": self.opts.budget_usd,
                "tokens": self.opts.budget_tokens,
                "spent_usd": round(self.spend["cost_usd"], 6),
                "spent_tokens": self.spend["total_tokens"],
                "reached": self.budget_hit,
            },
            "last_event_at": self.last_event_at,
        }
        write_json_atomic(self.run_dir / "status.json", status, self.redact)

    def format_log(self, ev: dict[str, Any]) -> str:
        """A tool call preview: redacted first, then cut to --log_prefix_chars, so no secret shows in part."""
        n = self.settings.log_prefix_chars

        def cut(text: str) -> str:
            text = self.redact(text)
            return text if len(text) <= n else text[:n] + "..."

        return f"[{ev['prompt_index']}] {ev['tool']}({cut(ev['args'])}) -> {cut(ev['result'])}"

    def record_outcome(self, ev: dict[str, Any]) -> None:
        """Write one outcome durably: trajectories to their batch file, discards and failures aside."""
        kind = ev["kind"]
        self.counts[kind] += 1
        self.last_event_at = dt.datetime.now().isoformat(timespec="seconds")
        usage = ev.get("usage") or {}
        for key, value in usage.items():  # Usage.as_dict(): every number is summed, the provider list is not
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.spend[key] += value
        self.spend["total_tokens"] = self.spend["prompt_tokens"] + self.spend["completion_tokens"]
        stamp = dt.datetime.now().isoformat(timespec="seconds")
        if kind == TRAJECTORY:
            rec = ev["record"]
            self.counts["tool_calls"] += sum(s["count"] for s in rec["tool_stats"].values())
            append_jsonl(self.run_dir / f"batch_{ev['batch_num']}.jsonl", rec, self.redact)
            if self.done_indices is not None:
                self.done_indices.add(rec["prompt_index"])
        elif kind == DISCARDED:
            self.discards[ev["reason"]] += 1
            row = {
                "prompt": ev["prompt"],
                "prompt_index": ev["prompt_index"],
                "batch_num": ev["batch_num"],
                "reason": ev["reason"],
                "timestamp": stamp,
                "record": ev["record"],
            }
            append_jsonl(self.run_dir / "discarded.jsonl", row, self.redact)
        else:
            self.failures[ev["error_class"]] += 1
            row = {
                "prompt": ev["prompt"],
                "prompt_index": ev["prompt_index"],
                "batch_num": ev["batch_num"],
                "error_class": ev["error_class"],
                "error": ev["error"],
                "timestamp": stamp,
                "usage": usage,
            }
            append_jsonl(self.run_dir / "failed.jsonl", row, self.redact)
            if self.opts.verbose:
                self.pbar.write(
                    self.redact(f"[{ev['prompt_index']}] failed: {ev['error_class']}: {ev['error']}"),
                    file=sys.stderr,
                )

    def fail_lost_prompts(
        self,
        batch_nums: set[int],
        pid: int,
        outstanding: dict[int, set[int]],
        by_num: dict[int, list[PromptJob]],
        error_class: str = "worker_died",
    ) -> int:
        """A worker died: its unfinished prompts will never report, so record them as failed (re-run on resume)."""
        lost = 0
        for batch_num in batch_nums:
            for job in by_num[batch_num]:
                if job.prompt_index in outstanding.get(batch_num, ()):
                    ev = {
                        "kind": FAILED,
                        "batch_num": batch_num,
                        "prompt_index": job.prompt_index,
                        "prompt": job.prompt,
                        "error_class": error_class,
                        "error": f"worker process {pid} ended before the prompt finished"
                        if pid > 0
                        else "no worker process could run it",
                    }
                    lost += self.handle_event(ev, outstanding)
        return lost

    def fail_all_outstanding(
        self, outstanding: dict[int, set[int]], by_num: dict[int, list[PromptJob]]
    ) -> int:
        """The pool cannot start workers any more: every unfinished prompt fails (re-run on resume)."""
        return self.fail_lost_prompts(set(outstanding), -1, outstanding, by_num, "pool_broken")

    def write_checkpoint(self) -> None:
        """Resume state after each batch. Informational: --resume trusts the batch files' content."""
        if self.done_indices is None:
            self.done_indices = set()
            for _, path in batch_files(self.run_dir):
                self.done_indices.update(
                    rec["prompt_index"]
                    for rec in iter_jsonl(path)
                    if rec and isinstance(rec.get("prompt_index"), int)
                )
        state = {
            "run_name": self.opts.run_name,
            "completed_prompts": sorted(self.done_indices),
            "batches": [n for n, _ in batch_files(self.run_dir)],
            "last_updated": dt.datetime.now().isoformat(timespec="seconds"),
        }
        write_json_atomic(self.run_dir / "checkpoint.json", state, self.redact)

    def merge(self, rows: list[Row]) -> MergeTotals:
        """Stream every batch file into trajectories.jsonl: skip torn lines, unknown tools and extras.

        One pass: each kept line is copied as written (already redacted) and counted for the
        statistics, so memory stays flat and each record is parsed once.
        """
        wanted = collections.Counter(self.prompt_key(r.prompt) for r in rows)
        done_indices: set[int] = set()
        kept: collections.Counter[bytes] = collections.Counter()
        known = set(known_tool_names())
        totals = MergeTotals(known_tool_names())
        out = self.run_dir / "trajectories.jsonl"
        tmp = out.with_name(f".trajectories.jsonl.{os.getpid()}.tmp")
        with tmp.open("wb") as fh:
            for _, path in batch_files(self.run_dir):
                for raw, rec in iter_jsonl_raw(path):
                    text = first_human(rec.get("conversations", [])) if rec else None
                    if text is None:
                        totals.dropped["invalid_lines"] += 1
                        continue
                    key = _key(text)
                    totals.finished[key] += 1
                    if isinstance(rec.get("prompt_index"), int):
                        done_indices.add(rec["prompt_index"])
                    if used_tool_names(rec) - known:
                        totals.dropped["unknown_tool"] += 1
                        continue
                    if key in wanted and kept[key] >= wanted[key]:
                        totals.dropped["duplicate"] += 1
                        continue
                    kept[key] += 1
                    totals.add(rec)
                    fh.write(raw if raw.endswith(b"\n") else raw + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
        fsync_dir(self.run_dir)
        self.done_indices = done_indices  # counted in this pass: no second parse of the batch files
        self.write_checkpoint()
        return totals

    def statistics(self, rows: list[Row], totals: MergeTotals) -> dict[str, Any]:
        """Statistics over the merged output of every run of this run name, plus this run's counters."""
        discards_all: collections.Counter[str] = collections.Counter()
        with_r, without_r = totals.with_reasoning, totals.without_reasoning
        for rec in iter_jsonl(self.run_dir / "discarded.jsonl"):
            if rec and isinstance(rec.get("reason"), str):
                discards_all[rec["reason"]] += 1
                w, n = reasoning_counts((rec.get("record") or {}).get("conversations", []))
                with_r, without_r = with_r + w, without_r + n - w
        failures_all = _count_field(self.run_dir / "failed.jsonl", "error_class")
        summary = totals.summary()
        # Coverage over every sample the model produced, the discarded ones included (SPEC: "over the run").
        summary["reasoning"] = {
            "turns_with_reasoning": with_r,
            "turns_without_reasoning": without_r,
            "coverage": round(with_r / (with_r + without_r), 4) if with_r + without_r else None,
            "coverage_of_kept_trajectories": summary["reasoning"]["coverage"],
        }
        stats = {
            "run_name": self.opts.run_name,
            "model": self.settings.llm.model,
            "distribution": self.opts.distribution,
            "sandbox": self.settings.sandbox_backend,
            "isolation": self.isolation,
            "sandbox_disk_cap": self.disk_cap,
            "dataset_prompts": len(rows),
            **summary,
            "discarded": {"total": sum(discards_all.values()), "by_reason": dict(discards_all)},
            "failed_attempts": {"total": sum(failures_all.values()), "by_class": failures_all},
            "remaining_for_resume": self.count_remaining(rows, totals),
            "this_run": {
                "attempted": self.counts[TRAJECTORY] + self.counts[DISCARDED] + self.counts[FAILED],
                "trajectories": self.counts[TRAJECTORY],
                "discarded": dict(self.discards),
                "failed": dict(self.failures),
                "api_calls": self.spend["requests"],
                "usage": {k: round(v, 8) if isinstance(v, float) else v for k, v in self.spend.items()},
                "skipped_for_budget": self.counts["skipped_budget"],
                "rate_limit_pauses": self.counts["rate_limit_pauses"],
                "bad_dataset_lines": self.counts["bad_lines"],
                "toolsets_offered": {
                    k.split(":", 1)[1]: v for k, v in self.counts.items() if k.startswith("toolset:")
                },
                "toolsets_not_available": {
                    k.split(":", 1)[1]: v for k, v in self.counts.items() if k.startswith("toolset_missing:")
                },
                "duration_s": round(time.monotonic() - self.started, 2),
            },
        }
        write_json_atomic(self.run_dir / "statistics.json", stats, self.redact)
        return stats

    def count_remaining(self, rows: list[Row], totals: MergeTotals) -> int:
        """Dataset rows a --resume would run: no trajectory and (unless re-run) no discard yet."""
        done = collections.Counter(totals.finished)
        self.add_discards(done)
        return len(self.unfinished(rows, done))

    def write_report(self) -> None:
        """report.html beside the data; a report must never fail a finished run."""
        from agent.report import write_report

        try:
            path = write_report(self.run_dir, max_trajectories=self.opts.report_max_trajectories)
            print(f"Report: {path}  (again any time: python -m agent.report {self.run_dir})")
        except Exception as exc:
            print(f"warning: report.html not written: {exc}", file=sys.stderr)

    def print_summary(self, stats: dict[str, Any], interrupted: bool) -> None:
        print("\n" + "=" * 72)
        print(
            f"Run {stats['run_name']}: {stats['trajectories']} trajectories in {self.run_dir / 'trajectories.jsonl'}"
        )
        tr = stats["this_run"]
        print(
            f"This run: {tr['attempted']} attempted, {tr['trajectories']} trajectories, discarded {tr['discarded'] or 0}, failed {tr['failed'] or 0}, {tr['api_calls']} model calls, {tr['duration_s']} s"
        )
        used = {n: s for n, s in stats["tool_stats"].items() if s["count"]}
        if used:
            print(f"{'tool':<20}{'calls':>8}{'ok':>8}{'failed':>8}{'success':>10}")
            for name, s in sorted(used.items(), key=lambda kv: -kv[1]["count"]):
                print(
                    f"{name:<20}{s['count']:>8}{s['success']:>8}{s['failure']:>8}{s['success_rate']:>10.1%}"
                )
        r = stats["reasoning"]
        if r["coverage"] is not None:
            print(
                f"Reasoning coverage: {r['coverage']:.1%} of {r['turns_with_reasoning'] + r['turns_without_reasoning']} assistant turns"
            )
        print(f"Discarded (all runs): {stats['discarded']['total']} {stats['discarded']['by_reason'] or ''}")
        d = stats["dropped_at_merge"]
        if any(d.values()):
            print(f"Dropped at merge: {d}")
        if stats["remaining_for_resume"]:
            print(
                f"{stats['remaining_for_resume']} prompt(s) remain; continue with:\n  {self.redact(resume_command())}"
            )
        print("=" * 72)

    def exit_code(self, stats: dict[str, Any], interrupted: bool) -> int:
        if interrupted:
            return 130
        tr = stats["this_run"]
        failed = sum(tr["failed"].values())
        if tr["attempted"] and failed / tr["attempted"] > self.opts.max_failure_rate:
            print(
                f"error: {failed} of {tr['attempted']} prompts failed (more than --max_failure_rate={self.opts.max_failure_rate})",
                file=sys.stderr,
            )
            return 3
        return 0


def _flag(name: str, value: Any) -> str:
    """A manifest setting as the command-line flag that reproduces it."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--{name}=False"
    return f"--{name}={shlex.quote(str(value))}"


def _count_field(path: Path, field: str) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    if path.exists():
        for rec in iter_jsonl(path):
            if rec and isinstance(rec.get(field), str):
                counts[rec[field]] += 1
    return dict(counts)


def resume_command() -> str:
    """The command that continues this run; the API key is left out (it comes from the environment)."""
    args, skip_next = [], False
    for arg in sys.argv[1:]:
        if skip_next:
            skip_next = False
            continue
        if arg in ("--api_key", "--api-key"):
            skip_next = True  # Fire also takes "--api_key KEY" as two arguments
            continue
        if not arg.startswith(("--resume", "--api_key=", "--api-key=")):
            args.append(shlex.quote(arg))
    return " ".join(["python", "batch_runner.py", *args, "--resume"])


# ----------------------------------------------------------------------------- CLI


def _list(value: Any, flag: str) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    else:
        items = [v.strip() for v in str(value).split(",")]
    if not all(items):
        raise UsageError(f"--{flag} must be a comma-separated list of provider names")
    return tuple(items)


def _positive_int(value: Any, flag: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"--{flag} must be a positive integer, got {value!r}")
    return value


def _optional_bool(value: Any, flag: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise UsageError(f"--{flag} must be True or False, got {value!r}")


def _positive_float(value: Any, flag: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UsageError(f"--{flag} must be a positive number, got {value!r}")
    return float(value)


def _share(total: float | None, workers: int) -> float | None:
    """One worker's share of a run-wide rate, so all workers together stay within it."""
    return None if total is None else total / workers


def _share_int(total: int | None, workers: int) -> int | None:
    if total is None:
        return None
    if total < workers:
        raise UsageError(
            f"--max_concurrent_requests={total} is below --num_workers={workers}; raise it or use fewer workers"
        )
    return total // workers


def load_prefill(path: str | None) -> tuple[dict[str, Any], ...]:
    if not path:
        return ()
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--prefill_messages_file {path}: cannot read: {exc.strerror}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prefill_messages_file {path}: not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise UsageError(
            f"--prefill_messages_file {path}: expected a JSON array of {{role, content}} messages"
        )
    for i, msg in enumerate(data):
        if (
            not isinstance(msg, dict)
            or msg.get("role") not in ("system", "user", "assistant")
            or not isinstance(msg.get("content"), str)
        ):
            raise UsageError(
                f'--prefill_messages_file {path}: message {i} must be {{"role": system|user|assistant, "content": string}}'
            )
    return tuple(data)


def _dataset_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(
    dataset_file: str | None = None,
    batch_size: int | None = None,
    run_name: str | None = None,
    distribution: str = "default",
    model: str = DEFAULT_MODEL,
    api_key: str | None = None,
    base_url: str = DEFAULT_BASE_URL,
    max_turns: int = 10,
    num_workers: int = 4,
    resume: bool = False,
    list_distributions: bool = False,
    verbose: bool = False,
    ephemeral_system_prompt: str | None = None,
    log_prefix_chars: int = 100,
    providers_allowed: str | None = None,
    providers_ignored: str | None = None,
    providers_order: str | None = None,
    provider_sort: str | None = None,
    max_tokens: int | None = None,
    reasoning_effort: str | None = None,
    reasoning_disabled: bool = False,
    prefill_messages_file: str | None = None,
    max_samples: int | None = None,
    # Additions (see README): reproducibility, concurrency, sandboxes, limits, resume policy.
    seed: int = 0,
    prompts_per_worker: int = 16,
    max_sandbox_starts: int = 8,
    sandbox: str | None = None,
    default_image: str = DEFAULT_DOCKER_IMAGE,
    local_isolation: str = "auto",
    container_cpus: float = 1.0,
    container_memory_mb: int = 2048,
    container_disk_mb: int = 4096,
    container_pids_limit: int = 512,
    sandbox_network: bool = True,
    tool_timeout: float = 180.0,
    prompt_timeout: float = 1800.0,
    request_timeout: float = 600.0,
    max_retries: int = 3,
    output_dir: str = "data",
    rerun_discarded: bool = False,
    force_resume: bool = False,
    max_failure_rate: float = 0.5,
    keep_no_reasoning: bool = False,
    ray_address: str | None = None,
    budget_usd: float | None = None,
    budget_tokens: int | None = None,
    max_prompt_tokens: int | None = None,
    max_prompt_usd: float | None = None,
    max_rpm: float | None = None,
    max_concurrent_requests: int | None = None,
    report_max_trajectories: int = 500,
    provider_allow_fallbacks: bool | None = None,
    provider_data_collection: str | None = None,
) -> None:
    """Run a tool-using agent over every prompt of a JSONL dataset; see README.md for every flag."""
    if list_distributions:
        print(format_distributions())
        return
    try:
        code = _run(locals())
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # outside the dispatch (preflight, merge): every written file is intact
        print("\nInterrupted. Continue with --resume.", file=sys.stderr)
        raise SystemExit(130) from None
    if code:
        raise SystemExit(code)


def _run(flags: dict[str, Any]) -> int:
    opts, settings, manifest, redact, mock = build_run(flags)
    try:
        return BatchRunner(opts, settings, manifest, redact, mock).run()
    finally:
        if mock is not None:
            mock.stop()


def build_run(f: dict[str, Any]) -> tuple[Options, RunSettings, dict[str, Any], Redactor, Any]:
    """Check every flag and build the run's settings; raises UsageError with a specific message."""
    if not f["dataset_file"]:
        raise UsageError('--dataset_file is required (a JSONL file with one {"prompt": ...} object per line)')
    if not f["run_name"] or not re.fullmatch(r"[\w.\-]+", str(f["run_name"])):
        raise UsageError(
            "--run_name is required: letters, digits, '.', '-' and '_' only (output goes to data/<run_name>/)"
        )
    batch_size = _positive_int(f["batch_size"], "batch_size")
    num_workers = _positive_int(f["num_workers"], "num_workers")
    ray_address = f["ray_address"]
    if ray_address is not None:  # before anything starts: without Ray, say how to install it
        from agent.ray_pool import RaySetupError, check_address

        try:
            ray_address = check_address(ray_address)
        except RaySetupError as exc:
            raise UsageError(str(exc)) from None
    max_turns = _positive_int(f["max_turns"], "max_turns")
    max_samples = _positive_int(f["max_samples"], "max_samples", allow_none=True)
    max_tokens = _positive_int(f["max_tokens"], "max_tokens", allow_none=True)
    _positive_int(f["prompts_per_worker"], "prompts_per_worker")
    _positive_int(f["max_sandbox_starts"], "max_sandbox_starts")
    try:
        get_distribution(f["distribution"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    effort = f["reasoning_effort"]
    if effort is not None and effort not in REASONING_EFFORTS:
        raise UsageError(f"--reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}")
    if f["provider_sort"] is not None and f["provider_sort"] not in PROVIDER_SORTS:
        raise UsageError(
            f"--provider_sort must be one of {', '.join(PROVIDER_SORTS)}; got {f['provider_sort']!r}"
        )
    if f["provider_data_collection"] not in (None, "allow", "deny"):
        raise UsageError(
            f"--provider_data_collection must be allow or deny; got {f['provider_data_collection']!r}"
        )
    backend = f["sandbox"] or os.environ.get("TERMINAL_ENV") or "local"
    if backend not in BACKENDS:
        raise UsageError(
            f"unknown sandbox backend {backend!r}; valid: {', '.join(BACKENDS)} (--sandbox or TERMINAL_ENV)"
        )
    prefill = load_prefill(f["prefill_messages_file"])
    model, base_url = str(f["model"]), str(f["base_url"])
    mock = None
    if model == MOCK_MODEL:
        from agent.fake_model import FakeModelServer

        mock = FakeModelServer().start()
        base_url = mock.base_url
    api_key = (
        f["api_key"]
        if f["api_key"] is not None
        else os.environ.get("OPENROUTER_API_KEY") or os.environ.get("OPENAI_API_KEY")
    )
    api_key = str(api_key) if api_key else None
    if not api_key and mock is None and ("openrouter.ai" in base_url or "api.openai.com" in base_url):
        raise UsageError(
            f"no API key for {base_url}: pass --api_key or set OPENROUTER_API_KEY (or OPENAI_API_KEY)"
        )
    llm = LLMConfig(
        model=model,
        base_url=base_url,
        api_key=api_key,
        max_tokens=max_tokens,
        reasoning_effort=effort,
        reasoning_disabled=bool(f["reasoning_disabled"]),
        providers_allowed=_list(f["providers_allowed"], "providers_allowed"),
        providers_ignored=_list(f["providers_ignored"], "providers_ignored"),
        providers_order=_list(f["providers_order"], "providers_order"),
        provider_sort=f["provider_sort"],
        provider_allow_fallbacks=_optional_bool(f["provider_allow_fallbacks"], "provider_allow_fallbacks"),
        provider_data_collection=f["provider_data_collection"],
        request_timeout_s=float(f["request_timeout"]),
        max_retries=int(f["max_retries"]),
    )
    settings = RunSettings(
        run_name=str(f["run_name"]),
        llm=llm,
        limits=LoopLimits(
            max_turns=max_turns,
            prompt_timeout_s=float(f["prompt_timeout"]),
            tool_timeout_s=float(f["tool_timeout"]),
            max_prompt_tokens=_positive_int(f["max_prompt_tokens"], "max_prompt_tokens", allow_none=True),
            max_prompt_usd=_positive_float(f["max_prompt_usd"], "max_prompt_usd"),
        ),
        rpm_per_worker=_share(_positive_float(f["max_rpm"], "max_rpm"), num_workers),
        requests_per_worker=_share_int(
            _positive_int(f["max_concurrent_requests"], "max_concurrent_requests", allow_none=True),
            num_workers,
        ),
        sandbox_backend=backend,
        sandbox_options=_sandbox_options(backend, f, str(f["run_name"])),
        sandbox_network=bool(f["sandbox_network"]),
        ephemeral_system_prompt=f["ephemeral_system_prompt"],
        prefill_messages=prefill,
        require_reasoning=not f["keep_no_reasoning"],
        verbose=bool(f["verbose"]),
        log_prefix_chars=int(f["log_prefix_chars"]),
        tool_extra=_tool_extra(llm, Path(str(f["output_dir"])) / str(f["run_name"])),
    )
    opts = Options(
        dataset_file=str(f["dataset_file"]),
        batch_size=batch_size,
        run_name=str(f["run_name"]),
        distribution=f["distribution"],
        num_workers=num_workers,
        resume=bool(f["resume"]),
        max_samples=max_samples,
        seed=int(f["seed"]),
        prompts_per_worker=int(f["prompts_per_worker"]),
        max_sandbox_starts=int(f["max_sandbox_starts"]),
        output_dir=str(f["output_dir"]),
        rerun_discarded=bool(f["rerun_discarded"]),
        force_resume=bool(f["force_resume"]),
        max_failure_rate=float(f["max_failure_rate"]),
        budget_usd=_positive_float(f["budget_usd"], "budget_usd"),
        budget_tokens=_positive_int(f["budget_tokens"], "budget_tokens", allow_none=True),
        report_max_trajectories=_positive_int(f["report_max_trajectories"], "report_max_trajectories"),
        verbose=bool(f["verbose"]),
        ray_address=ray_address,
    )
    manifest = {
        "model": model,
        "distribution": opts.distribution,
        "max_turns": max_turns,
        "seed": opts.seed,
        "reasoning_effort": effort,
        "reasoning_disabled": llm.reasoning_disabled,
        "sandbox": backend,
        "dataset_file": opts.dataset_file,
        "dataset_sha256": _dataset_sha256(opts.dataset_file) if Path(opts.dataset_file).is_file() else None,
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
    }
    return opts, settings, manifest, Redactor(api_key), mock


def _tool_extra(llm: LLMConfig, run_dir: Path) -> dict[str, Any]:
    """What tools beyond terminal/file need: the run's endpoint (vision, moa), run_dir (images), settings."""
    from agent.tools.config import tool_env_snapshot

    return {
        "llm_base_url": llm.base_url,
        "llm_api_key": llm.api_key,
        "llm_model": llm.model,
        "run_dir": str(run_dir.resolve()),
        "tool_env": tool_env_snapshot(),
    }


def _sandbox_options(backend: str, f: dict[str, Any], run_name: str) -> dict[str, Any]:
    options = _backend_options(backend, f)
    try:  # build (not start) one sandbox so a bad option fails now, naming the field
        create_sandbox(backend, SandboxSpec(run_name=run_name, prompt_index=-1), options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return options


def _backend_options(backend: str, f: dict[str, Any]) -> dict[str, Any]:
    """Backend options from the flags; each backend's options dataclass validates them at start."""
    if backend == "local":
        if f["local_isolation"] not in ("auto", "bwrap", "none"):
            raise UsageError(f"--local_isolation must be auto, bwrap or none; got {f['local_isolation']!r}")
        return {"isolation": f["local_isolation"]}
    options: dict[str, Any] = {"default_image": str(f["default_image"])}
    if backend == "docker":
        from agent.sandboxes.docker_engine import default_owner

        options.update(
            cpus=float(f["container_cpus"]),
            memory_mb=int(f["container_memory_mb"]),
            pids_limit=int(f["container_pids_limit"]),
            network_mode="bridge" if f["sandbox_network"] else "none",
            run_owner=default_owner(),
            disk_mb=_positive_int(f["container_disk_mb"], "container_disk_mb"),
            # A backstop should the runner's death go unnoticed: a prompt may outlive its timeout
            # by the run-wide pauses for rate limits, hence the generous margin.
            lifetime_s=2 * max(float(f["prompt_timeout"]), 0.0) + DOCKER_LIFETIME_MARGIN_S,
        )
    elif backend == "modal":
        options.update(cpu=float(f["container_cpus"]), memory_mb=int(f["container_memory_mb"]))
    return options


if __name__ == "__main__":
    import fire

    fire.Fire(main)
