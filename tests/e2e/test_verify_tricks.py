"""What the agent leaves in its sandbox must not make a hidden test's verdict other than its work's: the
tricks a red-team audit found, played by the fake model against the local sandbox, each judged as the
same wrong work without the trick is (a scorer error for a test that printed no credit and exited 0)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from helpers import read_jsonl, run, write_rows


def _commands(script: str) -> str:
    """A fake-model directive that runs ``script`` in the terminal (its own text may hold ``]``)."""
    return f"[run:echo {base64.b64encode(script.encode()).decode()} | base64 -d | sh]"


# Two cases of add.sh, the share right printed as its credit: the agent's add.sh says 7 whatever it is
# given, right for 3 + 4 only (0.5; exit 0, so passed, with half credit).
CREDIT_TEST = """ok=0
[ "$(sh add.sh 2 3)" = 5 ] && ok=$((ok + 1))
[ "$(sh add.sh 3 4)" = 7 ] && ok=$((ok + 1))
echo "{\\"score\\": $(awk "BEGIN {print $ok / 2}")}"
"""
WRONG = "printf 'echo 7\\n' > add.sh"


def _row(row_id: str, trick: str) -> dict:
    return {
        "id": row_id,
        "prompt": f"Write add.sh {_commands(WRONG + '; ' + trick if trick else WRONG)}",
        "verify": "sh tests/credit.sh",
        "verify_files": {"tests/credit.sh": CREDIT_TEST},
    }


def test_a_full_tmp_or_a_flood_of_stderr_does_not_hide_the_tests_credit_line(tmp_path: Path):
    """The sandbox's note "[batch-runner: /tmp is full ...]", appended after a command's output, was the
    verify's last line when the agent had filled /tmp: no credit line was read, and the test's exit 0 read
    as full credit (1 of 2 right: 1.0, not 0.5). Output past the cap kept its start only: the agent's
    add.sh writing 70 KB to stderr pushed the test's credit line out, the same way; and one byte on stderr
    without a line break made the credit line "x{...}", no credit line either. Now the credit line is read
    before the sandbox's notes, a capped output keeps its end, and a last line ending with the credit
    object counts."""
    rows = [
        _row("plain", ""),
        _row("fill-tmp", "dd if=/dev/zero of=/tmp/fill bs=64k 2>/dev/null; df /tmp | tail -1"),
        # 70 KB on stderr, then a line break: past the cap, the credit line after it was cut off.
        _row("flood", "printf 'head -c 70000 /dev/zero | tr \\\\\\\\0 x >&2; echo >&2\\necho 7\\n' > add.sh"),
        # A byte on stderr and no line break: the test's credit line began with it, and read as none.
        _row("glued", "printf 'printf x >&2\\necho 7\\n' > add.sh"),
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out, container_disk_mb=64)
    scores = {r["metadata"]["row_id"]: r["score"] for r in read_jsonl(out / "run" / "trajectories.jsonl")}
    for row_id in ("plain", "fill-tmp", "flood", "glued"):
        score = scores[row_id]
        assert (score["passed"], score["value"]) == (True, 0.5), (row_id, score)
        own = score["verify_output"].split("\n[batch-runner: /tmp is full")[0].rstrip()  # the note after it
        assert own.endswith('{"score": 0.5}'), (row_id, score)
    assert "/tmp is full" in scores["fill-tmp"]["verify_output"], scores["fill-tmp"]
    assert scores["flood"]["verify_output"].startswith("[...cut...]\n"), scores["flood"]["verify_output"][
        :100
    ]


ADD_CHECK = "import subprocess\n\ndef check():\n    out = subprocess.run(['sh', 'add.sh', '2', '3'], capture_output=True, text=True).stdout\n    return out.strip() == '5'\n"
RUN_CHECK = "import os, sys\nsys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\nimport checks\nsys.exit(0 if checks.check() else 1)\n"
PLANT_PYC = (
    "mkdir -p tests; printf 'def check():\\n    return True\\n' > /tmp/f.py; python3 -c \""
    "import py_compile, importlib.util; py_compile.compile('/tmp/f.py', "
    "cfile=importlib.util.cache_from_source('tests/checks.py'), "
    'invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"'
)
PLANT_PACKAGE = "mkdir -p tests/checks; printf 'def check():\\n    return True\\n' > tests/checks/__init__.py"


def test_what_the_agent_compiled_or_made_beside_a_hidden_module_is_not_imported_in_its_place(tmp_path: Path):
    """A hidden test's own module (tests/checks.py, imported by the hidden tests/run.py) was shadowed by
    what the agent left beside it: an unchecked-hash tests/__pycache__/checks.*.pyc, which Python loads
    without looking at the source (even under python3 -I), or a package tests/checks/. Its
    `def check(): return True` ran as the hidden test's, and add.sh saying 7 for 2 + 3 passed. They are
    removed when the hidden files are written; the wrong work fails as it does without them."""
    rows = [
        {
            "id": row_id,
            "prompt": f"Write add.sh {_commands(WRONG + '; ' + trick if trick else WRONG)}",
            "verify": "python3 -I tests/run.py",
            "verify_files": {"tests/run.py": RUN_CHECK, "tests/checks.py": ADD_CHECK},
        }
        for row_id, trick in (("plain", ""), ("pyc", PLANT_PYC), ("package", PLANT_PACKAGE))
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    scores = {r["metadata"]["row_id"]: r["score"] for r in read_jsonl(out / "run" / "trajectories.jsonl")}
    for row_id in ("plain", "pyc", "package"):
        score = scores[row_id]
        assert (score["passed"], score["verify_exit_code"]) == (False, 1), (row_id, score)


def test_a_scorers_read_file_is_the_whole_file_or_an_error(tmp_path: Path):
    """``sandbox.read_file`` was ``cat`` through a command's output: a file over the output cap came back
    cut (start and end, a note between), and a scorer looking for "FAIL" in the agent's 200 KB report
    passed it; with /tmp full, the sandbox's note was appended to the file's text; a FIFO or a link to
    /dev/zero waited out the timeout. Now the whole file, byte for byte, or an error at once; and
    ``sandbox.run`` gives what the command printed, without the sandbox's notes."""
    from batchrun.prompt.sandboxes.base import SandboxSpec
    from batchrun.prompt.sandboxes.local import LocalSandbox
    from batchrun.scoring import SandboxHandle

    box = LocalSandbox(SandboxSpec("read", 0), isolation="bwrap", base_dir=str(tmp_path), disk_mb=8)
    box.start()
    try:
        report = "PASS\n" + "." * 100_000 + "\nFAIL case 7\n" + "é" * 50_000 + "\nend\n"
        assert box.write_direct(f"{box.workdir}/report.txt", report.encode(), make_parents=False)
        handle = SandboxHandle(box, timeout_s=30)
        assert handle.read_file("report.txt") == report
        assert handle.read_file("/tmp/../" + box.workdir.lstrip("/") + "/report.txt") == report
        assert box.run("mkfifo fifo && ln -s /dev/zero zero", timeout_s=30).exit_code == 0
        for odd in ("fifo", "zero", "."):
            with pytest.raises(OSError, match="not a regular file"):
                handle.read_file(odd)
        with pytest.raises(FileNotFoundError):
            handle.read_file("missing.txt")
        with pytest.raises(OSError, match="more than"):
            handle.read_file("report.txt", max_bytes=1000)
        # /tmp full: the note stays out of what a file and a command said.
        box.run("head -c 20000000 /dev/zero > /tmp/fill 2>/dev/null; echo done > small.txt", timeout_s=30)
        assert box.run("echo hi", timeout_s=30).output.endswith("is full: its size cap is 8 MiB]")
        assert handle.read_file("small.txt") == "done\n"
        assert handle.run("echo hi") == (0, "hi\n")
    finally:
        box.stop()


