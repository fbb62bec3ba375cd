"""A fetched page as text: its charset read safely, and HTML turned into markdown in a child process.

The page is the web's, the work is the host's. BeautifulSoup and markdownify are pure Python: a 5 MB
page of nested tags took 57 s of CPU and 1.1 GB in the worker, holding the GIL its other prompts
need, and no timeout could stop it. So the conversion runs in a child of its own (``convert_html``),
killed at the page's deadline and refused memory past :data:`HTML_MEMORY_MB`. This file is that
child's program too (run by path: it imports nothing of the package).

Charsets are the ones browsers know (the WHATWG Encoding Standard's): a page naming another in its
Content-Type or its ``<meta>`` is read as UTF-8. Python's codecs include ``punycode`` (quadratic: a
200 kB body took 2.7 s, a 5 MB one would take half an hour), ``idna`` and ``undefined`` (which raise
whatever the error handler) and ``utf-7`` or ``unicode_escape`` (which make lone surrogates, text no
record can carry in UTF-8).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

HTML_MEMORY_MB = 512  # address space of one conversion: a 2.5 MB page of 93,000 tags peaks at ~100 MB

_WHATWG_ENCODINGS = (
    "utf-8 utf-16-le utf-16-be ibm866 iso-8859-1 iso-8859-2 iso-8859-3 iso-8859-4 iso-8859-5 iso-8859-6 "
    "iso-8859-7 iso-8859-8 iso-8859-9 iso-8859-10 iso-8859-11 iso-8859-13 iso-8859-14 iso-8859-15 "
    "iso-8859-16 koi8-r koi8-u mac-roman mac-cyrillic cp874 cp1250 cp1251 cp1252 cp1253 cp1254 cp1255 "
    "cp1256 cp1257 cp1258 gbk gb18030 big5 big5hkscs euc-jp iso-2022-jp shift_jis cp932 euc-kr cp949 "
    "ascii utf-8-sig utf-16"
)
SAFE_ENCODINGS = frozenset(codecs.lookup(name).name for name in _WHATWG_ENCODINGS.split())
_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_encoding(name: str | None) -> str | None:
    """Python's name of the codec ``name`` stands for, when it is one browsers know; else None."""
    if not name:
        return None
    try:
        codec = codecs.lookup(name.strip().strip("\"'"))
    except (LookupError, ValueError):
        return None
    return codec.name if codec.name in SAFE_ENCODINGS else None


def decode_text(body: bytes, charset: str | None) -> str:
    """``body`` as text: in ``charset`` when browsers know it, else UTF-8; bad bytes become U+FFFD."""
    text = body.decode(safe_encoding(charset) or "utf-8", errors="replace")
    return _SURROGATE.sub("\ufffd", text)  # none of these codecs should make one; none may pass


def page_encoding(body: bytes, charset: str | None) -> str:
    """The encoding to read an HTML page in: a byte-order mark, else the Content-Type's charset, else
    the page's own ``<meta>`` declaration, each only when browsers know it; else UTF-8 when the bytes
    are UTF-8, else windows-1252 (what browsers assume of an undeclared page)."""
    for bom, name in _BOMS:
        if body.startswith(bom):
            return name
    declared = safe_encoding(charset)
    if declared:
        return declared
    from bs4.dammit import EncodingDetector

    declared = safe_encoding(EncodingDetector.find_declared_encoding(body[:65536], is_html=True))
    if declared:
        return declared
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return "cp1252"
    return "utf-8"


_DROP_TAGS = ["script", "style", "noscript", "template", "svg", "canvas", "iframe", "object", "embed", "head"]
_CHROME_SELECTOR = (
    "nav, aside, footer, [role=navigation], [role=banner], [role=contentinfo], [role=complementary], "
    '[hidden], [aria-hidden=true], [style*="display:none"], [style*="display: none"]'
)


