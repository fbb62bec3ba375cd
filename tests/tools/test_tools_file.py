"""Tests of the file tools (read_file, write_file, patch, search_files) through execute_tool_call.

Every test takes the ``sandbox`` fixture, so the same bodies can run over other backends. It runs
the local backend twice: as is, and with only busybox on PATH (``sh`` being busybox ash), which is
what the tools may assume inside a container. Files are set up and checked through the sandbox
too, never through host paths.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest
from helpers import TOOL_CAP as CAP
from helpers import sandbox_sh as sh
from helpers import tool_call as call


def sha256_in_sandbox(sandbox, path: str) -> str:
    return sh(sandbox, f"sha256sum '{path}'").split()[0]


def numbered(first: int, lines: list[str]) -> str:
    return "\n".join(f"{n:6d}|{line}" for n, line in enumerate(lines, first))


# ----------------------------------------------------------------------------- read_file


def test_read_numbers_lines_with_offset_and_limit(sandbox):
    sh(sandbox, "seq 1 10 | sed 's/^/line/' > ten.txt")
    result = call(sandbox, "read_file", path="ten.txt", offset=3, limit=2)
    assert result["content"] == "     3|line3\n     4|line4"
    assert result["total_lines"] == 10
    assert result["truncated"] is True
    assert "offset=5" in result["hint"]
    whole = call(sandbox, "read_file", path="ten.txt")
    assert whole == {
        "content": numbered(1, [f"line{i}" for i in range(1, 11)]),
        "total_lines": 10,
        "truncated": False,
    }


def test_read_without_trailing_newline_and_empty_file(sandbox):
    sh(sandbox, "printf 'a\\nb' > two.txt; : > empty.txt")
    assert call(sandbox, "read_file", path="two.txt") == {
        "content": "     1|a\n     2|b",
        "total_lines": 2,
        "truncated": False,
    }
    assert call(sandbox, "read_file", path="empty.txt") == {
        "content": "",
        "total_lines": 0,
        "truncated": False,
    }


def test_read_offset_past_end(sandbox):
    sh(sandbox, "printf 'a\\nb\\n' > two.txt")
    result = call(sandbox, "read_file", path="two.txt", offset=7)
    assert result["content"] == "" and result["total_lines"] == 2
    assert "past the end" in result["hint"]


def test_read_non_utf8_bytes(sandbox):
    sh(sandbox, "printf 'ok\\n\\377\\376bad\\n' > latin.txt")
    result = call(sandbox, "read_file", path="latin.txt")
    assert result["content"] == "     1|ok\n     2|\ufffd\ufffdbad"


def test_read_cuts_long_lines(sandbox):
    sh(sandbox, "{ head -c 5000 /dev/zero | tr '\\000' x; printf '\\nshort\\n'; } > long.txt")
    lines = call(sandbox, "read_file", path="long.txt")["content"].split("\n")
    assert lines[0] == "     1|" + "x" * 2000 + " [line truncated: 5000 bytes, first 2000 shown]"
    assert lines[1] == "     2|short"


def test_read_stays_within_the_output_cap_and_says_where_to_continue(sandbox):
    sh(
        sandbox,
        'seq 1 500 | awk \'{ printf "%04d", $1; for (i = 0; i < 996; i++) printf "y"; print "" }\' > big.txt',
    )
    result = call(sandbox, "read_file", path="big.txt")
    assert result["truncated"] is True and result["total_lines"] == 500
    content = result["content"]
    assert CAP // 2 < len(content) <= CAP
    last = int(content.split("\n")[-1].split("|")[0])
    assert f"offset={last + 1}" in result["hint"]
    more = call(sandbox, "read_file", path="big.txt", offset=last + 1, limit=1)
    assert more["content"].startswith(f"{last + 1:6d}|{last + 1:04d}yyy")


@pytest.mark.parametrize(
    "setup, path, message",
    [
        ("true", "missing.txt", "File not found: missing.txt"),
        ("mkdir adir", "adir", "adir is a directory"),
        ("printf 'text\\000more' > blob.bin", "blob.bin", "blob.bin is a binary file (9 bytes)"),
    ],
)
def test_read_errors(sandbox, setup, path, message):
    sh(sandbox, setup)
    assert message in call(sandbox, "read_file", path=path)["error"]


# ----------------------------------------------------------------------------- write_file

TRICKY = (
    "quotes: \"double\" 'single' `backtick`\n"
    "shell: $(touch pwned) ${HOME} $HOME; rm -rf / && echo no\n"
    "backslashes: \\ \\\\ \\n \\t \\000\n"
    "\ttab, carriage return\r\n"
    "unicode: héllo — 日本語 🎉\n"
    "EOF\n"
    "no trailing newline"
)


def test_write_creates_parent_directories(sandbox):
    result = call(sandbox, "write_file", path="deep/er/still/file.txt", content="hi\n")
    assert result == {"bytes_written": 3, "path": "deep/er/still/file.txt"}
    assert sh(sandbox, "cat deep/er/still/file.txt") == "hi\n"


def test_write_read_round_trip_of_tricky_content(sandbox):
    path = "-odd dir/my file.txt"
    result = call(sandbox, "write_file", path=path, content=TRICKY)
    assert result == {"bytes_written": len(TRICKY.encode()), "path": path}
    assert sha256_in_sandbox(sandbox, "./" + path) == hashlib.sha256(TRICKY.encode()).hexdigest()
    assert sh(sandbox, "ls") == "-odd dir\n"  # nothing in the content was executed
    read = call(sandbox, "read_file", path=path)
    assert read["content"] == numbered(1, TRICKY.split("\n"))
    assert read["total_lines"] == 7


def test_write_and_patch_one_megabyte(sandbox):
    line = "0123456789 abcdefghij ünïcödé ✓ {}\n"
    content = "".join(line.format(i) for i in range(30000))[: 1 << 20]
    content = content[: len(content) // 2] + "UNIQUE-MARKER" + content[len(content) // 2 :]
    assert call(sandbox, "write_file", path="big.txt", content=content)["bytes_written"] == len(
        content.encode()
    )
    assert sha256_in_sandbox(sandbox, "big.txt") == hashlib.sha256(content.encode()).hexdigest()
    result = call(sandbox, "patch", path="big.txt", old_string="UNIQUE-MARKER", new_string="replaced")
    assert result["replacements"] == 1
    expected = content.replace("UNIQUE-MARKER", "replaced").encode()
    assert sha256_in_sandbox(sandbox, "big.txt") == hashlib.sha256(expected).hexdigest()


def test_write_empty_and_overwrite(sandbox):
    call(sandbox, "write_file", path="f.txt", content="long old content\n")
    assert call(sandbox, "write_file", path="f.txt", content="") == {"bytes_written": 0, "path": "f.txt"}
    assert sh(sandbox, "wc -c < f.txt").strip() == "0"


def test_write_errors(sandbox):
    sh(sandbox, "mkdir adir; echo x > afile")
    assert "adir is a directory" in call(sandbox, "write_file", path="adir", content="x")["error"]
    assert call(sandbox, "write_file", path="afile/child.txt", content="x")["error"].startswith(
        "write failed"
    )


# ----------------------------------------------------------------------------- patch


def test_patch_unique_string(sandbox):
    call(sandbox, "write_file", path="code.py", content="def f():\n    return 1\n\nprint(f())\n")
    result = call(sandbox, "patch", path="code.py", old_string="return 1", new_string="return 2")
    assert result["replacements"] == 1 and result["path"] == "code.py"
    assert "-    return 1\n+    return 2\n" in result["diff"]
    assert sh(sandbox, "cat code.py") == "def f():\n    return 2\n\nprint(f())\n"


def test_patch_not_found_and_ambiguous(sandbox):
    call(sandbox, "write_file", path="a.txt", content="x = 1\nx = 1\nx = 1\n")
    assert (
        "old_string not found in a.txt"
        in call(sandbox, "patch", path="a.txt", old_string="y", new_string="z")["error"]
    )
    ambiguous = call(sandbox, "patch", path="a.txt", old_string="x = 1", new_string="x = 2")
    assert "found 3 times" in ambiguous["error"] and "replace_all" in ambiguous["error"]
    assert sh(sandbox, "cat a.txt") == "x = 1\nx = 1\nx = 1\n"  # untouched
    result = call(sandbox, "patch", path="a.txt", old_string="x = 1", new_string="x = 2", replace_all=True)
    assert result["replacements"] == 3
    assert sh(sandbox, "cat a.txt") == "x = 2\nx = 2\nx = 2\n"


def test_patch_keeps_other_bytes_exactly(sandbox):
    sh(sandbox, "printf 'ok\\n\\377\\376\\000tail' > raw.bin")
    assert call(sandbox, "patch", path="raw.bin", old_string="ok", new_string="OK")["replacements"] == 1
    assert sha256_in_sandbox(sandbox, "raw.bin") == hashlib.sha256(b"OK\n\xff\xfe\x00tail").hexdigest()


def test_patch_errors(sandbox):
    sh(sandbox, "mkdir adir; echo same > f.txt")
    assert (
        "File not found: nope.txt"
        in call(sandbox, "patch", path="nope.txt", old_string="a", new_string="b")["error"]
    )
    assert "is a directory" in call(sandbox, "patch", path="adir", old_string="a", new_string="b")["error"]
    assert "must not be empty" in call(sandbox, "patch", path="f.txt", old_string="", new_string="b")["error"]
    assert "identical" in call(sandbox, "patch", path="f.txt", old_string="same", new_string="same")["error"]


def test_patch_stays_within_the_tool_timeout_over_a_slow_fifo(sandbox):
    """patch reads a file by commands chunk by chunk when the direct path does not take it (a FIFO):
    a background writer giving a byte a second kept each command short and the whole read going
    for as many seconds as the FIFO first claimed bytes. All its commands share one timeout."""
    from batchrun.prompt.tools.catalog import execute_tool_call, tools_for_toolsets
    from batchrun.prompt.tools.registry import ToolContext

    sh(sandbox, "mkfifo slow")
    feed = "printf '%030d' 0 > slow; i=0; while [ $i -lt 30 ]; do sleep 1; printf 0 > slow; i=$((i+1)); done"
    assert call(sandbox, "process", action="start", command=feed)["status"] == "running"
    ctx = ToolContext(sandbox=sandbox, tool_timeout_s=3.0, output_cap_bytes=CAP)
    offered = {t.name for t in tools_for_toolsets(["terminal", "file"])}
    args = {"path": "slow", "old_string": "0", "new_string": "1", "replace_all": True}
    start = time.monotonic()
    result = json.loads(execute_tool_call("patch", json.dumps(args), ctx, offered))
    assert time.monotonic() - start < 8, result
    assert "timed out" in result["error"]


def test_patch_refuses_a_result_beyond_its_limit_before_making_it(sandbox):
    """replace_all multiplies: 4 MB of "a", each made 100 bytes, was 400 MB built in the worker
    (1.5 GB at its peak) and written back; a longer new_string could exhaust the worker's memory."""
    sh(sandbox, "head -c 4000000 /dev/zero | tr '\\0' a > many")
    args = {"path": "many", "old_string": "a", "new_string": "b" * 100, "replace_all": True}
    assert "limit" in call(sandbox, "patch", **args)["error"]
    assert sh(sandbox, "wc -c < many").strip() == "4000000"


