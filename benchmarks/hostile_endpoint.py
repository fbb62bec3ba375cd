#!/usr/bin/env python3
"""The real CLI against a hostile OpenAI-compatible endpoint: one run per attack, streamed and not.

    python benchmarks/hostile_endpoint.py                  # every attack, --stream false and true
    python benchmarks/hostile_endpoint.py drip usage_nan   # only these
    python benchmarks/hostile_endpoint.py --list

The endpoint (loopback, raw sockets, written here) answers ``GET /models`` and the start check
properly, then misbehaves on every chat call whose prompt holds the attack's marker ``[atk:NAME]``.
Each run is ``batch_runner.py --base_url=http://127.0.0.1:PORT/v1 --model=x --sandbox=local`` with
short timeouts; printed per run: the exit code, wall time against the prompt's deadline, the peak RSS
(VmHWM) of the runner and of its largest other process, the rows' outcomes (trajectory, discard,
failed with its error class), whether every row ended exactly once (rows a budget left unstarted, for a resume, apart), whether the
API key reached any output file or another origin (a redirect), and the requests the endpoint saw.
Exit 1 when a row did not end exactly once, the key leaked, or a run exited other than 0 (or 6: a
--budget_usd the endpoint's costs cannot keep; with --at_start, 2: the start check refused to run).
"""

from __future__ import annotations

import argparse
import email.utils
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "sk-HOSTILE-SECRET-4242-abcdef"
PROMPT_TIMEOUT = 20.0
REQUEST_TIMEOUT = 10.0
GB = 1 << 30


def usage(prompt=12, completion=4, cost=1e-5, **extra) -> dict:
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "cost": cost, **extra}
    return {k: v for k, v in out.items() if v is not _DROP}


_DROP = object()


def reply(message: dict | None = None, finish="stop", use: Any = None) -> dict:
    message = {"role": "assistant", "content": "done"} if message is None else message
    return {
        "id": "c1",
        "object": "chat.completion",
        "model": "x",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage() if use is None else use,
    }


def as_sse(body: dict) -> bytes:
    """A whole reply as server-sent events: one delta with the message, then the usage, then [DONE]."""
    choice = body["choices"][0]
    msg = dict(choice["message"])
    calls = msg.pop("tool_calls", None)
    if calls:
        msg["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
    first = {"choices": [{"index": 0, "delta": msg, "finish_reason": choice["finish_reason"]}]}
    last = {"choices": [], "usage": body.get("usage")}
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (first, last)) + b"data: [DONE]\n\n"


