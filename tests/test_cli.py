"""The command line: the CLI as a subprocess, flag validation, and the catalogue of bad dataset input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_jsonl

import batch_runner
from batchrun.prompt.llm import PROVIDER_SORTS, REASONING_EFFORTS
from batchrun.sharegpt import first_human
from toolset_distributions import DISTRIBUTIONS

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "batch_runner.py")


def cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


# ----------------------------------------------------------------------------- the CLI as a subprocess


def test_list_distributions_prints_all_17_with_descriptions_and_probabilities(tmp_path):
    done = cli("--list_distributions", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert len(DISTRIBUTIONS) == 17
    blocks = {b.splitlines()[0].split(":", 1)[0]: b for b in done.stdout.strip().split("\n\n")}
    assert list(blocks) == list(DISTRIBUTIONS)
    for name, dist in DISTRIBUTIONS.items():
        lines = blocks[name].splitlines()
        assert lines[0] == f"{name}: {dist.description}"
        shown = {ln.split()[0]: ln.split()[1] for ln in lines[1:]}
        assert shown == {t: f"{p}%" for t, p in dist.probabilities.items()}
    assert not (tmp_path / "data").exists()


def test_cli_run_against_an_endpoint(server, tmp_path):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text(
        "".join(
            json.dumps({"prompt": p}) + "\n"
            for p in ["cli one", "cli two [calls:1]", "cli three [scratchpad]"]
        ),
        "utf-8",
    )
    done = cli(
        "--dataset_file=prompts.jsonl",
        "--batch_size=2",
        "--run_name=cli_run",
        "--model=vendor/some-model",
        f"--base_url={server.base_url}",
        "--api_key=sk-cli-SECRET-424242",
        "--num_workers=2",
        "--distribution=terminal_only",
        "--providers_allowed=a,b",
        "--provider_sort=price",
        "--reasoning_effort=high",
        "--max_tokens=123",
        "--endpoint_dialect=openrouter",  # a local address, spoken to as OpenRouter (e.g. a proxy)
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "data" / "cli_run"  # relative to the working directory
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in records) == [
        "cli one",
        "cli three [scratchpad]",
        "cli two [calls:1]",
    ]
    assert {r["metadata"]["model"] for r in records} == {"vendor/some-model"}
    req = server.stats()["last_requests"][-1]
    assert req["model"] == "vendor/some-model"
    assert req["provider"] == {"only": ["a", "b"], "sort": "price"}
    assert req["reasoning"] == {"enabled": True, "effort": "high"}
    assert req["max_tokens"] == 123
    assert "3 trajectories" in done.stdout
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert b"sk-cli-SECRET-424242" not in path.read_bytes(), path.name
    assert "sk-cli-SECRET-424242" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "key_args",
    [
        ["--api_key=sk-cli-SECRET-777777"],
        ["--api_key", "sk-cli-SECRET-777777"],
    ],
    ids=["equals", "separate"],
)
def test_cli_resume_hint_does_not_print_the_api_key(server, tmp_path, key_args):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text(
        json.dumps({"prompt": "ok [calls:0]"}) + "\n" + json.dumps({"prompt": "down [error:503]"}) + "\n"
    )
    done = cli(
        "--dataset_file=prompts.jsonl",
        "--batch_size=2",
        "--run_name=hint",
        "--model=m",
        f"--base_url={server.base_url}",
        *key_args,
        "--num_workers=2",
        "--distribution=terminal_only",
        "--max_retries=0",
        "--max_failure_rate=1",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "--resume" in done.stdout  # the hint is printed
    assert "sk-cli-SECRET-777777" not in done.stdout + done.stderr
    for path in (tmp_path / "data").rglob("*"):
        if path.is_file():
            assert b"sk-cli-SECRET-777777" not in path.read_bytes(), path.name


def test_cli_mock_model_needs_no_key_and_no_network(tmp_path, monkeypatch):
    for var in ("OPENROUTER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "p.jsonl").write_text('{"prompt": "mock one"}\n{"prompt": "mock two [scratchpad]"}\n')
    done = cli(
        "--dataset_file=p.jsonl",
        "--batch_size=1",
        "--run_name=m",
        "--model=mock",
        "--num_workers=2",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    records = read_jsonl(tmp_path / "data" / "m" / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in records) == ["mock one", "mock two [scratchpad]"]


def test_an_output_dir_under_tilde_is_the_home_directory_the_check_approved(tmp_path, monkeypatch):
    # The shell leaves "~" in --output_dir=~/runs; the check read it as $HOME/runs, and the run then wrote
    # to ./~/runs/<run_name>, a directory named "~" that "rm -rf ~" would take for the home directory.
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (work / "p.jsonl").write_text('{"prompt": "mock one"}\n')
    done = cli(
        "--dataset_file=p.jsonl", "--batch_size=1", "--run_name=m", "--model=mock",
        "--num_workers=1", "--output_dir=~/runs", cwd=work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(read_jsonl(home / "runs" / "m" / "trajectories.jsonl")) == 1
    assert not (work / "~").exists()


def _nofile(soft: int, hard: int | None = None):
    """A preexec_fn giving the child ``ulimit -Sn soft`` (and ``-Hn hard``)."""
    import resource

    def limit() -> None:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard is None else hard),
        )

    return limit


def _run_many(tmp_path: Path, n: int, preexec) -> subprocess.CompletedProcess:
    (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "task {i} [slow:1]"}}\n' for i in range(n)))
    return subprocess.run(
        [sys.executable, SCRIPT, "--dataset_file=p.jsonl", f"--batch_size={n}", "--run_name=m", "--model=mock",
         "--distribution=terminal_only", "--num_workers=1", f"--prompts_per_worker={n}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, preexec_fn=preexec,
    )  # fmt: skip


def test_a_low_soft_open_files_limit_is_raised_for_the_prompts_in_flight(tmp_path):
    # Under a soft limit of 1,024 (most systems' default; the hard one 20,000), 66 of 300 prompts in
    # flight failed mid-run with "Too many open files", each after a paid model call. Here 256 and 80.
    done = _run_many(tmp_path, 80, _nofile(256))
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_jsonl(tmp_path / "data" / "m" / "trajectories.jsonl")
    assert len(records) == 80
    assert read_jsonl(tmp_path / "data" / "m" / "failed.jsonl") == []


def test_prompts_in_flight_past_the_hard_open_files_limit_exit_2_naming_the_flag(tmp_path):
    done = _run_many(tmp_path, 80, _nofile(256, 256))
    assert done.returncode == 2
    assert "--prompts_per_worker=80 needs about" in done.stderr
    assert "ulimit -Hn" in done.stderr and "(to at most 24;" in done.stderr
    assert not (tmp_path / "data" / "m").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch_size=2", "--run_name=x"], "--dataset_file is required"),
        (
            ["--dataset_file=p.jsonl", "--batch_size=0", "--run_name=x"],
            "--batch_size must be a positive integer",
        ),
    ],
)
def test_cli_usage_errors_exit_2_without_traceback(tmp_path, args, message):
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    done = cli(*args, "--base_url=http://127.0.0.1:9/v1", "--api_key=k", cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (
            f"--container_cpus={(os.cpu_count() or 1) * 32}",
            "--container_cpus must be at most the",
        ),
        (
            "--container_disk_mb=10000000",
            "--container_memory_mb + --container_disk_mb (10002048 MB) must be at most",
        ),
    ],
    ids=["cpus", "disk"],
)
def test_cli_local_limits_the_machine_cannot_give_exit_2_before_any_run_directory(tmp_path, flag, message):
    """The local sandbox took --container_cpus=64 on 2 cores (a quota that never binds) and a tmpfs size
    past the machine's memory (its files are RAM, charged with the processes): both ran, exit 0."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    done = cli(
        "--dataset_file=p.jsonl", "--batch_size=1", "--run_name=x", "--model=mock", "--sandbox=local", flag,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.skipif(not shutil.which("taskset"), reason="needs taskset (util-linux)")
