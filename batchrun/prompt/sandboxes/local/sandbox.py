"""Local backend: each prompt in its own bubblewrap sandbox, or (on purpose) plain host processes.

With ``bwrap`` a prompt sees the system directories read-only and nothing of the host's data: its
working directory (the row's ``cwd``, a path inside the sandbox), its ``/tmp`` and its ``/dev/shm`` are
its own size-capped tmpfs mounts (``/dev`` itself is read-only), homes and daemons' state are empty, and it has its own PID, network,
IPC and UTS namespaces, with no capabilities. A cgroup per prompt (or rlimits where the machine
offers no cgroups, see ``limits``) bounds its processes, memory and CPU; in a run, an emptied one is
kept for the worker's next prompt (``limits.CgroupPool``). With the network on,
``slirp4netns`` connects its network namespace to the outside world but not to the host's services:
as root one per worker, each prompt on a link of its own into it (``network_hub``), else one per prompt.

One command server runs per prompt (see ``CommandServer``): setting up the namespaces costs more
CPU than the command itself, so it is paid once per prompt, not per command. Each command still
gets a fresh ``bash -c``, and after each one every process it left behind is killed, so commands
behave as if each had its own sandbox, except for the files; only what the ``process`` tool started
in the background is spared (see ``command_server``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from batchrun.prompt.sandboxes._process import run_process
from batchrun.prompt.sandboxes.base import (
    ExecResult,
    Preflight,
    SandboxBackend,
    SandboxError,
    SandboxFlags,
    SandboxSpec,
    SetupError,
    end_processes_with_script,
    parse_options,
    safe_run_name,
)
from batchrun.prompt.sandboxes.local import launcher, limits
from batchrun.prompt.sandboxes.local.command_server import (
    SERVER_READY_TIMEOUT_S,
    SERVER_SHELL_NAMES,
    CommandServer,
    can_reach_non_dumpable,
    server_shells,
)
from batchrun.prompt.sandboxes.local.direct_files import DirectFiles
from batchrun.prompt.sandboxes.local.host import (
    bwrap_problem,
    command_shell,
    host_cwd_problem,
    is_within,
    local_isolation_available,
    network_problem,
    sandbox_cwd_problem,
    sandbox_workdir,
    system_sockets,
    tool_path,
    userns_refused,
)
from batchrun.prompt.sandboxes.local.limits import (
    PARENT_PREFIX,
    CgroupLayout,
    PromptCgroup,
    apply_rlimits,
    cgroup_layout,
    cgroup_pool,
    limits_mechanism,
    remove_run_cgroups,
    run_cgroup_names,
)
from batchrun.prompt.sandboxes.local.options import (
    CTL_DIR,
    PASSED_ENV,
    RUN_DIR_PREFIX,
    TAG_VAR,
    LocalOptions,
)
from batchrun.prompt.sandboxes.local.process_tree import kill_tagged, prefer_for_oom
from batchrun.prompt.sandboxes.local.seccomp import keyring_filter_fd
from batchrun.prompt.sandboxes.local.system_view import (
    HIDDEN_DIRS,
    NAMESPACES,
    run_etc_view,
    run_files_lock,
    runtime_dir,
    system_mounts,
    user_namespace_args,
)
from batchrun.protocol import PromptJob
from batchrun.storage import pid_alive

# A sandbox's directory made outside a run directory (see start), and the parent cgroup of such
# sandboxes (limits.PromptCgroup without a run's parent): both name the process that made them.
log = logging.getLogger(__name__)
_ORPHAN_DIR = re.compile(r"br@(\d+)-.+-[A-Za-z0-9_]{8}")  # "@": no run name has one (safe_run_name)
_ORPHAN_CGROUP = re.compile(re.escape(PARENT_PREFIX) + r"pid(\d+)")
_BWRAP_SETUP_RACE = re.compile(r"\A(bwrap|br-launch): Can't (create file at|bind mount|mkdir) ")
SLIRP_DNS = "10.0.2.3"  # slirp4netns's DNS forwarder, in its default 10.0.2.0/24


class LocalSandbox(SandboxBackend):
    """Commands run in ``bash -c``: inside the prompt's bubblewrap namespace when available."""

    # The start (mounts, a cgroup, the command server, slirp4netns) overlaps the first model call: at a
    # thousand prompts in flight, starting first put seconds of queueing before every first request.
    synchronous_start = False
    direct_files = True  # read_direct / write_direct: the file tools reach its tmpfs without a command
    starts_per_cpu = 4  # a start is mostly this machine's CPU (~15-25 ms): more at once only compete
    # cpus: a quota above the machine's cores never binds, and says a bound the run cannot keep; the
    # files (tmpfs) are charged to the prompt's memory cgroup with its processes: one limit for both.
    host_bounds = ("memory", "cpus", "disk_in_memory")
    synchronous_stop = True  # a few ms on the prompt's thread, without messages to the parent

    # -- run-level steps (see base.Sandbox)

    @classmethod
    def options_from(cls, flags: SandboxFlags) -> dict[str, Any]:
        options: dict[str, Any] = {
            "isolation": flags.local_isolation,
            "cpus": flags.cpus,
            "memory_mb": flags.memory_mb,
            "pids_limit": flags.pids_limit,
            "disk_mb": flags.disk_mb,
        }
        if flags.cwd_root is not None:
            options["cwd_root"] = flags.cwd_root
        return options

    @classmethod
    def preflight(
        cls,
        jobs: Sequence[PromptJob],
        options: dict[str, Any],
        *,
        real_model: bool,
        network: bool,
        dataset: str = "the dataset",
    ) -> Preflight:
        """Isolation, limits and network as they will really be; no silent run without isolation."""
        isolation = options.get("isolation", "auto")
        problem = bwrap_problem() if isolation != "none" else None
        if problem and (isolation == "bwrap" or real_model):
            if shutil.which("bwrap") is None:
                fix = "Install bubblewrap (Debian: apt-get install bubblewrap)"
            elif userns_refused():  # installed: "install bubblewrap" sent such a user nowhere
                fix = "Let this user make user namespaces (above), run as root"
            else:
                fix = "Make bubblewrap work here (its error above)"
            raise SetupError(
                f"the local sandbox cannot isolate commands: {problem}. {fix}, use --sandbox=docker, or pass "
                "--local_isolation=none to run the model's commands on this machine without isolation, on purpose"
            )
        with_image = sum(1 for j in jobs if j.image)
        if with_image:
            print(
                f"warning: {with_image} prompt(s) name a container image, which the local backend ignores; "
                "use --sandbox=docker to run them in their images"
            )
        if problem or isolation == "none":
            print(
                f"warning: the local sandbox has NO isolation ({problem or '--local_isolation=none'}): commands "
                "run on this machine as this user, in a private directory, or in a row's cwd under --cwd_root "
                f"({options.get('cwd_root')}); they can read this user's files and the runner's environment "
                "(/proc/<pid>/environ: the API key), and the model sees what they print"
            )
            bad = [
                (j, why) for j in jobs if j.cwd and (why := host_cwd_problem(j.cwd, options.get("cwd_root")))
            ]
            if bad:
                lines = "; ".join(f"{dataset}:{j.prompt_index + 1}: {why}" for j, why in bad[:5])
                more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
                raise SetupError(
                    f"{len(bad)} dataset row(s) name a cwd the local sandbox may not use: {lines}{more}"
                )
            # Commands on this machine, in its network namespace: --sandbox_network=False cannot hold them.
            return Preflight(isolation="none", facts={"sandbox_network": "host"})
        net, kind = "off", "off"
        if network:
            net, kind = "outside world through slirp4netns; not the host's own services", "slirp4netns"
            if network_problem():
                net, kind = "OFF", "off"
                print(
                    f"warning: --sandbox_network is on, but {network_problem()}: the local sandbox has NO network"
                )
        if launcher.launcher_path():
            made_by = "bubblewrap's line run by br-launch"
        elif launcher.problem:  # as root: why br-launch is not in use (no compiler, its check failed)
            made_by = f"bubblewrap (br-launch not used: {launcher.problem})"
        else:
            made_by = "bubblewrap"
        print(
            f"Local sandbox isolation: {made_by} (system directories read-only; each prompt sees only its own "
            f"working directory and /tmp; own PID, network and IPC namespaces); network: {net}"
        )
        if not can_reach_non_dumpable():
            why = "a setuid bubblewrap" if os.geteuid() else "root without CAP_SYS_PTRACE, no user namespace"
            print(
                f"warning: the local sandbox's command server is in its commands' reach ({why}): any "
                "command can take it over, and a failing verify then reports exit code 0 without running; "
                "do not train on this run's scores (give the runner CAP_SYS_PTRACE, or run it as another user)"
            )
        print(
            f"Per-prompt limits: {options.get('cpus')} CPU, {options.get('memory_mb')} MiB memory + "
            f"{options.get('disk_mb')} MiB per tmpfs (working directory, /tmp, /dev/shm), {options.get('pids_limit')} "
            f"processes; enforced by {limits_mechanism()}"
        )
        failed = {
            j.prompt_index: f"local sandbox: {why}"
            for j in jobs
            if j.cwd and (why := sandbox_cwd_problem(j.cwd))
        }
        if failed:
            # prompt_index is the row's 0-based line in the dataset: name the first lines, as bad lines are
            shown = sorted(failed.items())[:5]
            lines = "; ".join(f"{dataset}:{i + 1}: {why.removeprefix('local sandbox: ')}" for i, why in shown)
            more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
            print(
                f"warning: {len(failed)} prompt(s) name a cwd the sandbox cannot have; they fail without a "
                f"model call: {lines}{more}"  # each names its cwd with repr(): control characters escaped
            )
        return Preflight(
            isolation="bwrap",
            failed=failed,
            facts={"sandbox_network": kind, "sandbox_limits": limits_mechanism()},
        )

    @classmethod
    def prepare_run(cls, run_name: str, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """One directory (and one parent cgroup of the same name) holds this run's sandboxes, so none outlives it.

        The workers' sandboxes go under ``<runtime dir>/batch-runner-<run>-<pid>-<random>`` (see
        :func:`runtime_dir`: ``TMPDIR`` when set, else memory-backed); :meth:`sweep`
        removes it once the pool has ended (normally, on Ctrl-C or after a worker died mid-prompt).
        What a runner that was killed outright left is removed here, by the next run of the same
        name, once its pid is gone. (Workers on other machines, Ray's, keep their own temp dirs.)
        So is what a worker without a run directory left when it died mid-prompt (a Ray worker on
        this machine, whose runner was killed): its sandboxes' directories and its parent cgroup
        carry its pid (``_ORPHAN_DIR``, ``batch-runner-pid<N>``), and are removed once it is gone.
        """
        if not workers_here:
            return options
        cls.sweep_dead(run_name)
        prefix = f"{RUN_DIR_PREFIX}{safe_run_name(run_name)}-"
        base_dir = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=runtime_dir())
        # The run's parent cgroup is named after the directory, so a sweep finds both.
        return {**options, "base_dir": base_dir, "cgroup_parent": os.path.basename(base_dir)}

    @classmethod
    def sweep_dead(cls, run_name: str) -> None:
        """The sandbox directories and cgroups of runs of this name whose runner is gone, and those of
        workers without a run directory that are gone (see :meth:`prepare_run`)."""
        prefix = f"{RUN_DIR_PREFIX}{safe_run_name(run_name)}-"
        leftover = re.compile(re.escape(prefix) + r"(\d+)-[A-Za-z0-9_]{8}")
        removed = 0
        here = runtime_dir()
        # Also the system temp dir: where a run with another TMPDIR put them.
        for where in dict.fromkeys((here, tempfile.gettempdir())):
            for entry in os.scandir(where):
                m = leftover.fullmatch(entry.name)
                if m and entry.is_dir(follow_symlinks=False) and not pid_alive(int(m.group(1))):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    remove_run_cgroups(entry.name)
                    removed += 1
                orphan = _ORPHAN_DIR.fullmatch(entry.name)
                if orphan and entry.is_dir(follow_symlinks=False) and not pid_alive(int(orphan.group(1))):
                    shutil.rmtree(entry.path, ignore_errors=True)
        for name in run_cgroup_names():  # also those whose directory is gone (another TMPDIR, say)
            m = leftover.fullmatch(name) or _ORPHAN_CGROUP.fullmatch(name)
            if m and not pid_alive(int(m.group(1))):
                remove_run_cgroups(name)
        if removed:
            print(f"Removed {removed} sandbox director(ies) left by an earlier run named {run_name}")

    @classmethod
    def sweep(cls, options: dict[str, Any]) -> None:
        """After the pool ended: the run's cgroups and sandbox directory go, whatever its prompts left."""
        base_dir = options.get("base_dir")
        if not base_dir:
            return
        remove_run_cgroups(os.path.basename(base_dir))
        # The workers are gone, and their bubblewrap namespaces die with them (SIGKILL, from the
        # kernel); a process still dying may write a last file: try again a few times.
        for attempt in range(5):
            shutil.rmtree(base_dir, ignore_errors=True)
            if not os.path.exists(base_dir):
                break
            time.sleep(0.1 * (attempt + 1))

    @classmethod
    def prepare_process(cls) -> None:
        """The bubblewrap probe, with the scan of /etc it needs (~30 ms), and the network's tools."""
        if local_isolation_available():
            network_problem()
            launcher.launcher_path()  # built (once per machine) and checked here, not by every worker

    # -- one prompt's sandbox

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(LocalOptions, "local", options)
        wanted = self.options.isolation
        self.isolation = (
            "bwrap" if wanted == "bwrap" or (wanted == "auto" and local_isolation_available()) else "none"
        )
        self.workdir = ""
        self.network = "none"  # what the commands really get: "none", or "slirp4netns" (user-mode networking)
        self._root: str | None = None
        self._tag = uuid.uuid4().hex
        self._server: CommandServer | None = None
        self._cgroup: PromptCgroup | None = None
        self._hits = (0, 0)  # the cgroup's (pids.max hits, OOM kills) after the last command
        self._lock = threading.Lock()  # one command at a time per prompt
        self._own_shells = False  # the command server runs from execute-only shells (server_shells)

    def start(self) -> None:
        if self.isolation == "bwrap" and bwrap_problem():
            raise SandboxError(f"local sandbox: isolation 'bwrap' was requested but {bwrap_problem()}")
        cwd = self.spec.cwd or ""
        if self.isolation == "bwrap":
            problem = sandbox_cwd_problem(cwd)
        else:
            problem = host_cwd_problem(cwd, self.options.cwd_root)
        if problem:
            raise SandboxError(f"local sandbox: {problem}")
        # Without a run directory (a worker elsewhere, or no run at all) the name carries this process's
        # pid, so that what a killed worker left can be told from what a live one uses (prepare_run).
        lead = "br-" if self.options.base_dir else f"br@{os.getpid()}-"
        self._root = tempfile.mkdtemp(
            prefix=f"{lead}{safe_run_name(self.spec.run_name)}-{self.spec.prompt_index}-",
            dir=self.options.base_dir or runtime_dir(),
        )
        if self.isolation == "none":
            os.mkdir(os.path.join(self._root, "tmp"))
            self.workdir = os.path.abspath(os.path.join(self._root, "work", cwd))
            try:
                os.makedirs(self.workdir, exist_ok=True)
            except OSError as exc:
                raise SandboxError(f"local sandbox: cannot create cwd {cwd!r}: {exc}") from exc
            return
        # Inside bubblewrap the cwd is a path in the sandbox, its own size-capped tmpfs.
        self.workdir = sandbox_workdir(cwd)
        os.mkdir(os.path.join(self._root, "ctl"))
        open(os.path.join(self._root, "ctl", "empty"), "wb").close()
        self._own_shells = self._link_server_shells()
        layout = cgroup_layout()
        if isinstance(layout, CgroupLayout):
            name, limits = os.path.basename(self._root), self.options.limits
            try:
                if self.options.cgroup_parent:  # the run's own, which its sweep removes: kept ones too
                    self._cgroup = cgroup_pool.take(layout, self.options.cgroup_parent, name, limits)
                    if self._cgroup.uses > 1:  # a kept one: its counters so far are this prompt's zero
                        self._hits = self._cgroup.hits()
                else:
                    self._cgroup = PromptCgroup(layout, f"{PARENT_PREFIX}pid{os.getpid()}", name, limits)
            except OSError as exc:
                self.stop()
                raise SandboxError(f"local sandbox: cannot make the prompt's cgroup: {exc}") from exc
        try:
            self._server = self._start_server()
        except BaseException:
            self.stop()  # no cgroup or directory of a sandbox that never ran is left behind
            raise

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        if self._root is None:
            raise SandboxError("local sandbox is not started")
        if self.isolation == "none":
            return run_process(
                [command_shell(), "-c", command], stdin=stdin, timeout_s=timeout_s,
                output_cap_bytes=self.options.output_cap_bytes, cwd=self.workdir, env=self._env(),
            )  # fmt: skip
        with self._lock:
            if self._server is None or not self._server.alive():
                # The namespace ended (bwrap was killed from outside): the next command gets a new one.
                if self._server is not None:
                    self._server.close()
                self._server = self._start_server()
            result = self._server.run(command, timeout_s=timeout_s, stdin=stdin)
            notes = self._limit_notes()
        if notes:
            result = dataclasses.replace(
                result, output=(result.output + "\n" + "\n".join(notes)).lstrip("\n"), notes=tuple(notes)
            )
        return result

    def end_processes(self, timeout_s: float) -> str | None:
        """Before judging: end every process the agent left (its server, PID 1 of the prompt's own PID
        namespace, stays). Without isolation the agent's processes are the host's: nothing is ended."""
        if self.isolation == "none":
            return None
        return end_processes_with_script(self, timeout_s)

    # -- the file tools' direct path (see direct_files): the prompt's working directory and /tmp, from here

    def read_direct(self, path: str, max_bytes: int) -> bytes | None:
        with self._lock:
            files = self._direct_files()
            return files.read(path, max_bytes) if files is not None else None

    def write_direct(self, path: str, data: bytes, *, make_parents: bool) -> bool:
        with self._lock:
            files = self._direct_files()
            return files is not None and files.write(path, data, make_parents=make_parents)

    def _direct_files(self) -> DirectFiles | None:
        """The live server's view of the sandbox's own mounts; None without bubblewrap, or when the
        server has ended (its namespace, which the next command replaces, must not be written)."""
        server = self._server
        if server is None or not server.alive():
            return None
        return server.files

    def _limit_notes(self) -> list[str]:
        """What a limit did during the command, said plainly (the command's own errors can be cryptic).

        The counters are read once per command: the values after the previous command (zero in a new
        cgroup) are this one's starting point. Called under ``_lock``, so commands do not interleave."""
        notes = []
        opts = self.options
        if self._cgroup is not None:
            before = self._hits
            pids, oom = self._hits = self._cgroup.hits()
            # The run's prompts together have a limit too (limits.run_bounds), which a prompt may meet first.
            run = limits.run_bounds()
            if pids > before[0]:
                notes.append(
                    f"[batch-runner: the sandbox's process limit ({opts.pids_limit}, and {run.pids:,} for all "
                    "the run's prompts together) was reached; fork() failed for some processes]"
                )
            if oom > before[1]:
                notes.append(
                    f"[batch-runner: the sandbox's memory limit ({opts.memory_mb} MiB for processes + "
                    f"{opts.disk_mb} MiB for files, and {run.memory_bytes >> 20:,} MiB for all the run's prompts "
                    f"together) was reached; the kernel killed {oom - before[1]} process(es)]"
                )
        server = self._server
        for where in dict.fromkeys((self.workdir, "/tmp", "/dev/shm")):
            free = server.free_bytes(where) if server is not None else None
            if free == 0:
                notes.append(f"[batch-runner: {where} is full: its size cap is {opts.disk_mb} MiB]")
        return notes

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
        cgroup, self._cgroup = self._cgroup, None
        if cgroup is not None and self.options.cgroup_parent:
            cgroup_pool.give_back(cgroup)  # kept for the next prompt only once no process is in it
        elif cgroup is not None:
            cgroup.remove()
        root, self._root = self._root, None
        if root is None:
            return
        if self.isolation == "none":  # bwrap ends each command's processes with it; here some may linger
            kill_tagged(f"{TAG_VAR}={self._tag}".encode())
        shutil.rmtree(root, ignore_errors=True)

    def _env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.setdefault("PATH", os.defpath)
        if self.isolation == "bwrap":
            env["PATH"] = self._sandbox_path(env["PATH"])
        tmp = "/tmp" if self.isolation == "bwrap" else os.path.join(self._root or "", "tmp")
        env.update(HOME=self.workdir, TMPDIR=tmp)
        env.update(self.spec.env)
        env[TAG_VAR] = self._tag
        return env

    def _sandbox_path(self, path: str) -> str:
        """The runner's PATH without what the sandbox's commands may write in: a directory in its working
        directory or /tmp (a host's ``/workspace/.venv/bin`` under the default ``/workspace``), an
        empty or relative entry (the current directory). There the agent's ``python3`` or ``sh`` would
        stand in for the system's when the verify runs, whatever its hidden test says."""
        writable = (self.workdir, "/tmp", "/var/tmp")
        kept = [
            d
            for d in path.split(":")
            if d.startswith("/")
            and not any(is_within(posixpath.normpath("/" + d.lstrip("/")), w) for w in writable)
        ]
        return ":".join(kept) or os.defpath

    def _link_server_shells(self) -> bool:
        """The execute-only shells the command server runs from, in this prompt's control directory
        (``command_server.server_shells``: no command may read the server's memory); False where
        there are none, and the server runs from the system's shells."""
        assert self._root is not None
        shells = server_shells(os.path.dirname(self._root))
        if shells is None:
            return False
        try:
            for name in SERVER_SHELL_NAMES:
                os.link(os.path.join(shells, name), os.path.join(self._root, "ctl", name))
        except OSError as exc:
            log.warning(
                "the command server of prompt %s runs from readable shells: %s", self.spec.prompt_index, exc
            )
            return False
        return True

    def _start_server(self) -> CommandServer:
        assert self._root is not None
        for attempt in range(3):
            # No kernel keyrings (the runner's user's, see seccomp): the filter on a descriptor of its own.
            argv, seccomp = self._launch_argv(), keyring_filter_fd()
            argv[-1:-1] = ["--seccomp", str(seccomp)]  # with the options, before the command's "--"
            try:
                server = CommandServer(argv, ctl=os.path.join(self._root, "ctl"), env=self._env(),
                                        output_cap_bytes=self.options.output_cap_bytes,
                                        own_shells=self._own_shells, pass_fds=(seccomp,))  # fmt: skip
            finally:
                os.close(seccomp)
            problem = server.wait_ready(SERVER_READY_TIMEOUT_S)
            if problem is None and self._cgroup is None:
                try:
                    apply_rlimits(server.pid, self.options.limits)
                except OSError as exc:
                    server.close()
                    raise SandboxError(f"local sandbox: cannot set the prompt's rlimits: {exc}") from exc
            elif problem is None:
                # The server only waits for requests until now; every command is its child, so
                # everything the model runs starts in the cgroup, without a process of
                # its own to join it.
                try:
                    self._cgroup.enter(server.proc.pid, server.pid)
                except OSError as exc:
                    server.close()
                    raise SandboxError(
                        f"local sandbox: cannot put the prompt into its cgroup: {exc}"
                    ) from exc
            if problem is None:
                prefer_for_oom(server.pid)
                home = posixpath.join(self.workdir, self.spec.env.get("HOME", self.workdir))
                server.files = DirectFiles.open(
                    f"/proc/{server.pid}/root",
                    self.workdir,
                    home,
                    tuple(dict.fromkeys((self.workdir, "/tmp"))),
                )
                if self.spec.network and network_problem() is None:
                    try:
                        server.connect_network()
                    except SandboxError:
                        server.close()
                        raise
                    self.network = "slirp4netns"
                return server
            server.close()
            if not _BWRAP_SETUP_RACE.match(problem):
                break
            time.sleep(0.05 * (attempt + 1))
        raise SandboxError(f"local sandbox: bubblewrap could not start the prompt's shell: {problem}")

    def _resolv_conf(self) -> list[str]:
        """slirp4netns answers DNS at 10.0.2.3; the host's resolver (127.0.0.53, say) may be
        unreachable from the sandbox. Bound where /etc/resolv.conf leads (often into /run)."""
        assert self._root is not None
        target = os.path.realpath("/etc/resolv.conf")
        hidden = any(is_within(target, d) for d in HIDDEN_DIRS)
        if not (hidden or os.path.isfile(target)):
            return []  # no file to cover in the read-only /etc
        # The same for every sandbox: written once per worker in the run's directory (a file per
        # start was ~3% of a busy worker's CPU), or in the sandbox's own when there is no run.
        where = self.options.base_dir or self._root
        ours = os.path.join(where, f"resolv-{os.getpid()}.conf")
        with run_files_lock:
            if not os.path.exists(ours):
                with open(ours, "w", encoding="utf-8") as f:
                    f.write(f"nameserver {SLIRP_DNS}\n")
        return [*(["--dir", os.path.dirname(target)] if hidden else []), "--ro-bind", ours, target]

    def _launch_argv(self) -> list[str]:
        """bwrap, its namespaces and mounts, and where the command server starts."""
        assert self._root is not None
        disk = str(self.options.disk_mb << 20)
        etc_view = run_etc_view(self.options.base_dir) if self.options.base_dir else None
        launch = launcher.launcher_path()  # root: the same line run by br-launch, at about half the CPU
        if launch is not None:
            newroot = os.path.join(self._root, "newroot")  # the sandbox's root is built on it, inside
            os.makedirs(newroot, exist_ok=True)
            argv = [launch, "--newroot", newroot]
        else:
            argv = [tool_path("bwrap")]
        argv += [*NAMESPACES, *user_namespace_args(), *system_mounts(etc_view, self.options.disk_mb << 20)]
        for path in system_sockets():
            if not (etc_view and is_within(path, "/etc")):  # the view has no sockets
                argv += ["--ro-bind", "/dev/null", path]
        for d in HIDDEN_DIRS:
            argv += ["--dir", d]
        argv += ["--symlink", "../tmp", "/var/tmp", "--size", disk, "--tmpfs", "/tmp"]
        argv += ["--ro-bind", os.path.join(self._root, "ctl"), CTL_DIR]
        if self.spec.network and network_problem() is None:
            argv += self._resolv_conf()
        argv += ["--size", disk, "--tmpfs", self.workdir]
        # Last: nothing but the working directory, /tmp and /dev/shm stays writable (remounts are not
        # recursive).
        argv += ["--remount-ro", "/"]
        # The cgroup, or the rlimits without one, are put on the server before its first command
        # (_start_server).
        return [*argv, "--chdir", self.workdir, "--"]