def test_patch_diff_of_many_changes_takes_no_minutes(sandbox):
    """The diff is made in the worker, with no timeout: difflib's time grows with the square of the
    lines it compares, and replace_all changing every other one of 30,000 lines took half a minute
    (200,000: many minutes). Only the changed stretch is compared, with the file's line numbers."""
    sh(sandbox, 'awk \'BEGIN { for (i = 0; i < 30000; i++) print i, (i % 2 ? "z" : "x") }\' > alt')
    start = time.monotonic()
    result = call(sandbox, "patch", path="alt", old_string="x", new_string="y", replace_all=True)
    assert time.monotonic() - start < 10
    assert result["replacements"] == 15000
    assert result["diff"].startswith("--- a/alt\n+++ b/alt\n@@ -1,") and "-2 x\n+2 y\n" in result["diff"]
    sh(sandbox, 'awk \'BEGIN { for (i = 1; i <= 20000; i++) print (i == 15000 ? "old" : "same") }\' > deep')
    diff = call(sandbox, "patch", path="deep", old_string="old", new_string="new")["diff"]
    assert diff.split("\n")[2:-1] == [
        "@@ -14998,5 +14998,5 @@",
        " same",
        " same",
        "-old",
        "+new",
        " same",
        " same",
    ]


# ----------------------------------------------------------------------------- search_files


