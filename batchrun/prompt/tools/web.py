"""The ``web`` toolset: web_search through a configured provider, web_extract fetching pages itself.

Providers speak their own HTTP APIs (Tavily, Brave, SearXNG JSON, Exa, Firecrawl); which one and
where is read from the environment (batchrun/prompt/tools/config.py), so tests point them at a local fake.
web_extract fetches each URL with the standard library under a time, size and content-type
limit and turns HTML into markdown with BeautifulSoup + markdownify, keeping the main content
(``<main>``, ``<article>``) and dropping scripts, navigation and footers: in a child process bounded
in time and memory, and reading only the charsets browsers know (batchrun/prompt/tools/html_text.py).

web_extract runs on the host, not in the prompt's sandbox, so unless WEB_ALLOW_PRIVATE_ADDRESSES
is set it only reaches public addresses: each connection (the first URL and every redirect hop)
resolves the host, refuses it if ANY of its addresses is loopback, private, link-local, multicast,
reserved or unspecified, or one of this machine's own (``resolve_public``), and then connects to
one of the addresses it checked, so a DNS answer that changes between check and connect
(rebinding) cannot slip through. The
search providers' base URLs are the operator's configuration and are fetched unchecked.
"""

from __future__ import annotations

import contextvars
import http.client
import ipaddress
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from email.message import Message
from typing import Any

from batchrun.prompt.tools.config import SearchConfig, ToolSettings, extract_config, search_config
from batchrun.prompt.tools.html_text import (  # noqa: F401 (html_to_markdown: where it was)
    ConversionError,
    convert_html,
    decode_text,
    html_to_markdown,
)
from batchrun.prompt.tools.registry import (
    Tool,
    ToolArgumentError,
    ToolContext,
    register,
    register_toolset_check,
)
from batchrun.sharegpt import parse_json

MAX_URLS = 5  # per web_extract call, as in the reference
MIN_PAGE_CHARS = 2000  # the results budget never cuts a page below this
MAX_DESCRIPTION_CHARS = 500  # per search result
_TEXT_TYPES = (
    "text/",
    "application/json",
    "application/xml",
    "application/javascript",
    "application/ld+json",
)
_HTML_TYPES = ("text/html", "application/xhtml+xml")


# ----------------------------------------------------------------------------- fetching


class FetchError(Exception):
    """A URL could not be fetched within the limits; the message is shown to the model."""


@dataclass(frozen=True)
class Fetched:
    url: str  # after redirects
    status: int
    content_type: str  # lower-case media type without parameters; "" when the server sent none
    charset: str | None
    body: bytes


class AddressRefused(FetchError):
    """A URL (or a redirect hop) whose host resolves to an address that is not public."""

    def __init__(self, url: str, ip: str):
        super().__init__(f"{url} resolves to a private address ({ip}); refused")
        self.url = url
        self.ip = ip


class PrivateAddressError(Exception):
    """``resolve_public``: ``host`` resolved to ``ip``, which is not a public address."""

    def __init__(self, host: str, ip: str):
        super().__init__(f"{host} resolves to a private address ({ip})")
        self.host = host
        self.ip = ip


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_private_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True unless ``ip`` is a globally routable unicast address: loopback, private, link-local,
    multicast, reserved, unspecified, shared (100.64/10)... IPv6 forms that carry an IPv4 address
    (IPv4-mapped, NAT64, 6to4) are judged by that IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_private_address(ip.ipv4_mapped)
        if ip in _NAT64:
            return is_private_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None:
            return is_private_address(ip.sixtofour)
        ip = ipaddress.IPv6Address(int(ip))  # without a %scope
    return (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    )


def resolve_any(host: str, port: int) -> list[tuple[Any, ...]]:
    """``socket.getaddrinfo`` results (TCP) for ``host``, whatever its addresses, within the fetch's
    deadline if this thread is making one (OSError when the name does not resolve): what a fetch, or the
    browser's egress proxy, connects to where nothing is refused (WEB_ALLOW_PRIVATE_ADDRESSES)."""
    infos = _getaddrinfo(host, port)
    if not infos:
        raise OSError(f"{host} has no address")
    return infos