def test_what_the_agent_left_at_a_hidden_files_place_fails_its_sample_not_its_judging(tmp_path: Path):
    """A directory at a hidden file's path (the README: written "in place of whatever the agent left at
    their paths"), a file where its directory goes, or a disk the agent filled made the write fail: a
    scorer error, no verdict, so the agent could take any failing sample out of the pass rate. A directory
    or a file in the way is removed now, and a write that still fails (a full disk) fails the sample."""
    check = {"verify": "sh tests/t.sh", "verify_files": {"tests/t.sh": '[ "$(sh add.sh 2 3)" = 5 ]\n'}}
    right = "printf 'echo 5\\n' > add.sh"
    rows = [
        {"id": "honest", "prompt": f"Add {_commands(WRONG)}", **check},
        {"id": "dir", "prompt": f"Add {_commands(right + '; mkdir -p tests/t.sh/x')}", **check},
        {"id": "file", "prompt": f"Add {_commands(right + '; echo no > tests')}", **check},
        {
            "id": "fill",
            "prompt": f"Add {_commands(WRONG + '; head -c 80000000 /dev/zero > fill 2>/dev/null')}",
            **check,
        },
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out, container_disk_mb=64)
    scores = {r["metadata"]["row_id"]: r["score"] for r in read_jsonl(out / "run" / "trajectories.jsonl")}
    assert (scores["honest"]["passed"], scores["honest"]["verify_exit_code"]) == (False, 1), scores["honest"]
    assert scores["dir"]["passed"] is True and scores["file"]["passed"] is True, (
        scores
    )  # the test ran: right work
    fill = scores["fill"]
    assert (fill["passed"], fill["value"], fill["status"]) == (False, 0.0, "failed"), fill
    assert "could not be written" in fill["explanation"], fill


