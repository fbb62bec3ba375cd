"""The worker pool on a Ray cluster (``--ray_address``): the same workers, on any node of the cluster.

:class:`RayPool` stands in for ``multiprocessing.Pool`` in ``BatchRunner.dispatch``. It starts the
actors of ``ray.util.multiprocessing.Pool`` with the runner's own initializer and initargs, so each
actor is an ordinary worker: it connects to the parent's inbox (TCP with the run's authkey, at an
address reachable from every node), runs its prompts on threads and sends each outcome back the
moment it finishes. The parent stays the only writer. The actors reserve no CPU (the work is waiting
on the model and the sandboxes) and are spread over the nodes.

Scheduling: Ray's Pool hands calls to its actors round-robin, up front, so a batch queued behind a
slow actor waits and one queued behind a dead actor is lost. Here a batch goes to an actor only when
the actor is idle (every prompt of its last batch has started), as with ``multiprocessing.Pool``'s
shared task queue; a dead actor takes at most the batch it was starting with it.

A worker that dies: its inbox connection closes and the parent records the prompts it claimed as
failed (``--resume`` runs them again). A batch it had received but not claimed yet is recorded failed
here, after a short delay that lets the connection deliver its last outcomes first (an outcome is
recorded once: whichever arrives first wins). Dead workers are not replaced; the rest go on.
A parent that dies: each worker's watchdog sees its inbox connection close and exits (Ray also ends
the actors of a driver that is gone).

``ray`` is imported only when a Ray run starts; without it the flag says how to install it.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from queue import Queue
from typing import Any

from batchrun.prompt.sandboxes import backend_class
from batchrun.protocol import Outcome, Received

INSTALL_HINT = "pip install 'batch-runner[ray]'"
# Where workers reach the parent's inbox: the host (default: the IP Ray knows this node by) and a
# fixed port, for firewalls (default: any free port).
INBOX_HOST_ENV = "BATCH_RUNNER_INBOX_HOST"
INBOX_PORT_ENV = "BATCH_RUNNER_INBOX_PORT"
LOST_BATCH_DELAY_S = 3.0
CLEANUP_TIMEOUT_S = 30.0
_ADDRESS = re.compile(r"(ray://)?(\[[0-9a-fA-F:.]+\]|[\w.\-]+):(\d{1,5})")
_AUTH_HINT = (
    "; a cluster with token authentication also needs RAY_AUTH_MODE=token and its token "
    "(RAY_AUTH_TOKEN, or the file ~/.ray/auth_token) on this machine"
)

_owned = False  # whether this process started (or connected) Ray itself, and so shuts it down


class RaySetupError(RuntimeError):
    """Ray is missing, the cluster cannot be reached, or the workers cannot start."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RaySetupError(f"--ray_address needs Ray, an optional extra: {INSTALL_HINT}") from None
    return ray


def check_address(value: Any) -> str:
    """``auto``, ``local``, ``ray://host:port`` or ``host:port``; Ray must be installed."""
    address = str(value).strip()
    if address not in ("auto", "local"):
        m = _ADDRESS.fullmatch(address)
        if not m or not 0 < int(m.group(3)) < 65536:
            raise RaySetupError(
                f"--ray_address must be auto, local, ray://host:port or host:port; got {value!r}"
            )
    import_ray()
    return address


def connect(address: str, num_workers: int) -> str:
    """Join the cluster (or start a local one for ``local``) unless Ray is already up; returns a summary."""
    global _owned
    ray = import_ray()
    if not ray.is_initialized():
        quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
        try:
            if address == "local":
                ray.init(address="local", num_cpus=num_workers, include_dashboard=False, **quiet)
            else:
                ray.init(address=address, **quiet)
        except Exception as exc:
            raise RaySetupError(
                f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: {exc}"
                f"{'' if address == 'local' else _AUTH_HINT}"
            ) from None
        _owned = True
    cpus = int(ray.cluster_resources().get("CPU", 0))
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if cpus < num_workers:
        raise RaySetupError(
            f"--num_workers={num_workers} is more than the {cpus} CPU(s) of the Ray cluster at {address} "
            "(Ray's Pool starts at most one worker per CPU; each runs --prompts_per_worker prompts on threads)"
        )
    return (
        f"Ray {ray.__version__} cluster ({address}): {nodes} node(s), {cpus} CPU(s); "
        f"{num_workers} workers spread over the nodes, reporting to this process over TCP"
    )


def inbox_endpoint() -> tuple[str, int]:
    """(host, port) for the parent's inbox: the address Ray knows this node by, unless set in the environment."""
    ray = import_ray()
    host = os.environ.get(INBOX_HOST_ENV) or ray.util.get_node_ip_address()
    return host, int(os.environ.get(INBOX_PORT_ENV) or 0)


def shutdown() -> None:
    """Leave the cluster (and stop a local one) if this process joined it; Ray started by the caller stays."""
    global _owned
    if _owned:
        _owned = False
        import_ray().shutdown()