def html_to_markdown(body: bytes | str, base_url: str, charset: str | None = None) -> tuple[str, str]:
    """(title, markdown of the page's main content). Links and images become absolute URLs.
    In this process: unbounded in time and memory, see :func:`convert_html`."""
    from bs4 import BeautifulSoup
    from markdownify import MarkdownConverter

    if isinstance(body, bytes):
        body = decode_text(body, page_encoding(body, charset))
    soup = BeautifulSoup(body, "html.parser")
    title = " ".join(soup.title.get_text().split()) if soup.title else ""
    for tag in soup(_DROP_TAGS):
        tag.decompose()
    body_tag = soup.body or soup
    root = soup.find("main") or soup.find(attrs={"role": "main"}) or soup.find("article") or body_tag
    for tag in root.select(_CHROME_SELECTOR):
        tag.decompose()
    if root is body_tag:
        for header in root.find_all("header", recursive=False):
            if not header.find(["h1", "h2"]):
                header.decompose()
    for a in root.find_all("a", href=True):
        href = a["href"].strip()
        if href.lower().startswith("javascript:"):
            del a["href"]
        else:
            a["href"] = urllib.parse.urljoin(base_url, href)
    for img in root.find_all("img"):
        src = (img.get("src") or "").strip()
        if not src or src.startswith("data:"):
            img.replace_with(img.get("alt") or "")
        else:
            img["src"] = urllib.parse.urljoin(base_url, src)
    converter = MarkdownConverter(
        heading_style="ATX", bullets="-", escape_underscores=False, escape_misc=False
    )
    text = converter.convert_soup(root)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return title, text


class ConversionError(Exception):
    """The page could not be turned into text within its time or memory; the message says which."""


def convert_html(
    body: bytes, base_url: str, charset: str | None, max_chars: int, timeout_s: float
) -> tuple[str, str, int]:
    """(title, the first ``max_chars`` characters of the page's markdown, its length), converted in a
    child process killed after ``timeout_s`` and given :data:`HTML_MEMORY_MB` of memory."""
    header = json.dumps({"base_url": base_url, "charset": charset, "max_chars": max_chars})
    # -I: none of the environment's PYTHON* variables; the modules are found where this process finds them.
    boot = (
        "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[1]); sys.argv = sys.argv[2:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-I",
                "-c",
                boot,
                json.dumps(sys.path),
                str(Path(__file__)),
                str(HTML_MEMORY_MB),
                str(os.getpid()),
            ],
            input=header.encode() + b"\n" + body,
            capture_output=True,
            timeout=max(timeout_s, 0.001),
            env={},
        )
    except subprocess.TimeoutExpired:
        raise ConversionError(f"turning the page into text took longer than {timeout_s:g} s") from None
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        out = {
            "error": f"the converter ended with code {proc.returncode}: {proc.stderr[-300:].decode(errors='replace')}"
        }
    if "error" in out:
        raise ConversionError(out["error"])
    return out["title"], out["text"], out["length"]


def _child(memory_mb: int, parent: int) -> None:
    import resource

    _end_with(parent)
    size = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (size, size))
    data = sys.stdin.buffer.read()
    header, _, body = data.partition(b"\n")
    args = json.loads(header)
    try:
        title, text = html_to_markdown(body, args["base_url"], args["charset"])
        out = {"title": title, "text": text[: args["max_chars"]], "length": len(text)}
    except MemoryError:
        out = {"error": f"turning the page into text needs more than {memory_mb} MB"}
    except RecursionError:
        out = {"error": "the page's tags are nested too deeply to turn into text"}
    except Exception as exc:  # a page the parser chokes on
        out = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(out))


def _end_with(parent: int) -> None:
    """End this child within a quarter of a second of its CPU once ``parent`` is gone: a worker killed
    (SIGKILL too) mid-conversion left it converting on at full CPU, 16 s for a 2.6 MB page here. The
    same check as batchrun.bounded_re's children: the signal handler runs between the parser's steps."""
    import signal

    def orphaned(*_: object) -> None:
        if os.getppid() != parent:
            os._exit(1)

    signal.signal(signal.SIGPROF, orphaned)
    signal.setitimer(signal.ITIMER_PROF, 0.25, 0.25)
    orphaned()


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
