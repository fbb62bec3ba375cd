"""The worker pool on a Ray cluster (``--ray_address``): the same workers, on any node of the cluster.

:class:`RayPool` stands in for the local worker processes in :mod:`batchrun.run.dispatch`. It starts the
actors of ``ray.util.multiprocessing.Pool`` with the runner's own initializer and initargs, so each
actor is an ordinary worker: it connects to the parent's inbox (TCP with the run's authkey, at an
address reachable from every node), runs its prompts on threads and sends each outcome back the
moment it finishes. The parent stays the only writer. The actors reserve no CPU (the work is waiting
on the model and the sandboxes) and are spread over the nodes.

Scheduling is the parent's, as for the local pool: each actor says how many prompts it runs at
once and the parent sends it one prompt per free slot over its inbox connection (never a batch up
front, so a slow or dead actor holds no prompt it has not started).

A worker that dies: its inbox connection closes (TCP keepalive covers a machine that vanishes) and
the parent records the prompts it held as failed (``--resume`` runs them again). Dead workers are
not replaced; the rest go on. A parent that dies: each worker's watchdog sees its inbox connection close and exits (Ray also ends
the actors of a driver that is gone).

``ray`` is imported only when a Ray run starts; without it the flag says how to install it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from batchrun.prompt.sandboxes import backend_class

INSTALL_HINT = "pip install 'batch-runner[ray]'"
# Where workers reach the parent's inbox: the host (default: the IP Ray knows this node by) and a
# fixed port, for firewalls (default: any free port).
INBOX_HOST_ENV = "BATCH_RUNNER_INBOX_HOST"
INBOX_PORT_ENV = "BATCH_RUNNER_INBOX_PORT"
CLEANUP_TIMEOUT_S = 30.0
# A call to the cluster's GCS at the end of the run (its node list, leaving it) must answer this fast: a GCS that
# hangs (stopped, swapping, partitioned) accepts connections and never answers, and Ray waits for it forever.
GCS_ANSWER_TIMEOUT_S = 15.0
# The workers must all be up this fast (Ray waits for them forever: a GCS that hangs, a node that never takes one).
START_TIMEOUT_ENV = "BATCH_RUNNER_RAY_START_TIMEOUT_S"
START_TIMEOUT_S = 300.0
PROBE_TIMEOUT_S = 10.0  # the cluster's address must answer this fast at start
# Ray ends a driver whose cluster (its GCS) has not answered for this long, 60 s by default, from a thread
# of its own, whatever the driver is doing: a runner whose cluster died would die too, before merging what it
# recorded. Set for ray.init only (it is read there), so nothing the runner starts inherits it.
GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
GCS_RECONNECT_S = 10 * 365 * 86400
# A gRPC server (Ray's GCS, the Ray Client server) answers the HTTP/2 client preface with a SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4
_ADDRESS = re.compile(r"(ray://)?(\[[0-9a-fA-F:.]+\]|[\w.\-]+):(\d{1,5})")
_AUTH_HINT = (
    "; a cluster with token authentication also needs RAY_AUTH_MODE=token and its token "
    "(RAY_AUTH_TOKEN, or the file ~/.ray/auth_token) on this machine"
)

_owned = False  # whether this process started (or connected) Ray itself, and so shuts it down
_hung = False  # the cluster's GCS stopped answering: no Ray call is made any more, leaving it included


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


def connect(address: str, num_workers: int, entrypoint: str | None = None) -> str:
    """Join the cluster (or start a local one for ``local``) unless Ray is already up; returns a summary.
    ``entrypoint``: this command as the cluster shows it (its job table, dashboard), keys left out."""
    global _owned
    ray = import_ray()
    if not ray.is_initialized():
        quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
        try:
            if address == "local":
                with _outlive_the_cluster(), _shown_as(entrypoint):
                    ray.init(address="local", num_cpus=num_workers, include_dashboard=False, **quiet)
            else:
                probe(address)  # an address where no cluster answers keeps ray.init retrying for many minutes
                with _outlive_the_cluster(), _shown_as(entrypoint):
                    ray.init(address=address, **quiet)
        except RaySetupError:
            raise
        except Exception as exc:
            raise RaySetupError(
                f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: {exc}"
                f"{'' if address == 'local' else _AUTH_HINT}"
            ) from None
        _owned = True
    global _hung
    ended, seen = bounded(lambda: (ray.cluster_resources(), ray.nodes()), GCS_ANSWER_TIMEOUT_S)
    if not ended or isinstance(seen, BaseException):
        _hung = not ended
        shutdown()
        raise RaySetupError(
            f"the Ray cluster at {address} does not answer (its GCS gave no answer in {GCS_ANSWER_TIMEOUT_S:g} s)"
        )
    cpus = int(seen[0].get("CPU", 0))
    nodes = sum(1 for n in seen[1] if n.get("Alive"))
    if cpus < num_workers:
        raise RaySetupError(
            f"--num_workers={num_workers} is more than the {cpus} CPU(s) of the Ray cluster at {address} "
            "(Ray's Pool starts at most one worker per CPU; each runs --prompts_per_worker prompts on threads)"
        )
    return (
        f"Ray {ray.__version__} cluster ({address}): {nodes} node(s), {cpus} CPU(s); "
        f"{num_workers} workers spread over the nodes, reporting to this process over TCP"
    )


@contextlib.contextmanager
def _outlive_the_cluster():
    """ray.init with Ray's limit on a cluster that stopped answering lifted for this driver (unless the user set
    it): the run then ends its own way (its workers' connections close, their prompts fail, --resume runs them)."""
    saved = os.environ.get(GCS_RECONNECT_ENV)
    if saved is None:
        os.environ[GCS_RECONNECT_ENV] = str(GCS_RECONNECT_S)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(GCS_RECONNECT_ENV, None)


@contextlib.contextmanager
def _shown_as(entrypoint: str | None):
    """ray.init records the driver's command line, /proc/self/cmdline, as its job's entrypoint, kept in the
    cluster's job table and shown by ``ray list jobs`` and the dashboard: --api_key=... among it. This
    command line is given instead (Ray has no setting for it: its helper is replaced for the call)."""
    try:
        from ray._private import utils
    except ImportError:
        utils = None
    original = getattr(utils, "get_entrypoint_name", None)
    if entrypoint is None or original is None:
        yield
        return
    utils.get_entrypoint_name = lambda: entrypoint
    try:
        yield
    finally:
        utils.get_entrypoint_name = original


def _target(address: str) -> tuple[str, int] | None:
    """The host and port ray.init would connect to (``auto``: RAY_ADDRESS, or the cluster this machine
    started last); None when that cannot be told (then ray.init says what is wrong)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "").strip() or "auto"
    m = _ADDRESS.fullmatch(address)
    if m and not m.group(1):  # host:port: where Ray connects (localhost is the node's own IP to it)
        with contextlib.suppress(Exception):
            from ray._private import services

            address = services.canonicalize_bootstrap_address(address) or address
    elif not m:
        try:
            from ray._private import services

            address = services.canonicalize_bootstrap_address(address) or ""
        except Exception:
            return None
    m = _ADDRESS.fullmatch(address)
    return (m.group(2).strip("[]"), int(m.group(3))) if m else None


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse an address where no Ray cluster answers, in seconds: ray.init itself retries for many minutes
    (a closed port, a machine that is down) or forever (a port of another server, e.g. the dashboard's)."""
    target = _target(address)
    if target is None:
        return
    host, port = target
    where = f"{host}:{port}" + ("" if f"{host}:{port}" in address else f" (from --ray_address={address})")
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise RaySetupError(
            f"the Ray cluster at {where} does not answer (no connection in {timeout_s:g} s)"
        ) from None
    except OSError as exc:
        raise RaySetupError(
            f"no Ray cluster at {where}: {exc.strerror or exc} (the head's port is the --port of "
            "`ray start --head`, 6379 by default; ray://host:10001 from outside the cluster)"
        ) from None
    with sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return  # the cluster speaks TLS: the connection is all this check can see
        try:
            sock.settimeout(timeout_s)
            sock.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = sock.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
        except OSError:
            head = b""
    if len(head) < 9 or head[3] != _H2_SETTINGS:
        raise RaySetupError(
            f"{where} answers, but not as a Ray cluster (a gRPC server): give the head's port, the --port of "
            "`ray start --head` (6379 by default), not e.g. the dashboard's (8265); ray://host:10001 from "
            "outside the cluster"
        )


def answers() -> bool:
    """Whether the cluster this process joined still answers (a dead or hung one would block Ray's calls):
    its GCS takes a connection, and gives its node list within GCS_ANSWER_TIMEOUT_S."""
    global _hung
    ray = import_ray()
    if _hung:
        return False
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:
        address = None  # Ray Client, or an older Ray: the node list alone tells
    m = _ADDRESS.fullmatch(str(address)) if address else None
    if m:
        try:
            socket.create_connection((m.group(2).strip("[]"), int(m.group(3))), timeout=3).close()
        except OSError:
            return False
    # A stopped GCS still takes connections (the kernel accepts them): only an answer tells it is alive.
    ended, nodes = bounded(ray.nodes, GCS_ANSWER_TIMEOUT_S)
    _hung = not ended
    return not isinstance(nodes, BaseException)


def bounded(
    call: Callable[[], Any], timeout_s: float, on_interrupt: Callable[[], None] | None = None
) -> tuple[bool, Any]:
    """``call()`` on a thread of its own, waited for at most ``timeout_s``: (whether it ended, its result, or
    the exception it raised; None while it runs). Ray's calls to a GCS that hangs never return and cannot be
    cancelled: the thread is left behind (a daemon)."""
    result: list[Any] = [None]

    def target() -> None:
        try:
            result[0] = call()
        except Exception as exc:
            result[0] = exc

    thread = threading.Thread(target=target, name="ray-call", daemon=True)
    thread.start()
    try:
        thread.join(timeout_s)
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        raise
    return not thread.is_alive(), result[0]


def left_hanging() -> bool:
    """Whether this process gave up on a cluster whose GCS hangs (Ray's calls to it still wait)."""
    return _hung


def inbox_endpoint() -> tuple[str, int]:
    """(host, port) for the parent's inbox: the address Ray knows this node by, unless set in the environment."""
    ray = import_ray()
    host = os.environ.get(INBOX_HOST_ENV) or ray.util.get_node_ip_address()
    return host, int(os.environ.get(INBOX_PORT_ENV) or 0)


def shutdown() -> None:
    """Leave the cluster (and stop a local one) if this process joined it; Ray started by the caller stays.

    A cluster whose GCS hangs: leaving it would hang as well (Ray's shutdown waits on the GCS), and so would
    Ray's own shutdown at the interpreter's exit; both are skipped and the process leaves it by exiting.
    """
    global _owned
    if not _owned:
        return
    _owned = False
    ray = import_ray()
    if _hung or not bounded(ray.shutdown, GCS_ANSWER_TIMEOUT_S)[0]:
        import atexit

        atexit.unregister(ray.shutdown)  # else the exit waits on the GCS forever


class RayPool:
    """Ray actors running :func:`batchrun.run.worker.init_worker`, and ``terminate`` as on ``multiprocessing.Pool``."""

    def __init__(
        self,
        address: str,
        processes: int,
        initializer: Callable[..., None],
        initargs: tuple[Any, ...],
        settings: Any,
    ):
        """``settings``: the run's worker settings, for the sweep; not in ``initargs`` (Ray keeps those)."""
        connect(address, processes)
        self._ray = import_ray()
        from ray.util.multiprocessing import Pool

        self._settings = settings
        inbox = initargs[1][0]
        timeout_s = float(os.environ.get(START_TIMEOUT_ENV) or START_TIMEOUT_S)
        # Each actor runs the initializer when it starts: it connects to the inbox and from then
        # on runs what the parent sends it. The Pool's own task queue is never used. Ray waits for the
        # actors without a limit (and a Ctrl-C meanwhile must be taken): a thread of its own.
        ended, made = bounded(
            lambda: Pool(
                processes,
                initializer=initializer,
                initargs=initargs,
                ray_remote_args={"scheduling_strategy": "SPREAD"},
            ),
            timeout_s,
            on_interrupt=shutdown,  # leaving the cluster ends the actors it started
        )
        if not ended:
            why = (
                "the cluster does not answer (its GCS gave no answer)"
                if not answers()
                else "the cluster did not start them (no room on its nodes, or their start hangs)"
            )
            shutdown()
            raise RaySetupError(
                f"the Ray workers did not start within {timeout_s:g} s ({START_TIMEOUT_ENV}): {why}"
            )
        if isinstance(made, BaseException):
            shutdown()
            raise RaySetupError(
                f"the Ray workers could not start: {_short(made)}. Every node needs this package (and its "
                f"dependencies) installed and must reach this process's inbox at {inbox[0]}:{inbox[1]}"
            ) from None
        self._pool = made

    def terminate(self, cluster_lost: bool = False) -> None:
        """End every actor now (like ``multiprocessing.Pool.terminate``), remove their containers, leave Ray.

        A cluster that went away or hangs mid-run: Ray's calls to it block for as long as it does (and a call
        left blocked makes Ray's own shutdown hang), so the sweep is skipped; each call here is bounded.
        """
        global _hung
        bounded(self._pool.terminate, GCS_ANSWER_TIMEOUT_S)
        if cluster_lost:
            # Every worker died: the cluster went away, and a head restarted at its address since makes Ray's
            # next call to it abort this process (a C++ check: "WrongClusterID"), before the run is merged.
            _hung = True
        answering = not _hung and answers()
        if answering and not bounded(self._sweep_nodes, CLEANUP_TIMEOUT_S + GCS_ANSWER_TIMEOUT_S)[0]:
            _hung, answering = True, False
        if not answering:
            print(
                "warning: the Ray cluster does not answer any more"
                + (
                    " (every worker died with it)"
                    if cluster_lost
                    else f" (its GCS gave no answer in {GCS_ANSWER_TIMEOUT_S:g} s)"
                    if _hung
                    else ""
                )
                + ", so what the run's sandboxes left on its nodes (containers of --sandbox=docker) was not removed",
                file=sys.stderr,
            )
        shutdown()

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
