"""batchrun/config.py and the command line: every flag checked before anything starts, no key in any output."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import batch_runner
from batchrun.config import RunConfig, UsageError, parse_argv, parse_bool
from batchrun.fakes.fake_model import FakeModelServer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "batch_runner.py")
KEY = "sk-or-v1-CONFIGTESTSECRET0123456789abcdef"


@pytest.fixture(scope="module")
def server():
    with FakeModelServer(latency_s=0) as srv:
        yield srv


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=environ
    )


def base_args(tmp_path: Path, server: FakeModelServer) -> list[str]:
    (tmp_path / "p.jsonl").write_text('{"prompt": "config one"}\n{"prompt": "config two"}\n')
    return [
        f"--dataset_file={tmp_path / 'p.jsonl'}",
        "--batch_size=2",
        "--run_name=cfg",
        f"--output_dir={tmp_path / 'out'}",
        f"--base_url={server.base_url}",
        "--model=m",
        "--num_workers=1",
        "--distribution=terminal_only",
        "--keep_no_reasoning",
    ]


# ----------------------------------------------------------------------------- refused before any model call

BAD_FLAGS = [
    (["--max_turn=1"], "did you mean --max_turns?"),
    (["--max_sample=5"], "did you mean --max_samples?"),
    (["--sandbox_netwrok=False"], "did you mean --sandbox_network?"),
    (["--sandbox_network=flase"], "--sandbox_network must be true or false"),
    (["--resume=maybe"], "--resume must be true or false"),
    (["--force_resume=2"], "--force_resume must be true or false"),
    (["--tool_timeout=abc"], "--tool_timeout must be a number"),
    (["--tool_timeout=0"], "--tool_timeout must be a number above 0"),
    (["--request_timeout=0"], "--request_timeout"),
    (["--prompt_timeout=-5"], "--prompt_timeout"),
    (["--prompt_timeout=nan"], "--prompt_timeout"),
    (["--max_retries=abc"], "--max_retries must be an integer"),
    (["--max_retries=-1"], "--max_retries must be an integer"),
    (["--seed=abc"], "--seed must be an integer"),
    (["--seed=1.5"], "--seed must be an integer"),
    (["--max_failure_rate=abc"], "--max_failure_rate must be a number"),
    (["--max_failure_rate=1.5"], "--max_failure_rate must be a number from 0 to 1"),
    (["--log_prefix_chars=abc"], "--log_prefix_chars must be an integer"),
    (["--container_cpus=abc"], "--container_cpus must be a number"),
    (["--container_memory_mb=12.5"], "--container_memory_mb"),
    (["--budget_usd=0"], "--budget_usd"),
    (["--max_rpm=fast"], "--max_rpm"),
    (["--run_name=.."], "--run_name"),
    (["--run_name=.hidden"], "--run_name"),
    (["--default_image="], "--default_image must not be empty"),
    (["--output_dir=/proc/self"], "--output_dir"),
    (["--reasoning_effort=huge"], "--reasoning_effort must be one of"),
    (["--provider_sort=cheapest"], "--provider_sort must be one of"),
    (["--local_isolation=off"], "--local_isolation must be one of"),
    (["--sandbox=kubernetes"], "--sandbox: unknown sandbox backend"),
    (["--distribution=nope"], "--distribution"),
    (["--base_url=localhost:8000"], "--base_url must be an http"),
    (["stray"], "unexpected argument"),
    (["--max_turns=3", "--max_turns=4"], "--max_turns is given more than once"),
    (["--max_turns=\uff13"], "--max_turns must be a positive integer"),  # a full-width digit
    (["--temperature=\u0661"], "--temperature must be a number"),  # an Arabic-Indic digit
    (["--budget_usd=1_000"], "--budget_usd must be a number"),
    # A flag that does nothing with the others given: what it was meant for would not happen.
    (["--force_resume"], "--force_resume applies only with --resume"),
    (["--rerun_discarded"], "--rerun_discarded applies only with --resume"),
    (["--judge_model=j"], "--judge_model applies only with the judge scorer"),
    # An unset shell variable (--scorer=$SCORER): read as the rows' own scorers, and as no step at all.
    (["--scorer="], "--scorer must not be empty"),
    (["--answer_normalize="], "--answer_normalize must not be empty"),
    (
        ["--judge_base_url=http://127.0.0.1:9", "--scorer=exact"],
        "--judge_base_url applies only with the judge",
    ),
    (["--judge_api_key_env=MY_JUDGE_KEY"], "--judge_api_key_env applies only with the judge scorer"),
    # The judge's key, named but not there: every judged sample was unscored after its tokens were spent.
    (
        ["--scorer=judge", "--judge_model=j", "--judge_api_key_env=MY_JUDGE_API_KEY"],
        "--judge_api_key_env=MY_JUDGE_API_KEY: the environment variable MY_JUDGE_API_KEY is not set",
    ),
    (
        ["--scorer=judge", "--judge_model=j", "--judge_base_url=https://openrouter.ai/api/v1"],
        "no API key for the judge at --judge_base_url=https://openrouter.ai/api/v1: set JUDGE_API_KEY",
    ),
    (["--cwd_root=/tmp", "--local_isolation=bwrap"], "--cwd_root applies only with --local_isolation=none"),
    (["--cwd_root=/tmp", "--sandbox=singularity"], "--cwd_root applies only to the local sandbox"),
    # A sandbox flag the backend never reads: the limit or isolation asked for was not what ran.
    (["--local_isolation=none", "--sandbox=docker"], "--local_isolation does nothing with --sandbox=docker"),
    (
        ["--default_image=ubuntu:22.04", "--sandbox=local"],
        "--default_image does nothing with --sandbox=local",
    ),
    (
        ["--container_memory_mb=512", "--sandbox=singularity"],
        "--container_memory_mb does nothing with --sandbox=singularity",
    ),
    (
        ["--container_pids_limit=64", "--sandbox=modal"],
        "--container_pids_limit does nothing with --sandbox=modal",
    ),
    # Modal ends a sandbox after at most 24 hours: a prompt given longer would lose its sandbox under it.
    (
        ["--sandbox=modal", "--prompt_timeout=86000"],
        "--prompt_timeout=86000 is longer than a Modal sandbox can live",
    ),
]


@pytest.mark.parametrize(("extra", "message"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_exits_2_before_any_model_call_and_never_prints_the_key(tmp_path, server, extra, message):
    server.reset_stats()
    named = {a.split("=", 1)[0] for a in extra if a.startswith("--") and a != "--max_turns=4"}
    base = [a for a in base_args(tmp_path, server) if a.split("=", 1)[0] not in named]
    done = run_cli(*base, f"--api_key={KEY}", *extra, cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert KEY not in done.stdout + done.stderr
    assert server.stats()["requests"] == 0  # not even the endpoint check
    assert not (tmp_path / "out" / "cfg").exists()


def test_output_dir_that_is_a_file_is_refused(tmp_path, server):
    (tmp_path / "afile").write_text("x")
    base = [a for a in base_args(tmp_path, server) if not a.startswith("--output_dir=")]
    done = run_cli(*base, f"--output_dir={tmp_path / 'afile'}", cwd=tmp_path)
    assert done.returncode == 2
    assert "--output_dir" in done.stderr and "not a directory" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_read_only_output_dir_is_refused(tmp_path, server):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        base = [a for a in base_args(tmp_path, server) if not a.startswith("--output_dir=")]
        done = run_cli(*base, f"--output_dir={ro}", cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(ro)])
    assert done.returncode == 2
    assert "--output_dir" in done.stderr and "cannot write there" in done.stderr


def test_key_from_the_command_line_warns_once_and_is_never_written(tmp_path, server):
    done = run_cli(*base_args(tmp_path, server), f"--api_key={KEY}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("--api_key is visible to other users") == 1
    assert KEY not in done.stdout + done.stderr
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    from_env = run_cli(*base_args(tmp_path, server), "--resume", cwd=tmp_path, env={"OPENAI_API_KEY": KEY})
    assert from_env.returncode == 0, from_env.stderr
    assert "visible to other users" not in from_env.stderr


@pytest.mark.parametrize("word", ["false", "False", "FALSE", "0", "no", "off", "Off"])
def test_lowercase_false_words_are_false(tmp_path, server, word):
    done = run_cli(*base_args(tmp_path, server), f"--resume={word}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Resume:" not in done.stdout  # a fresh run, not a resume


def test_help_documents_every_flag_in_groups(tmp_path):
    done = run_cli("--help", cwd=tmp_path, env={"PAGER": "cat"})
    assert done.returncode == 0, done.stderr
    shown = done.stdout  # on stdout, so `--help | less` works
    for name in RunConfig.flag_names():
        assert f"--{name}" in shown, name
    for group in ("[reference]", "[sandbox]", "[limits]", "[spend]"):
        assert group in shown
    # A list flag with no default (--providers_allowed, --scorer) says none, as the README does: not "()".
    assert "Default: ()" not in shown and "--providers_allowed=PROVIDERS_ALLOWED" in shown


# ----------------------------------------------------------------------------- the config itself


def test_main_takes_exactly_the_config_flags_and_documents_each():
    params = list(inspect.signature(batch_runner.main).parameters)
    assert params == list(RunConfig.flag_names())
    doc = inspect.getdoc(batch_runner.main) or ""
    args = doc.split("Args:", 1)[1]
    for name in params:
        assert f"\n{name}: " in "\n" + "\n".join(line.strip() for line in args.splitlines()), name


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", True), ("On", True), ("YES", True), ("1", True), (1, True)]
    + [("false", False), ("off", False), ("No", False), ("0", False), (0, False)],
)
def test_parse_bool_words(value, expected):
    assert parse_bool(value, "x") is expected


@pytest.mark.parametrize("value", ["", "2", "tru", "nope", None, 2, 1.0, "y"])
def test_parse_bool_refuses_everything_else(value):
    with pytest.raises(UsageError, match="--x must be true or false"):
        parse_bool(value, "x")


def test_parse_argv_forms():
    names = RunConfig.flag_names()
    bools = ["resume", "verbose", "sandbox_network"]
    got = parse_argv(
        ["--resume", "--noverbose", "--max-turns", "3", "--sandbox_network", "off", "--run_name=a=b"],
        bools,
        names,
    )
    assert got == {
        "resume": "true",
        "verbose": "false",
        "max_turns": "3",
        "sandbox_network": "off",
        "run_name": "a=b",
    }
    with pytest.raises(UsageError, match="needs a value"):
        parse_argv(["--api_key"], bools, names)
    # Fire's one-letter aliases, as --help lists them: only for a letter that starts a single flag.
    assert parse_argv(["-n", "3", "-a=k"], bools, ["num_workers", "api_key", "max_turns", "model"]) == {
        "num_workers": "3",
        "api_key": "k",
    }
    with pytest.raises(UsageError, match="-m stands for no single flag"):
        parse_argv(["-m", "3"], bools, ["max_turns", "model"])


def test_refusals_never_echo_a_long_value():
    with pytest.raises(UsageError) as info:
        RunConfig.from_flags(dataset_file="d", batch_size=1, run_name="r", max_turns=KEY)
    assert KEY not in str(info.value)


def test_config_is_frozen_and_typed(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    config = RunConfig.from_flags(
        dataset_file=str(tmp_path / "d.jsonl"),
        batch_size="3",
        run_name="r",
        output_dir=str(tmp_path / "o"),
        tool_timeout="2.5",
        sandbox_network="off",
        providers_order="a, b",
        base_url="http://127.0.0.1:1/v1",
    )
    assert (config.batch_size, config.tool_timeout, config.sandbox_network) == (3, 2.5, False)
    assert config.providers_order == ("a", "b")
    with pytest.raises(AttributeError):
        config.batch_size = 4  # type: ignore[misc]


def test_a_key_bound_for_another_host_or_without_tls_is_warned_of(tmp_path, monkeypatch):
    """OPENROUTER_API_KEY is read first (as the reference reads it) and went to whatever --base_url
    named, without a word: now the run says so when that host is not OpenRouter, and whenever a key goes
    over plain http to a host that is not this machine's. The key itself is never in the warning."""
    from batchrun.cli import key_destination_warnings

    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")

    def warnings(**flags) -> str:
        flags = {"model": "m", **flags}
        config = RunConfig.from_flags(
            dataset_file=str(tmp_path / "d.jsonl"),
            batch_size=1,
            run_name="r",
            output_dir=str(tmp_path),
            **flags,
        )
        lines = key_destination_warnings(config)
        assert all(KEY not in line for line in lines)
        return "\n".join(lines)

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY)
    assert warnings() == ""  # the default --base_url: OpenRouter's
    said = warnings(base_url="https://api.together.xyz/v1")
    assert "OPENROUTER_API_KEY is sent to api.together.xyz, which is not OpenRouter" in said
    assert "without TLS" not in said
    both = warnings(base_url="http://10.0.0.5:8000/v1")
    assert "sent to 10.0.0.5, which is not OpenRouter" in both and "sent to 10.0.0.5 without TLS" in both
    for local in ("http://127.0.0.1:8080/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1"):
        assert warnings(base_url=local) == ""  # this machine's own server
    assert warnings(base_url="https://api.together.xyz/v1", api_key=KEY) == ""  # the key given for it
    monkeypatch.delenv("OPENROUTER_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # the variable any OpenAI-compatible client reads: no word
    assert warnings(base_url="https://api.together.xyz/v1") == ""
    assert "without TLS" in warnings(base_url="http://gpu-box.internal:8000/v1")
    assert warnings(model="mock") == ""
