"""The local sandbox for a user who is not root (unprivileged bubblewrap), with the network on.

Unprivileged bubblewrap nests a second user namespace inside the one that owns the prompt's network
namespace; slirp4netns and nsenter must enter the owner, and slirp4netns cannot build its own
mount-namespace sandbox there (the user is not root in it), so it runs under its syscall filter.
The tests run as root and start the sandbox in a child process as ``nobody``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import FORGE_FROM_MEMORY

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

CHILD = r"""
import json, os, shlex, sys
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox
from batchrun.prompt.sandboxes.local.host import host_addresses, network_problem

box = LocalSandbox(SandboxSpec("nonroot", 0, network=True), isolation="bwrap", base_dir=sys.argv[1])
box.start()
try:
    slirp = box._server._slirp
    env = open(f"/proc/{slirp.pid}/environ", "rb").read().split(b"\0") if slirp else []
    routes = box.run("cat /proc/net/route /proc/net/ipv6_route", timeout_s=30).output
    who = box.run("id -u", timeout_s=30).output.strip()
    forged = box.run("/usr/bin/python3 -c " + shlex.quote(sys.argv[2]), timeout_s=60)
    wrote = box.write_direct(box.workdir + "/direct.txt", b"direct", make_parents=False)
    print(json.dumps({
        "network": box.network, "routes": routes, "uid": who, "hosts": host_addresses(),
        "secret_in_slirp_env": any(b"sk-nonroot-secret" in e for e in env),
        "forged_exit": forged.exit_code, "forged_output": forged.output[-300:],
        "oom_score_adj": box.run("cat /proc/self/oom_score_adj", timeout_s=30).output.strip(),
        "direct": wrote and box.read_direct(box.workdir + "/direct.txt", 100) == b"direct"
        and box.run("cat direct.txt", timeout_s=30).output == "direct",
    }))
finally:
    box.stop()
"""


def _interpreter_for_nobody(env: dict[str, str]) -> str | None:
    """This interpreter, or the system's (the sandbox needs only the standard library), if nobody
    can run it and import the local backend with it."""
    for python in dict.fromkeys(
        filter(None, (sys.executable, shutil.which("python3", path="/usr/bin:/bin")))
    ):
        try:
            probe = subprocess.run(
                [python, "-c", "import batchrun.prompt.sandboxes.local"],
                env=env, preexec_fn=_as_nobody, capture_output=True, timeout=60,
            )  # fmt: skip
        except OSError:
            continue
        if probe.returncode == 0:
            return python
        # The local backend needs the standard library alone, so that the system's Python runs it here:
        # an import of a third-party module on its path (urllib3, through batchrun.secrets) turned this
        # test into a skip without a word.
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", probe.stderr.decode())
        if missing and not missing.group(1).startswith("batchrun"):
            raise AssertionError(
                f"the local sandbox's modules import {missing.group(1)!r}, which {python} lacks: "
                f"{probe.stderr.decode()[-500:]}"
            )
    return None


def nobody_home(request, prefix: str) -> tuple[Path, dict[str, str]]:
    """A directory every user may write (pytest's own tmp_path is root's alone, 0700), removed after the
    test, and the environment of a child run as nobody with this checkout's package, its home there."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    os.chmod(base, 0o777)
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "PYTHONPATH": str(REPO),
        "HOME": str(base),
        "TMPDIR": str(base),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return base, env


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.mark.bwrap
def test_a_non_root_sandbox_gets_the_network_with_the_hosts_addresses_closed(bwrap_available, request):
    from batchrun.prompt.sandboxes.local.host import network_problem

    if os.geteuid() != 0:
        pytest.skip("needs root to start a child as nobody")
    if network_problem():
        pytest.skip(network_problem())
    base, env = nobody_home(request, "br-nonroot-")
    env["OPENROUTER_API_KEY"] = "sk-nonroot-secret"
    python = _interpreter_for_nobody(env)
    if python is None:  # neither this interpreter nor the system's is readable by other users here
        pytest.skip("no Python interpreter that nobody can run imports the package here")
    done = subprocess.run(
        [python, "-c", CHILD, str(base), FORGE_FROM_MEMORY],
        env=env, preexec_fn=_as_nobody, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["network"] == "slirp4netns"
    assert seen["uid"] == str(NOBODY)
    assert "tap0\t00000000" in seen["routes"]  # the default route leaves through slirp4netns
    for address in seen["hosts"]:  # each of the host's own addresses is closed inside
        if ":" not in address:
            hexed = "".join(f"{int(part):02X}" for part in reversed(address.split(".")))
            assert f"*\t{hexed}\t" in seen["routes"], (address, seen["routes"])
    # and so is the link-local range, where clouds serve their metadata (169.254.0.0/16, host.NEVER_REACHED)
    link_local = [
        line.split("\t") for line in seen["routes"].splitlines() if line.startswith("*\t0000FEA9\t")
    ]
    assert link_local and link_local[0][7] == "0000FFFF", seen["routes"]
    assert seen["secret_in_slirp_env"] is False
    # No command reads the command server's memory (the end marker's token) as an unprivileged user
    # either, and the server, non-dumpable, still gets its OOM score and the direct file access.
    assert seen["forged_exit"] == 3, seen["forged_output"]
    assert seen["oom_score_adj"] == "1000" and seen["direct"] is True


# A user who is not root and may make no user namespaces (what AppArmor's
# apparmor_restrict_unprivileged_userns, unprivileged_userns_clone=0 or max_user_namespaces=0 do): a
# user namespace whose max_user_namespaces allows only the one inside it, where this runs as uid 1000.
NO_USERNS = 'echo 1 > /proc/sys/user/max_user_namespaces && exec unshare --user --map-user=1000 --map-group=1000 -- "$@"'


@pytest.mark.bwrap
def test_a_user_who_may_make_no_user_namespaces_is_told_so_not_to_install_bubblewrap(
    bwrap_available, tmp_path
):
    """bubblewrap was installed, but this user could not make the user namespace it needs without root:
    the run exited 2 telling them to "Install bubblewrap (Debian: apt-get install bubblewrap)". It now
    says that this user may not make user namespaces, and that letting them (or root) is the fix."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "hello"}\n')
    tmp_path.chmod(0o777)
    argv = [
        "unshare", "--user", "--map-root-user", "--", "/bin/sh", "-c", NO_USERNS, "sh",
        sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=1",
        "--run_name=r", f"--output_dir={tmp_path}", "--model=fake-model", "--base_url=http://127.0.0.1:9/v1",
        "--api_key=sk-test", "--distribution=terminal_only", "--num_workers=1",
    ]  # fmt: skip
    env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    setup = subprocess.run([*argv[:8], "true"], env=env, capture_output=True, text=True, timeout=60)
    if setup.returncode != 0:
        pytest.skip(f"cannot make the nested user namespaces here: {setup.stderr.strip()[-300:]}")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "this user may not make user namespaces (unshare --user: " in done.stderr, done.stderr[-2000:]
    assert "Let this user make user namespaces (above), run as root, use --sandbox=docker" in done.stderr
    assert "Install bubblewrap" not in done.stderr
