"""The parent's event loop: hand out prompts one at a time as slots free, record every outcome the moment it arrives.

Workers (a ``multiprocessing`` forkserver pool, or Ray actors) connect to the
:class:`~batchrun.run.inbox.Inbox` and say how many prompts they run at once; the loop sends each
worker that many prompts, in plan order, then one more for every outcome it sends back. So a
worker never holds a prompt it cannot start while another has a free slot, and the tail of one
batch never keeps a slot idle: batches are only how outcomes are filed (batch files, the
checkpoint once a batch is complete). The loop records outcomes through the
:class:`~batchrun.run.recorder.Recorder`, relays a 429 pause to every worker, stops the run when
the budget is spent, fails the prompts of a worker that died (``--resume`` runs them again), and
once every outcome is in waits for the workers' background sandbox stops before ending them.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from batchrun.config import RunConfig, UsageError
from batchrun.identity import RowIdentity
from batchrun.prompt.attempt import WorkerSettings
from batchrun.prompt.llm import usage_warning
from batchrun.prompt.sandbox_lifecycle import start_slots_per_worker
from batchrun.prompt.sandboxes import backend_class
from batchrun.protocol import (
    FAILED,
    SKIPPED_AFTER_PASSES,
    EndpointHealth,
    Grant,
    Log,
    Outcome,
    Pause,
    PauseAll,
    PromptJob,
    Ready,
    Received,
    Reserve,
    Skipped,
    Spend,
    StopDone,
    StopQueued,
    StopStarting,
    WorkerExit,
)
from batchrun.record import read_score
from batchrun.run import worker
from batchrun.run.budget import Budget, Decision
from batchrun.run.endpoint_watch import DRAIN_S, RUN_JUDGE, EndpointWatch, probe_once
from batchrun.run.forkserver import WORKER_PROCESS_NAME, skip_callers_main
from batchrun.run.inbox import Inbox
from batchrun.run.recorder import Recorder
from batchrun.run.resume import PassKey, pass_key, row_fields_digest, row_fields_of, row_pass_key
from batchrun.secrets import terminal_safe

GROUP_COMMIT_S = 0.005  # grants wait at most this long for others to share their journal's fsync
PROBE = "endpoint-probe"  # the worker id of the dead-endpoint probes' reservations (the parent's own calls)
POOL_DEAD_AFTER_S = 20.0  # no live worker for this long: the pool is broken (e.g. its forkserver was killed)
STOPS_DRAIN_S = 120.0  # after the last outcome: longest wait for the workers' background sandbox stops


Key = tuple[int, int, int]  # (batch number, prompt index, sample index): one job of the plan


def _key(item: PromptJob | Outcome | Skipped) -> Key:
    return item.batch_num, item.prompt_index, item.sample_index


@dataclass
class _Tracking:
    """What the loop knows about the prompts of the plan."""

    outstanding: dict[int, set[tuple[int, int]]]  # batch number -> (prompt, sample) without an outcome
    jobs: dict[Key, PromptJob]
    pending: collections.deque[PromptJob]  # not handed out yet, in plan order
    free: dict[Any, int] = field(default_factory=dict)  # pid -> free slots of a live worker
    held: dict[Any, set[Key]] = field(
        default_factory=lambda: collections.defaultdict(set)
    )  # pid -> prompts handed to it without an outcome yet
    stops: collections.Counter[Any] = field(default_factory=collections.Counter)  # pid -> stops not done yet


def passing_samples(run_dir: Any, exclude_partial: bool = False) -> collections.Counter[PassKey]:
    """A row's :data:`~batchrun.run.resume.PassKey` -> passing samples in the run's batch files (a resume's
    --stop_after_passes counts them);
    with ``exclude_partial`` the partial ones are not counted: the merge leaves them out of trajectories.jsonl."""
    from batchrun.record import valid_record
    from batchrun.storage import batch_files, iter_jsonl

    passes: collections.Counter[PassKey] = collections.Counter()
    for _, path in batch_files(run_dir):
        for rec in iter_jsonl(path):
            if valid_record(rec) and read_score(rec.get("score")).get("passed") is True:
                if exclude_partial and rec.get("partial"):
                    continue
                passes[pass_key(RowIdentity.of_record(rec).key, row_fields_of(rec.get("metadata")))] += 1
    return passes


class WorkerProcesses:
    """``num`` worker processes forked from the forkserver, each replaced when it dies, until :meth:`terminate`.

    Not ``multiprocessing.Pool``: prompts reach the workers over their inbox connections, so the
    pool's task queue would only hold idle workers blocked on its shared read lock, and a worker
    killed while holding it (the one blocked reading) makes ``Pool.terminate`` wait forever.
    """

    def __init__(self, num: int, initargs: tuple[Any, ...]) -> None:
        self._ctx = mp.get_context("forkserver")
        self._initargs = initargs
        self._procs: list[Any] = []
        self._closed = threading.Event()
        self._lock = threading.Lock()  # no replacement starts while terminate() ends the workers
        for _ in range(num):
            self._procs.append(self._start())
        threading.Thread(target=self._maintain, name="worker-maintenance", daemon=True).start()

    def _start(self) -> Any:
        skip_callers_main()
        proc = self._ctx.Process(
            target=worker.serve, args=self._initargs, daemon=True, name=WORKER_PROCESS_NAME
        )
        proc.start()
        return proc

    def _maintain(self) -> None:
        """Replace a worker that died (its prompts are failed by the dispatch loop); stop if none can start."""
        while not self._closed.wait(0.2):
            with self._lock:
                for i, proc in enumerate(self._procs):
                    if proc.is_alive() or self._closed.is_set():
                        continue
                    proc.join(0)
                    try:
                        self._procs[i] = self._start()
                    except Exception:  # e.g. the forkserver is gone: the loop's broken-pool check takes over
                        return

    def terminate(self) -> None:
        """End every worker now (SIGTERM, then SIGKILL for one that lingers) and reap it."""
        self._closed.set()
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)


class Dispatch:
    """One run's dispatch: :meth:`run` returns when every handed-out prompt has an outcome."""

    def __init__(self, config: RunConfig, settings: WorkerSettings, recorder: Recorder) -> None:
        self.config = config
        self.settings = settings
        self.recorder = recorder
        self.pbar: Any = None
        self.budget = Budget(
            config.budget_tokens,
            config.budget_usd,
            recorder.budget_spent,
        )
        recorder.reserved_tokens = lambda: sum(self.budget.reserved.values())
        self.journal = recorder.journal  # None without a budget: no call waits for a grant then
        self._unsent: list[tuple[Any, int]] = []  # grants written to the journal, sent once it is synced
        self._unsent_since = 0.0
        self.probe_gate = ProbeGate()
        self.usage_fault_warned = False
        self.unpriced_warned = False  # an answer without a cost was counted at the learned price
        self._ending: threading.Thread | None = None  # ends the workers after run() (wait_for_workers)
        self._ending_error: BaseException | None = None
        self.watch: EndpointWatch | None = None  # made with the inbox, in run()
        self.judge_watch: EndpointWatch | None = None  # the judge's endpoint's (--scorer=judge), likewise
        self.endpoint_dead = False  # the run stopped because the endpoint died (exit code 5) or refused
        # The run stopped because the endpoint refused its key or account (exit code 8): the refusal, as
        # "HTTP 402: <the endpoint's words>", redacted.
        self.endpoint_refused: str | None = None
        self.judge_stopped = False  # the endpoint that died or refused was the judge's
        self.stop_concluded = False  # decided as the last prompts ended, not at --endpoint_grace's end
        self._stopped_at: float | None = None  # when the watch that stopped the run stopped it
        # The run lost its workers (exit code 7): the pool broke, or on Ray every actor died (the cluster
        # went away) with prompts of theirs unfinished. Not a few failed prompts: the run could not go on.
        self.workers_lost = False
        self._live: set[Any] = set()  # workers heard from and not gone
        # --stop_after_passes: a row's PassKey -> passing samples so far (earlier runs' included)
        self.passes: collections.Counter[PassKey] = (
            passing_samples(config.run_dir, config.exclude_partial)
            if config.stop_after_passes
            else collections.Counter()
        )
        # A dataset line's PassKey, made once: its fields' digest redacts and hashes them (hidden files of
        # up to 4 MiB), and every hand-out looks up each sample in flight.
        self._pass_keys: dict[int, PassKey] = {}

    def run(self, batches: list[list[PromptJob]]) -> None:
        """Hand the batches' prompts out as workers' slots free, and write every outcome the moment it arrives."""
        from tqdm import tqdm

        config, rec = self.config, self.recorder
        if config.ray_address:  # workers on any node of a Ray cluster: they report over TCP
            from batchrun.run.ray_pool import inbox_endpoint

            inbox = Inbox(
                *inbox_endpoint(), hello=self.settings
            )  # the settings: not in Ray's actor arguments
        else:
            inbox = Inbox()
        rec.total = sum(len(b) for b in batches)
        track = _Tracking(
            outstanding={b[0].batch_num: {(j.prompt_index, j.sample_index) for j in b} for b in batches},
            jobs={_key(j): j for b in batches for j in b},
            pending=collections.deque(j for b in batches for j in b),
        )
        remaining = rec.total
        rec.in_flight = lambda: sum(len(held) for held in track.held.values())  # for status.json
        self.probe_gate.inbox = inbox
        watch_args = dict(
            grace_s=config.endpoint_grace,
            pause=lambda until: inbox.broadcast(PauseAll(until)),
            # With a budget a probe is a call like any: reserved, journaled and counted (see ProbeGate).
            probe=self.probe_gate.probe if self.budget.active else probe_once,
            lift=lambda until: inbox.broadcast(PauseAll(until, lift=True)),
        )
        self.watch = EndpointWatch(self.settings.llm, **watch_args)
        if self.settings.judge_llm is not None:
            # The judge's endpoint, watched apart (its own key, server and model): a judge refused or dead
            # mid-run stops the run as the agent's endpoint does, its samples left for --resume to judge.
            self.judge_watch = EndpointWatch(self.settings.judge_llm, **watch_args, words=RUN_JUDGE)
        self.pbar = tqdm(total=remaining, unit="prompt", dynamic_ncols=True, file=sys.stderr)
        rec.echo = lambda line: self.pbar.write(line, file=sys.stderr)
        start_slots = start_slots_per_worker(
            backend_class(self.settings.sandbox_backend), config.max_sandbox_starts, config.num_workers
        )
        initargs = (self.settings, inbox.address, config.prompts_per_worker, start_slots, os.getpid())
        try:
            pool = self._make_pool(inbox, initargs)
        except BaseException:  # Ctrl-C or SIGTERM while the workers start: no worker's end sweeps after them
            inbox.close()
            backend_class(self.settings.sandbox_backend).sweep(self.settings.sandbox_options)
            raise
        try:
            last_alive = time.monotonic()
            exits_without_progress = 0
            while remaining:
                try:
                    event = inbox.events.get(timeout=1.0)
                except queue.Empty:
                    if inbox.open_connections:
                        last_alive = time.monotonic()
                    elif time.monotonic() - last_alive > POOL_DEAD_AFTER_S:
                        remaining -= self.fail_all_outstanding(track)
                        print(
                            "error: no worker process has been alive for a while; the pool is broken",
                            file=sys.stderr,
                        )
                    rec.write_status("running")
                    remaining -= self.watch_endpoint(inbox, track)
                    self.commit(inbox)
                    continue
                if isinstance(event, WorkerExit):
                    self._live.discard(event.pid)
                    self.grant(inbox, [d for d in self.count_unsettled(event.pid) if d[0] != event.pid])
                    self.grant(inbox, self.budget.drop(event.pid))
                    track.stops.pop(event.pid, None)  # what it was stopping is the backend's sweep's now
                    track.free.pop(event.pid, None)
                    lost = self.fail_lost_prompts(track.held.pop(event.pid, set()), event.pid, track)
                    remaining -= lost
                    if lost and config.ray_address and not self._live:
                        self.workers_lost = True  # dead actors are not replaced: none is left to run a prompt
                    exits_without_progress += 1
                    if exits_without_progress > 2 * config.num_workers + 2:
                        # Workers die as fast as the pool replaces them (e.g. at start-up): stop, don't spin.
                        print("error: worker processes keep dying; giving up on this run", file=sys.stderr)
                        remaining -= self.fail_all_outstanding(track)
                else:
                    if event.pid != PROBE:
                        self._live.add(event.pid)
                    settled = self.handle(event, track, inbox)
                    remaining -= settled
                    exits_without_progress = 0 if settled else exits_without_progress
                remaining -= self.watch_endpoint(inbox, track)
                if self._unsent and (
                    inbox.events.empty() or time.monotonic() - self._unsent_since > GROUP_COMMIT_S
                ):
                    self.commit(inbox)  # the grants of this moment: one fsync, then sent
                rec.write_status("running")
            self.conclude_watches(inbox, track)
            self.probe_gate.closed.set()  # no probe is sent any more (one granted now is refused)
            self.commit(inbox)
            # Every call is made: status.json says all of it now, not as of its last refresh (up to 2 s
            # old), so a kill in the finish phase (a long merge) loses none of this invocation's spend.
            rec.write_status("running", force=True)
            self.wait_for_sandbox_stops(inbox, track)
        finally:
            self.probe_gate.closed.set()
            # Every outcome is in, and every sandbox stop the workers ran after sending one is done,
            # so ending the workers loses nothing. Local ones end (and the backend sweeps after them)
            # while the merge runs: :meth:`wait_for_workers`. The thread is not a daemon, so the
            # process never exits before it is done.
            if config.ray_address:  # Ray's actors are ended from this thread, as before
                self._end_workers(pool, inbox)
            else:
                self._ending = threading.Thread(
                    target=self._end_workers_in_background,
                    args=(pool, inbox),
                    name="end-workers",
                    daemon=False,
                )
                self._ending.start()
            self.pbar.close()

    def count_unsettled(self, worker: Any = None) -> list[Decision]:
        """The calls granted to ``worker`` (None: to every worker, at an interrupt) whose spend will never
        be reported: it died or was ended with them in flight. Sent, they may have been billed, so each is
        counted as a failed attempt with no answer is (unanswered_tokens), at its reservation: its request's
        estimate plus its completion limit. Before, they were in no spend: a Ctrl-C or a dead worker left
        them out of the books, and a resume got them back as budget."""
        decisions: list[Decision] = []
        for (owner, rid), tokens in list(self.budget.reserved.items()):
            if worker is None or owner == worker:
                self.recorder.spend["unanswered_tokens"] += tokens
                if self.journal is not None:
                    self.journal.settle(owner, rid, unanswered_tokens=tokens)
                decisions += self.budget.settle(owner, rid, 0, 0.0, unanswered=tokens)
        return decisions

    def _end_workers(self, pool: Any, inbox: Inbox) -> None:
        if self.config.ray_address:
            pool.terminate(cluster_lost=self.workers_lost)
        else:
            pool.terminate()
        inbox.close()
        backend_class(self.settings.sandbox_backend).sweep(self.settings.sandbox_options)
        browsers = self.settings.tool_settings.browser_cgroup
        if browsers:  # the workers' Chromiums' cgroups, with whatever a killed worker's left in them
            from batchrun.prompt.sandboxes.local.limits import remove_run_cgroups

            remove_run_cgroups(browsers)

    def _end_workers_in_background(self, pool: Any, inbox: Inbox) -> None:
        try:
            self._end_workers(pool, inbox)
        except BaseException as exc:  # raised where the run waits for it (wait_for_workers)
            self._ending_error = exc

    def wait_for_workers(self) -> None:
        """Return once :meth:`run`'s workers are ended and the backend's sweep is done (at once when
        no run started them); what failed there is raised here."""
        if self._ending is not None:
            self._ending.join()
            self._ending = None
        error, self._ending_error = self._ending_error, None
        if error is not None:
            raise error

    def _make_pool(self, inbox: Inbox, initargs: tuple[Any, ...]) -> Any:
        config = self.config
        if config.ray_address:
            from batchrun.run.ray_pool import RayPool, RaySetupError

            try:
                # The settings (keys among them) reach each actor over its inbox connection, as the
                # inbox's hello: Ray keeps actor arguments in its cluster state, readable by any of its users.
                return RayPool(
                    config.ray_address,
                    config.num_workers,
                    worker.init_worker,
                    (None, *initargs[1:]),
                    self.settings,
                )
            except RaySetupError as exc:
                inbox.close()
                raise UsageError(str(exc)) from None
            except (
                BaseException
            ):  # Ctrl-C while the actors start: one that starts later finds no inbox and ends
                inbox.close()
                raise
        # forkserver: workers fork from a clean, single-threaded server that has already imported
        # the heavy modules, so each worker starts in milliseconds and inherits no parent threads.
        worker.start_forkserver(self.settings.sandbox_backend)  # started already: then a no-op
        return WorkerProcesses(config.num_workers, initargs)

    def handle(self, event: Received, track: _Tracking, inbox: Inbox) -> int:
        """One message from a worker; returns how many prompts it settled."""
        message, pid = event.message, event.pid
        if isinstance(message, Ready):  # a worker is up: fill its slots
            track.free[pid] = message.slots
            return self.hand_out(pid, track, inbox)
        elif isinstance(message, (StopQueued, StopDone)):
            self.count_stop(message, pid, track.stops)
        elif isinstance(message, Spend):  # a call of a prompt in flight: the budget counts it at once
            if pid == PROBE:  # the runner's own call (a dead-endpoint probe): no prompt holds it
                if message.prompt_tokens + message.completion_tokens:
                    rec = self.recorder
                    rec.add_check_spend(message.prompt_tokens, message.completion_tokens, message.cost_usd)
                self.recorder.spend["unanswered_tokens"] += message.unanswered_tokens
            elif message.prompt_index >= 0:
                self.recorder.add_live_spend(message)
            if self.journal is not None and message.reservation is not None:
                self.journal.settle(
                    pid,
                    message.reservation,
                    message.prompt_tokens,
                    message.completion_tokens,
                    message.cost_usd,
                    message.unanswered_tokens,
                )
            if message.fault and not self.usage_fault_warned:
                self.usage_fault_warned = True
                self.pbar.write(
                    f"warning: {usage_warning(self.settings.llm.base_url, message.fault)}", file=sys.stderr
                )
            tokens = message.prompt_tokens + message.completion_tokens
            decisions = self.budget.settle(
                pid, message.reservation, tokens, message.cost_usd, message.priced, message.unanswered_tokens
            )
            self.grant(inbox, decisions)
            self.note_unpriced(message, tokens)
            return self.check_budget(inbox, track)
        elif isinstance(message, Reserve):  # may this call be sent? (the budget as a cap)
            self.grant(
                inbox,
                self.budget.request(
                    pid, message.rid, message.tokens, message.priority, message.prompt, message.model
                ),
            )
            return self.check_budget(inbox, track)
        elif isinstance(message, EndpointHealth):
            self.recorder.counts["endpoint_failures"] += (
                message.error_class is not None and not message.refused and not message.judge
            )
            watch = self.judge_watch if message.judge else self.watch
            line = (
                watch.report(message.error_class, message.refused, message.sent_at)
                if watch is not None
                else None
            )
            if line:
                self.pbar.write(line, file=sys.stderr)
        elif isinstance(message, Pause):  # one worker was told to slow down: the whole run does
            self.recorder.counts["rate_limit_pauses"] += 1
            inbox.broadcast(PauseAll(message.until))
        elif isinstance(message, Log):
            self.pbar.write(self.format_log(message), file=sys.stderr)
        elif isinstance(message, (Outcome, Skipped)):
            self.count_pass(message, track)  # before the slot is refilled: a row done needs no more
            held = track.held.get(pid)
            if held is not None and _key(message) in held:
                held.discard(_key(message))
                track.free[pid] = track.free.get(pid, 0) + 1
                # The slot is refilled before the outcome is written (append + fsync), so the
                # worker does not wait for the parent's disk.
                skipped = self.hand_out(pid, track, inbox)
            else:
                skipped = 0
            settled = self.settle(message, track)
            if isinstance(message, Outcome) and self.budget.active:
                usage = message.usage or {}
                tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
                calls = (
                    (usage.get("calls") or 0) if message.kind != FAILED else 0
                )  # a stopped one teaches nothing
                self.grant(inbox, self.budget.prompt_done(_key(message), calls, tokens))
            if self.config.stop_after_passes:
                skipped += self.hand_out_everywhere(track, inbox)
            return settled + skipped + self.check_budget(inbox, track)
        return 0

    def grant(self, inbox: Inbox, decisions: list[Decision]) -> None:
        """The budget's answers: a refusal goes at once; a grant is written to the spend journal and sent
        by :meth:`commit`, once the journal holds it durably (a kill -9 after the send must not lose it
        from the books: the endpoint bills the call)."""
        for pid, rid, ok in decisions:
            if not ok or self.journal is None:
                self._send_grant(inbox, pid, rid, ok)
                continue
            tokens = self.budget.reserved.get((pid, rid), 0)
            price = self.budget.usd_per_token
            self.journal.grant(pid, rid, tokens, tokens * price if price is not None else None)
            if not self._unsent:
                self._unsent_since = time.monotonic()
            self._unsent.append((pid, rid))

    def commit(self, inbox: Inbox) -> None:
        """Make the journal's grants durable (one fsync for all of them), then send them."""
        if not self._unsent:
            return
        self.journal.sync()
        unsent, self._unsent = self._unsent, []
        for pid, rid in unsent:
            self._send_grant(inbox, pid, rid, True)

    def _send_grant(self, inbox: Inbox, pid: Any, rid: int, ok: bool) -> None:
        if pid == PROBE:
            if ok and self.probe_gate.closed.is_set():  # the run is over: not sent after all
                ok = False
                self.budget.settle(PROBE, rid, 0, 0.0)
                if self.journal is not None:
                    self.journal.settle(PROBE, rid)
            self.probe_gate.answer(rid, ok)
        else:
            inbox.send(pid, Grant(rid, ok))

    def hand_out(self, pid: Any, track: _Tracking, inbox: Inbox) -> int:
        """Send worker ``pid`` the next prompts of the plan, one per free slot (none once the budget is spent).
        Returns how many it settled without running them (their row has its --stop_after_passes).

        A worker holds at most its share of the prompts not yet settled (÷ --num_workers): with fewer
        prompts than slots, the first worker up would otherwise take them all and run them on one
        core while the others idle. The share shrinks as prompts settle, so no slot idles at the end.

        With --stop_after_passes=K a row never has more samples running than it may still need
        (K minus its passes): a sample that could turn out unnecessary waits, in plan order, until
        one of the row's samples in flight fails; once the row has K passes its samples are skipped.
        """
        held = track.held[pid]
        skipped = 0
        unsettled = len(track.pending) + sum(len(h) for h in track.held.values())
        share = max(1, -(-unsettled // self.config.num_workers))
        k = self.config.stop_after_passes
        in_flight = self.rows_in_flight(track) if k else collections.Counter()
        waiting: list[PromptJob] = []
        try:
            while (
                track.pending
                and track.free.get(pid, 0) > 0
                and len(held) < share
                and not self.recorder.budget_hit
                and not self.endpoint_dead
            ):
                job = track.pending.popleft()
                if k:
                    row = self.pass_key_of(job)
                    if self.passes[row] >= k:
                        skipped += self.settle(Outcome.discarded(job, SKIPPED_AFTER_PASSES, None, {}), track)
                        continue
                    if self.passes[row] + in_flight[row] >= k:
                        waiting.append(job)
                        continue
                    in_flight[row] += 1
                if not inbox.send(pid, job):  # it is gone: its exit (and its held prompts' failure) follows
                    track.pending.appendleft(job)
                    track.free.pop(pid, None)
                    return skipped
                track.free[pid] -= 1
                held.add(_key(job))
        finally:
            track.pending.extendleft(reversed(waiting))  # back at the front, in plan order
        return skipped

    def rows_in_flight(self, track: _Tracking) -> collections.Counter[PassKey]:
        """A row's PassKey -> its samples handed out without an outcome yet."""
        return collections.Counter(
            self.pass_key_of(track.jobs[key]) for keys in track.held.values() for key in keys
        )

    def pass_key_of(self, job: PromptJob) -> PassKey:
        """The PassKey of ``job``'s dataset line (its prompt_index), as its saved records give it."""
        key = self._pass_keys.get(job.prompt_index)
        if key is None:
            key = self._pass_keys[job.prompt_index] = row_pass_key(job, self.recorder.sample_text)
        return key

    def hand_out_everywhere(self, track: _Tracking, inbox: Inbox) -> int:
        """--stop_after_passes: an outcome may free samples of its row for any worker with a free slot."""
        return sum(self.hand_out(pid, track, inbox) for pid, free in list(track.free.items()) if free > 0)

    def count_pass(self, message: Outcome | Skipped, track: _Tracking) -> None:
        """A passing sample's outcome, counted once (an outcome already settled is not)."""
        if not self.config.stop_after_passes or not isinstance(message, Outcome):
            return
        if (message.prompt_index, message.sample_index) not in track.outstanding.get(message.batch_num, ()):
            return
        score = read_score((message.record or {}).get("score"))
        if self.config.exclude_partial and (message.record or {}).get("partial"):
            return  # never in trajectories.jsonl: no kept pass
        if score.get("passed") is True and self.recorder.keeps(message):  # a discard is no kept pass
            redact = self.recorder.sample_text
            self.passes[message.identity.redacted(redact).key, row_fields_digest(message, redact)] += 1

    def settle(self, message: Outcome | Skipped, track: _Tracking) -> int:
        """Record an outcome (or a skip) once: a prompt already settled (e.g. by a lost-batch report) is ignored."""
        batch_num, index = message.batch_num, (message.prompt_index, message.sample_index)
        if index not in track.outstanding.get(batch_num, ()):
            return 0
        if isinstance(message, Skipped):
            self.recorder.counts["skipped_budget"] += 1
        else:
            self.recorder.record(message)
        track.outstanding[batch_num].discard(index)
        if not track.outstanding[batch_num]:
            del track.outstanding[batch_num]
            self.recorder.write_checkpoint()
        self.pbar.update(1)
        self.pbar.set_postfix_str(self.recorder.progress_text(), refresh=False)
        return 1

    @staticmethod
    def count_stop(message: StopQueued | StopDone, pid: Any, stops: collections.Counter[Any]) -> None:
        """A worker queued a sandbox stop or finished one. A stop is queued just before its prompt's
        outcome is sent, on the same connection, so once every outcome is in every queued stop is counted."""
        stops[pid] += 1 if isinstance(message, StopQueued) else -1
        if not stops[pid]:
            del stops[pid]

    def wait_for_sandbox_stops(self, inbox: Inbox, track: _Tracking) -> None:
        """Workers stop sandboxes (remove containers) in the background, while the prompt's outcome goes
        out: wait for the last of those before the workers are ended, so none outlives the run. What a
        worker that dies or hangs leaves is for the backend's sweep."""
        deadline = time.monotonic() + STOPS_DRAIN_S
        # A probe sent before the last outcome came is awaited too: its answer is billed, and counted here.
        while (
            (track.stops and inbox.open_connections) or any(k[0] == PROBE for k in self.budget.reserved)
        ) and time.monotonic() < deadline:
            try:
                self.after_the_last(inbox.events.get(timeout=0.5), inbox, track)
            except queue.Empty:
                continue
        if track.stops and inbox.open_connections:
            print(
                f"warning: {sum(track.stops.values())} sandbox stop(s) still running after {STOPS_DRAIN_S:g} s; "
                "ending the workers",
                file=sys.stderr,
            )

    def after_the_last(self, event: Any, inbox: Inbox, track: _Tracking) -> None:
        """An event once every prompt has its outcome: a worker gone, a probe's reservation or spend (its
        answer is billed, and counted here), a sandbox stop; the rest say nothing more of the run."""
        if isinstance(event, WorkerExit):
            track.stops.pop(event.pid, None)
        elif event.pid == PROBE:
            self.handle(event, track, inbox)
            self.commit(inbox)
        elif isinstance(event.message, (StopQueued, StopDone)):
            self.count_stop(event.message, event.pid, track.stops)

    def note_unpriced(self, message: Spend, tokens: int) -> None:
        """--budget_usd and an answer without a cost: the summary says so, and a warning once."""
        rec, budget = self.recorder, self.budget
        rec.budget_estimated_usd, rec.budget_unmeasured = budget.estimated_usd, budget.unmeasured
        if message.priced or tokens <= 0 or budget.usd is None or self.unpriced_warned or budget.unmeasured:
            return
        self.unpriced_warned = True
        self.pbar.write(
            "warning: a model answer reported no cost (usage.cost): --budget_usd counts such answers at the "
            f"highest price per token seen so far (${budget.usd_per_token * 1e6:.4f} per million tokens)",
            file=sys.stderr,
        )

    def check_budget(self, inbox: Inbox, track: _Tracking) -> int:
        """Once the run's budget is spent: no new prompt starts (those not handed out yet are settled as
        skipped; returns how many), and prompts in flight stop at their next model call (failed, class
        ``budget``; --resume runs them). With the reservations of batchrun/run/budget.py no call is sent
        that would not fit, so the budget is reached when the next call's worst case no longer fits."""
        rec = self.recorder
        if rec.budget_hit or not (rec.budget_reached() or self.budget.exhausted):
            return 0
        rec.budget_hit = True
        inbox.broadcast(StopStarting())
        self.grant(inbox, self.budget.refuse_all())
        skipped = 0
        while track.pending:
            skipped += self.settle(Skipped(*_key(track.pending.popleft())), track)
        if self.budget.unmeasured:
            self.pbar.write(
                "error: --budget_usd cannot be kept: a model answer reported no cost (usage.cost) before any "
                "answer of this run showed a price (the start check's short answer is not taken as the run's "
                "price), so what the run spends cannot be counted. No new model call is sent; "
                "prompts in flight stop at their next call and prompts not started stay unrun. Continue "
                "with --resume once the endpoint reports costs, or bound the spend with --budget_tokens.",
                file=sys.stderr,
            )
            return skipped
        earlier = (
            f"; earlier invocations ${rec.earlier_usd:.4f}, {rec.earlier_tokens:,} tokens"
            if rec.earlier_tokens or rec.earlier_usd
            else ""
        )
        self.pbar.write(
            f"Budget reached (${rec.spend['cost_usd']:.4f}"
            + (
                f" + ~${self.budget.estimated_usd:.4f} for answers without a cost"
                if self.budget.estimated_usd
                else ""
            )
            + f", {rec.spend['total_tokens']:,} tokens"
            + (
                f" + ~{rec.spend['unanswered_tokens']:,} of attempts that failed mid-answer"
                if rec.spend["unanswered_tokens"]
                else ""
            )
            + earlier
            + (f"; {self.budget.why}" if self.budget.why else "")
            + "): no new prompt starts and prompts in flight stop at their next model call. "
            "Continue later with --resume (and a larger budget).",
            file=sys.stderr,
        )
        return skipped

    def watch_endpoint(self, inbox: Inbox, track: _Tracking) -> int:
        """The dead-endpoint stop (batchrun/run/endpoint_watch.py), the agent's endpoint's and the judge's;
        returns how many prompts it settled."""
        settled = sum(
            self._watch_one(watch, inbox, track)
            for watch in (self.watch, self.judge_watch)
            if watch is not None
        )
        if (
            self.endpoint_dead
            and self._stopped_at is not None
            and time.monotonic() - self._stopped_at > DRAIN_S
        ):
            # Calls in flight to a hung endpoint would hold the run for --request_timeout: they end now.
            held = {k for keys in track.held.values() for k in keys}
            track.held.clear()
            why = "endpoint_dead" if self.endpoint_refused is None else "endpoint_refused"
            return settled + self.fail_lost_prompts(held, -1, track, why)
        return settled

    def conclude_watches(self, inbox: Inbox, track: _Tracking) -> None:
        """Every prompt ended while a watch probes (the last ones refused or failed, with those in
        flight): the stop is decided on its probe's word now (EndpointWatch.conclude), not left undecided
        (a key refused as the run's last prompts ran exited 3, its prompts failed http_401, and nothing
        said the key was refused)."""
        for watch in (self.watch, self.judge_watch):
            if watch is None or self.endpoint_dead:
                continue
            while watch.awaits_probe():  # a budget's probe waits for this loop's grant
                try:
                    self.after_the_last(inbox.events.get(timeout=0.2), inbox, track)
                except queue.Empty:
                    pass
            line = watch.conclude()
            if line:
                self.pbar.write(terminal_safe(self.recorder.redact(line)), file=sys.stderr)
            self._watch_one(watch, inbox, track)

    def _watch_one(self, watch: EndpointWatch, inbox: Inbox, track: _Tracking) -> int:
        line = watch.tick()
        if line:  # a refusal's line quotes the endpoint, which may quote the key
            self.pbar.write(terminal_safe(self.recorder.redact(line)), file=sys.stderr)
        spent = watch.take_spend()
        for probe in spent:  # the probes' answers cost what any call costs
            self.recorder.add_check_spend(probe.prompt_tokens, probe.completion_tokens, probe.cost_usd)
        settled = self.check_budget(inbox, track) if spent else 0
        if watch.dead and not self.endpoint_dead:
            self.endpoint_dead, self._stopped_at = True, watch.dead_at
            self.judge_stopped = watch is self.judge_watch
            self.stop_concluded = watch.concluded
            other = self.watch if self.judge_stopped else self.judge_watch
            if other is not None:  # stopped on this watch's word: the other probes and holds the run no more
                other.stand_down()
            if watch.refused is not None:
                self.endpoint_refused = terminal_safe(self.recorder.redact(watch.refused))[:300]
            inbox.broadcast(StopStarting())
            # Prompts held by the watch's pause then stop at their next call at once, not when it runs out
            # (up to 15 s later: a run whose llama-server died ended 12 s after it said so).
            watch.lift_pause()
            self.grant(inbox, self.budget.refuse_all())
            skipped = 0
            while track.pending:  # not started: left for --resume
                skipped += self.settle(Skipped(*_key(track.pending.popleft())), track)
            return settled + skipped
        return settled

    def format_log(self, message: Log) -> str:
        """A tool call preview: redacted first, then cut to --log_prefix_chars, so no secret shows in part;
        its control characters (the model's arguments, a command's output) shown as ``\\xNN``, not obeyed."""
        n = self.config.log_prefix_chars
        redact = self.recorder.redact

        def cut(text: str) -> str:
            text = redact(text)
            return text if len(text) <= n else text[:n] + "..."

        return terminal_safe(
            f"[{message.prompt_index}] {message.tool}({cut(message.args)}) -> {cut(message.result)}"
        )

    def fail_lost_prompts(
        self, keys: set[Key], pid: Any, track: _Tracking, error_class: str = "worker_died"
    ) -> int:
        """A worker died: the prompts it held will never report, so record them as failed (re-run on resume)."""
        error = (
            f"worker process {pid} ended before the prompt finished"
            if isinstance(pid, int) and pid > 0
            else "no worker process could run it"
        )
        return sum(
            self.settle(Outcome.failed(track.jobs[key], error_class, error), track) for key in sorted(keys)
        )

    def fail_all_outstanding(self, track: _Tracking) -> int:
        """The pool cannot start workers any more: every unfinished prompt fails (re-run on resume)."""
        self.workers_lost = True
        track.pending.clear()
        track.held.clear()
        track.free.clear()
        keys = {(b, *i) for b, indices in track.outstanding.items() for i in indices}
        return self.fail_lost_prompts(keys, -1, track, "pool_broken")


class ProbeGate(worker.ParentGate):
    """The run's budget for the dead-endpoint probes (the parent's own calls, made on the watch's thread):
    each probe asks the dispatch loop for its worst case through the inbox's queue, as a worker's call
    does, and is sent only when granted (and journaled); what it spent is reported the same way. Before,
    probes were sent whatever was left of the budget, and counted only once answered."""

    def __init__(self) -> None:
        super().__init__()
        self.inbox: Inbox | None = None
        self.closed = threading.Event()  # the dispatch loop is over: nothing answers a reservation any more

    def probe(self, cfg: Any, usage: Any) -> Any:
        """:func:`~batchrun.run.endpoint_watch.probe_once` under the budget; its spend goes through
        :meth:`settle` (not ``usage``, which the watch would count a second time)."""
        return probe_once(cfg, None, gate=self)

    def _ask(self, rid: int, tokens: int, priority: int, model: str | None) -> None:
        self._put(Reserve(rid, tokens, priority=1 << 30, prompt=None, model=model))  # before any prompt's

    def _wait(self, event: threading.Event, seconds: float) -> bool:
        from batchrun.prompt.llm import BudgetStop

        while not event.wait(0.5):
            if self.closed.is_set():
                raise BudgetStop()
        return True

    def answer(self, rid: int, ok: bool) -> None:
        self.granted(Grant(rid, ok))

    def settle(self, ticket: Any, usage: dict[str, Any] | None) -> None:
        if ticket is not None:
            self._put(worker.spend_of_usage(usage or {}, -1, -1, 0, ticket))

    def _put(self, message: Any) -> None:
        if self.inbox is not None:
            self.inbox.events.put(Received(PROBE, message))
