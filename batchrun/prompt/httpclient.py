"""A small HTTP/1.1 client on the standard library, for the model calls (:class:`batchrun.prompt.llm.LLMClient`).

The ``openai`` SDK costs a worker ~0.75 s of CPU to import and ~1.7 ms of CPU per call (``httpx2``,
``h11``, its option handling); this client does what those calls need, and nothing else:

* **keep-alive**: idle connections are pooled per :class:`Client` (one per worker process) and shared
  by all its threads, most recently used first. A connection is used by one thread at a time, so a
  thread holds at most one; an idle one is dropped after :data:`KEEPALIVE_EXPIRY_S` (the SDK's
  5 s), or sooner when the server announced a shorter ``Keep-Alive: timeout``;
* **bodies**: ``Content-Length``, ``chunked`` and read-until-close; ``gzip`` and ``deflate``
  (asked for, like the SDK did); streamed bodies line by line (server-sent events);
* **timeouts**: ``timeout_s`` bounds the connect and every single read or write (a server that stalls
  mid-stream times out); the caller bounds the whole call;
* **HTTPS** with the system CA store, or ``SSL_CERT_FILE`` / ``REQUESTS_CA_BUNDLE`` / ``SSL_CERT_DIR``;
* **proxies** from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``, read
  once per client, as ``httpx`` did with ``trust_env``): a ``CONNECT`` tunnel for https, the
  absolute form for http. Only ``http://`` proxies;
* **redirects**: 307 and 308 are followed (same method and body; ``Authorization`` is dropped when
  the redirect leaves the origin); any other 3xx is a :class:`StatusError` naming the new location.

When is a request sent twice? A pooled connection may have been closed by the server while it
sat idle. Before reuse, an idle connection is checked (readable while idle means the server closed
it, or broke the protocol) and dropped. What remains is a race with a close in flight, and it ends in
one of two ways:

1. writing the request fails: the server cannot have received all of it, so it cannot have acted on
   it. The request is sent again once, on a new connection, whatever its method;
2. the request was written, and the connection ends before the first byte of an answer. The server
   may have received it and acted on it (a model call is paid for as soon as it runs). A GET
   (idempotent) is sent again once on a new connection; anything else raises
   :class:`ConnectionDropped`, and the caller decides: the model client counts it as one retry through
   its retry logic (limiter, back-off, ``--max_retries``, the prompt's usage counts the request), so a
   repeated POST is never silent. Once a byte of the answer was read, nothing is ever resent here.

Nothing this module raises carries a request header (the API key is one) or the request body:
messages name the host, the port and what went wrong.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

KEEPALIVE_EXPIRY_S = 5.0  # an idle pooled connection is dropped after this (the openai SDK's value)
MAX_IDLE_CONNECTIONS = 1024  # per origin; a worker has at most one connection per prompt thread
MAX_REDIRECTS = 5
MAX_HEADER_LINE = 65536
MAX_HEADERS = 200
READ_SIZE = 65536
DRAIN_S = 1.0  # after the caller stopped reading ([DONE]): how long the rest may take to arrive
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
ACCEPT_ENCODING = "gzip, deflate"


class HTTPError(Exception):
    """Base of what this client raises. Its text never holds a request header or the request body."""


class InvalidRequest(HTTPError, ValueError):
    """The request cannot be sent as given (a header with a line break, a bad URL, no such proxy kind)."""


class RequestTimeout(HTTPError):
    """Connecting, or one read or write, took longer than the request's ``timeout_s``."""


class TransportError(HTTPError):
    """No usable answer: the connection could not be made, dropped, or the answer is not HTTP."""


class ConnectError(TransportError):
    """The connection (or its TLS handshake, or the proxy tunnel) could not be made."""


class ConnectionDropped(TransportError):
    """The server closed the connection without a byte of an answer; the request may have reached it."""


