"""The ``browser`` toolset: headless Chromium (Debian's package) driven through Playwright.

Threading model. A worker process runs many prompts on threads, and Playwright objects belong
to the event loop (sync API: the thread) that made them. So each process has one browser host:
a private thread running an asyncio loop that owns Playwright and one Chromium, started on the
first browser call. Prompt threads hand it coroutines (``run_coroutine_threadsafe``) and wait
with the call's timeout; the loop interleaves the prompts' page operations, so one slow page
does not stall the others. Each prompt gets its own browser context (cookies, storage, pages),
made on its first browser call and closed by ``close_prompt_resources(ctx)``. The host stops at
process exit (atexit and multiprocessing finalizers); if the process is killed, Playwright's
driver notices its pipe closing and takes Chromium down with it.

Snapshots are Playwright's accessibility tree in its AI mode; element refs are shown as
``[@e5]`` and accepted by browser_click and browser_type as ``@e5`` (or ``e5``).

Private addresses. Chromium runs on the host, not in the prompt's sandbox, so unless
WEB_ALLOW_PRIVATE_ADDRESSES is set a prompt's context only reaches public addresses, by two
layers. (1) ``context.route("**/*")`` sees every request the page makes first (navigation,
frames, subresources, fetch/XHR) and aborts those to another scheme than http(s) or to a host
that resolves to a non-public address (``web.resolve_public``); browser_navigate checks its URL
the same way first and says why it refused. (2) Playwright does not route redirect hops, and
Chromium resolves names itself, so the context also goes through its own small HTTP proxy
(``EgressProxy``, on 127.0.0.1, on the browser loop): the proxy resolves each host, refuses it
if any address is not public, and connects to an address it checked. Every hop of a redirect,
WebSockets (tunnelled with CONNECT) and a name whose DNS answer changes after the first check
(rebinding) all meet that check. WebRTC's UDP, which would pass beside the proxy, is turned off
(``BROWSER_FLAGS``).

Chromium's own sandbox. Renderers run in Chromium's sandbox (user, PID and network namespaces of their
own, seccomp-bpf); a root worker starts Chromium as nobody, which that sandbox needs. Where user
namespaces are refused it runs without, and the run's start and the log say so (``browser_sandbox``).

The host's share. Every Chromium process starts under RLIMIT_DATA (``BROWSER_MEMORY_MB``): a page
allocating without end gets allocation failures or a crashed tab, which the session replaces. Where
cgroups can be made, the worker's whole Chromium runs in one of its own (``browser_cgroup``), with a
memory limit on all its processes (``BROWSER_TREE_MEMORY_MB``) and a CPU quota (``BROWSER_CPUS``).
The popup blocker stays on and a prompt keeps at most ``MAX_PAGES`` tabs. A page writing more than
``CONSOLE_FLOOD_PER_S`` console messages a second is closed: they all cross the one browser loop.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import json
import logging
import os
import re
import shlex
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # asyncio is imported where the browser runs: every run imports this module
    import asyncio
    import socket

    from batchrun.prompt.sandboxes.local.limits import PromptCgroup
    from batchrun.prompt.tools.browser_sandbox import SandboxPlan, UserNetns

from batchrun.prompt.tools.browser_egress import (
    FAILED_HEADER,
    REFUSED_HEADER,
    ROUTED_SCHEMES,
    AddressGuard,
    EgressProxy,
    refusal_message,
)
from batchrun.prompt.tools.config import BROWSER_FLAGS, BrowserConfig, browser_config, vision_config
from batchrun.prompt.tools.registry import (
    Tool,
    ToolArgumentError,
    ToolContext,
    register,
    register_toolset_check,
)

log = logging.getLogger(__name__)
RESOURCE_KEY = "browser"
SCREENSHOTS_DIR = "screenshots"
MAX_IMAGES = 100
MAX_CONSOLE = 200  # messages kept per prompt
MAX_PAGES = 10  # open tabs per prompt: a tab opened beyond them is closed at once
# Every console message and uncaught error of a page crosses Chromium, Playwright's driver and this
# process's browser loop, which all prompts of the worker share: a page logging in a loop would hold
# every other prompt's browser calls up (and its own context's close). A page past this many in one
# second is closed.
CONSOLE_FLOOD_PER_S = 500
MAX_EVAL_CHARS = 8000
FULL_SNAPSHOT_FACTOR = 4  # full=true shows this many times the default snapshot size
_INTERACTIVE = (
    "link|button|textbox|searchbox|checkbox|radio|combobox|listbox|option|slider|spinbutton|switch|tab|"
    "menuitem|menuitemcheckbox|menuitemradio|treeitem"
)
_REF = r"(?:f\d+)?e\d+"  # Playwright numbers elements of later documents and frames f<N>e<M>
_REF_RE = re.compile(rf"\[ref=({_REF})\]")
_NOISE_RE = re.compile(r" \[(?:cursor=pointer|active)\]")
_BARE_GENERIC_RE = re.compile(rf"- generic \[@{_REF}\]:?")
_INTERACTIVE_RE = re.compile(rf"- (?:{_INTERACTIVE})\b.*?\[ref=({_REF})\]")


class BrowserToolError(Exception):
    """A browser action failed in a way the model should see."""


# ----------------------------------------------------------------------------- the process's browser


class BrowserHost:
    """One Chromium per process, owned by a private event-loop thread (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._playwright: Any = None
        self._browser: Any = None
        self._launching: asyncio.Lock | None = None
        self.launches = 0  # how many times Chromium was started in this process (tests read it)
        # Chromium's cgroup (browser_cgroup.py), made at its first start; None: not made (yet), or
        # ``cgroup_problem`` says why it cannot be (then RLIMIT_DATA alone bounds it).
        self.cgroup: PromptCgroup | None = None
        self.cgroup_problem: str | None = None
        # How Chromium starts (browser_sandbox.plan), at its first start.
        self.sandbox: SandboxPlan | None = None
        # Chromium's network namespace (browser_sandbox.make_netns; None: the host's), made at its first
        # start; the prompts' egress proxies listen in it
        self.netns_fd: int | None = None
        # A worker that is not root: the same, kept by a process that lives in it (browser_sandbox.UserNetns)
        self.user_netns: UserNetns | None = None

    @property
    def has_own_network(self) -> bool:
        """Whether Chromium's network is a namespace of its own, where it reaches only the egress proxy."""
        return self.netns_fd is not None or self.user_netns is not None

    # -- the loop thread -------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        import asyncio

        with self._lock:
            alive = self._thread is not None and self._thread.is_alive()
            if self._loop is None or self._pid != os.getpid() or not alive:
                # A forked child inherits no threads: it starts its own loop and browser.
                loop = asyncio.new_event_loop()
                # Address checks (getaddrinfo) block: they get threads of this loop's own.
                loop.set_default_executor(
                    concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="browser-dns")
                )
                thread = threading.Thread(target=loop.run_forever, name="browser-loop", daemon=True)
                thread.start()
                if self._pid != os.getpid():  # a forked child: the cgroup is its parent's browser's
                    self.cgroup = self.cgroup_problem = None
                    if self.netns_fd is not None:  # and so is the network namespace: its copy goes
                        os.close(self.netns_fd)
                        self.netns_fd = None
                    self.user_netns = None  # the parent's: its keeper is not this process's to end
                self._loop, self._thread, self._pid = loop, thread, os.getpid()
                self._playwright = self._browser = self._launching = None
                _register_exit_hooks()
            return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def call(self, make: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        """Run ``make()`` on the browser loop and wait for it at most ``timeout_s`` seconds."""
        import asyncio

        loop = self._ensure_loop()
        future = asyncio.run_coroutine_threadsafe(_call(make), loop)
        try:
            return future.result(timeout=max(timeout_s, 0.1))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BrowserToolError(f"the browser action did not finish within {timeout_s:g} s") from None

    def submit(self, make: Callable[[], Awaitable[Any]]) -> concurrent.futures.Future | None:
        """Schedule ``make()`` on the loop without waiting (for cleanup from any thread)."""
        import asyncio

        with self._lock:
            loop = self._loop if self._pid == os.getpid() else None
        if loop is not None and not loop.is_closed():
            return asyncio.run_coroutine_threadsafe(_call(make), loop)
        return None

    # -- Chromium --------------------------------------------------------------------------

    async def browser(self, cfg: BrowserConfig) -> Any:
        """The running Chromium, launched (again, after a crash) when needed. Loop thread only."""
        import asyncio

        if self._launching is None:
            self._launching = asyncio.Lock()
        async with self._launching:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            if self._playwright is None:
                from playwright.async_api import async_playwright

                self._playwright = await async_playwright().start()
            procs = self._chromium_cgroup(cfg)
            sandbox = self._sandbox_plan()
            netns = user_netns = None
            if sandbox.isolated and sandbox.own_root:  # not root: in a namespace a keeper holds
                if self.user_netns is None:
                    from batchrun.prompt.tools.browser_sandbox import UserNetns

                    self.user_netns = UserNetns()
                user_netns = self.user_netns.paths
            elif sandbox.isolated:
                if self.netns_fd is None:
                    from batchrun.prompt.tools.browser_sandbox import make_netns

                    self.netns_fd = make_netns()
                netns = f"/proc/{os.getpid()}/fd/{self.netns_fd}"
            with tempfile.TemporaryDirectory(prefix="batch-runner-chromium-") as tmp:
                # Playwright's own flags turn Chromium's popup blocker off: a page calling
                # window.open in a loop opened a tab every 200 ms (7 MB each, without end).
                self._browser = await self._playwright.chromium.launch(
                    executable_path=_limited_launcher(
                        tmp, cfg, procs, sandbox.user, netns, sandbox.own_root, user_netns
                    ),
                    headless=True,
                    args=[*BROWSER_FLAGS, *(() if sandbox.sandbox else ("--no-sandbox",))],
                    chromium_sandbox=sandbox.sandbox,
                    ignore_default_args=["--disable-popup-blocking"],
                    env=browser_environment(),
                    timeout=60_000,
                )
            self.launches += 1
            return self._browser

    def _sandbox_plan(self) -> SandboxPlan:
        """How Chromium starts here (browser_sandbox.py); said in the log, once per process, when its
        sandbox cannot be on or it reads the host's files."""
        from batchrun.prompt.tools.browser_sandbox import plan

        if self.sandbox is None:
            self.sandbox = plan()
            said = self.sandbox.describe()
            if said.startswith("warning: "):
                log.warning("%s", said.removeprefix("warning: "))
        return self.sandbox

    def _chromium_cgroup(self, cfg: BrowserConfig) -> list[str]:
        """The ``cgroup.procs`` files the launcher moves Chromium into (none: no cgroup here). Made at the
        first start; at a restart, what the last Chromium left in it (a crashed browser's renderers) is
        ended first."""
        from batchrun.prompt.tools import browser_cgroup

        if self.cgroup is None and self.cgroup_problem is None:
            made = browser_cgroup.make(cfg.cgroup_parent, cfg)
            if isinstance(made, str):
                self.cgroup_problem = made
                log.warning("browser: no cgroup for Chromium (%s): RLIMIT_DATA alone bounds it", made)
            else:
                self.cgroup = made
        elif self.cgroup is not None:
            self.cgroup.kill()
        return [os.path.join(d, "cgroup.procs") for d in self.cgroup.dirs] if self.cgroup else []

    def shutdown(self) -> None:
        """Close Chromium and Playwright and stop the loop thread; remove Chromium's cgroup. Idempotent."""
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or self._pid != os.getpid():
                return
            self._loop = self._thread = None

        async def stop() -> None:
            try:
                if self._browser is not None:
                    await self._browser.close()
            finally:
                if self._playwright is not None:
                    await self._playwright.stop()
                self._browser = self._playwright = None

        import asyncio  # loaded already: the loop exists

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=15)
        except Exception:  # a dead browser must not stop the process from exiting
            pass
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=5)
        loop.close()
        cgroup, self.cgroup, self.cgroup_problem, self.sandbox = self.cgroup, None, None, None
        netns_fd, self.netns_fd = self.netns_fd, None
        if netns_fd is not None:  # the namespace ends with the last of Chromium's processes
            os.close(netns_fd)
        user_netns, self.user_netns = self.user_netns, None
        if user_netns is not None:
            user_netns.close()
        if cgroup is not None:  # what a close that failed or timed out left is ended with it
            from batchrun.prompt.tools.browser_cgroup import release

            release(cgroup)


async def _call(make: Callable[[], Awaitable[Any]]) -> Any:
    return await make()


# What Chromium keeps of the worker's environment: where things are, the locale, the time zone and
# the proxies it needs to reach pages. Not the rest (API keys above all): it renders hostile pages on
# the host, and code a page got to run in it (its browser process, or any process where its sandbox
# cannot be on: browser_sandbox.py) would read its own environment.
_BROWSER_ENV = re.compile(
    r"(PATH|HOME|USER|LOGNAME|SHELL|TMPDIR|LANG|LANGUAGE|LC_[A-Z]+|TZ|XDG_[A-Z_]+|FONTCONFIG_[A-Z_]+"
    r"|[A-Za-z]+_proxy|[A-Z]+_PROXY|SSL_CERT_FILE|SSL_CERT_DIR)"
)


def browser_environment(environ: Any = None) -> dict[str, str]:
    """The environment Chromium is started with: the worker's, but for anything not in _BROWSER_ENV."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if _BROWSER_ENV.fullmatch(k)}


def _limited_launcher(
    directory: str,
    cfg: BrowserConfig,
    procs: Sequence[str] = (),
    user: tuple[int, int] | None = None,
    netns: str | None = None,
    own_root: bool = False,
    user_netns: tuple[str, str] | None = None,
) -> str:
    """A launcher in ``directory`` that moves itself into the cgroup whose ``cgroup.procs`` files are
    ``procs`` and starts ``cfg.executable`` under RLIMIT_DATA of ``cfg.memory_mb``: every process Chromium
    forks is born in the cgroup and inherits the limit (see ``BROWSER_MEMORY_MB``). With ``user`` (a root
    worker, browser_sandbox.py) it gives Playwright's profile directory to that uid and gid, makes it
    Chromium's home and temporary directory (root's are not its), and execs Chromium through setpriv as
    them. With ``netns`` (a root worker's, browser_sandbox.make_netns) Chromium starts in that network
    namespace and in PID and mount namespaces of its own, on a root of its own
    (browser_sandbox.isolate_command: the shell becomes the unshare whose child is Chromium); with
    ``own_root`` (a worker that is not root) on that root too, in user, mount and PID namespaces
    (browser_sandbox.own_root_command), with the profile as home and temporary directory, and with
    ``user_netns`` (the paths of a browser_sandbox.UserNetns's namespaces) in that network. Only needed
    until exec (the shell becomes Chromium or that unshare: no process of its own is left)."""
    from batchrun.prompt.tools.browser_sandbox import drop_command, isolate_command, own_root_command

    path = os.path.join(directory, "chromium")
    enter = "".join(f"echo $$ > {shlex.quote(p)} || exit 1\n" for p in procs)
    drop = ""
    # Chromium's home and temporary directory: its profile (root's are not nobody's; the worker's are not on
    # its root of its own)
    if user is not None or own_root:
        enter += (
            'profile=\nfor a in "$@"; do case "$a" in --user-data-dir=*) profile="${a#--user-data-dir=}";; esac; done\n'
            '[ -n "$profile" ] || { echo "no --user-data-dir to give to the browser\'s user" >&2; exit 1; }\n'
            + (f'chown {user[0]}:{user[1]} "$profile" || exit 1\n' if user is not None else "")
            + 'export HOME="$profile" TMPDIR="$profile"\n'
            "unset XDG_CONFIG_HOME XDG_CACHE_HOME XDG_DATA_HOME XDG_STATE_HOME XDG_RUNTIME_DIR\n"
        )
    if user is not None:
        drop = shlex.join(drop_command(user)) + " "
    executable = cfg.executable
    if netns is not None:  # on a root of its own, where the executable is at its real path
        executable = os.path.realpath(executable)
        drop = shlex.join(isolate_command(netns, executable)) + ' "$profile" ' + drop
    elif own_root:
        executable = os.path.realpath(executable)
        outer, inner = own_root_command(executable, user_netns)
        drop = shlex.join(outer) + ' "$profile" ' + shlex.join(inner) + " "
    with open(path, "w") as f:
        f.write(
            f"#!/bin/sh\n{enter}ulimit -d {cfg.memory_mb * 1024} || exit 1\n"
            f'exec {drop}{shlex.quote(executable)} "$@"\n'
        )
    os.chmod(path, 0o700)
    return path


HOST = BrowserHost()
_EXIT_HOOKS_PID: int | None = None


def _register_exit_hooks() -> None:
    global _EXIT_HOOKS_PID
    if _EXIT_HOOKS_PID == os.getpid():
        return
    _EXIT_HOOKS_PID = os.getpid()
    atexit.register(shutdown_browser)
    # multiprocessing children leave through os._exit: atexit does not run there, its finalizers do.
    import multiprocessing.util

    multiprocessing.util.Finalize(None, shutdown_browser, exitpriority=10)


def shutdown_browser() -> None:
    """Stop this process's Chromium (call once per worker process at exit; safe to call twice)."""
    HOST.shutdown()


# ----------------------------------------------------------------------------- one prompt's browser


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return re.sub(r"^\w+\.\w+: ", "", line)[:400]


async def _close_page(page: Any) -> None:
    try:
        await page.close(run_before_unload=False)
    except Exception:  # closed already, or the browser went away
        pass


async def _error_page_committed(page: Any) -> None:
    """After a failed navigation Chromium still commits its error page; page.goto has already
    raised by then, and a navigation started before that commit would be interrupted by it."""
    if page.url.startswith("chrome-error://"):
        return
    try:
        await page.wait_for_url(lambda u: u.startswith("chrome-error://"), timeout=2000)
    except Exception:
        pass


class BrowserSession:
    """One prompt's browser context and current page; its methods run on the browser loop."""

    def __init__(self, host: BrowserHost, cfg: BrowserConfig, run_dir: str | None, stem: str):
        self.host = host
        self.cfg = cfg
        self.run_dir = run_dir  # screenshots are saved below it, when there is one
        self.stem = stem
        self.context: Any = None
        self.page: Any = None
        self.console: collections.deque[dict[str, str]] = collections.deque(maxlen=MAX_CONSOLE)
        self.errors: collections.deque[str] = collections.deque(maxlen=MAX_CONSOLE)
        self.closed = False
        self.screenshots = 0
        self._lock: asyncio.Lock | None = None
        self._listened: list[Any] = []  # pages whose console we already follow
        self.closed_pages: list[str] = []  # pages the session closed, and why (told in the next result)
        self._too_many_told = False
        self._crashed: list[Any] = []  # pages whose renderer died
        self.guard: AddressGuard | None = None if cfg.allow_private else AddressGuard()
        self._routed = self.guard is not None  # the context's requests are checked (context.route)
        self._proxy: EgressProxy | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def _page(self, *, navigating: bool = False) -> Any:
        lost = self.context is not None and not self.context.browser.is_connected()
        if lost:
            self.context = self.page = None
        if self.context is None:
            browser = await self.host.browser(self.cfg)
            w, h = self.cfg.viewport
            options: dict[str, Any] = {}
            if self.guard is None and self.host.has_own_network:
                # Chromium has no network but the way to the proxy: it carries the context's requests,
                # private addresses allowed (WEB_ALLOW_PRIVATE_ADDRESSES)
                self.guard = AddressGuard(allow_private=True)
            if self.guard is not None:
                if self._proxy is None:
                    self._proxy = EgressProxy(self.guard)
                    await self._proxy.start(self._proxy_socket())
                # Playwright adds "<-loopback>": loopback addresses go through the proxy too.
                options["proxy"] = {"server": self._proxy.url}
            self.context = await browser.new_context(
                viewport={"width": w, "height": h}, accept_downloads=False, service_workers="block", **options
            )
            if self._routed:
                await self.context.route("**/*", self._route)
            self.context.set_default_timeout(self.cfg.action_timeout_s * 1000)
            self.context.set_default_navigation_timeout(self.cfg.nav_timeout_s * 1000)
            self.context.on("page", self._on_new_page)
            self._adopt(await self.context.new_page())
            if lost and not navigating:
                raise BrowserToolError("the browser crashed and was restarted; navigate to the page again")
        if self.page is not None and self.page in self._crashed:
            # A crashed tab answers nothing again ("Target crashed"): the prompt goes on in a new one.
            crashed, self.page = self.page, None
            self._crashed.remove(crashed)
            await _close_page(crashed)
            self._adopt(await self.context.new_page())
            if not navigating:
                tree = (
                    f", this worker's browser {self.cfg.tree_memory_mb} MB in all" if self.host.cgroup else ""
                )
                raise BrowserToolError(
                    f"the page {crashed.url[:200]} crashed (out of memory? each browser process may use "
                    f"{self.cfg.memory_mb} MB{tree}); navigate to a page again"
                )
        if self.page is None or self.page.is_closed():
            pages = [p for p in self.context.pages if not p.is_closed()]
            if not pages:
                self._adopt(await self.context.new_page())
            else:
                self.page = pages[-1]
        if not navigating and self.page.url in ("", "about:blank"):
            raise BrowserToolError("no page is open yet: call browser_navigate first")
        return self.page

    def _proxy_socket(self) -> socket.socket | None:
        """Where the egress proxy listens: on 127.0.0.1 in Chromium's network namespace (None: the host's)."""
        if self.host.user_netns is not None:
            return self.host.user_netns.listen()
        if self.host.netns_fd is None:
            return None
        from batchrun.prompt.tools.browser_sandbox import listen_in

        return listen_in(self.host.netns_fd)

    def _on_new_page(self, page: Any) -> None:
        """A tab the page opened (window.open, a link to a new tab): followed, up to MAX_PAGES open."""
        context = self.context
        if context is not None and sum(not p.is_closed() for p in context.pages) > MAX_PAGES:
            if not self._too_many_told:
                self._too_many_told = True
                self.closed_pages.append(f"{page.url[:200]}: closed, {MAX_PAGES} tabs are open already")
            import asyncio

            asyncio.ensure_future(_close_page(page))
            return
        self._adopt(page)

    def _adopt(self, page: Any) -> None:
        """Make ``page`` current (a link opening a new tab moves the session there) and listen to it."""
        self.page = page
        if any(seen is page for seen in self._listened):
            return  # new_page() also fires the context's "page" event
        self._listened.append(page)
        window = [0.0, 0]  # this page's messages: start of the current second, how many in it

        def flooding() -> bool:
            now = time.monotonic()
            if now - window[0] >= 1:
                window[0], window[1] = now, 0
            window[1] += 1
            if window[1] == CONSOLE_FLOOD_PER_S + 1:
                self.closed_pages.append(
                    f"{page.url[:200]}: closed, it wrote more than {CONSOLE_FLOOD_PER_S} console messages "
                    "or errors in a second"
                )
                import asyncio

                asyncio.ensure_future(_close_page(page))
            return window[1] > CONSOLE_FLOOD_PER_S

        def on_console(msg: Any) -> None:
            if not flooding():
                self.console.append({"type": msg.type, "text": msg.text[:2000]})

        def on_error(err: Any) -> None:
            if not flooding():
                self.errors.append(str(err)[:2000])

        page.on("console", on_console)
        page.on("pageerror", on_error)
        page.on("crash", lambda crashed: self._crashed.append(crashed))

    async def _route(self, route: Any) -> None:
        """Every request of the context: abort other schemes and non-public addresses."""
        assert self.guard is not None
        url = route.request.url
        try:
            scheme = url.split(":", 1)[0].lower()
            if scheme in ("data", "blob", "about"):
                await route.continue_()
                return
            if scheme not in ROUTED_SCHEMES:
                self.guard.record(url[:200], f"{scheme}: is not allowed")
                await route.abort("blockedbyclient")
                return
            ip = await self.guard.private_ip(url)
            if ip is not None:
                self.guard.record(url, ip or "unparsable URL")
                await route.abort("blockedbyclient")
                return
            await route.continue_()
        except Exception:  # the page or context closed meanwhile
            pass

    async def run(self, op: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        import asyncio

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.closed:
                raise BrowserToolError("the browser session of this prompt is closed")
            mark = self.guard.events if self.guard is not None else 0
            try:
                out = await op()
            except Exception as exc:
                if self.closed_pages:
                    closed, self.closed_pages = self.closed_pages, []
                    message = str(exc) if isinstance(exc, BrowserToolError) else _first_line(exc)
                    raise BrowserToolError(f"{message} (page {'; '.join(closed[:5])})") from None
                raise
            if self.closed_pages and isinstance(out, dict):
                out["closed_pages"], self.closed_pages = self.closed_pages[:5], []
            refused = self.guard.since(mark, self.guard.refused) if self.guard is not None else []
            if refused and isinstance(out, dict):
                blocked = [f"{what} ({ip})" for what, ip in refused]
                out["blocked_requests"] = blocked[:10] + (
                    [f"... {len(blocked) - 10} more"] if len(blocked) > 10 else []
                )
                out.setdefault(
                    "note", "requests to private addresses (or other schemes than http/https) were blocked"
                )
            return out

    async def aclose(self) -> None:
        context, self.context, self.page = self.context, None, None
        if context is not None:
            try:
                await context.close()
            except Exception:  # the browser may already be gone
                pass
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            await proxy.close()

    def close(self, wait: bool = True) -> None:
        """Close the context; idempotent. ``wait=False`` schedules it (safe from any thread)."""
        if self.closed:
            return
        self.closed = True
        if self.context is None:
            return
        future = self.host.submit(self.aclose)
        if wait and future is not None and not self.host.in_loop_thread():
            try:  # not cancelled when slow: the context is closed all the same, later
                future.result(timeout=15)
            except Exception:
                pass

    # -- helpers ---------------------------------------------------------------------------

    async def _settle(self, page: Any) -> None:
        """Give a navigation an action may have started the time to reach DOMContentLoaded."""
        import asyncio

        await asyncio.sleep(0.15)
        page = self.page or page
        try:
            await page.wait_for_load_state("domcontentloaded", timeout=self.cfg.nav_timeout_s * 1000)
        except Exception:
            pass

    async def _where(self) -> dict[str, Any]:
        page = self.page
        try:
            title = await page.title()
        except Exception:
            title = ""
        return {"url": page.url, "title": title}

    async def snapshot_text(self, *, full: bool) -> dict[str, Any]:
        page = await self._page()
        raw = await page.aria_snapshot(mode="ai", timeout=self.cfg.nav_timeout_s * 1000)
        limit = self.cfg.snapshot_max_chars * (FULL_SNAPSHOT_FACTOR if full else 1)
        text, cut = format_snapshot(raw, compact=not full, max_chars=limit)
        out = {**await self._where(), "snapshot": text, "element_refs": len(_REF_RE.findall(raw))}
        if cut:
            out["truncated"] = cut
        return out

    async def _element(self, page: Any, ref: str) -> Any:
        target = page.locator(f"aria-ref={ref}")
        if await target.count() == 0:
            raise BrowserToolError(
                f"no element @{ref} on this page; refs change when the page changes: "
                "call browser_snapshot for fresh ones"
            )
        return target

    # -- actions (each runs on the loop, under the session lock) ---------------------------

    async def navigate(self, url: str) -> dict[str, Any]:
        page = await self._page(navigating=True)
        timeout_ms = self.cfg.nav_timeout_s * 1000
        guard = self.guard
        if guard is not None:
            ip = await guard.private_ip(url)
            if ip is not None:
                raise BrowserToolError(refusal_message("browser_navigate", url, ip or "unparsable URL"))
        mark = guard.events if guard is not None else 0
        try:
            response = await page.goto(url, wait_until="domcontentloaded", timeout=timeout_ms)
        except Exception as exc:
            if "net::ERR_" in str(exc) and "ERR_ABORTED" not in str(exc):
                await _error_page_committed(page)
            if guard is not None and "net::ERR_" in str(exc):
                # A redirect hop the route check cannot see, refused by the proxy (https: no tunnel).
                refused = guard.since(mark, guard.refused)
                if refused:
                    what, ip = refused[0]
                    raise BrowserToolError(refusal_message("browser_navigate", url, ip, what)) from None
                failed = guard.since(mark, guard.failed)
                if "ERR_TUNNEL_CONNECTION_FAILED" in str(exc) and failed:
                    raise BrowserToolError(f"{failed[0][1]} at {url}") from None
            raise
        if guard is not None and response is not None:
            # The proxy's own answers (a page's server could send these headers too: check the log).
            headers, where = response.headers, response.url.split("#", 1)[0]
            refused = [r for r in guard.since(mark, guard.refused) if r[0] == where]
            if REFUSED_HEADER.lower() in headers and refused:
                raise BrowserToolError(refusal_message("browser_navigate", url, refused[0][1], response.url))
            failed = [f for f in guard.since(mark, guard.failed) if f[0] == where]
            if FAILED_HEADER.lower() in headers and failed:
                raise BrowserToolError(f"{failed[0][1]} at {response.url}")
        try:
            await page.wait_for_load_state("load", timeout=min(timeout_ms, 5000))
        except Exception:
            pass
        out: dict[str, Any] = {"success": True}
        if response is not None:
            out["status"] = response.status
            if response.status >= 400:
                out["note"] = f"the server answered HTTP {response.status}"
        out.update(await self.snapshot_text(full=False))
        return out

    async def click(self, ref: str) -> dict[str, Any]:
        page = await self._page()
        await (await self._element(page, ref)).click()
        await self._settle(page)
        return {"success": True, "clicked": f"@{ref}", **await self._where()}

    async def type(self, ref: str, text: str) -> dict[str, Any]:
        page = await self._page()
        target = await self._element(page, ref)
        try:
            await target.fill(text)
        except Exception as exc:
            if "not an <input>" in str(exc) or "not editable" in str(exc):
                raise BrowserToolError(
                    f"@{ref} is not a text field; pick a textbox from the snapshot"
                ) from None
            raise
        return {"success": True, "typed": text, "into": f"@{ref}", **await self._where()}

    async def scroll(self, direction: str) -> dict[str, Any]:
        import asyncio

        page = await self._page()
        w, h = self.cfg.viewport
        await page.mouse.move(w / 2, h / 2)
        await page.mouse.wheel(0, (0.8 if direction == "down" else -0.8) * h)
        await asyncio.sleep(0.2)
        y, height, inner = await page.evaluate(
            "() => [window.scrollY, document.documentElement.scrollHeight, window.innerHeight]"
        )
        return {
            "success": True,
            "direction": direction,
            "scroll_y": round(y),
            "page_height": height,
            "at_top": y <= 0,
            "at_bottom": y + inner >= height - 2,
        }

    async def back(self) -> dict[str, Any]:
        page = await self._page()
        before = page.url
        await page.go_back(wait_until="domcontentloaded")
        if page.url == "about:blank" and before != "about:blank":
            await page.go_forward(wait_until="domcontentloaded")  # the blank page every tab starts on
        if page.url == before:
            raise BrowserToolError("there is no previous page in this tab's history")
        return {"success": True, **await self._where()}

    async def press(self, key: str) -> dict[str, Any]:
        page = await self._page()
        await page.keyboard.press(key)
        await self._settle(page)
        return {"success": True, "pressed": key, **await self._where()}

    async def images(self) -> dict[str, Any]:
        page = await self._page()
        found = await page.evaluate(
            """(limit) => Array.from(document.images).slice(0, limit).map(img => ({
                src: img.currentSrc || img.src, alt: img.alt || '',
                width: img.naturalWidth, height: img.naturalHeight}))""",
            MAX_IMAGES,
        )
        total = await page.evaluate("() => document.images.length")
        images = []
        for img in found:
            src = img.get("src") or ""
            if not src:
                continue
            if src.startswith("data:"):
                img["src"] = f"{src.split(',', 1)[0]},... (inline data, {len(src)} characters, not shown)"
            images.append(img)
        out = {"success": True, **await self._where(), "images": images, "count": len(images)}
        if total > MAX_IMAGES:
            out["truncated"] = f"first {MAX_IMAGES} of {total} images"
        return out

    async def console_read(self, clear: bool, expression: str | None) -> dict[str, Any]:
        page = await self._page()
        out: dict[str, Any] = {
            "success": True,
            "url": page.url,
            "console_messages": list(self.console),
            "js_errors": list(self.errors),
        }
        if expression:
            value = await page.evaluate(expression)
            text = json.dumps(value, ensure_ascii=False, default=str)
            out["result"] = value if len(text) <= MAX_EVAL_CHARS else text[:MAX_EVAL_CHARS] + "…"
        if clear:
            self.console.clear()
            self.errors.clear()
        return out

    async def screenshot(self, annotate: bool) -> tuple[bytes, dict[str, Any]]:
        page = await self._page()
        labels = 0
        if annotate:
            raw = await page.aria_snapshot(mode="ai")
            boxes = []
            for ref in _INTERACTIVE_RE.findall(raw)[:80]:
                try:
                    box = await page.locator(f"aria-ref={ref}").bounding_box(timeout=1000)
                except Exception:
                    box = None
                if box and box["width"] > 0 and box["height"] > 0:
                    boxes.append({"n": ref, **box})
            labels = await page.evaluate(_ADD_LABELS_JS, boxes)
        try:
            data = await page.screenshot(type="png", timeout=self.cfg.nav_timeout_s * 1000)
        finally:
            if annotate:
                await page.evaluate(_REMOVE_LABELS_JS)
        return data, {**await self._where(), "labels": labels}


_ADD_LABELS_JS = """(boxes) => {
  const layer = document.createElement('div');
  layer.id = '__batch_runner_labels__';
  layer.style.cssText = 'position:fixed;left:0;top:0;width:0;height:0;z-index:2147483647;pointer-events:none';
  for (const b of boxes) {
    const tag = document.createElement('div');
    tag.textContent = '[@' + b.n + ']';
    tag.style.cssText = 'position:fixed;background:#ffeb3b;color:#000;font:bold 11px monospace;' +
      'padding:0 2px;border:1px solid #000;left:' + b.x + 'px;top:' + Math.max(0, b.y - 14) + 'px';
    layer.appendChild(tag);
  }
  document.documentElement.appendChild(layer);
  return boxes.length;
}"""
_REMOVE_LABELS_JS = (
    "() => { const l = document.getElementById('__batch_runner_labels__'); if (l) l.remove(); }"
)


def format_snapshot(raw: str, *, compact: bool, max_chars: int) -> tuple[str, str | None]:
    """The snapshot as shown to the model: refs as ``[@eN]``, noise removed; compact mode also
    drops unnamed layout containers (promoting their children). Cut at ``max_chars``."""
    out: list[str] = []
    dropped: list[int] = []  # indents of removed containers enclosing the current line
    for line in raw.splitlines():
        body = line.lstrip(" ")
        indent = len(line) - len(body)
        while dropped and indent <= dropped[-1]:
            dropped.pop()
        body = _REF_RE.sub(r"[@\1]", _NOISE_RE.sub("", body))
        if compact and _BARE_GENERIC_RE.fullmatch(body):
            dropped.append(indent)
            continue
        out.append(" " * max(0, indent - 2 * len(dropped)) + body)
    kept: list[str] = []
    size = 0
    for i, line in enumerate(out):
        if size + len(line) + 1 > max_chars:
            more = len(out) - i
            hint = "scroll and snapshot again" + ("" if not compact else ", or use full=true")
            kept.append(f"[... {more} more lines not shown: {hint}]")
            return "\n".join(kept), f"{more} of {len(out)} lines not shown"
        kept.append(line)
        size += len(line) + 1
    return "\n".join(kept), None


# ----------------------------------------------------------------------------- handlers


def _session(ctx: ToolContext) -> BrowserSession:
    session = ctx.resources.get(RESOURCE_KEY)
    if session is not None:
        return session
    cfg = browser_config(ctx.settings)
    if cfg is None:
        raise BrowserToolError("the browser is not available (Playwright or Chromium missing)")
    from batchrun.prompt.tools.image_gen import prompt_stem

    session = BrowserSession(HOST, cfg, ctx.settings.run_dir, prompt_stem(ctx))
    ctx.resources[RESOURCE_KEY] = session
    # Safety net for a runner that forgets close_prompt_resources: close when the context is collected.
    weakref.finalize(ctx, session.close, False)
    return session


def _run(ctx: ToolContext, action: Callable[[BrowserSession], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    try:
        session = _session(ctx)
        return HOST.call(lambda: session.run(lambda: action(session)), timeout_s=ctx.tool_timeout_s)
    except BrowserToolError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # Playwright errors: a missing element, a timeout, a bad key...
        message = _first_line(exc)
        if "aria-ref" in str(exc) or "ref=" in message:
            message += " (refs change when the page changes: call browser_snapshot for fresh ones)"
        return {"error": message}


def _ref(args: dict[str, Any]) -> str:
    raw = str(args["ref"]).strip().strip("[]")
    ref = raw.removeprefix("ref=").removeprefix("@")
    if ref.isdigit():
        ref = "e" + ref
    if not re.fullmatch(_REF, ref):
        raise ToolArgumentError(f"ref must be an element ref from the snapshot such as '@e5', got {raw!r}")
    return ref


def browser_navigate(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    url = args["url"].strip()
    if re.match(r"^[\w.-]+\.[a-z]{2,}(?:[/:?#]|$)", url, re.IGNORECASE):
        url = "https://" + url  # "example.com/page": the scheme was left out
    if not re.match(r"^https?://", url, re.IGNORECASE):
        raise ToolArgumentError(f"only http(s) URLs can be opened, got {url!r}")
    return _run(ctx, lambda s: s.navigate(url))


def browser_snapshot(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    full = bool(args.get("full") or False)
    return _run(ctx, lambda s: _with_success(s.snapshot_text(full=full)))


async def _with_success(result: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    return {"success": True, **await result}


def browser_click(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    ref = _ref(args)
    return _run(ctx, lambda s: s.click(ref))


def browser_type(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    ref, text = _ref(args), args["text"]
    return _run(ctx, lambda s: s.type(ref, text))


def browser_scroll(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    direction = args["direction"]
    if direction not in ("up", "down"):
        raise ToolArgumentError(f"direction must be 'up' or 'down', got {direction!r}")
    return _run(ctx, lambda s: s.scroll(direction))


def browser_back(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    return _run(ctx, lambda s: s.back())


def browser_press(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    key = args["key"].strip()
    if not key:
        raise ToolArgumentError("key must not be empty (e.g. 'Enter', 'Tab', 'ArrowDown')")
    return _run(ctx, lambda s: s.press(key))


def browser_get_images(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    return _run(ctx, lambda s: s.images())


def browser_console(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    clear = bool(args.get("clear") or False)
    expression = (args.get("expression") or "").strip() or None
    return _run(ctx, lambda s: s.console_read(clear, expression))


def browser_vision(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    from batchrun.prompt.tools.image_gen import save_image
    from batchrun.prompt.tools.vision import VisionError, ask_about_image

    question = args["question"].strip() or "Describe what this page shows."
    annotate = bool(args.get("annotate") or False)
    cfg = vision_config(ctx.settings)
    if cfg is None:
        return {"error": "browser_vision needs a vision model, and none is configured"}
    shot: dict[str, Any] = {}

    async def take(session: BrowserSession) -> dict[str, Any]:
        shot["png"], info = await session.screenshot(annotate)
        return info

    info = _run(ctx, take)
    if "error" in info:
        return info
    session: BrowserSession = ctx.resources[RESOURCE_KEY]
    try:
        answer = ask_about_image(
            cfg, question, shot["png"], "image/png", min(cfg.timeout_s, ctx.tool_timeout_s), ctx.usage
        )
    except VisionError as exc:
        return {"error": str(exc)}
    out: dict[str, Any] = {"success": True, "analysis": answer, "url": info["url"], "title": info["title"]}
    if annotate:
        out["labels"] = f"{info['labels']} interactive elements labelled with their refs, e.g. [@e5]"
    if session.run_dir:
        session.screenshots += 1
        stem = f"{session.stem}_{session.screenshots}"
        path = save_image(session.run_dir, SCREENSHOTS_DIR, stem, shot["png"], "image/png")
        out["screenshot_path"] = str(path)
    return out


# ----------------------------------------------------------------------------- registration

register_toolset_check(
    "browser",
    lambda settings: browser_config(settings) is not None,
    "the playwright package and Chromium (apt-get install chromium), BROWSER_ENABLED not 0",
)

_NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
_REF_DOC = "Element ref from the latest snapshot, e.g. '@e5'."

for _name, _handler, _description, _parameters in (
    (
        "browser_navigate",
        browser_navigate,
        "Open a URL in the browser (a real headless Chromium that runs JavaScript). Returns the page's "
        "title and a compact accessibility snapshot with element refs like [@e5] for browser_click and "
        "browser_type. To just read a page's text, web_extract is faster when it is offered.",
        {
            "type": "object",
            "properties": {"url": {"type": "string", "description": "The http(s) URL to open."}},
            "required": ["url"],
        },
    ),
    (
        "browser_snapshot",
        browser_snapshot,
        "Get the current page's accessibility tree: headings, text, links (with their URLs), form "
        "fields and buttons, each interactive element with a ref like [@e5]. By default layout-only "
        "containers are left out and the text is cut at a few thousand characters; full=true gives "
        "the complete tree, four times longer. Take a new snapshot after the page changes: refs from "
        "an old one may no longer work.",
        {
            "type": "object",
            "properties": {
                "full": {
                    "type": "boolean",
                    "description": "Complete tree instead of the compact view (default false).",
                }
            },
            "required": [],
        },
    ),
    (
        "browser_click",
        browser_click,
        "Click an element given its ref from the snapshot (e.g. '@e5'). Returns the URL and title "
        "afterwards, so you can tell whether the click opened another page.",
        {
            "type": "object",
            "properties": {"ref": {"type": "string", "description": _REF_DOC}},
            "required": ["ref"],
        },
    ),
    (
        "browser_type",
        browser_type,
        "Type text into an input field given its ref from the snapshot. The field is cleared first. "
        "To submit, press Enter with browser_press or click the form's button.",
        {
            "type": "object",
            "properties": {
                "ref": {"type": "string", "description": _REF_DOC},
                "text": {"type": "string", "description": "The text to enter."},
            },
            "required": ["ref", "text"],
        },
    ),
    (
        "browser_scroll",
        browser_scroll,
        "Scroll the page up or down by most of a screen, to reach content outside the view. Returns "
        "the scroll position and whether the top or bottom was reached.",
        {
            "type": "object",
            "properties": {
                "direction": {"type": "string", "enum": ["up", "down"], "description": "Where to scroll."}
            },
            "required": ["direction"],
        },
    ),
    ("browser_back", browser_back, "Go back to the previous page in the browser history.", _NO_ARGS),
    (
        "browser_press",
        browser_press,
        "Press a key on the keyboard in the page, e.g. 'Enter' to submit a form, 'Tab', 'Escape', "
        "'ArrowDown', or a combination like 'Control+A'.",
        {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "Key name, e.g. 'Enter' or 'Tab'."}},
            "required": ["key"],
        },
    ),
    (
        "browser_get_images",
        browser_get_images,
        "List the images on the current page with their URLs, alt text and sizes; pass a URL to "
        "vision_analyze to look at one.",
        _NO_ARGS,
    ),
    (
        "browser_vision",
        browser_vision,
        "Take a screenshot of the visible part of the page and ask a vision model about it: for "
        "layouts, charts, pictures, or anything the text snapshot does not capture. With annotate=true "
        "interactive elements are labelled with their refs (e.g. [@e5]) on the screenshot. Returns the "
        "answer and the path of the saved screenshot.",
        {
            "type": "object",
            "properties": {
                "question": {"type": "string", "description": "What you want to know about the page."},
                "annotate": {
                    "type": "boolean",
                    "description": "Label interactive elements with their refs (default false).",
                },
            },
            "required": ["question"],
        },
    ),
    (
        "browser_console",
        browser_console,
        "Read the page's JavaScript console messages and uncaught errors (since the prompt's browser "
        "started, or since the last clear). With `expression`, also evaluate that JavaScript "
        "expression in the page and return its value (e.g. 'document.title').",
        {
            "type": "object",
            "properties": {
                "clear": {
                    "type": "boolean",
                    "description": "Empty the message lists after reading them (default false).",
                },
                "expression": {
                    "type": "string",
                    "description": "JavaScript expression to evaluate in the page; its JSON value is returned.",
                },
            },
            "required": [],
        },
    ),
):
    register(Tool(_name, "browser", _description, _parameters, _handler, sandbox_network=False))