@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--num_workers=17", "--num_workers=17 is more worker processes than the 1 CPUs this run may use"),
        ("--container_cpus=2", "--container_cpus must be at most the 1 CPUs this run may use"),
    ],
    ids=["workers", "cpus"],
)
def test_a_runner_confined_to_one_cpu_plans_by_that_cpu(tmp_path, flag, message):
    """Under ``taskset -c 0`` (a container's cpuset, a CI runner) the bounds counted the machine's cores
    (os.cpu_count), so 17 workers or a 2-core quota passed on one usable core."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    args = [
        "--dataset_file=p.jsonl",
        "--batch_size=1",
        "--run_name=x",
        "--model=mock",
        "--sandbox=local",
        flag,
    ]
    done = subprocess.run(
        ["taskset", "-c", "0", sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


# ----------------------------------------------------------------------------- flag validation in-process


def _main(tmp_path: Path, **kw) -> None:
    args = dict(
        dataset_file=str(tmp_path / "p.jsonl"),
        batch_size=2,
        run_name="run",
        base_url="http://127.0.0.1:9/v1",
        api_key="k",
        output_dir=str(tmp_path / "data"),
        num_workers=2,
        distribution="terminal_only",
    )
    args.update(kw)
    code = batch_runner.main(**args)  # returns the exit code when called from Python
    if code:
        raise SystemExit(code)


def _usage_error(tmp_path: Path, capsys, **kw) -> str:
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit) as info:
        _main(tmp_path, **kw)
    assert info.value.code == 2
    assert not (tmp_path / "data" / "run").exists()
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    return err


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"dataset_file": None}, "--dataset_file is required"),
        ({"batch_size": None}, "--batch_size must be a positive integer"),
        ({"batch_size": 0}, "--batch_size must be a positive integer, got 0"),
        ({"batch_size": -3}, "--batch_size must be a positive integer, got -3"),
        ({"batch_size": "ten"}, "--batch_size must be a positive integer"),
        ({"num_workers": 0}, "--num_workers must be a positive integer"),
        ({"max_turns": 0}, "--max_turns must be a positive integer"),
        ({"run_name": None}, "--run_name is required"),
        ({"run_name": "../escape"}, "--run_name"),
    ],
)
def test_usage_errors(tmp_path, capsys, kw, message):
    assert message in _usage_error(tmp_path, capsys, **kw)


def test_unknown_distribution_lists_the_valid_ones(tmp_path, capsys):
    err = _usage_error(tmp_path, capsys, distribution="everything")
    assert "'everything'" in err
    for name in DISTRIBUTIONS:
        assert name in err


@pytest.mark.parametrize(("typo", "meant"), [("terminal_onyl", "terminal_only"), ("Default", "default")])
def test_a_mistyped_distribution_names_the_close_one_first(tmp_path, capsys, typo, meant):
    """The message listed all 17 names and left the reader to spot the one meant."""
    err = _usage_error(tmp_path, capsys, distribution=typo)
    assert f"unknown toolset distribution {typo!r} (did you mean {meant!r}" in err


def test_a_distribution_with_no_available_toolset_is_refused_before_any_request(
    tmp_path, capsys, clean_tool_env, server
):
    """`minimal` is web only: without a search provider its prompts would run without tools."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit) as info:
        _main(tmp_path, distribution="minimal", base_url=server.base_url)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "no toolset of distribution 'minimal' is available" in err
    assert "WEB_SEARCH_PROVIDER" in err
    assert server.stats()["requests"] == 0
    _main(tmp_path, distribution="terminal_only", base_url=server.base_url, model="mock")  # the name is free


