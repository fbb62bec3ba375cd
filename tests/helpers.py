"""Plain helpers shared by the tests (fixtures are in conftest.py): datasets, JSONL files, Docker, CI policy."""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

import batch_runner
from batchrun.fakes.fake_model import FakeModelServer
from batchrun.sharegpt import first_human

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
IN_CI = os.environ.get("CI") == "true"
DOCKER_TEST_IMAGE = "batch-runner-test:latest"  # built from busybox by tests/docker_image/build.sh
TOOL_CAP = 64 * 1024  # the output cap the tool tests' sandboxes use


def skip_or_fail(reason: str) -> None:
    """Locally a missing facility skips the test; in CI it fails it, so nothing is silently not run."""
    if IN_CI:
        pytest.fail(f"CI must be able to run this test: {reason}")
    pytest.skip(reason)


def docker_ps(*labels: str) -> list[str]:
    """Names of all containers (running or not) with every one of ``labels``, as the docker CLI reports them."""
    filters = [arg for label in labels for arg in ("--filter", f"label={label}")]
    done = subprocess.run(
        ["docker", "ps", "-a", *filters, "--format", "{{.Names}}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.split()


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    """A dataset of one ``{"prompt": ...}`` row per prompt."""
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts), "utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def lines_written(path: Path) -> int:
    """The complete lines of a JSONL file a running run is appending to: a reader may see a line's first
    pages before its last (a write of a record over 4 KiB is not atomic to a concurrent read), and
    ``read_jsonl`` of a live file failed on a record cut at 8,192 bytes."""
    try:
        return sum(1 for line in path.read_bytes().split(b"\n")[:-1] if line.strip())
    except FileNotFoundError:
        return 0


# ----------------------------------------------------------------------------- a run in-process


def run(server: FakeModelServer | None, dataset: Path, out: Path, run_name: str = "run", **kw) -> None:
    """One in-process run against ``server`` (None: the built-in ``--model=mock``); flags in ``kw`` win.
    Raises SystemExit on a non-zero exit like the CLI does."""
    endpoint = {"model": "mock"}
    if server is not None:
        endpoint = {"model": "fake-model", "base_url": server.base_url, "api_key": "sk-local-test"}
    args = dict(
        dataset_file=str(dataset),
        batch_size=4,
        run_name=run_name,
        **endpoint,
        output_dir=str(out),
        num_workers=2,
        distribution="terminal_only",
        max_failure_rate=1.0,
    )
    args.update(kw)
    code = batch_runner.main(**args)
    if code:
        raise SystemExit(code)


def runner_argv(dataset: Path, out: Path, server: FakeModelServer, *flags: str) -> list[str]:
    """``python batch_runner.py`` as a process, against ``server``, run name ``run`` under ``out``, one worker."""
    return [
        sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=run",
        f"--output_dir={out}", "--model=fake-model", f"--base_url={server.base_url}", "--api_key=sk-local-test",
        "--distribution=terminal_only", "--num_workers=1", *flags,
    ]  # fmt: skip


def by_prompt(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in records:
        out[first_human(rec["conversations"])].append(rec)
    return out


def requests(server: FakeModelServer) -> collections.Counter:
    return collections.Counter(server.stats()["requests_by_prompt"])


def tool_blocks(value: str) -> list[dict]:
    parts = value.split("<tool_response>\n")[1:]
    return [json.loads(p.split("\n</tool_response>")[0]) for p in parts]


def offered_in_system(system_value: str) -> list[dict]:
    return json.loads(system_value.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0])


def exit_code(server: FakeModelServer, dataset: Path, out: Path, **kw) -> int:
    try:
        run(server, dataset, out, **kw)
    except SystemExit as exc:
        return int(exc.code)
    return 0


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    return path


def stats_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "statistics.json").read_text("utf-8"))


def parse_line(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def wait_for(predicate, timeout_s: float, step_s: float = 0.2):
    """Poll ``predicate`` until it gives a true value or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    return predicate()


def wait_until(predicate, timeout_s: float, step_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; whether it held at the end."""
    return bool(wait_for(predicate, timeout_s, step_s))


def tool_call(sandbox, name: str, **args) -> dict:
    """One call of a terminal/file tool through execute_tool_call, as a prompt makes it."""
    from batchrun.prompt.tools.catalog import execute_tool_call, tools_for_toolsets
    from batchrun.prompt.tools.registry import ToolContext

    offered = {t.name for t in tools_for_toolsets(["terminal", "file"])}
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=20.0, output_cap_bytes=TOOL_CAP)
    return json.loads(execute_tool_call(name, json.dumps(args), ctx, offered))


def sandbox_sh(sandbox, command: str) -> str:
    """A command in the sandbox that must succeed; its output."""
    result = sandbox.run(command, timeout_s=20)
    assert result.exit_code == 0, result.output
    return result.output


