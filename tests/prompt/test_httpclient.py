"""batchrun/prompt/httpclient.py, the model calls' HTTP/1.1 client, over real sockets.

Against the fake endpoint (real HTTP, also served over TLS) and against small scripted servers
written here for what a real server does only sometimes: closing idle connections, chunked and
compressed bodies, a stream that stalls, a proxy from the environment.
"""

from __future__ import annotations

import gzip
import json
import socket
import socketserver
import subprocess
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import skip_or_fail

from batchrun.fakes.fake_model import FakeModelServer, respond, stream_chunks
from batchrun.prompt import httpclient
from batchrun.prompt.llm import (
    MAX_TOOL_CALLS_PER_REPLY,
    LLMClient,
    LLMConfig,
    LLMError,
    Usage,
    retry_after_s,
)

USER = [{"role": "user", "content": "say hi [calls:0]"}]


# ----------------------------------------------------------------------------- a scripted server


class Request:
    def __init__(self, line: str, headers: dict[str, str], body: bytes):
        self.line, self.headers, self.body = line, headers, body
        self.method, self.target = line.split()[:2]


def read_request(rfile) -> Request | None:
    """One request from a client (None when it closed the connection)."""
    line = rfile.readline()
    if not line:
        return None
    headers = {}
    while True:
        h = rfile.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = rfile.read(int(headers.get("content-length", 0)))
    return Request(line.decode("latin-1").strip(), headers, body)


class Scripted:
    """A TCP server whose every connection runs ``serve(conn_no, sock, rfile, server)`` on its own thread."""

    def __init__(self, serve: Callable):
        self.serve = serve
        self.connections = 0
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                n = self.connections
            threading.Thread(target=self._run, args=(n, conn), daemon=True).start()

    def _run(self, n, conn):
        rfile = conn.makefile("rb")
        try:
            self.serve(n, conn, rfile, self)
        except OSError:
            pass
        finally:
            rfile.close()
            conn.close()

    def next_request(self, rfile) -> Request | None:
        req = read_request(rfile)
        if req is not None:
            with self.lock:
                self.requests.append(req)
        return req

    def close(self):
        self._stop = True
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def answer(status: int, body: bytes, headers: dict[str, str] | None = None, chunks: int = 0) -> bytes:
    """An HTTP/1.1 response: Content-Length, or ``chunks`` > 0 chunked pieces (with an extension and a trailer)."""
    head = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    if not chunks:
        head.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body
    head.append("Transfer-Encoding: chunked")
    size = max(1, -(-len(body) // chunks))
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    out = ("\r\n".join(head) + "\r\n\r\n").encode()
    for p in pieces:
        out += f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n"
    return out + b"0\r\nX-Trailer: 1\r\n\r\n"


def completion(content: str = "hello there") -> dict:
    return {
        "id": "c1",
        "model": "scripted",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def keep_answering(payload: bytes, **kw) -> Callable:
    """A server that answers every request on a connection with the same response."""

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, payload, {"Content-Type": "application/json"}, **kw))

    return serve


def llm(base_url: str, **kw) -> LLMClient:
    kw.setdefault("max_retries", 0)
    kw.setdefault("request_timeout_s", 5)
    return LLMClient(LLMConfig(model="m", base_url=base_url, api_key=kw.pop("api_key", "k"), **kw))


# ----------------------------------------------------------------------------- keep-alive


def test_calls_reuse_one_keep_alive_connection():
    with Scripted(keep_answering(json.dumps(completion()).encode())) as srv:
        client = llm(srv.base_url)
        for _ in range(5):
            assert client.chat(USER, []).content == "hello there"
        assert srv.connections == 1 and len(srv.requests) == 5
        assert client._http.stats == {"opened": 1, "reused": 4, "resent": 0}


def test_threads_share_the_pool_one_connection_each_at_most():
    with FakeModelServer(latency_s=0.05) as srv:
        client = llm(srv.base_url)
        errors = []

        def prompt(i):
            try:
                for k in range(4):
                    client.chat([{"role": "user", "content": f"thread {i} call {k} [calls:0]"}], [])
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=prompt, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        stats = client._http.stats
        assert stats["opened"] <= 40 and stats["opened"] + stats["reused"] == 160
        assert srv.stats()["requests"] == 160


def test_a_connection_the_server_closed_while_idle_is_replaced_without_a_retry():
    """The server answers once per connection and closes it later (its idle timeout, no Connection: close)."""

    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(answer(200, json.dumps(completion(f"conn {n}")).encode()))
        time.sleep(0.2)  # then the server's idle timeout closes the connection

    with Scripted(serve) as srv:
        client = llm(srv.base_url, max_retries=0)
        usage = Usage()
        assert client.chat(USER, [], usage=usage).content == "conn 1"
        time.sleep(0.5)
        assert client.chat(USER, [], usage=usage).content == "conn 2"
        assert usage.retries == 0 and usage.requests == 2
        assert client._http.stats["resent"] == 0 and srv.connections == 2


def test_close_closes_the_pooled_connections():
    """A run's start checks each make a client and close it: a connection they left open (urllib3 2
    only forgets the pools, and the pool could never be collected) was two open sockets per run."""
    closed = threading.Event()

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, b"{}"))
        closed.set()  # the client closed its end

    with Scripted(serve) as srv:
        client = httpclient.Client()
        client.request("GET", srv.base_url + "/x")
        client.close()
        assert closed.wait(5)


