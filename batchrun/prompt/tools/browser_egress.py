"""The browser's egress guard: one prompt's address checks and its checking HTTP proxy.

Chromium runs on the host, not in the prompt's sandbox, so unless WEB_ALLOW_PRIVATE_ADDRESSES is
set a prompt's browser context reaches only public addresses. ``AddressGuard`` checks the URLs the
page requests (through ``context.route``) and keeps what it refused; ``EgressProxy`` is the
context's HTTP proxy on 127.0.0.1 that resolves each host itself and connects only to an address it
checked, so redirect hops, WebSockets and DNS rebinding meet the same check (see browser.py).
"""

from __future__ import annotations

import collections
import socket
import urllib.parse
from typing import TYPE_CHECKING, Any

from batchrun.prompt.tools import web

if TYPE_CHECKING:  # asyncio is imported where the proxy runs (see browser.py)
    import asyncio

MAX_LOGGED = 200  # refusals and failures kept per prompt

REFUSED_HEADER = "X-Batch-Runner-Refused"  # on the proxy's answer for a refused plain-http request
FAILED_HEADER = "X-Batch-Runner-Failed"  # on its answer when the host cannot be resolved or reached
ROUTED_SCHEMES = ("http", "https")  # checked; data:, blob: and about: stay inside the browser
_CHECK_TTL_S = 30.0  # how long the route check trusts a host's verdict (the proxy checks every connection)
_PROXY_HEAD_LIMIT = 64 * 1024
_PROXY_CONNECT_TIMEOUT_S = 30.0
_HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate"}


def refusal_message(tool: str, url: str, ip: str, via: str | None = None) -> str:
    if via and via != url:
        return f"{tool}: {url} led to {via}, which resolves to a private address ({ip}); refused"
    return f"{tool}: {url} resolves to a private address ({ip}); refused"


def _host_port(url: str) -> tuple[str, int] | None:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname, port or (443 if parts.scheme in ("https", "wss") else 80)


class AddressGuard:
    """One prompt's address checks (on the browser loop) and the requests it refused."""

    def __init__(self, allow_private: bool = False) -> None:
        # WEB_ALLOW_PRIVATE_ADDRESSES: nothing refused; the proxy still carries the context's requests
        # where Chromium has no network but the way to it (browser_sandbox.py)
        self.allow_private = allow_private
        # (number, url or host:port, address or net::ERR_... code), the latest MAX_LOGGED of each
        self.refused: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=MAX_LOGGED)
        self.failed: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=MAX_LOGGED)
        self.events = 0  # refusals and failures so far: a mark for ``since``
        self._verdicts: dict[tuple[str, int], tuple[float, str | None]] = {}

    def record(self, what: str, ip: str) -> None:
        """A request refused: ``what`` (URL or host:port) resolves to ``ip`` (or another reason)."""
        self.events += 1
        self.refused.append((self.events, what, ip))

    def record_failure(self, what: str, code: str) -> None:
        """The proxy could not resolve or reach ``what``: ``code`` as Chromium would say it."""
        self.events += 1
        self.failed.append((self.events, what, code))

    @staticmethod
    def since(mark: int, log: collections.deque[tuple[int, str, str]]) -> list[tuple[str, str]]:
        return [(what, why) for n, what, why in log if n > mark]

    async def resolve(self, host: str, port: int) -> list[tuple[Any, ...]]:
        """``web.resolve_public`` off the loop (``web.resolve_any`` where nothing is refused):
        PrivateAddressError, OSError, or the addresses."""
        import asyncio

        resolve = web.resolve_any if self.allow_private else web.resolve_public
        return await asyncio.get_running_loop().run_in_executor(None, resolve, host, port)

    async def private_ip(self, url: str) -> str | None:
        """The non-public address ``url``'s host resolves to, "" for an unparsable URL, else None
        (also when the name does not resolve: the proxy then fails the request itself). Verdicts
        are kept a little while; the proxy checks every connection regardless."""
        import asyncio

        if self.allow_private:
            return None
        where = _host_port(url)
        if where is None:
            return ""
        key = (where[0].lower(), where[1])
        now = asyncio.get_running_loop().time()
        cached = self._verdicts.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            await self.resolve(*where)
            verdict = None
        except web.PrivateAddressError as exc:
            verdict = exc.ip
        except OSError:
            verdict = None  # the proxy, resolving again, says what is wrong
        if len(self._verdicts) > 1000:
            self._verdicts.clear()
        self._verdicts[key] = (now + _CHECK_TTL_S, verdict)
        return verdict


