"""The Docker command server's encoding, checked against the real shells images have (no engine needed).

A request carries the command as one single-quoted shell word and the stdin as a printf format;
both must give back exactly the bytes sent, in dash (Debian's sh), busybox ash and bash.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from batchrun.prompt.sandboxes._shell import exec_tag
from batchrun.prompt.sandboxes.base import CappedBuffer
from batchrun.prompt.sandboxes.docker.container_server import Scanner, printf_format, request, sh_quote

SHELLS = [
    pytest.param(argv, id=argv[0])
    for argv in (["dash"], ["busybox", "sh"], ["bash"])
    if shutil.which(argv[0])
]
SAMPLES = [
    b"",
    b"plain text\n",
    b"-n starts like an option",
    b"100% \\n \\c \\0 \\\\ %s %d %%",
    b"it's 'quoted' \"twice\" `tick` $HOME ${x} $(date)",
    b"\r\n\t\x0b\x0c\x1b[0m",
    bytes(range(256)),
    b"\0\0nul first, and last\0",
    "héllo wörld ✓".encode(),
]


@pytest.mark.parametrize("shell", SHELLS)
def test_printf_format_gives_back_every_byte(shell: list[str]):
    for data in SAMPLES:
        done = subprocess.run([*shell, "-c", 'printf "$1"', "sh", printf_format(data)], capture_output=True)
        assert (done.stdout, done.returncode) == (data, 0), data


@pytest.mark.parametrize("shell", SHELLS)
def test_a_quoted_word_gives_back_every_byte_but_nul(shell: list[str]):
    for data in SAMPLES:
        data = data.replace(b"\0", b"")
        done = subprocess.run([*shell, "-c", b"printf %s " + sh_quote(data)], capture_output=True)
        assert (done.stdout, done.returncode) == (data, 0), data


def test_request_is_one_line_of_words():
    tag = exec_tag("tok").encode()  # the commands' environment carries the tag, never the marker's token
    assert tag != b"tok" and b"tok" not in tag
    line = request("tok", "echo 'a'\nb", b"x\0y%")
    assert line == b"__br_run tok " + tag + b" 'echo '\\''a'\\''\nb' 'x\\000y%%'\n"
    assert request("tok", "true", None) == b"__br_run tok " + tag + b" 'true'\n"


def test_scanner_closed_at_a_deadline_keeps_the_output_and_still_finds_the_marker():
    scanner = Scanner("tok", CappedBuffer(1000))
    scanner.feed(b"begun\n")
    assert scanner.close_output() == ("begun\n", False)  # a trailing newline is output, not held
    scanner.feed(b"Killed\n\n[batch-runner-exit:tok]=137\n")
    assert scanner.done and scanner.exit_code == 137  # the marker is found; what came before it is not kept

    scanner = Scanner("tok", CappedBuffer(1000))
    scanner.feed(b"out\n[batch-runner-ex")  # the marker's start may arrive before the deadline
    assert scanner.close_output() == ("out", False)
    scanner.feed(b"it:tok]=0\n")
    assert scanner.done and scanner.exit_code == 0