def test_unknown_reasoning_effort_lists_the_valid_ones(tmp_path, capsys):
    err = _usage_error(tmp_path, capsys, reasoning_effort="extreme")
    assert "--reasoning_effort" in err and "'extreme'" in err
    for effort in REASONING_EFFORTS:
        assert effort in err


def test_unknown_provider_sort_lists_the_valid_ones(tmp_path, capsys):
    err = _usage_error(tmp_path, capsys, provider_sort="cheapest")
    for sort in PROVIDER_SORTS:
        assert sort in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),  # no such file
        ("[{", "not valid JSON"),
        ('{"role": "user", "content": "hi"}', "expected a JSON array"),
        ('[{"content": "no role"}]', "message 0 must be"),
        ('[{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}]', "message 1 must be"),
        ('[{"role": "user", "content": 5}]', "message 0 must be"),
    ],
)
def test_bad_prefill_file(tmp_path, capsys, content, message):
    path = tmp_path / "prefill.json"
    if content is not None:
        path.write_text(content)
    err = _usage_error(tmp_path, capsys, prefill_messages_file=str(path))
    assert "--prefill_messages_file" in err and str(path) in err
    assert message in err


def test_prefill_file_that_is_a_directory(tmp_path, capsys):
    err = _usage_error(tmp_path, capsys, prefill_messages_file=str(tmp_path))
    assert "--prefill_messages_file" in err and "cannot read" in err