def test_idle_connections_expire_before_the_servers_keep_alive_timeout():
    """``Keep-Alive: timeout=1.5``: dropped after 0.5 s idle, a second before the server would."""

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, b"{}", {"Keep-Alive": "timeout=1.5, max=100"}))

    with Scripted(serve) as srv:
        client = httpclient.Client()
        client.request("GET", srv.base_url + "/x")
        client.request("GET", srv.base_url + "/x")
        assert srv.connections == 1
        time.sleep(0.6)
        client.request("GET", srv.base_url + "/x")
        assert srv.connections == 2


def _drip_the_head(n, conn, rfile, server):
    """Connection 1 answers every request at once; any other reads one and drips its head forever."""
    if n == 1:
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, b"{}"))
        return
    server.next_request(rfile)
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 150:  # ~8 s, then the server closes
        conn.sendall(bytes([byte]))
        time.sleep(0.05)


def test_the_deadline_watchdog_keeps_no_ended_request_and_still_ends_an_earlier_deadline():
    """Ended requests leave nothing in the watchdog's heap, and a request whose deadline is earlier
    than a waiting one's wakes the watchdog: its dripped head ends at its own deadline."""
    with Scripted(_drip_the_head) as srv:
        client = httpclient.Client()
        for _ in range(300):
            client.request("GET", srv.base_url + "/fast", timeout_s=60)
        assert len(httpclient._WATCHDOG._heap) <= 1  # the last request's entry at most

        late = {}

        def slow(timeout_s):
            began = time.monotonic()
            try:
                httpclient.Client().request("GET", srv.base_url + "/slow", timeout_s=timeout_s)
            except httpclient.RequestTimeout:
                late[timeout_s] = time.monotonic() - began

        waiting = threading.Thread(target=slow, args=(4.0,))
        waiting.start()
        time.sleep(0.3)  # its deadline is the watchdog's earliest now
        slow(0.6)
        assert 0.5 <= late[0.6] < 2.0, late
        waiting.join()
        assert 3.9 <= late[4.0] < 6.0, late


def _no_idle_check(monkeypatch):
    """Lose the race the idle check usually wins: the server's close arrives after the check."""
    import urllib3.connectionpool

    monkeypatch.setattr(urllib3.connectionpool, "is_connection_dropped", lambda conn: False)


def test_a_request_that_could_not_be_written_is_a_counted_retry_on_a_new_connection(monkeypatch):
    """The server reset the idle connection: writing fails. urllib3 cannot tell how much was written,
    so nothing is resent silently: the model client's retry (counted) sends it on a new connection."""
    _no_idle_check(monkeypatch)

    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(answer(200, json.dumps(completion(f"conn {n}")).encode()))
        if n == 1:  # reset (RST, not FIN): the next write on it fails
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return
        server.next_request(rfile)

    with Scripted(serve) as srv:
        client = llm(srv.base_url, max_retries=1)
        usage = Usage()
        assert client.chat(USER, [], usage=usage).content == "conn 1"
        time.sleep(0.2)
        assert client.chat(USER, [], usage=usage).content == "conn 2"
        assert usage.retries == 1 and usage.requests == 3
        assert client._http.stats["resent"] == 0
        assert len(srv.requests) == 2  # each request reached the server once


def _drops_its_second_request(n, conn, rfile, server):
    """Connection 1 answers one request, reads the next and closes unanswered; later ones answer all."""
    server.next_request(rfile)
    conn.sendall(answer(200, json.dumps(completion(f"conn {n}")).encode()))
    if n == 1:
        server.next_request(rfile)
        return
    while server.next_request(rfile) is not None:
        conn.sendall(answer(200, json.dumps(completion(f"conn {n}")).encode()))


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_post_the_server_may_have_received_is_a_counted_retry_not_a_silent_resend(monkeypatch, max_retries):
    """Written in full, then the connection ends with no byte of an answer: the model may have run."""
    _no_idle_check(monkeypatch)
    with Scripted(_drops_its_second_request) as srv:
        client = llm(srv.base_url, max_retries=max_retries)
        assert client.chat(USER, []).content == "conn 1"
        usage = Usage()
        if max_retries == 0:
            with pytest.raises(LLMError) as info:
                client.chat(USER, [], usage=usage)
            assert info.value.error_class == "connection"
            assert "closed the connection without answering" in str(info.value)
            assert len(srv.requests) == 2 and usage.requests == 1
        else:
            assert client.chat(USER, [], usage=usage).content == "conn 2"
            assert usage.retries == 1 and usage.requests == 2  # the dropped request counts
            assert len(srv.requests) == 3
        assert client._http.stats["resent"] == 0


def test_a_get_the_server_dropped_unanswered_is_sent_again_once(monkeypatch):
    _no_idle_check(monkeypatch)

    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(answer(200, b'{"n": %d}' % n))
        if n == 1:
            server.next_request(rfile)  # then closes unanswered
            return
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, b'{"n": %d}' % n))

    with Scripted(serve) as srv:
        client = httpclient.Client()
        assert client.request("GET", srv.base_url + "/models").json() == {"n": 1}
        time.sleep(0.1)
        assert client.request("GET", srv.base_url + "/models").json() == {"n": 2}
        assert client.stats["resent"] == 1 and len(srv.requests) == 3


