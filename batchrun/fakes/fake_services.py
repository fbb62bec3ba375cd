"""Local stand-ins for the web, for tests and zero-cost dry runs (standard library only).

:class:`FakeWebServer` serves, on one loopback port:

* a small web site under ``/site/`` (pages with navigation, links, images, a form driven by
  JavaScript, a long page, a redirect, a PDF, a slow page, a page built by script): see
  :func:`default_site` for the paths and the phrases each page holds; ``?delay=S`` delays any
  page; ``/site/big.html?bytes=N`` and ``/site/chunked.html?bytes=N`` (no Content-Length) are
  pages of about N bytes;
* the search APIs of the providers ``web_search`` supports, at the HTTP level, answering from
  the site's own pages: Tavily ``POST /tavily/search``, Brave ``GET /brave/res/v1/web/search``,
  SearXNG ``GET /searxng/search?format=json``, Exa ``POST /exa/search``, Firecrawl
  ``POST /firecrawl/v2/search``. Each checks its provider's auth header against ``api_key``.
  A query containing ``[error:CODE]`` gets HTTP CODE.

``server.provider_env("brave")`` gives the variables that point ``web_search`` at it.

Also here: :func:`make_png` (a solid-colour PNG of any size) and :func:`describe_images`, which the
fake model uses to answer vision requests with each image's type, size and digest, so a test can
tell which image bytes reached the model.

    python -m batchrun.fakes.fake_services --port 8001   # prints the base URL, serves until killed
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import html
import json
import re
import struct
import sys
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_API_KEY = "test-search-key"

# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def make_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A solid-colour 8-bit RGB PNG."""
    row = b"\x00" + bytes(rgb) * width
    raw = zlib.compress(row * height, 6)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def color_for(text: str) -> tuple[int, int, int]:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return digest[0], digest[1], digest[2]


