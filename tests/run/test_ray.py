"""The run on a Ray cluster (``--ray_address``): a head node started here (``ray start --head`` in a
subprocess, token authentication on, its own ports and temp dir), the real runner in-process or as the
CLI, the scripted fake model over HTTP, the local sandbox. A Ray run is compared with a local run of
the same dataset and seed; a worker is SIGKILLed mid-run before ``--resume``; the CLI's parent is
killed and its workers must end.

The tests that need no Ray (the missing-Ray message, the TCP inbox, the remote worker's watchdog) run
without it.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import Client, Listener
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import lines_written, read_jsonl, skip_or_fail, wait_for, write_jsonl
from helpers import run as run_main

import batch_runner
from batchrun.fakes.fake_model import FakeModelServer
from batchrun.protocol import Log, Ready, Received, WorkerExit
from batchrun.run.inbox import Inbox
from batchrun.sharegpt import first_human

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-ray-test-0123456789"
VARYING_METADATA = (
    "timestamp",
    "duration_s",
    "sandbox_start_wait_s",
    "sandbox_start_s",
    "sandbox_start_blocked_s",
    "sandbox_stop_s",
)
# the local sandbox's temporary directory (inside the run's batch-runner-* directory when not on Ray)
SANDBOX_DIR = re.compile(r"/tmp/(batch-runner-[\w.\-]+/)?br-[\w.\-]+")

# ----------------------------------------------------------------------------- helpers


def run(server: FakeModelServer, dataset: Path, out: Path, run_name: str = "run", **kw) -> None:
    run_main(server, dataset, out, run_name, **{"model": "fake", "api_key": API_KEY, "seed": 11, **kw})


def comparable(records: list[dict]) -> dict[int, dict]:
    """Records by prompt index, without what varies from run to run (times, temporary paths)."""
    out = {}
    for rec in records:
        rec = json.loads(json.dumps(rec))
        for key in VARYING_METADATA:
            rec["metadata"].pop(key, None)
        # The sandbox's path differs in length between the two (Ray workers keep their own temp dir),
        # and the fake model counts the characters it is sent: prompt tokens follow the path.
        rec["metadata"].pop("prompt_tokens", None)
        rec["metadata"].get("usage", {}).pop("prompt_tokens", None)
        out[rec["prompt_index"]] = json.loads(SANDBOX_DIR.sub("<sandbox>", json.dumps(rec, sort_keys=True)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def pool_actor_pids(root: int) -> list[int]:
    """The Ray Pool workers (``ray::PoolActor`` processes) descending from ``root`` (the head node)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parents[int(entry.name)] = _ppid(int(entry.name))
    found = []
    for pid in parents:
        p, depth = parents.get(pid), 0
        while p and p != root and depth < 10:
            p, depth = parents.get(p), depth + 1
        if p == root:
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::PoolActor"):
                    found.append(pid)
            except OSError:
                pass
    return sorted(found)


def outcomes_written(run_dir: Path) -> int:
    return sum(lines_written(p) for p in run_dir.glob("batch_*.jsonl"))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ray_env():
    """Token authentication with a token of this test module's own (never ~/.ray/auth_token).

    Set before ``ray`` is first imported: Ray reads them once, at import.
    """
    values = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    saved = {k: os.environ.get(k) for k in values}
    if "ray" in sys.modules:
        pytest.fail("ray was imported before the Ray tests set its authentication environment")
    os.environ.update(values)
    try:
        import ray  # noqa: F401
    except ImportError:
        skip_or_fail("the Ray tests need Ray: pip install 'batch-runner[ray]'")
    yield values
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ray_head(ray_env):
    """A Ray head node on this machine (2 CPUs, no dashboard), stopped by SIGTERM to the process we started."""
    yield from start_head("ray")


@pytest.fixture
def own_head(ray_env):
    """A Ray head of the test's own: one it kills, or one whose memory holds only what its run sent."""
    yield from start_head("own-ray")


