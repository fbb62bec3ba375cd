"""Shared fixtures only (plain helpers are in helpers.py). Each section belongs to one area."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DOCKER_TEST_IMAGE, TESTS_DIR, TOOL_CAP, skip_or_fail

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox

# ============================================================================ the fake model


@pytest.fixture
def server():
    """The scripted fake model on a free loopback port, for one test."""
    with FakeModelServer(latency_s=0) as srv:
        yield srv


# ============================================================================ sandboxes: Docker
DOCKER_IMAGE_BUILD = TESTS_DIR / "docker_image" / "build.sh"


@pytest.fixture(scope="session")
def docker_engine() -> str:
    """The Docker server version; skips locally (fails in CI) when no engine answers."""
    from batchrun.prompt.sandboxes.base import SandboxError
    from batchrun.prompt.sandboxes.docker.sandbox import check_engine

    try:
        return check_engine()
    except SandboxError as exc:
        skip_or_fail(str(exc))


@pytest.fixture(scope="session")
def docker_test_image(docker_engine: str) -> str:
    """The busybox test image, built from local files (no registry) if it is not there yet."""
    done = subprocess.run(["sh", str(DOCKER_IMAGE_BUILD), DOCKER_TEST_IMAGE], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"building {DOCKER_TEST_IMAGE} failed:\n{done.stdout}\n{done.stderr}")
    return DOCKER_TEST_IMAGE


# ============================================================================ sandboxes: bubblewrap
@pytest.fixture(scope="session")
def bwrap_available() -> None:
    """Skips locally (fails in CI) when bubblewrap cannot isolate commands here."""
    from batchrun.prompt.sandboxes.local import bwrap_problem

    problem = bwrap_problem()
    if problem:
        skip_or_fail(problem)


# ============================================================================ sandboxes: the network
# A TCP service that answers each connection with a line naming the peer, run by the system's python3.
OUTSIDE_SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(16)
print("listening", flush=True)
while True:
    c, peer = s.accept()
    c.sendall(b"hello from outside, you are " + peer[0].encode() + b"\n")
    c.close()
"""
OUTSIDE_PORT = 8471


@pytest.fixture
def outside_host():
    """(address, port) of a TCP service in a network namespace of its own, routed from the host: not one
    of the host's addresses, so a sandbox's slirp4netns reaches it as it would a host on the internet."""
    n = os.getpid() % 200 + 20
    yield from _far_host(f"brt{os.getpid() % 100000}", f"10.251.{n}.1", f"10.251.{n}.2")


@pytest.fixture
def metadata_host():
    """(address, port) of a TCP service at 169.254.169.254, where clouds serve their instance metadata
    and credentials, made as ``outside_host`` (the host reaches it; the host's own side of its link is
    a link-local address, which is no address a sandbox is kept from as the host's)."""
    yield from _far_host(f"brm{os.getpid() % 100000}", "169.254.169.253", "169.254.169.254")