# ----------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("chunks", [0, 1, 7])
def test_content_length_and_chunked_bodies(chunks):
    payload = json.dumps(completion("é" * 3000)).encode()  # multi-byte characters across chunk edges
    with Scripted(keep_answering(payload, chunks=chunks)) as srv:
        client = llm(srv.base_url)
        for _ in range(3):  # the connection stays usable after each framing
            assert client.chat(USER, []).content == "é" * 3000
        assert srv.connections == 1


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate"])
def test_compressed_bodies_are_decoded(encoding):
    payload = json.dumps(completion("compressed " * 100)).encode()
    if encoding == "gzip":
        data = gzip.compress(payload)
    elif encoding == "deflate":
        data = zlib.compress(payload)
    else:
        obj = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        data = obj.compress(payload) + obj.flush()
    sent = "gzip" if encoding == "gzip" else "deflate"

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, data, {"Content-Encoding": sent}, chunks=3))

    with Scripted(serve) as srv:
        assert llm(srv.base_url).chat(USER, []).content == "compressed " * 100
        assert srv.requests[0].headers["accept-encoding"] == "gzip, deflate"


def test_a_body_read_until_the_server_closes():
    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        body = json.dumps(completion("until close")).encode()
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body)

    with Scripted(serve) as srv:
        client = llm(srv.base_url)
        assert client.chat(USER, []).content == "until close"
        assert client.chat(USER, []).content == "until close"
        assert srv.connections == 2  # HTTP/1.0 without keep-alive: never reused


def test_invalid_json_is_a_bad_response():
    with Scripted(keep_answering(b"<html>Bad gateway</html>", chunks=2)) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url).chat(USER, [])
    assert info.value.error_class == "bad_response"


def test_a_body_cut_short_is_a_connection_error():
    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"choices": [')

    with Scripted(serve) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url).chat(USER, [])
    assert info.value.error_class == "connection"
    assert "mid-answer" in str(info.value)


# ----------------------------------------------------------------------------- what is sent


@pytest.mark.parametrize("prefix", ["/api/v1", "/api/v1/"])
def test_base_url_path_prefix_and_headers(prefix):
    with Scripted(keep_answering(json.dumps(completion()).encode())) as srv:
        base = f"http://127.0.0.1:{srv.port}{prefix}"
        llm(base, api_key="sk-test-123", temperature=0.5).chat(USER, [])
        llm(base, api_key=None).chat(USER, [])
    keyed, keyless = srv.requests
    assert keyed.line == "POST /api/v1/chat/completions HTTP/1.1"
    assert keyed.headers["host"] == f"127.0.0.1:{srv.port}"
    assert keyed.headers["authorization"] == "Bearer sk-test-123"
    assert keyless.headers["authorization"] == "Bearer no-key"
    assert keyed.headers["content-type"] == "application/json"
    body = json.loads(keyed.body)
    assert body == {"model": "m", "messages": USER, "temperature": 0.5}


def test_openai_organization_and_project_from_the_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_ORG_ID", "org-1")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-2")
    with Scripted(keep_answering(json.dumps(completion()).encode())) as srv:
        llm(srv.base_url).chat(USER, [])
    headers = srv.requests[0].headers
    assert headers["openai-organization"] == "org-1" and headers["openai-project"] == "proj-2"


# ----------------------------------------------------------------------------- status errors and retries


def test_429_with_retry_after_seconds_is_waited_out():
    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            if len(server.requests) == 1:
                err = {"error": {"message": "slow down", "type": "rate_limit", "code": 429}}
                conn.sendall(answer(429, json.dumps(err).encode(), {"Retry-After": "1"}))
            else:
                conn.sendall(answer(200, json.dumps(completion()).encode()))

    with Scripted(serve) as srv:
        usage = Usage()
        started = time.monotonic()
        turn = llm(srv.base_url).chat(USER, [], usage=usage)
        waited = time.monotonic() - started
    assert turn.content == "hello there"
    assert usage.rate_limited == 1 and waited >= 0.9


@pytest.mark.parametrize(
    ("headers", "expected"),
    [({"Retry-After": "2"}, 2.0), ({"retry-after-ms": "1500"}, 1.5), ({"Retry-After": "soon"}, None)],
)
def test_retry_after_is_read_from_the_answers_headers(headers, expected):
    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(answer(429, b'{"error": {"message": "x"}}', headers))

    with Scripted(serve) as srv:
        with pytest.raises(httpclient.StatusError) as info:
            httpclient.Client().request("POST", srv.base_url + "/chat/completions", body=b"{}")
    assert info.value.status_code == 429 and info.value.body == {"error": {"message": "x"}}
    assert retry_after_s(info.value) == expected


def test_retry_after_as_an_http_date():
    import email.utils

    when = email.utils.formatdate(time.time() + 30, usegmt=True)

    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(answer(503, b"upstream down", {"Retry-After": when}))

    with Scripted(serve) as srv:
        with pytest.raises(httpclient.StatusError) as info:
            httpclient.Client().request("GET", srv.base_url + "/x")
    assert 25 < retry_after_s(info.value) <= 31
    assert info.value.body == "upstream down"


def test_a_5xx_is_retried_then_answers():
    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            if len(server.requests) < 3:
                conn.sendall(answer(503, b'{"error": {"message": "overloaded"}}'))
            else:
                conn.sendall(answer(200, json.dumps(completion("third time")).encode()))

    with Scripted(serve) as srv:
        usage = Usage()
        turn = llm(srv.base_url, max_retries=3).chat(USER, [], usage=usage)
    assert turn.content == "third time"
    assert usage.retries == 2 and usage.requests == 3