def start_head(name: str, port: int | None = None):
    # Its own short directory under /tmp, as Ray's default is: its sockets' paths must fit AF_UNIX's 107
    # bytes, and one under pytest's numbered directories (/tmp/pytest-of-root/pytest-1076/restarted-ray0/
    # session_<date>_<time>_<pid>/sockets/plasma_store) outgrew them as the counter grew.
    temp_dir = Path(tempfile.mkdtemp(prefix=f"br-{name}-", dir="/tmp"))
    port = port or free_port()
    log_path = temp_dir / "head.log"
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--object-store-memory=200000000",  # modest, and fits a container's small /dev/shm
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp_dir}",
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ))
    started = wait_for(lambda: proc.poll() is not None or "will now block" in log_path.read_text(), 90, 0.2)
    if not started or proc.poll() is not None:
        proc.kill()
        printed = log_path.read_text()[-3000:]
        shutil.rmtree(temp_dir, ignore_errors=True)
        pytest.fail(f"ray start --head did not come up:\n{printed}")
    yield SimpleNamespace(address=f"127.0.0.1:{port}", proc=proc, log=log_path, temp_dir=temp_dir)
    import ray

    if ray.is_initialized():
        ray.shutdown()
    proc.send_signal(signal.SIGTERM)  # --block: the head drains and stops the processes it started
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    with FakeModelServer() as s:
        yield s


# ----------------------------------------------------------------------------- without Ray


def exit_code_with_ray_address(dataset: Path, out: Path, address: str) -> int:
    """The exit code of a run refused at start because of ``--ray_address`` (no endpoint is reached)."""
    return batch_runner.main(
        dataset_file=str(dataset),
        batch_size=1,
        run_name="r",
        model="fake",
        base_url="http://127.0.0.1:9/v1",
        api_key=API_KEY,
        output_dir=str(out),
        ray_address=address,
    )


def test_without_ray_the_flag_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    dataset = write_jsonl(tmp_path / "d.jsonl", ["hello"])
    assert exit_code_with_ray_address(dataset, tmp_path / "out", "auto") == 2
    assert "pip install 'batch-runner[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.parametrize("address", ["", "nowhere", "host:99999", "http://head:6379"])
def test_a_malformed_ray_address_is_refused_at_start(address, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["hello"])
    assert exit_code_with_ray_address(dataset, tmp_path / "out", address) == 2
    assert "--ray_address must be auto, local, ray://host:port or host:port" in capsys.readouterr().err


def cli_refusal(tmp_path: Path, address: str) -> tuple[int, str, float]:
    """``python batch_runner.py --ray_address=<address>`` (a process of its own: Ray is imported there, not
    here): its exit code, stderr and seconds; no endpoint is reached (nothing listens at its URL)."""
    if importlib.util.find_spec("ray") is None:
        skip_or_fail("needs Ray: pip install 'batch-runner[ray]'")
    dataset = write_jsonl(tmp_path / "d.jsonl", ["hello"])
    cmd = [
        sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=1",
        "--run_name=r", f"--output_dir={tmp_path / 'out'}", "--model=fake", "--base_url=http://127.0.0.1:9/v1",
        "--distribution=terminal_only", "--num_workers=1", f"--ray_address={address}",
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    t = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"--ray_address={address}: no exit in 60 s (ray.init retrying an address where no cluster is)"
        )
    return done.returncode, done.stderr, time.monotonic() - t


def test_a_ray_address_where_nothing_listens_exits_2_at_once(tmp_path):
    """A closed port kept ray.init retrying for 14 minutes (20 tries of ~41 s), printing Ray's warnings."""
    code, err, took = cli_refusal(tmp_path, f"127.0.0.1:{free_port()}")
    assert code == 2, err[-2000:]
    assert "--ray_address: no Ray cluster at " in err and "Connection refused" in err
    assert "6379 by default" in err  # says which port is the right one
    assert took < 30
    assert not list((tmp_path / "out" / "r").glob("batch_*.jsonl"))


