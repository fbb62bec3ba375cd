"""The HTTP client of every model call (:class:`batchrun.prompt.llm.LLMClient`), on urllib3 2.x.

urllib3 does the protocol (pooled keep-alive connections, ``Content-Length``, chunked and read-until-close
bodies, TLS, proxies); this module adds what an endpoint nobody here controls makes necessary:

* **bounds** on everything the endpoint sends (:class:`Bounds`): the decompressed body
  (``--max_response_mb``; a ``Content-Length`` above it fails before a byte is read, a gzip bomb is
  inflated a piece at a time and stops at the bound), the headers (http.client: 100 lines of 64 KiB at
  most), each server-sent-events line and the whole stream. Past a bound: :class:`BadResponse`;
* **one deadline per request** (``deadline``, time.monotonic): the connect, and every read, get only
  the time left, and the deadline is checked after every read, so neither a stall nor a body dripped a
  byte at a time keeps a request past it (:class:`RequestTimeout`);
* **keep-alive**: connections are pooled per :class:`Client` (one per worker process, shared by its
  threads); one idle for more than :data:`KEEPALIVE_EXPIRY_S` is closed before reuse, so a server's own
  idle timeout (uvicorn's 5 s) does not race a request. llama-server (``Server: llama.cpp``) is asked to
  close each connection after its answer instead (:data:`CLOSE_SERVERS`): it holds an HTTP thread on
  each idle one, and the requests of other connections wait;
* **no silent resend of a POST**: urllib3 retries nothing here. A connection that ends before an
  answer raises :class:`ConnectionDropped`; the model client counts it as a retry (limiter, back-off,
  ``--max_retries``), because the server may have run, and billed, the call. A GET is sent again once;
* **HTTPS** with the system CA store, or ``SSL_CERT_FILE`` / ``REQUESTS_CA_BUNDLE`` / ``SSL_CERT_DIR``;
* **proxies** from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``), read
  once per client; credentials in the proxy URL become ``Proxy-Authorization``;
* **gzip and deflate** asked for, decoded here (bounded); **redirects**: 307 and 308 are followed
  (same method and body; ``Authorization`` is dropped when the redirect leaves the origin), any other
  3xx is a :class:`StatusError` naming the new location.

Nothing this module raises carries a request header (the API key is one) or the request body:
messages name the host, the port and what went wrong.
"""

from __future__ import annotations

import base64
import contextlib
import heapq
import http.client
import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import urllib3
from urllib3 import exceptions as u3
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from batchrun.sharegpt import parse_json

KEEPALIVE_EXPIRY_S = 4.0  # an idle pooled connection is closed after this (below uvicorn's 5 s)
MAX_CONNECTIONS = 1024  # per origin; a worker has at most one connection per prompt thread
MAX_REDIRECTS = 5
READ_SIZE = 65536
MAX_ERROR_BODY = 1 << 20  # an error answer's body is read up to this (its message is what matters)
DRAIN_BYTES = 1 << 20  # after the caller stopped reading ([DONE]): the rest read to keep the connection
DRAIN_S = 1.0
ACCEPT_ENCODING = "gzip, deflate"
# Servers (their ``Server`` header, lower-case prefix) asked to close each connection after its answer.
CLOSE_SERVERS = ("llama.cpp",)


MIN_PROCESS_BYTES = 64 << 20  # the least all the answers a process reads at once may hold together


