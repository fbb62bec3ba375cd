"""The Docker engine as a whole, for the runner: client, preflight (engine, images, disk cap), cleanup.

Containers are found by their labels: the run name, the prompt index, and the owner
(``pid:starttime@host`` of the run's parent process), so a sweep can tell containers of a live
runner from a dead one's, even after the pid was reused.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
from docker import auth
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.utils import parse_repository_tag
from requests.exceptions import RequestException

from batchrun import cache_dir
from batchrun.prompt.sandboxes._process import cgroup_procs
from batchrun.prompt.sandboxes.base import SandboxError
from batchrun.storage import pid_alive, read_json_object, remove_stale_temp_files, write_text_atomic

log = logging.getLogger(__name__)

LABEL_RUN = "batch_runner.run_name"
LABEL_INDEX = "batch_runner.prompt_index"
LABEL_OWNER = "batch_runner.owner"

# What a call to the engine raises when it fails: docker-py's errors, and requests' own, which
# docker-py lets through when the engine's socket is gone or does not answer (dockerd stopped or
# restarting: ConnectionError; an answer past the client's timeout: ReadTimeout). Caught as
# DockerException alone, a stopped dockerd's ConnectionError left a command of the agent's as a tool
# error (the prompt counted done, its container dead) and ended the run in a traceback at its sweep.
ENGINE_ERRORS = (DockerException, RequestException)

# One client per process: a forked worker must not share its parent's sockets.
_clients: dict[int, docker.DockerClient] = {}
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def docker_client() -> docker.DockerClient:
    """The Docker client of this process (from the environment, API version negotiated), made once."""
    with _lock:
        client = _clients.get(os.getpid())
        if client is None:
            try:
                client = docker.from_env(version="auto", max_pool_size=64)
            except ENGINE_ERRORS as exc:
                raise SandboxError(_unreachable(exc)) from exc
            _clients[os.getpid()] = client
        return client


def check_engine() -> str:
    """The engine's server version; ``SandboxError`` with a clear hint when no engine answers."""
    try:
        return str(docker_client().version().get("Version", "unknown"))
    except ENGINE_ERRORS as exc:
        raise SandboxError(_unreachable(exc)) from exc


def _unreachable(exc: Exception) -> str:
    said = f"Docker engine not reachable: {exc}."
    denied = _socket_denied(exc)
    if denied:
        return f"{said} {denied}, or choose --sandbox=local"
    return f"{said} Start dockerd (or Docker Desktop) or choose --sandbox=local"


def _socket_denied(exc: BaseException) -> str | None:
    """The hint for an engine that runs but whose Unix socket this user may not open (not in its group):
    "Start dockerd" sent a user who is not in the ``docker`` group to a daemon that was running."""
    seen: BaseException | None = exc
    denied = "Permission denied" in str(exc)
    while seen is not None and not denied:
        denied = isinstance(seen, PermissionError) or any(isinstance(a, PermissionError) for a in seen.args)
        seen = seen.__cause__ or seen.__context__
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if not denied or not host.startswith("unix://"):
        return None
    path = host.removeprefix("unix://")
    try:
        import grp

        group = grp.getgrgid(os.stat(path).st_gid).gr_name
    except (OSError, KeyError):
        group = "docker"
    return (
        f"The engine's socket {path} is not open to this user (uid {os.geteuid()}): add the user to its "
        f"group '{group}' (`sudo usermod -aG {group} $USER`, then log in again), use a rootless engine "
        f"(DOCKER_HOST)"
    )


def default_owner() -> str:
    """This process as a container owner: ``pid:starttime@hostname`` (``pid@hostname`` without /proc)."""
    pid = os.getpid()
    start = process_start_ticks(pid)
    return f"{pid}:{start}@{socket.gethostname()}" if start else f"{pid}@{socket.gethostname()}"