def test_a_ray_address_of_another_server_is_refused_at_start(tmp_path):
    """A port of a server that is not Ray's (the dashboard's 8265 given for the head's 6379): ray.init
    waited forever for it to answer as a Ray cluster."""
    import http.server

    httpd = http.server.ThreadingHTTPServer(("", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        code, err, took = cli_refusal(tmp_path, f"127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert code == 2, err[-2000:]
    assert "answers, but not as a Ray cluster" in err and "the dashboard's (8265)" in err
    assert took < 30


def test_the_command_shown_to_the_ray_cluster_holds_no_key(monkeypatch):
    from batchrun.cli import shown_command
    from batchrun.secrets import Redactor

    argv = ["batch_runner.py", "--run_name=r", f"--api_key={API_KEY}", "--api_key", API_KEY]
    argv += [
        "--ephemeral_system_prompt",
        "be terse",
        "--base_url=http://u:pa55-w0rd-xyz@h/v1",
        "--num_workers=2",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    shown = shown_command(Redactor(API_KEY, secrets=["pa55-w0rd-xyz"]))
    assert API_KEY not in shown and "pa55-w0rd-xyz" not in shown and "be terse" not in shown
    assert (
        "--run_name=r" in shown
        and "--num_workers=2" in shown
        and "--ephemeral_system_prompt=<not shown>" in shown
    )


def test_tcp_inbox_tells_apart_workers_with_the_same_pid_on_two_machines():
    inbox = Inbox(host="127.0.0.1")
    (host, port), authkey = inbox.address
    assert host == "127.0.0.1" and port > 0
    a = Client((host, port), authkey=authkey)
    b = Client((host, port), authkey=authkey)
    try:
        a.send(4242)  # a worker introduces itself by its pid
        b.send(4242)
        a.send(Ready(0))
        b.send(Ready(1))
        claims = [inbox.events.get(timeout=5) for _ in range(2)]
        ids = {ev.message.slots: ev.pid for ev in claims}
        assert ids[0] != ids[1] and 4242 in ids.values()
        a.send(Log(0, "terminal", "{}", "ok"))
        assert inbox.events.get(timeout=5).pid == ids[0]  # the same id for every message of a worker
        a.close()
        assert inbox.events.get(timeout=5) == WorkerExit(ids[0])
    finally:
        b.close()
        inbox.close()


def test_tcp_inbox_refuses_a_wrong_authkey_and_still_accepts_workers():
    inbox = Inbox(host="127.0.0.1")
    address, authkey = inbox.address
    try:
        with pytest.raises(Exception):  # noqa: B017 - AuthenticationError or a closed connection
            Client(address, authkey=b"not the key").send(1)
        with socket.create_connection(address):
            pass  # a port scanner: connects and hangs up
        good = Client(address, authkey=authkey)
        good.send(2)
        good.send(Ready(0))
        assert inbox.events.get(timeout=5) == Received(2, Ready(0))
        good.close()
    finally:
        inbox.close()


WORKER_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from batchrun.prompt.llm import LLMConfig
from batchrun.prompt.loop import LoopLimits
from batchrun.prompt.attempt import WorkerSettings
from batchrun.run import worker

settings = WorkerSettings(run_name="t", llm=LLMConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key="k"),
                       limits=LoopLimits(max_turns=1))
# A TCP inbox, and the pid of a runner on "another machine" (no such process here).
worker.init_worker(settings, ({address!r}, {authkey!r}), 1, 1, 4194000)
print("ready", flush=True)
time.sleep(120)
"""


def test_remote_worker_outlives_a_foreign_parent_pid_and_ends_when_its_connection_closes(tmp_path):
    authkey = os.urandom(16)
    listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=authkey)
    script = WORKER_SCRIPT.format(repo=str(REPO), address=listener.address, authkey=authkey)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        accepted: list = []
        t = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        t.start()
        t.join(30)
        assert accepted, "the worker did not connect"
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # the local pid watchdog would have ended it by now
        assert proc.poll() is None
        accepted[0].close()  # the runner is gone
        assert proc.wait(timeout=10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()


# ----------------------------------------------------------------------------- on a Ray cluster


@pytest.mark.ray
@pytest.mark.slow
def test_ray_run_equals_local_run(ray_head, server, tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_bytes((REPO / "data" / "prompts.jsonl").read_bytes())
    # The same run name: it is part of the sandbox paths the model sees, and so of the token counts.
    run(server, dataset, tmp_path / "local")
    t = time.monotonic()
    run(server, dataset, tmp_path / "ray", ray_address=ray_head.address)
    ray_s = time.monotonic() - t
    printed = capsys.readouterr().out
    assert "cluster (127.0.0.1:" in printed and "reporting to this process over TCP" in printed

    local = read_jsonl(tmp_path / "local" / "run" / "trajectories.jsonl")
    on_ray = read_jsonl(tmp_path / "ray" / "run" / "trajectories.jsonl")
    prompts = [json.loads(line)["prompt"] for line in dataset.read_text().splitlines()]
    lost = [
        {k: v for k, v in rec.items() if k in ("prompt_index", "error_class", "error", "reason")}
        for name in ("failed.jsonl", "discarded.jsonl")
        for rec in read_jsonl(tmp_path / "ray" / "run" / name)
    ]
    assert sorted(first_human(r["conversations"]) for r in on_ray) == sorted(prompts), lost
    assert {r["prompt_index"]: r["toolsets_used"] for r in on_ray} == {
        r["prompt_index"]: r["toolsets_used"] for r in local
    }
    assert comparable(on_ray) == comparable(local)
    assert not (tmp_path / "ray" / "run" / "failed.jsonl").exists()
    stats = [json.loads((tmp_path / d / "run" / "statistics.json").read_text()) for d in ("local", "ray")]
    for key in ("trajectories", "completed", "tool_stats", "reasoning", "api_calls_in_trajectories"):
        assert stats[0][key] == stats[1][key], key
    import ray

    assert not ray.is_initialized()  # the runner left the cluster it joined
    print(f"Ray run: {ray_s:.1f} s")


@pytest.mark.ray
@pytest.mark.slow
def test_local_ray_started_by_the_runner(ray_env, server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"Local Ray prompt {i}" for i in range(3)])
    run(server, dataset, tmp_path / "out", ray_address="local", batch_size=2)
    assert "Ray " in capsys.readouterr().out
    assert len(read_jsonl(tmp_path / "out" / "run" / "trajectories.jsonl")) == 3
    import ray

    assert not ray.is_initialized()  # and stopped it


@pytest.mark.ray
@pytest.mark.slow
def test_killed_ray_worker_fails_its_prompts_and_resume_completes_without_duplicates(
    ray_head, server, tmp_path
):
    prompts = [f"Slow job number {i}: write the notes [slow:0.7]" for i in range(12)]
    dataset = write_jsonl(tmp_path / "slow.jsonl", prompts)
    out = tmp_path / "out"
    run_dir = out / "run"
    killed: list[int] = []

    def kill_one_worker_mid_run() -> None:
        actors = wait_for(
            lambda: (
                (a := pool_actor_pids(ray_head.proc.pid)) and len(a) >= 2 and outcomes_written(run_dir) and a
            ),
            90,
            0.1,
        )
        if actors:
            os.kill(actors[0], signal.SIGKILL)
            killed.append(actors[0])

    killer = threading.Thread(target=kill_one_worker_mid_run, daemon=True)
    killer.start()
    opts = dict(ray_address=ray_head.address, batch_size=2, prompts_per_worker=2)
    run(server, dataset, out, **opts)
    killer.join(5)
    assert killed, "no Ray worker was found to kill"

    failed = read_jsonl(run_dir / "failed.jsonl")
    assert failed and {f["error_class"] for f in failed} == {"worker_died"}
    done = [first_human(r["conversations"]) for r in read_jsonl(run_dir / "trajectories.jsonl")]
    assert len(done) < len(prompts)
    assert sorted(done + [f["prompt"] for f in failed]) == sorted(prompts)  # every prompt: one outcome

    run(server, dataset, out, resume=True, **opts)
    merged = [first_human(r["conversations"]) for r in read_jsonl(run_dir / "trajectories.jsonl")]
    assert sorted(merged) == sorted(prompts)
    in_batches = collections.Counter(
        first_human(r["conversations"]) for p in run_dir.glob("batch_*.jsonl") for r in read_jsonl(p)
    )
    assert set(in_batches.values()) == {1}, "a prompt was written twice"
    assert len(in_batches) == len(prompts)


@pytest.mark.ray
@pytest.mark.slow
def test_cli_with_auto_address_and_its_workers_end_when_it_is_killed(ray_head, ray_env, server, tmp_path):
    """``python batch_runner.py`` (functions of ``__main__`` reach the workers by module name), address from
    RAY_ADDRESS; SIGKILL the runner mid-run and every worker it started must end."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"CLI job {i} [slow:1]" for i in range(12)])
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "batch_runner.py"),
        f"--dataset_file={dataset}",
        "--batch_size=2",
        "--run_name=cli",
        f"--output_dir={out}",
        "--model=fake",
        f"--base_url={server.base_url}",
        f"--api_key={API_KEY}",
        "--distribution=terminal_only",
        "--num_workers=2",
        "--prompts_per_worker=2",
        "--ray_address=auto",
    ]
    env = {**os.environ, **ray_env, "RAY_ADDRESS": ray_head.address}
    log = tmp_path / "cli.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        actors = wait_for(
            lambda: (
                (a := pool_actor_pids(ray_head.proc.pid))
                and len(a) >= 2
                and outcomes_written(out / "cli")
                and a
            ),
            90,
            0.1,
        )
        assert actors, f"the CLI run did not get going:\n{log.read_text()[-3000:]}"
        assert proc.poll() is None
        proc.kill()
        proc.wait(10)
        gone = wait_for(lambda: not set(actors) & set(pool_actor_pids(ray_head.proc.pid)), 30, 0.25)
        assert gone, f"Ray workers {actors} outlived the runner"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.docker
