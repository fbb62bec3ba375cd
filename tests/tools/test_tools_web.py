"""web_search against fake providers at the HTTP level, web_extract against the local fake site."""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import pretend_public, skip_or_fail

from batchrun.fakes.fake_services import FakeWebServer, Page
from batchrun.prompt.tools import web
from batchrun.prompt.tools.catalog import available_toolsets, tools_for_toolsets
from batchrun.prompt.tools.config import (
    SEARCH_PROVIDERS,
    ToolConfigError,
    ToolSettings,
    extract_config,
    search_config,
)

PRIVATE_OFF = {"WEB_ALLOW_PRIVATE_ADDRESSES": "0"}


@pytest.fixture
def tool_ctx(local_tool_ctx):
    """The fake servers listen on 127.0.0.1 (see local_tool_ctx); PRIVATE_OFF turns the guard back on."""
    return local_tool_ctx


AUTH_HEADERS = {
    "tavily": ("authorization", "Bearer {key}"),
    "brave": ("x-subscription-token", "{key}"),
    "exa": ("x-api-key", "{key}"),
    "firecrawl": ("authorization", "Bearer {key}"),
}


# ----------------------------------------------------------------------------- web_search


@pytest.mark.parametrize("provider", SEARCH_PROVIDERS)
def test_search_through_each_provider_returns_the_site_pages(provider, fake_web, tool_ctx, call_tool):
    ctx = tool_ctx(fake_web.provider_env(provider))
    fake_web.requests.clear()
    out = call_tool(ctx, "web_search", query="Alpha Centauri light-years")
    assert out["success"] is True and out["query"] == "Alpha Centauri light-years"
    assert out["results"][0]["url"] == fake_web.url("/articles/alpha.html")
    assert out["results"][0]["title"] == "Alpha Centauri"
    assert "ALPHA-FACT" in out["results"][0]["description"]
    assert [r["position"] for r in out["results"]] == list(range(1, len(out["results"]) + 1))
    assert 1 <= len(out["results"]) <= 5
    sent = fake_web.requests[-1]
    assert sent["path"].startswith(f"/{provider}/")
    if provider in AUTH_HEADERS:
        name, value = AUTH_HEADERS[provider]
        assert sent["headers"].get(name) == value.format(key=fake_web.api_key)