def calls(n: int, name="terminal", args: Any = '{"command": "true"}', same_id=False) -> dict:
    tcs = [
        {
            "id": "call_0" if same_id else f"call_{i}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }
        for i in range(n)
    ]
    return {"role": "assistant", "content": None, "tool_calls": tcs}


class Endpoint:
    """The hostile endpoint: ``GET /models``, the start check and any prompt without a marker get a
    proper answer; a prompt with ``[atk:NAME]`` gets ``Endpoint.atk_NAME``."""

    def __init__(self, host="127.0.0.1", sink=False):
        self.sink = sink  # another origin a redirect points to: answers every call properly
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        self.lock = threading.Lock()
        self.seen: list[dict] = []
        self.counts: dict[str, int] = {}
        self.other: Endpoint | None = None
        self.check_attack: str | None = None  # the attack the start check (and GET /models) meets
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            rfile = conn.makefile("rb")
            while True:
                line = rfile.readline(65536)
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := rfile.readline(65536)) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = rfile.read(int(headers.get("content-length", 0)))
                req = json.loads(body) if body else {}
                text = json.dumps(req.get("messages", ""))
                atk = text.split("[atk:", 1)[1].split("]", 1)[0] if "[atk:" in text else None
                with self.lock:
                    self.seen.append(
                        {"method": method, "path": path, "auth": "authorization" in headers, "atk": atk}
                    )
                    n = self.counts[atk or ""] = self.counts.get(atk or "", 0) + 1
                stream = bool(req.get("stream"))
                check = method == "GET" or "x-batch-runner-check" in headers
                if check and self.check_attack:
                    atk = self.check_attack
                    with self.lock:
                        n = self.counts[atk] = self.counts.get(atk, 0) + 1
                elif method == "GET":
                    self.send(conn, 200, {"object": "list", "data": [{"id": "x"}]})
                    continue
                if atk is None or self.sink or (check and not self.check_attack):
                    self.ok(conn, stream)
                    continue
                req["_auth"] = headers.get("authorization", "")
                if getattr(self, f"atk_{atk}")(conn, stream, n, req) == "close":
                    return
        except (OSError, ValueError):
            pass
        finally:
            conn.close()

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def send(conn, status, body, ctype="application/json", extra=b"", reason=b"X"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status, reason, ctype.encode(), len(data), extra)  # fmt: skip
        conn.sendall(head + data)

    def ok(self, conn, stream, body: dict | None = None):
        body = reply() if body is None else body
        if stream:
            self.send(conn, 200, as_sse(body), "text/event-stream")
        else:
            self.send(conn, 200, body)

    def raw(self, conn, stream, plain: bytes, events: bytes):
        if stream:
            self.send(conn, 200, events, "text/event-stream")
        else:
            self.send(conn, 200, plain)

    @staticmethod
    def endless(conn, head: bytes, piece: bytes, limit=2 * GB, seconds=120.0):
        conn.sendall(head)
        sent, end = 0, time.monotonic() + seconds
        while sent < limit and time.monotonic() < end:
            conn.sendall(piece)
            sent += len(piece)
        return "close"

    # -- GARBAGE -------------------------------------------------------------------------------
    def atk_nonjson(self, conn, stream, n, req):
        self.raw(
            conn, stream, b"<html>hello, not json</html>", b"data: <html>not json</html>\n\ndata: [DONE]\n\n"
        )

    def atk_truncated(self, conn, stream, n, req):
        self.raw(
            conn,
            stream,
            b'{"choices":[{"index":0,"mess',
            b'data: {"choices":[{"index":0,"del\n\ndata: [DONE]\n\n',
        )

    def _shape(self, conn, stream, body):
        if stream:
            self.send(
                conn,
                200,
                b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n",
                "text/event-stream",
            )
        else:
            self.send(conn, 200, body)

    def atk_choices_missing(self, conn, stream, n, req):
        self._shape(conn, stream, {"id": "c", "usage": usage()})

    def atk_choices_empty(self, conn, stream, n, req):
        self._shape(conn, stream, {"choices": [], "usage": usage()})

    def atk_choices_null(self, conn, stream, n, req):
        self._shape(conn, stream, {"choices": None, "usage": usage()})

    def atk_message_null(self, conn, stream, n, req):
        self._shape(
            conn, stream, {"choices": [{"index": 0, "message": None, "delta": None, "finish_reason": "stop"}]}
        )

    def atk_json_list(self, conn, stream, n, req):
        self._shape(conn, stream, [1, 2, 3])

    def atk_args_object(self, conn, stream, n, req):
        """Tool call arguments as an object, then a number: not the string the API says."""
        if n > 2:
            return self.ok(conn, stream)
        self.ok(conn, stream, reply(calls(1, args={"command": "true"} if n == 1 else 12345), "tool_calls"))

    def atk_ids_dup(self, conn, stream, n, req):
        if n > 1:
            return self.ok(conn, stream)
        self.ok(conn, stream, reply(calls(3, same_id=True), "tool_calls"))

    def atk_calls_10k(self, conn, stream, n, req):
        if n > 1:
            return self.ok(conn, stream)
        self.ok(conn, stream, reply(calls(10_000), "tool_calls"))

    def atk_name_huge(self, conn, stream, n, req):
        if n > 1:
            return self.ok(conn, stream)
        self.ok(conn, stream, reply(calls(1, name="t" * 3_000_000), "tool_calls"))

    def atk_args_huge(self, conn, stream, n, req):
        if n > 1:
            return self.ok(conn, stream)
        arg = json.dumps({"command": "echo " + "a" * 3_000_000})
        self.ok(conn, stream, reply(calls(1, args=arg), "tool_calls"))

    def atk_args_deep(self, conn, stream, n, req):
        """Arguments nested 100,000 deep (a string the runner parses)."""
        if n > 1:
            return self.ok(conn, stream)
        self.ok(conn, stream, reply(calls(1, args='{"a":' * 100_000 + "1" + "}" * 100_000), "tool_calls"))

    def atk_body_deep(self, conn, stream, n, req):
        """The reply itself nested 100,000 deep."""
        deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
        plain = (
            b'{"choices":[{"index":0,"message":{"role":"assistant","content":"x","extra":'
            + deep
            + b'},"finish_reason":"stop"}]}'
        )
        self.raw(
            conn, stream, plain, b"data: " + plain.replace(b'"message"', b'"delta"') + b"\n\ndata: [DONE]\n\n"
        )

    # -- HUGE ----------------------------------------------------------------------------------
    def atk_huge_cl(self, conn, stream, n, req):
        ctype = b"text/event-stream" if stream else b"application/json"
        head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (ctype, 2 * GB)
        piece = (
            b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 60000 + b'"}}]}\n\n'
            if stream
            else b" " * 65536
        )
        return self.endless(conn, head, piece)

    def atk_huge_close(self, conn, stream, n, req):
        ctype = b"text/event-stream" if stream else b"application/json"
        head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nConnection: close\r\n\r\n" % ctype
        piece = (
            b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 60000 + b'"}}]}\n\n'
            if stream
            else b'["' + b"x" * 65536
        )
        return self.endless(conn, head, piece)

    def atk_sse_line(self, conn, stream, n, req):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: "
        return self.endless(conn, head, b"a" * 65536, limit=GB)

    def atk_sse_comments(self, conn, stream, n, req):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        return self.endless(conn, head, b": keep-alive\n\n" * 4000)

    def atk_sse_empty(self, conn, stream, n, req):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        return self.endless(conn, head, b'data: {"choices":[{"index":0,"delta":{}}]}\n\n' * 1000)

    def atk_sse_blank(self, conn, stream, n, req):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        return self.endless(conn, head, b"\n" * 65536)

    # -- DRIP ----------------------------------------------------------------------------------
    def atk_drip_head(self, conn, stream, n, req):
        for b in b"HTTP/1.1 200 OK\r\n" + b"X-Slow: y\r\n" * 1000:
            conn.sendall(bytes([b]))
            time.sleep(0.5)
        return "close"

    def atk_drip_body(self, conn, stream, n, req):
        body = as_sse(reply()) if stream else json.dumps(reply()).encode()
        ctype = b"text/event-stream" if stream else b"application/json"
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (ctype, len(body))
        )
        for b in body:
            conn.sendall(bytes([b]))
            time.sleep(0.5)
        return "close"

    def atk_drip_comments(self, conn, stream, n, req):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for _ in range(1000):
            conn.sendall(b":\n")
            time.sleep(0.5)
        return "close"

    # -- USAGE (each call answers; the budget must stop the run) ---------------------------------
    def _usage(self, conn, stream, u):
        self.ok(conn, stream, reply(use=u))

    def atk_usage_negative(self, conn, stream, n, req):
        self._usage(conn, stream, usage(-1_000_000, -5, -1.0))

    atk_usage_negative_usd = atk_usage_negative

    def atk_usage_nan(self, conn, stream, n, req):
        self._usage(conn, stream, usage("NaN", "Infinity", "nan"))

    def atk_usage_1e300(self, conn, stream, n, req):
        self._usage(conn, stream, usage(1e300, 1e300, 1e300))

    def atk_usage_missing(self, conn, stream, n, req):
        self._usage(conn, stream, {})

    def atk_usage_null(self, conn, stream, n, req):
        body = reply()
        body["usage"] = None
        self.ok(conn, stream, body)

    def atk_usage_huge_prompt(self, conn, stream, n, req):
        self._usage(conn, stream, usage(9_999_999, 1, 0.5))

    def atk_usage_zero(self, conn, stream, n, req):
        """Says 0 tokens and a cost of 0 while answering 100 KB of text."""
        self.ok(conn, stream, reply({"role": "assistant", "content": "z" * 100_000}, use=usage(0, 0, 0.0)))

    def atk_usage_bool(self, conn, stream, n, req):
        self._usage(conn, stream, usage(True, True, True))

    # -- status codes --------------------------------------------------------------------------
    def _status(self, conn, status, extra=b""):
        self.send(conn, status, {"error": {"message": "no", "code": status}}, extra=extra)

    def atk_r429_huge(self, conn, stream, n, req):
        self._status(conn, 429, b"Retry-After: 1000000000\r\n")

    def atk_r429_negative(self, conn, stream, n, req):
        self._status(conn, 429, b"Retry-After: -5\r\n")

    def atk_r429_date(self, conn, stream, n, req):
        when = email.utils.formatdate(time.time() + 10 * 365 * 86400, usegmt=True).encode()
        self._status(conn, 429, b"Retry-After: " + when + b"\r\n")

    def atk_r429_ms(self, conn, stream, n, req):
        self._status(conn, 429, b"retry-after-ms: 1e12\r\nx-ratelimit-reset-requests: 99999h\r\n")

    def atk_r500(self, conn, stream, n, req):
        self._status(conn, 500)

    def atk_r503_loading(self, conn, stream, n, req):
        self.send(
            conn, 503, {"error": {"message": "Loading model", "code": 503}}, extra=b"Retry-After: 1000000\r\n"
        )

    def atk_r401_mid(self, conn, stream, n, req):
        if n <= 3:
            return self.ok(conn, stream)
        self._status(conn, 401)

    def _redirect(self, conn, code):
        assert self.other is not None
        self.send(
            conn, code, b"", extra=b"Location: " + self.other.base_url.encode() + b"/chat/completions\r\n"
        )

    def atk_redirect_307(self, conn, stream, n, req):
        self._redirect(conn, 307)

    def atk_redirect_302(self, conn, stream, n, req):
        self._redirect(conn, 302)

    def atk_redirect_loop(self, conn, stream, n, req):
        self.send(conn, 307, b"", extra=b"Location: " + self.base_url.encode() + b"/chat/completions\r\n")

    def atk_echo_key_error(self, conn, stream, n, req):
        """An error whose message repeats the request's Authorization header (the key in it)."""
        self.send(conn, 500, {"error": {"message": f"upstream rejected {req['_auth']}", "code": 500}})

    def atk_echo_key_400(self, conn, stream, n, req):
        self.send(conn, 400, {"error": {"message": f"Incorrect API key provided: {req['_auth'][7:]}"}})

    def atk_echo_key_header(self, conn, stream, n, req):
        """The key sent back in a header and the reason phrase of a 502."""
        key = req["_auth"][7:].encode()
        self.send(
            conn, 502, b"bad gateway " + key, "text/plain", extra=b"X-Echo: " + key + b"\r\n", reason=key
        )

    def atk_echo_key_reply(self, conn, stream, n, req):
        """A 200 reply whose content and tool call hold the key."""
        key = req["_auth"][7:]
        if n > 1:
            return self.ok(conn, stream, reply({"role": "assistant", "content": f"the key is {key}"}))
        self.ok(conn, stream, reply(calls(1, args=json.dumps({"command": f"echo {key}"})), "tool_calls"))

    def atk_status_garbage(self, conn, stream, n, req):
        conn.sendall(b"HTTP/1.1 999999999999999999999 \xff\xfe\r\nContent-Length: 2\r\n\r\n{}")