class RayPool:
    """``apply_async`` and ``terminate`` of ``multiprocessing.Pool``, over Ray actors (see the module docstring).

    ``apply_async(func, (jobs,))``: ``jobs`` is the batch (PromptJob list) the failures of a lost batch are
    recorded for; ``events`` is the inbox queue those failures are put in.
    """

    def __init__(
        self,
        address: str,
        processes: int,
        initializer: Callable[..., None],
        initargs: tuple[Any, ...],
        events: Queue,
    ):
        connect(address, processes)
        self._ray = import_ray()
        from ray.util.multiprocessing import Pool

        self._events = events
        self._settings = initargs[0]
        try:
            self._pool = Pool(
                processes,
                initializer=initializer,
                initargs=initargs,
                ray_remote_args={"scheduling_strategy": "SPREAD"},
            )
        except Exception as exc:
            shutdown()
            inbox = initargs[1][0]
            raise RaySetupError(
                f"the Ray workers could not start: {_short(exc)}. Every node needs this package (and its "
                f"dependencies) installed and must reach this process's inbox at {inbox[0]}:{inbox[1]}"
            ) from None
        self._idle = [actor for actor, _ in self._pool._actor_pool]
        self._pending: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._running: dict[Any, tuple[Any, tuple[Any, ...]]] = {}  # object ref -> (actor, args)
        self._timers: list[threading.Timer] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._feed, name="ray-pool", daemon=True)
        self._thread.start()

    def apply_async(self, func: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
        with self._cond:
            if self._closed:
                raise ValueError("Pool not running")
            self._pending.append((func, tuple(args)))
            self._cond.notify()

    def terminate(self) -> None:
        """End every actor now (like ``multiprocessing.Pool.terminate``), remove their containers, leave Ray."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        for timer in self._timers:
            timer.cancel()
        try:
            self._pool.terminate()
        except Exception:
            pass
        self._sweep_nodes()
        shutdown()

    # -- scheduling (the feeder thread)

    def _feed(self) -> None:
        try:
            while not self._closed:
                self._start_idle()
                if not self._running:
                    with self._cond:
                        if not self._closed and not (self._pending and self._idle):
                            self._cond.wait(0.5)
                    continue
                ready, _ = self._ray.wait(list(self._running), num_returns=1, timeout=0.5)
                for ref in ready:
                    self._finished(ref)
        except Exception as exc:
            if not self._closed:  # the cluster is gone: the parent's broken-pool check takes over
                print(f"error: Ray pool scheduler stopped: {_short(exc)}", file=sys.stderr)

    def _start_idle(self) -> None:
        lost: list[tuple[Any, ...]] = []
        with self._cond:
            while self._idle and self._pending:
                func, args = self._pending.popleft()
                actor = self._idle.pop(0)
                self._running[actor.run_batch.remote(func, [(args, None)])] = (actor, args)
            if self._pending and not self._idle and not self._running:
                lost, self._pending = [a for _, a in self._pending], collections.deque()
        for args in lost:
            self._fail(args, "no Ray worker was left to run it")

    def _finished(self, ref: Any) -> None:
        actor, args = self._running.pop(ref)
        try:
            error = next((r for r in self._ray.get(ref) if isinstance(r, BaseException)), None)
            if error is None:
                self._idle.append(actor)
                return
            # The batch function raised: retire the worker, whose prompts already started still report.
            error = getattr(error, "underlying", error)
        except self._ray.exceptions.RayError as exc:
            error = exc
            try:
                self._ray.kill(actor)  # dead or broken: make sure, so its connection closes
            except Exception:
                pass
        reason = f"the Ray worker given this batch ended or failed before finishing it: {_short(error)}"
        timer = threading.Timer(LOST_BATCH_DELAY_S, self._fail, (args, reason))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _fail(self, args: tuple[Any, ...], reason: str) -> None:
        """Record the batch's prompts failed; the parent ignores those that already have an outcome."""
        if self._closed:
            return
        for job in args[0]:
            self._events.put(Received(None, Outcome.failed(job, "worker_died", reason)))

    # -- sandboxes left on the nodes

    def _sweep_nodes(self) -> None:
        """Actors are killed, not asked to stop: the backend sweeps what the run left on every node."""
        settings = self._settings
        ray = self._ray
        try:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            task = ray.remote(num_cpus=0)(_sweep_node)
            refs = [
                task.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                ).remote(settings.sandbox_backend, settings.sandbox_options)
                for n in ray.nodes()
                if n.get("Alive")
            ]
            ray.wait(refs, num_returns=len(refs), timeout=CLEANUP_TIMEOUT_S)
        except Exception as exc:
            print(f"warning: could not sweep sandboxes on the Ray nodes: {_short(exc)}", file=sys.stderr)


def _sweep_node(backend: str, options: dict[str, Any]) -> None:
    """Runs on one node: the backend removes what the run's sandboxes left there (e.g. containers)."""
    try:
        backend_class(backend).sweep(options)
    except Exception:
        pass  # e.g. a node with no Docker engine: nothing of ours can be there


def _short(exc: BaseException, limit: int = 500) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + "..."