def test_containers_left_on_the_nodes_are_removed(ray_head, docker_test_image):
    """After the actors are killed, the run's containers on every node are removed (docker backend)."""
    import ray

    from batchrun.prompt.sandboxes.docker.engine import LABEL_OWNER, docker_client
    from batchrun.run.ray_pool import RayPool

    owner = f"{uuid.uuid4().hex[:8]}@another-host"
    client = docker_client()
    client.containers.create(docker_test_image, command=["true"], labels={LABEL_OWNER: owner})
    ray.init(address=ray_head.address, logging_level="WARNING")
    try:
        pool = SimpleNamespace(
            _settings=SimpleNamespace(sandbox_backend="docker", sandbox_options={"run_owner": owner}),
            _ray=ray,
        )
        RayPool._sweep_nodes(pool)  # the backend's own sweep, run on every node
    finally:
        ray.shutdown()
        left = client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={owner}"})
        for c in left:
            c.remove(force=True)
    assert not left


def raylet_pid(root: int) -> int | None:
    """The raylet of the head node ``root`` (one of its children)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _ppid(int(entry.name)) == root:
            try:
                if b"raylet/raylet" in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                pass
    return None


def cli_on_head(tmp_path, server, ray_env, address, run_name, prompts, *flags, env=None):
    """The runner's command line on the cluster at ``address`` (2 workers, the fake model, terminal_only,
    ``flags``) for a dataset of ``prompts``: (command, environment, its log's path, the output directory)."""
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=2",
        f"--run_name={run_name}", f"--output_dir={out}", "--model=fake", f"--base_url={server.base_url}",
        "--distribution=terminal_only", "--num_workers=2", *flags, f"--ray_address={address}",
    ]  # fmt: skip
    return cmd, {**os.environ, **ray_env, "OPENAI_API_KEY": API_KEY, **(env or {})}, tmp_path / "cli.log", out


