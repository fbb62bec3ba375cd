"""The ``file`` toolset: read_file, write_file, patch and search_files.

Every tool works only through ``ctx.sandbox.run`` (file data travels over stdin and, base64
encoded, over the output), so it behaves the same in a local directory and in a container.
The commands are written for POSIX ``sh`` with busybox utilities: containers need no python
or bash. Output of a command is capped by the sandbox, so each command budgets its own
output below ``ctx.output_cap_bytes`` and reports where it stopped.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import posixpath
import re
import shlex
import time
from typing import Any

from batchrun.prompt.sandboxes.base import DirectFileAccess, ExecResult, declared
from batchrun.prompt.tools.registry import Tool, ToolArgumentError, ToolContext, register

MAX_LINE_CHARS = 2000  # longer lines are cut in read_file, with a note
MAX_PATCH_BYTES = 8 * 1024 * 1024  # patch reads the whole file through the capped output, chunk by chunk
MAX_DIFF_CHARS = 4000
MAX_DIFF_LINES = 2000  # lines difflib compares at most (its time grows with their square)
MAX_MATCH_CHARS = 400  # longest search match line shown
MAX_SEARCH_LIMIT = 1000
BINARY_SNIFF_BYTES = 8192  # a NUL byte in this many leading bytes marks a file as binary
DIRECT_READ_MAX_BYTES = 16 * 1024 * 1024  # larger files are read by commands, which stream them

_MARK = "@@BR"  # first/last line of a command's own reports; file data never starts with it


# ----------------------------------------------------------------------------- shell helpers


def shell_path(path: str) -> str:
    """Quote ``path`` for sh: ``~`` means $HOME, and a leading ``-`` cannot become an option, nor a
    directory named ``(``, ``)``, ``!`` or ``,`` a part of ``find``'s expression."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    if path.startswith("-") or path in ("(", ")", "!", ","):
        path = "./" + path
    return shlex.quote(path)


def _check_file(var: str = "f") -> str:
    """sh snippet: report and stop unless ``$var`` is an existing, readable regular file."""
    return (
        f'if [ ! -e "${var}" ]; then echo "{_MARK} err not_found"; exit 0; fi; '
        f'if [ -d "${var}" ]; then echo "{_MARK} err is_dir"; exit 0; fi; '
        f'if [ ! -r "${var}" ]; then echo "{_MARK} err no_read"; exit 0; fi; '
    )


def _is_binary_test(var: str = "f") -> str:
    """sh condition that holds when the first bytes of ``$var`` contain a NUL byte.

    One pipeline that keeps only the NUL bytes and succeeds when anything is left (``grep -q '^'``
    matches any input that is not empty, GNU or busybox). No ``$(...)``: each process a command
    starts costs about a millisecond of CPU, and read_file runs this on every call.
    """
    n = BINARY_SNIFF_BYTES
    return f'head -c {n} "${var}" | tr -dc "\\000" | grep -q "^"'


_CHECK_ERRORS = {
    "not_found": "File not found: {path}",
    "is_dir": "{path} is a directory, not a file. Use search_files with target='files' to list its contents.",
    "no_read": "Permission denied: cannot read {path}",
    "binary": "{path} is a binary file ({size} bytes); read_file only shows text. "
    "Use the terminal (e.g. `od -c | head`, `file`, `strings`) to inspect it.",
}


def _run(
    ctx: ToolContext, command: str, stdin: bytes | None = None, deadline: float | None = None
) -> ExecResult:
    """``command`` within the tool's timeout, or what is left of it until ``deadline`` (monotonic)."""
    timeout_s = ctx.tool_timeout_s if deadline is None else deadline - time.monotonic()
    if timeout_s <= 0:
        return ExecResult(output="", exit_code=-1, timed_out=True)
    return ctx.sandbox.run(command, timeout_s=timeout_s, stdin=stdin)


def _direct(ctx: ToolContext) -> DirectFileAccess | None:
    """The sandbox's direct file access, when it declares one (the local bubblewrap sandbox)."""
    return ctx.sandbox if declared(ctx.sandbox, "direct_files") else None


def _header(output: str) -> tuple[list[str], list[str]]:
    """Split output into the words of its first ``@@BR`` line and the lines after it."""
    lines = output.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(_MARK + " "):
            return line.split()[1:], lines[i + 1 :]
    return [], lines


