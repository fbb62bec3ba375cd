"""The browser tools driving real headless Chromium (Debian's package) on the local fake site."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import pretend_public

from batchrun.fakes.fake_services import FakeWebServer, Page, _html
from batchrun.prompt.sandboxes.local.host import host_addresses
from batchrun.prompt.tools import browser
from batchrun.prompt.tools.browser import HOST, format_snapshot
from batchrun.prompt.tools.catalog import available_toolsets
from batchrun.prompt.tools.config import ToolSettings
from batchrun.prompt.tools.registry import close_prompt_resources

pytestmark = [pytest.mark.browser, pytest.mark.usefixtures("chromium_ready")]

PRIVATE_OFF = {"WEB_ALLOW_PRIVATE_ADDRESSES": "0"}


@pytest.fixture
def tool_ctx(local_tool_ctx):
    """The fake servers listen on 127.0.0.1 (see local_tool_ctx); PRIVATE_OFF turns the guard back on."""
    return local_tool_ctx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ref_of(snapshot: str, role: str, name: str) -> str:
    """The ref of the element ``role "name"`` in a snapshot, as the model would pick it."""
    m = re.search(rf'- {role} "{re.escape(name)}"[^\n]*?\[(@(?:f\d+)?e\d+)\]', snapshot)
    assert m, f'{role} "{name}" not in snapshot:\n{snapshot}'
    return m.group(1)


def test_navigate_returns_a_snapshot_with_refs(fake_web, tool_ctx, call_tool):
    out = call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/form.html"))
    assert out["success"] is True and out["status"] == 200
    assert out["url"] == fake_web.url("/form.html") and out["title"] == "Search form"
    snap = out["snapshot"]
    assert 'heading "Search the catalogue" [level=1]' in snap
    ref_of(snap, "textbox", "Query")
    ref_of(snap, "button", "Search")
    assert "[ref=" not in snap and "[cursor=pointer]" not in snap
    assert "- generic" not in snap  # layout containers are left out of the compact view
    assert out["element_refs"] > 10


def test_type_press_and_click_change_the_page(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    snap = call_tool(ctx, "browser_navigate", url=fake_web.url("/form.html"))["snapshot"]
    typed = call_tool(ctx, "browser_type", ref=ref_of(snap, "textbox", "Query"), text="red giants")
    assert typed["success"] is True and typed["typed"] == "red giants"
    assert call_tool(ctx, "browser_press", key="Enter")["success"] is True
    after = call_tool(ctx, "browser_snapshot")["snapshot"]
    assert "You searched for: red giants" in after
    assert "MORE-TEXT" not in after
    clicked = call_tool(ctx, "browser_click", ref=ref_of(after, "button", "Show more"))
    assert clicked["success"] is True and clicked["url"] == fake_web.url("/form.html")
    assert "MORE-TEXT revealed." in call_tool(ctx, "browser_snapshot")["snapshot"]
    console = call_tool(ctx, "browser_console")
    texts = [m["text"] for m in console["console_messages"]]
    assert texts.count("FORM-READY") == 1 and "submitted red giants" in texts


def test_links_back_and_new_tabs(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    snap = call_tool(ctx, "browser_navigate", url=fake_web.url("/"))["snapshot"]
    out = call_tool(ctx, "browser_click", ref=ref_of(snap, "link", "Read about Alpha Centauri"))
    assert out["url"] == fake_web.url("/articles/alpha.html") and out["title"] == "Alpha Centauri"
    assert "ALPHA-FACT" in call_tool(ctx, "browser_snapshot")["snapshot"]
    back = call_tool(ctx, "browser_back")
    assert back["url"] == fake_web.url("/") and back["title"] == "Fake Site Home"
    snap = call_tool(ctx, "browser_navigate", url=fake_web.url("/popup.html"))["snapshot"]
    out = call_tool(ctx, "browser_click", ref=ref_of(snap, "link", "Open Beta in a new tab"))
    assert out["url"] == fake_web.url("/articles/beta.html")  # the session follows the new tab
    assert "BETA-FACT" in call_tool(ctx, "browser_snapshot")["snapshot"]


def test_back_without_history_is_an_error(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    call_tool(ctx, "browser_navigate", url=fake_web.url("/"))
    assert "no previous page" in call_tool(ctx, "browser_back")["error"]


def test_scroll(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    call_tool(ctx, "browser_navigate", url=fake_web.url("/long.html"))
    down = call_tool(ctx, "browser_scroll", direction="down")
    assert down["success"] is True and down["scroll_y"] > 300 and down["at_top"] is False
    again = call_tool(ctx, "browser_scroll", direction="down")
    assert again["scroll_y"] > down["scroll_y"]
    up = call_tool(ctx, "browser_scroll", direction="up")
    assert up["scroll_y"] < again["scroll_y"]
    assert "direction must be" in call_tool(ctx, "browser_scroll", direction="left")["error"]


def test_snapshot_sizes(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx({"BROWSER_SNAPSHOT_MAX_CHARS": "1500"})
    call_tool(ctx, "browser_navigate", url=fake_web.url("/long.html"))
    short = call_tool(ctx, "browser_snapshot")
    assert (
        len(short["snapshot"]) < 1700 and "more lines not shown" in short["snapshot"] and short["truncated"]
    )
    full = call_tool(ctx, "browser_snapshot", full=True)
    assert 4000 < len(full["snapshot"]) <= 6200 and "LONG-PAGE-TEXT 20." in full["snapshot"]


def test_get_images(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    call_tool(ctx, "browser_navigate", url=fake_web.url("/gallery.html"))
    out = call_tool(ctx, "browser_get_images")
    red, blue, inline = out["images"]
    assert red == {"src": fake_web.url("/img/red.png"), "alt": "A red rectangle", "width": 8, "height": 6}
    assert blue == {"src": fake_web.url("/img/blue.png"), "alt": "A blue square", "width": 4, "height": 4}
    assert inline["alt"] == "An inline green dot" and "not shown" in inline["src"]
    assert "iVBOR" not in json.dumps(out)  # no inline image data in the result


def test_console_errors_and_expressions(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    snap = call_tool(ctx, "browser_navigate", url=fake_web.url("/form.html"))["snapshot"]
    call_tool(ctx, "browser_click", ref=ref_of(snap, "button", "Break something"))
    out = call_tool(ctx, "browser_console", expression="document.title + ' / ' + location.pathname")
    assert any("BOOM-ERROR" in e for e in out["js_errors"])
    assert out["result"] == "Search form / /site/form.html"
    cleared = call_tool(ctx, "browser_console", clear=True)
    assert cleared["js_errors"]  # returned once more, then emptied
    assert call_tool(ctx, "browser_console")["js_errors"] == []
    assert "error" in call_tool(ctx, "browser_console", expression="no_such_variable.x")


def test_vision_screenshot_is_saved_and_sent(fake_web, tool_ctx, call_tool, tmp_path):
    ctx = tool_ctx(prompt_index=5)
    call_tool(ctx, "browser_navigate", url=fake_web.url("/gallery.html"))
    out = call_tool(ctx, "browser_vision", question="What is on the page?", annotate=True)
    assert out["success"] is True and out["url"] == fake_web.url("/gallery.html")
    assert "image/png 1280x800" in out["analysis"]
    path = Path(out["screenshot_path"])
    assert path.parent == tmp_path / "run" / "screenshots" and path.name.startswith("prompt5_1_")
    data = path.read_bytes()
    assert struct.unpack(">II", data[16:24]) == (1280, 800)
    assert out["labels"].split()[0] != "0"
    # the labels were removed again after the screenshot
    assert "@" not in call_tool(ctx, "browser_console", expression="document.body.innerText")["result"]


def test_page_built_by_script_is_visible(fake_web, tool_ctx, call_tool):
    out = call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/script-only.html"))
    assert "SCRIPT-BUILT-TEXT" in out["snapshot"]


def test_errors_are_observations(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    assert "browser_navigate first" in call_tool(ctx, "browser_snapshot")["error"]
    assert "only http(s) URLs" in call_tool(ctx, "browser_navigate", url="file:///etc/passwd")["error"]
    refused = call_tool(ctx, "browser_navigate", url=f"http://127.0.0.1:{free_port()}/")
    assert "ERR_CONNECTION_REFUSED" in refused["error"]
    call_tool(ctx, "browser_navigate", url=fake_web.url("/form.html"))
    started = time.monotonic()
    assert "call browser_snapshot for fresh ones" in call_tool(ctx, "browser_click", ref="@e999")["error"]
    assert time.monotonic() - started < 8  # a missing ref does not wait for the 10 s action timeout
    assert "ref must be" in call_tool(ctx, "browser_click", ref="button")["error"]
    link = ref_of(call_tool(ctx, "browser_snapshot")["snapshot"], "link", "Home")
    assert "not a text field" in call_tool(ctx, "browser_type", ref=link, text="x")["error"]
    assert "Unknown key" in call_tool(ctx, "browser_press", key="NoSuchKey")["error"]
    nf = call_tool(ctx, "browser_navigate", url=fake_web.url("/missing"))
    assert nf["status"] == 404 and "HTTP 404" in nf["note"]


def test_tool_timeout_ends_a_slow_navigation(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    ctx.tool_timeout_s = 1.5
    started = time.monotonic()
    out = call_tool(ctx, "browser_navigate", url=fake_web.url("/slow.html?delay=6"))
    assert "did not finish within 1.5 s" in out["error"]
    assert time.monotonic() - started < 5.5  # not waiting for the 6 s page
    ctx.tool_timeout_s = 30
    assert call_tool(ctx, "browser_navigate", url=fake_web.url("/"))["success"] is True


def test_prompts_get_separate_contexts_in_one_browser(fake_web, tool_ctx, call_tool):
    a, b = tool_ctx(), tool_ctx()
    results = {}

    def visit(name, ctx, page):
        results[name] = call_tool(ctx, "browser_navigate", url=fake_web.url(page))

    threads = [
        threading.Thread(target=visit, args=("a", a, "/articles/alpha.html")),
        threading.Thread(target=visit, args=("b", b, "/slow.html?delay=1")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["a"]["title"] == "Alpha Centauri" and results["b"]["title"] == "Slow page"
    call_tool(a, "browser_console", expression="localStorage.setItem('who', 'a') || 1")
    assert call_tool(a, "browser_snapshot")["url"] == fake_web.url("/articles/alpha.html")
    call_tool(b, "browser_navigate", url=fake_web.url("/articles/beta.html"))
    assert call_tool(b, "browser_console", expression="localStorage.getItem('who')")["result"] is None
    launches = HOST.launches
    contexts = len(HOST._browser.contexts)
    close_prompt_resources(a)
    assert len(HOST._browser.contexts) == contexts - 1
    assert a.resources == {}
    close_prompt_resources(a)  # idempotent
    assert call_tool(b, "browser_snapshot")["success"] is True  # the other prompt is untouched
    assert HOST.launches == launches  # one Chromium for the whole process


def test_browser_configuration(clean_tool_env, tmp_path):
    assert "browser" in available_toolsets()
    assert "browser" not in available_toolsets(ToolSettings(tool_env={"BROWSER_ENABLED": "0"}))
    with pytest.raises(ValueError, match="BROWSER_EXECUTABLE"):
        available_toolsets(ToolSettings(tool_env={"BROWSER_EXECUTABLE": str(tmp_path / "nothing")}))
    with pytest.raises(ValueError, match="BROWSER_VIEWPORT"):
        available_toolsets(ToolSettings(tool_env={"BROWSER_VIEWPORT": "wide"}))
    # A screenshot at 20000x20000 never came within 20 s; at 8192x8192 it took 1.4 s.
    with pytest.raises(ValueError, match="BROWSER_VIEWPORT .*at most 8192, got '20000x20000'"):
        available_toolsets(ToolSettings(tool_env={"BROWSER_VIEWPORT": "20000x20000"}))
    assert "browser" in available_toolsets(ToolSettings(tool_env={"BROWSER_VIEWPORT": "8192x8192"}))
    # Node turns a timer past 2**31 - 1 ms into 1 ms: every navigation failed at once.
    for name in ("BROWSER_NAV_TIMEOUT_S", "BROWSER_ACTION_TIMEOUT_S"):
        with pytest.raises(ValueError, match=f"^{name} must be at most 86400, got '3000000'$"):
            available_toolsets(ToolSettings(tool_env={name: "3000000"}))


def test_agent_loop_drives_the_browser(fake_web, tool_ctx, run_tool_loop):
    ctx = tool_ctx()
    messages = run_tool_loop(ctx, fake_web.url("/articles/beta.html"), ["browser"])
    tool = next(m for m in messages if m["role"] == "tool")
    assert tool["name"] == "browser_navigate"
    assert "BETA-FACT" in json.loads(tool["content"])["snapshot"]


def test_format_snapshot_collapses_containers_and_cuts():
    raw = (
        "- generic [active] [ref=e1]:\n"
        "  - generic [ref=e2]:\n"
        '    - link "A" [ref=e3] [cursor=pointer]:\n'
        "      - /url: /a\n"
        "  - paragraph [ref=f2e4]: text\n"
    )
    compact, cut = format_snapshot(raw, compact=True, max_chars=1000)
    assert compact == '- link "A" [@e3]:\n  - /url: /a\n- paragraph [@f2e4]: text' and cut is None
    full, _ = format_snapshot(raw, compact=False, max_chars=1000)
    assert full.splitlines()[0] == "- generic [@e1]:" and len(full.splitlines()) == 5
    short, cut = format_snapshot(raw, compact=True, max_chars=30)
    assert (
        short.splitlines()[-1].startswith("[... 2 more lines not shown") and cut == "2 of 3 lines not shown"
    )


# ----------------------------------------------------------------------------- private addresses (setting off)


@pytest.fixture
def site_and_secret():
    """Two fake sites of the test's own: a page server and a "private" one that must not be reached."""
    with FakeWebServer() as site, FakeWebServer() as secret:
        yield site, secret