def test_connection_refused():
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(httpclient.ConnectError, match="connection refused"):
        httpclient.Client().request("GET", f"http://127.0.0.1:{port}/v1/models")
    with pytest.raises(LLMError) as info:
        llm(f"http://127.0.0.1:{port}/v1").chat(USER, [])
    assert info.value.error_class == "connection"
    assert str(info.value) == (
        f"cannot reach http://127.0.0.1:{port}/v1: cannot connect to http://127.0.0.1:{port}: connection refused"
    )


def test_a_307_is_followed_with_the_same_body_and_other_redirects_are_errors():
    def serve(n, conn, rfile, server):
        while (req := server.next_request(rfile)) is not None:
            if req.target == "/v1/chat/completions":
                conn.sendall(answer(307, b"", {"Location": "/v2/chat/completions"}))
            elif req.target == "/v2/chat/completions":
                conn.sendall(answer(200, json.dumps(completion("moved")).encode()))
            else:
                conn.sendall(answer(301, b"", {"Location": "https://elsewhere.example/v1"}))

    with Scripted(serve) as srv:
        assert llm(srv.base_url).chat(USER, []).content == "moved"
        assert srv.requests[1].body == srv.requests[0].body and srv.requests[1].method == "POST"
        with pytest.raises(LLMError) as info:
            llm(f"http://127.0.0.1:{srv.port}/old").chat(USER, [])
    assert info.value.error_class == "http_301"
    assert "redirected to https://elsewhere.example/v1" in str(info.value)


def test_a_307_that_leaves_the_origin_does_not_carry_the_api_key():
    """A hostile endpoint redirecting to a host of its choosing must not get the key sent there; a
    redirect within the origin keeps it (the same server)."""

    def elsewhere(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, json.dumps(completion("elsewhere")).encode()))

    with Scripted(elsewhere) as other:
        for location in (
            f"http://127.0.0.1:{other.port}/v1/chat/completions",  # another port: another origin
            f"http://localhost:{other.port}/v1/chat/completions",
            f"//127.0.0.1:{other.port}/v1/chat/completions",
            f"http://user:pw@127.0.0.1:{other.port}/v1/chat/completions",
        ):

            def serve(n, conn, rfile, server, location=location):
                while server.next_request(rfile) is not None:
                    conn.sendall(answer(307, b"", {"Location": location}))

            with Scripted(serve) as srv:
                assert llm(srv.base_url, api_key="sk-must-stay-home").chat(USER, []).content == "elsewhere"
            assert srv.requests[0].headers["authorization"] == "Bearer sk-must-stay-home"
            assert "authorization" not in other.requests[-1].headers, location
            assert "sk-must-stay-home" not in other.requests[-1].line + str(other.requests[-1].headers)

    def within(n, conn, rfile, server):
        while (req := server.next_request(rfile)) is not None:
            moved = req.target == "/v2/chat/completions"
            conn.sendall(
                answer(200, json.dumps(completion("home")).encode())
                if moved
                else answer(307, b"", {"Location": "/v2/chat/completions"})
            )

    with Scripted(within) as srv:
        assert llm(srv.base_url, api_key="sk-home").chat(USER, []).content == "home"
    assert [r.headers.get("authorization") for r in srv.requests] == ["Bearer sk-home"] * 2


# ----------------------------------------------------------------------------- streaming


def _sse(events: list[dict]) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def test_a_stream_read_as_it_arrives_gives_the_plain_turn():
    """Events in separate chunks, with pauses, \\r\\n line ends and a comment: the same turn as without streaming."""
    body = {"model": "m", "messages": [{"role": "user", "content": "stream me [calls:1]"}], "tools": []}
    done = respond(body)
    events = _sse(stream_chunks(done, include_usage=True))

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for i, event in enumerate([b": keep-alive\r\n\r\n", *events]):
                event = event.replace(b"\n", b"\r\n") if i % 2 else event
                conn.sendall(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                time.sleep(0.01)
            conn.sendall(b"0\r\n\r\n")

    with Scripted(serve) as srv:
        client = llm(srv.base_url, stream=True)
        turn = client.chat(body["messages"], [])
        again = client.chat(body["messages"], [])
    message = done["choices"][0]["message"]
    assert turn.content == message["content"] and turn.reasoning == message["reasoning_content"]
    assert turn.usage == done["usage"] and again == turn
    assert srv.connections == 1  # the stream was read to its end: the connection was reused


def test_a_stream_that_stalls_mid_answer_times_out():
    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        first = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
        conn.sendall(f"{len(first):x}\r\n".encode() + first + b"\r\n")
        time.sleep(10)

    with Scripted(serve) as srv:
        started = time.monotonic()
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=True, request_timeout_s=1.0).chat(USER, [])
        took = time.monotonic() - started
    assert info.value.error_class == "timeout"
    assert "mid-answer" in str(info.value)
    assert took < 5


def test_an_error_status_on_a_streamed_call_is_a_status_error():
    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(answer(400, b'{"error": {"message": "bad tools", "code": 400}}', chunks=2))

    with Scripted(serve) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=True).chat(USER, [])
    assert info.value.error_class == "http_400" and str(info.value) == "HTTP 400: bad tools"