def _far_host(link: str, host_ip: str, far_ip: str):
    """A TCP service at ``far_ip`` in a network namespace of its own, on a veth link ``link`` from the
    host (whose end is ``host_ip``, the two in one /30)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        skip_or_fail("an outside host needs root, ip and unshare")
    from batchrun.prompt.sandboxes.local.host import network_problem

    if network_problem():
        skip_or_fail(network_problem())
    server = subprocess.Popen(
        ["unshare", "--net", "/usr/bin/python3", "-c", OUTSIDE_SERVER, str(OUTSIDE_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline().strip() == "listening"
    far = ["nsenter", "-t", str(server.pid), "-n", "ip"]
    steps = [
        ["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", str(server.pid)],
        ["ip", "addr", "add", f"{host_ip}/30", "dev", link],
        ["ip", "link", "set", link, "up"],
        [*far, "addr", "add", f"{far_ip}/30", "dev", "eth0"],
        [*far, "link", "set", "eth0", "up"],
        [*far, "link", "set", "lo", "up"],
        [*far, "route", "add", "default", "via", host_ip],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                skip_or_fail(f"cannot make an outside host here: {' '.join(step)}: {done.stderr.strip()}")
        yield far_ip, OUTSIDE_PORT
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
        subprocess.run(["ip", "link", "del", link], capture_output=True)  # gone with the namespace anyway


# ============================================================================ sandboxes: fakes
FAKES_DIR = TESTS_DIR / "fakes"


@pytest.fixture
def fakes_runnable(bwrap_available: None) -> None:
    """The fakes run commands in a busybox root filesystem entered with bubblewrap."""
    sys.path.insert(0, str(FAKES_DIR))
    try:
        import fake_rootfs
    finally:
        sys.path.remove(str(FAKES_DIR))
    if not fake_rootfs.available():
        skip_or_fail("the fakes need busybox and bwrap")


@pytest.fixture
def fake_apptainer(fakes_runnable: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Puts the fake ``apptainer`` first on PATH; returns its home (instances/, argv.log: one JSON argv a line)."""
    home = tmp_path / "fake-apptainer"
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    launcher = bin_dir / "apptainer"
    # The backend gives the CLI a minimal environment, so the launcher carries the fake's settings itself.
    launcher.write_text(
        f"#!/bin/sh\nFAKE_APPTAINER_HOME='{home}' exec '{sys.executable}' '{FAKES_DIR / 'apptainer'}' \"$@\"\n"
    )
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return home


@pytest.fixture
def fake_modal(fakes_runnable: None, monkeypatch: pytest.MonkeyPatch):
    """Installs the fake Modal SDK as ``modal``; returns the module (``calls`` records every SDK call)."""
    monkeypatch.syspath_prepend(str(FAKES_DIR))
    import fake_modal as module

    module.calls.clear()
    monkeypatch.setitem(sys.modules, "modal", module)
    return module


# ============================================================================ tools: web, vision, image_gen, moa, browser
@pytest.fixture(scope="session")
def fake_web():
    """The local fake site (``/site/...``) and fake search providers (batchrun/fakes/fake_services.py)."""
    from batchrun.fakes.fake_services import FakeWebServer

    with FakeWebServer() as server:
        yield server


@pytest.fixture(scope="session")
def tools_llm():
    """A fake model endpoint of its own for the tools that call models (vision, image_gen, moa)."""
    from batchrun.fakes.fake_model import FakeModelServer

    with FakeModelServer() as server:
        yield server


@pytest.fixture
def clean_tool_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tool variable from the developer's environment leaks into a test."""
    from batchrun.prompt.tools.config import TOOL_ENV_VARS

    for name in TOOL_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def tool_ctx(tmp_path: Path, tools_llm, clean_tool_env: None):
    """``make(tool_env=None, prompt_index=0, **settings)``: a ToolContext on a started local sandbox whose
    run endpoint is ``tools_llm`` and run_dir ``tmp_path/"run"``. Resources and sandboxes are released
    after the test."""
    from batchrun.prompt.sandboxes.base import SandboxSpec
    from batchrun.prompt.sandboxes.local import LocalSandbox
    from batchrun.prompt.tools.config import ToolSettings
    from batchrun.prompt.tools.registry import ToolContext, close_prompt_resources

    made = []

    def make(tool_env: dict | None = None, prompt_index: int = 0, **overrides):
        sandbox = LocalSandbox(
            SandboxSpec(run_name="tools-test", prompt_index=prompt_index), base_dir=str(tmp_path)
        )
        sandbox.start()
        fields = {
            "llm_base_url": tools_llm.base_url,
            "llm_api_key": "sk-run-key",
            "llm_model": "mock",
            "run_dir": str(tmp_path / "run"),
            "tool_env": dict(tool_env or {}),
        }
        fields.update(overrides)
        ctx = ToolContext(sandbox=sandbox, tool_timeout_s=60.0, settings=ToolSettings(**fields))
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        close_prompt_resources(ctx)
        ctx.sandbox.stop()