def test_navigation_to_a_private_address_is_refused(site_and_secret, tool_ctx, call_tool):
    _, secret = site_and_secret
    ctx = tool_ctx(PRIVATE_OFF)
    url = secret.url("/articles/alpha.html")
    assert call_tool(ctx, "browser_navigate", url=url) == {
        "error": f"browser_navigate: {url} resolves to a private address (127.0.0.1); refused"
    }
    for other, ip in (
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),  # refused before Chromium sees it
        (f"http://[::1]:{secret.port}/", "::1"),
        (f"http://[::ffff:127.0.0.1]:{secret.port}/", "::ffff:127.0.0.1"),
    ):
        assert call_tool(ctx, "browser_navigate", url=other)["error"].endswith(
            f"private address ({ip}); refused"
        )
    for url in ("file:///etc/passwd", "chrome://version", "view-source:http://example.com/"):
        assert "only http(s) URLs" in call_tool(ctx, "browser_navigate", url=url)["error"]
    assert secret.requests == []


def test_a_page_cannot_reach_private_addresses(site_and_secret, monkeypatch, tool_ctx, call_tool):
    site, secret = site_and_secret
    s = secret.port
    site.pages["/leaky.html"] = _html(
        "Leaky page",
        "<main><h1>LEAKY-PAGE</h1>"
        f"<img src='http://127.0.0.1:{s}/site/img/red.png'>"
        f"<iframe src='http://127.0.0.1:{s}/site/'></iframe>"
        f"<script>fetch('http://127.0.0.1:{s}/site/fetch').catch(() => {{}});"
        f"try {{ new WebSocket('ws://127.0.0.1:{s}/site/ws'); }} catch (e) {{}}</script></main>",
    )
    pretend_public(monkeypatch, "localhost")
    page = f"http://localhost:{site.port}/site/leaky.html"
    # With the setting on, the page does reach the other server (so the check below means something).
    allowed = call_tool(tool_ctx(), "browser_navigate", url=page)
    assert allowed["success"] is True
    deadline = time.monotonic() + 5
    while len({r["path"] for r in secret.requests}) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {r["path"] for r in secret.requests} >= {"/site/img/red.png", "/site/", "/site/fetch", "/site/ws"}
    secret.requests.clear()

    out = call_tool(tool_ctx(PRIVATE_OFF), "browser_navigate", url=page)
    assert out["success"] is True and "LEAKY-PAGE" in out["snapshot"]
    time.sleep(1)
    assert secret.requests == []
    assert f"http://127.0.0.1:{s}/site/img/red.png (127.0.0.1)" in out["blocked_requests"]
    assert "private addresses" in out["note"]


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_redirect_to_a_private_address_is_refused(
    scheme, site_and_secret, monkeypatch, tool_ctx, call_tool
):
    """Playwright's routes do not see redirect hops: the context's checking proxy refuses them."""
    site, secret = site_and_secret
    target = f"{scheme}://127.0.0.1:{secret.port}/site/articles/alpha.html"
    site.pages["/hop"] = Page(b"", status=302, headers={"Location": target})
    pretend_public(monkeypatch, "localhost")
    ctx = tool_ctx(PRIVATE_OFF)
    url = f"http://localhost:{site.port}/site/hop"
    error = call_tool(ctx, "browser_navigate", url=url)["error"]
    via = target if scheme == "http" else f"127.0.0.1:{secret.port}"
    assert (
        error
        == f"browser_navigate: {url} led to {via}, which resolves to a private address (127.0.0.1); refused"
    )
    assert secret.requests == [] and [r["path"] for r in site.requests] == ["/site/hop"]
    # the prompt's browser goes on working
    out = call_tool(ctx, "browser_navigate", url=f"http://localhost:{site.port}/site/articles/beta.html")
    assert out["title"] == "Beta Pictoris"


