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


def test_only_a_statically_linked_elf_may_be_the_trusted_busybox(tmp_path):
    import sys

    from batchrun.prompt.sandboxes.docker.sandbox import static_elf

    text = tmp_path / "script"
    text.write_text("#!/bin/sh\nexit 0\n")
    assert not static_elf(str(text))
    assert not static_elf(sys.executable)  # a dynamic one loads the container's ld.so and libc
    assert not static_elf(str(tmp_path / "missing"))
    busybox = shutil.which("busybox")
    if (
        busybox
        and "statically linked"
        in subprocess.run(["file", "-L", busybox], capture_output=True, text=True).stdout
    ):
        assert static_elf(busybox)


def test_with_an_engine_elsewhere_judging_keeps_the_images_sh_and_says_the_risk(monkeypatch):
    from batchrun.prompt.sandboxes.docker import sandbox

    monkeypatch.setenv("DOCKER_HOST", "tcp://10.0.0.1:2375")
    tools, said = sandbox.trusted_tools({})
    assert tools == {}
    assert said.startswith("warning: ") and "whose user is root" in said and "over tcp" in said, said
    monkeypatch.delenv("DOCKER_HOST")
    monkeypatch.setattr(sandbox, "_engine_here_problem", lambda: None)
    monkeypatch.setattr(sandbox, "_find_busybox", lambda: ("", "no busybox on this machine"))
    assert sandbox.trusted_tools({}) == (
        {},
        f"warning: {sandbox.UNTRUSTED_JUDGING}: no busybox on this machine",
    )


def test_judged_execs_start_from_the_trusted_busybox_and_the_verify_in_the_images_sh():
    from batchrun.prompt.sandboxes._shell import RUN_BY_PATH, RUN_IN_IMAGE_SH, kill_argv, wrapped_argv
    from batchrun.prompt.sandboxes.docker.container_server import subreaped_argv

    assert wrapped_argv("true", "tok")[:2] == ["sh", "-c"]  # no busybox: as before
    own = wrapped_argv("true", "tok", busybox="/busybox.batch-runner")
    assert own[:3] == ["/busybox.batch-runner", "sh", "-c"] and RUN_BY_PATH in own[3]  # busybox's sh applet
    user = wrapped_argv("true", "tok", busybox="/busybox.batch-runner", image_sh="abc  /bin/sh")
    assert RUN_IN_IMAGE_SH in user[3] and user[-1] == "abc  /bin/sh" and "tok" not in user
    assert kill_argv("tok", "/bb")[:2] == ["/bb", "sh"]
    assert subreaped_argv(["x"], init="/init", busybox="/bb") == ["/init", "-s", "--", "x"]
    assert subreaped_argv(["x"], busybox="/bb")[:2] == ["/bb", "sh"]


@pytest.mark.skipif(not shutil.which("busybox"), reason="no busybox here")
def test_the_verify_runs_only_while_bin_sh_is_unchanged():
    from batchrun.prompt.sandboxes._shell import token_line, wrapped_argv

    now = subprocess.run(["busybox", "sha256sum", "/bin/sh"], capture_output=True, text=True).stdout.strip()
    changed = "0" * 64 + "  /bin/sh"
    for recorded, said, code in (
        (now, "ran\n", 0),
        ("", "ran\n", 0),
        (changed, "/bin/sh is not the file", 126),
    ):
        argv = wrapped_argv("echo ran", "tok", busybox=shutil.which("busybox"), image_sh=recorded)
        out = subprocess.run(argv, input=token_line("tok"), capture_output=True).stdout.decode()
        assert said in out and out.endswith(f"\n[batch-runner-exit:tok]={code}\n"), out