def process_start_ticks(pid: int) -> str:
    """When ``pid`` started, in clock ticks since boot (/proc/<pid>/stat field 22); "" where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


PULL_TIMEOUT_S = 1800.0  # one image's pull, at most (the docker option pull_timeout_s: --prompt_timeout)
PULL_BUDGET_S = 3600.0  # all of a run's pulls, at most (the docker option pull_budget_s)
NOT_PULLED = "not present locally, not pulled yet"  # ensure_images(pull=False): an image to pull later
# Why an image whose containers cannot run the command server (container_server.BOOT_SCRIPT is the
# entrypoint ``sh -c``) is not available: distroless, or FROM scratch with one static binary.
NO_SH = "has no sh: the runner's command server needs sh and cat"
# What a container of each image runs before any prompt: the entrypoint's sh, and the sleep that bounds
# the container's life (BOOT_SCRIPT's sleeper: without it, the boot shell is killed at once, and the
# container with it). cat and setsid the server does without.
PROBE_SCRIPT = "command -v sleep >/dev/null 2>&1 || exit 3"
NO_SLEEP_EXIT = 3
NO_SLEEP = "has no sleep: the runner's containers need it to bound their lifetime, and end at once without it"
# The images of this engine's platform that ran the probe once, by image ID: an ID names the image's
# content, so one that ran once always does (runnable_cache_path; only passes are kept).
RUNNABLE_CACHE = "docker-images-runnable.json"
# A probe that failed for another reason (an engine error, a timeout, sh exiting oddly): tried once more.
PROBE_BROKE = "a container of it could not run sh"
RUNNABLE_CACHE_MAX = 4096  # entries kept, the newest


def ensure_images(
    images: list[str],
    *,
    max_concurrent: int = 4,
    progress: Callable[[str], None] = print,
    pull: bool = True,
    pull_timeout_s: float = PULL_TIMEOUT_S,
    pull_budget_s: float = PULL_BUDGET_S,
) -> dict[str, str | None]:
    """Make each distinct image present, pulling missing ones once, and runnable here; image -> None if
    ready, else the error (without ``pull``, a missing one is ``NOT_PULLED``: no registry is asked).

    A pull ends after ``pull_timeout_s`` (a prompt's deadline), and every pull by ``pull_budget_s`` from
    the first: a registry that takes the connection and never answers held the run ~25 s an image,
    4 at a time, without end over a dataset of such rows. Once one pull found its registry silent (no
    answer, refused, unreachable), the other images of that registry fail at once, naming it.

    Runnable: a container of it runs ``PROBE_SCRIPT`` (the command server is an ``sh``), once per image ID
    on this machine (``runnable_cache_path``). Else each of its prompts would pay a model call and
    five container starts, on every --resume, before failing with a message naming neither sh nor
    the image. An image built for another platform than the engine's is probed on every run (an
    emulator registered with binfmt_misc may come and go).
    """
    client = docker_client()
    try:
        version = client.version()
    except ENGINE_ERRORS:
        version = {}
    engine = (str(version.get("Os") or ""), str(version.get("Arch") or ""))
    known = _read_runnable()
    budget_end = time.monotonic() + pull_budget_s
    silent: dict[str, str] = {}  # registry -> why a pull from it found no answer
    passed: list[str] = []
    verdicts: dict[str, str | None] = {}  # image ID -> its probe's verdict: one probe per ID (tags share it)
    probing: dict[str, threading.Lock] = {}
    guard = threading.Lock()

    def ensure(image: str) -> str | None:
        try:
            attrs = client.images.get(image).attrs
        except ImageNotFound:
            attrs = None
        except ENGINE_ERRORS as exc:
            return f"cannot inspect image: {exc}"
        if attrs is None and not pull:
            return NOT_PULLED
        if attrs is None:
            registry = registry_of(image)
            with guard:
                dead = silent.get(registry)
            if dead is not None:
                return f"not present locally, not pulled: its registry {registry} gave no answer this run ({dead})"
            if time.monotonic() >= budget_end:
                return (
                    f"not present locally, not pulled: the pulls took their whole budget of {pull_budget_s:g} s "
                    "(the docker option pull_budget_s)"
                )
            progress(f"pulling {image} ...")
            deadline = time.monotonic() + pull_timeout_s
            limit = f"{pull_timeout_s:g} s (--prompt_timeout, or the docker option pull_timeout_s)"
            if budget_end < deadline:
                deadline, limit = (
                    budget_end,
                    f"the pulls' budget of {pull_budget_s:g} s (the docker option pull_budget_s)",
                )
            problem, answered = pull_image(image, deadline, limit)
            if problem is None:
                try:
                    attrs = client.images.get(image).attrs
                except ENGINE_ERRORS as exc:
                    problem = str(getattr(exc, "explanation", None) or exc)
            if problem is not None:
                if not answered:
                    with guard:
                        silent.setdefault(registry, f"pull of {image}: {problem}")
                progress(f"pull of {image} failed")
                return f"not present locally and the pull failed: {problem}"
            progress(f"pulled {image}")
        image_id = str(attrs.get("Id") or image)
        native = _platform(attrs) == engine
        if native and image_id in known:
            return None
        with guard:
            lock = probing.setdefault(image_id, threading.Lock())
        with lock:
            if image_id not in verdicts:
                verdict = _run_problem(image, attrs, engine)
                # Not the image's fault, maybe: an engine error, or a busy engine whose docker-init
                # found no sh in an image that has one (exit 127, seen at 1-11 of 30 starts with two runs
                # at once): a good image must not lose all its prompts to that. Two more tries.
                for _ in range(2 if verdict is not None and verdict.startswith((PROBE_BROKE, NO_SH)) else 0):
                    verdict = _run_problem(image, attrs, engine)
                    if verdict is None:
                        break
                verdicts[image_id] = verdict
                if verdicts[image_id] is None and native and attrs.get("Id"):
                    passed.append(image_id)
            return verdicts[image_id]

    unique = list(dict.fromkeys(image for image in images if image))
    if not unique:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrent, len(unique)))) as pool:
        status = dict(zip(unique, pool.map(ensure, unique), strict=True))
    if passed:
        _remember_runnable(passed)
    return status


def registry_of(image: str) -> str:
    """The registry an image reference pulls from (``docker.io`` for Docker Hub's)."""
    repository, _ = parse_repository_tag(image)
    try:
        return auth.resolve_repository_name(repository)[0]
    except DockerException:  # a reference the engine will refuse itself
        return repository.split("/", 1)[0]


def pull_image(image: str, deadline: float, limit: str = "its time") -> tuple[str | None, bool]:
    """Pull ``image`` through the engine, ending the request at ``deadline`` (``limit`` says what set
    it; the engine then gives the pull up); (None, True) once done, else (why not, whether its
    registry answered at all).

    docker-py's pull has no overall timeout (its own is off for pulls), and the engine waits ~25 s for
    a registry that never answers (and a slow one's layers without end)."""
    api = docker_client().api
    repository, tag = parse_repository_tag(image)
    headers = {}
    header = auth.get_config_header(api, registry_of(image))
    if header:
        headers["X-Registry-Auth"] = header
    params = {"fromImage": repository, "tag": tag or "latest"}
    answered, error, response, cut = False, None, None, None
    try:
        # The timeout bounds the wait for the engine's first answer, which comes once the registry's did.
        response = api._post(
            api._url("/images/create"), params=params, headers=headers, stream=True,
            timeout=max(deadline - time.monotonic(), 0.1),
        )  # fmt: skip
        api._raise_for_status(response)
        raw = api._get_raw_response_socket(response)
        cut = threading.Timer(
            max(deadline - time.monotonic(), 0.0), _shut, args=(getattr(raw, "_sock", raw),)
        )
        cut.daemon = True
        cut.start()
        for message in api._stream_helper(response, decode=True):
            answered = True  # the engine reports progress once the registry answered
            if isinstance(message, dict) and message.get("error"):
                error = str(message.get("error"))
    except Exception as exc:  # the engine's error, the timeout, or the connection ended at the deadline
        error = str(getattr(exc, "explanation", None) or exc)
    finally:
        if cut is not None:
            cut.cancel()
        if response is not None:
            response.close()
    if time.monotonic() >= deadline:
        how = "was not done" if answered else "had no answer from the registry"
        return f"it {how} within {limit}", answered
    if error is not None:
        return error, not _no_answer(error)
    return None, True


# The engine's words when a registry gave no answer at all: refused, unreachable, silent.
NO_ANSWER_SIGNS = (
    "awaiting headers", "i/o timeout", "connection refused", "no such host", "network is unreachable",
    "no route to host", "tls handshake timeout", "context deadline exceeded", "connection reset",
)  # fmt: skip


def _no_answer(error: str) -> bool:
    lowered = error.lower()
    return any(sign in lowered for sign in NO_ANSWER_SIGNS)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _platform(attrs: dict[str, Any]) -> tuple[str, str]:
    return (str(attrs.get("Os") or ""), str(attrs.get("Architecture") or ""))


def _run_problem(image: str, attrs: dict[str, Any], engine: tuple[str, str]) -> str | None:
    """None when a container of ``image`` (``attrs``: its inspection) runs ``PROBE_SCRIPT`` on this engine
    (``engine``: its os and arch); else why not: no sh or sleep, or built for a platform the engine cannot run."""
    platform = _platform(attrs)
    foreign = platform != engine and "" not in platform and "" not in engine
    built, here = "/".join(platform), "/".join(engine)
    cannot = f"built for {built}, and this engine ({here}) cannot run it" if foreign else ""
    client = docker_client()
    try:
        container = client.containers.create(
            image, entrypoint=["sh", "-c", PROBE_SCRIPT], command=[], network_mode="none",
            labels={LABEL_RUN: "image-probe", LABEL_OWNER: default_owner()},
        )  # fmt: skip
    except ENGINE_ERRORS as exc:
        if foreign:
            return f"built for {built}, not this engine's {here}, and no container of it could be made: {exc}"
        return f"{PROBE_BROKE} (no container of it could be made: {getattr(exc, 'explanation', None) or exc})"
    try:
        container.start()
        code = container.wait(timeout=60).get("StatusCode")
        if code != 0:
            logs = container.logs(tail=5).decode(errors="replace").strip()
            said = f"sh exited {code}" + (f" ({logs[-300:]})" if logs else "")
        else:
            said = ""
    except Exception as exc:  # the engine's start error ("exec format error", no sh), or the wait's timeout
        said = str(getattr(exc, "explanation", None) or exc)
        code = None
    finally:
        _remove(container)
    if not said:
        return None
    if code == NO_SLEEP_EXIT:
        return NO_SLEEP
    if cannot:
        return f"{cannot}: {said}"
    if code == 127 or sh_not_found(said):
        return f"{NO_SH} ({sh_words(said)})"
    return f"{PROBE_BROKE} ({said})"


def sh_words(said: str) -> str:
    """What the engine said of a missing ``sh``: runc's words without its own before them ("failed to
    create shim task: ..."), else all of it."""
    cut = said.find('exec: "sh"')
    return said[cut:].removesuffix(": unknown") if cut >= 0 else said


def sh_not_found(said: str) -> bool:
    """Whether the engine's words (runc's, or docker-init's in the container's output) say that a
    container has no ``sh`` to run."""
    return 'exec: "sh": executable file not found' in said or "exec sh failed: No such file" in said


def runnable_cache_path() -> Path:
    """Where the IDs of the images that ran the probe are kept: the runner's cache directory
    (``batchrun.cache_dir``: ``$XDG_CACHE_HOME/batch-runner``), beside its other caches."""
    return Path(cache_dir(), RUNNABLE_CACHE)


def _read_runnable() -> dict[str, float]:
    """The cache's image IDs (with when they last passed); {} when it is absent or damaged."""
    obj = read_json_object(runnable_cache_path())
    ids = obj.get("runnable") if obj and obj.get("probe") == PROBE_SCRIPT else None
    if not isinstance(ids, dict):
        return {}
    return {k: v for k, v in ids.items() if isinstance(k, str) and isinstance(v, int | float)}


def _remember_runnable(image_ids: list[str]) -> None:
    """Add ``image_ids`` to the cache (read again: another run may have added some), replaced whole;
    a cache that cannot be written only costs the next run its probes."""
    path = runnable_cache_path()
    ids = {**_read_runnable(), **dict.fromkeys(image_ids, round(time.time()))}
    kept = dict(sorted(ids.items(), key=lambda kv: kv[1])[-RUNNABLE_CACHE_MAX:])
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_stale_temp_files(path.parent)  # a copy of the cache (~300 KiB) per runner killed writing it
        write_text_atomic(path, json.dumps({"probe": PROBE_SCRIPT, "runnable": kept}))
    except OSError as exc:
        log.info("could not keep the runnable images in %s: %s", path, exc)


def _owner_alive(owner: str) -> bool | None:
    """Whether the ``pid[:starttime]@host`` owner is alive: None when it lives on another host (cannot tell).

    A live pid with another start time is a new process that reused the number: the owner is dead.
    """
    ident, _, host = owner.partition("@")
    pid, _, start = ident.partition(":")
    if host != socket.gethostname():
        return None
    if not pid.isdigit():
        return False
    if not pid_alive(int(pid)):
        return False
    return not start or process_start_ticks(int(pid)) in ("", start)


def sweep_containers() -> list[str]:
    """Remove the containers, of any run, whose owner process is dead on this host; returns their names.

    Only containers that carry our owner label are looked at; those of live runners, and of
    runners on other hosts sharing this engine, are left alone.
    """
    removed = []
    # ignore_removed: containers that end themselves vanish between the listing and their inspection.
    for container in docker_client().containers.list(
        all=True, filters={"label": LABEL_OWNER}, ignore_removed=True
    ):
        if _owner_alive(container.labels.get(LABEL_OWNER, "")) is False:
            removed += _remove(container)
    return removed


def storage_size_supported(image: str) -> bool:
    """Whether the engine caps a container's writable layer (``--storage-opt size=``).

    Asked by creating (never starting) a container: overlay2 accepts it only on xfs mounted with
    pquota, and most engines refuse, which is the answer, not a failure.
    """
    client = docker_client()
    try:
        container = client.containers.create(
            image, command=["true"], storage_opt={"size": "64m"},
            labels={LABEL_RUN: "storage-probe", LABEL_OWNER: default_owner()},
        )  # fmt: skip
    except ENGINE_ERRORS:
        return False
    _remove(container)
    return True


def layer_paths(attrs: dict[str, Any]) -> list[str]:
    """Where a container's files that no cap of the engine holds are on the engine's disk (``attrs``:
    its inspection): its writable layer (overlay2's ``UpperDir``), then its volumes; [] without a layer."""
    upper = ((attrs.get("GraphDriver") or {}).get("Data") or {}).get("UpperDir")
    if not upper:
        return []
    volumes = [
        m["Source"] for m in attrs.get("Mounts") or [] if m.get("Type") == "volume" and m.get("Source")
    ]
    return [upper, *volumes]


def layer_watch_problem(image: str) -> str | None:
    """Why this process cannot watch the writable layer of a container of ``image`` (see
    ``disk_watch``), or None. Asked by creating (never starting) a container and reading its layer."""
    client = docker_client()
    try:
        container = client.containers.create(
            image, command=["true"], labels={LABEL_RUN: "layer-probe", LABEL_OWNER: default_owner()}
        )
    except ENGINE_ERRORS as exc:
        return f"no container could be made to look at ({exc})"
    try:
        paths = layer_paths(container.attrs)
        if not paths:
            driver = (container.attrs.get("GraphDriver") or {}).get("Name")
            return f"the engine's storage driver ({driver}) names no writable layer"
        try:
            os.scandir(paths[0]).close()
            os.statvfs(paths[0])
        except OSError as exc:
            why = (
                "not root"
                if os.geteuid() != 0
                else "the engine is not on this machine, or in another mount namespace"
            )
            return f"its writable layer cannot be read here ({why}: {exc})"
        return None
    finally:
        _remove(container)


def remove_owned_containers(owner: str, *, passes: int = 5, pause_s: float = 0.5) -> list[str]:
    """Remove every container this owner (see ``default_owner``) started, e.g. on Ctrl-C; returns their names.

    A worker ended mid-start may have a create request still in the engine: after a pass that
    found containers, look again a moment later, until a pass finds none.
    """
    removed: list[str] = []
    for attempt in range(passes):
        if attempt:
            time.sleep(pause_s)
        found = []
        for container in docker_client().containers.list(
            all=True, filters={"label": f"{LABEL_OWNER}={owner}"}, ignore_removed=True
        ):
            found += _remove(container)
        removed += found
        if not found:
            break
    return removed


def _remove(container) -> list[str]:
    try:
        container.remove(force=True, v=True)
    except NotFound:
        return []
    except APIError as exc:
        if exc.status_code == 409:  # being removed already: it ended itself (auto-remove)
            return [container.name] if wait_removed(container.id) else []
        log.warning("could not remove container %s: %s", container.name, exc)
        return []
    except ENGINE_ERRORS as exc:
        log.warning("could not remove container %s: %s", container.name, exc)
        return []
    return [container.name]


def wait_removed(container_id: str, timeout_s: float = 10.0) -> bool:
    """Wait for a removal the engine has in progress (a 409 on remove), so that what we call gone is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            docker_client().api.inspect_container(container_id)
        except NotFound:
            return True
        except ENGINE_ERRORS:
            return False
        time.sleep(0.05)
    log.warning("container %s is still being removed", container_id[:12])
    return False


# ----------------------------------------------------------------------------- the run's cgroup
# The containers of a run go under one cgroup of the engine's (``--cgroup-parent``) that holds them
# together to what the machine can spare (base.run_share): each container has its own limits, and a
# few hundred of them could otherwise fill the machine's memory or its pid_max. Made where the engine
# runs on this machine with the cgroupfs driver (the systemd driver wants a slice, made through
# systemd) and this process may write the engine's cgroup tree; elsewhere the containers have their
# own limits only, and the start of the run says so.
RUN_CGROUP_PREFIX = "batch-runner-docker-"
# <prefix><pid>-<random>[-<PID namespace>]: the pid is one of the runner's PID namespace (named since
# the sweep below judged a runner in another one by a pid of its own and took it for gone).
_RUN_CGROUP_NAME = re.compile(rf"{re.escape(RUN_CGROUP_PREFIX)}([0-9]+)-[0-9a-f]+(?:-([0-9]+))?")
CGROUP_ROOT = "/sys/fs/cgroup"


def run_cgroup_problem(info: dict[str, Any]) -> str | None:
    """Why the run's containers cannot be held together here, or None; ``info``: the engine's ``docker
    info``."""
    if info.get("CgroupDriver") != "cgroupfs":
        return f"the engine's cgroup driver is {info.get('CgroupDriver')!r}, not cgroupfs"
    if any("rootless" in str(o) for o in info.get("SecurityOptions") or []):
        return "the engine is rootless"
    host = os.environ.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return f"the engine is reached over {host.split('://')[0]} (maybe on another machine)"
    if not os.access(CGROUP_ROOT, os.W_OK) and not os.access(os.path.join(CGROUP_ROOT, "memory"), os.W_OK):
        return "this process may not write the machine's cgroup tree (not root)"
    return None


def engine_processes_problem(info: dict[str, Any]) -> str | None:
    """Why the engine's containers' processes may not be in this process's PID namespace (``docker
    inspect``'s ``State.Pid`` one of ours), or None: the engine answers on a Unix socket, from a
    ``dockerd`` this process sees (the socket's peer). ``info``: the engine's ``docker info``."""
    host = os.environ.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return f"the engine is reached over {host.split('://')[0]} (maybe on another machine)"
    if any("rootless" in str(o) for o in info.get("SecurityOptions") or []):
        return "the engine is rootless (its containers' processes are in a PID namespace of its own)"
    path = host[len("unix://") :] if host else "/var/run/docker.sock"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(path)
            pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        name = os.path.basename(os.readlink(f"/proc/{pid}/exe")) if pid > 0 else ""
    except OSError as exc:
        return f"the engine's socket {path} cannot be asked who serves it ({exc})"
    if pid <= 0:  # the kernel gives 0 for a peer outside this PID namespace
        return "the engine runs in another PID namespace (a runner in a container, say)"
    if not name.startswith("dockerd"):
        return f"the engine's socket is served by {name!r}, not by a dockerd of this machine"
    return None


def _run_cgroup_dirs(name: str) -> list[tuple[str, str]]:
    """(directory, controller) of the run's cgroup: v2's one, or v1's memory and pids ones."""
    if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
        return [(os.path.join(CGROUP_ROOT, name), "")]
    return [(os.path.join(CGROUP_ROOT, c, name), c) for c in ("memory", "pids")]


def make_run_cgroup(memory_bytes: int, pids: int) -> str:
    """The run's cgroup, holding its containers to ``memory_bytes`` and ``pids`` together; its name
    (carrying this process's pid, so that the next run removes it once this process is gone).
    OSError when the kernel refuses."""
    namespace = pid_namespace()
    name = f"{RUN_CGROUP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}" + (f"-{namespace}" if namespace else "")
    # controller ("": v2's one hierarchy) -> the files that hold its limits
    files = {
        "": (("memory.max", memory_bytes), ("pids.max", pids)),
        "memory": (("memory.limit_in_bytes", memory_bytes),),
        "pids": (("pids.max", pids),),
    }
    made = []
    try:
        for path, controller in _run_cgroup_dirs(name):
            if controller == "":
                with open(os.path.join(CGROUP_ROOT, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory +pids")
            os.mkdir(path)
            made.append(path)
            for file, value in files[controller]:
                with open(os.path.join(path, file), "w") as f:
                    f.write(str(value))
    except OSError:
        for path in made:
            _rmdir_cgroup(path)
        raise
    return name


def _hierarchies() -> list[str]:
    """Every cgroup hierarchy mounted under CGROUP_ROOT: the engine makes the run's cgroup in each
    (v1: cpu, blkio, freezer, ... too, not only the memory and pids ones its limits are in)."""
    if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
        return [CGROUP_ROOT]
    try:
        return [e.path for e in os.scandir(CGROUP_ROOT) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def is_run_cgroup(name: str) -> bool:
    """Whether ``name`` is a run cgroup as ``make_run_cgroup`` names them: the only cgroups whose
    processes are killed and which are removed here. A ``cgroup_parent`` of the user's own (in
    --sandbox_settings, kept where the run's cannot be made) is neither: for "/" the kill would be
    every process of the machine's."""
    return _RUN_CGROUP_NAME.fullmatch(name) is not None


def remove_run_cgroup(name: str, *, wait_s: float = 30.0) -> bool:
    """Remove the run's cgroup, in every hierarchy, once the engine has removed its containers' (it
    does as they go): within ``wait_s`` for all of them (waited per hierarchy, the run's end took
    a minute for each of v1's ten while a process stayed in it)."""
    if not is_run_cgroup(name):
        raise ValueError(f"not a run cgroup of the runner's: {name!r}")
    deadline = time.monotonic() + wait_s
    left = [os.path.join(hierarchy, name) for hierarchy in _hierarchies()]
    pause_s = 0.05
    while True:
        left = [path for path in left if not _rmdir_cgroup(path)]
        if not left or time.monotonic() >= deadline:
            return not left
        time.sleep(pause_s)
        pause_s = min(pause_s + 0.05, 1.0)


def kill_cgroup_processes(name: str, *, spare_known: bool = False) -> int:
    """SIGKILL every process left in the run's cgroup ``name`` (every hierarchy, the containers'
    cgroups in it); how many. Once the engine removed every container of the run, what runs there
    is a container no engine removes any more: its dockerd was killed (SIGKILL, a crash) and started
    again, and the new one lists it no more while its shim keeps it running, its stream's end never
    seen, until its lifetime (hours). It also held the cgroup, so the run's end waited for it.

    ``spare_known``: not in the cgroups of containers the engine lists (the engine's cgroupfs driver
    names each by its container's ID): another runner's, whose pid this process cannot tell alive (a
    PID namespace of its own), are left to the sweep by label. ENGINE_ERRORS when the engine does not
    answer then."""
    if not is_run_cgroup(name):
        raise ValueError(f"not a run cgroup of the runner's: {name!r}")
    dirs = {d for hierarchy in _hierarchies() for d in _cgroup_tree(os.path.join(hierarchy, name))}
    if spare_known and dirs:
        known = {c["Id"] for c in docker_client().api.containers(all=True, quiet=True)}
        dirs = {d for d in dirs if os.path.basename(d) not in known}
    killed: set[int] = set()
    for _ in range(20):  # what forks meanwhile is killed by the next round
        pids = {pid for d in dirs for pid in cgroup_procs(d)}
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
            killed.add(pid)
        time.sleep(0.05)
    return len(killed)


def _cgroup_tree(path: str) -> list[str]:
    """The cgroup at ``path`` and every cgroup below it ([] when there is none)."""
    return [directory for directory, _, _ in os.walk(path)]


def _rmdir_cgroup(path: str, attempts: int = 1) -> bool:
    """rmdir ``path`` and the containers' cgroups left empty in it (an engine that kept them)."""
    for attempt in range(attempts):
        try:
            for entry in os.scandir(path):
                if entry.is_dir(follow_symlinks=False):
                    try:
                        os.rmdir(entry.path)
                    except OSError:
                        pass
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if attempt + 1 < attempts:
                time.sleep(0.05 * (attempt + 1))
    return False


def sweep_run_cgroups() -> int:
    """Remove the run cgroups of runners that are gone, killing what still runs in them but the
    containers the engine knows (see ``kill_cgroup_processes``)."""
    removed = 0
    for where in _hierarchies():
        try:
            entries = list(os.scandir(where))
        except OSError:
            continue
        for entry in entries:
            if _runner_gone(entry.name):
                try:
                    killed = kill_cgroup_processes(entry.name, spare_known=True)
                except ENGINE_ERRORS:
                    killed = 0
                removed += remove_run_cgroup(entry.name, wait_s=5.0 if killed else 0.0)
    return removed


def pid_namespace() -> int | None:
    """This process's PID namespace (its inode), or None when /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _runner_gone(name: str) -> bool:
    """Whether ``name`` is a run cgroup whose runner is gone. One made in another PID namespace (a
    runner in a container, sharing the machine's cgroups and engine) is not: its pid is no process of
    this one's, so a live runner's was taken for gone, and its cgroup, empty between two containers,
    removed with the run's limits (the engine made it again without them for the next container)."""
    match = _RUN_CGROUP_NAME.fullmatch(name)
    if match is None:
        return False
    if match[2] is not None and int(match[2]) != pid_namespace():
        return False
    return not pid_alive(int(match[1]))