def test_the_browser_connects_to_the_address_that_was_checked(
    site_and_secret, monkeypatch, tool_ctx, call_tool
):
    """Chromium does no DNS of its own (rebinding): the name below exists only for the address check,
    so the page loads only if the connection goes to the checked address."""
    site, _ = site_and_secret
    host = f"rebind.example.com:{site.port}"
    site.pages["/ws.html"] = _html(
        "Socket page",
        f"<main><p>SOCKET-PAGE</p><script>new WebSocket('ws://{host}/site/ws');</script></main>",
    )
    pretend_public(monkeypatch, "rebind.example.com")
    out = call_tool(tool_ctx(PRIVATE_OFF), "browser_navigate", url=f"http://{host}/site/ws.html")
    assert out["success"] is True and out["title"] == "Socket page" and "blocked_requests" not in out
    deadline = time.monotonic() + 5
    while len(site.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    # the page, then the WebSocket handshake (tunnelled through the proxy with CONNECT)
    assert [(r["path"], r["headers"]["host"]) for r in site.requests[:2]] == [
        ("/site/ws.html", host),
        ("/site/ws", host),
    ]


def test_webrtc_sends_no_udp_to_the_hosts_addresses(site_and_secret, monkeypatch, tool_ctx, call_tool):
    """WebRTC's STUN and TURN go beside the context's proxy (UDP, from Chromium itself): a page naming
    the host's loopback (or any other address of it) as its ICE server would reach the services there
    with packets of its making. Chromium must keep WebRTC to what the proxy carries: no UDP at all."""
    site, _ = site_and_secret
    listeners = []
    for address in ("127.0.0.1", *host_addresses()):
        if ":" in address:
            continue
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((address, 0))
        udp.settimeout(0.2)
        listeners.append(udp)
    servers = ", ".join(
        f"{{urls: 'stun:{u.getsockname()[0]}:{u.getsockname()[1]}'}}, "
        f"{{urls: 'turn:{u.getsockname()[0]}:{u.getsockname()[1]}', username: 'u', credential: 'c'}}"
        for u in listeners
    )
    site.pages["/rtc.html"] = _html(
        "RTC page",
        "<main><p>RTC-PAGE</p><script>"
        f"const pc = new RTCPeerConnection({{iceServers: [{servers}]}});"
        "pc.createDataChannel('x'); pc.createOffer().then((o) => pc.setLocalDescription(o));"
        "</script></main>",
    )
    pretend_public(monkeypatch, "localhost")
    out = call_tool(
        tool_ctx(PRIVATE_OFF), "browser_navigate", url=f"http://localhost:{site.port}/site/rtc.html"
    )
    assert out["success"] is True and "RTC-PAGE" in out["snapshot"]
    got = []
    deadline = time.monotonic() + 3
    try:
        while time.monotonic() < deadline:
            for udp in listeners:
                try:
                    got.append((udp.getsockname(), udp.recvfrom(2048)[1]))
                except TimeoutError:
                    pass
    finally:
        for udp in listeners:
            udp.close()
    assert got == []


def test_unreachable_hosts_are_reported_as_chromium_would(monkeypatch, tool_ctx, call_tool):
    pretend_public(monkeypatch, "localhost")
    ctx = tool_ctx(PRIVATE_OFF)
    refused = call_tool(ctx, "browser_navigate", url=f"http://localhost:{free_port()}/")
    assert refused["error"].startswith("net::ERR_CONNECTION_REFUSED at http://localhost:")
    missing = call_tool(ctx, "browser_navigate", url="http://no-such-host.invalid/")
    assert "ERR_NAME_NOT_RESOLVED" in missing["error"]


def test_shutdown_and_restart(fake_web, tool_ctx, call_tool):
    browser.shutdown_browser()
    browser.shutdown_browser()  # idempotent
    out = call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))
    assert out["success"] is True  # a new loop and Chromium start on demand


# ----------------------------------------------------------------------------- hostile pages: the host's share


def chromium_processes(kind: str) -> dict[int, int]:
    """pid -> resident MB of this process's Chromium processes of ``--type=kind``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if f"--type={kind}".encode() in args and b"--enable-automation" not in args:
            rss = re.search(r"VmRSS:\s+(\d+)", status)
            found[int(entry.name)] = int(rss.group(1)) // 1024 if rss else 0
    return found


def test_a_console_flood_is_cut_off_and_spares_other_prompts(fake_web, tool_ctx, call_tool):
    """Every console message crosses Chromium, Playwright's driver and the worker's one browser loop:
    a page logging in a loop held every other prompt's browser calls past their timeout, and its own
    context's close, for as long as it ran. Such a page is closed."""
    fake_web.pages["/flood.html"] = _html(
        "Flood",
        "<main><p>FLOOD</p><script>"
        "const src = URL.createObjectURL(new Blob([`setInterval(() => { for (let i = 0; i < 2000; i++) "
        "console.log('w' + i) }, 1)`]));"
        "new Worker(src); setInterval(() => { for (let i = 0; i < 2000; i++) console.log('x' + i) }, 1);"
        "</script></main>",
    )
    flooding, other = tool_ctx(), tool_ctx()
    flooding.tool_timeout_s = other.tool_timeout_s = 10
    try:
        out = call_tool(flooding, "browser_navigate", url=fake_web.url("/flood.html"))
        for _ in range(3):
            started = time.monotonic()
            assert call_tool(other, "browser_navigate", url=fake_web.url("/"))["title"] == "Fake Site Home"
            assert time.monotonic() - started < 3
            time.sleep(1)
        told = json.dumps(out)
        assert "more than 500 console messages or errors in a second" in told and "flood.html" in told
        assert "browser_navigate first" in call_tool(flooding, "browser_snapshot")["error"]
        assert len(call_tool(other, "browser_console")["console_messages"]) < 50
        started = time.monotonic()
        close_prompt_resources(flooding)
        assert time.monotonic() - started < 3
    finally:
        browser.shutdown_browser()  # with the old code, the flood would slow every later test


def test_pages_cannot_open_tabs_without_end(fake_web, tool_ctx, call_tool):
    """Playwright turns Chromium's popup blocker off: a page calling window.open in a loop opened tabs
    (7 MB each in the browser process) for as long as the prompt ran."""
    fake_web.pages["/popups.html"] = _html(
        "Popups",
        "<main><p>POPUPS</p><script>"
        "setInterval(() => window.open('/site/popups.html?' + Math.random()), 5);</script></main>",
    )
    ctx = tool_ctx()
    assert call_tool(ctx, "browser_navigate", url=fake_web.url("/popups.html"))["title"] == "Popups"
    for _ in range(6):
        call_tool(ctx, "browser_snapshot")
        time.sleep(0.5)
    context = ctx.resources["browser"].context
    assert len(context.pages) <= 10  # browser.MAX_PAGES
    # a link to a new tab, clicked, still opens it (test_links_back_and_new_tabs)


