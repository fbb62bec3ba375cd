"""MCP servers as toolsets, end to end: a real server written with the SDK (tests/mcp_servers/), over
stdio and streamable HTTP, called by the scripted model through the whole runner."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    TESTS_DIR,
    by_prompt,
    exit_code,
    offered_in_system,
    read_jsonl,
    requests,
    run,
    tool_blocks,
    write_jsonl,
)

from batchrun.distributions import use_file_distributions
from batchrun.prompt.tools import mcp

pytest.importorskip("mcp")

SERVER = TESTS_DIR / "mcp_servers" / "tools_server.py"
TOKEN = "tok-mcp-secret-5531"  # the server prints it on its stderr at start: it must reach no file
TOOLS = [f"mcp__tools__{n}" for n in ("echo", "add", "count", "fail", "nap", "crash")]


@pytest.fixture(autouse=True)
def _forget_run_tools():
    """The in-process runs install MCP tools and file distributions in this process: forget them after."""
    yield
    mcp.install(None)
    use_file_distributions({})


def stdio_config(tmp_path: Path, **extra) -> Path:
    entry = {"command": sys.executable, "args": [str(SERVER), "stdio", "--pid-file", str(tmp_path / "pids")]}
    entry["env"] = {"TOOLS_TOKEN": TOKEN}
    entry.update(extra)
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"mcpServers": {"tools": entry}}), "utf-8")
    return path


def mcp_only(tmp_path: Path) -> Path:
    path = tmp_path / "dists.json"
    path.write_text(json.dumps({"mcp_only": {"probabilities": {"mcp:tools": 100}}}), "utf-8")
    return path


def run_stdio(server, tmp_path: Path, ds: Path, out: Path, **kw) -> None:
    """A run of one worker whose prompts are offered the stdio test server's tools alone."""
    args = dict(distribution_file=str(mcp_only(tmp_path)), distribution="mcp_only", num_workers=1)
    run(server, ds, out, mcp_config=str(stdio_config(tmp_path)), **{**args, **kw})


def files_of(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not a running server
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_stdio_server_tools_reach_the_model_and_the_records(server, tmp_path):
    ds = write_jsonl(tmp_path / "ds.jsonl", ["say hello there", "count them [calls:3]"])
    out = tmp_path / "out"
    run_stdio(server, tmp_path, ds, out)
    records = by_prompt(read_jsonl(out / "run" / "trajectories.jsonl"))
    hello = records["say hello there"][0]
    # The server's own schema reached the model under the namespaced name.
    system = hello["conversations"][0]["value"]
    offered = {t.get("function", t)["name"]: t.get("function", t) for t in offered_in_system(system)}
    assert list(offered) == TOOLS
    assert offered["mcp__tools__add"]["parameters"]["required"] == ["a", "b"]
    assert offered["mcp__tools__echo"]["description"] == "Say the text back."
    # The result came from the server process and the model quoted it in its answer.
    assert "echo from pid" in hello["conversations"][-1]["value"]
    assert "say hello there" in hello["conversations"][-1]["value"]
    assert hello["toolsets_used"] == ["mcp:tools"]
    assert hello["tool_stats"]["mcp__tools__echo"] == {"count": 1, "success": 1, "failure": 0}
    counted = records["count them [calls:3]"][0]
    assert counted["tool_stats"]["mcp__tools__add"] == {"count": 1, "success": 1, "failure": 0}
    assert counted["tool_stats"]["mcp__tools__count"] == {"count": 1, "success": 1, "failure": 0}
    # Every record lists every known tool: the built-ins and the server's.
    assert set(TOOLS) <= set(hello["tool_stats"]) and "terminal" in hello["tool_stats"]
    assert set(hello["tool_stats"]) == set(counted["tool_stats"])
    manifest = json.loads((out / "run" / "run_manifest.json").read_text("utf-8"))
    assert set(TOOLS) <= set(manifest["known_tools"])
    assert manifest["distribution_probabilities"] == {"mcp:tools": 100}
    assert len(manifest["mcp_config_sha256"]) == 64
    for path in files_of(out):
        assert TOKEN.encode() not in path.read_bytes(), path
    # One worker: the probe's server and the worker's, both stopped with the run.
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids)


def stubborn_config(tmp_path: Path, **env: str) -> Path:
    """The test server ignoring SIGTERM and its stdin's end, with a child in its group and one in a
    session of its own; each writes its pid to ``tmp_path / "pids"``."""
    args = [str(SERVER), "stdio", "--stubborn", "--escaping-child", "--pid-file", str(tmp_path / "pids")]
    entry = {"command": sys.executable, "args": args, "env": env}
    config = tmp_path / "servers.json"
    config.write_text(json.dumps({"mcpServers": {"tools": entry}}), "utf-8")
    return config