def test_a_gzip_stream_is_decoded_as_it_arrives():
    body = {"model": "m", "messages": [{"role": "user", "content": "zipped [calls:0]"}]}
    data = b"".join(_sse(stream_chunks(respond(body), include_usage=True)))
    packed = gzip.compress(data)

    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(answer(200, packed, {"Content-Encoding": "gzip"}, chunks=5))

    with Scripted(serve) as srv:
        turn = llm(srv.base_url, stream=True).chat(body["messages"], [])
    assert turn.content == respond(body)["choices"][0]["message"]["content"]


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    event = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


CUT = [
    _chunk({"role": "assistant", "reasoning_content": "thinking"}),
    _chunk({"content": "The answer is the sum of"}),
]
WHOLE = [*CUT, _chunk({"content": " two numbers."}), _chunk({}, "stop")]
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


def _sse_server(events_of: Callable[[int], list[bytes]], framing: str) -> Callable:
    """Each request (the n-th, from 1) answered with ``events_of(n)`` as a stream framed by ``framing``:
    ``close`` (the body ends when the connection closes) or ``chunked`` (it ends with the last chunk)."""
    count = {"n": 0}

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            count["n"] += 1
            events = events_of(count["n"])
            if framing == "close":
                conn.sendall(SSE_HEAD + b"Connection: close\r\n\r\n" + b"".join(events))
                return
            conn.sendall(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
            for event in events:
                conn.sendall(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            conn.sendall(b"0\r\n\r\n")

    return serve


@pytest.mark.parametrize("framing", ["close", "chunked"])
def test_a_stream_cut_before_its_finish_reason_is_retried_and_then_fails_as_a_connection_error(framing):
    """No finish_reason and no [DONE]: the reply was cut, never an answer. Retried like a body cut short."""
    with Scripted(_sse_server(lambda n: CUT, framing)) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=True, max_retries=2).chat(USER, [])
    assert info.value.error_class == "connection"
    assert "ended mid-answer (no finish_reason and no [DONE]" in str(info.value)
    assert len(srv.requests) == 3  # 1 try + 2 retries


@pytest.mark.parametrize("framing", ["close", "chunked"])
def test_a_stream_cut_once_is_asked_again_and_the_whole_reply_kept(framing):
    with Scripted(_sse_server(lambda n: CUT if n == 1 else WHOLE, framing)) as srv:
        turn = llm(srv.base_url, stream=True, max_retries=1).chat(USER, [])
    assert (turn.content, turn.finish_reason) == ("The answer is the sum of two numbers.", "stop")
    assert len(srv.requests) == 2


@pytest.mark.parametrize(
    "ending",
    [
        [_chunk({}, "stop"), b"data: [DONE]\n\n"],  # OpenAI, llama.cpp, vLLM, LiteLLM
        [_chunk({}, "stop")],  # ik_llama.cpp, older llama.cpp: no [DONE]
        [_chunk({}, "stop"), b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'],  # usage last
    ],
)
@pytest.mark.parametrize("framing", ["close", "chunked"])
def test_a_stream_that_gave_its_finish_reason_is_whole_with_or_without_done(ending, framing):
    with Scripted(_sse_server(lambda n: [*CUT, *ending], framing)) as srv:
        turn = llm(srv.base_url, stream=True).chat(USER, [])
    assert (turn.content, turn.reasoning, turn.finish_reason) == (
        "The answer is the sum of",
        "thinking",
        "stop",
    )


def test_a_stream_ended_by_done_without_a_finish_reason_is_a_reply_that_does_not_say_it_finished():
    """[DONE] is an end the server chose: not retried; the turn's finish_reason is None, which the
    agent loop does not take as a finished answer (tests/prompt/test_loop.py)."""
    with Scripted(_sse_server(lambda n: [*CUT, b"data: [DONE]\n\n"], "chunked")) as srv:
        turn = llm(srv.base_url, stream=True, max_retries=2).chat(USER, [])
    assert (turn.content, turn.finish_reason) == ("The answer is the sum of", None)
    assert len(srv.requests) == 1


@pytest.mark.parametrize(
    ("event", "tries", "error_class"),
    [
        (b'data: {"error": {"message": "upstream went away", "code": 502}}\n\n', 3, "http_502"),
        (b'data: {"error": {"message": "upstream went away"}}\n\n', 3, "stream_error"),
        (b'data: {"error": {"message": "bad field", "code": 400}}\n\n', 1, "http_400"),
    ],
)
def test_an_error_event_mid_stream_is_asked_again_when_the_server_failed(event, tries, error_class):
    """Like a 5xx before the answer began: the server's failure is retried, the request's is final."""
    with Scripted(_sse_server(lambda n: [*CUT, event], "close")) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=True, max_retries=2).chat(USER, [])
    assert info.value.error_class == error_class
    assert len(srv.requests) == tries
    with Scripted(_sse_server(lambda n: [*CUT, event] if n == 1 else WHOLE, "close")) as srv:
        if tries == 1:
            with pytest.raises(LLMError):
                llm(srv.base_url, stream=True, max_retries=2).chat(USER, [])
        else:
            assert llm(srv.base_url, stream=True, max_retries=2).chat(USER, []).finish_reason == "stop"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8"])
def test_a_plain_json_reply_to_a_streamed_request_is_that_reply(content_type):
    """A server or proxy that does not stream answers with the chat.completion body: the same answer."""
    body = completion("done")
    body["choices"][0]["message"]["reasoning_content"] = "r"

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, json.dumps(body).encode(), {"Content-Type": content_type}, chunks=2))

    with Scripted(serve) as srv:
        turn = llm(srv.base_url, stream=True).chat(USER, [])
    assert (turn.content, turn.reasoning, turn.finish_reason) == ("done", "r", "stop")
    assert turn.usage["completion_tokens"] == 2
    assert json.loads(srv.requests[0].body)["stream"] is True