@pytest.fixture
def tree(sandbox):
    sh(
        sandbox,
        "mkdir -p sub .git && printf 'def foo():\\n    return 1\\n' > a.py && printf 'foo bar\\n' > b.txt"
        " && printf 'def bar():\\n  foo()\\n' > sub/c.py && printf 'foo\\000\\n' > blob.dat"
        " && echo foo > .git/config",
    )
    return sandbox


def test_search_content(tree):
    result = call(tree, "search_files", pattern="fo+")
    assert sorted(result["matches"], key=lambda m: m["path"]) == [
        {"path": "a.py", "line": 1, "text": "def foo():"},
        {"path": "b.txt", "line": 1, "text": "foo bar"},
        {"path": "sub/c.py", "line": 2, "text": "  foo()"},
    ]  # the binary blob.dat and .git are skipped
    assert result["total"] == 3 and result["truncated"] is False


def test_search_content_glob_path_and_limit(tree):
    py = call(tree, "search_files", pattern="def [a-z]+", file_glob="*.py")
    assert sorted((m["path"], m["line"]) for m in py["matches"]) == [("a.py", 1), ("sub/c.py", 1)]
    sub = call(tree, "search_files", pattern="foo", path="sub")
    assert sub["matches"] == [{"path": "sub/c.py", "line": 2, "text": "  foo()"}]
    limited = call(tree, "search_files", pattern="foo", limit=1)
    assert len(limited["matches"]) == 1 and limited["total"] == 3 and limited["truncated"] is True