class EgressProxy:
    """An HTTP proxy on 127.0.0.1 for one prompt's browser context that only connects to public
    addresses, each one checked on the connection that uses it (see the module docstring).

    CONNECT (https, wss) is tunnelled as bytes; a plain-http request is sent on as the only
    request of its connection (``Connection: close`` both ways), so a kept-alive client connection
    can never carry a request to a host that was not checked."""

    def __init__(self, guard: AddressGuard):
        self.guard = guard
        self.server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen on 127.0.0.1, or on ``sock`` (listening on 127.0.0.1 in Chromium's own network
        namespace, browser_sandbox.listen_in)."""
        import asyncio

        if sock is not None:
            self.server = await asyncio.start_server(self._serve, sock=sock, limit=_PROXY_HEAD_LIMIT)
        else:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_PROXY_HEAD_LIMIT)

    async def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _answer(self, writer: asyncio.StreamWriter, status: str, text: str, extra: str = "") -> None:
        body = text.encode("utf-8")
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nProxy-Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _connect(
        self, host: str, port: int, what: str, client: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to a checked address of ``host``, or None after answering the client."""
        import asyncio

        try:
            infos = await self.guard.resolve(host, port)
        except web.PrivateAddressError as exc:
            self.guard.record(what, exc.ip)
            message = f"Refused: {what} resolves to a private address ({exc.ip}); the browser only reaches public addresses."
            await self._answer(client, "403 Forbidden", message, f"{REFUSED_HEADER}: {exc.ip}\r\n")
            return None
        except OSError as exc:
            await self._fail(client, what, "net::ERR_NAME_NOT_RESOLVED", f"cannot resolve {host}: {exc}")
            return None
        error: Exception | None = None
        for info in infos:
            sockaddr = info[4]
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(sockaddr[0], sockaddr[1], limit=_PROXY_HEAD_LIMIT),
                    _PROXY_CONNECT_TIMEOUT_S,
                )
            except (OSError, asyncio.TimeoutError) as exc:
                error = exc
        if isinstance(error, ConnectionRefusedError):
            code = "net::ERR_CONNECTION_REFUSED"
        elif isinstance(error, (TimeoutError, asyncio.TimeoutError)):
            code = "net::ERR_CONNECTION_TIMED_OUT"
        else:
            code = "net::ERR_CONNECTION_FAILED"
        await self._fail(client, what, code, f"cannot connect to {host}:{port}: {error}")
        return None

    async def _fail(self, client: asyncio.StreamWriter, what: str, code: str, text: str) -> None:
        """Chromium shows a failed CONNECT only as ERR_TUNNEL_CONNECTION_FAILED and a plain-http
        502 as a page: record what went wrong, so browser_navigate can say it as Chromium would."""
        self.guard.record_failure(what, code)
        await self._answer(client, "502 Bad Gateway", text, f"{FAILED_HEADER}: {code}\r\n")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import asyncio

        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)).decode("latin-1")
            lines = head.split("\r\n")
            method, target, version = lines[0].split(" ", 2)
            if method.upper() == "CONNECT":
                where = _host_port(f"//{target}")
                if where is None:
                    await self._answer(writer, "400 Bad Request", f"bad CONNECT target {target!r}")
                    return
                opened = await self._connect(where[0], where[1], target, writer)
                if opened is None:
                    return
                up_reader, upstream = opened
                self._writers.add(upstream)
                writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                await writer.drain()
                await _relay(reader, writer, up_reader, upstream)
                return
            parts = urllib.parse.urlsplit(target)
            where = _host_port(target) if parts.scheme.lower() == "http" else None
            if where is None:
                await self._answer(
                    writer, "400 Bad Request", f"this proxy forwards http:// URLs only, not {target!r}"
                )
                return
            opened = await self._connect(where[0], where[1], target, writer)
            if opened is None:
                return
            up_reader, upstream = opened
            self._writers.add(upstream)
            path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            kept = [
                line
                for line in lines[1:]
                if line and line.split(":", 1)[0].strip().lower() not in _HOP_HEADERS
            ]
            upstream.write(f"{method} {path} {version}\r\n".encode("latin-1"))
            upstream.write("".join(f"{line}\r\n" for line in [*kept, "Connection: close"]).encode("latin-1"))
            upstream.write(b"\r\n")
            body = asyncio.ensure_future(_copy(reader, upstream))  # a request body, if any
            try:
                while True:
                    raw = await up_reader.readuntil(b"\r\n\r\n")
                    answer = raw.decode("latin-1").split("\r\n")
                    status = (answer[0].split(" ", 2) + [""])[1]
                    if status.startswith("1") and status != "101":
                        writer.write(raw)  # 100 Continue, 103 Early Hints: the final answer follows
                        continue
                    break
                if status == "101":  # an upgrade: the connection is the protocol's from now on
                    body.cancel()
                    writer.write(raw)
                    await _relay(reader, writer, up_reader, upstream)
                    return
                kept = [
                    line
                    for line in answer[1:]
                    if line and line.split(":", 1)[0].strip().lower() not in _HOP_HEADERS
                ]
                lines_out = [answer[0], *kept, "Connection: close", "Proxy-Connection: close"]
                writer.write("".join(f"{line}\r\n" for line in lines_out).encode("latin-1") + b"\r\n")
                await _copy(up_reader, writer)
            finally:
                body.cancel()
        except (
            OSError,
            EOFError,
            ValueError,
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass  # a client or server that went away or spoke nonsense: drop the connection
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._writers.discard(w)
                    w.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    import asyncio

    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass


async def _relay(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copy both ways until either side closes."""
    import asyncio

    tasks = [
        asyncio.ensure_future(_copy(a_reader, b_writer)),
        asyncio.ensure_future(_copy(b_reader, a_writer)),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