def test_server_sent_events_labelled_as_json_are_still_read_as_a_stream():
    events = b"".join(WHOLE) + b"data: [DONE]\n\n"

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, events, {"Content-Type": "application/json"}))

    with Scripted(serve) as srv:
        turn = llm(srv.base_url, stream=True).chat(USER, [])
    assert (turn.content, turn.finish_reason) == ("The answer is the sum of two numbers.", "stop")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("finish", ["error", "abort"])
def test_a_reply_whose_finish_reason_says_the_generation_failed_is_retried_then_a_bad_response(
    stream, finish
):
    body = completion("The answer is")
    body["choices"][0]["finish_reason"] = finish
    events = [
        _chunk({"role": "assistant", "content": "The answer is"}),
        _chunk({}, finish),
        b"data: [DONE]\n\n",
    ]
    serve = _sse_server(lambda n: events, "chunked") if stream else keep_answering(json.dumps(body).encode())
    with Scripted(serve) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=stream, max_retries=1).chat(USER, [])
    assert info.value.error_class == "bad_response"
    assert f"finish_reason '{finish}': the generation failed" in str(info.value)
    assert len(srv.requests) == 2


def test_a_streamed_tool_call_whose_index_is_not_an_integer_is_a_bad_response():
    call = {"index": "1", "id": "b", "function": {"name": "terminal", "arguments": "{}"}}
    events = [_chunk({"tool_calls": [{**call, "index": 0, "id": "a"}]}), _chunk({"tool_calls": [call]})]
    with Scripted(_sse_server(lambda n: [*events, _chunk({}, "tool_calls")], "chunked")) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=True).chat(USER, [])
    assert info.value.error_class == "bad_response" and "index '1'" in str(info.value)


@pytest.mark.parametrize("stream", [False, True])
def test_an_endpoints_error_message_is_cut_before_it_reaches_the_records(stream):
    """A 400 (or a streamed error event) whose message is a megabyte: that message became the
    LLMError's text whole, so every failed prompt wrote a megabyte (4 MiB with a stream's line bound)
    to failed.jsonl and ran the secret filter over it: an endpoint could fill the disk."""
    error = {"error": {"message": "no. " * 250_000, "code": 400}}
    if stream:
        serve = _sse_server(lambda n: [b"data: " + json.dumps(error).encode() + b"\n\n"], "chunked")
    else:

        def serve(n, conn, rfile, server):
            while server.next_request(rfile) is not None:
                conn.sendall(answer(400, json.dumps(error).encode(), {"Content-Type": "application/json"}))

    with Scripted(serve) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=stream).chat(USER, [])
    assert info.value.error_class == "http_400"
    assert str(info.value).startswith("HTTP 400: no. no. ")
    assert len(str(info.value)) < 2000


