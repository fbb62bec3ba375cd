"""The local sandbox's network with the network on: it reaches a host outside this machine's own
addresses, and, as root, each prompt is on a link of its own into the worker's one slirp4netns
(``network_hub``) without reaching another prompt of the same worker.

The "outside host" is conftest's ``outside_host``: a network namespace of the test's own, on a veth
link from the host, whose address is not one of the host's, so slirp4netns reaches it as it would a
host on the internet, which this machine cannot.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import skip_or_fail
from test_local_isolation import sandbox_factory

from batchrun.prompt.sandboxes.local import LocalSandbox, network_hub
from batchrun.prompt.sandboxes.local.host import network_problem

RUN = f"network-{uuid.uuid4().hex[:8]}"
PY = "/usr/bin/python3"  # the system's: the sandbox sees /usr, not this test's virtualenv
CONNECT = r"""
import socket, sys
s = socket.socket()
s.settimeout(5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("CONNECTED", s.recv(200).decode().strip())
except OSError as e:
    print("unreachable", e)
"""
LISTEN_ONCE = r"""
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(4)
s.settimeout(float(sys.argv[2]))
print("listening", flush=True)
try:
    c, peer = s.accept()
    print("ACCEPTED", peer[0])
except OSError as e:
    print("nobody came:", e)
"""


@pytest.fixture
def net_boxes(bwrap_available: None, tmp_path: Path):
    """``net_boxes(index)``: started bubblewrap sandboxes with the network on, stopped at teardown."""
    made: list[LocalSandbox] = []
    factory = sandbox_factory(made, isolation="bwrap", base_dir=str(tmp_path))
    yield lambda index: factory(index, network=True)
    for box in made:
        box.stop()


def connect(box: LocalSandbox, host: str, port: int) -> str:
    return box.run(f"{PY} -c {shlex.quote(CONNECT)} {host} {port}", timeout_s=60).output.strip()


@pytest.mark.bwrap
@pytest.mark.parametrize("network", ["hub", "own slirp4netns"])
def test_a_prompt_reaches_a_host_outside(net_boxes, outside_host, network, monkeypatch):
    monkeypatch.setattr(network_hub, "ENABLED", network == "hub")
    host, port = outside_host
    box = net_boxes(0)
    said = connect(box, host, port)
    assert said.startswith("CONNECTED hello from outside"), said
    if network == "hub":
        address = box._server.address
        assert address is not None and ipaddress.ip_address(address) in network_hub.PROMPT_NET
        assert box._server._slirp is None  # no process of its own for the network
    else:
        assert box._server.address is None and box._server._slirp is not None


@pytest.mark.bwrap
@pytest.mark.parametrize("network", ["hub", "own slirp4netns"])
def test_the_cloud_metadata_address_is_out_of_reach(net_boxes, metadata_host, network, monkeypatch):
    """169.254.169.254 (a cloud's instance metadata and credentials) answers the host, and the outside
    world answers the sandbox, but no command in it reaches that address: slirp4netns would connect
    to it from the host's own sockets."""
    monkeypatch.setattr(network_hub, "ENABLED", network == "hub")
    host, port = metadata_host
    with socket.create_connection((host, port), timeout=5) as conn:
        assert conn.recv(200).startswith(b"hello from outside")  # the host reaches it
    said = connect(net_boxes(0), host, port)
    assert said.startswith("unreachable"), said


@pytest.mark.bwrap
def test_prompts_on_one_hub_do_not_reach_each_other(net_boxes, outside_host):
    """Prompt A listens on all its addresses; prompt B, on the same worker's hub, cannot connect to
    it, though it reaches the outside host; A's listener does take A's own connection afterwards."""
    host, port = outside_host
    a, b = net_boxes(0), net_boxes(1)
    mine, theirs = a._server.address, b._server.address
    assert mine and theirs and mine != theirs
    assert connect(b, host, port).startswith("CONNECTED"), "B has the network"
    script = (
        f"{PY} -c {shlex.quote(LISTEN_ONCE)} 9000 12 & sleep 4; "
        f"{PY} -c {shlex.quote(CONNECT)} {mine} 9000; wait"
    )
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(a=a.run(script, timeout_s=60).output))
    thread.start()
    try:
        time.sleep(1.5)  # A's listener is up
        said = connect(b, mine, 9000)
    finally:
        thread.join()
    assert said.startswith("unreachable"), said
    assert f"ACCEPTED {mine}" in out["a"] and theirs not in out["a"], out["a"]


@pytest.mark.bwrap
def test_the_hub_is_made_again_when_its_slirp4netns_dies(net_boxes, outside_host):
    host, port = outside_host
    first = net_boxes(0)
    hub = network_hub.hub()
    assert hub is not None and first._server.address is not None
    hub._slirp.kill()
    hub._slirp.wait()
    second = net_boxes(1)
    assert network_hub.hub() is not hub
    assert connect(second, host, port).startswith("CONNECTED")


@pytest.mark.bwrap
def test_the_hubs_slirp4netns_gets_none_of_the_runners_environment(net_boxes, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the hub is for root")
    if network_problem():
        skip_or_fail(network_problem())
    network_hub.close_hub()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-hub-secret-0123456789")
    net_boxes(0)
    hub = network_hub.hub()
    assert hub is not None, network_hub.hub_problem
    env = Path(f"/proc/{hub._slirp.pid}/environ").read_bytes().split(b"\0")
    assert not any(b"sk-hub-secret" in e for e in env) and any(e.startswith(b"PATH=") for e in env)
    network_hub.close_hub()  # the next test's hub is made without the secret in the environment