@dataclass(frozen=True)
class Bounds:
    """What one answer may hold. ``body_bytes`` bounds the decoded body, streamed or not (a stream is
    its body); ``line_bytes`` one server-sent-events line. ``process_bytes`` (default: twice
    ``body_bytes``, at least :data:`MIN_PROCESS_BYTES`) bounds the bodies of all the answers this
    process is reading at once: each within its own bound, 16 prompt threads of a worker fed 32 MiB
    answers at once took it to 1 GB (4 GB for the default four workers)."""

    body_bytes: int = 32 << 20
    line_bytes: int = 4 << 20
    process_bytes: int = 0

    def __post_init__(self) -> None:
        # a line may be a whole reply's tool call, never most of the stream
        object.__setattr__(self, "line_bytes", max(1, min(self.line_bytes, self.body_bytes // 2)))
        if self.process_bytes <= 0:
            object.__setattr__(self, "process_bytes", max(2 * self.body_bytes, MIN_PROCESS_BYTES))


class _Held:
    """The decoded bytes of the answers this process is reading (each counted until it is closed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total = 0

    def add(self, n: int, bound: int) -> bool:
        """Count ``n`` more bytes; False (and nothing counted) when the total would pass ``bound``."""
        with self.lock:
            if self.total + n > bound:
                return False
            self.total += n
            return True

    def release(self, n: int) -> None:
        with self.lock:
            self.total -= n


HELD = _Held()


class HTTPError(Exception):
    """Base of what this client raises. Its text never holds a request header or the request body.

    ``sent``: False when the request cannot have reached the server (no connection was made, or it
    was never written); True when it may have, so the server may have run, and billed, it."""

    sent = True

    def unsent(self) -> HTTPError:
        self.sent = False
        return self


class InvalidRequest(HTTPError, ValueError):
    """The request cannot be sent as given (a header with a line break, a bad URL, no such proxy kind)."""

    sent = False


class RequestTimeout(HTTPError):
    """The request's deadline passed: connecting, waiting for the answer, or reading it."""


class TransportError(HTTPError):
    """No usable answer: the connection could not be made, dropped, or the answer is not HTTP."""


class ConnectError(TransportError):
    """The connection (or its TLS handshake, or the proxy tunnel) could not be made."""

    sent = False


class ConnectionDropped(TransportError):
    """The server closed the connection without a byte of an answer; the request may have reached it."""


class BadResponse(HTTPError):
    """The answer broke a bound (:class:`Bounds`, the header limits) or its encoding: error class ``bad_response``."""


class StatusError(HTTPError):
    """The server answered with a status of 300 or more (redirects not followed, see the module doc).

    ``body`` is the answer's JSON (any type) or, when it is not JSON, its stripped text; ``message``
    is ``Error code: <status>`` plus the error object's ``message`` when it has one;
    ``response`` holds the status and the headers (``Retry-After``, ``retry-after-ms``)."""

    def __init__(self, response: Response, body: Any):
        message = f"Error code: {response.status}"
        error = body.get("error", body) if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
            message += f" - {error['message'][:1000]}"
        elif isinstance(body, str) and body:  # not JSON (a proxy's error page): its start
            message += f" - {body[:300]}"
        super().__init__(message)
        self.message = message
        self.response = response
        self.status_code = response.status
        self.body = body


class Response:
    """An answer: ``status``, ``headers`` (lower-case names), and its body, read whole or line by line,
    within the request's bounds and deadline."""

    def __init__(self, raw: Any, url: str, bounds: Bounds, deadline: float, read_timeout_s: float):
        self.status = raw.status
        self.reason = raw.reason or ""
        self.headers = {k.lower(): v for k, v in raw.headers.items()}  # repeated ones joined by ", "
        self.url = url  # origin and path of the request (no credentials)
        self._raw = raw
        self._bounds = bounds
        self._deadline = deadline
        self._read_timeout_s = read_timeout_s
        self._decoder = _decoder(self.headers.get("content-encoding", ""), url)
        if raw.connection is not None:  # how long it may idle in the pool after this answer
            raw.connection._expiry_s = _keepalive_expiry(self.headers.get("keep-alive"))
        self._content: bytes | None = None
        self._received = 0  # decoded bytes so far
        self._held = 0  # of them, those counted in HELD (released when the answer is closed)
        self._done = False
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > bounds.body_bytes:
            self.close()
            raise BadResponse(f"{url} announced a body of {int(length):,} bytes, above {_limit(bounds)}")

    def __repr__(self) -> str:
        return f"<Response {self.status} from {self.url}>"

    @property
    def received(self) -> int:
        """Bytes of the body read so far (decoded)."""
        return self._received

    def read(self, limit: int | None = None) -> bytes:
        """The whole (decoded) body; ``limit``: cut there instead of failing (error answers)."""
        if self._content is None:
            parts, size = [], 0
            try:
                for piece in self._pieces(cut_at=limit):
                    parts.append(piece)
                    size += len(piece)
                    if limit is not None and size >= limit:
                        break
            except BaseException:
                parts.clear()  # the error's traceback keeps this frame, and held the body to the bound
                raise
            self._content = b"".join(parts)
            self.close()
        return self._content

    @property
    def text(self) -> str:
        return self.read().decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` (``JSONDecodeError``, ``UnicodeDecodeError``) when it is not."""
        return parse_json(self.read())

    def _line_text(self, line: bytes | bytearray) -> str:
        """A streamed line as text; :class:`BadResponse` when it is not UTF-8, as a body that is not is
        (:meth:`json`): replacing its bytes with U+FFFD would keep text the model never wrote."""
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._drop()
            raise BadResponse(
                f"{self.url} sent a streamed line that is not UTF-8 (byte {exc.start})"
            ) from None

    def iter_lines(self) -> Iterator[str]:
        """The body's lines as they arrive, without their ends; a line longer than ``Bounds.line_bytes``
        is :class:`BadResponse`. The unfinished line is kept in one buffer and searched only where new
        bytes came, so a line without a newline costs linear time, not quadratic."""
        if self._content is not None:
            for line in self._content.splitlines():
                yield self._line_text(line)
            return
        buf = bytearray()
        max_line = self._bounds.line_bytes
        for piece in self._pieces():
            start = len(buf)
            buf += piece
            cut = 0
            while True:
                nl = _line_end(buf, max(cut, start - 1))
                if nl < 0:
                    break
                yield self._line_text(buf[cut:nl].rstrip(b"\r"))
                cut = nl + 1
                start = cut
            if cut:
                del buf[:cut]
            if len(buf) > max_line:
                self._drop()
                raise BadResponse(f"{self.url} sent a streamed line longer than {max_line:,} bytes")
        if buf:
            yield buf.decode("utf-8", "replace")

    def close(self) -> None:
        """Done with the answer: a body read to its end, or whose rest is short and prompt, leaves the
        connection in the pool; otherwise the connection is closed."""
        self._release()
        raw, self._raw = self._raw, None
        if raw is None:
            return
        try:
            if not self._done:
                self._drain(raw)
            raw.release_conn()
        except Exception:  # noqa: BLE001 - any failure here only means the connection is not reused
            _discard(raw)

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------------

    def _pieces(self, cut_at: int | None = None) -> Iterator[bytes]:
        """The decoded body a bounded piece at a time; the deadline checked before every read."""
        raw = self._raw
        if raw is None:
            return
        bound = self._bounds.body_bytes if cut_at is None else max(cut_at, 1)
        while True:
            data = self._read_raw(raw)
            if not data:
                tail = self._inflate(b"", bound, final=True)
                if tail:
                    yield tail
                self._done = True
                return
            out = self._inflate(data, bound)
            if out:
                yield out

    def _read_raw(self, raw: Any) -> bytes:
        left = self._deadline - time.monotonic()
        if left <= 0:
            self._drop()
            raise RequestTimeout(f"{self.url} did not finish its answer before the request's deadline")
        _set_read_timeout(raw, min(left, self._read_timeout_s))
        try:
            return raw.read1(READ_SIZE, decode_content=False)
        except Exception as exc:  # noqa: BLE001 - every failure of a read is one of ours
            self._drop()
            raise _body_error(exc, self.url, time.monotonic() >= self._deadline) from None

    def _inflate(self, data: bytes, bound: int, final: bool = False) -> bytes:
        """Decode (a piece of bounded size at a time) and count against ``bound``."""
        dec = self._decoder
        if dec is None:
            out = data
        else:
            try:
                out = dec.decompress(data, bound - self._received + 1) if not final else dec.flush()
                while dec.unconsumed_tail and len(out) <= bound - self._received:
                    out += dec.decompress(dec.unconsumed_tail, bound - self._received - len(out) + 1)
            except zlib.error as exc:
                self._drop()
                raise BadResponse(f"{self.url} sent a body that does not decompress: {exc}") from None
        self._received += len(out)
        if not HELD.add(len(out), self._bounds.process_bytes):
            self._drop()
            raise BadResponse(
                f"{self.url} sent a body while the answers this process is reading held "
                f"{self._bounds.process_bytes / (1 << 20):g} MiB together (twice --max_response_mb, "
                f"at least {MIN_PROCESS_BYTES >> 20} MiB)"
            )
        self._held += len(out)
        if self._received > bound:
            self._drop()
            if bound == self._bounds.body_bytes:
                raise BadResponse(f"{self.url} sent a body above {_limit(self._bounds)} (decoded)")
            return out[: len(out) - (self._received - bound)]
        return out

    def _drain(self, raw: Any) -> None:
        """Read what is left of a body the caller stopped reading, if it is short and prompt."""
        if self._decoder is not None or raw.headers.get("content-length") is None and not raw.chunked:
            _discard(raw)
            return
        # DRAIN_S bounds the whole drain, not each read: a server dripping a byte a second after
        # [DONE] would otherwise hold the prompt for DRAIN_BYTES seconds, past every deadline.
        end = min(time.monotonic() + DRAIN_S, self._deadline)
        total = 0
        while total <= DRAIN_BYTES:
            left = end - time.monotonic()
            if left <= 0:
                break
            _set_read_timeout(raw, left)
            data = raw.read1(READ_SIZE, decode_content=False)
            if not data:
                return
            total += len(data)
        _discard(raw)

    def _drop(self) -> None:
        self._release()
        raw, self._raw = self._raw, None
        if raw is not None:
            _discard(raw)

    def _release(self) -> None:
        held, self._held = getattr(self, "_held", 0), 0  # 0: an answer whose __init__ raised early
        if held:
            HELD.release(held)

    def __del__(self) -> None:
        self._release()  # an answer dropped unclosed (an error between reads) frees its count too


def _line_end(buf: bytearray, start: int) -> int:
    """Index of the first line end (``\\n``, or a ``\\r`` not followed by ``\\n``) from ``start``, or -1."""
    start = max(start, 0)
    nl = buf.find(b"\n", start)
    cr = buf.find(b"\r", start, nl if nl >= 0 else len(buf))
    while cr >= 0:
        if cr + 1 < len(buf) and buf[cr + 1] != 0x0A:
            return cr
        if cr + 1 >= len(buf):
            break  # \n may follow
        cr = buf.find(b"\r", cr + 1, nl if nl >= 0 else len(buf))
    return nl


def _keepalive_expiry(value: str | None) -> float:
    """``Keep-Alive: timeout=N``: the connection is dropped a second before the server would."""
    for part in (value or "").split(","):
        key, _, number = part.strip().partition("=")
        if key.strip().lower() == "timeout":
            try:
                return max(0.0, min(KEEPALIVE_EXPIRY_S, float(number) - 1.0))
            except ValueError:
                break
    return KEEPALIVE_EXPIRY_S


def _limit(bounds: Bounds) -> str:
    return f"the bound of {bounds.body_bytes / (1 << 20):g} MiB (--max_response_mb)"


def _discard(raw: Any) -> None:
    """Close the answer's connection (it is not reused), returning its slot to the pool."""
    try:
        conn = raw.connection
        if conn is not None:
            conn.close()
        raw.release_conn()
    except Exception:  # noqa: BLE001
        pass


def _set_read_timeout(raw: Any, seconds: float) -> None:
    conn = raw.connection
    sock = getattr(conn, "sock", None) if conn is not None else None
    if sock is not None:
        sock.settimeout(max(0.001, seconds))


def _body_error(exc: BaseException, url: str, deadline_passed: bool) -> HTTPError:
    """A failure while reading a body, as this module's error."""
    if isinstance(exc, HTTPError):
        return exc
    if deadline_passed or isinstance(exc, (TimeoutError, u3.ReadTimeoutError)):
        return RequestTimeout(
            f"{url} sent nothing more mid-answer before the request's deadline (read timeout)"
        )
    if _caused_by(exc, http.client.LineTooLong) or isinstance(exc, u3.InvalidChunkLength):
        return BadResponse(f"{url} sent a malformed or overlong chunk size line")
    return TransportError(f"the connection to {url} failed mid-answer: {_reason(exc)}")


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``kind`` is ``exc`` or behind it (urllib3 wraps http.client's error as its second arg)."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, kind):
            return True
        wrapped = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], BaseException) else None
        exc = getattr(exc, "reason", None) or wrapped or exc.__cause__ or exc.__context__
    return False


class _Decoder:
    """gzip (``16 + MAX_WBITS``) or deflate (zlib-wrapped by the standard, raw from some servers)."""

    def __init__(self, gzip: bool):
        self._gzip = gzip
        self._obj: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
        self.unconsumed_tail = b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._obj is None:  # deflate: which form it is shows in the first bytes
            try:
                obj = zlib.decompressobj()
                out = obj.decompress(data, max_length)
            except zlib.error:
                obj = zlib.decompressobj(-zlib.MAX_WBITS)
                out = obj.decompress(data, max_length)
            self._obj = obj
        else:
            out = self._obj.decompress(data, max_length)
        self.unconsumed_tail = self._obj.unconsumed_tail
        return out

    def flush(self) -> bytes:
        return self._obj.flush(READ_SIZE) if self._obj is not None else b""


def _decoder(encoding: str, url: str) -> _Decoder | None:
    codings = [c.strip().lower() for c in encoding.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in ("gzip", "x-gzip", "deflate"):
        raise BadResponse(f"{url} sent a body encoded as {encoding[:40]!r}, which was not asked for")
    return _Decoder(gzip=codings[0] != "deflate")


# -- the pool ------------------------------------------------------------------------------------


_this_thread = threading.local()  # .opened: whether this thread's request opened a connection; .deadline


class _Watchdog:
    """Ends a connection whose request's deadline passed while urllib3 waits for the answer's head: a
    server dripping its status line or headers a byte at a time meets each read's timeout forever.
    One thread per process, asleep until the earliest deadline; shutting the socket down makes the
    blocked read return at once. A request is woken for only when its deadline is the new earliest
    (waking the thread at every request cost the workers ~7 % of their Python CPU); an ended
    request's entry is dropped once it reaches the heap's head, by the next request or the thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Any]] = []
        self._count = 0
        self._pid = 0

    def watch(self, deadline: float, conn: Any) -> list[Any]:
        entry = [conn]  # emptied by cancel
        with self._cv:
            if self._pid != os.getpid():  # first use in this process (a fork has no thread)
                self._pid, self._heap = os.getpid(), []
                threading.Thread(target=self._run, name="http-deadlines", daemon=True).start()
            heap = self._heap
            while heap and not heap[0][2]:  # ended requests' entries go here, not in the thread
                heapq.heappop(heap)
            self._count += 1
            heapq.heappush(heap, (deadline, self._count, entry))
            if heap[0][2] is entry:  # only a new earliest deadline wakes the thread
                self._cv.notify()
        return entry

    @staticmethod
    def cancel(entry: list[Any]) -> None:
        entry.clear()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._heap and not self._heap[0][2]:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                _, _, entry = heapq.heappop(self._heap)
            sock = getattr(entry[0], "sock", None) if entry else None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


_WATCHDOG = _Watchdog()


MAX_INFORMATIONAL = 20  # interim answers (102 Processing, 103 Early Hints) skipped before the final one


class _FinalResponse(http.client.HTTPResponse):
    """http.client's response, past every interim answer: http.client skips only ``100 Continue``,
    so a ``103 Early Hints`` (a CDN's, a proxy's) was read as the answer itself, with no body, and
    the call failed as a bad response. At most :data:`MAX_INFORMATIONAL` of them (then: not HTTP)."""

    def _read_status(self) -> tuple[str, int, str]:
        for _ in range(MAX_INFORMATIONAL):
            version, status, reason = super()._read_status()
            if not 102 <= status < 200:  # 100 is http.client's own to skip; 101 switches protocols
                return version, status, reason
            http.client.parse_headers(self.fp)  # the interim answer's headers (bounded there)
        raise http.client.BadStatusLine(f"more than {MAX_INFORMATIONAL} interim (1xx) answers")


class _Counting:
    """Mixed into the pools: counts connections opened, and closes one idle too long before reuse."""

    stats: dict[str, int]
    lock: threading.Lock

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        idle_since = getattr(conn, "_idle_since", None)
        expiry = getattr(conn, "_expiry_s", KEEPALIVE_EXPIRY_S)
        if idle_since is not None and time.monotonic() - idle_since > expiry:
            conn.close()
        deadline = getattr(_this_thread, "deadline", None)
        if deadline is not None:  # this request's deadline watches its connection until the head is in
            _this_thread.watched = _WATCHDOG.watch(deadline, conn)
        return conn

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            conn._idle_since = time.monotonic()
        super()._put_conn(conn)  # type: ignore[misc]

    def _new_conn(self) -> Any:
        conn = super()._new_conn()  # type: ignore[misc]
        conn.response_class = _FinalResponse
        original = conn.connect
        # Not ``self``: a connection that held its pool would keep it alive from urllib3's finalizer
        # (which holds the pool's queue of connections), so the pool's connections were never closed.
        lock, stats = self.lock, self.stats

        def connect() -> None:
            original()
            _this_thread.opened = True
            with lock:
                stats["opened"] += 1

        conn.connect = connect
        return conn


def _pool_classes(stats: dict[str, int], lock: threading.Lock) -> dict[str, type]:
    attrs = {"stats": stats, "lock": lock}
    return {
        "http": type("_HTTPPool", (_Counting, HTTPConnectionPool), attrs),
        "https": type("_HTTPSPool", (_Counting, HTTPSConnectionPool), attrs),
    }


def _safe_url(url: str) -> str:
    """A URL without its user and password, for messages; also one urllib cannot read
    (``http://u:p@[::1/v1``), whose user and password are cut by hand."""
    try:
        parts = urlsplit(url)
    except ValueError:
        scheme, sep, rest = url.partition("://")
        return scheme + sep + rest.rpartition("@")[2] if "@" in rest else url
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def url_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its user and password, and the (user, password) it held, URL-unquoted."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    return _safe_url(url), (unquote(parts.username or ""), unquote(parts.password or ""))


def basic_auth(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def environment_proxies() -> dict[str, str]:
    """``getproxies()`` of the environment, read only when some ``*_proxy`` variable is set."""
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
            except ImportError:  # pragma: no cover
                pass
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _header_problem(headers: dict[str, str]) -> str | None:
    """What would break the request (a line break would split it); names the header, never its value."""
    for name, value in headers.items():
        if not name or any(c in name for c in "\r\n\0: \t") or any(c in str(value) for c in "\r\n\0"):
            return f"the request header {name.strip()!r} holds a line break or NUL (or has a bad name)"
        try:
            str(value).encode("latin-1")
        except UnicodeEncodeError:
            return f"the request header {name.strip()!r} holds a character outside Latin-1"
    return None


class Client:
    """HTTP/1.1 requests with pooled keep-alive connections; one per process, shared by its threads.

    ``headers`` go with every request (a request's own headers are added to them). Proxies are read
    from the environment once, here. ``stats`` counts connections opened, reused, and requests resent.
    """

    def __init__(
        self, headers: dict[str, str] | None = None, *, trust_env: bool = True, bounds: Bounds | None = None
    ):
        self.headers = dict(headers or {})
        self.headers.setdefault("Accept-Encoding", ACCEPT_ENCODING)
        self.bounds = bounds or Bounds()
        self._bad_headers = _header_problem(self.headers)  # raised by each request, not here
        self._proxies = environment_proxies() if trust_env else {}
        self._lock = threading.Lock()
        self.stats = {"opened": 0, "reused": 0, "resent": 0}
        self._managers: dict[str | None, Any] = {}
        self._pools: dict[tuple[str, str, int], Any] = {}  # direct origins' pools
        self._pid = os.getpid()
        self._ssl: Any = None
        self._close_origins: set[tuple] = set()  # servers asked to close each connection (see request)

    def __repr__(self) -> str:
        return f"<httpclient.Client, {self.stats['opened']} connections opened>"

    def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        stream: bool = False,
        deadline: float | None = None,
    ) -> Response:
        """Send one request; its answer when the status is below 300 (307/308 followed), else :class:`StatusError`.

        ``timeout_s`` bounds each wait (connect, each read); ``deadline`` (time.monotonic; default
        ``timeout_s`` from now) bounds the whole request, its body included. ``stream``: the body is read
        as it arrives (:meth:`Response.iter_lines`); close the response when done. Otherwise it is read
        whole before this returns, and the connection is back in the pool.
        """
        problem = self._bad_headers or (_header_problem(headers) if headers else None)
        if problem:
            raise InvalidRequest(problem)
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        all_headers = {**self.headers, **headers} if headers else dict(self.headers)
        for _ in range(MAX_REDIRECTS + 1):
            if _origin(url) in self._close_origins:
                all_headers["Connection"] = "close"
            response = self._send(method, url, body, all_headers, timeout_s, deadline)
            if response.headers.get("server", "").lower().startswith(CLOSE_SERVERS):
                # llama-server (cpp-httplib) holds one of its few HTTP threads on each idle keep-alive
                # connection for its 5 s keep-alive timeout: with more requests in flight than it has
                # threads, the rest sat unread while it idled (one slot, 16 prompts: 20.3 s and a prompt
                # timed out; 8.1 s asking it to close). A local connection costs ~0.1 ms to open again.
                self._close_origins.add(_origin(url))
            if response.status in (307, 308) and response.headers.get("location"):
                response.read(limit=MAX_ERROR_BODY)
                new = urljoin(url, response.headers["location"])
                if _origin(new) != _origin(url):  # never hand the key to another origin
                    all_headers = {k: v for k, v in all_headers.items() if k.lower() != "authorization"}
                url = new
                continue
            if response.status >= 300:
                raise _status_error(response)
            if not stream:
                response.read()
            return response
        raise TransportError(f"more than {MAX_REDIRECTS} redirects from {_safe_url(url)}")

    def close(self) -> None:
        """Close every pooled connection (urllib3 2's ``PoolManager.clear`` only forgets its pools)."""
        with self._lock:
            managers, self._managers, self._pools = self._managers, {}, {}
        for manager in managers.values():
            pools = []
            for key in manager.pools.keys():
                with contextlib.suppress(KeyError):
                    pools.append(manager.pools[key])
            manager.clear()
            for pool in pools:
                pool.close()

    def _send(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout_s: float,
        deadline: float,
    ) -> Response:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"not an http(s) URL: {_safe_url(url)}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise InvalidRequest(f"bad port in {_safe_url(url)}") from None
        display = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        manager, proxy = self._manager(parts.scheme, parts.hostname, port)
        where = f"{display} through the proxy {proxy}" if proxy else display
        left = deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout(f"no time left for a request to {display}").unsent()
        wait = min(left, timeout_s)
        idempotent = method in ("GET", "HEAD", "OPTIONS")
        _this_thread.opened, _this_thread.deadline, _this_thread.watched = False, deadline, None
        # Direct: the origin's pool, looked up once (the pool manager's key normalisation costs more
        # CPU per call than the rest of the request); through a proxy, the manager adds its parts.
        opener, target = (
            (manager, url)
            if proxy
            else (self._pool(manager, parts.scheme, parts.hostname, port), _path(parts))
        )
        try:
            raw = opener.urlopen(
                method,
                target,
                body=body,
                headers=headers,
                timeout=urllib3.Timeout(connect=wait, read=wait),
                retries=urllib3.Retry(
                    total=1,
                    connect=0,
                    read=1,
                    redirect=0,
                    status=0,
                    other=0,
                    raise_on_redirect=False,
                    raise_on_status=False,
                )
                if idempotent
                else False,
                redirect=False,
                preload_content=False,
                decode_content=False,
                assert_same_host=False,
            )
        except u3.HTTPError as exc:
            if time.monotonic() >= deadline:
                raise RequestTimeout(f"{where} did not answer before the request's deadline") from None
            raise _send_error(exc, where, wait) from None
        finally:
            if _this_thread.watched is not None:
                _WATCHDOG.cancel(_this_thread.watched)
            _this_thread.deadline = _this_thread.watched = None
        with self._lock:
            if not _this_thread.opened:
                self.stats["reused"] += 1
            if raw.retries is not None and raw.retries.history:
                self.stats["resent"] += len(raw.retries.history)
        path = parts.path or "/"
        return Response(raw, f"{display}{path}", self.bounds, deadline, timeout_s)

    def _pool(self, manager: Any, scheme: str, host: str, port: int) -> Any:
        key = (scheme, host, port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = manager.connection_from_host(host, port, scheme)
        return pool

    def _manager(self, scheme: str, host: str, port: int) -> tuple[Any, str | None]:
        """The pool manager for this origin: direct, or through its proxy from the environment."""
        if self._pid != os.getpid():  # a forked child must not share its parent's connections
            self._managers, self._pools, self._lock, self._pid = {}, {}, threading.Lock(), os.getpid()
        proxy_url = _proxy_for(scheme, host, port, self._proxies) if self._proxies else None
        with self._lock:
            manager = self._managers.get(proxy_url)
            if manager is None:
                manager = self._make_manager(proxy_url)
                self._managers[proxy_url] = manager
            if scheme == "https" and "ssl_context" not in manager.connection_pool_kw:
                # Built for the first https request only: loading the CA store costs ~0.1 s of CPU.
                if self._ssl is None:
                    self._ssl = ssl_context()
                manager.connection_pool_kw["ssl_context"] = self._ssl
        return manager, _safe_url(proxy_url).split("://")[-1].rstrip("/") if proxy_url else None

    def _make_manager(self, proxy_url: str | None) -> Any:
        options: dict[str, Any] = {"num_pools": 16, "maxsize": MAX_CONNECTIONS, "block": False}
        if proxy_url is None:
            manager = urllib3.PoolManager(**options)
        else:
            plain, creds = url_credentials(proxy_url if "://" in proxy_url else f"http://{proxy_url}")
            scheme = urlsplit(plain).scheme
            if scheme not in ("http", "https"):
                raise InvalidRequest(
                    f"the proxy {_safe_url(plain)} from the environment is not supported: only http(s):// proxies are"
                )
            proxy_headers = {"Proxy-Authorization": basic_auth(*creds)} if creds else None
            manager = urllib3.ProxyManager(plain, proxy_headers=proxy_headers, **options)
        manager.pool_classes_by_scheme = _pool_classes(self.stats, self._lock)
        return manager


def _path(parts: Any) -> str:
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _send_error(exc: BaseException, where: str, wait: float) -> HTTPError:
    """urllib3's failure to get an answer, as this module's error (the request's text never in it)."""
    if isinstance(exc, u3.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    # NewConnectionError is a ConnectTimeoutError in urllib3 2.x: it goes first.
    if isinstance(exc, (u3.NewConnectionError, u3.SSLError, u3.NameResolutionError, u3.ProxyError)):
        return ConnectError(f"cannot connect to {where}: {_reason(exc)}")
    if isinstance(exc, u3.ConnectTimeoutError):
        return RequestTimeout(f"connecting to {where} timed out after {wait:.1f} s").unsent()
    if isinstance(exc, (u3.ReadTimeoutError, TimeoutError)):
        return RequestTimeout(f"no answer from {where} within {wait:.1f} s")
    if isinstance(exc, u3.LocationParseError):
        return InvalidRequest(f"not a valid URL for {where}")
    if isinstance(exc, u3.ProtocolError):
        if (
            _caused_by(exc, http.client.LineTooLong)
            or "headers" in str(exc).lower()
            and "more than" in str(exc)
        ):
            return BadResponse(f"{where} sent an overlong header line or too many headers")
        if _caused_by(exc, http.client.BadStatusLine) and not _caused_by(exc, http.client.RemoteDisconnected):
            return TransportError(f"{where} did not answer with HTTP")
        return ConnectionDropped(f"{where} closed the connection without answering ({_reason(exc)})")
    return TransportError(f"the connection to {where} failed: {_reason(exc)}")


def _status_error(response: Response) -> StatusError:
    text = response.read(limit=MAX_ERROR_BODY).decode("utf-8", "replace").strip()
    body: Any = text
    if text:
        try:
            body = parse_json(text)
        except ValueError:
            pass
    location = response.headers.get("location")
    if 300 <= response.status < 400 and location and not body:
        body = f"redirected to {_safe_url(location)}; point the URL there"
    return StatusError(response, body)


def _reason(exc: BaseException) -> str:
    """An error in words (urllib3's and the OS's text hold no request data)."""
    inner = exc
    for _ in range(6):
        nxt = getattr(inner, "reason", None) or inner.__cause__ or inner.__context__
        if not isinstance(nxt, BaseException) or nxt is inner:
            break
        inner = nxt
    if isinstance(inner, ConnectionRefusedError) or "Connection refused" in str(exc):
        return "connection refused"
    if isinstance(inner, socket.gaierror) or isinstance(exc, u3.NameResolutionError):
        return "name resolution failed"
    text = getattr(inner, "strerror", None) or str(inner)
    return text[:300] or type(inner).__name__