def _shaped(message: dict) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def _event(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


# Valid JSON of the wrong shape where a list or an object belongs. Each one was a TypeError,
# AttributeError or KeyError out of the parser: the prompt failed as the runner's own bug ("internal"),
# never retried, and past the start check, which catches LLMError only.
WRONG_SHAPES = {
    "choices a number": json.dumps({"choices": 5}),
    "choices an object": json.dumps({"choices": {"a": 1}}),
    "tool_calls a number": json.dumps(_shaped({"content": "x", "tool_calls": 5})),
    "function a string": json.dumps(_shaped({"content": "", "tool_calls": [{"id": "a", "function": "f"}]})),
    # A call that is not an object was dropped: its reply, whose finish_reason said stop, was kept as
    # a completed sample with no call in it.
    "a tool call a string": json.dumps(_shaped({"content": "Done.", "tool_calls": ["terminal"]})),
    "a tool call a number": json.dumps(_shaped({"content": "Done.", "tool_calls": [{"id": "a"}, 7]})),
    # An id of another type was kept as Python's str() of it ("{'a': 1}") in the sample.
    "a call's id an object": json.dumps(
        _shaped({"content": "", "tool_calls": [{"id": {"a": 1}, "function": {"name": "terminal"}}]})
    ),
}
# More calls than any model's reply can hold (a body of 20,001 empty objects is 60 KB): each call became
# a saved call and a "not run" answer, so a million of them took a worker to 2.3 GB and a 341 MB line.
WRONG_SHAPES["more calls than any reply holds"] = json.dumps(
    _shaped({"content": "", "tool_calls": [{}] * (MAX_TOOL_CALLS_PER_REPLY + 1)})
)
WRONG_STREAMS = {
    "choices a number": _event({"choices": 7}),
    "delta a string": _event({"choices": [{"index": 0, "delta": "abc", "finish_reason": "stop"}]}),
    "tool_calls a number": _chunk({"tool_calls": 5}, "stop"),
    "function a string": _chunk({"tool_calls": [{"index": 0, "function": "f"}]}, "stop"),
    "name a number": _chunk({"tool_calls": [{"index": 0, "function": {"name": 5}}]}, "stop"),
    "a tool call a string": _chunk({"tool_calls": ["terminal"]}, "stop"),
    "a call's id a list": _chunk(
        {"tool_calls": [{"index": 0, "id": [1], "function": {"name": "terminal"}}]}, "tool_calls"
    ),
    "more calls than any reply holds": _chunk(
        {"tool_calls": [{"index": i} for i in range(MAX_TOOL_CALLS_PER_REPLY + 1)]}, "tool_calls"
    ),
    "reasoning_details a number": _chunk({"reasoning_details": 5}, "stop"),
}


@pytest.mark.parametrize("body", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_a_reply_of_the_wrong_shape_is_a_bad_response(body):
    with Scripted(keep_answering(body.encode())) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, max_retries=1).chat(USER, [])
    assert info.value.error_class == "bad_response", info.value
    assert len(srv.requests) == 2  # retried like any bad response


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_calls_integer_id_is_kept_as_its_digits(stream):
    calls = [{"id": 7, "function": {"name": "terminal", "arguments": "{}"}}]
    if stream:
        server = _sse_server(
            lambda n: [_chunk({"tool_calls": [{"index": 0, **calls[0]}]}, "tool_calls"), b"data: [DONE]\n\n"],
            "chunked",
        )
    else:
        server = keep_answering(json.dumps(_shaped({"content": "", "tool_calls": calls})).encode())
    with Scripted(server) as srv:
        turn = llm(srv.base_url, stream=stream, max_retries=0).chat(USER, [])
    assert [c.id for c in turn.tool_calls] == ["7"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_reply_of_as_many_calls_as_a_reply_can_hold_is_read(stream):
    calls = [
        {"id": f"c{i}", "function": {"name": "terminal", "arguments": "{}"}}
        for i in range(MAX_TOOL_CALLS_PER_REPLY)
    ]
    if stream:
        deltas = [{"index": i, **c} for i, c in enumerate(calls)]
        server = _sse_server(
            lambda n: [_chunk({"tool_calls": deltas}, "tool_calls"), b"data: [DONE]\n\n"], "chunked"
        )
    else:
        server = keep_answering(json.dumps(_shaped({"content": "", "tool_calls": calls})).encode())
    with Scripted(server) as srv:
        turn = llm(srv.base_url, stream=stream, max_retries=0).chat(USER, [])
    assert [c.id for c in turn.tool_calls] == [f"c{i}" for i in range(MAX_TOOL_CALLS_PER_REPLY)]


@pytest.mark.parametrize("event", WRONG_STREAMS.values(), ids=WRONG_STREAMS.keys())
def test_a_stream_of_the_wrong_shape_is_a_bad_response(event):
    with Scripted(_sse_server(lambda n: [event, b"data: [DONE]\n\n"], "chunked")) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=True, max_retries=1).chat(USER, [])
    assert info.value.error_class == "bad_response", info.value
    assert len(srv.requests) == 2


# ----------------------------------------------------------------------------- proxies


class Proxy:
    """A tiny forward proxy: CONNECT tunnels, and absolute-form requests forwarded one at a time."""

    def __init__(self):
        self.lines: list[str] = []
        self.auth: list[str | None] = []
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                while (req := read_request(self.rfile)) is not None:
                    proxy.lines.append(req.line)
                    proxy.auth.append(req.headers.get("proxy-authorization"))
                    if req.method == "CONNECT":
                        host, port = req.target.rsplit(":", 1)
                        upstream = socket.create_connection((host, int(port)))
                        self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                        self._pipe(upstream)
                        return
                    url = req.target.split("://", 1)[1]
                    authority, _, path = url.partition("/")
                    host, port = authority.rsplit(":", 1)
                    with socket.create_connection((host, int(port))) as upstream:
                        head = [f"{req.method} /{path} HTTP/1.1"] + [
                            f"{k}: {v}" for k, v in req.headers.items() if k != "proxy-authorization"
                        ]
                        upstream.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + req.body)
                        up = upstream.makefile("rb")
                        status = up.readline()
                        headers = []
                        while (h := up.readline()) not in (b"\r\n", b""):
                            headers.append(h)
                        length = int(
                            next(h.split(b":")[1] for h in headers if h.lower().startswith(b"content-length"))
                        )
                        self.wfile.write(status + b"".join(headers) + b"\r\n" + up.read(length))

            def _pipe(self, upstream):
                def pump(src, dst):
                    try:
                        while data := src.recv(65536):
                            dst.sendall(data)
                    except OSError:
                        pass
                    finally:
                        for s in (src, dst):
                            try:
                                s.shutdown(socket.SHUT_RDWR)
                            except OSError:
                                pass

                t = threading.Thread(target=pump, args=(upstream, self.connection), daemon=True)
                t.start()
                pump(self.connection, upstream)
                t.join(5)
                upstream.close()

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    p = Proxy()
    yield p
    p.close()