def image_info(data: bytes) -> tuple[str, int | None, int | None]:
    """(media type, width, height) read from the header of a PNG, GIF, JPEG or BMP."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return "image/png", w, h
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return "image/gif", w, h
    if data.startswith(b"BM") and len(data) >= 26:
        w, h = struct.unpack("<ii", data[18:26])
        return "image/bmp", w, abs(h)
    if data.startswith(b"\xff\xd8"):
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                i += 1
                continue
            marker = data[i + 1]
            size = struct.unpack(">H", data[i + 2 : i + 4])[0]
            if marker in (0xC0, 0xC1, 0xC2):
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return "image/jpeg", w, h
            i += 2 + size
        return "image/jpeg", None, None
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp", None, None
    return "application/octet-stream", None, None


def describe_images(messages: list[dict[str, Any]]) -> str | None:
    """A sentence naming each image of the last user message: type, size and sha256 prefix."""
    for msg in reversed(messages):
        if not isinstance(msg, dict) or msg.get("role") != "user":
            continue
        content = msg.get("content")
        if not isinstance(content, list):
            return None
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            url = (part.get("image_url") or {}).get("url", "")
            n = len(parts) + 1
            if url.startswith("data:") and ";base64," in url:
                try:
                    data = base64.b64decode(url.split(",", 1)[1], validate=True)
                except (binascii.Error, ValueError):
                    parts.append(f"image {n}: invalid base64")
                    continue
                mime, w, h = image_info(data)
                dims = f"{w}x{h}" if w is not None else "unknown size"
                parts.append(f"image {n}: {mime} {dims}, sha256 {hashlib.sha256(data).hexdigest()[:12]}")
            else:
                parts.append(f"image {n}: {url} (not fetched)")
        return ("I see " + "; ".join(parts) + ".") if parts else None
    return None


# ---------------------------------------------------------------------------------------------
# The site
# ---------------------------------------------------------------------------------------------


@dataclass
class Page:
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


def _html(title: str, body: str, head: str = "") -> Page:
    doc = f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>{head}</head><body>{body}</body></html>"
    return Page(doc.encode("utf-8"))


_NAV = (
    "<nav><a href='/site/'>Home</a> | <a href='/site/articles/alpha.html'>Alpha</a> | "
    "<a href='/site/articles/beta.html'>Beta</a> | <a href='/site/gallery.html'>Gallery</a> | "
    "<a href='/site/form.html'>Search form</a> NAV-NOISE</nav>"
)
_FOOTER = "<footer>FOOTER-NOISE &copy; Fake Site</footer>"

RED = (220, 20, 30)
BLUE = (20, 40, 220)


def default_site() -> dict[str, Page]:
    """The pages of the fake site, by path below ``/site``. Each holds a distinctive phrase."""
    paragraphs = "".join(
        f"<p id='para-{i}'>Paragraph {i} of the long page. LONG-PAGE-TEXT {i}.</p>" for i in range(1, 121)
    )
    return {
        "/": _html(
            "Fake Site Home",
            f"<header><a href='/site/'>Fake Site</a></header>{_NAV}<main><h1>Welcome to the fake site</h1>"
            "<p>This site exists for tests. HOME-PAGE-TEXT.</p><ul>"
            "<li><a href='articles/alpha.html'>Read about Alpha Centauri</a></li>"
            "<li><a href='articles/beta.html'>Read about Beta Pictoris</a></li>"
            "<li><a href='gallery.html'>See the gallery</a></li>"
            "<li><a href='form.html'>Use the search form</a></li></ul></main>" + _FOOTER,
        ),
        "/articles/alpha.html": _html(
            "Alpha Centauri",
            f"{_NAV}<main><article><h1>Alpha Centauri</h1>"
            "<p>Alpha Centauri is the closest star system to the Sun. ALPHA-FACT: it lies 4.37 light-years away.</p>"
            "<h2>Components</h2><ul><li>Alpha Centauri A</li><li>Alpha Centauri B</li><li>Proxima Centauri</li></ul>"
            "<p>See also <a href='beta.html'>Beta Pictoris</a> and <a href='../gallery.html'>pictures</a>.</p>"
            "<img src='../img/red.png' alt='A red star'>"
            "</article></main><aside>ASIDE-NOISE related links</aside>"
            "<script>var s = 'SCRIPT-NOISE';</script><style>.x{color:red} STYLE-NOISE</style>" + _FOOTER,
        ),
        "/articles/beta.html": _html(
            "Beta Pictoris",
            f"{_NAV}<div class='content'><h1>Beta Pictoris</h1>"
            "<p>Beta Pictoris is a young star with a debris disk. BETA-FACT: it is about 63 light-years away.</p>"
            "<table><tr><th>Property</th><th>Value</th></tr><tr><td>Age</td><td>23 million years</td></tr></table>"
            "</div>" + _FOOTER,
        ),
        "/gallery.html": _html(
            "Gallery",
            f"{_NAV}<main><h1>Gallery</h1><p>GALLERY-TEXT: two pictures.</p>"
            "<img src='img/red.png' alt='A red rectangle' width='8' height='6'>"
            "<img src='/site/img/blue.png' alt='A blue square'>"
            "<img src='data:image/png;base64,"
            + base64.b64encode(make_png(2, 2, (0, 200, 0))).decode()
            + "' alt='An inline green dot'></main>",
        ),
        "/img/red.png": Page(make_png(8, 6, RED), "image/png"),
        "/img/blue.png": Page(make_png(4, 4, BLUE), "image/png"),
        "/form.html": _html(
            "Search form",
            f"{_NAV}<main><h1>Search the catalogue</h1>"
            "<form id='f'><label for='q'>Query</label><input id='q' name='q' type='text' placeholder='type here'>"
            "<button type='submit'>Search</button></form>"
            "<button id='more' type='button'>Show more</button>"
            "<button id='boom' type='button'>Break something</button>"
            "<p id='result'>No search yet.</p><p id='hidden-text' style='display:none'>MORE-TEXT revealed.</p>"
            "</main><script>"
            "console.log('FORM-READY');"
            "document.getElementById('f').addEventListener('submit', e => { e.preventDefault();"
            " const q = document.getElementById('q').value;"
            " document.getElementById('result').textContent = 'You searched for: ' + q;"
            " console.log('submitted ' + q); });"
            "document.getElementById('more').addEventListener('click', () => {"
            " document.getElementById('hidden-text').style.display = 'block'; });"
            "document.getElementById('boom').addEventListener('click', () => { throw new Error('BOOM-ERROR'); });"
            "</script>",
        ),
        "/long.html": _html(
            "Long page", f"<main><h1>Long page</h1>{paragraphs}<p>END-OF-LONG-PAGE</p></main>"
        ),
        "/script-only.html": _html(
            "Built by script",
            "<div id='app'></div><script>document.getElementById('app').innerHTML ="
            " '<h1>SCRIPT-BUILT-TEXT</h1><a href=\"/site/articles/alpha.html\">Alpha from script</a>';</script>",
        ),
        "/popup.html": _html(
            "Popup",
            "<main><a href='/site/articles/beta.html' target='_blank'>Open Beta in a new tab</a></main>",
        ),
        "/plain.txt": Page(b"PLAIN-TEXT-FILE line one\nline two\n", "text/plain; charset=utf-8"),
        "/doc.pdf": Page(b"%PDF-1.4\n1 0 obj <<>> endobj\ntrailer <<>>\n%%EOF\n", "application/pdf"),
        "/redirect": Page(b"", status=302, headers={"Location": "/site/articles/alpha.html"}),
        "/slow.html": _html("Slow page", "<main><p>SLOW-PAGE-TEXT</p></main>"),
        "/latin1.html": Page(
            "<html><head><title>Caf\xe9</title></head><body><main><p>CAF\xc9-TEXT cr\xe8me br\xfbl\xe9e</p></main></body></html>".encode(
                "latin-1"
            ),
            "text/html; charset=iso-8859-1",
        ),
    }


class _TextOf(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.title = ""
        self._skip = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        self._in_title = tag == "title"

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1
        self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skip:
            self.parts.append(data)


def page_text(page: Page) -> tuple[str, str]:
    """(title, visible text) of an HTML or text page; ("", "") for anything else."""
    if page.content_type.startswith("text/plain"):
        return "", page.body.decode("utf-8", errors="replace")
    if not page.content_type.startswith("text/html"):
        return "", ""
    parser = _TextOf()
    parser.feed(page.body.decode("utf-8", errors="replace"))
    return parser.title.strip(), " ".join(" ".join(parser.parts).split())


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    fake: FakeWebServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # the client gave up (a timeout under test); nothing to report
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeWeb/1.0"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def _send(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode("utf-8"), "application/json")

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        self._route("GET", b"")

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        self._route("POST", self.rfile.read(length) if length else b"")

    def _route(self, method: str, raw: bytes) -> None:
        fake = self.server.fake
        parts = urllib.parse.urlsplit(self.path)
        path, query = parts.path, urllib.parse.parse_qs(parts.query)
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            body = {}
        fake._log(method, path, {k.lower(): v for k, v in self.headers.items()}, body, query)
        if path == "/site" or path.startswith("/site/"):
            self._site(path[len("/site") :] or "/", query)
            return
        provider = path.strip("/").split("/", 1)[0]
        route = {
            ("POST", "/tavily/search"): "tavily",
            ("GET", "/brave/res/v1/web/search"): "brave",
            ("GET", "/searxng/search"): "searxng",
            ("POST", "/exa/search"): "exa",
            ("POST", "/firecrawl/v2/search"): "firecrawl",
            ("POST", "/firecrawl/v1/search"): "firecrawl",
        }.get((method, path.rstrip("/")))
        if route is None:
            self._json(404, {"error": f"no route {method} {path} ({provider})"})
            return
        self._search(route, path, body, query)

    # -- the site --------------------------------------------------------------------------

    def _site(self, path: str, query: dict[str, list[str]]) -> None:
        fake = self.server.fake
        if path == "/big.html":
            size = int(query.get("bytes", ["2000000"])[0])
            filler = b"<p>" + b"BIG " * 20 + b"</p>"
            body = b"<html><body><main>" + filler * (size // len(filler) + 1) + b"</main></body></html>"
            self._send(200, body, "text/html; charset=utf-8")
            return
        if path == "/chunked.html":  # no Content-Length: the reader must count the bytes itself
            size = int(query.get("bytes", ["2000000"])[0])
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            piece = b"<p>" + b"CHUNK " * 100 + b"</p>"
            for _ in range(size // len(piece) + 1):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        page = fake.pages.get(path)
        if page is None:
            self._send(404, b"<html><body><h1>Not found</h1></body></html>", "text/html; charset=utf-8")
            return
        delay = float(query.get("delay", [page.delay_s])[0])
        if delay > 0:
            time.sleep(min(delay, 30.0))
        self._send(page.status, page.body, page.content_type, page.headers)

    # -- search providers ------------------------------------------------------------------

    def _authorized(self, provider: str, body: dict[str, Any]) -> bool:
        key = self.server.fake.api_key
        if key is None or provider == "searxng":
            return True
        headers = self.headers
        if provider in ("tavily", "firecrawl"):
            return headers.get("Authorization") == f"Bearer {key}" or body.get("api_key") == key
        if provider == "brave":
            return headers.get("X-Subscription-Token") == key
        return headers.get("x-api-key") == key

    def _search(self, provider: str, path: str, body: dict[str, Any], query: dict[str, list[str]]) -> None:
        fake = self.server.fake
        if not self._authorized(provider, body):
            self._json(401, {"error": "invalid API key (fake)"})
            return
        q = body.get("query") or (query.get("q") or [""])[0]
        code = re.search(r"\[error:(\d{3})\]", q)
        if code:
            self._json(int(code.group(1)), {"error": f"scripted error {code.group(1)} (fake)"})
            return
        if provider == "searxng" and (query.get("format") or [""])[0] != "json":
            self._send(403, b"format not allowed", "text/plain")
            return
        n = int(
            body.get("max_results")
            or body.get("numResults")
            or body.get("limit")
            or (query.get("count") or [10])[0]
        )
        hits = fake.search(q, n)
        if provider == "tavily":
            out: Any = {
                "query": q,
                "results": [{"title": t, "url": u, "content": d, "score": 0.9} for t, u, d in hits],
            }
        elif provider == "brave":
            out = {
                "type": "search",
                "web": {"results": [{"title": t, "url": u, "description": d} for t, u, d in hits]},
            }
        elif provider == "searxng":
            out = {
                "query": q,
                "results": [{"title": t, "url": u, "content": d, "engine": "fake"} for t, u, d in hits],
            }
        elif provider == "exa":
            out = {"results": [{"title": t, "url": u, "id": u, "text": d} for t, u, d in hits]}
        elif path.startswith("/firecrawl/v1"):
            out = {"success": True, "data": [{"title": t, "url": u, "description": d} for t, u, d in hits]}
        else:
            rows = [
                {"title": t, "url": u, "description": d, "position": i + 1}
                for i, (t, u, d) in enumerate(hits)
            ]
            out = {"success": True, "data": {"web": rows}}
        self._json(200, out)


class FakeWebServer:
    """The fake site and search providers on a daemon thread. See the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = DEFAULT_API_KEY):
        self.host = host
        self.port = port
        self.api_key = api_key
        self.pages: dict[str, Page] = default_site()
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeWebServer:
        if self._httpd is None:
            httpd = _HTTPServer((self.host, self.port), _Handler)
            httpd.fake = self
            self.port = httpd.server_address[1]
            self._httpd = httpd
            self._thread = threading.Thread(target=httpd.serve_forever, name="fake-web", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    def __enter__(self) -> FakeWebServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        """The absolute URL of a site page, e.g. ``url("/gallery.html")``."""
        return f"{self.base_url}/site{path}"

    def provider_env(self, provider: str) -> dict[str, str]:
        """Variables that point web_search's ``provider`` at this server."""
        key_var = {"tavily": "TAVILY_API_KEY", "brave": "BRAVE_API_KEY", "exa": "EXA_API_KEY"}
        key_var["firecrawl"] = "FIRECRAWL_API_KEY"
        url_var = {"searxng": "SEARXNG_URL"}.get(provider, f"{provider.upper()}_API_URL")
        env = {"WEB_SEARCH_PROVIDER": provider, url_var: f"{self.base_url}/{provider}"}
        if provider in key_var and self.api_key:
            env[key_var[provider]] = self.api_key
        return env

    def search(self, query: str, n: int) -> list[tuple[str, str, str]]:
        """(title, url, description) of site pages sharing words with ``query``, best first."""
        words = {w for w in re.findall(r"[a-z0-9]+", query.lower()) if len(w) > 2}
        scored = []
        for path, page in self.pages.items():
            title, text = page_text(page)
            if not text:
                continue
            hay = f"{title} {text}".lower()
            score = sum(hay.count(w) for w in words)
            if score:
                scored.append((-score, path, title or path, html.unescape(text[:200])))
        scored.sort()
        return [(title, self.url(path), desc) for _, path, title, desc in scored[: max(n, 0)]]

    def _log(self, method: str, path: str, headers: dict[str, str], body: Any, query: Any) -> None:
        with self._lock:
            self.requests.append(
                {"method": method, "path": path, "headers": headers, "body": body, "query": query}
            )
            del self.requests[:-200]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.fakes.fake_services", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", default=DEFAULT_API_KEY)
    args = parser.parse_args(argv)
    server = FakeWebServer(args.host, args.port, args.api_key).start()
    print(server.base_url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