def test_search_result_count_follows_the_setting(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx({**fake_web.provider_env("tavily"), "WEB_SEARCH_MAX_RESULTS": "2"})
    out = call_tool(ctx, "web_search", query="the fake site pages alpha beta gallery")
    assert len(out["results"]) == 2
    assert fake_web.requests[-1]["body"]["max_results"] == 2


def test_search_provider_error_is_an_observation_and_hides_the_key(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx(fake_web.provider_env("brave"))
    out = call_tool(ctx, "web_search", query="alpha [error:503]")
    assert "503" in out["error"] and "brave" in out["error"]
    assert fake_web.api_key not in json.dumps(out)


def test_search_with_a_wrong_key_reports_401(fake_web, tool_ctx, call_tool):
    env = {**fake_web.provider_env("exa"), "EXA_API_KEY": "wrong-key"}
    out = call_tool(tool_ctx(env), "web_search", query="alpha")
    assert "401" in out["error"]


def test_search_with_no_hits_says_so(fake_web, tool_ctx, call_tool):
    out = call_tool(tool_ctx(fake_web.provider_env("searxng")), "web_search", query="zzzqqq")
    assert out["success"] is True and out["results"] == [] and "no results" in out["note"]


def test_unreachable_provider_is_an_error(tool_ctx, call_tool):
    env = {"WEB_SEARCH_PROVIDER": "searxng", "SEARXNG_URL": "http://127.0.0.1:9", "WEB_TIMEOUT_S": "3"}
    out = call_tool(tool_ctx(env), "web_search", query="alpha")
    assert "search failed" in out["error"]


# ----------------------------------------------------------------------------- configuration


def test_web_is_offered_only_with_a_provider(clean_tool_env, fake_web):
    assert "web" not in available_toolsets()
    assert "web" in available_toolsets(ToolSettings(tool_env=fake_web.provider_env("searxng")))


def test_browser_toolset_offers_web_search_when_a_provider_is_configured(clean_tool_env, fake_web):
    """As in the reference, browser includes web_search: here only when a search provider is set."""
    configured = ToolSettings(tool_env=fake_web.provider_env("searxng"))
    plain = [t.name for t in tools_for_toolsets(["browser"])]
    assert plain and all(name.startswith("browser_") for name in plain)
    assert [t.name for t in tools_for_toolsets(["browser"], configured)] == ["web_search", *plain]
    assert [t.name for t in tools_for_toolsets(["web", "browser"], configured)].count("web_search") == 1
    assert "web_extract" not in {t.name for t in tools_for_toolsets(["browser"], configured)}
    bad = ToolSettings(
        tool_env={"WEB_SEARCH_PROVIDER": "google"}
    )  # reported by the run's preflight, not offered
    assert [t.name for t in tools_for_toolsets(["browser"], bad)] == plain


def test_a_browser_only_run_searches_the_web(clean_tool_env, fake_web, chromium_ready, tmp_path, monkeypatch):
    """End to end: the browser_only distribution, a search provider set in the environment, the fake
    model (which calls the first offered tool): web_search runs and its results reach the record."""
    import batch_runner
    from batchrun.fakes.fake_model import FakeModelServer

    for name, value in fake_web.provider_env("searxng").items():
        monkeypatch.setenv(name, value)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "alpha article search"}) + "\n")
    with FakeModelServer(latency_s=0) as server:
        batch_runner.main(
            dataset_file=str(tmp_path / "p.jsonl"), batch_size=1, run_name="b", model="fake-model",
            base_url=server.base_url, api_key="k", output_dir=str(tmp_path / "data"), num_workers=1,
            distribution="browser_only",
        )  # fmt: skip
    (record,) = [json.loads(line) for line in (tmp_path / "data" / "b" / "trajectories.jsonl").open()]
    assert record["toolsets_used"] == ["browser"]
    offered = json.loads(record["conversations"][0]["value"].split("<tools>\n")[1].split("\n</tools>")[0])
    assert offered[0]["name"] == "web_search" and offered[1]["name"].startswith("browser_")
    assert record["tool_stats"]["web_search"] == {"count": 1, "success": 1, "failure": 0}
    assert fake_web.url("/articles/alpha.html") in record["conversations"][3]["value"]


def test_provider_is_detected_from_its_key(clean_tool_env):
    cfg = search_config(ToolSettings(tool_env={"BRAVE_API_KEY": "k"}))
    assert (cfg.provider, cfg.base_url, cfg.api_key) == ("brave", "https://api.search.brave.com", "k")


def test_self_hosted_firecrawl_needs_no_key(clean_tool_env):
    cfg = search_config(
        ToolSettings(tool_env={"WEB_SEARCH_PROVIDER": "firecrawl", "FIRECRAWL_API_URL": "http://fc:3002/"})
    )
    assert (cfg.base_url, cfg.api_key) == ("http://fc:3002", None)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"WEB_SEARCH_PROVIDER": "google"}, "WEB_SEARCH_PROVIDER"),
        ({"WEB_SEARCH_PROVIDER": "tavily"}, "TAVILY_API_KEY"),
        ({"WEB_SEARCH_PROVIDER": "searxng"}, "SEARXNG_URL"),
        ({"BRAVE_API_KEY": "k", "WEB_TIMEOUT_S": "soon"}, "WEB_TIMEOUT_S"),
        ({"SEARXNG_URL": "ftp://x"}, "SEARXNG_URL"),
        ({"BRAVE_API_KEY": "k", "WEB_EXTRACT_MAX_BYTES": "lots"}, "WEB_EXTRACT_MAX_BYTES"),
        ({"WEB_EXTRACT_MAX_CHARS": "0"}, "WEB_EXTRACT_MAX_CHARS"),
    ],
)
def test_bad_settings_fail_at_start_naming_the_variable(clean_tool_env, env, named):
    with pytest.raises(ToolConfigError, match=named):
        available_toolsets(ToolSettings(tool_env=env))