class StatusError(HTTPError):
    """The server answered with a status of 300 or more (redirects not followed, see the module doc).

    ``body`` is the answer's JSON (any type) or, when it is not JSON, its stripped text; ``message``
    is ``Error code: <status>`` plus the error object's ``message`` when it has one (as the SDK said it);
    ``response`` holds the status and the headers (``Retry-After``, ``retry-after-ms``)."""

    def __init__(self, response: Response, body: Any):
        message = f"Error code: {response.status}"
        error = body.get("error", body) if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
            message += f" - {error['message']}"
        elif isinstance(body, str) and body:  # not JSON (a proxy's error page): its start
            message += f" - {body[:300]}"
        super().__init__(message)
        self.message = message
        self.response = response
        self.status_code = response.status
        self.body = body


class Response:
    """An answer: ``status``, ``headers`` (lower-case names), and its body, read whole or line by line."""

    def __init__(self, status: int, reason: str, headers: dict[str, str], url: str):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.url = url  # origin and path of the request (no credentials)
        self._content: bytes | None = None
        self._body: _Body | None = None  # set while the body is still to be read

    def __repr__(self) -> str:
        return f"<Response {self.status} from {self.url}>"

    def read(self) -> bytes:
        """The whole (decoded) body."""
        if self._content is None:
            body, self._body = self._body, None
            self._content = body.read_all() if body is not None else b""
        return self._content

    @property
    def text(self) -> str:
        return self.read().decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` (``JSONDecodeError``, ``UnicodeDecodeError``) when it is not."""
        return json.loads(self.read())

    def iter_lines(self) -> Iterator[str]:
        """The body's lines as they arrive, without their ends (``\\n``, ``\\r\\n`` or ``\\r``)."""
        body = self._body
        if body is None:  # already read whole
            for line in self.read().splitlines():
                yield line.decode("utf-8", "replace")
            return
        pending = b""
        while True:
            data = body.piece()
            if not data:
                break
            if pending:
                data = pending + data
            lines = data.splitlines(keepends=True)
            # An unfinished last line waits for more; so does one ending in \r (\n may follow).
            pending = lines.pop() if not lines[-1].endswith(b"\n") else b""
            for line in lines:
                yield line.rstrip(b"\r\n").decode("utf-8", "replace")
        for line in pending.splitlines():
            yield line.decode("utf-8", "replace")

    def close(self) -> None:
        """Done with the answer. A body read to its end, or whose rest arrives within :data:`DRAIN_S`,
        leaves the connection in the pool; otherwise the connection is closed."""
        body, self._body = self._body, None
        if body is not None:
            body.close()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Conn:
    """One TCP (or TLS) connection and its buffered reader."""

    __slots__ = ("sock", "rfile", "key", "idle_since", "expiry_s", "reused")

    def __init__(self, sock: socket.socket, key: tuple):
        self.sock = sock
        self.rfile = sock.makefile("rb", buffering=READ_SIZE)
        self.key = key
        self.idle_since = 0.0
        self.expiry_s = KEEPALIVE_EXPIRY_S
        self.reused = False

    def closed_while_idle(self) -> bool:
        """Readable while idle: the server closed it (EOF), reset it, or sent what nobody asked for."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))

    def close(self) -> None:
        for closable in (self.rfile, self.sock):
            try:
                closable.close()
            except OSError:
                pass


class _Body:
    """The body of one answer on its connection: framing, content decoding, and where the connection
    goes afterwards (back to the pool only when the body was read to its end)."""

    def __init__(self, client: Client, conn: _Conn, response: Response, method: str, timeout_s: float):
        self.client, self.conn, self.url, self.timeout_s = client, conn, response.url, timeout_s
        self.framing, self.left = _framing(response, method)
        self.done = self.framing == "none" or (self.framing == "length" and self.left == 0)
        self.keep = self.framing != "close" and _keep_alive(response)
        self.expiry_s = _keepalive_expiry(response.headers.get("keep-alive"))
        self.decoder = _decoder(response.headers.get("content-encoding", ""), self.url)
        self.released = False
        if self.done:
            self._release()

    def read_all(self) -> bytes:
        with self._errors():
            if self.framing == "length" and not self.decoder and not self.done:
                data = self.conn.rfile.read(self.left)
                if len(data) < self.left:
                    raise ConnectionResetError("the connection closed before the body's end")
                self.left, self.done = 0, True
                self._release()
                return data
        parts = []
        while True:
            data = self.piece()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def piece(self) -> bytes:
        """The next decoded piece of the body; b"" at its end (the connection is then released)."""
        with self._errors():
            while not self.done:
                raw = self._raw()
                if self.decoder is not None:
                    out = self.decoder.decompress(raw) if raw else self.decoder.flush()
                    if out:
                        return out
                elif raw:
                    return raw
            self._release()
            return b""

    def close(self) -> None:
        """The caller is done: drain a body that is almost over (a stream after ``[DONE]``), or drop it."""
        if self.released:
            return
        if self.keep and self.framing in ("length", "chunked"):
            try:
                self.conn.sock.settimeout(min(DRAIN_S, self.timeout_s))
                total = 0
                while not self.done and total <= 1 << 20:
                    total += len(self._raw())
            except OSError:
                pass
        if self.done:
            self._release()
        else:
            self.released = True
            self.conn.close()

    def _raw(self) -> bytes:
        """The next bytes of the body as sent (b"" once at its end, setting ``done``)."""
        rfile = self.conn.rfile
        if self.framing == "length":
            data = rfile.read1(min(self.left, READ_SIZE))
            if not data:
                raise ConnectionResetError("the connection closed before the body's end")
            self.left -= len(data)
            self.done = self.left == 0
            return data
        if self.framing == "close":
            data = rfile.read1(READ_SIZE)
            self.done = not data
            return data
        if self.left == 0:  # chunked: a chunk's size line
            line = rfile.readline(MAX_HEADER_LINE + 1)
            if not line:
                raise ConnectionResetError("the connection closed before the body's end")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ConnectionResetError(f"bad chunk size line {line[:20]!r}") from None
            if size == 0:
                while line not in (b"\r\n", b"\n"):  # trailers, then a blank line
                    line = rfile.readline(MAX_HEADER_LINE + 1)
                    if not line:
                        raise ConnectionResetError("the connection closed in the chunked trailer")
                self.done = True
                return b""
            self.left = size
        data = rfile.read1(min(self.left, READ_SIZE))
        if not data:
            raise ConnectionResetError("the connection closed before the body's end")
        self.left -= len(data)
        if self.left == 0 and rfile.readline(3) not in (b"\r\n", b"\n"):
            raise ConnectionResetError("a chunk did not end with CRLF")
        return data

    def _release(self) -> None:
        if not self.released:
            self.released = True
            if self.keep:
                self.conn.expiry_s = self.expiry_s
                self.client._put(self.conn)
            else:
                self.conn.close()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """OS and zlib errors as this module's; the connection is closed on any of them."""
        try:
            with _os_errors(
                self._drop,
                f"{self.url} sent nothing for {self.timeout_s:.1f} s mid-answer (read timeout)",
                TransportError,
                f"the connection to {self.url} failed mid-answer",
            ):
                yield
        except zlib.error as exc:
            self._drop()
            raise TransportError(f"{self.url} sent a body that does not decompress: {exc}") from None

    def _drop(self) -> None:
        self.done = self.released = True
        self.conn.close()


class _Target:
    """Where a URL's request goes: the origin, the pool's key, and the request line's target."""

    __slots__ = ("scheme", "host", "port", "host_header", "path", "proxy", "key", "display")

    def __init__(self, url: str, proxy: _Proxy | None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"not an http(s) URL: {_safe_url(url)}")
        self.scheme = parts.scheme
        self.host = parts.hostname
        try:
            port = parts.port
        except ValueError:
            raise InvalidRequest(f"bad port in {_safe_url(url)}") from None
        default = 443 if self.scheme == "https" else 80
        self.port = port or default
        self.host_header = _authority(self.host, self.port, default)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.proxy = proxy
        self.key = (self.scheme, self.host, self.port, proxy.key if proxy else None)
        self.display = f"{self.scheme}://{self.host_header}"


def _authority(host: str, port: int, default: int | None = None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == default else f"{shown}:{port}"


class _Proxy:
    """An ``http://`` proxy from the environment (its credentials are kept out of every message)."""

    __slots__ = ("host", "port", "auth", "key", "display")

    def __init__(self, url: str):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise InvalidRequest(
                f"the proxy {parts.scheme}://{parts.hostname or ''} from the environment is not supported: "
                "only http:// proxies are"
            )
        self.host = parts.hostname
        try:
            self.port = parts.port or 80
        except ValueError:
            raise InvalidRequest(f"bad port in the proxy {parts.hostname} from the environment") from None
        self.auth = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.auth = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
        self.key = (self.host, self.port, self.auth)
        self.display = f"the proxy {_authority(self.host, self.port)}"


def _safe_url(url: str) -> str:
    """A URL without its user and password, for messages."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def environment_proxies() -> dict[str, str]:
    """``getproxies()`` of the environment, read only when some ``*_proxy`` variable is set
    (``urllib.request`` is a heavy import for a worker that needs no proxy)."""
    if not any(name.lower().endswith("_proxy") for name in os.environ):
        return {}
    from urllib.request import getproxies_environment

    return getproxies_environment()


def _proxy_for(scheme: str, host: str, port: int, proxies: dict[str, str]) -> str | None:
    """The proxy URL a request to this origin goes through, or None (none set, or ``NO_PROXY``)."""
    url = proxies.get(scheme) or proxies.get("all")
    if not url:
        return None
    from urllib.request import proxy_bypass_environment

    if proxy_bypass_environment(host, proxies) or proxy_bypass_environment(f"{host}:{port}", proxies):
        return None
    return url


def ssl_context() -> Any:
    """The TLS context: ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE`` or ``SSL_CERT_DIR`` when set, else
    the system CA store (``certifi``'s bundle only when the system has none)."""
    import ssl

    cafile = os.environ.get("SSL_CERT_FILE") or os.environ.get("REQUESTS_CA_BUNDLE")
    capath = os.environ.get("SSL_CERT_DIR")
    if cafile or capath:
        ctx = ssl.create_default_context(cafile=cafile or None, capath=None if cafile else capath)
    else:
        ctx = ssl.create_default_context()
        paths = ssl.get_default_verify_paths()
        if not (paths.cafile or paths.capath):
            try:
                import certifi

                ctx.load_verify_locations(certifi.where())
            except ImportError:  # pragma: no cover - certifi comes with the openai SDK
                pass
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class Client:
    """HTTP/1.1 requests with pooled keep-alive connections; one per process, shared by its threads.

    ``headers`` go with every request (a request's own headers are added to them). Proxies are read
    from the environment once, here. ``stats`` counts connections opened, reused, and requests resent.
    """

    def __init__(self, headers: dict[str, str] | None = None, *, trust_env: bool = True):
        self.headers = dict(headers or {})
        self._bad_headers = _header_problem(self.headers)  # raised by each request, not here
        self._proxies = environment_proxies() if trust_env else {}
        self._targets: dict[str, _Target] = {}
        self._idle: dict[tuple, list[_Conn]] = {}
        self._lock = threading.Lock()
        self._ssl: Any = None
        self._pid = os.getpid()
        self.stats = {"opened": 0, "reused": 0, "resent": 0}

    def __repr__(self) -> str:
        return f"<httpclient.Client, {sum(len(v) for v in self._idle.values())} idle connections>"

    def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        stream: bool = False,
    ) -> Response:
        """Send one request; its answer when the status is below 300 (307/308 followed), else :class:`StatusError`.

        ``stream``: the body is read as it arrives (:meth:`Response.iter_lines`); close the response when
        done. Otherwise it is read whole before this returns, and the connection is back in the pool.
        """
        problem = self._bad_headers or (_header_problem(headers) if headers else None)
        if problem:
            raise InvalidRequest(problem)
        all_headers = {**self.headers, **headers} if headers else self.headers
        for _ in range(MAX_REDIRECTS + 1):
            target = self._target(url)
            response = self._send(method, target, body, all_headers, timeout_s)
            if response.status in (307, 308) and response.headers.get("location"):
                response.read()
                url = urljoin(url, response.headers["location"])
                if self._target(url).key[:3] != target.key[:3]:  # never hand the key to another origin
                    all_headers = {k: v for k, v in all_headers.items() if k.lower() != "authorization"}
                continue
            if response.status >= 300:
                raise _status_error(response)
            if not stream:
                response.read()
            return response
        raise TransportError(f"more than {MAX_REDIRECTS} redirects from {_safe_url(url)}")

    def close(self) -> None:
        """Close every idle connection (one in use is closed or pooled when its answer is done)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            proxy_url = None
            if self._proxies and parts.hostname:
                try:
                    port = parts.port or (443 if parts.scheme == "https" else 80)
                except ValueError:
                    port = 0  # _Target says what is wrong with it
                proxy_url = _proxy_for(parts.scheme, parts.hostname, port, self._proxies)
            target = _Target(url, _Proxy(proxy_url) if proxy_url else None)
            if len(self._targets) < 64:  # the model client asks for one URL; redirects are few
                self._targets[url] = target
        return target

    def _send(
        self, method: str, target: _Target, body: bytes | None, headers: dict[str, str], timeout_s: float
    ) -> Response:
        """Write the request and read the answer's head (see the module doc for when it is sent again)."""
        head = _request_head(method, target, headers, body)
        data = head + body if body else head
        resent = False
        while True:
            conn = self._take(target.key) or self._connect(target, timeout_s)
            with _os_errors(
                conn.close,
                f"no answer from {target.display} within {timeout_s:.1f} s",
                TransportError,
                f"the connection to {target.display} failed",
            ):
                conn.sock.settimeout(timeout_s)
                try:
                    conn.sock.sendall(data)
                except TimeoutError:
                    raise
                except OSError as exc:  # not all of the request left: the server cannot have acted on it
                    if conn.reused and not resent:
                        conn.close()
                        resent = True
                        self._count("resent")
                        continue
                    raise TransportError(f"sending to {target.display} failed: {_reason(exc)}") from None
                try:
                    response = _read_head(conn.rfile, target)
                except ConnectionDropped:
                    if conn.reused and not resent and method in IDEMPOTENT:
                        conn.close()
                        resent = True
                        self._count("resent")
                        continue
                    raise
                response._body = _Body(self, conn, response, method, timeout_s)
                return response

    # -- the pool ----------------------------------------------------------------------------

    def _take(self, key: tuple) -> _Conn | None:
        """The most recently used idle connection that is still good, or None."""
        if self._pid != os.getpid():  # a forked child must not share its parent's connections
            self._idle, self._lock, self._pid = {}, threading.Lock(), os.getpid()
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._idle.get(key)
                if not idle:
                    return None
                conn = idle.pop()
            if now - conn.idle_since < conn.expiry_s and not conn.closed_while_idle():
                conn.reused = True
                self._count("reused")
                return conn
            conn.close()

    def _put(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < MAX_IDLE_CONNECTIONS:
                idle.append(conn)
                return
        conn.close()

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def _connect(self, target: _Target, timeout_s: float) -> _Conn:
        """A new connection: TCP to the origin or the proxy, the CONNECT tunnel, TLS."""
        proxy = target.proxy
        host, port = (proxy.host, proxy.port) if proxy else (target.host, target.port)
        where = f"{target.display} through {proxy.display}" if proxy else target.display
        sock: Any = None
        with _os_errors(
            lambda: sock is not None and sock.close(),  # ssl.SSLError (certificate, handshake) is an OSError
            f"connecting to {where} timed out after {timeout_s:.1f} s",
            ConnectError,
            f"cannot connect to {where}",
        ):
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if target.scheme == "https":
                if proxy:
                    _tunnel(sock, target, proxy)
                if self._ssl is None:
                    self._ssl = ssl_context()  # two threads may both build one: the same, harmless
                sock = self._ssl.wrap_socket(sock, server_hostname=target.host)
        self._count("opened")
        return _Conn(sock, target.key)


@contextlib.contextmanager
def _os_errors(close: Any, timeout_text: str, error: type[HTTPError], error_text: str) -> Iterator[None]:
    """OS errors as this module's (a timeout as RequestTimeout), after ``close()``; ours pass through."""
    try:
        yield
    except HTTPError:
        close()
        raise
    except TimeoutError:
        close()
        raise RequestTimeout(timeout_text) from None
    except OSError as exc:
        close()
        raise error(f"{error_text}: {_reason(exc)}") from None


def _header_problem(headers: dict[str, str]) -> str | None:
    """What would break the request (a line break would split it); names the header, never its value."""
    for name, value in headers.items():
        if not name or any(c in name for c in "\r\n\0: \t") or any(c in str(value) for c in "\r\n\0"):
            return f"the request header {name.strip()!r} holds a line break or NUL (or has a bad name)"
    return None


def _request_head(method: str, target: _Target, headers: dict[str, str], body: bytes | None) -> bytes:
    absolute = target.proxy is not None and target.scheme == "http"  # a plain-http proxy wants the URL
    path = f"{target.display}{target.path}" if absolute else target.path
    lines = [f"{method} {path} HTTP/1.1", f"Host: {target.host_header}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if not any(k.lower() == "accept-encoding" for k in headers):
        lines.append(f"Accept-Encoding: {ACCEPT_ENCODING}")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body or b'')}")
    if absolute and target.proxy.auth:
        lines.append(f"Proxy-Authorization: {target.proxy.auth}")
    lines.append("\r\n")
    try:
        return "\r\n".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        raise InvalidRequest("a request header holds a character outside Latin-1") from None


def _tunnel(sock: socket.socket, target: _Target, proxy: _Proxy) -> None:
    """``CONNECT host:port`` through an http proxy; ConnectError unless it answers 2xx."""
    authority = _authority(target.host, target.port)
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if proxy.auth:
        lines.append(f"Proxy-Authorization: {proxy.auth}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    # Unbuffered: the tunnel's first bytes (the TLS handshake) must not be read into a buffer here.
    rfile = sock.makefile("rb", buffering=0)
    try:
        status_line = _unbuffered_line(rfile, proxy)
        while _unbuffered_line(rfile, proxy).strip():  # the proxy's headers
            pass
    finally:
        rfile.close()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ConnectError(f"{proxy.display} did not answer CONNECT with HTTP")
    if not 200 <= int(parts[1]) < 300:
        raise ConnectError(f"{proxy.display} refused the tunnel to {target.display}: HTTP {int(parts[1])}")


def _unbuffered_line(rfile: Any, proxy: _Proxy) -> bytes:
    line = bytearray()
    while not line.endswith(b"\n"):
        b = rfile.read(1)
        if not b:
            raise ConnectError(f"{proxy.display} closed the connection during CONNECT")
        line += b
        if len(line) > MAX_HEADER_LINE:
            raise ConnectError(f"{proxy.display} answered CONNECT with an overlong line")
    return bytes(line)


def _read_head(rfile: Any, target: _Target) -> Response:
    """The status line and headers (1xx answers skipped). ConnectionDropped: not a byte came."""
    first = True
    while True:
        try:
            line = rfile.readline(MAX_HEADER_LINE + 1)
        except TimeoutError:
            raise
        except OSError as exc:  # reset before anything came
            if first:
                raise ConnectionDropped(
                    f"{target.display} closed the connection without answering ({_reason(exc)})"
                ) from None
            raise
        if not line:
            if first:
                raise ConnectionDropped(f"{target.display} closed the connection without answering")
            raise TransportError(f"{target.display} closed the connection mid-answer")
        first = False
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise TransportError(f"{target.display} did not answer with HTTP: {line[:40]!r}")
        version, status = parts[0], int(parts[1])
        reason = parts[2].strip().decode("latin-1") if len(parts) > 2 else ""
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            line = rfile.readline(MAX_HEADER_LINE + 1)
            if not line:
                raise TransportError(f"{target.display} closed the connection mid-answer")
            if line in (b"\r\n", b"\n"):
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise TransportError(f"{target.display} sent a malformed header line")
            name, value = name.strip().lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        else:
            raise TransportError(f"{target.display} sent more than {MAX_HEADERS} headers")
        if 100 <= status < 200 and status != 101:
            continue  # 100 Continue, 103 Early Hints: the answer follows
        if version == b"HTTP/1.0" and "keep-alive" not in headers.get("connection", "").lower():
            headers["connection"] = "close"  # HTTP/1.0 keeps the connection only when it says so
        return Response(status, reason, headers, f"{target.display}{target.path}")


def _framing(response: Response, method: str) -> tuple[str, int]:
    """How the body ends: ("none", 0), ("length", n), ("chunked", 0) or ("close", 0)."""
    if method == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200:
        return "none", 0
    if "chunked" in response.headers.get("transfer-encoding", "").lower():
        return "chunked", 0
    length = response.headers.get("content-length")
    if length is None:
        return "close", 0
    values = {v.strip() for v in length.split(",")}  # repeated headers were joined
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise TransportError(f"{response.url} sent a bad Content-Length")
    return "length", int(next(iter(values)))


def _keep_alive(response: Response) -> bool:
    return "close" not in response.headers.get("connection", "").lower()


def _keepalive_expiry(value: str | None) -> float:
    """``Keep-Alive: timeout=N``: the connection is dropped a second before the server would."""
    if value:
        for part in value.split(","):
            key, _, number = part.strip().partition("=")
            if key.strip().lower() == "timeout":
                try:
                    return max(0.0, min(KEEPALIVE_EXPIRY_S, float(number) - 1.0))
                except ValueError:
                    break
    return KEEPALIVE_EXPIRY_S


def _decoder(encoding: str, url: str) -> Any:
    """A decompressor for the body's Content-Encoding (gzip, deflate), or None for identity."""
    codings = [c.strip().lower() for c in encoding.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in ("gzip", "x-gzip", "deflate"):
        raise TransportError(f"{url} sent a body encoded as {encoding!r}, which was not asked for")
    return _Deflate() if codings[0] == "deflate" else zlib.decompressobj(16 + zlib.MAX_WBITS)


class _Deflate:
    """``deflate`` is zlib-wrapped by the standard, raw from some servers: tried in that order."""

    def __init__(self) -> None:
        self._obj: Any = None

    def decompress(self, data: bytes) -> bytes:
        if self._obj is None:
            try:
                obj = zlib.decompressobj()
                out = obj.decompress(data)
            except zlib.error:
                obj = zlib.decompressobj(-zlib.MAX_WBITS)
                out = obj.decompress(data)
            self._obj = obj
            return out
        return self._obj.decompress(data)

    def flush(self) -> bytes:
        return self._obj.flush() if self._obj is not None else b""


def _status_error(response: Response) -> StatusError:
    text = response.read().decode("utf-8", "replace").strip()
    body: Any = text
    if text:
        try:
            body = json.loads(text)
        except ValueError:
            pass
    location = response.headers.get("location")
    if 300 <= response.status < 400 and location and not body:
        body = f"redirected to {_safe_url(location)}; point the URL there"
    return StatusError(response, body)


def _reason(exc: BaseException) -> str:
    """An OS error in words (an OSError's text holds no request data)."""
    if isinstance(exc, socket.gaierror):
        return f"name resolution failed ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    text = getattr(exc, "strerror", None) or str(exc)
    return text or type(exc).__name__