# The check of the audit's Docker rows: r.txt must hold 5; the agent writes 4, then replaces what the
# runner's judging ran by path in a container whose user is root.
R5_TEST = '[ "$(cat r.txt)" = 5 ] || exit 1\n'
# /sbin is a link in merged-/usr images (and in the test image): made a directory holding a docker-init
# that exits 0, which every judged exec ran (`[ -x /sbin/docker-init ] && exec /sbin/docker-init -s --`):
# the processes never ended, the hidden files never written, the verify "passed".
FAKE_DOCKER_INIT = "rm /sbin && mkdir /sbin && printf '#!/bin/sh\\nexit 0\\n' > /sbin/docker-init && chmod +x /sbin/docker-init"
# /bin/sh, which every judged command started as (`sh -c` by PATH), made a script that prints the end
# marker with exit code 0 (its token: the first line of its stdin) and exits 0.
FAKE_SH = """rm /bin/sh && cat > /bin/sh <<'FAKE'
#!/bin/busybox sh
IFS= read -r t; printf '\\n[batch-runner-exit:%s]=0\\n' "$t"; exit 0
FAKE
chmod +x /bin/sh"""


def _r5_row(row_id: str, answer: int, trick: str) -> dict:
    script = f"echo {answer} > r.txt" + (f"; {trick}" if trick else "")
    return {"id": row_id, "prompt": f"Write 5 into r.txt {_commands(script)}", "verify": "sh t.sh",
            "verify_files": {"t.sh": R5_TEST}}  # fmt: skip


@pytest.mark.docker
def test_an_agent_as_root_cannot_replace_what_judging_runs_on_the_docker_backend(
    tmp_path: Path, docker_test_image: str, capsys: pytest.CaptureFixture[str]
):
    """The runner's own judging steps run the host's static busybox and docker-init, mounted read-only
    (the agent can neither remove, rename nor write a mount point): a fake /sbin/docker-init changes
    nothing; the verify runs the image's /bin/sh, and not at all once the agent changed it (126)."""
    rows = [
        _r5_row("wrong", 4, ""),
        _r5_row("fake-init", 4, FAKE_DOCKER_INIT),
        _r5_row("fake-sh", 4, FAKE_SH),
        _r5_row("right", 5, ""),
        _r5_row("right-fake-init", 5, FAKE_DOCKER_INIT),  # the verify still runs, reaped by the real one
    ]
    rows = [{**r, "image": docker_test_image, "cwd": "/work"} for r in rows]
    out = tmp_path / "data"
    run(
        None, write_rows(tmp_path / "d.jsonl", rows), out, sandbox="docker", default_image=docker_test_image,
        verify_timeout=20,
    )  # fmt: skip
    recs = {r["metadata"]["row_id"]: r for r in read_jsonl(out / "run" / "trajectories.jsonl")}
    said = {k: (r["score"]["status"], r["score"]["verify_exit_code"]) for k, r in recs.items()}
    assert said == {
        "wrong": ("failed", 1),
        "fake-init": ("failed", 1),
        "fake-sh": ("failed", 126),
        "right": ("passed", 0),
        "right-fake-init": ("passed", 0),
    }, said
    assert "/bin/sh is not the file it was" in recs["fake-sh"]["score"]["verify_output"]
    assert "run this machine's static busybox" in capsys.readouterr().out


@pytest.mark.slow  # 25,000 names removed one by one: ~30 s
def test_names_in_a_hidden_modules_way_do_not_take_the_sample_out_of_judging(tmp_path: Path):
    """25,000 long names `test_hidden.<...>.so` the agent left made the removal of a hidden module's
    shadows one `rm` with an argument list too long (exit 126), which read as "the image lacks a tool":
    a scorer error, so the failing sample left the pass rate. Each name is removed apart now, and the test
    runs (a failure the agent caused in the write itself fails the sample; see the test above)."""
    from batchrun.prompt.sandboxes.base import SandboxSpec
    from batchrun.prompt.sandboxes.local import LocalSandbox
    from batchrun.protocol import RowCheck
    from batchrun.scoring import ScoringSettings, verify_score

    box = LocalSandbox(SandboxSpec("shadows", 0), isolation="bwrap", base_dir=str(tmp_path))
    box.start()
    try:
        make = "python3 -c \"[open(f'test_hidden.{i:0100d}.so', 'w').close() for i in range(25000)]\" && ls | wc -l"
        assert box.run(make, timeout_s=120).output.strip() == "25000"
        check = RowCheck(
            verify=("python3 -I test_hidden.py",),
            verify_files=(("test_hidden.py", "import sys; sys.exit(1)"),),
        )
        part = verify_score(box, check, ScoringSettings())
        assert (part.passed, part.value, part.error) == (False, 0.0, None), part
        assert box.run("ls | wc -l", timeout_s=60).output.strip() == "1"  # the hidden module alone
    finally:
        box.stop()
