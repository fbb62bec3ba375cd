"""The run's configuration: every command-line flag typed and checked before anything starts.

:meth:`RunConfig.from_flags` turns the flags (as typed by a caller of ``main(...)``, or as the raw
strings of a command line) into one frozen :class:`RunConfig`. A bad value, a bad combination or an
unusable path raises :class:`UsageError` naming the flag; nothing has been started by then (no
endpoint check, no sandbox, no model call). :func:`parse_argv` reads a command line the same strict
way: an unknown flag is refused with the closest valid name, and no value (the API key above all)
is ever echoed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import math
import os
import re
import tempfile
import textwrap
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from batchrun.prompt.httpclient import url_credentials
from batchrun.prompt.llm import (
    DIALECTS,
    MAX_CALL_TOKENS,
    PROVIDER_SORTS,
    REASONING_EFFORTS,
    LLMConfig,
    safe_url,
)
from batchrun.prompt.loop import LoopLimits
from batchrun.prompt.sandboxes import DEFAULT_BACKEND, backend_class
from batchrun.prompt.sandboxes.base import DEFAULT_IMAGE, SandboxFlags, usable_cpus
from batchrun.prompt.sandboxes.local import ISOLATION_MODES
from batchrun.scoring import DEFAULT_NUMERIC_TOLERANCE, NORMALIZE_STEPS
from batchrun.secrets import ORDINARY, url_secrets
from batchrun.sharegpt import parse_json
from batchrun.storage import not_a_file, read_flag_file, read_json_file

DEFAULT_MODEL = "anthropic/claude-sonnet-4.6"
MAX_COUNT = 100_000_000  # prompts, samples, batch sizes: more than any run holds
MAX_TURNS = 100_000  # --max_turns and a row's own max_turns
# Memory one planned sample may take in the parent (measured ~450 bytes: the job, its batch).
SAMPLE_BYTES = 1024
MIN_CPUS = 0.01  # --container_cpus: Docker refuses less; the local cgroup's quota cannot go below it
MAX_DURATION_S = 7 * 24 * 3600.0  # a timeout longer than a week is a typo (1e11 s would overflow a timer)
PID_MAX_LIMIT = 4_194_304  # the kernel's own highest pid_max
DERIVED_MAX_TOKENS = 4096  # the per-call completion limit a budget run gets when --max_tokens is not set
EPHEMERAL_PROMPT_ENV = "BATCH_RUNNER_EPHEMERAL_SYSTEM_PROMPT"  # the prompt, kept out of ps
DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
MOCK_MODEL = "mock"  # the built-in fake model (batchrun.fakes.fake_model): no key, no network

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
# Where a run's output may never go: the kernel's own file systems.
_NOT_OUTPUT = ("/proc", "/sys", "/dev")


class UsageError(ValueError):
    """A flag or input the run cannot start with; printed without a traceback, exit code 2."""


# ----------------------------------------------------------------------------- value parsers


def parse_bool(value: Any, flag: str) -> bool:
    """true/false, 1/0, yes/no, on/off in any case (and Python bools); anything else is refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise UsageError(f"--{flag} must be true or false (also 1/0, yes/no, on/off), got {_show(value)}")


def parse_optional_bool(value: Any, flag: str) -> bool | None:
    return None if value is None else parse_bool(value, flag)


# Worker processes a run may start on this machine, per CPU core: each is a Python process with its own
# memory (~40-60 MB) and imports; more prompts in flight come from --prompts_per_worker, not processes.
WORKERS_PER_CPU = 16