@pytest.mark.slow
def test_a_page_s_memory_is_capped_and_a_crashed_tab_is_replaced(fake_web, tool_ctx, call_tool):
    """Chromium sets no memory limit of its own (with its sandbox or without): a page allocating in a loop
    took 4 GB in 10 s and would have taken the host's memory. And a tab whose renderer died answered
    every later call with "Page crashed" until the prompt ended."""
    fake_web.pages["/buffers.html"] = _html(
        "Buffers",
        "<main><p>BUFFERS</p><script>window.keep = []; setInterval(() => { const a = new Uint8Array(64 << 20);"
        " a.fill(1); keep.push(a); }, 20);</script></main>",
    )
    fake_web.pages["/heap.html"] = _html(
        "Heap",
        "<main><p>HEAP</p><script>window.keep = []; setInterval(() => keep.push(new Array(4 << 20).fill(0)"
        ".map((_, i) => i + 0.5)), 20);</script></main>",
    )
    browser.shutdown_browser()  # Chromium starts again under this test's limit
    ctx = tool_ctx({"BROWSER_MEMORY_MB": "1024"})
    before = set(chromium_processes("renderer"))
    try:
        assert call_tool(ctx, "browser_navigate", url=fake_web.url("/buffers.html"))["title"] == "Buffers"
        peak, failed = 0, False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not failed:
            ours = {p: mb for p, mb in chromium_processes("renderer").items() if p not in before}
            peak = max([peak, *ours.values()])
            if peak > 2000:  # the test's own watchdog, for the old code: this host's memory is shared
                for pid in ours:
                    os.kill(pid, signal.SIGKILL)
                break
            errors = call_tool(ctx, "browser_console").get("js_errors", [])
            failed = any("allocation failed" in e for e in errors)
            time.sleep(0.3)
        assert failed and peak < 1100
        # A page past the limit in V8's heap takes its renderer down: the prompt goes on in a new tab.
        call_tool(ctx, "browser_navigate", url=fake_web.url("/heap.html"))
        deadline = time.monotonic() + 30
        while "out of memory?" not in (error := call_tool(ctx, "browser_snapshot").get("error", "")):
            assert time.monotonic() < deadline, error  # a call under way meanwhile: "Target crashed"
            time.sleep(0.5)
        assert re.search(
            r"crashed \(out of memory\? each browser process may use 1024 MB(, this worker's browser 4096 MB in "
            r"all)?\); navigate to a page again$",
            error,
        )
        out = call_tool(ctx, "browser_navigate", url=fake_web.url("/"))
        assert out["title"] == "Fake Site Home"
    finally:
        close_prompt_resources(ctx)
        browser.shutdown_browser()


def test_browser_memory_setting(clean_tool_env):
    from batchrun.prompt.tools.config import browser_config

    assert browser_config().memory_mb == 2048
    assert browser_config(ToolSettings(tool_env={"BROWSER_MEMORY_MB": "4096"})).memory_mb == 4096
    with pytest.raises(ValueError, match="BROWSER_MEMORY_MB must be at least 1024"):
        browser_config(ToolSettings(tool_env={"BROWSER_MEMORY_MB": "512"}))


def chromium_descendants() -> list[tuple[int, bytes]]:
    """(pid, environ) of this process's descendants that run Chromium."""
    parents, found = {}, []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, os.getpid()):
            ancestor = parents.get(ancestor)
        if ancestor != os.getpid():
            continue
        try:
            if "chrom" in os.readlink(f"/proc/{pid}/exe"):
                found.append((pid, Path(f"/proc/{pid}/environ").read_bytes()))
        except OSError:
            continue
    return found


def test_chromium_runs_without_the_workers_secrets_in_its_environment(
    fake_web, tool_ctx, call_tool, monkeypatch
):
    """Chromium renders hostile pages on the host, and it was started with the worker's
    whole environment: the run's API key and every tool key were in /proc/<chromium>/environ, for any
    code a page got to run there. It keeps only what it needs (paths, locale, time zone, proxies)."""
    from batchrun.prompt.tools.browser import browser_environment, shutdown_browser

    secret = "sk-or-v1-chromium-must-not-see-4242"
    monkeypatch.setenv("OPENROUTER_API_KEY", secret)
    monkeypatch.setenv("SOME_SERVICE_TOKEN", secret)
    monkeypatch.setenv("https_proxy", "")  # a proxy variable is kept (pages may need it)
    shutdown_browser()  # the next call launches Chromium with this environment
    assert call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))["success"] is True
    environs = [environ for _, environ in chromium_descendants()]
    assert len(environs) >= 2, "no Chromium processes found"  # the browser and its renderer at least
    assert all(secret.encode() not in e for e in environs)
    assert any(
        b"PATH=" in e for e in environs
    )  # the browser process (the others rewrite their title over it)
    kept = browser_environment({"PATH": "/bin", "OPENAI_API_KEY": "k", "HTTPS_PROXY": "p", "LC_ALL": "C"})
    assert kept == {"PATH": "/bin", "HTTPS_PROXY": "p", "LC_ALL": "C"}


# ----------------------------------------------------------------------------- Chromium's own sandbox


def process_state(pid: int) -> dict[str, str]:
    """The fields of /proc/<pid>/status, the Chromium process type and its namespaces."""
    status = Path(f"/proc/{pid}/status").read_text()
    state = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    m = re.search(r"--type=(\S+)", cmdline)
    state["type"], state["cmdline"] = (m.group(1) if m else "browser"), cmdline
    for ns in ("user", "pid", "net"):
        state[ns] = os.readlink(f"/proc/{pid}/ns/{ns}")
    return state


@pytest.fixture
def chromium_sandbox():
    """Chromium's sandbox can be on here (browser_sandbox.plan); each test starts and ends without a
    Chromium."""
    from batchrun.prompt.tools.browser_sandbox import plan

    if not plan().sandbox:
        from helpers import skip_or_fail

        skip_or_fail(f"Chromium's sandbox cannot be on here: {plan().problem}")
    browser.shutdown_browser()
    yield
    browser.shutdown_browser()


def test_renderers_run_in_chromium_s_sandbox(chromium_sandbox, fake_web, tool_ctx, call_tool):
    """Chromium ran with --no-sandbox: its renderers, which run the pages the model picks, had no seccomp
    filter (Seccomp: 0) and the host's user, PID and network namespaces. Code a page got to run in one
    (gdb in a real renderer, as root) read a root-only file and connected to a service on 127.0.0.1 past
    the egress proxy. Its sandbox is on: every renderer is under seccomp-bpf, with no_new_privs, in
    namespaces of its own (no network: only the browser process reaches the proxy), and the tools work."""
    ctx = tool_ctx()
    snap = call_tool(ctx, "browser_navigate", url=fake_web.url("/form.html"))["snapshot"]
    assert call_tool(ctx, "browser_click", ref=ref_of(snap, "button", "Show more"))["success"] is True
    assert "MORE-TEXT revealed." in call_tool(ctx, "browser_snapshot")["snapshot"]
    shot = call_tool(ctx, "browser_vision", question="What is on the page?")
    assert shot["success"] is True and Path(shot["screenshot_path"]).stat().st_size > 1000
    states = [process_state(pid) for pid, _ in chromium_descendants()]
    assert not any("--no-sandbox" in s["cmdline"] for s in states)
    renderers = [s for s in states if s["type"] == "renderer"]
    assert renderers, [s["type"] for s in states]
    host = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("user", "pid", "net")}
    for state in renderers:
        assert (state["Seccomp"], state["NoNewPrivs"]) == ("2", "1")
        assert all(state[ns] != host[ns] for ns in host), state


def test_a_root_worker_s_chromium_runs_as_nobody(chromium_sandbox, fake_web, tool_ctx, call_tool):
    """Chromium refuses its sandbox as root; with --no-sandbox every process of it ran as root, the browser
    process and its network service with every capability (CapEff 000001fffeffffff): whatever took one over
    could read /proc/<worker>/environ (the run's API keys), any file, and write anywhere. A root worker
    starts it as nobody (BROWSER_UID), without capabilities, groups or the right to gain privileges."""
    from batchrun.prompt.tools.config import BROWSER_GID, BROWSER_UID

    if os.geteuid() != 0:
        pytest.skip("the worker is not root: Chromium keeps the worker's user")
    assert call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))["success"] is True
    states = [process_state(pid) for pid, _ in chromium_descendants()]
    assert len(states) >= 3  # the browser, a zygote, a renderer at least
    host_user = os.readlink("/proc/self/ns/user")
    for state in states:
        assert state["Uid"].split() == [str(BROWSER_UID)] * 4, state["type"]
        assert state["Gid"].split() == [str(BROWSER_GID)] * 4 and state["Groups"].strip() == ""
        assert state["NoNewPrivs"] == "1"
        if state["user"] == host_user:  # the sandbox's zygote holds capabilities in its own namespace only
            assert int(state["CapEff"], 16) == int(state["CapPrm"], 16) == int(state["CapBnd"], 16) == 0


