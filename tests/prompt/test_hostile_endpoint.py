"""A hostile endpoint against the model client: every case ends as a clear error class, in bounded
memory and within the deadline.

The server is real (loopback, written here); the client runs in its own process so that its peak
memory (``VmHWM``) is the client's alone. Without the bounds each case below took a worker to
gigabytes or kept a prompt alive forever.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from helpers import RawServer

ROOT = Path(__file__).resolve().parents[2]
MAX_MB = 4  # --max_response_mb for these runs
RSS_LIMIT_MB = 100  # the client process's peak: Python and the package (~25 MB) + a few bounds' worth

CLIENT = r"""
import json, resource, sys, time
from batchrun.prompt.llm import LLMClient, LLMConfig, LLMError
base_url, stream, max_mb, request_timeout, prompt_timeout = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
client = LLMClient(LLMConfig(model="m", base_url=base_url, api_key="k", stream=stream, max_retries=0,
                             max_response_mb=max_mb, request_timeout_s=request_timeout))
t0 = time.monotonic()
try:
    turn = client.chat([{"role": "user", "content": "hi"}], [], deadline=time.monotonic() + prompt_timeout)
    out = {"error_class": None, "content": turn.content[:100]}
except LLMError as exc:
    out = {"error_class": exc.error_class, "message": str(exc)[:300]}
out["elapsed_s"] = time.monotonic() - t0
# VmHWM: this process's own peak (ru_maxrss would also hold the forking parent's, from before exec)
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
out["maxrss_mb"] = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


# The same client in THREADS prompt threads of one process (a worker's), all against the endpoint at once.
THREADS_CLIENT = r"""
import json, sys, threading, time
from batchrun.prompt.llm import LLMClient, LLMConfig, LLMError
base_url, threads, max_mb, retries, stream = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
client = LLMClient(LLMConfig(model="m", base_url=base_url, api_key="k", max_retries=retries, max_response_mb=max_mb, stream=stream))
errors, start = [], threading.Barrier(threads)
def one():
    start.wait()
    try:
        client.chat([{"role": "user", "content": "hi"}], [], deadline=time.monotonic() + 120)
        errors.append(None)
    except LLMError as exc:
        errors.append(exc.error_class)
ts = [threading.Thread(target=one) for _ in range(threads)]
[t.start() for t in ts]
[t.join() for t in ts]
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({"errors": errors, "maxrss_mb": int(hwm[0].split()[1]) / 1024}))
"""


def _gzip_bomb() -> bytes:
    """~256 MiB of zeros, gzip-compressed to ~250 KiB."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    return b"".join(comp.compress(block) for _ in range(256)) + comp.flush()


class Hostile(RawServer):
    """A loopback server that answers every request the way ``mode`` says, until the client goes."""

    def __init__(self, mode: str):
        self.mode = mode
        super().__init__()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _serve(self, conn: socket.socket) -> None:
        try:
            rfile = conn.makefile("rb")
            headers = {}
            rfile.readline()
            while (line := rfile.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            rfile.read(int(headers.get("content-length", 0)))
            getattr(self, f"_{self.mode}")(conn)
        except OSError:
            pass  # the client went away: what every case here wants
        finally:
            conn.close()

    @staticmethod
    def _endless(conn: socket.socket, piece: bytes) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            conn.sendall(piece)

    def _gzip_bomb(self, conn):
        body = _gzip_bomb()
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)
        time.sleep(5)

    def _huge_content_length(self, conn):
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n"
        )
        self._endless(conn, b" " * 65536)

    def _until_close(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
        self._endless(conn, b" " * 65536)

    def _huge_chunk(self, conn):
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        conn.sendall(b"ffffffffffffffff\r\n")
        self._endless(conn, b" " * 65536)

    def _huge_headers(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        self._endless(conn, b"X-Filler: " + b"y" * 1000 + b"\r\n")

    def _endless_sse(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        chunk = {"choices": [{"index": 0, "delta": {"content": "x" * 200}}]}
        self._endless(conn, (b"data: " + json.dumps(chunk).encode() + b"\n\n") * 50)

    def _sse_no_newline(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: ")
        self._endless(conn, b"a" * 4096)

    def _drip(self, conn):
        body = json.dumps({"choices": [{"index": 0, "message": {"content": "hi"}}]}).encode()
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        for byte in body:
            conn.sendall(bytes([byte]))
            time.sleep(1.0)

    def _header_drip(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for _ in range(120):
            for byte in b"X-Slow: y\r\n":
                conn.sendall(bytes([byte]))
                time.sleep(0.5)

    def _done_then_drip(self, conn):
        """A whole streamed reply, then (chunked) a comment line every 0.3 s for 30 s."""
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
        events = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
        conn.sendall(b"%x\r\n%s\r\n" % (len(events), events))
        for _ in range(100):
            conn.sendall(b"2\r\n:\n\r\n")
            time.sleep(0.3)


def run_client(
    server: Hostile, *, stream: bool = False, request_timeout: float = 30, prompt_timeout: float = 60
) -> dict:
    args = (server.base_url, "1" if stream else "0", MAX_MB, request_timeout, prompt_timeout)
    return run_script(CLIENT, *args, timeout=180)


def run_script(script: str, *args: object, timeout: float) -> dict:
    """A client script in a process of its own (its peak memory is its own), without a proxy; the JSON
    object its last line prints."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HTTP_PROXY", None), env.pop("http_proxy", None)
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("mode", "stream"),
    [
        ("gzip_bomb", False),
        ("huge_content_length", False),
        ("until_close", False),
        ("huge_chunk", False),
        ("huge_headers", False),
        ("endless_sse", True),
        ("sse_no_newline", True),
    ],
)
def test_an_oversized_answer_is_a_bad_response_in_bounded_memory(mode, stream):
    server = Hostile(mode)
    try:
        result = run_client(server, stream=stream)
    finally:
        server.close()
    assert result["error_class"] == "bad_response", result
    if mode == "sse_no_newline":
        assert "line longer than" in result["message"]
    assert result["maxrss_mb"] < RSS_LIMIT_MB, result
    assert result["elapsed_s"] < 60, result  # the prompt's deadline (60 s) was not what stopped it


