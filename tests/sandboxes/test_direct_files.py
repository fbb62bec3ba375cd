"""The file tools' direct path in the local bubblewrap sandbox (batchrun/prompt/sandboxes/_direct.py).

read_file, write_file and patch reach the prompt's own working directory and /tmp from the worker
without a command. These tests check that it gives exactly what the commands give, that it is
really taken, and that it never reaches anything a command in the sandbox could not.
"""

from __future__ import annotations

import os
import time

import pytest
from helpers import TOOL_CAP
from helpers import sandbox_sh as sh
from helpers import tool_call as call

from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox, bwrap_problem
from batchrun.prompt.sandboxes.local.direct_files import openat2_available

pytestmark = pytest.mark.skipif(
    bool(bwrap_problem()) or not openat2_available(), reason="needs bubblewrap and openat2 (Linux 5.6+)"
)


class Counting(LocalSandbox):
    """The local sandbox, counting its commands; ``direct=False`` turns the direct path off."""

    def __init__(self, *args, direct: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands: list[str] = []
        self.direct = direct

    def run(self, command, *, timeout_s, stdin=None):
        self.commands.append(command)
        return super().run(command, timeout_s=timeout_s, stdin=stdin)

    def read_direct(self, path, max_bytes):
        return super().read_direct(path, max_bytes) if self.direct else None

    def write_direct(self, path, data, *, make_parents):
        return self.direct and super().write_direct(path, data, make_parents=make_parents)


@pytest.fixture
def box(tmp_path):
    sandbox = Counting(
        SandboxSpec(run_name="direct", prompt_index=0), base_dir=str(tmp_path), output_cap_bytes=TOOL_CAP
    )
    sandbox.start()
    try:
        yield sandbox
    finally:
        sandbox.stop()


# Contents where awk's way and the direct way could part: line ends, cut lines, bytes that are not
# UTF-8 (cut inside a character, too), NUL bytes early (binary) and late, the output budget.
WIDE = "é" * 1500  # 3,000 bytes: cut at the line width, inside a character
CONTENTS = {
    "empty": b"",
    "newline": b"\n",
    "no-final-newline": b"a\nb",
    "crlf": b"one\r\ntwo\r\n",
    "blank-lines": b"\n\n\nx\n\n",
    "wide": (WIDE + "\n" + "short\n").encode(),
    "latin1": b"caf\xe9\n\xff\xfe\n",
    "many": b"".join(b"line %d %s\n" % (i, b"x" * 90) for i in range(3000)),
    "nul-early": b"abc\0def\n",
    "nul-late": b"a\n" * 5000 + b"\0\n",
    "tabs": b"\tindented\t\n  spaces  \n",
}


@pytest.mark.parametrize("name", sorted(CONTENTS))
def test_read_file_direct_gives_what_the_commands_give(box, name):
    box.write_direct("f.txt", CONTENTS[name], make_parents=False) or pytest.fail("direct write refused")
    cases = [{}, {"offset": 2}, {"offset": 2, "limit": 3}, {"offset": 10_000}, {"limit": 1}]
    for args in cases:
        box.direct = True
        got = call(box, "read_file", path="f.txt", **args)
        box.direct = False
        want = call(box, "read_file", path="f.txt", **args)
        assert got == want, (name, args)


def test_read_and_write_take_no_command(box):
    box.commands.clear()
    assert call(box, "write_file", path="notes/deep/a.txt", content="alpha\nbeta\n")["bytes_written"] == 11
    assert call(box, "read_file", path="notes/deep/a.txt")["content"] == "     1|alpha\n     2|beta"
    assert (
        call(box, "patch", path="notes/deep/a.txt", old_string="beta", new_string="gamma")["replacements"]
        == 1
    )
    assert call(box, "read_file", path="~/notes/deep/a.txt")["content"] == "     1|alpha\n     2|gamma"
    assert call(box, "write_file", path="/tmp/t/x", content="in tmp")["bytes_written"] == 6
    assert call(box, "read_file", path="/var/tmp/t/x")["content"] == "     1|in tmp"  # /var/tmp -> /tmp
    assert box.commands == []
    # What the commands see: the same bytes, the same modes as a command's own mkdir -p and cat > would give.
    assert sh(box, "cat notes/deep/a.txt /tmp/t/x") == "alpha\ngamma\nin tmp"
    sh(box, "mkdir -p by/cmd && echo x > by/cmd/f")
    modes = sh(box, "stat -c '%a %U' notes notes/deep notes/deep/a.txt by by/cmd by/cmd/f").split("\n")
    assert modes[:3] == modes[3:6]


def test_write_direct_then_commands_agree_on_errors(box):
    sh(box, "mkdir adir")
    got = call(box, "write_file", path="adir", content="x")
    box.direct = False
    assert got == call(box, "write_file", path="adir", content="x")
    assert "directory" in got["error"]


def test_symlinks_stay_inside_the_sandbox(box, tmp_path):
    host_file = tmp_path / "host-secret.txt"
    host_file.write_text("host data\n")
    sh(box, f"ln -s {host_file} link; ln -s {tmp_path} linkdir; ln -s /etc/hostname etc-link")
    assert box.read_direct("link", 1 << 20) is None  # the path does not exist inside
    assert box.write_direct("link", b"overwritten", make_parents=False) is False
    assert box.write_direct("linkdir/new.txt", b"x", make_parents=True) is False
    assert (
        box.write_direct(str(tmp_path / "abs.txt"), b"x", make_parents=True) is True
    )  # the sandbox's own /tmp
    call(box, "write_file", path="link", content="overwritten")
    assert host_file.read_text() == "host data\n"
    assert not (tmp_path / "new.txt").exists() and not (tmp_path / "abs.txt").exists()
    # Files outside the prompt's own mounts are left to commands: the read-only system.
    assert box.read_direct("etc-link", 1 << 20) is None
    assert box.read_direct("../../etc/passwd", 1 << 20) is None
    assert box.write_direct("../../etc/passwd", b"x", make_parents=False) is False
    assert "Read-only" in call(box, "write_file", path="../../etc/passwd", content="x")["error"]


def test_magic_links_and_special_files_are_refused(box):
    sh(box, "echo secret > s; mkfifo fifo; mkdir d")
    for path in (
        "/proc/self/root/etc/hostname",
        "/proc/1/root/workspace/s",
        "/proc/1/cwd/s",
        "/proc/1/environ",
    ):
        assert box.read_direct(path, 1 << 20) is None, path
    start = time.monotonic()
    assert box.read_direct("fifo", 1 << 20) is None
    assert box.write_direct("fifo", b"x", make_parents=False) is False
    assert box.read_direct("d", 1 << 20) is None
    assert time.monotonic() - start < 5  # a FIFO without a writer or reader never blocks the direct path


def test_permissions_are_the_sandbox_users(box):
    """As root the worker could read and write anything; the sandbox's user (no capabilities) cannot."""
    sh(
        box,
        "echo locked > locked; chmod 000 locked; echo ro > ro; chmod 444 ro; mkdir rodir; chmod 555 rodir",
    )
    assert box.read_direct("locked", 1 << 20) is None
    assert box.write_direct("ro", b"changed", make_parents=False) is False
    assert box.write_direct("rodir/new", b"x", make_parents=False) is False
    assert box.write_direct("rodir/sub/new", b"x", make_parents=True) is False
    assert "Permission denied" in call(box, "write_file", path="ro", content="changed")["error"]
    assert sh(box, "cat ro; ls rodir") == "ro\n"


def test_no_write_into_an_ended_namespace(box):
    assert box.write_direct("before.txt", b"x", make_parents=False)
    os.kill(box._server.proc.pid, 9)  # bwrap, and with it the namespace
    box._server.proc.wait()
    assert box.write_direct("after.txt", b"x", make_parents=False) is False
    assert box.read_direct("before.txt", 10) is None
    assert call(box, "write_file", path="after.txt", content="y")["bytes_written"] == 1  # a new namespace
    assert sh(box, "ls") == "after.txt\n"


def test_size_limit_leaves_large_files_to_commands(box):
    assert box.write_direct("big", b"x" * 5000, make_parents=False)
    assert box.read_direct("big", 4999) is None
    assert box.read_direct("big", 5000) == b"x" * 5000


def test_the_runner_s_wrapped_sandbox_takes_the_direct_path_too(tmp_path):
    """A run's prompt gets its sandbox wrapped (started alongside the first model call): the file
    tools must see through the wrapper, or every call pays its commands again."""
    from batchrun.prompt.sandbox_lifecycle import BackgroundStart, StartPool

    inner = Counting(
        SandboxSpec(run_name="direct", prompt_index=1), base_dir=str(tmp_path), output_cap_bytes=TOOL_CAP
    )
    wrapped = BackgroundStart(inner, StartPool(1))
    wrapped.start()
    try:
        assert call(wrapped, "write_file", path="a/b.txt", content="one\n")["bytes_written"] == 4
        assert call(wrapped, "read_file", path="a/b.txt")["content"] == "     1|one"
        assert inner.commands == []
    finally:
        wrapped.stop()


def test_a_symlink_as_the_file_is_left_to_the_commands_which_follow_it_inside(box):
    sh(box, "echo old > real.txt; ln -s real.txt link.txt")
    assert box.write_direct("link.txt", b"new\n", make_parents=False) is False
    assert call(box, "write_file", path="link.txt", content="new\n")["bytes_written"] == 4
    assert sh(box, "cat real.txt; readlink link.txt") == "new\nreal.txt\n"
    assert box.read_direct("link.txt", 100) == b"new\n"  # reading follows it, inside the sandbox's root


def test_reading_a_file_of_many_short_lines_takes_little_of_the_worker_s_memory(box):
    """The direct path reads up to 16 MiB into the worker; splitting all of it into lines made an
    object per line (some 300 MB for 5.5 million lines of "ab") on every read_file call, however few
    lines were shown. Only the lines shown may be cut out."""
    import tracemalloc

    assert box.write_direct("short-lines", b"ab\n" * 5_500_000, make_parents=False)
    tracemalloc.start()
    try:
        result = call(box, "read_file", path="short-lines", offset=5_000_000, limit=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result["content"] == "5000000|ab\n5000001|ab" and result["total_lines"] == 5_500_000
    assert box.commands == []  # the direct path, not awk in the sandbox
    assert peak < 48 << 20, peak  # the file's 16.5 MB, once or twice