def test_without_user_namespaces_chromium_runs_unsandboxed_and_the_run_says_so(
    fake_web, tool_ctx, call_tool, monkeypatch, caplog
):
    """Where user namespaces are refused (a root-run Docker container's seccomp profile, a kernel or
    AppArmor policy) Chromium's sandbox cannot start: the browser still works, without it (a root worker's
    Chromium still as nobody), and the run's start and the worker's log say so, with why."""
    from batchrun.prompt.tools import browser_sandbox

    fake = Path(tempfile.mkdtemp())  # not under tmp_path: nobody must be able to run it
    fake.chmod(0o755)
    (fake / "unshare").write_text(
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
    )
    (fake / "unshare").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    browser.shutdown_browser()
    browser_sandbox.plan.cache_clear()
    try:
        plan = browser_sandbox.plan()
        assert not plan.sandbox and "Operation not permitted" in plan.problem
        assert plan.describe().startswith(
            "warning: Browser sandbox: OFF (no user namespaces here (unshare: unshare failed: Operation not "
            "permitted)): Chromium runs as "
        )
        with caplog.at_level("WARNING", logger="batchrun.prompt.tools.browser"):
            out = call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))
        assert out["title"] == "Fake Site Home"
        assert any("Browser sandbox: OFF (no user namespaces" in r.getMessage() for r in caplog.records)
        states = [process_state(pid) for pid, _ in chromium_descendants()]
        assert any(s["type"] == "browser" and "--no-sandbox" in s["cmdline"] for s in states)
        if os.geteuid() == 0:
            assert plan.user == (65534, 65534) and all(s["Uid"].split()[0] == "65534" for s in states)
    finally:
        browser.shutdown_browser()
        browser_sandbox.plan.cache_clear()
        shutil.rmtree(fake)


def test_where_chromium_reads_the_host_s_files_the_run_says_so():
    """A worker that is not root whose Chromium cannot have a root of its own (util-linux before 2.38 has
    no --map-user): its browser process, outside the renderers' seccomp filter, reads every file the
    runner's user may (the dataset with its expected answers, the run's directory, its home). The run's
    start said nothing of it; now it warns, with why, as where a root worker cannot make the namespaces."""
    from batchrun.prompt.tools.browser_sandbox import SandboxPlan

    why = "cannot have a root of its own: unshare: unrecognized option '--map-user=1000'"
    said = SandboxPlan(sandbox=True, user=None, isolation_problem=why).describe()
    assert said == (
        f"warning: Browser sandbox: Chromium runs as the runner's uid {os.geteuid()}, its renderers in user, "
        "PID and network namespaces of their own under seccomp-bpf; its browser process in the host's "
        f"network and PID namespaces, and reads every file the runner's uid {os.geteuid()} may read (the "
        f"dataset, the run's directory) ({why})"
    )
    for fine in (
        SandboxPlan(sandbox=True, user=None, own_root=True, isolated=True),
        SandboxPlan(True, (65534, 65534), isolated=True),
    ):
        assert not fine.describe().startswith("warning")
    # on its root of its own, but in the host's network: a page that broke out reaches its 127.0.0.1
    why = "cannot have a network namespace of its own: nsenter: reassociate to namespace 'ns/net' failed"
    said = SandboxPlan(sandbox=True, user=None, own_root=True, isolation_problem=why).describe()
    assert said.startswith("warning: Browser sandbox: ")
    assert said.endswith(f"on a root of its own that holds only the system's directories and its profile; "
                         f"its network is the host's ({why})")  # fmt: skip


@pytest.fixture
def isolated_chromium(chromium_sandbox):
    """A root worker whose Chromium can be put in namespaces of its own (browser_sandbox.plan)."""
    from batchrun.prompt.tools.browser_sandbox import plan

    if os.geteuid() != 0:
        pytest.skip("the worker is not root: Chromium keeps the worker's namespaces")
    if plan().isolation_problem:
        from helpers import skip_or_fail

        skip_or_fail(f"Chromium cannot have namespaces of its own here: {plan().isolation_problem}")


def browser_process() -> int:
    """The pid of this worker's Chromium browser process."""
    pids = [pid for pid, _ in chromium_descendants() if is_chromium_browser(pid)]
    assert len(pids) == 1, pids
    return pids[0]


def as_browser(pid: int, code: str) -> str:
    """What Python ``code`` prints, run with the credentials and the network, PID and mount namespaces of
    Chromium's browser process ``pid``: what a page that broke out of a renderer into it could do."""
    import subprocess

    argv = ["nsenter", "-t", str(pid), "-n", "-p", "-m", "--", "setpriv", "--reuid=65534", "--regid=65534",
            "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "/usr/bin/python3",
            "-c", code]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


CONNECT = """
import socket, sys
for host in sys.argv[1:]:
    try:
        socket.create_connection((host, {port}), 2).close()
        print(host, "connected")
    except OSError as exc:
        print(host, exc.errno)
"""


def test_a_root_worker_s_chromium_reaches_only_the_egress_proxy(
    isolated_chromium, fake_web, site_and_secret, tool_ctx, call_tool, monkeypatch
):
    """The browser process and its network service ran as nobody in the host's network namespace: a page
    that broke out of a renderer into it connected to a service on 127.0.0.1 and on the host's other
    addresses (the Docker bridge) past the egress proxy. Chromium now has a network namespace of its own
    with only its loopback, where the prompts' egress proxies listen: no route, no other address; the
    tools still work through the proxy, and a private address is refused as before."""
    _, secret = site_and_secret
    pretend_public(monkeypatch, "localhost")
    ctx = tool_ctx(PRIVATE_OFF)
    snap = call_tool(ctx, "browser_navigate", url=f"http://localhost:{fake_web.port}/site/form.html")[
        "snapshot"
    ]
    assert call_tool(ctx, "browser_click", ref=ref_of(snap, "button", "Show more"))["success"] is True
    assert "MORE-TEXT revealed." in call_tool(ctx, "browser_snapshot")["snapshot"]
    shot = call_tool(ctx, "browser_vision", question="What is on the page?")
    assert shot["success"] is True and Path(shot["screenshot_path"]).stat().st_size > 1000
    url = secret.url("/")
    assert call_tool(ctx, "browser_navigate", url=url) == {
        "error": f"browser_navigate: {url} resolves to a private address (127.0.0.1); refused"
    }
    pid = browser_process()
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    assert browser.HOST.sandbox.describe().endswith(
        "the whole of it in network and PID namespaces where it reaches only the egress proxy, on a root of "
        "its own that holds only the system's directories and its profile"
    )
    routes = Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:]  # its namespace's IPv4 routes
    links = [line.split(":")[0].strip() for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]]
    assert routes == [] and links == ["lo"]
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        others = [a for a in host_addresses() if ":" not in a][:2]
        said = as_browser(
            pid, CONNECT.format(port=port).replace("sys.argv[1:]", repr(["127.0.0.1", *others]))
        )
        assert "connected" not in said, said
        assert said.count("\n") == 1 + len(others)
    assert secret.requests == []


