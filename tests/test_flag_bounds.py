"""Flags that cannot fail later (issue 25): upper bounds the machine can honour, a distribution defined
twice, the ephemeral prompt kept out of ps, credentials in --base_url."""

from __future__ import annotations

import os

import pytest

# ----------------------------------------------------------------------------- issue 25: flags that cannot fail later


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("container_pids_limit", "100000000000", "--container_pids_limit must be"),
        ("container_memory_mb", str(1 << 30), "--container_memory_mb must be"),
        ("prompt_timeout", "1e11", "--prompt_timeout must be at most 604800"),
        ("max_tokens", "99999999999", "--max_tokens must be at most 10000000"),
        ("max_response_mb", "0", "--max_response_mb must be a number above 0"),
        ("num_workers", "1000", "--num_workers=1000 is more worker processes than the"),
        # URLs urllib cannot read (a traceback later, before): as bad as no URL at all.
        ("base_url", "http://[::1/v1", "--base_url must be an http:// or https:// URL"),
        ("base_url", "http://host:99999/v1", "--base_url must be an http:// or https:// URL"),
        ("base_url", "http:///v1", "--base_url must be an http:// or https:// URL"),
        ("container_cpus", str((os.cpu_count() or 1) + 1), "--container_cpus must be at most the"),
        ("container_disk_mb", str(1 << 25), "--container_memory_mb + --container_disk_mb"),
    ],
)
def test_sizes_the_machine_cannot_honour_exit_2_naming_the_flag(tmp_path, flag, value, message):
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError) as info:
        RunConfig.from_flags(
            dataset_file=str(ds),
            batch_size=1,
            run_name="r",
            output_dir=str(tmp_path),
            model="mock",
            **{flag: value},
        )
    assert message in str(info.value)


def test_a_distribution_defined_twice_in_one_file_exits_2(tmp_path):
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    dists = tmp_path / "dists.json"
    dists.write_text(
        '{"mine": {"probabilities": {"terminal": 100}}, "mine": {"probabilities": {"file": 100}}}'
    )
    with pytest.raises(UsageError) as info:
        RunConfig.from_flags(
            dataset_file=str(ds),
            batch_size=1,
            run_name="r",
            output_dir=str(tmp_path),
            model="mock",
            distribution_file=str(dists),
            distribution="mine",
        )
    assert "'mine' is defined twice" in str(info.value) and "--distribution_file" in str(info.value)


def test_the_ephemeral_prompt_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from batchrun.config import EPHEMERAL_PROMPT_ENV, RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    base = dict(dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path), model="mock")
    secret = tmp_path / "system.txt"
    secret.write_text("You are terse. (secret scaffolding)")
    config = RunConfig.from_flags(**base, ephemeral_system_prompt_file=str(secret))
    assert config.ephemeral_prompt == "You are terse. (secret scaffolding)"
    # Scaffolding: redacted from side files and logs (never saved); a sample echoing it is kept as written.
    assert "You are terse. (secret scaffolding)" in config.scaffolding_texts()
    monkeypatch.setenv(EPHEMERAL_PROMPT_ENV, "from the environment")
    with pytest.raises(UsageError, match="given twice"):
        RunConfig.from_flags(**base, ephemeral_system_prompt_file=str(secret))
    assert RunConfig.from_flags(**base).ephemeral_prompt == "from the environment"


@pytest.mark.parametrize("content", ["", " \n\t\n"])
def test_an_empty_ephemeral_prompt_file_exits_2(tmp_path, content):
    """An empty file (a redirect that failed) ran the whole dataset without the system prompt."""
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    empty = tmp_path / "system.txt"
    empty.write_text(content)
    base = dict(dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path), model="mock")
    with pytest.raises(UsageError, match=f"--ephemeral_system_prompt_file {empty}: the file is empty"):
        RunConfig.from_flags(**base, ephemeral_system_prompt_file=str(empty))


def test_base_url_credentials_with_a_key_exit_2_and_are_never_printed(tmp_path):
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    base = dict(dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path))
    with pytest.raises(UsageError) as info:
        RunConfig.from_flags(**base, base_url="http://user:hunter2pw@127.0.0.1:9/v1", api_key="sk-x")
    assert "hunter2pw" not in str(info.value) and "Basic auth" in str(info.value)
    config = RunConfig.from_flags(**base, base_url="http://user:hunter2pw@127.0.0.1:9/v1")
    assert "hunter2pw" in config.secret_texts()


# ----------------------------------------------------------------------------- audit b2: a careless user's flags


@pytest.mark.parametrize("flag", ["batch_size", "seed", "max_turns", "budget_tokens"])
def test_an_integer_of_more_than_4300_digits_exits_2_naming_the_flag(tmp_path, flag):
    """Python's int() refuses such a string with a plain ValueError: it was a traceback (exit 1)."""
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    base = dict(dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path), model="mock")
    with pytest.raises(UsageError) as info:
        RunConfig.from_flags(**{**base, flag: "9" * 5000})
    assert f"--{flag} must be" in str(info.value)