def test_existing_run_needs_resume_and_same_settings(server, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"prompt": "only one [calls:0]"}\n')
    _main(tmp_path, base_url=server.base_url, model="model-a")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        _main(tmp_path, base_url=server.base_url, model="model-a")
    assert info.value.code == 2
    assert "--resume" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        _main(tmp_path, base_url=server.base_url, model="model-b", resume=True)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "model" in err and "--force_resume" in err
    total = server.stats()["requests"]
    _main(tmp_path, base_url=server.base_url, model="model-b", resume=True, force_resume=True)
    assert "changed settings" in capsys.readouterr().err
    assert server.stats()["requests"] == total  # forced, but nothing left to do


# ----------------------------------------------------------------------------- bad dataset input


def test_bad_dataset_lines_are_reported_by_number_and_skipped(server, tmp_path, capsys):
    long_prompt = "Long prompt " + "y" * 100_000 + " [calls:0]"
    lines = [
        b"\xef\xbb\xbf" + json.dumps({"prompt": "bom on the first line [calls:0]"}).encode(),  # 1 ok
        json.dumps({"prompt": "Привет, мир 🌍 ünïcödé [calls:0]"}, ensure_ascii=False).encode(),  # 2 ok
        b'{"prompt": "unterminated',  # 3 invalid JSON
        json.dumps({"text": "no prompt field"}).encode(),  # 4
        json.dumps({"prompt": 42}).encode(),  # 5
        json.dumps({"prompt": ""}).encode(),  # 6
        json.dumps({"prompt": "   "}).encode(),  # 7
        b"\xff\xfe\x00\x01binary\x80garbage\x00",  # 8
        b"[1, 2, 3]",  # 9
        json.dumps({"prompt": None}).encode(),  # 10
        b"",  # 11 blank: ignored
        json.dumps({"prompt": long_prompt}).encode(),  # 12 ok
        json.dumps({"prompt": "crlf ending [calls:0]"}).encode() + b"\r",  # 13 ok
        json.dumps({"prompt": "extra fields [calls:0]", "source": {"id": 7}}).encode(),  # 14 ok
        json.dumps({"prompt": "relative cwd", "cwd": "relative/dir"}).encode(),  # 15
        json.dumps({"prompt": "bad image", "image": 5}).encode(),  # 16
        json.dumps({"prompt": "bad cwd type", "cwd": ["/tmp"]}).encode(),  # 17
    ]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    _main(tmp_path, base_url=server.base_url, max_failure_rate=1.0)
    err = capsys.readouterr().err
    bad = [3, 4, 5, 6, 7, 8, 9, 10, 15, 16, 17]
    for n in bad:
        assert f"{path}:{n}:" in err, n
    for n in (1, 2, 11, 12, 13, 14):
        assert f"{path}:{n}:" not in err, n
    assert "not UTF-8" in err and "invalid JSON" in err and "'prompt' is missing" in err
    assert "must be a string" in err and "is empty" in err
    assert "'cwd' must be an absolute path" in err and "'image'" in err

    records = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    humans = {first_human(r["conversations"]): r["prompt_index"] for r in records}
    assert humans == {
        "bom on the first line [calls:0]": 0,
        "Привет, мир 🌍 ünïcödé [calls:0]": 1,
        long_prompt: 11,
        "crlf ending [calls:0]": 12,
        "extra fields [calls:0]": 13,
    }
    assert server.stats()["requests_by_prompt"][long_prompt] == 1
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text("utf-8"))
    assert stats["this_run"]["bad_dataset_lines"] == len(bad)
    assert stats["dataset_prompts"] == 5


def test_lone_surrogate_prompt_is_reported_not_fatal(server, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine [calls:0]"}\n{"prompt": "broken \\ud800 text"}\n', encoding="ascii")
    _main(tmp_path, base_url=server.base_url)
    assert f"{path}:2:" in capsys.readouterr().err
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, ": not found"),
        ("dir", ": a directory"),
        (b"", "no usable rows"),
        (b"\n\n  \n", "no usable rows"),
        (b'{"oops": 1}\nnot json\n', ":1: field 'prompt' is missing"),
    ],
)
def test_unusable_dataset_is_a_clear_usage_error(tmp_path, capsys, content, message):
    path = tmp_path / "d.jsonl"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as info:
        _main(tmp_path, dataset_file=str(path))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err
    assert not (tmp_path / "data" / "run").exists()