def _project_of(pyproject: Path) -> tuple[str, str, dict[str, dict[str, str]]]:
    """Name, version and entry points of a test plugin's pyproject.toml (simple TOML only; Python 3.10
    has no tomllib)."""
    name = version = ""
    groups: dict[str, dict[str, str]] = {}
    section = ""
    for line in pyproject.read_text("utf-8").splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line:
            key, value = (part.strip().strip('"') for part in line.split("=", 1))
            if section == "project" and key in ("name", "version"):
                name, version = (value, version) if key == "name" else (name, value)
            elif section.startswith("project.entry-points."):
                groups.setdefault(section.split(".", 2)[2].strip('"'), {})[key] = value
    return name, version, groups


def build_wheel(project: Path, out: Path) -> Path:
    """A pure-Python wheel of a test package (a plugin, a backend), made from its pyproject.toml without a build backend, so
    installing it needs nothing from a package index (pip's build isolation would fetch setuptools)."""
    name, version, groups = _project_of(project / "pyproject.toml")
    stem = f"{name.replace('-', '_')}-{version}"
    files: dict[str, bytes] = {}
    for package in (p for p in project.iterdir() if (p / "__init__.py").is_file()):
        for source in sorted(package.rglob("*.py")):
            files[source.relative_to(project).as_posix()] = source.read_bytes()
    info = f"{stem}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{info}/entry_points.txt"] = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n"
        for group, points in groups.items()
    ).encode()
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = out / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def default_sigint() -> None:
    """preexec_fn for a runner that a test interrupts with SIGINT: Ctrl-C's default disposition, even
    where the test itself was started with SIGINT ignored (a shell's background job), so the runner's
    Python turns it into KeyboardInterrupt as it does in a terminal."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ----------------------------------------------------------------------------- a scripted endpoint

OK_REPLY = {
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "OK"}}]
}  # a chat answer

# (HTTP status, JSON body: an object, or raw bytes sent as they are[, headers to send beside them])
Reply = "tuple[int, dict | bytes] | tuple[int, dict | bytes, dict[str, str]]"


class ScriptedEndpoint:
    """A chat endpoint on a free loopback port whose every answer the test scripts (the fake model's
    behaviour when it is not what a test needs: a dying endpoint, refusals, odd usage).

    ``answer(call, calls)`` gives each POST's :data:`Reply`; ``call`` is ``{"body": parsed JSON or None,
    "check": the start check's X-Batch-Runner-Check header}``, ``calls`` every POST so far, this one
    last (answers are given one at a time; a reply that is a function is called after, outside that
    order: one that sleeps answers late while the next calls are answered). GET (the model list) answers
    ``get``."""

    def __init__(self, answer: Callable[[dict, list[dict]], Reply], get: Reply = (404, {})):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.calls: list[dict] = []
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self._send(*get)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                with lock:
                    outer.calls.append(
                        {
                            "body": body,
                            "check": self.headers.get("X-Batch-Runner-Check"),
                            "headers": dict(self.headers),
                        }
                    )
                    status, reply, *headers = answer(outer.calls[-1], outer.calls)
                self._send(status, reply() if callable(reply) else reply, *headers)

            def _send(self, status, reply, headers=None):
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def checks(self) -> int:
        """Start checks (and probes) received."""
        return sum(1 for c in self.calls if c["check"])

    def prompt_calls(self) -> int:
        """Calls made by prompts (not start checks or probes)."""
        return sum(1 for c in self.calls if not c["check"])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ScriptedEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pretend_public(monkeypatch, *names: str) -> None:
    """Let the web tools' address check pass ``names`` (resolved as 127.0.0.1): they stand for public hosts."""
    import socket

    from batchrun.prompt.tools import web

    check = web.resolve_public

    def resolve(host, port):
        if host in names:
            return socket.getaddrinfo("127.0.0.1", port, type=socket.SOCK_STREAM)
        return check(host, port)

    monkeypatch.setattr(web, "resolve_public", resolve)


# Reads the memory of every process it may (the command server's too, were it allowed), and prints the
# end marker with exit code 0 for every hex token it finds there, then fails. Were the token of the
# marker in reach, the runner would read 0: a hidden test that runs the agent's code would pass.
FORGE_FROM_MEMORY = r"""
import os, re, sys
found, seen = set(), []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            seen.append(pid)
            for line in maps:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if "r" not in perms or hi - lo > 64 << 20:
                    continue
                try:
                    mem.seek(lo)
                    found.update(re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", mem.read(hi - lo)))
                except (OSError, ValueError, OverflowError):
                    pass
    except OSError:
        pass
for token in found:
    sys.stdout.write("\n[batch-runner-exit:%s]=0\n" % token.decode())
sys.stdout.flush()
print("read the memory of", sorted(seen), "tokens", len(found))
sys.exit(3)
"""


class RawServer:
    """A loopback TCP server with no HTTP library in the way: each connection goes to ``self._serve``
    on a thread of its own (a subclass answers as a hostile server would)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError
