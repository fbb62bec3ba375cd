"""MCP servers as toolsets (``--mcp_config``), through the official ``mcp`` SDK.

Each server of the config becomes the toolset ``mcp:<name>``; each of its tools is offered as
``mcp__<name>__<tool>`` (a valid OpenAI function name, unique across servers) with the server's own
description and input schema. The parent lists every server's tools once at start
(:func:`probe`); the workers install exactly those definitions (:func:`install`), so the parent and
every worker know the same tools.

A server runs on this host, as configured, never in the prompt's sandbox: it is the user's own code,
and the model reaches it only through tool arguments. One connection per worker process serves all
of that worker's prompts (``"session": "worker"``, the default; started at its first call), or one
per prompt (``"session": "prompt"``, for servers that keep per-session state; closed when the prompt
ends). The SDK is asyncio: each process runs one event-loop thread, and prompt threads submit their
calls to it. A failed call (the server crashed, timed out or answered an error) is a tool error the
model sees; a server that is gone is restarted at the next call, a few times at most.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchrun.prompt.tools.catalog import add_toolset
from batchrun.prompt.tools.registry import TOOL_NAME, Tool, ToolContext, remove_toolsets
from batchrun.storage import read_json_file

if TYPE_CHECKING:  # asyncio is imported where an MCP server is used: ~40 ms of every run's start otherwise
    import asyncio

SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}")
SESSIONS = ("worker", "prompt")
MAX_RESTARTS = 3  # per server and worker process: a server that keeps dying is not started forever
STOP_TIMEOUT_S = 10.0  # the SDK closes stdin, waits 2 s, then SIGTERM, 2 s, SIGKILL
STDERR_LINES = 20  # the last lines of a stdio server's stderr, quoted when it fails
_FIELDS = (
    "command",
    "args",
    "env",
    "cwd",
    "url",
    "headers",
    "type",
    "session",
    "startup_timeout_s",
    "disabled",
)


class McpConfigError(ValueError):
    """The --mcp_config file is unusable; the message names the file and the field."""


@dataclass(frozen=True)
class McpServer:
    """One server of the config: a command to run (stdio) or a URL (streamable HTTP)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # added to PATH, HOME, USER, ... (nothing else of ours)
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # HTTP headers (e.g. Authorization): secrets
    session: str = "worker"  # "prompt": one connection (and stdio process) per prompt
    startup_timeout_s: float = 60.0

    @property
    def toolset(self) -> str:
        return f"mcp:{self.name}"

    def describe(self) -> str:
        """For messages and listings: the command or the URL without its query, never the args, the env
        or the headers (any of them may hold a token)."""
        where = f"stdio: {self.command}" if self.command else f"HTTP: {(self.url or '').split('?')[0]}"
        return f"MCP server {self.name!r} ({where}; one session per {self.session})"

    def secrets(self) -> list[str]:
        """Values that must never reach a file: every env value and header value."""
        return [v for _, v in (*self.env, *self.headers) if v]


@dataclass(frozen=True)
class McpTool:
    """One tool a server listed at start, as offered to the model."""

    server: str
    name: str  # the server's own name for it
    exposed: str  # the name the model calls
    description: str
    input_schema: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class McpSetup:
    """The run's MCP servers and the tools the parent listed: what every worker installs."""

    servers: tuple[McpServer, ...] = ()
    tools: tuple[McpTool, ...] = ()


# ----------------------------------------------------------------------------- the config file


def load_config(path: str) -> tuple[McpServer, ...]:
    """The servers of an ``{"mcpServers": {name: {...}}}`` file, checked (McpConfigError naming the field)."""
    try:
        data = read_json_file(path)
    except ValueError as exc:
        raise McpConfigError(str(exc)) from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise McpConfigError(
            f'{path}: expected {{"mcpServers": {{"<name>": {{"command": ...}} or {{"url": ...}}}}}}'
        )
    return tuple(s for name, entry in servers.items() if (s := _server(path, name, entry)) is not None)