@pytest.mark.ray
@pytest.mark.slow
def test_the_cluster_dying_mid_run_ends_the_run_with_its_outcomes_and_the_resume_command(
    own_head, ray_env, server, tmp_path
):
    """The head's raylet is killed mid-run (``ray start --block`` then stops the GCS too): the cluster is gone.
    Ray used to end the runner itself 60 s later (exit 1, from a thread of its own) while it waited on the
    sweep's ray.nodes(): no trajectories.jsonl, no statistics, status.json saying "running", no resume
    command. Now the run ends as one whose workers died: every prompt is a trajectory or a failure, once."""
    prompts = [f"Doomed job {i} [slow:1]" for i in range(10)]
    cmd, env, log, out = cli_on_head(
        tmp_path,
        server,
        ray_env,
        own_head.address,
        "doomed",
        prompts,
        "--prompts_per_worker=2",
        "--max_failure_rate=1",
    )
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_for(lambda: outcomes_written(out / "doomed"), 90, 0.1), log.read_text()[-3000:]
        raylet = raylet_pid(own_head.proc.pid)
        assert raylet, "the head has no raylet"
        os.kill(raylet, signal.SIGKILL)
        code = proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    printed = log.read_text()
    run_dir = out / "doomed"
    # --max_failure_rate=1 let the failures pass as the run's outcomes: exit 0, as for a finished run (a dead
    # cluster late in a run of 16 prompts, 4 of them lost, exited 0 even under the default 0.5). A run whose
    # workers are all gone did not finish: exit 7, and the resume command.
    assert code == 7, printed[-3000:]
    assert "The run stopped: the Ray cluster's workers are gone" in printed
    assert "Failed to connect to GCS" not in printed
    assert "continue with:" in printed and "--resume" in printed
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    stats = json.loads((run_dir / "statistics.json").read_text())
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert failed and {f["error_class"] for f in failed} <= {"worker_died", "pool_broken"}
    done = [first_human(r["conversations"]) for r in read_jsonl(run_dir / "trajectories.jsonl")]
    assert sorted(done + [f["prompt"] for f in failed]) == sorted(prompts)  # each prompt once
    assert stats["this_run"]["attempted"] == len(prompts)
    assert sum(stats["this_run"]["failed"].values()) == len(failed)


def memory_holds(pid: int, needle: bytes) -> int:
    """How many times ``needle`` is in the readable memory of process ``pid``."""
    hits = 0
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                start, end = (int(x, 16) for x in span.split("-"))
                if "r" not in perms or end - start > 1 << 31:
                    continue
                try:
                    mem.seek(start)
                    hits += mem.read(end - start).count(needle)
                except OSError:
                    continue
    except PermissionError:
        skip_or_fail("reading a Ray process's memory needs ptrace rights over it")
    return hits


def head_child(root: int, binary: bytes) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _ppid(int(entry.name)) == root:
            with contextlib.suppress(OSError):
                if binary in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    return int(entry.name)
    pytest.fail(f"the head has no {binary.decode()}")


def stop_head_child(head: SimpleNamespace, pid: int) -> None:
    """SIGSTOP one of the head's processes; a process gone already (seen once, in a CI at load 10, cause
    unknown) fails the test with the head's own logs, which the fixture's teardown removes."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        logs = [head.log, *sorted(head.temp_dir.glob("session_latest/logs/*.out"))]
        tails = "\n".join(f"--- {p}:\n{p.read_text(errors='replace')[-1500:]}" for p in logs if p.is_file())
        pytest.fail(f"the head's process {pid} is gone before the test could signal it:\n{tails}")


@pytest.mark.ray
@pytest.mark.slow
def test_keys_stay_out_of_the_ray_cluster_state(own_head, ray_env, server, tmp_path):
    """The worker settings (the API key, the tools' keys) were the Ray actors' arguments: the GCS kept them
    (29 copies of the key, 12 of a TAVILY_API_KEY; in Redis too where the GCS is persisted), and the job's
    entrypoint, shown by ``ray list jobs`` and the dashboard, was the command line, --api_key=... included.
    Now the settings reach each worker over its inbox connection and the entrypoint is the redacted command."""
    tool_key = "tvly-ray-test-tool-key-0123456789"
    ephemeral = "EPHEMERAL-ray-test-do-not-keep-4321"
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"Secret-keeping job {i}" for i in range(3)])
    cmd = [
        sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=2",
        "--run_name=keys", f"--output_dir={tmp_path / 'out'}", "--model=fake", f"--base_url={server.base_url}",
        "--distribution=terminal_only", "--num_workers=1", f"--ray_address={own_head.address}",
        f"--ephemeral_system_prompt={ephemeral}",
    ]  # fmt: skip
    # The key in the environment: Ray's node reporter sends every process's command line to the GCS.
    env = {**os.environ, **ray_env, "OPENAI_API_KEY": API_KEY, "TAVILY_API_KEY": tool_key}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(read_jsonl(tmp_path / "out" / "keys" / "trajectories.jsonl")) == 3
    gcs = head_child(own_head.proc.pid, b"gcs_server")
    raylet = head_child(own_head.proc.pid, b"raylet/raylet")
    for pid in (gcs, raylet):
        assert memory_holds(pid, API_KEY.encode()) == 0
        assert memory_holds(pid, tool_key.encode()) == 0

    import ray
    from ray._private.worker import global_worker

    ray.init(address=own_head.address, logging_level="WARNING")
    try:
        entrypoints = [job.entrypoint for job in global_worker.gcs_client.get_all_job_info().values()]
    finally:
        ray.shutdown()
    ours = [e for e in entrypoints if "--run_name=keys" in e]
    assert ours, entrypoints
    assert ephemeral not in ours[0] and "--ephemeral_system_prompt=<not shown>" in ours[0]


@pytest.mark.ray
@pytest.mark.slow
def test_a_gcs_that_hangs_does_not_hang_the_run(own_head, ray_env, server, tmp_path):
    """The head's GCS is SIGSTOPped mid-run: it still takes connections but never answers. The workers go on
    (they report over TCP), but the runner then waited forever in the sweep's ray.nodes() (200 s and counting,
    all 16 outcomes written, no trajectories.jsonl, status.json "running"); and Ray's shutdown, at the end or at
    the interpreter's exit, hangs on it too. Now each call to the cluster at the end is bounded: the run says
    why the nodes were not swept, merges, and exits."""
    prompts = [f"Frozen-GCS job {i} [slow:1]" for i in range(8)]
    cmd, env, log, out = cli_on_head(
        tmp_path, server, ray_env, own_head.address, "frozen", prompts, "--prompts_per_worker=2"
    )
    gcs = head_child(own_head.proc.pid, b"gcs_server")
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_for(lambda: outcomes_written(out / "frozen"), 90, 0.1), log.read_text()[-3000:]
        stop_head_child(own_head, gcs)
        stopped = time.monotonic()
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run hangs on a GCS that does not answer:\n{log.read_text()[-3000:]}")
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # gone: stop_head_child said why
            os.kill(gcs, signal.SIGCONT)  # the fixture's own stop needs it
    printed = log.read_text()
    run_dir = out / "frozen"
    assert code == 0, printed[-3000:]  # every prompt ran: the workers never needed the GCS
    assert "its GCS gave no answer" in printed
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    done = [first_human(r["conversations"]) for r in read_jsonl(run_dir / "trajectories.jsonl")]
    assert sorted(done) == sorted(prompts)
    assert not pool_actor_pids(own_head.proc.pid)  # they ended when their inbox connections closed
    print(f"ended {took:.1f} s after the GCS stopped")


@pytest.mark.ray
@pytest.mark.slow
def test_a_gcs_that_hangs_while_the_workers_start_stops_the_run_and_resume_finishes_it(
    own_head, ray_env, server, tmp_path
):
    """The GCS is SIGSTOPped as the runner joins the cluster: Ray's Pool waited for its actors forever (150 s
    and counting, in Pool._start_actor_pool's ray.get), or the join's ray.cluster_resources() did. Now the start has a limit: the run says the cluster
    does not answer and exits 2 (or, the GCS stopped a moment earlier, the join's own calls to it have one);
    once the GCS is back, --resume runs every prompt once."""
    prompts = [f"Early-frozen job {i}" for i in range(4)]
    cmd, env, log, out = cli_on_head(
        tmp_path,
        server,
        ray_env,
        own_head.address,
        "early",
        prompts,
        env={"BATCH_RUNNER_RAY_START_TIMEOUT_S": "10"},
    )
    gcs = head_child(own_head.proc.pid, b"gcs_server")
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_for(lambda: "cluster (" in log.read_text() or proc.poll() is not None, 90, 0.01)
        stop_head_child(own_head, gcs)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the workers' start waits forever on a GCS that hangs:\n{log.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # gone: stop_head_child said why
            os.kill(gcs, signal.SIGCONT)
    printed = log.read_text()
    assert code == 2, printed[-3000:]
    # Where the GCS stopped decides which step says so: joining the cluster, or the workers' start.
    assert "does not answer (its GCS gave no answer" in printed

    done = subprocess.run(
        [*cmd, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = out / "early"
    in_batches = [
        first_human(r["conversations"]) for p in run_dir.glob("batch_*.jsonl") for r in read_jsonl(p)
    ]
    assert sorted(in_batches) == sorted(prompts)  # each once
    merged = [first_human(r["conversations"]) for r in read_jsonl(run_dir / "trajectories.jsonl")]
    assert sorted(merged) == sorted(prompts)


def process_tree(root: int) -> list[int]:
    """``root`` and every process descending from it."""
    parents = {int(e.name): _ppid(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


@pytest.mark.ray
@pytest.mark.slow
def test_a_head_restarted_at_the_same_address_mid_run(own_head, ray_env, server, tmp_path):
    """The whole head is SIGKILLed mid-run and a new one started on its port: the runner's sweep asked the new
    GCS for its nodes, and Ray aborted the process on a C++ check ("WrongClusterID"): exit 1, a stack dump,
    no merge of that invocation, no resume command. Now a run whose workers all died makes no call to the
    cluster any more: exit 7 with the resume command, and --resume on the new head runs the rest once."""
    prompts = [f"Restarted-head job {i} [slow:1]" for i in range(12)]
    cmd, env, log, out = cli_on_head(
        tmp_path, server, ray_env, own_head.address, "restarted", prompts, "--prompts_per_worker=2"
    )
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, env=env)
    new_head = None
    try:
        assert wait_for(lambda: outcomes_written(out / "restarted"), 90, 0.1), log.read_text()[-3000:]
        for pid in process_tree(own_head.proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        own_head.proc.wait(10)
        port = int(own_head.address.rsplit(":", 1)[1])
        new_head = start_head("restarted-ray", port)
        head = next(new_head)
        code = proc.wait(timeout=150)
        printed = log.read_text()
        assert code == 7, printed[-3000:]
        assert "WrongClusterID" not in printed
        assert "continue with:" in printed
        run_dir = out / "restarted"
        assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"

        done = subprocess.run(
            [*cmd[:-1], f"--ray_address={head.address}", "--resume"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        kept = [first_human(r["conversations"]) for p in run_dir.glob("batch_*.jsonl") for r in read_jsonl(p)]
        assert sorted(kept) == sorted(prompts)  # each once
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if new_head is not None:
            with contextlib.suppress(StopIteration):
                next(new_head)