def test_a_stdio_server_that_ignores_sigterm_and_eof_ends_with_the_run(server, tmp_path):
    """It is killed, and all it started (its own session's child too), when its worker ends."""
    ds = write_jsonl(tmp_path / "ds.jsonl", ["say hello there"])
    out = tmp_path / "out"
    config = stubborn_config(tmp_path)
    run(
        server,
        ds,
        out,
        mcp_config=str(config),
        distribution_file=str(mcp_only(tmp_path)),
        distribution="mcp_only",
        num_workers=1,
    )
    (rec,) = read_jsonl(out / "run" / "trajectories.jsonl")
    assert rec["tool_stats"]["mcp__tools__echo"]["success"] == 1
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 6  # the probe's server and the worker's, each with its two children
    deadline = time.monotonic() + 20
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)]


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["runner", "worker"])
def test_a_killed_runner_or_worker_leaves_no_stdio_server_behind(tmp_path, victim):
    """SIGKILLed mid-run, so that nothing of its own ends the servers: a server that ignores SIGTERM and
    the end of its stdin, and its children, end with the process that started it all the same."""
    marker = f"br-mcp-orphans-{os.getpid()}-{victim}-{time.monotonic_ns()}"
    config = stubborn_config(tmp_path, BR_MCP_MARK=marker)  # the config's env reaches the server
    ds = write_jsonl(tmp_path / "ds.jsonl", ["[loop] call the server until killed"])
    err = (tmp_path / "err").open("w")
    runner = subprocess.Popen(
        [sys.executable, str(TESTS_DIR.parent / "batch_runner.py"), "--model=mock", "--batch_size=4",
         "--run_name=run", f"--dataset_file={ds}", f"--output_dir={tmp_path / 'out'}",
         f"--mcp_config={config}", f"--distribution_file={mcp_only(tmp_path)}", "--distribution=mcp_only", "--num_workers=1"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR.parent)},
    )  # fmt: skip
    try:
        pid_file = tmp_path / "pids"
        deadline = time.monotonic() + 120
        while len(pid_file.read_text().split() if pid_file.exists() else []) < 6:  # the worker's server is up
            assert runner.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.1)
        # The worker: the first of the worker's server's ancestors without the config's env.
        worker = int(pid_file.read_text().split()[3])
        while worker in marked_processes(marker):
            worker = parent_of(worker)
        assert worker not in (1, runner.pid)
        os.kill(worker if victim == "worker" else runner.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while (left := marked_processes(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for pid in marked_processes(marker):  # leave the machine clean, whatever the assertion says
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        runner.kill()
        runner.wait()
        err.close()
    assert left == {}


def marked_processes(marker: str) -> dict[int, str]:
    """The running processes whose environment holds ``marker``: their command lines, by pid."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes() and pid_alive(int(pid)):
                found[int(pid)] = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                )
        except OSError:
            continue
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_worker_session_server_lives_on_after_the_thread_that_started_it(tmp_path):
    """The server's launcher ends it when the thread that spawned it ends (a parent-death signal
    follows the thread): the SDK spawns on this process's event-loop thread, never a prompt's."""
    conn = mcp.Connection(
        mcp.McpServer(
            name="tools",
            command=sys.executable,
            args=(str(SERVER), "stdio", "--pid-file", str(tmp_path / "pids")),
        )
    )
    starter = threading.Thread(target=conn.start)
    starter.start()
    starter.join()
    first = conn.call("echo", {"text": "one"}, 30, 10_000)
    time.sleep(1)  # a signal sent at the thread's end would have ended the server by now
    later = [conn.call("count", {}, 30, 10_000)["content"] for _ in range(20)]
    (pid,) = (tmp_path / "pids").read_text().split()
    assert first["content"] == f"echo from pid {pid}: one"
    assert later == [f"call {n} in pid {pid}" for n in range(1, 21)]
    conn.close()
    deadline = time.monotonic() + 15
    while pid_alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(int(pid))


def test_a_worker_session_server_serves_all_the_workers_prompts(server, tmp_path):
    """Through its launcher, one server process per worker answers prompt after prompt (its calls
    counted across them), from prompt threads that come and go."""
    ds = write_jsonl(tmp_path / "ds.jsonl", [f"count them [calls:3] {i}" for i in range(12)])
    out = tmp_path / "out"
    run_stdio(server, tmp_path, ds, out, prompts_per_worker=2)
    records = read_jsonl(out / "run" / "trajectories.jsonl")
    counted = sorted(r["conversations"][-1]["value"].split("call ")[1].split(" in pid ") for r in records)
    assert len(counted) == 12 and len({pid for _, pid in counted}) == 1
    assert sorted(int(n) for n, _ in counted) == list(range(1, 13))
    assert len((tmp_path / "pids").read_text().split()) == 2  # the probe's server and the worker's


def test_per_prompt_sessions_get_a_server_each(server, tmp_path):
    prompts = ["first prompt", "second prompt", "third prompt"]
    ds = write_jsonl(tmp_path / "ds.jsonl", prompts)
    out = tmp_path / "out"
    common = dict(distribution_file=str(mcp_only(tmp_path)), distribution="mcp_only", num_workers=1)
    run(server, ds, out, run_name="shared", mcp_config=str(stdio_config(tmp_path)), **common)
    (tmp_path / "per_prompt").mkdir()
    config = stdio_config(tmp_path / "per_prompt", session="prompt")
    run(server, ds, out, run_name="own", mcp_config=str(config), **common)

    def echo_pids(name: str) -> set[str]:
        recs = read_jsonl(out / name / "trajectories.jsonl")
        return {r["conversations"][-1]["value"].split("echo from pid ")[1].split(":")[0] for r in recs}

    assert len(echo_pids("shared")) == 1  # one worker, one server for all its prompts
    assert len(echo_pids("own")) == 3  # one server per prompt
    assert len((tmp_path / "per_prompt" / "pids").read_text().split()) == 1 + 3  # the probe's and three


def test_crashing_server_gives_tool_errors_not_a_failed_run(server, tmp_path):
    # [calls:7] calls echo, add, count, fail, nap (longer than the tool timeout), crash, echo, then answers.
    ds = write_jsonl(tmp_path / "ds.jsonl", [f"crash {i} [calls:7]" for i in range(3)])
    out = tmp_path / "out"
    run_stdio(
        server, tmp_path, ds, out,
        max_failure_rate=0.0,  # a single failed prompt would exit 3
        tool_timeout=1,
        prompts_per_worker=1,  # one after the other: no prompt's crash lands in another's call
    )  # fmt: skip
    records = read_jsonl(out / "run" / "trajectories.jsonl")
    assert len(records) == 3 and all(r["completed"] for r in records)
    for rec in records:
        assert rec["tool_stats"]["mcp__tools__fail"] == {"count": 1, "success": 0, "failure": 1}
        assert rec["tool_stats"]["mcp__tools__crash"] == {"count": 1, "success": 0, "failure": 1}
        assert rec["tool_stats"]["mcp__tools__nap"] == {"count": 1, "success": 0, "failure": 1}
        results = [
            b["content"] for t in rec["conversations"] if t["from"] == "tool" for b in tool_blocks(t["value"])
        ]
        assert "did not answer within 1 s" in json.dumps(results)
        # After the crash the server was started again: the last call got a real answer.
        assert rec["tool_stats"]["mcp__tools__echo"] == {"count": 2, "success": 2, "failure": 0}
        assert "echo from pid" in rec["conversations"][-1]["value"]
    assert not (out / "run" / "failed.jsonl").exists() or not read_jsonl(out / "run" / "failed.jsonl")


@pytest.fixture
def http_server(tmp_path):
    """The test server over streamable HTTP on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "http_server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(port)], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"the HTTP MCP server did not start: {(tmp_path / 'http_server.log').read_text()}"
                    )
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_http_server_tools_reach_the_model(server, tmp_path, http_server):
    config = tmp_path / "servers.json"
    config.write_text(json.dumps({"mcpServers": {"tools": {"url": http_server}}}), "utf-8")
    ds = write_jsonl(tmp_path / "ds.jsonl", ["over http please", "add over http [calls:2]"])
    out = tmp_path / "out"
    run(
        server, ds, out,
        mcp_config=str(config),
        distribution_file=str(mcp_only(tmp_path)),
        distribution="mcp_only",
    )  # fmt: skip
    records = by_prompt(read_jsonl(out / "run" / "trajectories.jsonl"))
    assert "echo from pid" in records["over http please"][0]["conversations"][-1]["value"]
    added = records["add over http [calls:2]"][0]
    assert added["tool_stats"]["mcp__tools__add"] == {"count": 1, "success": 1, "failure": 0}
    # The scripted model fills integers with 1: the server's sum reached the model.
    tool_turns = [t["value"] for t in added["conversations"] if t["from"] == "tool"]
    assert '"content": "2"' in tool_turns[-1]


def test_server_that_cannot_start_stops_the_run_before_any_token(server, tmp_path, capsys):
    config = stdio_config(tmp_path, env={"TOOLS_TOKEN": TOKEN, "TOOLS_FAIL_START": "1"})
    ds = write_jsonl(tmp_path / "ds.jsonl", ["never runs"])
    code = exit_code(
        server, ds, tmp_path / "out", mcp_config=str(config),
        distribution_file=str(mcp_only(tmp_path)), distribution="mcp_only",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "MCP server 'tools'" in err and "cannot start or list its tools" in err
    assert "refusing to start: TOOLS_FAIL_START is set" in err  # the end of its stderr, quoted
    assert TOKEN not in err and "[REDACTED]" in err
    assert sum(requests(server).values()) == 0
    assert not (tmp_path / "out" / "run").exists()


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ({"tools": {"command": "x", "url": "http://h/mcp"}}, "mcpServers.tools: give either 'command'"),
        ({"tools": {"command": "x", "alwaysAllow": []}}, "mcpServers.tools: unknown field 'alwaysAllow'"),
        ({"bad name": {"command": "x"}}, "mcpServers.bad name: a server name is"),
        ({"tools": {"url": "ftp://h"}}, "field 'url' must be an http"),
        ({"tools": {"command": "x", "session": "run"}}, "field 'session' must be 'worker' or 'prompt'"),
        ({"tools": {"command": "x", "env": {"A": 1}}}, "field 'env' must map names to strings"),
    ],
)
def test_bad_mcp_config_is_refused_with_its_field(tmp_path, capsys, servers, message):
    config = tmp_path / "servers.json"
    config.write_text(json.dumps({"mcpServers": servers}), "utf-8")
    code = exit_code(
        None, write_jsonl(tmp_path / "ds.jsonl", ["x"]), tmp_path / "out", mcp_config=str(config)
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"--mcp_config {config}: " in err and message in err


def test_list_distributions_shows_file_distributions_and_mcp_toolsets(tmp_path):
    config = stdio_config(tmp_path)
    dists = tmp_path / "dists.yaml"
    dists.write_text(
        "mixed:\n  description: Shell and the tools server.\n  probabilities:\n    terminal: 80\n    mcp:tools: 50\n"
    )
    done = subprocess.run(
        [sys.executable, str(TESTS_DIR.parent / "batch_runner.py"), "--list_distributions",
         f"--mcp_config={config}", f"--distribution_file={dists}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mixed: Shell and the tools server.\n  terminal    80%\n  mcp:tools   50%\n" in done.stdout
    assert (
        f"Toolsets:\n  mcp:tools: MCP server 'tools' (stdio: {sys.executable}; one session per worker)\n"
        in done.stdout
    )
    assert f"tools: {', '.join(TOOLS)}" in done.stdout
    assert TOKEN not in done.stdout + done.stderr


def test_resume_with_other_tools_is_refused_so_records_keep_one_schema(tmp_path, capsys):
    ds = write_jsonl(tmp_path / "ds.jsonl", ["first run", "second run"])
    out = tmp_path / "out"
    run(None, ds, out, max_samples=1)
    code = exit_code(None, ds, out, resume=True, mcp_config=str(stdio_config(tmp_path)))
    assert code == 2
    err = capsys.readouterr().err
    assert "--resume with settings that differ from the first run (known_tools:" in err
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 1
    run(None, ds, out, resume=True)  # the same tools: the second row runs
    records = read_jsonl(out / "run" / "trajectories.jsonl")
    assert len(records) == 2
    assert set(records[0]["tool_stats"]) == set(records[1]["tool_stats"])


def test_rows_name_an_mcp_toolset_and_allowlist_its_tools(server, tmp_path):
    """Per-row control reaches MCP toolsets: a row's ``toolsets`` and ``tools`` may name them."""
    rows = [
        {"prompt": "only the server", "toolsets": ["mcp:tools"]},
        {"prompt": "just echo", "tools": ["mcp__tools__echo"]},
        {"prompt": "plain terminal"},
    ]
    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    out = tmp_path / "out"
    run(server, ds, out, mcp_config=str(stdio_config(tmp_path)), distribution="terminal_only", num_workers=1)
    records = {r["conversations"][1]["value"]: r for r in read_jsonl(out / "run" / "trajectories.jsonl")}
    names = {
        prompt: [t.get("function", t)["name"] for t in offered_in_system(rec["conversations"][0]["value"])]
        for prompt, rec in records.items()
    }
    assert names["only the server"] == TOOLS
    assert names["just echo"] == ["mcp__tools__echo"]
    assert names["plain terminal"] and not any(n.startswith("mcp__") for n in names["plain terminal"])
    assert records["only the server"]["toolsets_used"] == ["mcp:tools"]