# Every setting read as a float, with the toolset's config that reads it.
FLOAT_SETTINGS = [
    ("WEB_TIMEOUT_S", "web"),
    ("VISION_TIMEOUT_S", "vision"),
    ("IMAGE_GEN_TIMEOUT_S", "image_gen"),
    ("MOA_TIMEOUT_S", "moa"),
    ("MOA_REFERENCE_TEMPERATURE", "moa"),
    ("MOA_AGGREGATOR_TEMPERATURE", "moa"),
    ("BROWSER_NAV_TIMEOUT_S", "browser"),
    ("BROWSER_ACTION_TIMEOUT_S", "browser"),
    ("BROWSER_CPUS", "browser"),
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "NaN"])
@pytest.mark.parametrize(("name", "toolset"), FLOAT_SETTINGS)
def test_non_finite_numbers_are_refused_naming_the_variable(clean_tool_env, name, toolset, value):
    """float() reads "nan" and "inf": WEB_TIMEOUT_S=nan was taken, and every fetch then failed on a
    ValueError from the socket layer (inf: the deadline's timer thread died), the run going on."""
    from batchrun.prompt.tools import config

    env = {"IMAGE_GEN_MODEL": "m", "SEARXNG_URL": "http://search.invalid", name: value}
    run = ToolSettings(llm_base_url="http://llm.invalid/v1", llm_model="m", tool_env=env)
    read = {
        "web": lambda: (config.search_config(run), config.extract_config(run)),
        "vision": lambda: config.vision_config(run),
        "image_gen": lambda: config.image_gen_config(run),
        "moa": lambda: config.moa_config(run),
        "browser": lambda: config.browser_config(run),
    }[toolset]
    if toolset == "browser" and config.browser_config(replace(run, tool_env={})) is None:
        pytest.skip("no Chromium or Playwright here: browser settings are not read")
    with pytest.raises(ToolConfigError, match=f"^{name} must be a finite number, got '{value}'$"):
        read()
    with pytest.raises(ToolConfigError, match=name):
        available_toolsets(run)


# ----------------------------------------------------------------------------- web_extract


def test_extract_gives_main_content_as_markdown(fake_web, tool_ctx, call_tool):
    out = call_tool(tool_ctx(), "web_extract", urls=[fake_web.url("/articles/alpha.html")])
    assert "error" not in out
    page = out["results"][0]
    assert page["error"] is None and page["title"] == "Alpha Centauri"
    text = page["content"]
    assert text.startswith("# Alpha Centauri")
    assert "ALPHA-FACT: it lies 4.37 light-years away." in text
    assert "## Components" in text and "- Proxima Centauri" in text
    assert f"[Beta Pictoris]({fake_web.url('/articles/beta.html')})" in text  # links made absolute
    assert f"![A red star]({fake_web.url('/img/red.png')})" in text
    for noise in ("NAV-NOISE", "FOOTER-NOISE", "SCRIPT-NOISE", "STYLE-NOISE", "ASIDE-NOISE"):
        assert noise not in text


def test_extract_without_main_element_keeps_body_minus_chrome(fake_web, tool_ctx, call_tool):
    page = call_tool(tool_ctx(), "web_extract", urls=[fake_web.url("/articles/beta.html")])["results"][0]
    assert "BETA-FACT" in page["content"] and "| Age | 23 million years |" in page["content"]
    assert "NAV-NOISE" not in page["content"] and "FOOTER-NOISE" not in page["content"]