def test_a_root_worker_s_chromium_cannot_see_another_worker_s(
    isolated_chromium, fake_web, tool_ctx, call_tool, tmp_path
):
    """Every worker's Chromium runs as the same nobody, and there is no Yama here: from one browser
    process (as a page that broke out of a renderer) gdb attached to another worker's Chromium, its
    /proc/<pid>/environ was open to read, and so was its profile (the pages' cache, cookies, storage).
    Each Chromium has a PID namespace (and /proc) of its own: no other worker's process is there to see
    or trace; and a temporary directory that holds its own profile only."""
    import subprocess
    import sys

    assert call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))["success"] is True
    pid = browser_process()
    script = tmp_path / "worker.py"
    script.write_text(
        "import time\n"
        "from batchrun.prompt.tools.browser import HOST\n"
        "from batchrun.prompt.tools.config import browser_config\n"
        "HOST.call(lambda: HOST.browser(browser_config()), 60)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    other = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    try:
        assert other.stdout.readline().strip() == "up"
        theirs = [p for p, _ in chromium_descendants() if p != pid and is_chromium_browser(p)]
        assert len(theirs) == 1, "the other worker's Chromium is not running"
        mine, their_profile = (profile_of(p) for p in (pid, theirs[0]))
        assert os.path.dirname(mine) == os.path.dirname(their_profile) and os.path.isdir(their_profile)
        seen = as_browser(
            pid,
            f"import os\nfor p in {[mine, their_profile]!r}: print(os.access(p, os.R_OK))\n"
            f"print(os.listdir({os.path.dirname(mine)!r}))",
        )
        assert seen.splitlines() == ["True", "False", str([os.path.basename(mine)])]
        said = as_browser(
            pid,
            f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for p in {theirs!r}:
    print(p, os.path.exists(f"/proc/{{p}}"), libc.ptrace(16, p, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
print(os.readlink("/proc/self/ns/pid"))
""",
        )
        lines = said.splitlines()
        assert lines[-1] != os.readlink("/proc/self/ns/pid")
        assert lines[:-1] == [f"{p} False -1 3" for p in theirs]  # ESRCH: no such process
    finally:
        other.kill()
        other.wait()


@pytest.fixture
def run_setup(tmp_path):
    """A run as users leave one, outside the temporary directory and world-readable (the default umask):
    ``project/`` with the dataset (its rows' expected answers) and ``data/<run>/`` (a batch file with
    another prompt's trajectory), a home with the runner's cache, a Unix socket anyone may connect to;
    and another prompt's local sandbox in the run's sandbox directory. Removed afterwards."""
    from batchrun.prompt.sandboxes.base import SandboxSpec
    from batchrun.prompt.sandboxes.local import LocalSandbox

    top = Path(tempfile.mkdtemp(prefix="br-chromefs-", dir="/var/tmp"))
    top.chmod(0o755)
    files = {
        "project/eval.jsonl": '{"prompt": "What is 6 * 7?", "answer": "HIDDEN-ANSWER-42"}\n',
        "project/data/run/batch_0.jsonl": '{"conversations": "OTHER-PROMPT-TRAJECTORY"}\n',
        "project/data/run/checkpoint.json": '{"completed_prompts": [0]}\n',
        "home/.cache/batch-runner/docker-images-runnable.json": '{"runnable": {}}\n',
    }
    for name, text in files.items():
        path = top / name
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        path.write_text(text)
        path.chmod(0o644)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(top / "service.sock"))
    sock.listen()
    (top / "service.sock").chmod(0o777)
    sandboxes = tempfile.mkdtemp(prefix="batch-runner-run-", dir="/var/tmp")  # as prepare_run makes it
    other = LocalSandbox(SandboxSpec(run_name="run", prompt_index=1), base_dir=sandboxes)
    other.start()
    try:
        assert other.run("echo OTHER-PROMPT-FILE > notes.txt", timeout_s=30).exit_code == 0
        yield top, other
    finally:
        other.stop()
        sock.close()
        shutil.rmtree(top)
        shutil.rmtree(sandboxes, ignore_errors=True)


SEES = """
import os, socket, sys
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            print(path, "listed", len(os.listdir(path)))
        elif path.endswith(".sock"):
            socket.socket(socket.AF_UNIX).connect(path)
            print(path, "connected")
        else:
            print(path, "read", open(path).read(40))
    except OSError as exc:
        print(path, os.strerror(exc.errno))
"""


def test_a_root_worker_s_chromium_reads_no_file_of_the_run_or_the_host(
    isolated_chromium, fake_web, tool_ctx, call_tool, run_setup
):
    """Chromium's browser, GPU and network processes are outside the renderers' seccomp filter, and ran as
    nobody on the host's root: one a page took over read the dataset (its rows' expected answers), the
    run's directory (other prompts' trajectories), the runner's cache, the source tree, and connected to
    Unix sockets anyone may use; it wrote to /var/tmp and /dev/shm. It has a root of its own: the
    system's directories read-only, a minimal /dev, its /proc and its profile; the rest is absent. The
    tools still work, fonts and all."""
    top, other = run_setup
    ctx = tool_ctx()
    snap = call_tool(ctx, "browser_navigate", url=fake_web.url("/form.html"))["snapshot"]
    assert call_tool(ctx, "browser_click", ref=ref_of(snap, "button", "Show more"))["success"] is True
    assert "MORE-TEXT revealed." in call_tool(ctx, "browser_snapshot")["snapshot"]
    pid = browser_process()
    source = Path(browser.__file__).resolve()
    hidden = [
        str(top / "project/eval.jsonl"),
        str(top / "project/data/run"),
        str(top / "project/data/run/batch_0.jsonl"),
        str(top / "home/.cache/batch-runner"),
        str(top / "service.sock"),
        str(source),  # the runner's source tree
        str(Path(source.parents[3], "data/eval.jsonl")),  # the checkout's dataset with answers
        other._root,  # another prompt's sandbox (its directory 0700 already)
        "/home",
        "/root",
        "/run",
        "/var/tmp",
        "/sys",
    ]
    seen = as_browser(pid, SEES.replace("sys.argv[1:]", repr(hidden))).splitlines()
    assert seen == [f"{path} No such file or directory" for path in hidden]
    profile = profile_of(pid)
    check = f"""
import os
print(sorted(os.listdir("/")))
print(os.listdir(os.path.dirname({profile!r})), os.access({profile!r}, os.W_OK), os.listdir("/dev/shm"))
for path in ({os.path.realpath(browser.browser_config().executable)!r}, "/etc/fonts/fonts.conf",
             "/dev/urandom", "/proc/self/status"):
    open(path, "rb").close()
for path in ("/dev/shm/x", "/x", "/usr/x", "/etc/x", "/tmp/x"):
    try:
        open(path, "w")
        print(path, "written")
    except OSError as exc:
        pass
"""
    lines = as_browser(pid, check).splitlines()
    assert set(eval(lines[0])) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "var",
                                    "dev", "proc", profile.split("/")[1]}  # fmt: skip
    assert lines[1:] == [f"[{os.path.basename(profile)!r}] True []"]


NOT_ROOT_WORKER = """
import json, sys, time
from batchrun.fakes.fake_services import FakeWebServer
from batchrun.prompt.tools.browser import HOST, shutdown_browser
from batchrun.prompt.tools.browser_sandbox import plan
from batchrun.prompt.tools.catalog import execute_tool_call, known_tool_names
from batchrun.prompt.tools.config import ToolSettings
from batchrun.prompt.tools.registry import ToolContext

with FakeWebServer() as web:
    settings = ToolSettings(run_dir=sys.argv[1], tool_env={"WEB_ALLOW_PRIVATE_ADDRESSES": "1"})
    ctx = ToolContext(sandbox=None, tool_timeout_s=60.0, settings=settings)
    url = json.dumps({"url": web.url("/form.html")})
    out = json.loads(execute_tool_call("browser_navigate", url, ctx, set(known_tool_names())))
    print(json.dumps({"said": plan().describe(), "title": out.get("title"), "error": out.get("error")}))
    sys.stdout.flush()
    time.sleep(60)
"""

# As root: a private mount namespace where nobody may run this interpreter (pyenv's lives in /root, 0700),
# then the command as nobody.
AS_NOBODY = """set -e
hold=$1; shift; n=0
for prefix in "$@"; do
  [ "$prefix" != -- ] || break
  n=$((n + 1)); mkdir "$hold/$n"; mount --bind "$prefix" "$hold/$n"
done
[ "$n" = 0 ] || mount -t tmpfs -o mode=755 br-test-root /root
n=0
while [ "$1" != -- ]; do n=$((n + 1)); mkdir -p "$1"; mount --bind "$hold/$n" "$1"; shift; done; shift
exec setpriv --reuid=65534 --regid=65534 --clear-groups -- "$@"
"""


def test_a_chromium_of_a_worker_that_is_not_root_reads_none_of_its_user_s_files(tmp_path, run_setup):
    """A worker that is not root ran Chromium as its own user on the host's root: a page that took over its
    browser process read every file of that user (its home: keys, the dataset, the run's directory, all
    0600 here). It has the same root of its own as a root worker's, in user, mount and PID namespaces,
    and the run's start says so; the tools still work.

    Its network was the host's: from its browser process a page connected to a service on 127.0.0.1 and
    on the host's other addresses past the egress proxy. It now has a network namespace of its own with
    only its loopback, where a keeper process (browser_sandbox.UserNetns) makes the proxies' sockets:
    no route, no other address, as a root worker's."""
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("the test starts its worker as nobody")
    top, _ = run_setup
    private = top / "home/.ssh/id_ed25519"
    private.parent.mkdir(mode=0o700)
    private.write_text("PRIVATE-KEY")
    for path in (private.parent, private, top / "project/eval.jsonl", top / "project/data/run/batch_0.jsonl"):
        os.chown(path, 65534, 65534)
        path.chmod(0o700 if path.is_dir() else 0o600)
    hold = tmp_path / "hold"
    hold.mkdir()
    (tmp_path / "run").mkdir(mode=0o777)
    (tmp_path / "run").chmod(0o777)
    prefixes = [p for p in dict.fromkeys((sys.prefix, sys.base_prefix)) if p.startswith("/root/")]
    worker = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", AS_NOBODY, "sh", str(hold),
         *prefixes, "--", sys.executable, "-c", NOT_ROOT_WORKER, str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HOME": "/nonexistent", "PYTHONPATH": str(Path(browser.__file__).parents[3])},
    )  # fmt: skip
    try:
        line = worker.stdout.readline()
        if not line:
            from helpers import skip_or_fail

            skip_or_fail(f"cannot start a browser as nobody here: {worker.stderr.read()[-500:]}")
        said = json.loads(line)
        assert (said["title"], said["error"]) == ("Search form", None)
        pid = browser_process()
        hidden = [str(private), str(top / "project/eval.jsonl"), str(top / "project/data/run/batch_0.jsonl"),
                  str(top / "service.sock"), "/home", "/var/tmp"]  # fmt: skip
        seen = as_browser(pid, SEES.replace("sys.argv[1:]", repr(hidden))).splitlines()
        assert seen == [f"{path} No such file or directory" for path in hidden]
        assert said["said"].endswith(
            "the whole of it in network and PID namespaces where it reaches only the egress proxy, on a root "
            "of its own that holds only the system's directories and its profile"
        )
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        assert process_state(pid)["Uid"].split() == ["65534"] * 4
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        routes = Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:]
        links = [
            line.split(":")[0].strip() for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
        ]
        assert routes == [] and links == ["lo"]
        with socket.socket() as listener:
            listener.bind(("0.0.0.0", 0))
            listener.listen()
            others = [a for a in host_addresses() if ":" not in a][:2]
            connect = CONNECT.format(port=listener.getsockname()[1])
            said = as_browser(pid, connect.replace("sys.argv[1:]", repr(["127.0.0.1", *others])))
            assert "connected" not in said, said
            assert said.count("\n") == 1 + len(others)
    finally:
        worker.kill()
        worker.wait()


def test_a_chromium_outside_the_system_directories_starts_on_its_root(
    isolated_chromium, fake_web, tool_ctx, call_tool
):
    """BROWSER_EXECUTABLE may name a Chromium outside /usr (in /opt, or Playwright's own in a home
    directory), through a symbolic link: the directory that really holds it is put on Chromium's root,
    read-only, and nothing beside it."""
    from batchrun.prompt.tools.config import browser_config

    place = Path(tempfile.mkdtemp(prefix="br-chromium-", dir="/var/tmp"))
    try:
        place.chmod(0o755)
        (place / "chrome").mkdir(mode=0o755)
        real = place / "chrome" / "chrome"
        real.write_text(f'#!/bin/sh\nexec {os.path.realpath(browser_config().executable)} "$@"\n')
        real.chmod(0o755)
        (place / "link").symlink_to(real)
        (place / "beside.txt").write_text("NOT-FOR-CHROMIUM")
        (place / "beside.txt").chmod(0o644)
        browser.shutdown_browser()  # the next call launches this Chromium
        ctx = tool_ctx({"BROWSER_EXECUTABLE": str(place / "link")})
        assert call_tool(ctx, "browser_navigate", url=fake_web.url("/"))["title"] == "Fake Site Home"
        paths = [str(real), str(place / "beside.txt"), str(place / "link")]
        seen = as_browser(browser_process(), f"import os\nprint([os.path.exists(p) for p in {paths!r}])")
        assert seen.strip() == "[True, False, False]"
    finally:
        browser.shutdown_browser()
        shutil.rmtree(place)


def test_where_chromium_cannot_have_namespaces_of_its_own_the_run_says_so(
    chromium_sandbox, fake_web, tool_ctx, call_tool, monkeypatch, caplog
):
    """A root worker that cannot make a network namespace (a container without CAP_SYS_ADMIN) starts
    Chromium as before, in the host's namespaces, and the run's start and the worker's log say why."""
    from batchrun.prompt.tools import browser_sandbox

    if os.geteuid() != 0:
        pytest.skip("the worker is not root: Chromium keeps the worker's namespaces")

    def refused() -> int:
        raise OSError(1, "unshare: Operation not permitted")

    monkeypatch.setattr(browser_sandbox, "make_netns", refused)
    browser_sandbox.plan.cache_clear()
    try:
        plan = browser_sandbox.plan()
        assert plan.sandbox and not plan.isolated
        assert plan.describe().endswith(
            "its browser process in the host's network and PID namespaces, and reads every file uid 65534 may "
            "read (the dataset, the run's directory) (cannot make a network namespace: [Errno 1] unshare: "
            "Operation not permitted)"
        )
        assert plan.describe().startswith("warning: ")
        with caplog.at_level("WARNING", logger="batchrun.prompt.tools.browser"):
            assert (
                call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))["title"] == "Fake Site Home"
            )
        assert any("host's network and PID namespaces" in r.getMessage() for r in caplog.records)
        assert os.readlink(f"/proc/{browser_process()}/ns/net") == os.readlink("/proc/self/ns/net")
    finally:
        browser.shutdown_browser()
        browser_sandbox.plan.cache_clear()