def test_http_through_a_proxy_from_the_environment(proxy, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://user:p%40ss@"))
    with FakeModelServer() as srv:
        client = llm(srv.base_url)
        assert client.chat(USER, []).content
        assert client.chat(USER, []).content
        assert proxy.lines == [f"POST {srv.base_url}/chat/completions HTTP/1.1"] * 2
    assert proxy.auth[0] == "Basic dXNlcjpwQHNz"  # user:p@ss


def test_no_proxy_bypasses_the_proxy(proxy, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", "example.com,127.0.0.1")
    with FakeModelServer() as srv:
        assert llm(srv.base_url).chat(USER, []).content
    assert proxy.lines == []


def test_a_proxy_that_is_down_is_a_connection_error_without_its_password(monkeypatch):
    for name in ("HTTP_PROXY", "NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    monkeypatch.setenv("HTTP_PROXY", f"http://user:hunter2secret@127.0.0.1:{port}")
    with pytest.raises(LLMError) as info:
        llm("http://127.0.0.1:9/v1").chat(USER, [])
    assert info.value.error_class == "connection"
    assert f"through the proxy 127.0.0.1:{port}" in str(info.value)
    assert "hunter2secret" not in str(info.value) and "hunter2secret" not in repr(info.value.__cause__)


# ----------------------------------------------------------------------------- HTTPS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 and localhost it signed, made with the openssl CLI."""
    d = tmp_path_factory.mktemp("tls")
    ext = d / "server.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=batch-runner test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "2", "-extfile", "server.ext"],
    ]  # fmt: skip
    for args in steps:
        try:
            done = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
        except FileNotFoundError:
            skip_or_fail("the openssl command is needed to make the test certificates")
        assert done.returncode == 0, done.stderr
    return {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key"}


@pytest.fixture
def tls_server(tls_files):
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls_files["cert"], tls_files["key"])
    with FakeModelServer(ssl_context=ctx) as srv:
        yield srv


@pytest.fixture
def no_ca_env(monkeypatch):
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("variable", ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"])
def test_https_with_the_ca_from_the_environment(tls_server, tls_files, no_ca_env, monkeypatch, variable):
    monkeypatch.setenv(variable, str(tls_files["ca"]))
    client = llm(tls_server.base_url)
    assert tls_server.base_url.startswith("https://")
    assert client.chat(USER, []).content and client.chat(USER, []).content
    assert client._http.stats["opened"] == 1  # TLS connections are kept alive too


def test_https_refuses_a_certificate_no_trusted_ca_signed(tls_server, no_ca_env):
    with pytest.raises(LLMError) as info:
        llm(tls_server.base_url).chat(USER, [])
    assert info.value.error_class == "connection"
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)


def test_https_through_a_connect_tunnel(tls_server, tls_files, no_ca_env, proxy, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files["ca"]))
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    client = llm(tls_server.base_url)
    assert client.chat(USER, []).content and client.chat(USER, []).content
    assert [line.rsplit(" ", 1)[0] for line in proxy.lines] == [
        f"CONNECT 127.0.0.1:{tls_server.port}"
    ]  # one tunnel, kept alive
    assert tls_server.stats()["requests"] == 2


# ----------------------------------------------------------------------------- the worker starts without the SDK


def test_the_workers_forkserver_and_chat_path_import_no_openai_sdk():
    code = (
        "import sys\n"
        "from batchrun.fakes.fake_model import FakeModelServer\n"
        "import batchrun.run.worker_preload\n"  # what the workers' forkserver imports
        "from batchrun.prompt.llm import LLMClient, LLMConfig\n"
        "with FakeModelServer() as srv:\n"
        "    for stream in (False, True):\n"
        "        LLMClient(LLMConfig(model='m', base_url=srv.base_url, stream=stream)).chat(\n"
        "            [{'role': 'user', 'content': 'hi [calls:0]'}], [])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('openai', 'httpx', 'httpx2', 'h11', 'pydantic')))\n"
    )
    done = subprocess.run(
        [__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("interim", [1, 3])
def test_interim_answers_before_the_answer_are_skipped(interim):
    """A 103 Early Hints (a CDN's or a proxy's) was read as the answer: no body, a bad_response every
    try. Interim answers are skipped, each with its headers, on a connection then kept alive."""

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            hints = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" * interim
            conn.sendall(
                hints
                + b"HTTP/1.1 102 Processing\r\n\r\n"
                + answer(200, json.dumps(completion("ok")).encode())
            )

    with Scripted(serve) as srv:
        client = llm(srv.base_url, max_retries=0)
        assert client.chat(USER, []).content == "ok"
        assert client.chat(USER, []).content == "ok"
        assert srv.connections == 1


def test_endless_interim_answers_are_no_answer():
    def serve(n, conn, rfile, server):
        server.next_request(rfile)
        conn.sendall(b"HTTP/1.1 103 Early Hints\r\n\r\n" * 1000)

    with Scripted(serve) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, max_retries=0).chat(USER, [])
        assert info.value.error_class == "connection" and "did not answer with HTTP" in str(info.value)


@pytest.mark.parametrize("framing", ["close", "chunked"])
def test_a_streamed_line_that_is_not_utf8_is_a_bad_response_as_a_plain_body_is(framing):
    """Bytes no UTF-8 text holds were replaced by U+FFFD in a stream and kept as the model's words (a plain
    body with the same bytes was a bad_response): retried, then a failure, never altered text."""
    broken = [_chunk({"role": "assistant", "content": "caf\u00e9 "}), b'data: {"choices": [{"index": 0, "delta": {"content": "\xff\xfe"}}]}\n\n', _chunk({}, "stop")]  # fmt: skip
    with Scripted(_sse_server(lambda n: broken if n == 1 else WHOLE, framing)) as srv:
        turn = llm(srv.base_url, stream=True, max_retries=1).chat(USER, [])
    assert turn.content == "The answer is the sum of two numbers." and len(srv.requests) == 2
    with Scripted(_sse_server(lambda n: broken, framing)) as srv:
        with pytest.raises(LLMError) as info:
            llm(srv.base_url, stream=True, max_retries=0).chat(USER, [])
    assert info.value.error_class == "bad_response" and "not UTF-8" in str(info.value)