def test_extract_follows_redirects_and_decodes_charsets(fake_web, tool_ctx, call_tool):
    out = call_tool(
        tool_ctx(),
        "web_extract",
        urls=[fake_web.url("/redirect"), fake_web.url("/latin1.html"), fake_web.url("/plain.txt")],
    )
    moved, latin, plain = out["results"]
    assert moved["final_url"] == fake_web.url("/articles/alpha.html") and "ALPHA-FACT" in moved["content"]
    assert latin["title"] == "Café" and "CAFÉ-TEXT crème brûlée" in latin["content"]
    assert plain["content"].startswith("PLAIN-TEXT-FILE line one") and plain["content_type"] == "text/plain"


def test_extract_refuses_other_content_types_per_url(fake_web, tool_ctx, call_tool):
    out = call_tool(
        tool_ctx(), "web_extract", urls=[fake_web.url("/doc.pdf"), fake_web.url("/articles/beta.html")]
    )
    pdf, beta = out["results"]
    assert "application/pdf" in pdf["error"] and pdf["content"] == ""
    assert beta["error"] is None
    assert "error" not in out  # one good page makes the call a success


def test_extract_all_failing_is_a_failure(fake_web, tool_ctx, call_tool):
    out = call_tool(
        tool_ctx(), "web_extract", urls=[fake_web.url("/missing.html"), fake_web.url("/img/red.png")]
    )
    assert "HTTP 404" in out["results"][0]["error"]
    assert "image/png" in out["results"][1]["error"]
    assert "HTTP 404" in out["error"] and "image/png" in out["error"]


@pytest.mark.parametrize("page", ["/big.html", "/chunked.html"])
def test_extract_size_limit(page, fake_web, tool_ctx, call_tool):
    ctx = tool_ctx({"WEB_EXTRACT_MAX_BYTES": "100000"})
    out = call_tool(ctx, "web_extract", urls=[fake_web.url(f"{page}?bytes=500000")])
    assert "limit of 100000 bytes" in out["error"]
    small = call_tool(ctx, "web_extract", urls=[fake_web.url(f"{page}?bytes=20000")])
    assert small["results"][0]["error"] is None and len(small["results"][0]["content"]) > 10000