def _failure(tool: str, res: ExecResult) -> dict[str, Any]:
    """The error for a command that did not report what it was meant to."""
    if res.timed_out:
        return {"error": f"{tool} timed out"}
    detail = res.output.strip()[-500:] or f"exit code {res.exit_code}"
    return {"error": f"{tool} failed: {detail}"}


def _opt(args: dict[str, Any], key: str, default: Any) -> Any:
    value = args.get(key)
    return default if value is None else value


def _require_path(args: dict[str, Any]) -> str:
    path = args["path"]
    if not path:
        raise ToolArgumentError("path must not be empty")
    if "\0" in path:
        raise ToolArgumentError("path must not contain a NUL character")
    return path


def _budget(ctx: ToolContext) -> int:
    """Bytes a command may print so that the sandbox never cuts it."""
    return max(ctx.output_cap_bytes - 1024, 2048)


# ----------------------------------------------------------------------------- read_file

# Prints "%6d|line" for lines s..s+n-1 (cut at w bytes), stopping before b bytes of output,
# then "@@BR end <total lines> <last line shown>". LC_ALL=C makes lengths count bytes.
_READ_AWK = r"""
NR >= s && NR < s + n && !full {
    line = $0; note = ""
    if (length(line) > w) { note = " [line truncated: " length(line) " bytes, first " w " shown]"; line = substr(line, 1, w) }
    out = sprintf("%6d|%s%s", NR, line, note)
    if (shown > 0 && used + length(out) + 1 > b) { full = 1 } else { print out; used += length(out) + 1; last = NR; shown++ }
}
END { printf "@@BR end %d %d\n", NR, last }
"""