@pytest.fixture
def call_tool():
    """``call_tool(ctx, name, **args)``: run one tool call as the agent loop does; the parsed result."""

    from batchrun.prompt.tools.catalog import execute_tool_call, known_tool_names

    def call(ctx, name: str, **args):
        text = execute_tool_call(name, json.dumps(args), ctx, set(known_tool_names()))
        return json.loads(text)

    return call


@pytest.fixture
def run_tool_loop(tools_llm):
    """``run(ctx, prompt, toolsets)``: the agent loop with the scripted fake model (which calls the first
    offered tool, arguments filled from the prompt, then answers); returns the saved messages."""
    from batchrun.prompt.llm import LLMClient, LLMConfig
    from batchrun.prompt.loop import LoopLimits, run_agent
    from batchrun.prompt.tools.catalog import tools_for_toolsets

    client = LLMClient(LLMConfig(model="mock", base_url=tools_llm.base_url, api_key="sk-run-key"))

    def run(ctx, prompt: str, toolsets: list[str]):
        tools = tools_for_toolsets(toolsets)
        return run_agent(
            llm=client, prompt=prompt, tools=tools, ctx=ctx, limits=LoopLimits(max_turns=4)
        ).messages

    return run


@pytest.fixture(scope="session")
def chromium_ready() -> None:
    """Playwright and Debian's chromium are installed; skips locally (fails in CI) otherwise."""
    from batchrun.prompt.tools.config import browser_config

    if browser_config() is None:
        skip_or_fail("the browser tools need the playwright package and Chromium (apt-get install chromium)")


# ----------------------------------------------------------------------------- tool tests: a sandbox per test
# The terminal and file tool tests run every case twice: on the default local sandbox, and with only
# busybox on PATH (busybox sh as the shell), which is what a minimal container offers.


@pytest.fixture(scope="session")
def busybox_bin(tmp_path_factory):
    """A directory holding only busybox applets, with ``bash`` running busybox sh."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is not installed")
    root = tmp_path_factory.mktemp("busybox-bin")
    for applet in subprocess.run([busybox, "--list"], capture_output=True, text=True).stdout.split():
        if applet not in ("bash", "busybox"):
            (root / applet).symlink_to(busybox)
    wrapper = root / "bash"
    wrapper.write_text(f'#!{busybox} sh\nexec {busybox} sh "$@"\n')
    wrapper.chmod(0o755)
    return str(root)


@pytest.fixture(params=["local", "local-busybox"])
def sandbox(request, tmp_path, monkeypatch):
    options = {"output_cap_bytes": TOOL_CAP, "base_dir": str(tmp_path)}
    env = {}
    if request.param == "local-busybox":
        # The backend takes its shell from the host PATH: make that busybox sh, with only busybox to call.
        bin_dir = request.getfixturevalue("busybox_bin")
        monkeypatch.setenv("PATH", bin_dir)
        env = {"PATH": bin_dir}
        options["isolation"] = "none"  # the busybox directory lives under /tmp, which bwrap replaces
    box = LocalSandbox(SandboxSpec(run_name="tools", prompt_index=0, env=env), **options)
    box.start()
    try:
        yield box
    finally:
        box.stop()


# ----------------------------------------------------------------------------- run-directory helpers (plain functions)


@pytest.fixture
def local_tool_ctx(tool_ctx):
    """``tool_ctx`` for tests whose fake servers listen on 127.0.0.1: private addresses are allowed
    unless the test passes WEB_ALLOW_PRIVATE_ADDRESSES itself."""

    def make(tool_env: dict | None = None, prompt_index: int = 0, **settings):
        return tool_ctx({"WEB_ALLOW_PRIVATE_ADDRESSES": "1", **(tool_env or {})}, prompt_index, **settings)

    return make


@pytest.fixture
def offline_hf(tmp_path, monkeypatch):
    """The Hugging Face libraries offline, with their cache in the test's own directory."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