def test_extract_time_limit(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx({"WEB_TIMEOUT_S": "1"})
    started = time.monotonic()
    out = call_tool(ctx, "web_extract", urls=[fake_web.url("/slow.html?delay=20")])
    assert time.monotonic() - started < 15  # not waiting for the 20 s page
    assert "timed out" in out["error"] or "took longer" in out["error"]


def test_extract_cuts_long_pages_and_says_so(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx({"WEB_EXTRACT_MAX_CHARS": "2500"})
    page = call_tool(ctx, "web_extract", urls=[fake_web.url("/big.html?bytes=50000")])["results"][0]
    assert len(page["content"]) == 2500 and "cut at 2500" in page["truncated"]


def test_extract_shares_the_output_budget_between_urls(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    ctx.output_cap_bytes = 16 * 1024
    urls = [fake_web.url(f"/big.html?bytes={50000 + i}") for i in range(4)]
    out = call_tool(ctx, "web_extract", urls=urls)
    assert all(r["truncated"] for r in out["results"])
    assert len(json.dumps(out)) < 20 * 1024


def test_extract_page_built_by_script_suggests_the_browser(fake_web, tool_ctx, call_tool):
    page = call_tool(tool_ctx(), "web_extract", urls=[fake_web.url("/script-only.html")])["results"][0]
    assert page["content"] == "" and "browser" in page["note"]


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x", "not a url"])
def test_extract_only_fetches_http(url, tool_ctx, call_tool):
    out = call_tool(tool_ctx(), "web_extract", urls=[url])
    assert "not an http(s) URL" in out["results"][0]["error"]


def test_extract_argument_checks(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx()
    assert "at most 5" in call_tool(ctx, "web_extract", urls=[fake_web.url("/")] * 6)["error"]
    assert "must be array" in call_tool(ctx, "web_extract", urls=fake_web.url("/"))["error"]
    assert "non-empty" in call_tool(ctx, "web_extract", urls=[])["error"]


# ----------------------------------------------------------------------------- private addresses (setting off)


@pytest.fixture
def own_site():
    """A fake site of this test's own, to tell which requests reached it."""
    with FakeWebServer() as server:
        yield server


def test_private_addresses_are_refused_by_default(clean_tool_env):
    assert extract_config().allow_private is False
    assert extract_config(ToolSettings(tool_env={"WEB_ALLOW_PRIVATE_ADDRESSES": "1"})).allow_private is True


def test_the_setting_comes_from_the_environment_overlaid_by_tool_env(clean_tool_env, monkeypatch):
    monkeypatch.setenv("WEB_ALLOW_PRIVATE_ADDRESSES", "true")
    assert extract_config().allow_private is True
    assert extract_config(ToolSettings(tool_env=PRIVATE_OFF)).allow_private is False
    with pytest.raises(ToolConfigError, match="WEB_ALLOW_PRIVATE_ADDRESSES"):
        extract_config(ToolSettings(tool_env={"WEB_ALLOW_PRIVATE_ADDRESSES": "maybe"}))


def test_extract_of_a_live_local_server_is_refused_and_sends_nothing(own_site, tool_ctx, call_tool):
    url = own_site.url("/articles/alpha.html")
    out = call_tool(tool_ctx(PRIVATE_OFF), "web_extract", urls=[url])
    expected = f"web_extract: {url} resolves to a private address (127.0.0.1); refused"
    assert out["results"][0]["error"] == expected and out["error"] == expected
    assert out["results"][0]["content"] == ""
    assert own_site.requests == []


@pytest.mark.parametrize(
    ("url", "ip"),
    [
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
        ("http://[::1]/", "::1"),
        ("http://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1"),
        ("http://0.0.0.0/", "0.0.0.0"),
        ("https://10.0.0.5/admin", "10.0.0.5"),
        ("http://192.168.1.1:8080/", "192.168.1.1"),
        ("http://100.64.0.1/", "100.64.0.1"),
        ("http://224.0.0.1/", "224.0.0.1"),
        ("http://[fd00::1]/", "fd00::1"),
        ("http://2130706433/", "127.0.0.1"),  # 127.0.0.1 written as one number
        ("http://127.1/", "127.0.0.1"),
        ("http://localhost/", None),  # 127.0.0.1 or ::1, whichever the resolver lists first
    ],
)
def test_extract_refuses_private_addresses_in_any_spelling(url, ip, tool_ctx, call_tool):
    error = call_tool(tool_ctx(PRIVATE_OFF), "web_extract", urls=[url])["results"][0]["error"]
    assert error.startswith(f"web_extract: {url} resolves to a private address (") and error.endswith(
        "); refused"
    )
    if ip is not None:
        assert f"({ip})" in error


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://example.com/x", "data:text/plain,hi", "gopher://x/"]
)
def test_extract_refuses_other_schemes_with_the_setting_off(url, tool_ctx, call_tool):
    assert (
        "not an http(s) URL"
        in call_tool(tool_ctx(PRIVATE_OFF), "web_extract", urls=[url])["results"][0]["error"]
    )


def test_a_public_looking_name_that_resolves_to_loopback_is_refused(
    own_site, monkeypatch, tool_ctx, call_tool
):
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):
        return real("127.0.0.1" if host == "docs.example.com" else host, port, *args, **kwargs)

    monkeypatch.setattr(web.socket, "getaddrinfo", fake)
    url = f"http://docs.example.com:{own_site.port}/site/articles/alpha.html"
    error = call_tool(tool_ctx(PRIVATE_OFF), "web_extract", urls=[url])["results"][0]["error"]
    assert error == f"web_extract: {url} resolves to a private address (127.0.0.1); refused"
    assert own_site.requests == []


def test_every_resolved_address_is_checked(monkeypatch):
    answers = [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", 80)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", 80)),
    ]
    monkeypatch.setattr(web.socket, "getaddrinfo", lambda *a, **k: answers)
    with pytest.raises(web.PrivateAddressError) as caught:
        web.resolve_public("mixed.example.com", 80)
    assert caught.value.ip == "10.0.0.5"
    monkeypatch.setattr(web.socket, "getaddrinfo", lambda *a, **k: answers[:1])
    assert web.resolve_public("public.example.com", 80) == answers[:1]