def _server(path: str, name: Any, entry: Any) -> McpServer | None:
    where = f"{path}: mcpServers.{name}"
    if not isinstance(name, str) or not SERVER_NAME.fullmatch(name):
        raise McpConfigError(
            f"{where}: a server name is 1-40 letters, digits, '_' or '-' (starting with a letter or digit)"
        )
    if not isinstance(entry, dict):
        raise McpConfigError(f"{where}: expected an object")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise McpConfigError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(_FIELDS)})")
    if entry.get("disabled") is True:
        return None
    command, url = entry.get("command"), entry.get("url")
    if (command is None) == (url is None):
        raise McpConfigError(f"{where}: give either 'command' (stdio) or 'url' (streamable HTTP)")
    kind = entry.get("type", "stdio" if command else "http")
    if kind not in (("stdio",) if command else ("http", "streamable-http", "streamableHttp")):
        raise McpConfigError(f"{where}: field 'type' {kind!r} does not fit {'command' if command else 'url'}")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise McpConfigError(f"{where}: field 'command' must be a non-empty string")
    if url is not None and (not isinstance(url, str) or not re.fullmatch(r"https?://\S+", url)):
        raise McpConfigError(f"{where}: field 'url' must be an http:// or https:// URL")
    args = entry.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise McpConfigError(f"{where}: field 'args' must be a list of strings")
    maps = {}
    for key in ("env", "headers"):
        value = entry.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise McpConfigError(f"{where}: field {key!r} must map names to strings")
        maps[key] = tuple(sorted(value.items()))
    if url is not None and (maps["env"] or args or entry.get("cwd")):
        raise McpConfigError(f"{where}: 'env', 'args' and 'cwd' are for a command (stdio) server")
    if command is not None and maps["headers"]:
        raise McpConfigError(f"{where}: 'headers' are for a url (HTTP) server")
    session = entry.get("session", "worker")
    if session not in SESSIONS:
        raise McpConfigError(f"{where}: field 'session' must be 'worker' or 'prompt', got {session!r}")
    timeout = entry.get("startup_timeout_s", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise McpConfigError(f"{where}: field 'startup_timeout_s' must be a number of seconds above 0")
    cwd = entry.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not os.path.isdir(cwd)):
        raise McpConfigError(f"{where}: field 'cwd' must be an existing directory")
    return McpServer(
        name=name,
        command=command,
        args=tuple(args),
        env=maps["env"],
        cwd=cwd,
        url=url,
        headers=maps["headers"],
        session=session,
        startup_timeout_s=float(timeout),
    )


def exposed_name(server: str, tool: str) -> str:
    """``mcp__<server>__<tool>``, cut to OpenAI's 64 characters (with a hash to stay unique)."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"mcp__{server}__{tool}")
    if len(name) > 64:
        name = name[:55] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]
    assert TOOL_NAME.fullmatch(name)
    return name


# ----------------------------------------------------------------------------- the registry


def probe(servers: tuple[McpServer, ...], redact: Any = None) -> McpSetup:
    """Start each server, list its tools, stop it (the parent, at start). McpConfigError names the
    server that cannot start or list its tools, with the end of its stderr."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise McpConfigError("MCP servers need the mcp package: pip install 'batch-runner[mcp]'") from None
    tools: list[McpTool] = []
    for server in servers:
        conn = Connection(server)
        try:
            listed = conn.start()
        except Exception as exc:
            conn.close()
            raise McpConfigError(
                _failure(server, "cannot start or list its tools", exc, conn, redact)
            ) from None
        conn.close()
        for entry in listed:
            try:
                tools.append(_tool_of(server, entry))
            except ValueError as exc:
                raise McpConfigError(f"{server.describe()}: {exc}") from None
    setup = McpSetup(servers=servers, tools=tuple(tools))
    return setup


def _tool_of(server: McpServer, entry: dict[str, Any]) -> McpTool:
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a listed tool has no name: {str(entry)[:200]}")
    # Lenient with what servers send (the server checks the arguments itself): a schema without a
    # type is an object's; only one that is not an object's cannot describe tool arguments.
    schema = entry.get("inputSchema")
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema.setdefault("type", "object")
    if schema["type"] != "object":
        raise ValueError(f"tool {name!r}: its inputSchema must describe an object, not {schema['type']!r}")
    if not isinstance(schema.get("properties", {}), dict):
        schema["properties"] = {}
    description = entry.get("description") or entry.get("title") or name
    return McpTool(server.name, name, exposed_name(server.name, name), str(description), dict(schema))