@pytest.mark.parametrize(
    "flag, bad, said, good",
    [
        # 1e300 passed, then every verify sample was a scorer error (OverflowError in the worker).
        ("verify_timeout", ("1e300", "99999999999999999999999"), "at most 604800", ("604800", 604800.0)),
        # 1e300 was taken, and every numeric answer passed.
        ("numeric_tolerance", ("1e300", "1.5"), "a number from 0 to 1", ("0.01", 0.01)),
    ],
)
def test_a_scoring_flag_past_its_bound_exits_2(tmp_path, flag, bad, said, good):
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    base = dict(dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path), model="mock")
    for value in bad:
        with pytest.raises(UsageError, match=f"--{flag} must be {said}"):
            RunConfig.from_flags(**base, **{flag: value})
    assert getattr(RunConfig.from_flags(**base, **{flag: good[0]}), flag) == good[1]


def test_max_tokens_no_token_budget_can_hold_exits_2(tmp_path):
    """Every call's worst case past the whole budget: the start check ran, then every prompt failed
    (class budget) and the run exited 0 without a sample."""
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    base = dict(dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path), model="mock")
    for max_tokens in (5000, 1000):
        with pytest.raises(UsageError) as info:
            RunConfig.from_flags(**base, max_tokens=max_tokens, budget_tokens=1000)
        assert "--max_tokens" in str(info.value) and "--budget_tokens" in str(info.value)
    with pytest.raises(UsageError) as info:  # no --max_tokens: a budget's calls get 64 at the least
        RunConfig.from_flags(**base, budget_tokens=50)
    assert "--max_tokens" in str(info.value) and "--budget_tokens" in str(info.value)
    assert RunConfig.from_flags(**base, max_tokens=100, budget_tokens=1000).call_max_tokens == 100


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # The local cgroup's quota cannot go below 1 ms a 100 ms period: 0.0001 silently became 0.01 (100
        # times what was asked); Docker refuses it at every container start.
        ({"container_cpus": "0.0001"}, "--container_cpus must be a number from 0.01 to 1024, got 0.0001"),
        # One request per worker every 1.2e302 s: every prompt failed at its second call, its first paid.
        ({"max_rpm": "1e-300"}, "--max_rpm=1e-300 with --num_workers=4 lets each worker send one request"),
        (
            {"max_rpm": "0.1", "num_workers": "2", "prompt_timeout": "1200"},
            "not less than --prompt_timeout=1200",
        ),
    ],
)
def test_sizes_and_rates_no_prompt_could_work_with_exit_2_naming_the_flag(tmp_path, flags, message):
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError) as info:
        RunConfig.from_flags(
            dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path), model="mock", **flags
        )
    assert message in str(info.value)


def test_the_least_cpus_and_a_slow_rate_that_still_works_are_taken(tmp_path):
    from batchrun.config import RunConfig

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    config = RunConfig.from_flags(
        dataset_file=str(ds),
        batch_size=1,
        run_name="r",
        output_dir=str(tmp_path),
        model="mock",
        container_cpus="0.01",
        max_rpm="1",  # 4 workers: one request every 240 s each, under the 1,800 s prompt timeout
    )
    assert (config.container_cpus, config.max_rpm) == (0.01, 1.0)


FILE_FLAGS = ["prefill_messages_file", "mcp_config", "distribution_file", "ephemeral_system_prompt_file"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", FILE_FLAGS)
@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_a_flag_file_that_is_a_pipe_or_huge_exits_2_unread(tmp_path, flag, kind):
    # A FIFO no one writes to hung the run before it started (open() waits for a writer), and /dev/zero
    # (not read here) filled the machine's memory until the kernel killed the runner and others. Only a
    # regular file of at most 32 MiB is read.
    from batchrun.config import RunConfig, UsageError

    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "x"}\n')
    path = tmp_path / "file.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with path.open("wb") as fh:  # sparse: no disk taken
            fh.truncate((32 << 20) + 1)
    flags = {flag: str(path)}
    if flag == "distribution_file":
        flags["distribution"] = "terminal_only"
    with pytest.raises(UsageError) as info:
        RunConfig.from_flags(
            dataset_file=str(ds), batch_size=1, run_name="r", output_dir=str(tmp_path), model="mock", **flags
        )
    said = "not a regular file (a pipe or a device is not read)" if kind == "fifo" else "larger than 32 MiB"
    assert str(info.value) == f"--{flag} {path}: cannot read: {said}"


def test_a_flag_file_is_read_as_text_with_its_newlines_as_before(tmp_path):
    from batchrun.storage import read_flag_file

    path = tmp_path / "p.txt"
    path.write_bytes("line one\r\nline two\rthree\n\u00e9".encode())
    assert read_flag_file(path) == "line one\nline two\nthree\n\u00e9"
    with pytest.raises(ValueError, match="Is a directory"):
        read_flag_file(tmp_path)