def profile_of(pid: int) -> str:
    """The --user-data-dir of Chromium's browser process ``pid``."""
    return re.search(r"--user-data-dir=(\S+)", process_state(pid)["cmdline"]).group(1)


def is_chromium_browser(pid: int) -> bool:
    """Whether ``pid`` is a Chromium browser process (False if it is none, or gone)."""
    try:
        return (
            os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "chromium"
            and process_state(pid)["type"] == "browser"
        )
    except OSError:
        return False


# ----------------------------------------------------------------------------- the worker's Chromium in a cgroup


@pytest.fixture
def browser_cgroups():
    """Cgroups can be made here (root, or delegated); each test starts and ends without a Chromium."""
    from batchrun.prompt.sandboxes.local.limits import CgroupLayout, cgroup_layout

    if not isinstance(why := cgroup_layout(), CgroupLayout):
        from helpers import skip_or_fail

        skip_or_fail(f"the browser's cgroup needs cgroups: {why}")
    browser.shutdown_browser()  # Chromium starts again under the test's settings
    yield
    browser.shutdown_browser()


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            found[pid] = (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.slow
def test_a_spinning_page_gets_no_more_cpu_than_the_browser_s_quota(
    browser_cgroups, fake_web, tool_ctx, call_tool
):
    """Nothing bounded Chromium's CPU: a page spinning in 4 Web Workers took every core it could (1.9 of
    this host's 2 when idle, 0.7 beside the other loads) until its prompt's deadline, and 16 prompts of a
    worker could starve the runner, its model calls and the other prompts' sandboxes. The worker's whole
    Chromium is held to BROWSER_CPUS."""
    fake_web.pages["/spin.html"] = _html(
        "Spin",
        "<main><p>SPIN</p><script>const src = URL.createObjectURL(new Blob(['for (;;) {}']));"
        "for (let i = 0; i < 4; i++) new Worker(src);</script></main>",
    )
    ctx = tool_ctx({"BROWSER_CPUS": "0.25"})
    assert call_tool(ctx, "browser_navigate", url=fake_web.url("/spin.html"))["title"] == "Spin"
    time.sleep(1)
    pids = [pid for pid, _ in chromium_descendants()]
    before, started = cpu_seconds(pids), time.monotonic()
    time.sleep(4)
    after, elapsed = cpu_seconds(pids), time.monotonic() - started
    used = sum(after[p] - before[p] for p in after if p in before) / elapsed
    assert used <= 0.25 * 1.2 + 0.02, f"Chromium used {used:.2f} cores"


def private_mb(pids: list[int]) -> int:
    """Memory of these processes that is their own (shared libraries' pages counted in none)."""
    total = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total += sum(int(kb) for kb in re.findall(r"Private_(?:Clean|Dirty):\s+(\d+)", rollup))
    return total >> 10


@pytest.mark.slow
def test_pages_allocating_across_renderers_are_killed_inside_the_browser_s_cgroup(
    browser_cgroups, fake_web, tool_ctx, call_tool
):
    """RLIMIT_DATA bounds each Chromium process, not their sum: two prompts whose pages (and a cross-site
    frame) allocate without end held 1.8 GB with a 1 GB limit each, and 16 prompts could have taken the
    host's memory, bringing the kernel's OOM killer onto the runner. The worker's Chromium is held to
    BROWSER_TREE_MEMORY_MB together: the OOM killer ends a renderer in its cgroup, the worker lives and
    the prompt goes on in a new tab."""
    grab = (
        "<script>window.keep = []; setInterval(() => { try { const a = new Uint8Array(32 << 20); a.fill(1);"
        " keep.push(a); } catch (e) {} }, 30);</script>"
    )
    fake_web.pages["/grab.html"] = _html("Grab", f"<main><p>GRAB</p>{grab}</main>")
    # Another site (localhost, not 127.0.0.1): its frame gets a renderer of its own.
    frame = f"<iframe src='http://localhost:{fake_web.port}/site/grab.html'></iframe>"
    fake_web.pages["/frames.html"] = _html("Frames", f"<main><p>FRAMES</p>{grab}{frame}</main>")
    settings = {"BROWSER_MEMORY_MB": "1024", "BROWSER_TREE_MEMORY_MB": "1024"}
    prompts = [tool_ctx(settings), tool_ctx(settings)]
    # The snapshot, not the title: the title is read after it, when a renderer may be killed already.
    for prompt, page in zip(prompts, ("FRAMES", "GRAB"), strict=True):
        out = call_tool(prompt, "browser_navigate", url=fake_web.url(f"/{page.lower()}.html"))
        assert f"paragraph [@e3]: {page}" in out["snapshot"], out
    peak, crashed = 0, []
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and not crashed:
        pids = [pid for pid, _ in chromium_descendants()]
        peak = max(peak, private_mb(pids))
        if peak > 3000:  # the test's own watchdog, for the old code: this host's memory is shared
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            break
        crashed = [
            c for c in prompts if "out of memory?" in call_tool(c, "browser_snapshot").get("error", "")
        ]
        time.sleep(0.3)
    assert peak <= 1024 + 32, f"Chromium held {peak} MB"
    assert crashed and browser.HOST.cgroup.hits()[1] >= 1  # killed by the OOM killer, in its cgroup
    out = call_tool(crashed[0], "browser_navigate", url=fake_web.url("/"))
    assert out["title"] == "Fake Site Home"


def test_chromium_runs_in_its_cgroup_which_goes_with_the_browser(
    browser_cgroups, fake_web, tool_ctx, call_tool
):
    """Every process of the worker's Chromium is in its cgroup (the launcher moves itself there before it
    execs Chromium: no shell is left), and the cgroup is removed, its parent with it, when the browser
    stops; the next start makes a new one."""
    from batchrun.prompt.sandboxes.local.limits import run_cgroup_names

    assert call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))["success"] is True
    cgroup = browser.HOST.cgroup
    assert cgroup is not None and browser.HOST.cgroup_problem is None
    members = set()
    for d in cgroup.dirs:
        members |= {int(p) for p in Path(d, "cgroup.procs").read_text().split()}
    chromium = {pid for pid, _ in chromium_descendants()}
    assert len(chromium) >= 2 and chromium <= members
    # no sh is left (a root worker's unshare waits for Chromium, browser_sandbox.isolate_command)
    assert all(re.search(r"chrom|/unshare$", os.readlink(f"/proc/{pid}/exe")) for pid in members)
    mine = f"batch-runner-browser@{os.getpid()}"
    assert mine in run_cgroup_names()
    browser.shutdown_browser()
    assert not any(os.path.exists(d) for d in cgroup.dirs)
    assert mine not in run_cgroup_names()