_INSTALLED: set[str] = set()  # toolsets this process registered from an McpSetup


def install(setup: McpSetup | None) -> None:
    """Register the setup's toolsets and tools in this process (replacing an earlier run's)."""
    close_shared()
    remove_toolsets(set(_INSTALLED))
    _INSTALLED.clear()
    if setup is None:
        return
    for server in setup.servers:
        tools = [
            Tool(
                name=t.exposed,
                toolset=server.toolset,
                description=t.description,
                parameters=t.input_schema,
                handler=_handler(server, t.name),
                check_schema=False,  # the server validates against its own schema
                sandbox_network=False,  # the server runs on this host, never in the sandbox
            )
            for t in setup.tools
            if t.server == server.name
        ]
        add_toolset(server.toolset, server.describe(), tools)
        _INSTALLED.add(server.toolset)


def _handler(server: McpServer, tool: str):
    def call(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
        if server.session == "prompt":
            key = f"mcp:{server.name}"
            conn = ctx.resources.get(key)
            if conn is None:
                conn = ctx.resources[key] = Connection(server)
        else:
            conn = _shared(server)
        return conn.call(tool, args, ctx.tool_timeout_s, ctx.output_cap_bytes)

    return call


# ----------------------------------------------------------------------------- one process's event loop


class _Loop:
    """One asyncio loop on a daemon thread per process; prompt threads submit coroutines to it."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid: int | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        import asyncio

        with cls._lock:
            # A forked child inherits the object, not the thread: it needs its own loop.
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="mcp-loop", daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop


_SHARED: dict[str, Connection] = {}
_SHARED_LOCK = threading.Lock()


def _shared(server: McpServer) -> Connection:
    with _SHARED_LOCK:
        conn = _SHARED.get(server.name)
        if conn is None or conn.server != server:
            conn = _SHARED[server.name] = Connection(server)
        return conn


KILL_GRACE_S = 2.0  # after SIGTERM to a server's process group: how long before SIGKILL
# A stdio server's watcher, sent SIGTERM (by the SDK, kill_server_groups or this process's death), gives
# the server this long before it kills all the server started: less than the SDK's and KILL_GRACE_S's
# 2 s before they SIGKILL the group, the watcher with it, so the watcher's kill comes first.
SERVER_TERM_GRACE_S = 1.5
_SERVER_GROUPS: set[int] = set()  # process groups of the stdio servers this process started (pid = pgid)


def _track_stdio_processes() -> None:
    """Note the pid of every stdio server the SDK spawns (it starts each in its own session, so its pid
    is its process group), so that :func:`kill_server_groups` can end them when this process ends
    without closing its sessions: a worker told to stop, or whose parent died."""
    from mcp.client import stdio

    original = getattr(stdio, "_create_platform_compatible_process", None)
    if original is None or getattr(original, "_tracked", False):
        return

    async def spawn(*args: Any, **kwargs: Any) -> Any:
        process = await original(*args, **kwargs)
        pid = getattr(process, "pid", None)
        if isinstance(pid, int):
            _SERVER_GROUPS.add(pid)
        return process

    spawn._tracked = True  # type: ignore[attr-defined]
    stdio._create_platform_compatible_process = spawn


def kill_server_groups(grace_s: float = KILL_GRACE_S) -> None:
    """End every stdio server's whole process group: SIGTERM, then SIGKILL after ``grace_s`` for
    what is left (a server that ignores SIGTERM and the end of its stdin)."""
    import signal

    groups = list(_SERVER_GROUPS)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            _SERVER_GROUPS.discard(pgid)
    deadline = time.monotonic() + grace_s
    while _SERVER_GROUPS and time.monotonic() < deadline:
        for pgid in list(_SERVER_GROUPS):
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                _SERVER_GROUPS.discard(pgid)
        time.sleep(0.05)
    for pgid in list(_SERVER_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _SERVER_GROUPS.discard(pgid)


def close_shared() -> None:
    """Stop this process's per-worker servers (idempotent; at exit and when a new setup is installed)."""
    with _SHARED_LOCK:
        conns = list(_SHARED.values())
        _SHARED.clear()
    for conn in conns:
        conn.close()


# ----------------------------------------------------------------------------- one connection


class Connection:
    """One session with one server: started on first use, restarted after it died, closed once."""

    def __init__(self, server: McpServer):
        self.server = server
        self._lock = threading.Lock()
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._done: concurrent.futures.Future[Any] | None = None
        self._starts = 0
        self._closed = False
        self._errlog: Any = None
        self._drain: threading.Thread | None = None
        self.stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)

    # -- lifecycle

    def start(self) -> list[dict[str, Any]]:
        """Connect, initialise and list the tools (wire-format dicts); raises on failure."""
        import asyncio

        loop = _Loop.get()
        ready: concurrent.futures.Future[list[dict[str, Any]]] = concurrent.futures.Future()
        self._starts += 1
        self._stop = asyncio.Event()
        self._done = asyncio.run_coroutine_threadsafe(self._main(ready), loop)
        try:
            return ready.result(timeout=self.server.startup_timeout_s)
        except concurrent.futures.TimeoutError:
            self._shutdown()
            raise TimeoutError(f"no answer within {self.server.startup_timeout_s:g} s") from None
        finally:
            # The server has its copy of the stderr pipe (or never will): ours must go, so the
            # drain thread sees the end of the file when the server exits.
            if self._errlog is not None:
                self._errlog.close()
                self._errlog = None

    async def _main(self, ready: concurrent.futures.Future[list[dict[str, Any]]]) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                tools = await _list_tools(session)
                self._session = session
                ready.set_result(tools)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._session = None

    def _transport(self) -> Any:
        server = self.server
        if server.command:
            from mcp import StdioServerParameters, stdio_client

            from batchrun.prompt.sandboxes._process import watched

            _track_stdio_processes()
            # Through the watcher, which the SDK's spawn has no hook for otherwise: whatever the server
            # starts ends with this process, even when it is killed (SIGKILL) or the server ignores the
            # end of its stdin. The SDK spawns it from the event-loop thread, which lives as long as this
            # process (the parent-death signal follows that thread).
            command, *args = watched([server.command, *server.args], grace_s=SERVER_TERM_GRACE_S)
            params = StdioServerParameters(
                command=command, args=args, env=dict(server.env) or None, cwd=server.cwd
            )
            return stdio_client(params, errlog=self._stderr_pipe())
        from mcp.client import streamable_http
        from mcp.shared._httpx_utils import create_mcp_http_client

        headers = dict(server.headers) or None
        if hasattr(streamable_http, "streamable_http_client"):  # mcp >= 1.24 (and 2.x)
            client = create_mcp_http_client(headers=headers)
            return _with_client(
                client, streamable_http.streamable_http_client(server.url, http_client=client)
            )
        return streamable_http.streamablehttp_client(server.url, headers=headers)

    def _stderr_pipe(self) -> Any:
        """A pipe for the server's stderr: its last lines are kept for error messages, nothing is printed."""
        read_fd, write_fd = os.pipe()
        lines = self.stderr

        def drain() -> None:
            with open(read_fd, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    lines.append(line.rstrip("\n")[:500])

        self._drain = threading.Thread(target=drain, name=f"mcp-stderr-{self.server.name}", daemon=True)
        self._drain.start()
        self._errlog = open(write_fd, "w")  # noqa: SIM115  (closed by start(), once the server has its copy)
        return self._errlog

    def _alive(self) -> bool:
        return self._session is not None and self._done is not None and not self._done.done()

    def _ensure(self) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("the connection is closed")
            if not self._alive():
                if self._starts > MAX_RESTARTS:  # the first start and MAX_RESTARTS more
                    raise RuntimeError(f"it failed {self._starts} times in this worker; not started again")
                self._shutdown()
                self.start()
            return self._session

    def _shutdown(self) -> None:
        loop, stop, done = _Loop.get(), self._stop, self._done
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        if done is not None:
            try:
                done.result(timeout=STOP_TIMEOUT_S)
            except (
                Exception
            ):  # a session that failed to start, or one that ended badly: it is over either way
                done.cancel()
        self._session = self._stop = self._done = None

    def close(self) -> None:
        """Stop the server (stdio) or end the session (HTTP). Idempotent; never raises."""
        with self._lock:
            self._closed = True
            self._shutdown()

    # -- calls

    def call(self, tool: str, args: dict[str, Any], timeout_s: float, cap_bytes: int) -> dict[str, Any]:
        """One tool call; every failure becomes ``{"error": ...}`` for the model."""
        label = f"MCP server {self.server.name!r}"
        try:
            session = self._ensure()
        except Exception as exc:
            return {"error": _failure(self.server, "is not available", exc, self)}
        import asyncio

        future = asyncio.run_coroutine_threadsafe(session.call_tool(tool, args), _Loop.get())
        try:
            result = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._check_alive()  # slow, or hung: a server that does not answer a ping is restarted
            return {"error": f"{label}: {tool} did not answer within {timeout_s:g} s"}
        except Exception as exc:
            self._check_alive()
            return {"error": f"{label}: {tool} failed: {_message(exc)}"}
        return tool_result(_wire(result), cap_bytes)

    def _check_alive(self) -> None:
        """After a failed call: a server that no longer answers a ping is restarted at the next call."""
        session = self._session
        if session is None:
            return
        import asyncio

        ping = asyncio.run_coroutine_threadsafe(session.send_ping(), _Loop.get())
        try:
            ping.result(timeout=5)
        except Exception:
            ping.cancel()
            with self._lock:
                if self._session is session:
                    self._shutdown()


@contextlib.asynccontextmanager
async def _with_client(client: Any, transport: Any):
    """A transport on an HTTP client we made: the client is closed after the transport."""
    async with client:
        async with transport as streams:
            yield streams


async def _list_tools(session: Any) -> list[dict[str, Any]]:
    result = await session.list_tools()
    tools = [_wire(t) for t in result.tools]
    cursor = getattr(result, "next_cursor", None) or getattr(result, "nextCursor", None)
    while cursor:
        from mcp import types

        result = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        tools += [_wire(t) for t in result.tools]
        cursor = getattr(result, "next_cursor", None) or getattr(result, "nextCursor", None)
    return tools


def _wire(model: Any) -> dict[str, Any]:
    """An SDK object as its JSON form (the protocol's camelCase names, in SDK 1.x and 2.x alike)."""
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def tool_result(wire: dict[str, Any], cap_bytes: int) -> dict[str, Any]:
    """A CallToolResult as the tool's answer: text content (images and other blobs only named),
    structured content when given, ``error`` set when the server flagged an error."""
    parts: list[str] = []
    for block in wire.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in ("image", "audio"):
            size = len(block.get("data") or "") * 3 // 4
            parts.append(f"[{kind} {block.get('mimeType', '?')}, {size} bytes, not shown]")
        elif kind == "resource":
            res = block.get("resource") or {}
            parts.append(
                res["text"] if "text" in res else f"[resource {res.get('uri', '?')}, binary, not shown]"
            )
        elif kind == "resource_link":
            parts.append(f"[resource {block.get('uri', '?')}]")
    text = "\n".join(parts)
    data = text.encode("utf-8")
    if len(data) > cap_bytes:
        text = (
            data[:cap_bytes].decode("utf-8", errors="ignore") + f"\n[... {len(data) - cap_bytes} bytes cut]"
        )
    out: dict[str, Any] = {"content": text}
    structured = wire.get("structuredContent")
    if structured is not None and len(json.dumps(structured)) <= cap_bytes:
        out["structured_content"] = structured
    if wire.get("isError"):
        return {"error": text or "the tool reported an error"}
    out["error"] = None
    return out


def _message(exc: BaseException) -> str:
    """An exception (or a group of them, from the SDK's task groups) as one line."""
    while getattr(exc, "exceptions", None):  # an exception group (the SDK's task groups raise them)
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def _failure(
    server: McpServer, what: str, exc: BaseException, conn: Connection | None, redact: Any = None
) -> str:
    msg = f"{server.describe()} {what}: {_message(exc)}"
    if conn is not None and conn._drain is not None:
        conn._drain.join(timeout=2)  # the server has exited: its last lines are on their way
    if conn is not None and conn.stderr:
        msg += "\n  its stderr ended with:\n    " + "\n    ".join(list(conn.stderr)[-8:])
    for secret in server.secrets():  # a server may print its own token; the message goes to a terminal or log
        if len(secret) >= 4:
            msg = msg.replace(secret, "[REDACTED]")
    return redact(msg) if redact is not None else msg
