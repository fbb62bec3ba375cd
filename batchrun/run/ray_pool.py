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

import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from batchrun.prompt.sandboxes import backend_class

INSTALL_HINT = "pip install 'batch-runner[ray]'"
# Where workers reach the parent's inbox: the host (default: the IP Ray knows this node by) and a
# fixed port, for firewalls (default: any free port).
INBOX_HOST_ENV = "BATCH_RUNNER_INBOX_HOST"
INBOX_PORT_ENV = "BATCH_RUNNER_INBOX_PORT"
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
    """Ray actors running :func:`batchrun.run.worker.init_worker`, and ``terminate`` as on ``multiprocessing.Pool``."""

    def __init__(
        self,
        address: str,
        processes: int,
        initializer: Callable[..., None],
        initargs: tuple[Any, ...],
    ):
        connect(address, processes)
        self._ray = import_ray()
        from ray.util.multiprocessing import Pool

        self._settings = initargs[0]
        try:
            # Each actor runs the initializer when it starts: it connects to the inbox and from then
            # on runs what the parent sends it. The Pool's own task queue is never used.
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

    def terminate(self) -> None:
        """End every actor now (like ``multiprocessing.Pool.terminate``), remove their containers, leave Ray."""
        try:
            self._pool.terminate()
        except Exception:
            pass
        self._sweep_nodes()
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