def is_http_url(url: str) -> bool:
    """An http(s) URL with a host that a request can be sent to (``http://[::1/v1``: no; a port
    out of range: no); urllib raises ValueError for such a URL wherever it is read later."""
    if not re.fullmatch(r"https?://\S+", url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (ValueError when the port is no number or out of range)
    except ValueError:
        return False
    return bool(parts.hostname)


DEFAULT_JUDGE_KEY_ENV = "JUDGE_API_KEY"  # --judge_api_key_env's default


def judge_flags_given(model: str | None, base_url: str | None, key_env: str) -> list[str]:
    """The judge's flags given (their names), as the runner and views.score refuse them without the
    judge scorer: a forgotten --scorer=judge."""
    given = [
        name for name, value in (("judge_model", model), ("judge_base_url", base_url)) if value is not None
    ]
    return given + (["judge_api_key_env"] if key_env != DEFAULT_JUDGE_KEY_ENV else [])


def check_judge_key_env(key_env: str) -> None:
    """--judge_api_key_env names an environment variable (the runner and views.score, judge or not)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
        raise UsageError("--judge_api_key_env must name an environment variable (letters, digits, _)")


def check_judge_key(key_env: str, base_url: str | None, key: str | None) -> None:
    """The judge's key, as the runner and views.score check it before any call: a variable named but not
    set (every judged sample was unscored after its tokens were spent), and a hosted judge at ``base_url``
    without a ``key``, are refused."""
    if key_env != DEFAULT_JUDGE_KEY_ENV and not os.environ.get(key_env):
        raise UsageError(
            f"--judge_api_key_env={key_env}: the environment variable {key_env} is not set or is empty"
        )
    if base_url and not key and ("openrouter.ai" in base_url or "api.openai.com" in base_url):
        raise UsageError(
            f"no API key for the judge at --judge_base_url={safe_url(base_url)}: set {key_env} "
            "(the variable --judge_api_key_env names)"
        )


def _show(value: Any) -> str:
    """A refused value as the message shows it: quoted when it is a word, a number or a plain path
    (``four``, ``flase``, ``1e11``); anything else, which may be a key pasted into the wrong flag, only
    by its length. An http(s) URL shows without its user, password and query."""
    if isinstance(value, str) and re.match(r"https?://", value):
        scheme, _, rest = safe_url(value).partition("://")
        value = f"{scheme}://{rest.split('?', 1)[0]}" + ("?..." if "?" in rest else "")
        return repr(value) if len(value) <= 200 else repr(value[:197] + "...")
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= 40 and (ORDINARY.fullmatch(text.strip()) or re.fullmatch(r"[\w.+-]{1,12}", text)):
        return repr(value)
    return f"a value of {len(text)} characters (not shown: it may be a secret)"


def int_flag(
    low: int | None = None, high: int | None = None, optional: bool = False
) -> Callable[[Any, str], Any]:
    """A parser for a whole-number flag within [low, high]; ``optional``: None (unset) is allowed."""

    def parse(value: Any, flag: str) -> int | None:
        if value is None and optional:
            return None
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):  # ASCII digits only
            with contextlib.suppress(ValueError):  # more than 4300 digits: Python's int() refuses them
                number = int(value)
        kind = "a positive integer" if low == 1 else f"an integer{_range(low, high)}"
        if number is None:
            raise UsageError(f"--{flag} must be {kind}, got {_show(value)}")
        if low == 1 and high is not None and number > high:  # a size or count the machine cannot honour
            raise UsageError(f"--{flag} must be at most {high}, got {number}")
        if (low is not None and number < low) or (high is not None and number > high):
            raise UsageError(f"--{flag} must be {kind}, got {number}")
        return number

    return parse


_DECIMAL = re.compile(r"\s*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")


def float_flag(
    low: float | None = None, high: float | None = None, low_open: bool = False, optional: bool = False
) -> Callable[[Any, str], Any]:
    """A parser for a number flag within its range; ``low_open``: the low end itself is refused (``> low``)."""

    def parse(value: Any, flag: str) -> float | None:
        if value is None and optional:
            return None
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and _DECIMAL.fullmatch(value):
            # Python's float() also reads other scripts' digits, "1_000" and "infinity": a typo here.
            number = float(value)
        if number is None or not math.isfinite(number):
            raise UsageError(f"--{flag} must be a number{_range(low, high, low_open)}, got {_show(value)}")
        too_low = low is not None and (number <= low if low_open else number < low)
        if low_open and high is not None and number > high:  # a size or duration past what can be honoured
            raise UsageError(f"--{flag} must be at most {high:g}, got {value}")
        if too_low or (high is not None and number > high):
            raise UsageError(f"--{flag} must be a number{_range(low, high, low_open)}, got {value}")
        return number

    return parse


def _range(low: float | None, high: float | None, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" above {low:g}" if low_open else f" from {low} to {high}"
    if low is not None:
        if low == 0 and low_open:
            return " above 0"
        return f" above {low}" if low_open else f" of at least {low}"
    return ""


def choice_flag(choices: Iterable[str], optional: bool = True) -> Callable[[Any, str], Any]:
    options = tuple(choices)

    def parse(value: Any, flag: str) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, str) and value in options:
            return value
        raise UsageError(f"--{flag} must be one of {', '.join(options)}, got {_show(value)}")

    return parse


def text_flag(optional: bool = True, nonempty: bool = True) -> Callable[[Any, str], Any]:
    def parse(value: Any, flag: str) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or value is None or isinstance(value, (list, tuple, dict)):
            raise UsageError(f"--{flag} must be text, got {_show(value)}")
        text = str(value)
        if nonempty and not text.strip():
            raise UsageError(f"--{flag} must not be empty")
        if "\0" in text:
            raise UsageError(f"--{flag} must not contain a NUL character")
        return text

    return parse


def list_flag(value: Any, flag: str) -> tuple[str, ...]:
    """A comma-separated list (or a list from a Python caller); empty items are refused."""
    if value is None or value == "":
        return ()
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            # str() would send ``None`` or ``1`` as a provider's name
            bad = next(v for v in value if not isinstance(v, str))
            raise UsageError(f"--{flag} must be a list of names (text), got an item {_show(bad)}")
        items = [v.strip() for item in value for v in item.split(",")]  # ["a,b"] is --flag=a,b
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    else:
        raise UsageError(f"--{flag} must be a comma-separated list of names, got {_show(value)}")
    if not all(items):
        raise UsageError(f"--{flag} must be a comma-separated list of names (one is empty)")
    return tuple(items)


def run_name_flag(value: Any, flag: str) -> str | None:
    text = text_flag()(value, flag)
    if text is None:
        return None
    if not re.fullmatch(r"[A-Za-z0-9_][\w.\-]*", text) or len(text) > 200:
        raise UsageError(
            f"--{flag} must start with a letter, digit or '_' and hold only letters, digits, '.', '-' and '_' "
            f"(output goes to <output_dir>/<run_name>/), got {_show(value)}"
        )
    return text


# ----------------------------------------------------------------------------- scoring flags


def scorer_flag(value: Any, flag: str) -> tuple[str, ...]:
    """--scorer: comma-separated scorer names (built-ins, module:function, entry points); auto: the row's."""
    from batchrun.scoring import parse_scorers

    if isinstance(value, str) and not value.strip():
        # An unset shell variable (--scorer=$SCORER) read as the rows' own scorers: leave the flag out for those.
        raise UsageError(f"--{flag} must not be empty (leave it out for the rows' own scorers)")
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if value is not None and not isinstance(value, str):
        raise UsageError(f"--{flag} must be a comma-separated list of scorers, got {_show(value)}")
    try:
        return parse_scorers(value)
    except ValueError as exc:
        raise UsageError(f"--{flag}: {exc}") from None


def regex_flag(value: Any, flag: str) -> str | None:
    text = text_flag()(value, flag)
    if text is None:
        return None
    try:
        re.compile(text)
    except re.error as exc:
        raise UsageError(f"--{flag} is not a valid regular expression: {exc}") from None
    return text


def normalize_flag(value: Any, flag: str) -> tuple[str, ...]:
    """--answer_normalize: which of case, whitespace, punctuation; "none" for none."""
    if value is None or value == "none" or value == ():
        return ()
    if isinstance(value, str) and not value.strip():  # an unset shell variable read as no step at all
        raise UsageError(f"--{flag} must not be empty (none, for no step)")
    items = list_flag(value, flag)
    bad = [i for i in items if i not in NORMALIZE_STEPS]
    if bad:
        raise UsageError(f"--{flag} must name some of {', '.join(NORMALIZE_STEPS)} (or none), got {bad[0]!r}")
    return tuple(items)


# ----------------------------------------------------------------------------- the configuration


def json_object_flag(value: Any, flag: str) -> dict[str, Any] | None:
    """A JSON object, as its text (the command line) or a dict (``main(...)`` from Python)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = parse_json(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    raise UsageError(f"--{flag} must be a JSON object such as '{{\"name\": value}}', got {_show(value)}")


def _flag(parse: Callable[[Any, str], Any], default: Any = None, *, group: str, help: str) -> Any:
    """A flag: its parser, default, ``--help`` group and help line (cli.main is generated from these)."""
    return dataclasses.field(default=default, metadata={"parse": parse, "group": group, "help": help})


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every flag of a run, typed and checked; built once by :meth:`from_flags` and never changed."""

    # The reference runner's flags (same names and defaults)
    dataset_file: str = _flag(
        text_flag(), group="reference", help='JSONL dataset, one {"prompt": ...} object a line (required).'
    )  # the three required flags: see check()
    batch_size: int = _flag(
        int_flag(1, MAX_COUNT, optional=True),
        group="reference",
        help="Prompts per batch file (a positive whole number, required).",
    )
    run_name: str = _flag(
        run_name_flag,
        group="reference",
        help="Output goes to <output_dir>/<run_name>/ (letters, digits, '.', '-', '_').",
    )
    distribution: str = _flag(
        text_flag(optional=False),
        "default",
        group="reference",
        help="Toolset distribution; --list_distributions shows them all.",
    )
    model: str = _flag(
        text_flag(optional=False),
        DEFAULT_MODEL,
        group="reference",
        help='Model id sent to the endpoint; "mock" runs the built-in fake model.',
    )
    api_key: str | None = _flag(
        text_flag(nonempty=False),
        group="reference",
        help="API key; default OPENROUTER_API_KEY, then OPENAI_API_KEY (safer: ps shows flags).",
    )
    base_url: str = _flag(
        text_flag(optional=False),
        DEFAULT_BASE_URL,
        group="reference",
        help="Any OpenAI-compatible endpoint (OpenRouter, OpenAI, vLLM, SGLang, llama.cpp, Ollama).",
    )
    max_turns: int = _flag(
        int_flag(1, MAX_TURNS),
        10,
        group="reference",
        help="Most model calls (tool-calling iterations) per prompt.",
    )
    num_workers: int = _flag(int_flag(1, 1024), 4, group="reference", help="Worker processes.")
    resume: bool = _flag(
        parse_bool,
        False,
        group="reference",
        help="Continue an interrupted run: only prompts without an outcome run.",
    )
    list_distributions: bool = _flag(
        parse_bool, False, group="reference", help="Print the toolset distributions and exit."
    )
    verbose: bool = _flag(
        parse_bool, False, group="reference", help="Per-prompt logging (tool calls and results, failures)."
    )
    ephemeral_system_prompt: str | None = _flag(
        text_flag(nonempty=False),
        group="reference",
        help="System prompt sent to the model, never saved anywhere.",
    )
    log_prefix_chars: int = _flag(
        int_flag(0, 1_000_000), 100, group="reference", help="Length of tool call/result previews in logs."
    )
    providers_allowed: tuple[str, ...] = _flag(
        list_flag, (), group="reference", help="OpenRouter provider.only (comma-separated)."
    )
    providers_ignored: tuple[str, ...] = _flag(
        list_flag, (), group="reference", help="OpenRouter provider.ignore (comma-separated)."
    )
    providers_order: tuple[str, ...] = _flag(
        list_flag, (), group="reference", help="OpenRouter provider.order (comma-separated)."
    )
    provider_sort: str | None = _flag(
        choice_flag(PROVIDER_SORTS),
        group="reference",
        help="OpenRouter provider.sort: price, throughput or latency.",
    )
    max_tokens: int | None = _flag(
        int_flag(1, MAX_CALL_TOKENS, optional=True), group="reference", help="Most tokens per model response."
    )
    reasoning_effort: str | None = _flag(
        choice_flag(REASONING_EFFORTS),
        group="reference",
        help="none, minimal, low, medium, high, xhigh, max or ultra.",
    )
    reasoning_disabled: bool = _flag(
        parse_bool,
        False,
        group="reference",
        help="Ask the model not to reason; wins over --reasoning_effort.",
    )
    prefill_messages_file: str | None = _flag(
        text_flag(),
        group="reference",
        help="JSON array of {role, content} sent before the prompt, never saved.",
    )
    max_samples: int | None = _flag(
        int_flag(1, MAX_COUNT, optional=True), group="reference", help="Only the first N dataset rows."
    )
    # Your own toolsets and distributions
    distribution_file: str | None = _flag(
        text_flag(),
        group="tools",
        help="JSON (or YAML) file of named distributions, usable with --distribution.",
    )
    mcp_config: str | None = _flag(
        text_flag(),
        group="tools",
        help='{"mcpServers": ...} file: each MCP server becomes the toolset mcp:<name>.',
    )
    # Additions: reproducibility and concurrency
    seed: int = _flag(
        int_flag(0),
        0,
        group="concurrency",
        help="Toolset sampling seed; a prompt's toolsets depend only on it and the row.",
    )
    prompts_per_worker: int = _flag(
        int_flag(1, 10_000), 16, group="concurrency", help="Prompts in flight per worker process (threads)."
    )
    max_sandbox_starts: int = _flag(
        int_flag(1, 10_000),
        8,
        group="concurrency",
        help="Concurrent sandbox start-ups across the whole run (local: at most 4 per core).",
    )
    ray_address: str | None = _flag(
        text_flag(nonempty=False),
        group="concurrency",
        help="Run the workers on a Ray cluster: auto, local, host:port or ray://host:port.",
    )  # checked by the Ray pool's check_address
    # Sandboxes
    sandbox: str | None = _flag(
        text_flag(),
        group="sandbox",
        help="local, docker, singularity, modal, an installed backend (entry point batch_runner.sandboxes) or package.module:Class; default TERMINAL_ENV, else local.",
    )
    default_image: str = _flag(
        text_flag(optional=False),
        DEFAULT_IMAGE,
        group="sandbox",
        help="Image for rows that name none (container backends).",
    )  # the tests' image is never it
    local_isolation: str = _flag(
        choice_flag(ISOLATION_MODES, optional=False),
        "auto",
        group="sandbox",
        help="Local backend: auto (bubblewrap when it works), bwrap (required) or none.",
    )
    container_cpus: float = _flag(
        # 0.01: the least Docker takes, and a 1 ms quota a 100 ms period (the local cgroup's least)
        float_flag(MIN_CPUS, 1024),
        1.0,
        group="sandbox",
        help="CPUs of one prompt's sandbox (0.01 to the CPUs this run may use).",
    )
    container_memory_mb: int = _flag(
        int_flag(16, 1 << 24), 2048, group="sandbox", help="Memory of one prompt's sandbox, MiB."
    )  # and at most this machine's memory: check()
    container_pids_limit: int = _flag(
        int_flag(8, PID_MAX_LIMIT), 512, group="sandbox", help="Most processes in one prompt's sandbox."
    )  # and kernel.pid_max: check()
    container_disk_mb: int = _flag(
        int_flag(16, 1 << 26),
        4096,
        group="sandbox",
        help="Size cap of one prompt's working directory (local: and of its /tmp), MiB.",
    )  # 64 TiB
    cwd_root: str | None = _flag(
        text_flag(),
        group="sandbox",
        help="With --local_isolation=none: the host directory every row's cwd must lie in.",
    )
    sandbox_network: bool = _flag(
        parse_bool, True, group="sandbox", help="Whether the prompt's commands may reach the network."
    )
    sandbox_settings: dict[str, Any] | None = _flag(
        json_object_flag,
        group="sandbox",
        help="A JSON object of the backend's own options, laid over those the flags set (an outside backend's settings; unknown names exit 2).",
    )  # laid over the backend's options
    # Time limits and retries
    tool_timeout: float = _flag(
        float_flag(0, MAX_DURATION_S, low_open=True), 180.0, group="limits", help="Seconds per tool call."
    )
    prompt_timeout: float = _flag(
        float_flag(0, MAX_DURATION_S, low_open=True),
        1800.0,
        group="limits",
        help="Seconds per prompt (wall clock).",
    )
    request_timeout: float = _flag(
        float_flag(0, MAX_DURATION_S, low_open=True), 600.0, group="limits", help="Seconds per model call."
    )
    max_retries: int = _flag(
        int_flag(0, 100),
        3,
        group="limits",
        help="Retries of one model call on 5xx, timeouts and dropped connections.",
    )
    # Output, resume and quality
    output_dir: str = _flag(
        text_flag(optional=False), "data", group="output", help="Parent directory of run directories."
    )
    rerun_discarded: bool = _flag(
        parse_bool, False, group="output", help="On resume, run discarded prompts again."
    )
    force_resume: bool = _flag(
        parse_bool,
        False,
        group="output",
        help="Resume although data-defining settings changed (recorded in the manifest).",
    )
    max_failure_rate: float = _flag(
        float_flag(0, 1),
        0.5,
        group="output",
        help="Exit 3 when more than this share (0 to 1) of the prompts this invocation attempted failed (the budget's stops do not count).",
    )
    keep_no_reasoning: bool = _flag(
        parse_bool, False, group="output", help="Keep samples with no reasoning instead of discarding them."
    )
    keep_invalid_tool_calls: bool = _flag(
        parse_bool,
        False,
        group="output",
        help="Keep samples holding a tool call whose arguments are not a JSON object (bad or cut-off JSON) instead of discarding them (reason invalid_tool_call).",
    )
    keep_empty_answers: bool = _flag(
        parse_bool,
        False,
        group="output",
        help="Keep samples whose final answer is empty (or reasoning only) instead of discarding them (reason empty_answer).",
    )
    exclude_partial: bool = _flag(
        parse_bool,
        False,
        group="output",
        help="Leave partial trajectories (max_turns, context limit, truncated, budget) out of trajectories.jsonl; they stay in the batch files and count as finished for resume.",
    )
    report_max_trajectories: int = _flag(
        int_flag(0, 1_000_000),
        500,
        group="output",
        help="Conversations listed in report.html (all records are counted).",
    )
    # Spend and rate limits
    budget_usd: float | None = _flag(
        float_flag(0, 1e9, low_open=True, optional=True),
        group="spend",
        help="Run-wide budget in USD; once spent, the run stops (resume later).",
    )
    budget_tokens: int | None = _flag(
        int_flag(1, 10**15, optional=True),
        group="spend",
        help="Run-wide budget in tokens; once spent, the run stops (resume later).",
    )
    max_prompt_tokens: int | None = _flag(
        int_flag(1, 10**12, optional=True),
        group="spend",
        help="Per-prompt token cap: a runaway prompt ends as partial.",
    )
    max_prompt_usd: float | None = _flag(
        float_flag(0, 1e9, low_open=True, optional=True),
        group="spend",
        help="Per-prompt cost cap in USD: a runaway prompt ends as partial.",
    )
    max_rpm: float | None = _flag(
        float_flag(0, 1e7, low_open=True, optional=True),
        group="spend",
        help="Model requests per minute for the whole run.",
    )
    max_concurrent_requests: int | None = _flag(
        int_flag(1, 1_000_000, optional=True),
        group="spend",
        help="Model requests in flight for the whole run.",
    )
    # OpenRouter routing
    provider_allow_fallbacks: bool | None = _flag(
        parse_optional_bool,
        group="routing",
        help="OpenRouter provider.allow_fallbacks (false pins the providers).",
    )
    provider_data_collection: str | None = _flag(
        choice_flag(("allow", "deny")),
        group="routing",
        help="OpenRouter provider.data_collection: allow or deny.",
    )
    # Endpoint dialects
    endpoint_dialect: str = _flag(
        choice_flag(DIALECTS, optional=False),
        "auto",
        group="endpoint",
        help="auto (by the endpoint's host), openrouter, openai, local or ollama.",
    )
    stream: bool = _flag(
        parse_bool,
        False,
        group="endpoint",
        help="Stream replies (usage, tool-call and reasoning deltas assembled).",
    )
    # Samples and sampling parameters
    samples_per_prompt: int = _flag(
        int_flag(1, 10_000),
        1,
        group="sampling",
        help='Samples per dataset row, each its own record (sample_index); a row\'s own "samples" field wins. --resume runs only the missing samples.',
    )
    temperature: float | None = _flag(
        float_flag(0, 2, optional=True),
        group="sampling",
        help="Sampling temperature sent with every model request (0 to 2); default: the endpoint's.",
    )
    top_p: float | None = _flag(
        float_flag(0, 1, low_open=True, optional=True),
        group="sampling",
        help="Nucleus sampling top_p sent with every model request (above 0, at most 1).",
    )
    seed_per_request: bool = _flag(
        parse_bool,
        False,
        group="sampling",
        help="Send each request a seed derived from --seed, the row, the sample index and the turn (reproducible samples where the endpoint honours it).",
    )
    # Hostile endpoints and money (issue 25)
    max_response_mb: float = _flag(
        float_flag(0, 4096, low_open=True),
        32.0,
        group="endpoint",
        help="Most an answer may hold, decoded (a whole stream too); more is a bad_response.",
    )
    ephemeral_system_prompt_file: str | None = _flag(
        text_flag(),
        group="output",
        help="File holding the ephemeral system prompt (kept out of ps; or set BATCH_RUNNER_EPHEMERAL_SYSTEM_PROMPT).",
    )
    endpoint_grace: float = _flag(
        float_flag(0, MAX_DURATION_S, low_open=True),
        120.0,
        group="endpoint",
        help="Seconds a dead endpoint may take to come back before the run stops (exit 5).",
    )
    # Scores and verified samples (batchrun.scoring)
    scorer: tuple[str, ...] = _flag(
        scorer_flag,
        (),
        group="scores",
        help="Scorers, comma-separated: exact, includes, regex, numeric, json, verify, judge, module:function or a batch_runner.scorers entry point; default: the row's (verify if it has one, else its answer: numeric for a number, else exact; else none).",
    )
    answer_pattern: str | None = _flag(
        regex_flag,
        group="scores",
        help='Regex extracting the answer from the final text (group 1, last match); default: the last \\\\boxed{}, else the last "ANSWER: ..." line, else the whole text.',
    )
    answer_normalize: tuple[str, ...] = _flag(
        normalize_flag,
        NORMALIZE_STEPS,
        group="scores",
        help="For exact/includes: any of case, whitespace, punctuation, or none.",
    )
    numeric_tolerance: float = _flag(
        float_flag(0, 1),  # more passes answers off by more than the answer itself: a typo
        DEFAULT_NUMERIC_TOLERANCE,
        group="scores",
        help="numeric: passes when |got - want| <= tolerance x max(1, |want|); under the default, a whole "
        "number is compared exactly.",
    )
    verify_timeout: float = _flag(
        float_flag(0, MAX_DURATION_S, low_open=True),
        60.0,
        group="scores",
        help="Seconds per verify command (a timeout leaves the sample unscored).",
    )
    keep: str = _flag(
        choice_flag(("all", "passed"), optional=False),
        "all",
        group="scores",
        help="all, or passed: only samples whose check passed go to trajectories.jsonl (the rest to discarded.jsonl: failed_check, scorer_error, unscored).",
    )
    stop_after_passes: int | None = _flag(
        int_flag(1, optional=True),
        group="scores",
        help="Once a row has this many passing samples, its samples not yet started are not run (recorded as skipped_after_passes; not run by --resume either, unless it raises this: then while the row has fewer passes).",
    )
    judge_model: str | None = _flag(
        text_flag(), group="scores", help="Model id of the judge (--scorer=judge)."
    )
    judge_base_url: str | None = _flag(
        text_flag(), group="scores", help="The judge's endpoint; default --base_url."
    )
    judge_api_key_env: str = _flag(
        text_flag(optional=False),
        "JUDGE_API_KEY",
        group="scores",
        help="Environment variable holding the judge's key (default JUDGE_API_KEY; without it, the run's own key when the judge uses the run's endpoint).",
    )

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_flags(cls, **flags: Any) -> RunConfig:
        """Parse and check every flag, then the combinations and paths; raises UsageError."""
        unknown = sorted(set(flags) - set(cls.flag_names()))
        if unknown:
            raise UsageError(unknown_flag_message(unknown[0], cls.flag_names()))
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = flags.get(field.name, field.default)
            values[field.name] = field.metadata["parse"](raw, field.name)
        config = cls(**values)
        config.load_tool_files()
        if not config.list_distributions:
            config.check()
        return config

    def load_tool_files(self) -> None:
        """Read and check --mcp_config, and install --distribution_file's distributions (usable by name).

        Runs for --list_distributions too. Plugin toolsets (entry points) are known here already.
        """
        from batchrun.distributions import use_file_distributions

        self.mcp_servers  # noqa: B018  (reads and checks the file now)
        use_file_distributions(self.file_distributions)

    def check(self) -> None:
        """The checks that look beyond one flag: combinations, names that must exist, paths."""
        from batchrun.distributions import get_distribution
        from batchrun.prompt.sandboxes import backend_class

        if not self.dataset_file:
            raise UsageError(
                '--dataset_file is required (a JSONL file with one {"prompt": ...} object per line)'
            )
        if self.batch_size is None:
            raise UsageError(
                "--batch_size must be a positive integer (prompts per batch file); it is required"
            )
        if not self.run_name:
            raise UsageError("--run_name is required (output goes to <output_dir>/<run_name>/)")
        try:
            dist = get_distribution(self.distribution)
        except ValueError as exc:
            raise UsageError(f"--distribution: {exc}") from None
        for toolset in dist.probabilities:
            problem = self.toolset_problem(toolset)
            if problem:
                raise UsageError(f"--distribution={self.distribution}: {problem}")
        try:
            backend_class(self.backend)
        except ValueError as exc:
            raise UsageError(f"--sandbox: {exc} (--sandbox or the TERMINAL_ENV variable)") from None
        cpus = usable_cpus()
        most_workers = WORKERS_PER_CPU * cpus
        if self.ray_address is None and self.num_workers > most_workers:
            raise UsageError(
                f"--num_workers={self.num_workers} is more worker processes than the "
                f"{cpus} CPUs this run may use can serve (at most {most_workers}, {WORKERS_PER_CPU} a core); "
                "for more prompts in flight raise --prompts_per_worker (threads in each worker)"
            )
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < self.num_workers:
            raise UsageError(
                f"--max_concurrent_requests={self.max_concurrent_requests} is below "
                f"--num_workers={self.num_workers}; raise it or use fewer workers"
            )
        if self.budget_tokens is not None and self.call_max_tokens >= self.budget_tokens:
            # A call's worst case (its prompt and this completion) could never fit: every prompt would fail.
            given = (
                f"--max_tokens={self.max_tokens}"
                if self.max_tokens is not None
                else "the derived --max_tokens"
            )
            raise UsageError(
                f"--budget_tokens={self.budget_tokens} cannot hold one model call: {given} lets each call's "
                f"completion alone take {self.call_max_tokens} tokens; raise --budget_tokens or lower --max_tokens"
            )
        if not is_http_url(self.base_url):
            raise UsageError(f"--base_url must be an http:// or https:// URL, got {_show(self.base_url)}")
        if url_credentials(self.base_url)[1] is not None and self.resolved_api_key:
            raise UsageError(
                "--base_url holds a user and password and an API key is set too: both would be the "
                "Authorization header. Give one: the key, or the URL's credentials (sent as HTTP Basic auth)"
            )
        self.check_machine_bounds()
        self.ephemeral_prompt  # noqa: B018  (reads and checks the file now)
        self.check_scoring()
        self.check_rates()
        self.check_flags_that_apply()
        check_output_dir(self.output_dir, self.run_name)
        if self.cwd_root is not None and not os.path.isdir(self.cwd_root):
            raise UsageError(f"--cwd_root {self.cwd_root}: not a directory")
        dataset = Path(self.dataset_file)
        if not dataset.is_file():
            raise UsageError(
                f"--dataset_file {self.dataset_file}: {not_a_file(dataset)} (a JSONL file, one row a line)"
            )
        self.prefill_messages  # noqa: B018  (reads and checks the file now, before anything starts)

    def check_machine_bounds(self) -> None:
        """Sizes this machine cannot honour fail now, naming the flag, not at every sandbox's start."""
        from batchrun.prompt.sandboxes.local.limits import host_limits  # reads /proc and cgroup files only

        try:
            # A local sandbox is under the runner's own cgroup (a container's, a CI job's): its limits
            # bind it too. A container engine's sandboxes are not.
            memory_bytes, pid_max = host_limits(own_cgroup=self.backend == "local")
            memory_mb = memory_bytes // (1 << 20)
        except (OSError, ValueError):
            memory_mb, pid_max = 1 << 24, PID_MAX_LIMIT
        if self.container_pids_limit > pid_max:
            raise UsageError(
                f"--container_pids_limit must be at most the processes this machine allows the runner "
                f"({pid_max}: kernel.pid_max and threads-max, or its cgroup's pids limit), "
                f"got {self.container_pids_limit}"
            )
        bounds = _host_bounds(self.backend)
        if "memory" in bounds and self.container_memory_mb > memory_mb:
            raise UsageError(
                f"--container_memory_mb must be at most this machine's memory ({memory_mb} MB, or the "
                f"memory limit of the runner's own cgroup when smaller), got {self.container_memory_mb}"
            )
        in_memory = self.container_memory_mb + self.container_disk_mb
        if "disk_in_memory" in bounds and in_memory > memory_mb:
            raise UsageError(
                f"--container_memory_mb + --container_disk_mb ({in_memory} MB) must be at most this machine's "
                f"memory ({memory_mb} MB): the {self.backend} sandbox's files live in memory, under the same "
                "limit as its processes"
            )
        self.check_open_files()
        cpus = usable_cpus()
        if "cpus" in bounds and self.container_cpus > cpus:
            raise UsageError(
                f"--container_cpus must be at most the {cpus} CPUs this run may use (its affinity and "
                f"cgroup quota), got {self.container_cpus:g}"
            )

    def check_open_files(self) -> None:
        """The files each worker's prompts in flight hold at once must fit this machine's hard limit
        (``ulimit -Hn``; each process raises its soft limit itself): past it, prompts failed mid-run
        with "Too many open files", each after a paid model call."""
        from batchrun.run import open_files

        hard = open_files.hard_limit()
        need = open_files.needed(self.prompts_per_worker)
        if self.ray_address is None and hard is not None and need > hard:
            most = max(1, (hard - open_files.BASE) // open_files.PER_PROMPT)
            raise UsageError(
                f"--prompts_per_worker={self.prompts_per_worker} needs about {need} open files in each worker "
                f"process, more than this machine lets the runner open ({hard}: ulimit -Hn); lower "
                f"--prompts_per_worker (to at most {most}; --num_workers adds processes) or raise the hard limit"
            )

    def check_samples(self, samples: int, rows: int) -> None:
        """The run's samples (rows x --samples_per_prompt, or a row's own ``samples``) must fit in this
        machine's memory while they are planned: each is held as a job from the plan on (measured: about
        450 bytes; 1,000,000 of them took 520 MB and 14 s before the start check), so a typo such as
        --samples_per_prompt=1000 on a large dataset filled the machine before the first token."""
        from batchrun.prompt.sandboxes.local.limits import host_limits

        try:
            memory = host_limits(own_cgroup=True)[0]
        except (OSError, ValueError):
            return
        most = memory // 2 // SAMPLE_BYTES
        if samples > most:
            raise UsageError(
                f"--samples_per_prompt={self.samples_per_prompt} over the dataset's {rows:,} rows (with the rows' "
                f"own 'samples') makes {samples:,} samples, more than this machine's memory ({memory >> 20:,} MB) "
                f"can plan (at most {most:,}, about {SAMPLE_BYTES} bytes each): lower --samples_per_prompt, or "
                "run the dataset in parts (--max_samples, or split the file)"
            )

    def check_scoring(self) -> None:
        """The scoring flags together: a judge needs its model, --stop_after_passes its samples."""
        wants_judge = "judge" in self.scorer
        if wants_judge and not self.judge_model:
            raise UsageError("--scorer=judge needs --judge_model (and --judge_base_url, else --base_url)")
        if self.judge_base_url is not None and not is_http_url(self.judge_base_url):
            raise UsageError(
                f"--judge_base_url must be an http:// or https:// URL, got {_show(self.judge_base_url)}"
            )
        check_judge_key_env(self.judge_api_key_env)
        if wants_judge:  # the judge's URL None: the run's endpoint and key, which the run's own check covers
            check_judge_key(self.judge_api_key_env, self.judge_base_url, self.judge_api_key)

    def check_rates(self, prompts: int | None = None) -> None:
        """A request rate under which no prompt could finish: each worker gets its share of --max_rpm
        and spaces its requests evenly, so one request every 60 x workers / max_rpm seconds; a prompt
        slower than that between two calls runs into --prompt_timeout before its second call (every
        prompt failed, the first calls paid for, with --max_rpm=1e-300).

        ``prompts`` (the samples to run, once the plan knows them): a worker's prompts in flight share
        its turns, which are taken in order, so a prompt's second call waits for the first calls of all
        the others: one request every that many times the spacing."""
        if self.max_rpm is None:
            return
        spacing = 60.0 * self.num_workers / self.max_rpm
        if spacing >= self.prompt_timeout:
            raise UsageError(
                f"--max_rpm={self.max_rpm:g} with --num_workers={self.num_workers} lets each worker send one "
                f"request every {spacing:,.4g} s, not less than --prompt_timeout={self.prompt_timeout:g}: "
                "no prompt could make two model calls before its deadline; raise --max_rpm (at least "
                f"{60.0 * self.num_workers / self.prompt_timeout:.3g}) or lower --num_workers"
            )
        in_flight = min(self.prompts_per_worker, -(-(prompts or 1) // self.num_workers))
        if in_flight * spacing >= self.prompt_timeout:
            fits = math.ceil(self.prompt_timeout / spacing) - 1  # the most whose turns come round in time
            raise UsageError(
                f"--max_rpm={self.max_rpm:g} with --num_workers={self.num_workers} lets each worker send one "
                f"request every {spacing:,.4g} s, shared by the {in_flight} prompts in flight in it "
                f"(--prompts_per_worker={self.prompts_per_worker}): each prompt's next request comes "
                f"{in_flight * spacing:,.4g} s after its first, not less than --prompt_timeout="
                f"{self.prompt_timeout:g}: no prompt could make two model calls before its deadline, and "
                f"every first call would be paid for nothing; lower --prompts_per_worker (to at most {fits}) "
                "or raise --max_rpm"
            )

    def check_flags_that_apply(self) -> None:
        """A flag that does nothing with the others given is refused: it was meant to do something
        (a forgotten --resume, --scorer=judge or --local_isolation=none), and the run would not."""
        for name in ("force_resume", "rerun_discarded"):
            if getattr(self, name) and not self.resume:
                raise UsageError(f"--{name} applies only with --resume, which is not given")
        if "judge" not in self.scorer:
            given = judge_flags_given(self.judge_model, self.judge_base_url, self.judge_api_key_env)
            if given:
                raise UsageError(
                    f"--{given[0]} applies only with the judge scorer (--scorer=judge, or judge among the "
                    f"scorers), and --scorer is {','.join(self.scorer) or 'not given (the rows decide: verify, numeric or exact)'}"
                )
        if self.cwd_root is not None:
            from batchrun.prompt.sandboxes.local import local_isolation_available

            if self.backend != "local":
                raise UsageError(
                    f"--cwd_root applies only to the local sandbox without isolation; the sandbox is {self.backend}"
                )
            if self.local_isolation == "bwrap" or (
                self.local_isolation == "auto" and local_isolation_available()
            ):
                raise UsageError(
                    f"--cwd_root applies only with --local_isolation=none (rows' cwd are host directories "
                    f"then); with --local_isolation={self.local_isolation} each sandbox is isolated by "
                    "bubblewrap and a row's cwd is a directory inside it"
                )
        # A sandbox flag the backend takes nothing from: its options are the same with the flag's default.
        options_from, flags = backend_class(self.backend).options_from, self.sandbox_flags()
        for name, field in _SANDBOX_FLAG_FIELDS.items():
            default = RunConfig.__dataclass_fields__[name].default
            if getattr(self, name) == default:
                continue
            try:
                ignored = options_from(dataclasses.replace(flags, **{field: default})) == options_from(flags)
            except ValueError:  # options the backend refuses: sandbox_options() names them
                ignored = False
            if ignored:
                raise UsageError(
                    f"--{name} does nothing with --sandbox={self.backend}: that backend takes no such "
                    "setting; leave it out or choose a --sandbox that uses it"
                )

    @property
    def judge_api_key(self) -> str | None:
        """The judge's key: the variable --judge_api_key_env names, else the run's own key when the
        judge uses the run's endpoint (never a flag's text: flags show in ps)."""
        key = os.environ.get(self.judge_api_key_env) or None
        if key is None and (self.judge_base_url is None or self.judge_base_url == self.base_url):
            key = self.resolved_api_key
        return key

    def scoring_settings(self) -> Any:
        """How the workers judge samples (batchrun.scoring.ScoringSettings)."""
        from batchrun.scoring import JudgeSettings, ScoringSettings

        judge = None
        if self.judge_model:
            judge = JudgeSettings(
                model=self.judge_model,
                base_url=self.judge_base_url or self.base_url,
                api_key=self.judge_api_key,
            )
        return ScoringSettings(
            scorers=self.scorer,
            answer_pattern=self.answer_pattern,
            numeric_tolerance=self.numeric_tolerance,
            normalize=self.answer_normalize,
            verify_timeout_s=self.verify_timeout,
            judge=judge,
            keep=self.keep,
        )

    # -- values derived from the flags (computed, never stored apart from them)

    @functools.cached_property
    def ephemeral_prompt(self) -> str | None:
        """The ephemeral system prompt: --ephemeral_system_prompt, --ephemeral_system_prompt_file or
        the BATCH_RUNNER_EPHEMERAL_SYSTEM_PROMPT variable (one of them); never saved anywhere."""
        given = [
            name
            for name, value in (
                ("--ephemeral_system_prompt", self.ephemeral_system_prompt),
                ("--ephemeral_system_prompt_file", self.ephemeral_system_prompt_file),
                (EPHEMERAL_PROMPT_ENV, os.environ.get(EPHEMERAL_PROMPT_ENV)),
            )
            if value
        ]
        if len(given) > 1:
            raise UsageError(f"the ephemeral system prompt is given twice ({' and '.join(given)}): give one")
        if self.ephemeral_system_prompt_file:
            try:
                text = read_flag_file(self.ephemeral_system_prompt_file)
            except ValueError as exc:
                raise UsageError(f"--ephemeral_system_prompt_file {exc}") from None
            if not text.strip():  # a redirect that failed, a wrong file: the run would go without the prompt
                raise UsageError(
                    f"--ephemeral_system_prompt_file {self.ephemeral_system_prompt_file}: the file is empty"
                )
            return text
        return self.ephemeral_system_prompt or os.environ.get(EPHEMERAL_PROMPT_ENV) or None

    @property
    def call_max_tokens(self) -> int | None:
        """Each call's completion limit: --max_tokens, or with a budget :data:`DERIVED_MAX_TOKENS` (at most
        a tenth of --budget_tokens; a call's worst case must be finite for the budget to be a cap), or
        None (the endpoint's own)."""
        if self.max_tokens is not None:
            return self.max_tokens
        if self.budget_tokens is not None:  # a tenth of the budget at most: several calls must fit in it
            return max(64, min(DERIVED_MAX_TOKENS, self.budget_tokens // 10))
        if self.budget_usd is not None:
            return DERIVED_MAX_TOKENS
        return None

    @property
    def backend(self) -> str:
        return self.sandbox or os.environ.get("TERMINAL_ENV") or DEFAULT_BACKEND

    @property
    def is_mock(self) -> bool:
        return self.model == MOCK_MODEL

    @property
    def resolved_api_key(self) -> str | None:
        """--api_key, else OPENROUTER_API_KEY, else OPENAI_API_KEY."""
        key = self.api_key if self.api_key is not None else None
        key = key or os.environ.get("OPENROUTER_API_KEY") or os.environ.get("OPENAI_API_KEY")
        return key or None

    @property
    def run_dir(self) -> Path:
        # "~" as check_output_dir reads it: the shell leaves it in --output_dir=~/runs, and the run wrote
        # to a directory named "~" in the current one (which a later "rm -rf ~" would take for home).
        return Path(self.output_dir).expanduser() / self.run_name

    @functools.cached_property
    def mcp_servers(self) -> tuple[Any, ...]:
        """The --mcp_config's servers (``McpServer``), read and checked once; empty without the flag."""
        if not self.mcp_config:
            return ()
        from batchrun.prompt.tools.mcp import McpConfigError, load_config

        try:
            return load_config(self.mcp_config)
        except McpConfigError as exc:
            raise UsageError(f"--mcp_config {exc}") from None

    @functools.cached_property
    def file_distributions(self) -> dict[str, Any]:
        """The --distribution_file's distributions by name, checked against every known toolset."""
        if not self.distribution_file:
            return {}
        from batchrun.distributions import load_distribution_file
        from batchrun.prompt.tools.catalog import plugin_problems, toolset_names

        known = [*toolset_names(), *(s.toolset for s in self.mcp_servers), *plugin_problems()]
        try:
            return load_distribution_file(self.distribution_file, known)
        except ValueError as exc:
            raise UsageError(f"--distribution_file {exc}") from None

    def toolset_names(self) -> list[str]:
        """Every toolset a distribution or a dataset row may name in this run: built in, plugins, MCP servers."""
        from batchrun.prompt.tools.catalog import toolset_names

        names = toolset_names()
        return names + [s.toolset for s in self.mcp_servers if s.toolset not in names]

    def toolset_problem(self, name: str) -> str | None:
        """Why a toolset named by a distribution or a row cannot run here (None: it can): unknown, or its
        plugin failed to load. The run stops (exit 2) on it."""
        from batchrun.prompt.tools.catalog import plugin_problems

        broken = plugin_problems()
        if name in broken:
            return f"toolset {name!r} comes from a plugin that cannot be loaded: {broken[name]}"
        if name not in self.toolset_names():
            return f"unknown toolset {name!r} (known: {', '.join(self.toolset_names())})"
        return None

    def tool_sources_manifest(self) -> dict[str, Any]:
        """For the manifest: digests of --mcp_config and --distribution_file (the config holds secrets),
        the run's distribution as data, and every tool a record's tool_stats lists."""
        from batchrun.distributions import get_distribution
        from batchrun.prompt.tools.catalog import known_tool_names

        def digest(path: str | None) -> str | None:
            return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None

        return {
            "distribution_probabilities": dict(get_distribution(self.distribution).probabilities),
            "known_tools": known_tool_names(),
            "mcp_config_sha256": digest(self.mcp_config),
            "distribution_file_sha256": digest(self.distribution_file),
        }

    @functools.cached_property
    def prefill_messages(self) -> tuple[dict[str, Any], ...]:
        """The --prefill_messages_file's messages, read and checked once (by ``check``)."""
        return load_prefill(self.prefill_messages_file)

    def llm_config(self, base_url: str) -> LLMConfig:
        """The model client's settings; ``base_url`` is the endpoint really used (the fake model's for mock)."""
        return LLMConfig(
            model=self.model,
            base_url=base_url,
            api_key=self.resolved_api_key,
            max_tokens=self.call_max_tokens,
            reasoning_effort=self.reasoning_effort,
            reasoning_disabled=self.reasoning_disabled,
            providers_allowed=self.providers_allowed,
            providers_ignored=self.providers_ignored,
            providers_order=self.providers_order,
            provider_sort=self.provider_sort,
            provider_allow_fallbacks=self.provider_allow_fallbacks,
            provider_data_collection=self.provider_data_collection,
            request_timeout_s=self.request_timeout,
            max_response_mb=self.max_response_mb,
            max_retries=self.max_retries,
            rate_limit_patience_s=self.endpoint_grace,
            dialect=self.endpoint_dialect,
            stream=self.stream,
            temperature=self.temperature,
            top_p=self.top_p,
        )

    def loop_limits(self) -> LoopLimits:
        return LoopLimits(
            max_turns=self.max_turns,
            prompt_timeout_s=self.prompt_timeout,
            tool_timeout_s=self.tool_timeout,
            max_prompt_tokens=self.max_prompt_tokens,
            max_prompt_usd=self.max_prompt_usd,
        )

    def sandbox_options(self) -> dict[str, Any]:
        """The backend's options from the sandbox flags, checked now by building (not starting) one sandbox."""
        from batchrun.prompt.sandboxes import SandboxSpec, backend_class, create_sandbox

        try:
            options = {
                **backend_class(self.backend).options_from(self.sandbox_flags()),
                **(self.sandbox_settings or {}),
            }
            create_sandbox(self.backend, SandboxSpec(run_name=self.run_name, prompt_index=-1), options)
        except ValueError as exc:
            raise UsageError(f"--sandbox={self.backend}: {exc}") from None
        return options

    def sandbox_flags(self) -> SandboxFlags:
        return SandboxFlags(
            default_image=self.default_image,
            local_isolation=self.local_isolation,
            cpus=self.container_cpus,
            memory_mb=self.container_memory_mb,
            pids_limit=self.container_pids_limit,
            prompt_timeout_s=self.prompt_timeout,
            disk_mb=self.container_disk_mb,
            network=self.sandbox_network,
            cwd_root=os.path.realpath(self.cwd_root) if self.cwd_root else None,
        )

    def secret_hashes(self) -> dict[str, str | None]:
        """Digests of the ephemeral system prompt and the prefill, for the manifest: never their text."""
        prefill = self.prefill_messages
        return {
            "ephemeral_system_prompt_sha256": _sha256(self.ephemeral_prompt)
            if self.ephemeral_prompt
            else None,
            "prefill_sha256": _sha256(json.dumps(prefill, sort_keys=True)) if prefill else None,
        }

    def secret_texts(self) -> list[str]:
        """Secrets besides the key and the environment: the credentials of --base_url and
        --judge_base_url (a password, a ?api_key=), MCP servers' env and header values and their URLs'
        credentials (batchrun.secrets)."""
        texts = [*url_secrets(self.base_url), *url_secrets(self.judge_base_url or "")]
        for server in self.mcp_servers:  # MCP env and header values
            texts += [v for v in server.secrets() if v] + url_secrets(server.url or "")
        texts += [self.judge_api_key or ""] if self.judge_model else []  # the judge's key, like the main one
        return [t for t in texts if t]

    def scaffolding_texts(self) -> list[str]:
        """The ephemeral prompt and the prefill contents: never saved, redacted from side files, but no
        secret (a sample echoing them is kept as the model wrote it; batchrun.secrets)."""
        texts = [self.ephemeral_prompt or ""]
        texts += [m["content"] for m in self.prefill_messages if isinstance(m.get("content"), str)]
        return [t for t in texts if t]


# The sandbox flags, as SandboxFlags names them (a backend's options_from takes those that apply to it).
_SANDBOX_FLAG_FIELDS = {
    "default_image": "default_image",
    "local_isolation": "local_isolation",
    "container_cpus": "cpus",
    "container_memory_mb": "memory_mb",
    "container_pids_limit": "pids_limit",
    "container_disk_mb": "disk_mb",
}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_output_dir(output_dir: str, run_name: str) -> None:
    """The output directory can hold this run: a directory (made if absent), writable, not a kernel file system."""
    path = Path(output_dir).expanduser()
    real = os.path.realpath(path)
    if any(real == p or real.startswith(p + "/") for p in _NOT_OUTPUT):
        raise UsageError(f"--output_dir {output_dir}: {real} is a kernel file system, not a place for data")
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output_dir {output_dir}: exists and is not a directory")
    existing = path.absolute()
    while not existing.exists():  # nothing is made yet: a refused run leaves no directory behind
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--output_dir {output_dir}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise UsageError(f"--output_dir {output_dir}: cannot write there: {exc.strerror or exc}") from None
    run_dir = path / run_name
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--run_name {run_name}: {run_dir} exists and is not a directory")


def load_prefill(path: str | None) -> tuple[dict[str, Any], ...]:
    if not path:
        return ()
    flag = "--prefill_messages_file"
    try:
        data = read_json_file(path)
    except ValueError as exc:
        raise UsageError(f"{flag} {exc}") from None
    return check_prefill(data, f"{flag} {path}")


def check_prefill(data: Any, where: str) -> tuple[dict[str, Any], ...]:
    """Prefill messages (a file's, or the Python API's ``prefill_messages``) checked; UsageError naming ``where``."""
    if not isinstance(data, list):
        raise UsageError(f"{where}: expected a JSON array of {{role, content}} messages")
    for i, msg in enumerate(data):
        if (
            not isinstance(msg, dict)
            or msg.get("role") not in ("system", "user", "assistant")
            or not isinstance(msg.get("content"), str)
        ):
            raise UsageError(
                f'{where}: message {i} must be {{"role": system|user|assistant, "content": string}}'
            )
    return tuple(data)


# ----------------------------------------------------------------------------- the command line


def unknown_flag_message(name: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    hint = f" (did you mean --{close[0]}?)" if close else "; python batch_runner.py --help lists every flag"
    return f"unknown flag --{name}{hint}"


def parse_argv(argv: list[str], bool_flags: Iterable[str], valid: Iterable[str]) -> dict[str, Any]:
    """A command line as raw flag values, checked strictly: no unknown flag, no stray word, no repeat.

    ``--name=value`` and ``--name value`` set a flag; a boolean flag alone means true, and
    ``--noname`` false (as Fire reads them). Values stay strings: :meth:`RunConfig.from_flags` types
    them. No message repeats a value given on the line, so the API key cannot leak through one.
    """
    bools, names = set(bool_flags), set(valid)
    flags: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        short = re.fullmatch(r"-([A-Za-z])(=.*)?", token)
        if short:  # Fire's one-letter alias of the only flag starting with that letter (--help shows them)
            owners = [n for n in names if n.startswith(short.group(1))]
            if len(owners) != 1:
                raise UsageError(f"-{short.group(1)} stands for no single flag; write the flag out in full")
            token = f"--{owners[0]}{short.group(2) or ''}"
        if not token.startswith("--") or token == "--":
            raise UsageError(
                f"unexpected argument at position {i} (every setting is a --flag=value; "
                "python batch_runner.py --help lists them)"
            )
        name, has_value, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name not in names and name.startswith("no") and name[2:] in bools and not has_value:
            name, has_value, value = name[2:], True, "false"
        if name not in names:
            raise UsageError(unknown_flag_message(name, names))
        if name in flags:
            raise UsageError(f"--{name} is given more than once")
        if not has_value:
            if name in bools:
                if i < len(argv) and argv[i].strip().lower() in (*TRUE_WORDS, *FALSE_WORDS):
                    value, i = argv[i], i + 1
                else:
                    value = "true"
            elif i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            else:
                raise UsageError(f"--{name} needs a value (--{name}=VALUE)")
        flags[name] = value
    return flags


# ----------------------------------------------------------------------------- main's flags, from the fields


def with_flag_signature(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn(**flags)`` RunConfig's flags as its signature and its docstring's ``Args:`` (each
    flag's ``[group] help``), so Fire's ``--help`` and ``inspect`` see every flag, each written once."""
    hints = typing.get_type_hints(RunConfig)
    fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name]
            )
            for f in dataclasses.fields(RunConfig)
        ],
        return_annotation=inspect.signature(fn).return_annotation,
    )
    lines = ["", "    Args:"]
    for f in dataclasses.fields(RunConfig):
        text = f"{f.name}: [{f.metadata['group']}] {f.metadata['help']}"
        lines += textwrap.wrap(text, 110, initial_indent=" " * 8, subsequent_indent=" " * 12)
    fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
    return fn


def _host_bounds(backend: str) -> tuple[str, ...]:
    """The limits ``backend`` takes from this machine (its declared ``host_bounds``); none for a
    backend that does not load (the run refuses it with the reason elsewhere)."""
    try:
        return backend_class(backend).host_bounds
    except ValueError:
        return ()