def test_the_browsers_egress_resolves_as_the_web_tools_do(monkeypatch):
    """The egress proxy had its own copy of the resolution the web tools make where nothing is refused
    (WEB_ALLOW_PRIVATE_ADDRESSES=1); now both take web.resolve_any, and resolve_public is it plus the
    address check: a private answer passes the one, is refused by the other, and no answer is an OSError."""
    import asyncio

    from batchrun.prompt.tools.browser_egress import AddressGuard

    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", 80))]
    asked: list[str] = []
    monkeypatch.setattr(web.socket, "getaddrinfo", lambda host, *a, **k: asked.append(host) or answers)
    assert asyncio.run(AddressGuard(allow_private=True).resolve("intranet.example", 80)) == answers
    with pytest.raises(web.PrivateAddressError):
        asyncio.run(AddressGuard().resolve("intranet.example", 80))
    assert asked == ["intranet.example"] * 2
    resolved = []
    monkeypatch.setattr(web, "resolve_any", lambda host, port: resolved.append(host) or answers)
    assert asyncio.run(AddressGuard(allow_private=True).resolve("one.example", 80)) == answers
    assert resolved == ["one.example"]
    monkeypatch.undo()
    monkeypatch.setattr(web.socket, "getaddrinfo", lambda *a, **k: [])
    with pytest.raises(OSError, match="has no address"):
        web.resolve_any("nowhere.example", 80)


@pytest.mark.parametrize(
    ("address", "private"),
    [
        ("93.184.216.34", False),
        ("2606:4700:4700::1111", False),
        ("::ffff:93.184.216.34", False),  # IPv4-mapped: judged by the IPv4 address inside
        ("64:ff9b::5db8:d822", False),  # NAT64 of 93.184.216.34
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("172.16.0.1", True),
        ("192.168.0.1", True),
        ("169.254.169.254", True),
        ("100.100.100.200", True),  # shared address space (Alibaba Cloud's metadata service)
        ("0.0.0.0", True),
        ("255.255.255.255", True),
        ("240.0.0.1", True),
        ("239.1.1.1", True),
        ("::", True),
        ("::1", True),
        ("::ffff:10.0.0.1", True),
        ("::127.0.0.1", True),  # IPv4-compatible (deprecated)
        ("64:ff9b::a00:1", True),  # NAT64 of 10.0.0.1
        ("2002:7f00:1::", True),  # 6to4 of 127.0.0.1
        ("fe80::1", True),
        ("fc00::1", True),
        ("ff02::1", True),
        ("fd00:ec2::254", True),  # AWS's IPv6 metadata address
    ],
)
def test_is_private_address(address, private):
    assert web.is_private_address(ipaddress.ip_address(address)) is private


def test_a_redirect_to_a_private_address_is_refused(own_site, monkeypatch, tool_ctx, call_tool):
    target = own_site.url("/articles/alpha.html")
    own_site.pages["/hop"] = Page(b"", status=302, headers={"Location": target})
    pretend_public(monkeypatch, "localhost")  # the first hop passes as a public host
    ctx = tool_ctx(PRIVATE_OFF)
    allowed = call_tool(
        ctx, "web_extract", urls=[f"http://localhost:{own_site.port}/site/articles/beta.html"]
    )
    assert "BETA-FACT" in allowed["results"][0]["content"]
    own_site.requests.clear()
    out = call_tool(ctx, "web_extract", urls=[f"http://localhost:{own_site.port}/site/hop"])
    assert (
        out["results"][0]["error"]
        == f"web_extract: {target} resolves to a private address (127.0.0.1); refused"
    )
    assert [r["path"] for r in own_site.requests] == ["/site/hop"]  # the redirect target was never asked