def test_search_no_match_and_errors(tree):
    assert call(tree, "search_files", pattern="zzz") == {"matches": [], "total": 0, "truncated": False}
    assert "Invalid regular expression '(foo'" in call(tree, "search_files", pattern="(foo")["error"]
    assert "Path not found: nowhere" in call(tree, "search_files", pattern="x", path="nowhere")["error"]


def test_search_in_a_directory_named_like_an_operator_of_find(tree):
    # find read a path "(" or "!" as the start of its expression: the search failed or found nothing.
    sh(tree, "for d in '(' '!' ')' ','; do mkdir -p \"$d\" && echo foo > \"$d/x.txt\"; done")
    for d in ("(", "!", ")", ","):
        assert call(tree, "search_files", pattern="foo", path=d)["matches"] == [
            {"path": f"./{d}/x.txt", "line": 1, "text": "foo"}
        ], d
        assert call(tree, "search_files", pattern="*.txt", target="files", path=d)["matches"] == [
            f"./{d}/x.txt"
        ]


def test_search_files_by_name(tree):
    assert call(tree, "search_files", pattern="*.py", target="files") == {
        "matches": ["a.py", "sub/c.py"],
        "total": 2,
        "truncated": False,
    }
    assert call(tree, "search_files", pattern="sub/*.py", target="files")["matches"] == ["sub/c.py"]
    limited = call(tree, "search_files", pattern="*", target="files", limit=2)
    assert len(limited["matches"]) == 2 and limited["total"] == 4 and limited["truncated"] is True


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("read_file", {}, "missing required argument(s): path"),
        ("read_file", {"path": "x", "offset": "5"}, "argument 'offset' must be integer"),
        ("read_file", {"path": "x", "offset": 0}, "offset is the 1-based line"),
        ("read_file", {"path": "x", "limit": 1.5}, "argument 'limit' must be integer"),
        ("read_file", {"path": ""}, "path must not be empty"),
        ("write_file", {"path": "x", "content": 5}, "argument 'content' must be string"),
        ("write_file", {"path": "x"}, "missing required argument(s): content"),
        (
            "patch",
            {"path": "x", "old_string": "a", "new_string": "b", "replace_all": "yes"},
            "must be boolean",
        ),
        ("search_files", {"pattern": "x", "limit": 0}, "limit must be between 1 and"),
        ("search_files", {"pattern": "x", "target": "dirs"}, "target must be 'content' or 'files'"),
        ("search_files", {"pattern": "x", "regex": True}, "unknown argument(s): regex"),
    ],
)
def test_bad_arguments_are_errors(sandbox, name, args, message):
    assert message in call(sandbox, name, **args)["error"]


def test_write_reports_a_failed_write(sandbox):
    """/dev/full fails every write with ENOSPC, as a full disk does: the tool must say so."""
    result = call(sandbox, "write_file", path="/dev/full", content="x" * 100)
    assert "error" in result and "bytes_written" not in result


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("read_file", {"path": "a\u0000b"}),
        ("write_file", {"path": "a\u0000b", "content": "x"}),
        ("search_files", {"pattern": "x\u0000"}),
        ("search_files", {"pattern": "x", "file_glob": "*\u0000"}),
    ],
)
def test_a_nul_character_in_a_path_or_pattern_is_the_model_s_error(sandbox, tool: str, args: dict):
    assert "NUL" in call(sandbox, tool, **args)["error"]