def _cgroup_dir(controller: str) -> Path | None:
    """This process's own cgroup directory of ``controller`` (v1 hierarchy or v2)."""
    from batchrun.prompt.sandboxes.base import own_cgroup_dir

    own = own_cgroup_dir(controller)
    return Path(own[0]) if own is not None else None


CGROUP_LIMITS = {  # controller -> (its limit's file: v1's name, then v2's; the test's value)
    "memory": (("memory.limit_in_bytes", "memory.max"), str(768 << 20)),
    "pids": (("pids.max",), "400"),
    "cpu": (("cpu.cfs_quota_us", "cpu.max"), None),  # one core: written as each version takes it
}


@pytest.mark.parametrize(
    ("controllers", "flag", "message"),
    [
        (
            ("memory", "pids"),
            "--container_memory_mb=1024 --container_pids_limit=300",
            "--container_memory_mb must be at most this machine's memory (768 MB",
        ),
        (
            ("memory", "pids"),
            "--container_pids_limit=500",
            "--container_pids_limit must be at most the processes this machine allows the runner (400",
        ),
        (("cpu",), "--container_cpus=2", "--container_cpus must be at most the 1 CPUs this run may use"),
    ],
    ids=["memory", "pids", "cpu"],
)
def test_a_runner_in_a_smaller_cgroup_checks_the_sizes_against_that_cgroup(
    tmp_path, controllers, flag, message
):
    """A runner in a container or a CI job with 768 MB and 400 processes took a 1 GB sandbox and 500
    processes (checked against the machine's memory and kernel.pid_max), which its cgroup never gives;
    and one held to a core's worth of CPU time plans by that core."""
    import uuid

    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups")
    made: list[Path] = []  # one per hierarchy (v1: each controller apart; v2: one)
    try:
        for controller in controllers:
            names, value = CGROUP_LIMITS[controller]
            base = _cgroup_dir(controller)
            if base is None:
                pytest.skip(f"no cgroup hierarchy with {controller}")
            child = next((c for c in made if c.parent == base), None)
            if child is None:
                child = base / f"br-test-{uuid.uuid4().hex[:8]}"
                try:
                    child.mkdir()
                except OSError as exc:
                    pytest.skip(f"cannot make a cgroup here: {exc}")
                made.append(child)
            limit = next((child / n for n in names if (child / n).exists()), None)
            if limit is None:
                pytest.skip(f"the {controller} controller is not enabled for {base}'s children")
            if controller == "cpu":  # one core: a quota of one period
                value = "100000" if limit.name == "cpu.cfs_quota_us" else "100000 100000"
                if limit.name == "cpu.cfs_quota_us":
                    (child / "cpu.cfs_period_us").write_text("100000")
            limit.write_text(value)
        (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
        procs = sorted({str(c / "cgroup.procs") for c in made})

        def enter() -> None:
            for path in procs:
                with open(path, "w") as f:
                    f.write(str(os.getpid()))

        args = ["--dataset_file=p.jsonl", "--batch_size=1", "--run_name=x", "--model=mock", "--sandbox=local"]
        args += flag.split()
        done = subprocess.run(
            [sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
            preexec_fn=enter,
        )  # fmt: skip
    finally:
        for child in made:
            with open(child / "cgroup.procs") as f:
                assert not f.read().strip()
            child.rmdir()
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_command_is_still_importing_ends_it_as_interrupted(tmp_path, sig):
    """SIGTERM or Ctrl-C in the first ~0.15 s (the imports and the forkserver's start, before the command
    line's own handler) killed the runner by the signal (143, or -2) instead of the 130 the README
    promises at any moment. The import of the forkserver's module is held here until the signal comes."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    shim = f"""
import runpy, sys, time
class Hold:
    def find_spec(self, name, path, target=None):
        if name == "batchrun.run.forkserver":
            print("importing", flush=True)
            time.sleep(60)
        return None
sys.meta_path.insert(0, Hold())
sys.argv = [{SCRIPT!r}, "--dataset_file=p.jsonl", "--batch_size=1", "--run_name=x", "--model=mock"]
runpy.run_path({SCRIPT!r}, run_name="__main__")
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", shim], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "importing\n"
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, proc.stderr.read()
    assert not (tmp_path / "data").exists()