def run_threads(threads: int, max_mb: int, retries: int, stream: bool = False) -> dict:
    server = Hostile("endless_sse" if stream else "until_close")
    try:
        result = run_script(
            THREADS_CLIENT, server.base_url, threads, max_mb, retries, int(stream), timeout=300
        )
    finally:
        server.close()
    assert result["errors"] == ["bad_response"] * threads, result
    return result


def test_answers_read_at_once_by_a_workers_threads_are_bounded_together():
    """16 prompt threads (a worker's default) each fed an endless body at the default 32 MiB bound: each
    answer stayed within its own bound, but together they took the process to ~540 MB (~1 GB with
    retries; the default four workers to 4 GB). Now all the answers a process reads at once hold at
    most twice the bound (~205 MB: 64 MiB, Python and the package, the allocator's per-thread slack)."""
    result = run_threads(16, 32, 0)
    assert result["maxrss_mb"] < 400, result


@pytest.mark.parametrize(
    "stream", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "streamed"]
)
def test_a_failed_attempts_body_is_freed_before_the_retry(stream):
    """The body read up to the bound (a stream: its assembled reply) was kept by the error's traceback,
    in a cycle with the attempt's frame, while the retry read another: ~155 MB at a 64 MiB bound (two
    bodies), now ~92 MB (one). 16 threads with retries: 490 MB (streamed 300), now 155 (99)."""
    result = run_threads(1, 64, 2, stream)
    assert result["maxrss_mb"] < 130, result


def test_a_dripped_body_ends_at_the_prompts_deadline():
    """One byte a second: every read succeeds, only the deadline checked on each read ends it."""
    server = Hostile("drip")
    try:
        result = run_client(server, request_timeout=600, prompt_timeout=4)
    finally:
        server.close()
    assert result["error_class"] == "timeout", result
    assert result["elapsed_s"] < 4 + 3, result  # the deadline held: not the ~60 s the drip would take


def test_request_timeout_bounds_the_whole_request_not_each_read():
    server = Hostile("drip")
    try:
        result = run_client(server, request_timeout=3, prompt_timeout=600)
    finally:
        server.close()
    assert result["error_class"] == "timeout", result
    assert result["elapsed_s"] < 3 + 3, result


def test_headers_dripped_a_byte_at_a_time_end_at_the_deadline():
    """Each read of the head gets a byte in time; only the request's deadline (a watchdog) ends it."""
    server = Hostile("header_drip")
    try:
        result = run_client(server, request_timeout=3, prompt_timeout=600)
    finally:
        server.close()
    assert result["error_class"] == "timeout", result
    assert result["elapsed_s"] < 3 + 3, result


def test_bytes_dripped_after_a_finished_stream_do_not_hold_the_prompt():
    """After [DONE] the rest of the body is drained to keep the connection, but only for a moment:
    the drain's timeout was per read, so a comment every 0.3 s held the prompt for all 30 s of the
    drip (and DRAIN_BYTES reads of it at most), past --request_timeout and the prompt's deadline."""
    server = Hostile("done_then_drip")
    try:
        result = run_client(server, stream=True, request_timeout=3, prompt_timeout=5)
    finally:
        server.close()
    assert result["error_class"] is None and result["content"] == "hi", result
    assert result["elapsed_s"] < 3 + 1, result