def read_file(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    path = _require_path(args)
    offset = _opt(args, "offset", 1)
    limit = _opt(args, "limit", 500)
    if offset < 1:
        raise ToolArgumentError("offset is the 1-based line to start at; it must be >= 1")
    if limit < 1:
        raise ToolArgumentError("limit must be >= 1")
    budget = _budget(ctx)
    width = min(MAX_LINE_CHARS, budget // 4)
    direct = _direct(ctx)
    data = direct.read_direct(path, DIRECT_READ_MAX_BYTES) if direct is not None else None
    if data is not None and b"\0" in data[:BINARY_SNIFF_BYTES]:
        return {"error": _CHECK_ERRORS["binary"].format(path=path, size=len(data))}
    if data is not None and b"\0" not in data:  # NUL bytes further on: awk's own way, below
        return _numbered(data, offset, limit, width, budget)
    awk_vars = f"-v s={offset} -v n={limit} -v w={width} -v b={budget}"
    command = (
        f"f={shell_path(path)}; {_check_file()}"
        f'if {_is_binary_test()}; then echo "{_MARK} err binary $(wc -c < "$f")"; exit 0; fi; '
        f'echo "{_MARK} ok"; '
        f'LC_ALL=C awk {awk_vars} {shlex.quote(_READ_AWK)} "$f"'
    )
    res = _run(ctx, command)
    head, lines = _header(res.output)
    if head[:1] == ["err"]:
        size = head[2] if len(head) > 2 else "?"
        return {"error": _CHECK_ERRORS[head[1]].format(path=path, size=size)}
    trailer = lines[-2].split() if len(lines) >= 2 and lines[-1] == "" else []
    if head[:1] != ["ok"] or trailer[:2] != [_MARK, "end"] or res.truncated:
        return _failure("read_file", res)
    return _read_result("\n".join(lines[:-2]), int(trailer[2]), int(trailer[3]), offset)


def _numbered(data: bytes, offset: int, limit: int, width: int, budget: int) -> dict[str, Any]:
    """What ``_READ_AWK`` prints for ``data``, byte for byte, done here (the direct path).

    Only the lines shown are cut out of ``data``: splitting all of it made an object per line, some
    300 MB of the worker's memory for a 16 MB file of short lines."""
    total = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    shown: list[bytes] = []
    used = last = 0
    pos = _line_start(data, offset)
    for number in range(offset, min(total, offset + limit - 1) + 1):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        line, note, pos = data[pos:end], b"", end + 1
        if len(line) > width:
            note = b" [line truncated: %d bytes, first %d shown]" % (len(line), width)
            line = line[:width]
        out = b"%6d|%s%s" % (number, line, note)
        if shown and used + len(out) + 1 > budget:
            break
        shown.append(out)
        used += len(out) + 1
        last = number
    return _read_result(b"\n".join(shown).decode("utf-8", errors="replace"), total, last, offset)


def _line_start(data: bytes, number: int) -> int:
    """Where line ``number`` (1-based) of ``data`` starts; len(data) past its end. Newlines are
    counted a block at a time, then found one by one in the last block."""
    pos, before, block = 0, number - 1, 1 << 16
    while before:
        count = data.count(b"\n", pos, pos + block)
        if count < before and pos + block < len(data):
            pos, before = pos + block, before - count
            continue
        while before:
            found = data.find(b"\n", pos)
            if found < 0:
                return len(data)
            pos, before = found + 1, before - 1
    return pos


def _read_result(content: str, total: int, last: int, offset: int) -> dict[str, Any]:
    result: dict[str, Any] = {"content": content, "total_lines": total, "truncated": False}
    if total and offset > total:
        result["hint"] = f"offset {offset} is past the end of the file ({total} lines)."
    elif last < total:
        result["truncated"] = True
        result["hint"] = f"Showing lines {offset}-{last} of {total}. Use offset={last + 1} to read more."
    return result


# ----------------------------------------------------------------------------- write_file


def _write_bytes(
    ctx: ToolContext, path: str, data: bytes, *, make_parents: bool, deadline: float | None = None
) -> dict[str, Any] | int:
    """Write ``data`` to ``path`` over stdin; the size the sandbox reports, or an error dict."""
    direct = _direct(ctx)
    if direct is not None and direct.write_direct(path, data, make_parents=make_parents):
        return len(data)
    parent = posixpath.dirname(path)
    quoted_parent = shell_path(parent)
    # `[` is a shell builtin: only a missing parent costs a mkdir process.
    mkdir = (
        f"[ -d {quoted_parent} ] || mkdir -p {quoted_parent} || exit 1; " if make_parents and parent else ""
    )
    command = (
        f"f={shell_path(path)}; "
        f'if [ -d "$f" ]; then echo "{_MARK} err is_dir"; exit 0; fi; '
        f'{mkdir}cat > "$f" || exit 1; '
        f'echo "{_MARK} ok"'
    )
    # cat exits non-zero when a write fails (a full disk, a quota), so "ok" means every byte was
    # written: no `wc` afterwards, which would cost a process on every call.
    res = _run(ctx, command, stdin=data, deadline=deadline)
    head, _ = _header(res.output)
    if head[:2] == ["err", "is_dir"]:
        return {"error": f"{path} is a directory; give the path of a file inside it"}
    if head[:1] != ["ok"] or res.exit_code != 0:
        return _failure("write", res)
    return len(data)


def write_file(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    path = _require_path(args)
    # A lone surrogate from the JSON cannot be UTF-8 encoded; it becomes "?" rather than an error.
    data = args["content"].encode("utf-8", errors="replace")
    written = _write_bytes(ctx, path, data, make_parents=True)
    if isinstance(written, dict):
        return written
    return {"bytes_written": written, "path": path}


# ----------------------------------------------------------------------------- patch


def _chunk_bytes(ctx: ToolContext) -> int:
    """Largest power of two whose base64 (76-char lines) fits the output budget."""
    raw = _budget(ctx) * 3 // 4 * 76 // 77
    size = 1024
    while size * 2 <= raw:
        size *= 2
    return size


def read_bytes(
    ctx: ToolContext, path: str, max_bytes: int = MAX_PATCH_BYTES, deadline: float | None = None
) -> bytes | dict[str, Any]:
    """The exact bytes of a file in the sandbox, read as base64 in output-sized chunks; or an error dict.

    All the chunks' commands together stay within the tool's timeout (or ``deadline``): a FIFO fed a
    byte at a time by a background process kept each one short but the whole read endless."""
    if deadline is None:
        deadline = time.monotonic() + ctx.tool_timeout_s
    direct = _direct(ctx)
    data = direct.read_direct(path, max_bytes) if direct is not None else None
    if data is not None:
        return data
    quoted = shell_path(path)
    res = _run(ctx, f'f={quoted}; {_check_file()}echo "{_MARK} ok $(wc -c < "$f")"', deadline=deadline)
    head, _ = _header(res.output)
    if head[:1] == ["err"]:
        return {"error": _CHECK_ERRORS[head[1]].format(path=path, size="?")}
    if head[:1] != ["ok"]:
        return _failure("read", res)
    size = int(head[1])
    if size > max_bytes:
        return {"error": f"{path} is too large for this tool ({size} bytes, limit {max_bytes})"}
    parts: list[bytes] = []
    got, chunk = 0, _chunk_bytes(ctx)
    while got < size:
        # dd's skip counts blocks; chunk sizes are powers of two so halving keeps offsets aligned.
        res = _run(
            ctx,
            f"dd if={quoted} bs={chunk} skip={got // chunk} count=1 2>/dev/null | base64",
            deadline=deadline,
        )
        if res.timed_out:
            return _failure("read", res)
        if res.truncated and chunk > 512:
            chunk //= 2
            continue
        try:
            piece = base64.b64decode("".join(res.output.split()), validate=True)
        except binascii.Error:
            return _failure("read", res)
        if not piece:
            return {"error": f"{path} changed while it was read (expected {size} bytes, got {got})"}
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def patch(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    path = _require_path(args)
    old, new = args["old_string"], args["new_string"]
    replace_all = bool(_opt(args, "replace_all", False))
    if not old:
        raise ToolArgumentError("old_string must not be empty; use write_file to create or overwrite a file")
    if old == new:
        raise ToolArgumentError("old_string and new_string are identical; nothing to change")
    deadline = time.monotonic() + ctx.tool_timeout_s  # reading and writing back, together
    data = read_bytes(ctx, path, deadline=deadline)
    if isinstance(data, dict):
        return data
    # Work on bytes so that a file with invalid UTF-8 elsewhere keeps those bytes exactly.
    old_b, new_b = old.encode("utf-8", errors="replace"), new.encode("utf-8", errors="replace")
    count = data.count(old_b)
    if count == 0:
        return {
            "error": f"old_string not found in {path}. It must match the file exactly, including "
            "whitespace and indentation; read the file again and copy the text."
        }
    if count > 1 and not replace_all:
        return {
            "error": f"old_string found {count} times in {path}. Include more surrounding lines to make "
            "it unique, or set replace_all=true to replace every occurrence."
        }
    # The result is checked before it is made: 4 MB of "a" with replace_all to 100 bytes each
    # took 1.5 GB of the worker's memory, and a longer new_string any amount.
    size = len(data) + count * (len(new_b) - len(old_b))
    if size > MAX_PATCH_BYTES:
        return {
            "error": f"the patched {path} would be {size} bytes, more than this tool's limit ({MAX_PATCH_BYTES})"
        }
    patched = data.replace(old_b, new_b)
    written = _write_bytes(ctx, path, patched, make_parents=False, deadline=deadline)
    if isinstance(written, dict):
        return written
    return {"replacements": count, "path": path, "diff": _diff(data, patched, path)}


def _diff(before: bytes, after: bytes, path: str) -> str:
    """A unified diff of the change, of at most MAX_DIFF_CHARS.

    difflib's time grows with the square of the lines it compares: a replace_all changing every
    other line of 200,000 kept the worker's CPU for many minutes, past any timeout. So only the
    lines between the first and the last change are given to it (line numbers shifted back), and
    of those at most MAX_DIFF_LINES, more than the shown diff can hold."""
    a = before.decode("utf-8", errors="replace").splitlines(keepends=True)
    b = after.decode("utf-8", errors="replace").splitlines(keepends=True)
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    start = max(head - 2, 0)  # the two lines of context difflib would show (n=2)
    a_end, b_end = min(len(a) - tail + 2, len(a)), min(len(b) - tail + 2, len(b))
    cut = max(a_end, b_end) - start > MAX_DIFF_LINES
    if cut:
        a_end, b_end = min(a_end, start + MAX_DIFF_LINES), min(b_end, start + MAX_DIFF_LINES)
    lines = difflib.unified_diff(
        a[start:a_end], b[start:b_end], fromfile=f"a/{path}", tofile=f"b/{path}", n=2
    )
    text = "".join(_shift_hunk(line, start) if line.endswith("\n") else line + "\n" for line in lines)
    if cut:
        text += f"[diff cut: only {MAX_DIFF_LINES} lines from the first change were compared]\n"
    if len(text) > MAX_DIFF_CHARS:
        text = text[:MAX_DIFF_CHARS] + f"\n[diff truncated: {len(text)} chars]"
    return text


_HUNK = re.compile(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@\n")


def _shift_hunk(line: str, by: int) -> str:
    """A hunk header of a diff of lines from ``by`` on, numbered as in the whole file."""
    m = _HUNK.fullmatch(line)
    if not m or not by:
        return line
    return f"@@ -{int(m[1]) + by}{m[2] or ''} +{int(m[3]) + by}{m[4] or ''} @@\n"


# ----------------------------------------------------------------------------- search_files

# Prints the first n input lines (cut at w bytes) within b bytes, then "@@BR end <total> <shown>".
_LIMIT_AWK = r"""
{
    total++
    if (total <= n && !full) {
        line = $0
        if (length(line) > w) line = substr(line, 1, w) "..."
        if (used + length(line) + 1 > b) { full = 1 } else { print line; used += length(line) + 1; shown++ }
    }
}
END { printf "@@BR end %d %d\n", total, shown }
"""

_MATCH_LINE = re.compile(r"^(.*?):(\d+):(.*)$", re.DOTALL)


def search_files(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    pattern = args["pattern"]
    target = _opt(args, "target", "content")
    root = _opt(args, "path", ".") or "."
    file_glob = args.get("file_glob")
    limit = _opt(args, "limit", 50)
    if not pattern:
        raise ToolArgumentError("pattern must not be empty")
    if "\0" in pattern or "\0" in root or "\0" in (file_glob or ""):
        raise ToolArgumentError("pattern, path and file_glob must not contain a NUL character")
    if target not in ("content", "files"):
        raise ToolArgumentError(f"target must be 'content' or 'files', got {target!r}")
    if not 1 <= limit <= MAX_SEARCH_LIMIT:
        raise ToolArgumentError(f"limit must be between 1 and {MAX_SEARCH_LIMIT}")
    qpat = shlex.quote(pattern)
    walk = 'find "$p" -name .git -prune -o -type f'
    limit_awk = (
        f"LC_ALL=C awk -v n={limit} -v w={MAX_MATCH_CHARS} -v b={_budget(ctx)} {shlex.quote(_LIMIT_AWK)}"
    )
    check = f'p={shell_path(root)}; if [ ! -e "$p" ]; then echo "{_MARK} err not_found"; exit 0; fi; '
    if target == "files":
        test = (
            f"-path {shlex.quote(pattern if pattern.startswith('*') else '*' + pattern)}"
            if "/" in pattern
            else f"-name {qpat}"
        )
        command = f'{check}echo "{_MARK} ok"; {walk} {test} -print 2>/dev/null | LC_ALL=C sort | {limit_awk}'
    else:
        name = f" -name {shlex.quote(file_glob)}" if file_glob else ""
        grep = f"grep -nHE -e {qpat}"
        command = (
            f"{check}"
            f"echo x | grep -E -e {qpat} >/dev/null 2>&1; "
            f'if [ $? -eq 2 ]; then echo "{_MARK} err bad_regex"; echo x | grep -E -e {qpat}; exit 0; fi; '
            f'echo "{_MARK} ok"; '
            # GNU grep -I skips binary files; busybox accepts -I but ignores it, so check each hit there.
            f"if printf 'x\\000\\n' | grep -I -e x >/dev/null 2>&1; then "
            f"{walk}{name} -exec grep -lE -e {qpat} {{}} + 2>/dev/null | while IFS= read -r f; do "
            f'if ! {_is_binary_test()}; then {grep} "$f" 2>/dev/null; fi; done; '
            f"else {walk}{name} -exec {grep} -I {{}} + 2>/dev/null; fi | {limit_awk}"
        )
    res = _run(ctx, command)
    head, lines = _header(res.output)
    if head[:2] == ["err", "not_found"]:
        return {"error": f"Path not found: {root}"}
    if head[:2] == ["err", "bad_regex"]:
        detail = " ".join(line.strip() for line in lines if line.strip())
        return {"error": f"Invalid regular expression {pattern!r} (POSIX extended regex expected): {detail}"}
    trailer = lines[-2].split() if len(lines) >= 2 and lines[-1] == "" else []
    if head[:1] != ["ok"] or trailer[:2] != [_MARK, "end"] or res.truncated:
        return _failure("search_files", res)
    total, shown = int(trailer[2]), int(trailer[3])
    found = lines[:-2]
    strip = "./" if root in (".", "./") else ""
    matches: list[Any] = []
    for line in found:
        if strip and line.startswith(strip):
            line = line[len(strip) :]
        if target == "files":
            matches.append(line)
            continue
        m = _MATCH_LINE.match(line)
        if m:
            matches.append({"path": m.group(1), "line": int(m.group(2)), "text": m.group(3)})
    return {"matches": matches, "total": total, "truncated": shown < total}


# ----------------------------------------------------------------------------- registration

_PATH_DOC = (
    "Path of the file; relative paths are resolved against the working directory, ~ is the home directory."
)

register(
    Tool(
        name="read_file",
        toolset="file",
        description=(
            "Read a text file and return its lines numbered as 'NUMBER|line' (the numbers are not part of "
            "the file). Reads at most `limit` lines starting at line `offset` (1-based); `total_lines` "
            "tells how long the file is and `truncated` is true when more lines follow, with a hint giving "
            "the offset to continue from. Lines longer than 2000 characters are cut with a note. Binary "
            "files and directories are refused with an error. Use this instead of cat/head/sed in the "
            "terminal to look at files before editing them."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": _PATH_DOC},
                "offset": {
                    "type": "integer",
                    "description": "1-based line number to start reading from (default 1).",
                    "minimum": 1,
                },
                "limit": {
                    "type": "integer",
                    "description": "Maximum number of lines to return (default 500).",
                    "minimum": 1,
                },
            },
            "required": ["path"],
        },
        handler=read_file,
        sandbox_network=False,  # on the host, or files only
    )
)

register(
    Tool(
        name="write_file",
        toolset="file",
        description=(
            "Create a file or overwrite it completely with `content`, creating missing parent directories. "
            "The content is written exactly as given (no trailing newline is added). To change part of an "
            "existing file, prefer `patch`, which does not require repeating the whole file."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": _PATH_DOC},
                "content": {"type": "string", "description": "The complete new content of the file."},
            },
            "required": ["path", "content"],
        },
        handler=write_file,
        sandbox_network=False,  # on the host, or files only
    )
)

register(
    Tool(
        name="patch",
        toolset="file",
        description=(
            "Edit a file by exact string replacement: replace `old_string` with `new_string`. `old_string` "
            "must match the file character for character, including whitespace and indentation (copy it "
            "from read_file output without the line-number prefix). It must occur exactly once unless "
            "`replace_all` is true; include a few surrounding lines to make it unique. Returns the number "
            "of replacements and a unified diff of the change."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": _PATH_DOC},
                "old_string": {"type": "string", "description": "Exact text to find in the file."},
                "new_string": {"type": "string", "description": "Text to put in its place (may be empty)."},
                "replace_all": {
                    "type": "boolean",
                    "description": "Replace every occurrence instead of requiring exactly one (default false).",
                },
            },
            "required": ["path", "old_string", "new_string"],
        },
        handler=patch,
        sandbox_network=False,  # on the host, or files only
    )
)

register(
    Tool(
        name="search_files",
        toolset="file",
        description=(
            "Search under a directory. With target='content' (default), `pattern` is a POSIX extended "
            "regular expression (grep -E syntax: use [0-9] or [[:space:]], not \\d or \\s) matched against "
            "each line of every text file; returns matches as {path, line, text}. Binary files and .git "
            "directories are skipped. `file_glob` (e.g. '*.py') restricts which files are searched. With "
            "target='files', `pattern` is a glob matched against file names (e.g. '*.md', 'config*'; a "
            "pattern containing '/' is matched against the whole path) and the matching file paths are "
            "returned, sorted. At most `limit` results are returned; `total` counts them all and "
            "`truncated` says whether some were left out."
        ),
        parameters={
            "type": "object",
            "properties": {
                "pattern": {
                    "type": "string",
                    "description": "Regex for content search, or file-name glob for target='files'.",
                },
                "target": {
                    "type": "string",
                    "enum": ["content", "files"],
                    "description": "'content' to search inside files (default), 'files' to find files by name.",
                },
                "path": {
                    "type": "string",
                    "description": "Directory (or single file) to search; default '.', the working directory.",
                },
                "file_glob": {
                    "type": "string",
                    "description": "Only search files whose name matches this glob, e.g. '*.py' (content search).",
                },
                "limit": {
                    "type": "integer",
                    "description": f"Maximum number of results to return (default 50, at most {MAX_SEARCH_LIMIT}).",
                    "minimum": 1,
                },
            },
            "required": ["pattern"],
        },
        handler=search_files,
        sandbox_network=False,  # on the host, or files only
    )
)