def test_a_killed_worker_s_browser_cgroup_is_swept(browser_cgroups, fake_web, tmp_path):
    """A worker killed outright (the pool's end, the OOM killer) leaves its Chromium's cgroup: the run's
    end removes its parent with all in it, and a later run what a killed runner (or a worker outside a
    run) left."""
    from batchrun.prompt.sandboxes.local.limits import remove_run_cgroups, run_cgroup_names
    from batchrun.prompt.tools.browser_cgroup import run_parent, sweep_orphans

    script = tmp_path / "worker.py"
    script.write_text(
        "import json, sys, time\n"
        "from batchrun.prompt.tools.catalog import execute_tool_call, known_tool_names\n"
        "from batchrun.prompt.tools.config import ToolSettings\n"
        "from batchrun.prompt.tools.registry import ToolContext\n"
        "env = {'WEB_ALLOW_PRIVATE_ADDRESSES': '1'}\n"
        "ctx = ToolContext(sandbox=None, settings=ToolSettings(tool_env=env, browser_cgroup=sys.argv[2]))\n"
        "out = execute_tool_call('browser_navigate', json.dumps({'url': sys.argv[1]}), ctx, set(known_tool_names()))\n"
        "print(json.loads(out)['title'], flush=True)\n"
        "time.sleep(60)\n"
    )
    import subprocess
    import sys

    for parent in (run_parent(), ""):
        worker = subprocess.Popen(
            [sys.executable, str(script), fake_web.url("/"), parent],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            assert worker.stdout.readline().strip() == "Fake Site Home"
        finally:
            worker.kill()
            worker.wait()
        left = parent or f"batch-runner-browser@{worker.pid}"
        assert left in run_cgroup_names()
        if parent:
            remove_run_cgroups(parent)  # what the run's end does (run/dispatch.py)
        else:
            assert sweep_orphans() >= 1  # what a run's start does (cli.tool_settings)
        assert left not in run_cgroup_names()


def test_without_cgroups_chromium_keeps_its_rlimits_and_the_run_says_so(
    monkeypatch, fake_web, tool_ctx, call_tool
):
    from batchrun.prompt.tools import browser_cgroup
    from batchrun.prompt.tools.config import browser_config

    browser.shutdown_browser()
    monkeypatch.setattr(browser_cgroup, "cgroup_layout", lambda: "no delegation here")
    try:
        assert call_tool(tool_ctx(), "browser_navigate", url=fake_web.url("/"))["success"] is True
        assert browser.HOST.cgroup is None and browser.HOST.cgroup_problem == "no delegation here"
        line = browser_cgroup.describe(browser_config())
        assert line == (
            "Browser limits: each Chromium process 2048 MiB of data (RLIMIT_DATA); no CPU limit and no "
            "limit on its processes together (no delegation here)"
        )
    finally:
        browser.shutdown_browser()


def test_browser_share_settings(clean_tool_env):
    from batchrun.prompt.tools.config import browser_config

    cfg = browser_config()
    assert (cfg.cpus, cfg.tree_memory_mb) == (1.0, 4096)
    cfg = browser_config(ToolSettings(tool_env={"BROWSER_CPUS": "0.5", "BROWSER_TREE_MEMORY_MB": "8192"}))
    assert (cfg.cpus, cfg.tree_memory_mb) == (0.5, 8192)
    for name, value, says in (
        ("BROWSER_CPUS", "0.05", "BROWSER_CPUS must be a number of cores from 0.1"),
        ("BROWSER_CPUS", "nan", "BROWSER_CPUS must be a finite number"),
        ("BROWSER_CPUS", "inf", "BROWSER_CPUS must be a finite number"),
        ("BROWSER_CPUS", "lots", "BROWSER_CPUS must be a number"),
        ("BROWSER_TREE_MEMORY_MB", "512", "BROWSER_TREE_MEMORY_MB must be at least 1024"),
        ("BROWSER_TREE_MEMORY_MB", "1.5", "BROWSER_TREE_MEMORY_MB must be an integer"),
    ):
        with pytest.raises(ValueError, match=says):
            browser_config(ToolSettings(tool_env={name: value}))