ATTACKS = sorted(name[4:] for name in dir(Endpoint) if name.startswith("atk_"))
STREAM_ONLY = {"sse_line", "sse_comments", "sse_empty", "sse_blank", "drip_comments"}
# Rows per run and the run's extra flags (budgets for the usage lies).
ROWS = {"r401_mid": 6}
BUDGET = ["--budget_tokens=40000", "--max_tokens=200"]  # --budget_usd: see the usd_ runs
EXTRA = {name: BUDGET for name in ATTACKS if name.startswith("usage_")}
EXTRA["usage_negative_usd"] = ["--budget_usd=0.05", "--max_tokens=200"]
for name in EXTRA:
    ROWS[name] = 30


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return out


def hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_attack(
    ep: Endpoint, name: str, stream: bool, workdir: Path, rows: int = 0, per_worker: int = 4
) -> dict:
    rows = rows or ROWS.get(name, 1)
    data = workdir / f"{name}-{int(stream)}.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"row {i}: do the task [atk:{name}]"}) + "\n" for i in range(rows))
    )
    run = f"{name}-{'s' if stream else 'p'}"
    out = workdir / "out"
    cmd = [
        sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={data}", "--batch_size=10",
        f"--run_name={run}", f"--base_url={ep.base_url}", "--model=x", "--num_workers=1",
        f"--prompts_per_worker={per_worker}", "--sandbox=local", f"--output_dir={out}", f"--stream={stream}",
        f"--prompt_timeout={PROMPT_TIMEOUT}", f"--request_timeout={REQUEST_TIMEOUT}", "--max_retries=2",
        "--max_turns=3", "--max_failure_rate=1", "--keep_no_reasoning=true", "--endpoint_grace=5",
        "--tool_timeout=5", "--distribution=terminal_only", *EXTRA.get(name, []),
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "PYTHONPATH": str(ROOT)}
    for k in ("OPENROUTER_API_KEY", "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        env.pop(k, None)
    logf = workdir / f"{run}.log"
    peaks: dict[int, float] = {}
    t0 = time.monotonic()
    with logf.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        while proc.poll() is None:
            for p in tree(proc.pid):
                if (m := hwm_mb(p)) is not None:
                    peaks[p] = max(peaks.get(p, 0.0), m)
            if time.monotonic() - t0 > 600:
                proc.kill()
            time.sleep(0.1)
    wall = time.monotonic() - t0
    rd = out / run
    traj, disc, fail = (read_jsonl(rd / f) for f in ("trajectories.jsonl", "discarded.jsonl", "failed.jsonl"))
    ended = [r.get("prompt") or _prompt_of(r) for r in traj + disc + fail]
    expected = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
    status = json.loads((rd / "status.json").read_text()) if (rd / "status.json").exists() else {}
    leaked = [
        str(p.relative_to(workdir))
        for p in [logf, *rd.rglob("*")]
        if p.is_file() and API_KEY.encode() in p.read_bytes()
    ]
    runner_peak = peaks.get(proc.pid, 0.0)
    others = max((v for k, v in peaks.items() if k != proc.pid), default=0.0)
    return {
        "attack": name,
        "stream": stream,
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "runner_mb": round(runner_peak),
        "worker_mb": round(others),
        "rows": rows,
        "traj": len(traj),
        "disc": sorted({r.get("reason") for r in disc}),
        "fail": sorted({r.get("error_class") for r in fail}),
        # every row ended exactly once, but those the budget left for a resume (never started)
        "rows_ended": len(ended),
        "once": len(ended) == len(set(ended))
        and set(ended) <= set(expected)
        and len(set(expected) - set(ended)) == (status.get("skipped_budget") or 0),
        "leak": leaked,
        "requests": ep.counts.get(name, 0),
        "spent_tokens": (status.get("budget") or {}).get("spent_tokens"),
        "cost_usd": status.get("cost_usd"),
        "tail": logf.read_text(errors="replace").strip().splitlines()[-1:]
        if proc.returncode not in (0,)
        else [],
        "stop": _stop_reasons(traj),
        "skipped_budget": status.get("skipped_budget"),
    }


def _prompt_of(rec: dict) -> str | None:
    for msg in rec.get("conversations", []):
        if msg.get("from") == "human":
            return msg.get("value")
    return None


def _stop_reasons(traj: list[dict]) -> list[str]:
    return sorted({str((r.get("metadata") or {}).get("stop_reason") or r.get("stop_reason")) for r in traj})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("attacks", nargs="*", help=f"default: all of {', '.join(ATTACKS)}")
    p.add_argument("--list", action="store_true")
    p.add_argument("--stream", choices=("both", "true", "false"), default="both")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--rows", type=int, default=0, help="rows per run (default: 1, more for some attacks)")
    p.add_argument("--per_worker", type=int, default=4, help="--prompts_per_worker (one worker)")
    p.add_argument("--at_start", action="store_true", help="the start check and GET /models meet the attack")
    args = p.parse_args()
    if args.list:
        print("\n".join(ATTACKS))
        return 0
    ep, other = Endpoint(), Endpoint("127.0.0.2", sink=True)
    ep.other = other
    results = []
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        for name in args.attacks or ATTACKS:
            for stream in {"both": (False, True), "true": (True,), "false": (False,)}[args.stream]:
                if name in STREAM_ONLY and not stream:
                    continue
                before = len(other.seen)
                ep.counts.clear()
                ep.check_attack = name if args.at_start else None
                res = run_attack(ep, name, stream, Path(tmp), args.rows, args.per_worker)
                res["other_origin_auth"] = sum(r["auth"] for r in other.seen[before:])
                results.append(res)
                print(json.dumps(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(
        f"\n{'attack':<20} {'stream':<6} {'rc':>3} {'wall s':>7} {'runner MB':>9} {'worker MB':>9}  outcome"
    )
    for r in results:
        outcome = ", ".join(
            [f"{r['traj']} trajectories"] * bool(r["traj"])
            + [f"discarded {'/'.join(r['disc'])}"] * bool(r["disc"])
            + [f"failed {'/'.join(r['fail'])}"] * bool(r["fail"])
            + [f"{r['skipped_budget']} left for resume"] * bool(r["skipped_budget"])
        )
        refused_at_start = r["rc"] == 2 and args.at_start and not r["rows_ended"]
        flags = (
            ""
            if r["once"]
            else " (the start check refused: no row ran)"
            if refused_at_start
            else " ROWS NOT ENDED ONCE"
        )
        flags += " KEY LEAKED" if r["leak"] else ""
        flags += " KEY SENT TO ANOTHER ORIGIN" if r["other_origin_auth"] else ""
        print(
            f"{r['attack']:<20} {str(r['stream']).lower():<6} {r['rc']:>3} {r['wall_s']:>7} "
            f"{r['runner_mb']:>9} {r['worker_mb']:>9}  {outcome}{flags}"
        )
    # At the start check a hostile endpoint is exit 2 before any row starts (no row ends: none should).
    fine_rc = (0, 2, 6) if args.at_start else (0, 6)
    bad = [
        r
        for r in results
        if not (r["once"] or r["rc"] == 2 and args.at_start and not r["rows_ended"])
        or r["leak"]
        or r["other_origin_auth"]
        or r["rc"] not in fine_rc
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