def resolve_public(host: str, port: int) -> list[tuple[Any, ...]]:
    """``resolve_any``, after checking EVERY address: raises PrivateAddressError if any is not public
    (OSError when the name does not resolve). Connect to these very addresses, not to the name, so a
    second DNS answer cannot differ."""
    infos = resolve_any(host, port)
    for info in infos:
        raw = str(info[4][0])
        try:
            ip = ipaddress.ip_address(raw.split("%", 1)[0])
        except ValueError:
            raise PrivateAddressError(host, raw) from None
        if is_private_address(ip) or is_own_address(ip):
            raise PrivateAddressError(host, raw)
    return infos


def is_own_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` (without a %scope) (or the IPv4 address an IPv4-mapped one carries) is one of this machine's own
    addresses, public ones included: a host with a public address on an interface answers there with
    every service listening on 0.0.0.0, as on loopback. Read at each check (interfaces come and go)."""
    from batchrun.prompt.sandboxes.local.host import host_addresses  # only when a URL is checked

    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip) in host_addresses()


class _Deadline:
    """One fetch's whole deadline, held whatever http.client is doing. Socket timeouts bound each read
    alone: a server dripping a header byte a second, sending ``100 Continue`` responses or chunked
    trailers without end, kept a fetch going for as long as it liked. At the deadline every connection
    the fetch opened is shut down, which ends any read or loop there with end-of-file. A duplicate of
    each socket is kept for that: the same connection under TLS or after urllib closed its hop's socket,
    and a descriptor of our own, never one another thread reused."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s
        self.expired = False
        self.during = ""  # what the fetch was doing when it expired, where that is worth saying
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self.expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def watch(self, sock: socket.socket) -> None:
        dup = sock.dup()
        with self._lock:
            self._sockets.append(dup)
            if self.expired:
                _shut(dup)

    def message(self, url: str) -> str:
        """The fetch's error once it expired."""
        during = f" ({self.during})" if self.during else ""
        return f"{url} took longer than {self.timeout_s:g} s{during}"

    def expire(self, during: str = "") -> None:
        with self._lock:
            self.during = self.during or during  # the timer may have fired first, while resolving
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# The deadline of the fetch this thread is making (fetch_url sets it; its connections read it).
_DEADLINE: contextvars.ContextVar[_Deadline | None] = contextvars.ContextVar("fetch_deadline", default=None)
# The origin that fetch's address check spares (fetch_url's ``trusted_origin``), as origin() gives it.
_TRUSTED_ORIGIN: contextvars.ContextVar[tuple[str, str, int] | None] = contextvars.ContextVar(
    "fetch_trusted_origin", default=None
)


def origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, the port made explicit; None for anything else."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


# An answer's parts that http.client reads in loops bounded by the deadline alone: a server sending
# "100 Continue", trailer lines or chunk extensions (64 kB of them before each byte of the body) without
# end kept a core busy (1.6-1.8 s of CPU in a 2 s fetch, 30 s at the default WEB_TIMEOUT_S). urllib
# sends no "Expect: 100-continue", so any interim answer is unasked for; and extensions have no use here.
MAX_INTERIM_RESPONSES = 10
MAX_TRAILER_LINES = 100  # as many as http.client takes header lines
MAX_CHUNK_EXTENSION_BYTES = 65536  # in all the chunk size lines of a body


class EndlessResponse(http.client.HTTPException):
    """An answer with more interim responses or trailer lines than a fetch reads."""


class _BoundedResponse(http.client.HTTPResponse):
    """http.client's response with its two unbounded loops bounded in count (``EndlessResponse``)."""

    _interim = 0
    _extension_bytes = 0

    def _read_status(self) -> tuple[str, int, str]:  # begin() calls it once per response, interim ones too
        version, status, reason = super()._read_status()  # type: ignore[misc]
        if status == http.client.CONTINUE:
            self._interim += 1
            if self._interim > MAX_INTERIM_RESPONSES:
                raise EndlessResponse(f"more than {MAX_INTERIM_RESPONSES} interim (100 Continue) responses")
        return version, status, reason

    def _read_next_chunk_size(self) -> int:  # http.client's, counting the extensions' bytes
        line = self.fp.readline(http.client._MAXLINE + 1)  # type: ignore[attr-defined]
        if len(line) > http.client._MAXLINE:  # type: ignore[attr-defined]
            raise http.client.LineTooLong("chunk size")
        line, _, extension = line.partition(b";")
        self._extension_bytes += len(extension)
        if self._extension_bytes > MAX_CHUNK_EXTENSION_BYTES:
            raise EndlessResponse(f"more than {MAX_CHUNK_EXTENSION_BYTES} bytes of chunk extensions")
        try:
            return int(line, 16)
        except ValueError:
            self._close_conn()  # type: ignore[attr-defined]
            raise

    def _read_and_discard_trailer(self) -> None:  # http.client's, with a count
        for _ in range(MAX_TRAILER_LINES + 1):
            line = self.fp.readline(http.client._MAXLINE + 1)  # type: ignore[attr-defined]
            if len(line) > http.client._MAXLINE:  # type: ignore[attr-defined]
                raise http.client.LineTooLong("trailer line")
            if line in (b"\r\n", b"\n", b""):
                return
        raise EndlessResponse(f"more than {MAX_TRAILER_LINES} trailer lines after a chunked body")


def _getaddrinfo(host: str, port: int) -> list[tuple[Any, ...]]:
    """``socket.getaddrinfo`` (TCP) within the deadline of the fetch this thread is making, if any.
    getaddrinfo cannot be interrupted, and a name whose DNS server never answers held a 2 s fetch for
    10 s (glibc's 5 s timeout, twice; resolv.conf may make it minutes): it runs on a thread of its own,
    waited for only until the deadline, then left to glibc's timeout to end."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    got: list[Any] = []
    done = threading.Event()

    def resolve() -> None:
        try:
            got.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the fetch's thread
            got.append(exc)
        done.set()

    threading.Thread(target=resolve, name="fetch-resolve", daemon=True).start()
    if not done.wait(max(0.0, deadline.remaining())):
        deadline.expire(during=f"resolving {host}")
        raise TimeoutError(f"resolving {host} timed out")
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def _connect(url: str, host: str, port: int, timeout: Any, source: Any, check: bool) -> socket.socket:
    """A TCP connection to ``host``, through ``resolve_public`` when ``check`` (AddressRefused naming
    ``url``), each attempt within the fetch's deadline and the connection watched by it."""
    if check:
        try:
            infos = resolve_public(host, port)
        except PrivateAddressError as exc:
            raise AddressRefused(url, exc.ip) from None
    else:
        infos = resolve_any(host, port)
    deadline = _DEADLINE.get()
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        limit = None if timeout is socket._GLOBAL_DEFAULT_TIMEOUT else timeout  # type: ignore[attr-defined]
        if deadline is not None:
            left = deadline.remaining()
            if left <= 0:
                raise TimeoutError("timed out")
            limit = left if limit is None else min(limit, left)
        sock = socket.socket(family, kind, proto)
        try:
            if limit is not None:
                sock.settimeout(limit)
            if source:
                sock.bind(source)
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        if deadline is not None:
            deadline.watch(sock)
        return sock
    raise error or OSError(f"could not connect to {host}")


def _checked_connection(
    conn_class: type[http.client.HTTPConnection], req: urllib.request.Request, public_only: bool
):
    """What ``do_open`` calls to make its connection: one within the fetch's deadline, and with
    ``public_only`` one that only reaches public addresses."""
    url = req.full_url
    target = urllib.parse.urlsplit(url)
    host = target.hostname or ""
    port = target.port or (443 if target.scheme == "https" else 80)
    trusted = _TRUSTED_ORIGIN.get()
    public_only = public_only and (trusted is None or origin(url) != trusted)

    def make(netloc: str, **kwargs: Any) -> http.client.HTTPConnection:
        conn = conn_class(netloc, **kwargs)
        conn.response_class = _BoundedResponse
        through_proxy = bool(req._tunnel_host) or req.selector.lower().startswith(  # type: ignore[attr-defined]
            ("http://", "https://")
        )
        if through_proxy and public_only:
            # An operator's proxy (http_proxy...) resolves the name itself: check it here, best
            # effort (a name only the proxy can resolve is left to the proxy).
            try:
                resolve_public(host, port)
            except PrivateAddressError as exc:
                raise AddressRefused(url, exc.ip) from None
            except OSError:
                pass
        check = public_only and not through_proxy  # the proxy's own address is the operator's
        conn._create_connection = lambda address, timeout, source=None: _connect(  # type: ignore[attr-defined]
            url, address[0], address[1], timeout, source, check
        )
        return conn

    return make


class _CheckedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, public_only: bool):
        super().__init__()
        self.public_only = public_only

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(_checked_connection(http.client.HTTPConnection, req, self.public_only), req)


class _CheckedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, public_only: bool):
        super().__init__()
        self.public_only = public_only

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(
            _checked_connection(http.client.HTTPSConnection, req, self.public_only),
            req,
            context=self._context,  # type: ignore[attr-defined]
        )


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = 5

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise FetchError(f"redirect to a non-http(s) URL refused: {newurl}")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            # urllib then reads the redirect's body to its end, into memory, with no bound: a 302
            # whose body never ends took 2.5 GB in 4 s. Closed here, that read finds nothing.
            fp.close()
        return new


def _opener(public_only: bool) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(
        _CheckedHTTPHandler(public_only), _CheckedHTTPSHandler(public_only), _Redirects()
    )


# Every connection they make, redirect hops included, keeps the fetch's deadline; the public one's go
# through resolve_public.
_OPENER = _opener(public_only=False)
_PUBLIC_OPENER = _opener(public_only=True)


def check_http_url(url: str) -> str:
    """The URL stripped, or ToolArgumentError unless it is an absolute http(s) URL."""
    url = url.strip()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ToolArgumentError(f"not an http(s) URL: {url!r}")
    return url


def fetch_url(
    url: str,
    *,
    max_bytes: int,
    timeout_s: float,
    user_agent: str = "batch-runner/1.0",
    accept: tuple[str, ...] | None = None,
    method: str = "GET",
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    public_only: bool = False,
    trusted_origin: str | None = None,
) -> Fetched:
    """Fetch ``url`` (http/https only), giving up past ``timeout_s`` (the whole fetch: DNS, connections,
    redirects, headers and body) or ``max_bytes``.

    ``accept``: media-type prefixes allowed (others raise FetchError before the body is read).
    ``public_only``: refuse (AddressRefused) a URL or redirect hop whose host resolves to a
    non-public address, and connect only to the addresses checked. For URLs a model chose.
    ``trusted_origin``: with ``public_only``, a URL (the first or a redirect hop) on the origin of this
    URL (scheme, host, port) is not checked: an endpoint the operator configured, whose other URLs it
    may hand back (an images endpoint's files). Every hop elsewhere still is.
    """
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        # urllib's opener also reads file:, ftp: and data: URLs, none of them through the address check:
        # an ftp:// URL an images endpoint answered connected to a loopback port and sent "USER anonymous".
        raise FetchError(f"could not fetch {url}: not an http(s) URL")
    deadline = _Deadline(timeout_s)
    token = _DEADLINE.set(deadline)
    trust = _TRUSTED_ORIGIN.set(origin(trusted_origin) if trusted_origin else None)
    try:
        return _fetch(
            url, deadline, max_bytes, timeout_s, user_agent, accept, method, data, headers, public_only
        )
    except (http.client.HTTPException, TimeoutError, OSError) as exc:
        if deadline.expired:
            raise FetchError(deadline.message(url)) from None
        # A malformed answer (a status line that is not HTTP, too many or too long header lines,
        # a chunked body cut short): http.client's errors are not OSErrors, and escaped the caller.
        shown = str(exc)[:200] or type(exc).__name__
        raise FetchError(f"could not fetch {url}: {type(exc).__name__}: {shown!r}") from None
    finally:
        _TRUSTED_ORIGIN.reset(trust)
        _DEADLINE.reset(token)
        deadline.close()


def _fetch(
    url: str,
    deadline: _Deadline,
    max_bytes: int,
    timeout_s: float,
    user_agent: str,
    accept: tuple[str, ...] | None,
    method: str,
    data: bytes | None,
    headers: dict[str, str] | None,
    public_only: bool,
) -> Fetched:
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("User-Agent", user_agent)
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        resp = (_PUBLIC_OPENER if public_only else _OPENER).open(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        detail = _error_detail(exc)
        raise FetchError(f"HTTP {exc.code} {exc.reason} from {url}{detail}") from None
    except urllib.error.URLError as exc:
        if deadline.expired:
            raise FetchError(deadline.message(url)) from None
        raise FetchError(f"could not fetch {url}: {exc.reason}") from None
    with resp:
        msg: Message = resp.headers
        content_type = (msg.get_content_type() if msg.get("Content-Type") else "").lower()
        charset = msg.get_content_charset()
        if accept is not None and content_type and not content_type.startswith(accept):
            raise FetchError(f"{url} is {content_type}, not one of: {', '.join(accept)}")
        length = msg.get("Content-Length")
        if length and length.isdigit() and int(length) > max_bytes:
            raise FetchError(f"{url} is {int(length)} bytes, over the limit of {max_bytes} bytes")
        chunks: list[bytes] = []
        got = 0
        try:
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                got += len(chunk)
                if got > max_bytes:
                    raise FetchError(
                        f"{url} is larger than the limit of {max_bytes} bytes (sent without a length)"
                    )
                chunks.append(chunk)
        except (TimeoutError, OSError) as exc:
            if deadline.expired:
                raise
            raise FetchError(f"reading {url} failed: {exc or type(exc).__name__}") from None
        if deadline.expired:  # the shut connection read as the body's end
            raise FetchError(deadline.message(url))
        if resp.length:  # what Content-Length promised and the connection's end did not bring
            raise FetchError(
                f"{url} was cut: {got} of the {got + resp.length} bytes its Content-Length gives"
            )
        return Fetched(resp.geturl(), resp.status, content_type, charset, b"".join(chunks))


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read(300).decode("utf-8", errors="replace").strip()
    except Exception:
        return ""
    return f": {' '.join(text.split())[:200]}" if text else ""


# ----------------------------------------------------------------------------- HTML -> markdown


def _looks_like_html(body: bytes) -> bool:
    head = body[:1024].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html")) or b"<body" in body[:4096].lower()


# ----------------------------------------------------------------------------- web_extract


def _extract_one(url: str, budget_chars: int, ctx: ToolContext, deadline: float) -> dict[str, Any]:
    """One URL's entry, its fetch and its conversion each within WEB_TIMEOUT_S and all by ``deadline``."""
    cfg = extract_config(ctx.settings)
    entry: dict[str, Any] = {"url": url, "title": "", "content": "", "error": None}

    def time_left() -> float:
        left = min(cfg.timeout_s, deadline - time.monotonic())
        if left <= 0:
            raise FetchError(f"{url} not read: the call's time limit of {ctx.tool_timeout_s:g} s was reached")
        return left

    try:
        url = check_http_url(url)
        page = fetch_url(
            url,
            max_bytes=cfg.max_bytes,
            timeout_s=time_left(),
            user_agent=cfg.user_agent,
            headers={"Accept": "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"},
            public_only=not cfg.allow_private,
        )
    except AddressRefused as exc:
        entry["error"] = f"web_extract: {exc}"
        return entry
    except (FetchError, ToolArgumentError) as exc:
        entry["error"] = str(exc)
        return entry
    kind = page.content_type
    if kind.startswith(_HTML_TYPES) or (not kind and _looks_like_html(page.body)):
        try:  # in a child process, within the page's time and memory (see html_text.py)
            title, text, length = convert_html(page.body, page.url, page.charset, budget_chars, time_left())
        except ConversionError as exc:  # a page the parser chokes on fails alone, not the whole call
            entry["error"] = f"could not convert {url} to text: {exc}"
            return entry
        except FetchError as exc:
            entry["error"] = str(exc)
            return entry
    elif kind.startswith(_TEXT_TYPES) or not kind:
        text = decode_text(page.body, page.charset)
        title, length = "", len(text)
        if not kind and "\x00" in text[:4096]:
            entry["error"] = f"{url} sent binary data without a content type; web_extract reads text pages"
            return entry
    else:
        entry["error"] = (
            f"{url} is {kind}; web_extract reads HTML and text pages only "
            "(for other content, download it in the terminal if one is offered)"
        )
        return entry
    if page.url != url:
        entry["final_url"] = page.url
    entry["title"] = title
    entry["content_type"] = kind or "unknown"
    entry["content"] = text[:budget_chars]
    if length > budget_chars:
        entry["truncated"] = f"content cut at {budget_chars} of {length} characters"
    if not text.strip():
        entry["note"] = "the page has no text content (it may be built by JavaScript; try the browser)"
    return entry


def web_extract(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    urls = args["urls"]
    if isinstance(urls, str):
        urls = [urls]
    if not urls or not all(isinstance(u, str) and u.strip() for u in urls):
        raise ToolArgumentError("urls must be a non-empty list of URL strings")
    if len(urls) > MAX_URLS:
        raise ToolArgumentError(f"at most {MAX_URLS} URLs per call, got {len(urls)}")
    cfg = extract_config(ctx.settings)
    share = max(MIN_PAGE_CHARS, (ctx.output_cap_bytes - 1024) // len(urls))
    budget = min(cfg.max_chars, share)
    # The call's limit holds for all its URLs together: each got WEB_TIMEOUT_S of its own, so five
    # slow ones took five times the tool's timeout, past the prompt's deadline.
    deadline = time.monotonic() + ctx.tool_timeout_s
    results = [_extract_one(u, budget, ctx, deadline) for u in urls]
    out: dict[str, Any] = {"results": results}
    if all(r["error"] for r in results):
        out["error"] = "; ".join(r["error"] for r in results)
    return out


# ----------------------------------------------------------------------------- web_search


def _call_json(cfg: SearchConfig, url: str, *, body: dict | None = None, headers: dict[str, str]) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"Accept": "application/json", **headers}
    if data is not None:
        hdrs["Content-Type"] = "application/json"
    page = fetch_url(
        url,
        max_bytes=5_000_000,
        timeout_s=cfg.timeout_s,
        method="POST" if data is not None else "GET",
        data=data,
        headers=hdrs,
    )
    try:
        return parse_json(decode_text(page.body, page.charset))
    except ValueError:
        raise FetchError(f"{cfg.provider} answered with something that is not JSON") from None


def _rows(items: Any, desc_keys: tuple[str, ...]) -> list[dict[str, str]]:
    rows = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or not item.get("url"):
            continue
        desc = next((item[k] for k in desc_keys if isinstance(item.get(k), str) and item[k]), "")
        if not desc and isinstance(item.get("highlights"), list):
            desc = " … ".join(h for h in item["highlights"] if isinstance(h, str))
        desc = " ".join(str(desc).split())
        if len(desc) > MAX_DESCRIPTION_CHARS:
            desc = desc[:MAX_DESCRIPTION_CHARS] + "…"
        rows.append({"title": str(item.get("title") or ""), "url": str(item["url"]), "description": desc})
    return rows


def _search(cfg: SearchConfig, query: str, n: int) -> list[dict[str, str]]:
    base = cfg.base_url
    if cfg.provider == "tavily":
        data = _call_json(
            cfg,
            f"{base}/search",
            body={"query": query, "max_results": n, "search_depth": "basic"},
            headers={"Authorization": f"Bearer {cfg.api_key}"},
        )
        return _rows(data.get("results"), ("content",))
    if cfg.provider == "brave":
        qs = urllib.parse.urlencode({"q": query, "count": n})
        data = _call_json(
            cfg, f"{base}/res/v1/web/search?{qs}", headers={"X-Subscription-Token": cfg.api_key or ""}
        )
        return _rows((data.get("web") or {}).get("results"), ("description",))
    if cfg.provider == "searxng":
        qs = urllib.parse.urlencode({"q": query, "format": "json"})
        data = _call_json(cfg, f"{base}/search?{qs}", headers={})
        return _rows(data.get("results"), ("content",))
    if cfg.provider == "exa":
        data = _call_json(
            cfg,
            f"{base}/search",
            body={"query": query, "numResults": n, "contents": {"text": {"maxCharacters": 500}}},
            headers={"x-api-key": cfg.api_key or ""},
        )
        return _rows(data.get("results"), ("summary", "text"))
    # firecrawl: v2 answers {"data": {"web": [...]}}, v1 answered {"data": [...]}
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    data = _call_json(cfg, f"{base}/v2/search", body={"query": query, "limit": n}, headers=headers)
    items = data.get("data")
    if isinstance(items, dict):
        items = items.get("web")
    return _rows(items, ("description", "markdown"))


def web_search(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    query = args["query"].strip()
    if not query:
        raise ToolArgumentError("query must not be empty")
    cfg = search_config(ctx.settings)
    if cfg is None:
        return {"error": "web search is not configured (set WEB_SEARCH_PROVIDER and its API key)"}
    cfg = SearchConfig(
        cfg.provider, cfg.base_url, cfg.api_key, cfg.max_results, min(cfg.timeout_s, ctx.tool_timeout_s)
    )
    try:
        rows = _search(cfg, query, cfg.max_results)
    except FetchError as exc:
        return {"error": f"search failed ({cfg.provider}): {_redact(str(exc), cfg.api_key)}"}
    results = [{**row, "position": i + 1} for i, row in enumerate(rows[: cfg.max_results])]
    out: dict[str, Any] = {"success": True, "query": query, "results": results}
    if not results:
        out["note"] = "no results; try other words"
    return out


def _redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def _web_configured(settings: ToolSettings) -> bool:
    # web_extract's settings (vision_analyze's fetches read them too) are checked at start as well: a bad
    # WEB_EXTRACT_MAX_BYTES let the run start and failed every web_extract call.
    extract_config(settings)
    return search_config(settings) is not None


# ----------------------------------------------------------------------------- registration

register_toolset_check(
    "web", _web_configured, "a search provider: WEB_SEARCH_PROVIDER with its API key, or SEARXNG_URL"
)

register(
    Tool(
        name="web_search",
        toolset="web",
        also_in=("browser",),
        description=(
            "Search the web. Returns up to 5 results, each with a title, URL and a short description. "
            "Use web_extract on the URLs to read the pages themselves."
        ),
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to search for."}},
            "required": ["query"],
        },
        handler=web_search,
        sandbox_network=False,  # on the host, or files only
    )
)

register(
    Tool(
        name="web_extract",
        toolset="web",
        description=(
            "Fetch web pages and return their main content as markdown (navigation, scripts and "
            "footers left out; links kept as absolute URLs), with each page's title. Takes up to 5 "
            "http(s) URLs. HTML and plain-text pages only: PDFs, images and other files are refused, "
            "and very large pages are cut. A URL that fails gets its own error while the others are "
            "still returned. Pages built by JavaScript may come back empty: use the browser tools then."
        ),
        parameters={
            "type": "object",
            "properties": {
                "urls": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "URLs to read (at most 5).",
                    "maxItems": MAX_URLS,
                }
            },
            "required": ["urls"],
        },
        handler=web_extract,
        sandbox_network=False,  # on the host, or files only
    )
)