def test_the_connection_goes_to_the_address_that_was_checked(own_site, monkeypatch, tool_ctx, call_tool):
    """No second DNS lookup between check and connect (rebinding): the name below resolves only
    through the checked answer, so the fetch works only if it connects to that answer."""
    pretend_public(monkeypatch, "rebind.example.com")
    real = socket.getaddrinfo

    def no_dns(host, *args, **kwargs):
        if host == "rebind.example.com":
            raise socket.gaierror(socket.EAI_NONAME, "a second lookup happened")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(web.socket, "getaddrinfo", no_dns)
    url = f"http://rebind.example.com:{own_site.port}/site/articles/alpha.html"
    page = call_tool(tool_ctx(PRIVATE_OFF), "web_extract", urls=[url])["results"][0]
    assert page["error"] is None and "ALPHA-FACT" in page["content"]
    assert own_site.requests[-1]["headers"]["host"] == f"rebind.example.com:{own_site.port}"


HOST_SERVICE = r"""
import http.server, json, sys, threading
from batchrun.prompt.tools import web
hits = []
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"HOST-SERVICE")
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)  # every address of this host
threading.Thread(target=server.serve_forever, daemon=True).start()
port = server.server_address[1]
out = {}
for ip in sys.argv[1:]:
    url = f"http://{ip}:{port}/secret" if ":" not in ip else f"http://[{ip}]:{port}/secret"
    try:
        out[ip] = web.fetch_url(url, max_bytes=1000, timeout_s=5, public_only=True).body.decode()
    except web.FetchError as exc:
        out[ip] = str(exc)
print(json.dumps({"results": out, "hits": hits}))
"""


def test_the_hosts_own_public_address_is_refused():
    """A machine whose interface has a public address (a bare-metal or VPS host) answers on it with
    every service listening on 0.0.0.0: the web tools run on the host, so that address is the host's
    own services, as loopback is. In a network namespace of our own whose interface has a public
    address (11.22.33.44, and an IPv6 one): neither is fetched, nor the IPv4-mapped form."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        skip_or_fail("unshare and ip are needed")
    setup = (
        "ip link set lo up && ip link add br-v0 type veth peer name br-v1 && ip link set br-v0 up"
        " && ip link set br-v1 up && ip addr add 11.22.33.44/24 dev br-v0"
        ' && ip -6 addr add 2a01:4f8::44/64 dev br-v0 nodad && exec "$0" -c "$@"'
    )
    addresses = ["11.22.33.44", "2a01:4f8::44", "::ffff:11.22.33.44"]
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", setup, sys.executable, HOST_SERVICE, *addresses],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        skip_or_fail(f"cannot make a network namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    for ip in addresses:
        assert got["results"][ip].endswith("; refused"), got
    assert got["hits"] == []


def test_search_providers_on_private_addresses_still_work(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx({**fake_web.provider_env("searxng"), **PRIVATE_OFF})
    out = call_tool(ctx, "web_search", query="Alpha Centauri")
    assert out["success"] is True and out["results"][0]["url"] == fake_web.url("/articles/alpha.html")


# ----------------------------------------------------------------------------- through the agent loop


def test_agent_loop_searches_and_the_answer_quotes_the_result(fake_web, tool_ctx, run_tool_loop):
    ctx = tool_ctx(fake_web.provider_env("tavily"))
    messages = run_tool_loop(ctx, "Beta Pictoris debris disk", ["web"])
    tool_msgs = [m for m in messages if m["role"] == "tool"]
    assert [m["name"] for m in tool_msgs] == ["web_search"]
    result = json.loads(tool_msgs[0]["content"])
    assert result["results"][0]["url"] == fake_web.url("/articles/beta.html")
    assert messages[-1]["role"] == "assistant" and '"success": true' in messages[-1]["content"]
