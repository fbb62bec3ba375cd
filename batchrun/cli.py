"""The command line and the story of one run, step by step.

    python batch_runner.py --dataset_file=data/prompts.jsonl --batch_size=10 --run_name=my_run
    python batch_runner.py export data/my_run --format=openai --out=exported/   (trainer formats)
    batch-runner --dataset_file=...          (the installed console command: the same)

:func:`main` (Fire's, with every flag in its ``Args:``) builds one checked
:class:`~batchrun.config.RunConfig`; :func:`run` then takes the steps of a run, one call each:
load the dataset, open the run directory, filter for resume, plan, preflight, dispatch to the
workers, merge, statistics, report. The parent process is the only writer under ``data/<run_name>/``.
"""

import contextlib
import dataclasses
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.config import (
    RunConfig,
    UsageError,
    parse_argv,
    with_flag_signature,
)
from batchrun.distributions import format_distributions
from batchrun.identity import RowIdentity
from batchrun.prompt.attempt import RunTools, WorkerSettings
from batchrun.prompt.llm import dialect_warnings, safe_url
from batchrun.prompt.tools.catalog import known_tool_names
from batchrun.prompt.tools.config import ToolSettings, browser_config, run_tool_settings
from batchrun.prompt.tools.mcp import McpSetup
from batchrun.run import finish, open_files, resume
from batchrun.run.budget import CheckGate
from batchrun.run.dataset import Row, load_dataset
from batchrun.run.dispatch import Dispatch
from batchrun.run.endpoint_watch import EXIT_ENDPOINT_DEAD, EXIT_ENDPOINT_REFUSED, refused_means
from batchrun.run.forkserver import start_forkserver
from batchrun.run.journal import SpendJournal, read_journal, remove_journal
from batchrun.run.plan import make_plan, print_plan
from batchrun.run.preflight import (
    MAIN_KEY_HINT,
    check_endpoint,
    finish_sandbox_preflight,
    judge_key_hint,
    preflight_sandboxes,
    prepare_sandboxes,
    probe_mcp_servers,
    sweep_prepared,
    will_call_the_model,
)
from batchrun.run.recorder import Recorder, count_outcomes, damaged_books, earlier_runs, lost_runs, spend_of
from batchrun.run.resume import (
    CheckedFiles,
    all_samples,
    build_manifest,
    check_manifest,
    latest_round,
    read_manifest,
    rerun_round,
    resume_command,
    resume_filter,
    samples_of,
    without_api_key,
    without_flag,
)
from batchrun.run.run_dir import check_run_dir
from batchrun.secrets import Redactor, terminal_safe, url_secrets
from batchrun.storage import WriteError, read_json_object

EXIT_CANNOT_WRITE = 4  # an output file could not be written (disk full, read-only): the run stopped
EXIT_BUDGET_UNMEASURED = 6  # --budget_usd and an answer with no cost before any price: the run stopped
EXIT_WORKERS_LOST = 7  # the workers are gone (the Ray cluster died, the pool broke): the run stopped

# ----------------------------------------------------------------------------- the command line


@with_flag_signature
def main(**flags: Any) -> int:
    """Run a tool-using agent over every prompt of a JSONL dataset, each prompt in its own sandbox.

    Output goes to <output_dir>/<run_name>/: trajectories.jsonl, batch_N.jsonl, discarded.jsonl,
    failed.jsonl, checkpoint.json, statistics.json, status.json, run_manifest.json, report.html.
    `python batch_runner.py export <run_dir> --format=... --out=DIR` exports a run for trainers
    (`export --help`). Booleans take true/false, 1/0, yes/no or on/off. Every flag is checked before
    anything starts: a bad one exits 2. Exit codes: 0 done, 2 cannot start, 3 too many failures,
    4 an output file cannot be written, 5 the endpoint died (resume when it is back), 6 --budget_usd cannot
    be measured, 7 the workers are gone (a Ray cluster that died; resume when it is back), 8 the endpoint
    or the judge's refused the run's key or account during the run (resume once it is fixed), 130
    interrupted (called from Python, main returns the code instead of exiting).
    """
    config = None
    try:
        config = RunConfig.from_flags(**flags)
        if config.list_distributions:
            prepare_tools(config)
            print(format_distributions(toolset_listing()))
            return 0
        return run(config)
    except UsageError as exc:
        print(console_safe(f"error: {exc}", flags, config), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside the dispatch (preflight, merge): every written file is intact
        print("\nInterrupted. Continue with --resume.", file=sys.stderr)
        return 130


def console_safe(message: str, flags: dict[str, Any], config: RunConfig | None = None) -> str:
    """A message for the console with the run's secrets replaced: an endpoint's error may quote the key
    it was sent (a start check refused with "invalid key Bearer sk-..."), or the password of --base_url
    in the Basic auth header, and a flag's file or a server's answer may hold any secret of the
    environment. ``config``: the run's, when the flags made one (its redactor knows every secret);
    else the key and the URLs' credentials among ``flags``."""
    redact = None
    if config is not None:
        with contextlib.suppress(UsageError):  # a secret the config cannot read (a bad --mcp_config)
            redact = Redactor.for_config(config)
    if redact is None:
        redact = Redactor.for_endpoint(
            flags.get("api_key"), flags.get("base_url"), flags.get("judge_base_url")
        )
    return terminal_safe(redact(message))


def cli(argv: list[str] | None = None) -> None:
    """The command line: ``--help`` through Fire (from main's docstring); everything else parsed strictly.

    Fire itself would run the whole dataset before refusing a misspelled flag, accept ``false`` as
    true, and echo the command line (the API key included) in its usage message: flags are read
    here instead, and ``main`` gets them as strings that ``RunConfig.from_flags`` types and checks.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:  # python batch_runner.py export data/<run> --format=openai --out=DIR
        from batchrun.views.export import main as export_main

        raise SystemExit(export_main(argv[1:]))
    if any(a in ("-h", "--help", "-help") for a in argv):
        from fire import helptext, trace

        # Fire's own rendering of main's Args: docstring, on stdout (Fire itself writes help to stderr).
        text = helptext.HelpText(main, trace=trace.FireTrace(main, name="batch_runner.py"))
        # A list flag's empty default is Python's "()" to Fire: "none", as the README and SPEC say it.
        print(text.replace("Default: ()", "Default: none"))
        return
    names = RunConfig.flag_names()
    bools = [f.name for f in dataclasses.fields(RunConfig) if f.type in ("bool", "bool | None")]
    try:
        flags = parse_argv(argv, bools, names)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    resume.COMMAND_LINE = argv  # what the resume command repeats (a run from Python has none)
    try:
        code = main(**flags)
    finally:
        resume.COMMAND_LINE = None
    ray_pool = sys.modules.get("batchrun.run.ray_pool")
    if ray_pool is not None and ray_pool.left_hanging():
        # Ray's threads still wait on a GCS that hangs: the interpreter's exit would wait with them, or
        # crash in Ray's teardown (SIGSEGV, after the run's files were written). Everything is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


# ----------------------------------------------------------------------------- one run


def run(config: RunConfig) -> int:
    """One run of the configuration; returns the exit code.

    SIGTERM at any moment (preflight and the dataset load too) ends the run like Ctrl-C. The fake
    model (``--model=mock``) lives as long as the run.
    """
    # Only the main thread may install a handler: called from another (a service's worker thread), the
    # run goes on without one, and SIGTERM keeps whatever the process does with it.
    main_thread = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    previous_hook, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
    try:
        sandbox_options = check_before_start(config)
        mcp = prepare_tools(config)
        fake = None
        if config.is_mock:
            from batchrun.fakes.fake_model import FakeModelServer

            # Free: its answers say they cost nothing, so a --budget_usd dry run can count them.
            fake = FakeModelServer(free=config.budget_usd is not None).start()
        recorder = Recorder(
            config.run_dir,
            config.run_name,
            Redactor.for_config(config),
            verbose=config.verbose,
            budget_usd=config.budget_usd,
            budget_tokens=config.budget_tokens,
        )
        note = recorder.redact.start_note()  # secret-named variables holding a word: not redacted
        if note:
            print(note, file=sys.stderr)
        try:
            rows = read_dataset(config, recorder)  # a dataset with no usable row writes nothing
            recorder.lock()
            return run_steps(
                config, recorder, rows, fake.base_url if fake else config.base_url, sandbox_options, mcp
            )
        except WriteError as exc:
            return stop_cannot_write(recorder, exc)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM outside the dispatch (load, preflight, merge)
            _interrupt_handled()
            mark_interrupted(recorder)
            raise
        finally:
            recorder.unlock()
            if fake is not None:
                fake.stop()
    except KeyboardInterrupt:
        _interrupt_handled()  # before the default SIGTERM action is back: no re-sent signal may kill us
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous_term)
        sys.unraisablehook = previous_hook


def run_steps(
    config: RunConfig,
    recorder: Recorder,
    rows: list[Row],
    base_url: str,
    sandbox_options: dict[str, Any],
    mcp: McpSetup | None = None,
) -> int:
    """The steps of a run, in order, once its dataset is read; the run directory is locked by the caller."""
    manifest = open_run_dir(config, recorder)
    if config.budget_tokens is not None or config.budget_usd is not None:
        # Each call the budget lets go is journaled before it is sent (batchrun/run/journal.py).
        recorder.journal = SpendJournal(config.run_dir, recorder.invocation, recorder.started_at)
        recorder.journal.open()
    in_round, continued = None, False
    if config.resume:
        recorder.rerun_round = latest_round(config.run_dir)  # carried on in checkpoint.json
    if config.resume and config.rerun_discarded:
        recorder.rerun_planned = set()
        in_round, continued = rerun_round(config.run_dir, recorder.rerun_round)
    checked = CheckedFiles()  # the batch files the resume's scan read, for the merge: checked once
    todo = (
        resume_filter(
            rows,
            config.run_dir,
            recorder.sample_text,
            rerun_discarded=config.rerun_discarded,
            samples_per_prompt=config.samples_per_prompt,
            force=config.force_resume,
            dataset_file=config.dataset_file,
            stop_after_passes=config.stop_after_passes,
            exclude_partial=config.exclude_partial,
            # Which of them are discards run again: a run stopped before it ran them all says which did not.
            rerun=recorder.rerun_planned,
            in_round=in_round if continued else None,
            checked=checked,
        )
        if config.resume
        else all_samples(rows, config.samples_per_prompt)
    )
    recorder.track_rows(finish.pending_samples(rows, todo))  # checkpoint.json's completed prompts
    # checkpoint.json's batch_stats from the scan's counts: not a second read of every batch file
    counts = checked.take_counts()
    if config.resume and todo:
        recorder.batch_outcomes = count_outcomes(config.run_dir, *counts).batches
    del counts
    recorder.rerun_total = len(recorder.rerun_planned or ())
    if in_round is not None:
        recorder.start_round(in_round, continued)
    if todo and not config.ray_address:
        start_forkserver(
            config.backend
        )  # a no-op when the command line started it (batchrun/run/forkserver.py)
    llm = config.llm_config(base_url)
    for warning in dialect_warnings(llm):
        print(f"warning: {warning}", file=sys.stderr)
    tools_run = tool_settings(config, llm.base_url, llm.api_key)
    plan = make_plan(todo, config, config.run_dir, tools_run)
    recorder.counts.update({f"toolset:{t}": n for t, n in plan.offered.items()})
    recorder.counts.update({f"toolset_missing:{t}": n for t, n in plan.missing.items()})
    print_plan(rows, plan, config, llm.base_url)
    if plan.offered.get("browser") and (browser := browser_config(tools_run)) is not None:
        from batchrun.prompt.tools.browser_cgroup import describe
        from batchrun.prompt.tools.browser_sandbox import plan as browser_sandbox

        print(describe(browser))
        sandbox = browser_sandbox()
        said = sandbox.describe()
        print(said, file=sys.stderr if said.startswith("warning:") else sys.stdout)
    connect_ray(config, plan.prompts, recorder.redact)
    # The backend's checks come before the start check: a sandbox that cannot work here costs no token.
    preflighted = preflight_sandboxes(
        plan.batches,
        config.backend,
        sandbox_options,
        real_model=not config.is_mock,
        network=config.sandbox_network,
        dataset=config.dataset_file,
    )
    slots: list[int] = []  # llama-server's parallel slots, when the start check found one
    if will_call_the_model(preflighted.batches):
        # A USD cap needs each answer's cost (mock: free); without one it would count $0 and never stop.
        priced = [f"--{f}" for f in ("budget_usd", "max_prompt_usd") if getattr(config, f) is not None]
        needs_cost = priced[0] if priced and not config.is_mock else None
        checks = [(llm, "the endpoint")]
        judge = judge_llm_config(config, llm)
        if judge is not None and (judge.base_url, judge.model, judge.api_key) != (
            llm.base_url,
            llm.model,
            llm.api_key,
        ):
            # A judge that cannot answer (a wrong model name, key or endpoint) would leave every sample of
            # the paid run unscored: its own start check, before any prompt.
            checks.append((judge, "the judge's endpoint"))
        # Under a budget the check is a call like any: sent only when it fits, journaled, counted.
        gate = CheckGate(recorder) if recorder.journal is not None else None
        for endpoint, who in checks:
            # A server still loading its model (llama.cpp answers 503 meanwhile) is waited for, as a run
            # waits for an endpoint that died to come back.
            check = check_endpoint(
                endpoint,
                needs_cost=needs_cost,
                who=who,
                gate=gate,
                grace_s=config.endpoint_grace,
                on_slots=slots.append if endpoint is llm else None,
                key_hint=MAIN_KEY_HINT if endpoint is llm else judge_key_hint(config.judge_api_key_env),
            )
            if check.calls and gate is None:  # it cost what any call costs: the run's spend counts it
                recorder.add_check_spend(check.prompt_tokens, check.completion_tokens, check.cost_usd)
    # The backend's slow steps (Docker's pulls) after the start check: a wrong key costs seconds, not them.
    preflighted = finish_sandbox_preflight(preflighted)
    preflighted = prepare_sandboxes(
        preflighted, config.backend, run_name=config.run_name, workers_here=not config.ray_address
    )
    interrupted = False
    prepared = None
    limit = RequestLimit()
    try:
        # Only once the run can start: a rejected start leaves the name free.
        recorder.write_manifest(manifest)
        if preflighted.batches:
            secrets = tuple(sorted(getattr(recorder.redact, "values", ())))
            limit = request_limit(config, plan.prompts, slots[0] if slots else None, llm.base_url)
            settings = worker_settings(
                config, llm, preflighted.sandbox_options, tools_run, mcp, secrets, limit
            )
            dispatch = Dispatch(config, settings, recorder)
    except BaseException:  # Ctrl-C, SIGTERM, a full disk before any worker: what prepare_run made goes too
        sweep_prepared(preflighted, config.backend)
        raise
    if preflighted.batches:
        recorder.on_kept_line = prepared = finish.PreparedLines(config.report_max_trajectories)
        try:
            dispatch.run(preflighted.batches)
        except KeyboardInterrupt:
            _interrupt_handled()
            interrupted = True
            dispatch.wait_for_workers()
            dispatch.count_unsettled()  # calls in flight, ended unanswered: perhaps billed
            print(
                "\nInterrupted: stopped scheduling, workers ended. Finished prompts are saved.",
                file=sys.stderr,
            )
        except BaseException:  # e.g. an output file cannot be written: the workers are ended first
            with contextlib.suppress(Exception):
                dispatch.wait_for_workers()
            raise
    try:
        kept = finish.KeptFeed(config, rows, recorder)  # what statistics and the report take from the merge
        totals = finish.merge(
            config.run_dir,
            rows,
            recorder,
            exclude_partial=config.exclude_partial,
            samples_per_prompt=config.samples_per_prompt,
            written=kept,
            prepared=prepared,
            wanted=kept.wanted,
            excluded=kept.excluded,
            checked=checked,
        )
    finally:  # the workers end and the backend sweeps after them while the merge runs
        if preflighted.batches:
            dispatch.wait_for_workers()
    stats = finish.statistics(
        config,
        rows,
        totals,
        recorder,
        preflighted.isolation,
        preflighted.sandbox_facts,
        kept.scores,
        limit.as_dict(),
        kept=kept,
    )
    ran = dispatch if preflighted.batches else None
    stop = _stopped_early(config, recorder, ran, interrupted)
    # Interrupted is 130 whatever else stopped the run (a Ctrl-C while a dead endpoint's prompts drained
    # exited 5 with status.json saying "interrupted"); the stop's own message is still printed.
    code = (
        stop[0] if stop and not interrupted else finish.exit_code(stats, interrupted, config.max_failure_rate)
    )
    # "finished" after a stop too (exit 3, 5, 6, 7: the run's files are complete): exit_code tells them apart
    recorder.write_status("interrupted" if interrupted else "finished", force=True, exit_code=code)
    # statistics.json's runs hold every invocation's spend now, the journal's lost ones with them.
    remove_journal(config.run_dir, recorder.journal)
    finish.write_report(config.run_dir, config.report_max_trajectories, recorder.redact, kept.report)
    recorder.end_round()  # last: a kill before it leaves the round to be continued, not started anew
    finish.print_summary(
        config.run_dir,
        stats,
        recorder,
        endpoint_dead=stop is not None and stop[0] in (EXIT_ENDPOINT_DEAD, EXIT_ENDPOINT_REFUSED),
        endpoint_refused=stop is not None and stop[0] == EXIT_ENDPOINT_REFUSED,
        judge=ran is not None and ran.judge_stopped,
    )
    if stop:
        print(stop[1], file=sys.stderr)
        return code
    if code == finish.EXIT_FAILURE_RATE:
        print(finish.failure_rate_message(stats, config.max_failure_rate), file=sys.stderr)
    return code


def _stopped_early(
    config: RunConfig, recorder: Recorder, dispatch: Dispatch | None, interrupted: bool
) -> tuple[int, str] | None:
    """The exit code and the message of a run the dispatch stopped before its prompts ran out (the
    endpoint dead, a budget that cannot be measured, the workers lost), or None."""
    if dispatch is None:
        return None
    # The judge's endpoint (--scorer=judge) has its own watch: named, with its own flags.
    who, key, model = (
        ("the judge's endpoint", "the judge's key", "the judge's model (--judge_model)")
        if dispatch.judge_stopped
        else ("the endpoint", "the key", "the model")
    )
    probes = (  # decided at the grace's end, or as the last prompts ended (nothing left to run)
        "its probe as the run's last prompts ended ("
        if dispatch.stop_concluded
        else f"its probes for {config.endpoint_grace:g} s (--endpoint_grace; "
    )
    if dispatch.endpoint_refused is not None:
        return EXIT_ENDPOINT_REFUSED, (
            f"The run stopped: {who} refused its calls, and {probes}{dispatch.endpoint_refused}): "
            f"{refused_means(key, model, 'the run', '--endpoint_grace')}. When that is over, continue "
            "with:\n  " + recorder.redact(resume_command())
        )
    if dispatch.endpoint_dead:
        return EXIT_ENDPOINT_DEAD, (
            f"The run stopped: {who} stopped answering. When it is back, continue with:\n  "
            + recorder.redact(resume_command())
        )
    if dispatch.budget.unmeasured:
        return EXIT_BUDGET_UNMEASURED, (
            "The run stopped: --budget_usd could not be measured (an answer reported no cost). Continue "
            "with --budget_tokens, or once the endpoint reports costs:\n  "
            + recorder.redact(resume_command())
        )
    if dispatch.workers_lost and not interrupted:
        where = "the Ray cluster's workers are gone" if config.ray_address else "the worker pool broke"
        return EXIT_WORKERS_LOST, (
            f"The run stopped: {where}; their prompts are in failed.jsonl. When "
            + ("the cluster is back" if config.ray_address else "the cause is fixed")
            + ", continue with:\n  "
            + recorder.redact(resume_command())
        )
    return None


# ----------------------------------------------------------------------------- the steps


def stop_cannot_write(recorder: Recorder, exc: WriteError) -> int:
    """An output file cannot be written (disk full, read-only): the workers are ended already (the
    dispatch's ``finally``); say why in one line and leave status.json saying so when possible."""
    print(
        f"error: {exc}; the run stopped. What was recorded before is intact: "
        "free space (or make the directory writable) and continue with --resume",
        file=sys.stderr,
    )
    try:
        recorder.write_status("failed", force=True, error=str(exc), exit_code=EXIT_CANNOT_WRITE)
    except WriteError as status_exc:
        print(f"error: status.json could not say so either: {status_exc}", file=sys.stderr)
    return EXIT_CANNOT_WRITE


def mark_interrupted(recorder: Recorder) -> None:
    if not recorder.locked:  # the run directory is not ours (yet): write nothing there
        return
    try:
        recorder.write_status("interrupted", force=True, exit_code=130)
    except WriteError as exc:
        print(f"warning: {exc}", file=sys.stderr)


def check_before_start(config: RunConfig) -> dict[str, Any]:
    """What needs more than the flags themselves, before anything is written: the key, Ray, the backend options."""
    # The parent holds a connection per worker, the run's files and, for mock, the fake model's connections.
    in_flight = config.num_workers * (config.prompts_per_worker if config.is_mock else 1)
    open_files.raise_soft_limit(open_files.needed(in_flight))
    if config.api_key:
        print(
            "warning: --api_key is visible to other users of this machine (ps, /proc; on a Ray node, the "
            "dashboard's list of processes too); "
            "the OPENROUTER_API_KEY or OPENAI_API_KEY environment variable is safer",
            file=sys.stderr,
        )
    for line in key_destination_warnings(config):
        print(line, file=sys.stderr)
    for flag in ("base_url", "judge_base_url"):
        if url_secrets(getattr(config, flag) or ""):
            print(
                f"warning: --{flag} holds a credential (a password, or a key in its query), visible to other "
                "users of this machine (ps, /proc); it is redacted from every output",
                file=sys.stderr,
            )
    if config.ephemeral_system_prompt:
        print(
            "warning: --ephemeral_system_prompt is visible to other users of this machine (ps, /proc) for "
            "the whole run; --ephemeral_system_prompt_file or the BATCH_RUNNER_EPHEMERAL_SYSTEM_PROMPT "
            "environment variable is safer",
            file=sys.stderr,
        )
    base_url = config.base_url
    if (
        not config.resolved_api_key
        and not config.is_mock
        and ("openrouter.ai" in base_url or "api.openai.com" in base_url)
    ):
        raise UsageError(
            f"no API key for {safe_url(base_url)}: pass --api_key or set OPENROUTER_API_KEY (or OPENAI_API_KEY)"
        )
    if config.ray_address is not None:  # without Ray, say how to install it
        from batchrun.run.ray_pool import RaySetupError, check_address

        try:
            check_address(config.ray_address)
        except RaySetupError as exc:
            raise UsageError(str(exc)) from None
    return config.sandbox_options()


def key_destination_warnings(config: RunConfig) -> list[str]:
    """Where the run's key goes, when that may not be meant: OPENROUTER_API_KEY (read before
    OPENAI_API_KEY, as the reference reads them) sent to another host than OpenRouter, and any key sent
    without TLS to a host that is not this machine's. The endpoint given the key can use it; before, no
    word said so (an OpenRouter key in the environment went to whatever --base_url named)."""
    import ipaddress
    from urllib.parse import urlsplit

    if config.is_mock or not config.resolved_api_key:
        return []
    parts = urlsplit(config.base_url)
    host = (parts.hostname or "").lower()
    try:
        local = host == "localhost" or host.endswith(".localhost") or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if local:
        return []
    lines = []
    from_openrouter_var = not config.api_key and bool(os.environ.get("OPENROUTER_API_KEY"))
    if from_openrouter_var and host != "openrouter.ai" and not host.endswith(".openrouter.ai"):
        lines.append(
            f"warning: the key in OPENROUTER_API_KEY is sent to {host}, which is not OpenRouter; pass the key "
            "that endpoint should get with --api_key (or OPENAI_API_KEY, with OPENROUTER_API_KEY unset)"
        )
    if parts.scheme == "http":
        lines.append(
            f"warning: the key is sent to {host} without TLS (http://): anyone on the way can read it"
        )
    return lines


def read_dataset(config: RunConfig, recorder: Recorder) -> list[Row]:
    """The dataset's good rows; bad lines are reported by number (the first 20) and counted."""
    rows, problems = load_dataset(config.dataset_file, config.max_samples, scorers=config.scorer)
    for msg in problems[:20]:
        print(f"warning: skipped {msg}", file=sys.stderr)
    if problems.total > 20:
        print(f"warning: ... and {problems.total - 20} more bad lines", file=sys.stderr)
    recorder.counts["bad_lines"] = problems.total
    if (same := same_row_other_check(rows)) is not None:
        first, later, count = same
        print(
            f"warning: {config.dataset_file}:{later + 1}: the same prompt and settings as line {first + 1}, but "
            f"another answer, verify, verify_files or rubric ({count} such line(s)): one prompt with two "
            "checks. Each line's samples are judged, counted for pass@k and --stop_after_passes, and paired "
            "in views.compare, and listed in the report's per-row table, as its own, but the intervals take "
            "them for alike (one prompt); make their prompts differ if they are two tasks",
            file=sys.stderr,
        )
    config.check_samples(sum(samples_of(row, config.samples_per_prompt) for row in rows), len(rows))
    most = max((samples_of(row, config.samples_per_prompt) for row in rows), default=0)
    if config.stop_after_passes and rows and most <= config.stop_after_passes:
        # Never acts: a row's samples are skipped once it has K passes, and none has a sample after its K-th.
        print(
            f"warning: --stop_after_passes={config.stop_after_passes} stops nothing: no row has more than "
            f"{most} sample(s) (--samples_per_prompt, or a row's own samples), so every one runs",
            file=sys.stderr,
        )
    return rows


def same_row_other_check(rows: list[Row]) -> tuple[int, int, int] | None:
    """(first line, later line, how many later lines) of rows that share an identity
    (``RowIdentity.of_job``: prompt, image, cwd, own settings) but not their check, 0-based; None when none
    do. Such rows were silently one row's copies: pass@k took samples of both checks as one row's,
    views.compare paired them by order, and one's passes stopped the other's samples (now each is told
    apart by its line: ``RunScores``, ``compare.copies_by_line``, ``resume.PassKey``)."""
    first_of: dict[int, Row] = {}  # by the identity's hash: no identity held per row (100,000 rows)
    found, count = None, 0
    for row in rows:
        identity = RowIdentity.of_job(row)
        first = first_of.setdefault(hash(identity), row)
        if first is not row and first.check != row.check and RowIdentity.of_job(first) == identity:
            count += 1
            found = found or (first.index, row.index)
    return None if found is None else (*found, count)


def open_run_dir(config: RunConfig, recorder: Recorder) -> dict[str, Any]:
    """A new run needs a free name; a resume must keep the data-defining settings. Returns the manifest to write."""
    manifest = build_manifest(config)
    if recorder.holds_a_run() and not config.resume:
        raise UsageError(
            f"{config.run_dir} already holds a run; add --resume to continue it, or choose another --run_name"
        )
    problem = check_run_dir(config.run_dir) if config.resume else None
    if problem:
        raise UsageError(f"--resume: {problem}")
    if config.resume and not recorder.holds_a_run():
        print(
            f"warning: --resume: {no_run_here(config.run_dir)}; starting it from the first prompt",
            file=sys.stderr,
        )
    # The invocations killed before their statistics.json (kill -9, a lost machine) left their spend in
    # status.json only: read before this invocation writes its own, and carried in it (killed in turn, it
    # must not drop them from the books), then written to statistics.json at the end.
    earlier = earlier_runs(config.run_dir / "statistics.json")
    recorder.lost_runs = lost_runs(
        read_json_object(config.run_dir / "status.json"), earlier, read_journal(config.run_dir)
    )
    damaged = damaged_books(config.run_dir) if config.resume else None
    if damaged and (config.budget_tokens is not None or config.budget_usd is not None):
        # Counted as nothing, that spend would be budget again: only the user knows what it was.
        raise UsageError(
            f"--resume: {damaged}: what the earlier invocations of this run spent cannot be read, and the "
            "run's budget holds them. Restore the file, remove it to count what it held as nothing, or "
            "start a new --run_name"
        )
    if damaged:
        print(f"warning: --resume: {damaged}; run_totals leave out what it held", file=sys.stderr)
    if config.resume:  # a run's budget holds all its invocations: what the earlier ones spent counts
        recorder.earlier_tokens, recorder.earlier_usd = spend_of([*earlier, *recorder.lost_runs])
        problem = spent_budget(config, recorder.earlier_tokens, recorder.earlier_usd)
        if problem:
            raise UsageError(
                f"--resume: the earlier invocations of this run spent its budget: {problem}. A run's budget "
                "holds all its invocations; give a larger one to go on"
            )
    manifest_path = config.run_dir / "run_manifest.json"
    if manifest_path.exists():
        manifest = check_manifest(read_manifest(manifest_path), manifest, force=config.force_resume)
    return manifest


def spent_budget(config: RunConfig, tokens: int, usd: float) -> str | None:
    """Why the rest of the budget, after ``tokens`` and ``usd`` spent, holds no model call (None: it may):
    a call's worst case is at least its completion limit, and at the price the earlier calls paid."""
    limit = config.call_max_tokens or 0
    if config.budget_tokens is not None and config.budget_tokens - tokens < max(1, limit):
        left = max(0, config.budget_tokens - tokens)
        return (
            f"--budget_tokens={config.budget_tokens} (they spent {tokens:,} tokens; the {left:,} left hold no "
            f"call's completion limit of {limit:,})"
        )
    if config.budget_usd is not None:
        price = usd / tokens if tokens else 0.0
        if config.budget_usd - usd <= limit * price:
            return (
                f"--budget_usd={config.budget_usd:g} (they spent ${usd:.4f}; the ${max(0.0, config.budget_usd - usd):.4f} "
                f"left hold no call's completion limit of {limit:,} tokens at the ${price * 1e6:.4f} a million "
                "tokens they paid)"
            )
    return None


def no_run_here(run_dir: Path) -> str:
    """What --resume found at ``run_dir`` (no run), with the runs beside it whose name is close:
    "run or continue" scripts pass --resume every time, but a mistyped name starts a second run."""
    import difflib

    try:
        others = [
            d.name
            for d in run_dir.parent.iterdir()
            if d.name != run_dir.name and (d / "run_manifest.json").is_file()
        ]
    except OSError:
        others = []
    close = difflib.get_close_matches(run_dir.name, others, n=3, cutoff=0.6)
    near = f" (runs with a close name there: {', '.join(sorted(close))})" if close else ""
    return f"{run_dir} holds no run yet{near}"


def tool_settings(config: RunConfig, base_url: str, api_key: str | None) -> ToolSettings:
    """What tools beyond terminal/file need: the run's endpoint (vision, moa), run_dir (images), settings;
    with workers on this machine, the parent cgroup of their browsers (what dead runs left of theirs goes)."""
    browsers = ""
    if not config.ray_address:
        from batchrun.prompt.tools import browser_cgroup

        browser_cgroup.sweep_orphans()
        browsers = browser_cgroup.run_parent()
    return run_tool_settings(
        base_url=base_url,
        api_key=api_key,
        model=config.model,
        run_dir=str(Path(config.run_dir).resolve()),
        browser_cgroup=browsers,
    )


def connect_ray(config: RunConfig, prompts: int, redact: Callable[[str], str]) -> None:
    if not (config.ray_address and prompts):
        return
    from batchrun.run.ray_pool import RaySetupError, check_address, connect

    try:
        print(connect(check_address(config.ray_address), config.num_workers, shown_command(redact)))
    except RaySetupError as exc:
        raise UsageError(f"--ray_address: {exc}") from None


def shown_command(redact: Callable[[str], str]) -> str:
    """This command line as others may see it (a Ray cluster's job table): without --api_key and the
    ephemeral system prompt's text, every other secret redacted."""
    shown = "--ephemeral_system_prompt=<not shown>"  # as it was shown, unquoted
    args = without_flag(without_api_key(), "ephemeral_system_prompt", shown)[0]
    args = [arg if arg == shown else shlex.quote(arg) for arg in args]
    return redact(" ".join(["python", shlex.quote(sys.argv[0]), *args]))


LLAMA_SLOTS = "llama.cpp total_slots"  # what set a limit read from a llama-server's /props


@dataclasses.dataclass(frozen=True)
class RequestLimit:
    """The run's limit on model requests in flight, and what set it (statistics.json's
    ``requests_in_flight_limit``)."""

    per_worker: int | None = None  # None: no limit
    workers: int = 1
    set_by: str | None = None  # "--max_concurrent_requests" or "llama.cpp total_slots"
    endpoint_slots: int | None = None  # llama-server's --parallel, when it said

    def as_dict(self) -> dict[str, Any] | None:
        if self.per_worker is None:
            return None
        return {
            "requests": self.per_worker * self.workers,
            "per_worker": self.per_worker,
            "set_by": self.set_by,
            "endpoint_slots": self.endpoint_slots,
        }


def flag_request_limit(config: RunConfig) -> RequestLimit:
    """--max_concurrent_requests split evenly over the workers (rounded down), or no limit."""
    if config.max_concurrent_requests is None:
        return RequestLimit()
    share = config.max_concurrent_requests // config.num_workers
    return RequestLimit(share, config.num_workers, "--max_concurrent_requests")


def request_limit(config: RunConfig, prompts: int, slots: int | None, base_url: str) -> RequestLimit:
    """Model requests in flight: --max_concurrent_requests when given; else, against a llama-server
    with fewer slots than prompts in flight, its slots and one more (split over the workers, rounded
    up), so that one request waits in the server's queue, ready the moment a slot frees: with exactly
    its slots, the next request's sending and tokenizing came after each answer (2 slots, 20 prompts:
    28.2 s against 20.2 s). The other requests wait in the run's own queue, in order, and that wait
    does not count against the prompt's deadline (batchrun/prompt/limiter.py). Before, they all waited
    in the server's, where a wait cannot be told from a stall: 20 prompts in flight against a one-slot
    server all timed out at a --prompt_timeout that a lone prompt meets five times over."""
    workers = config.num_workers
    if config.max_concurrent_requests is not None:
        return dataclasses.replace(flag_request_limit(config), endpoint_slots=slots)
    in_flight = min(workers * config.prompts_per_worker, max(prompts, 1))
    share = None if slots is None else -(-(slots + 1) // workers)
    if share is None or share * workers >= in_flight:  # the server serves them all at once, near enough
        return RequestLimit(endpoint_slots=slots)
    print(
        f"llama.cpp at {safe_url(base_url)} serves {slots} request{'s' * (slots > 1)} at once (--parallel): "
        f"at most {share * workers} of the {in_flight} prompts in flight send one ({share} per worker; "
        "--max_concurrent_requests sets another limit); the others wait their turn, and that wait does not "
        "count against --prompt_timeout"
        + (
            f"; with {workers} workers, each sending one at least, {share * workers - slots} wait in the "
            "server's own queue, where it counts: fewer --num_workers with more --prompts_per_worker keep "
            "them in the run's"
            if share * workers > slots + 1
            else ""
        )
    )
    return RequestLimit(share, workers, LLAMA_SLOTS, slots)


def worker_settings(
    config: RunConfig,
    llm: Any,
    sandbox_options: dict[str, Any],
    tools_run: ToolSettings,
    mcp: McpSetup | None = None,
    secret_values: tuple[str, ...] = (),
    limit: RequestLimit | None = None,
) -> WorkerSettings:
    """What every worker gets, once: the prompt side's settings, derived from the config and preflight;
    ``secret_values``: the run's secrets (the recorder's Redactor's), which no tool result may carry
    on to the model. ``limit``: the run's requests in flight (:func:`request_limit`; None:
    :func:`flag_request_limit`)."""
    limit = flag_request_limit(config) if limit is None else limit
    return WorkerSettings(
        run_name=config.run_name,
        llm=llm,
        limits=config.loop_limits(),
        rpm_per_worker=None if config.max_rpm is None else config.max_rpm / config.num_workers,
        requests_per_worker=limit.per_worker,
        request_slots_endpoint_only=limit.set_by == LLAMA_SLOTS,
        sandbox_backend=config.backend,
        sandbox_options=sandbox_options,
        sandbox_network=config.sandbox_network,
        ephemeral_system_prompt=config.ephemeral_prompt,
        prefill_messages=config.prefill_messages,
        require_reasoning=not config.keep_no_reasoning,
        keep_invalid_tool_calls=config.keep_invalid_tool_calls,
        keep_empty_answers=config.keep_empty_answers,
        verbose=config.verbose,
        log_prefix_chars=config.log_prefix_chars,
        tool_settings=tools_run,
        tools=RunTools(mcp=mcp, known_tools=tuple(known_tool_names())),
        request_seed=config.seed if config.seed_per_request else None,
        budget_gate=config.budget_tokens is not None or config.budget_usd is not None,
        scoring=config.scoring_settings(),
        judge_llm=judge_llm_config(config, llm),
        secret_values=secret_values,
    )


def judge_llm_config(config: RunConfig, llm: Any) -> Any:
    """The judge model's client settings: the run's (timeouts, retries, dialect), another model and endpoint."""
    judge = config.scoring_settings().judge
    if judge is None:
        return None
    base_url = llm.base_url if config.judge_base_url is None else judge.base_url  # mock: the fake's URL
    return dataclasses.replace(
        llm,
        model=judge.model,
        base_url=base_url,
        api_key=judge.api_key,
        max_tokens=judge.max_tokens,
        reasoning_effort=None,
        reasoning_disabled=False,
        extra_body={},
        temperature=0.0,
        top_p=None,
        stream=False,
    )


def prepare_tools(config: RunConfig) -> McpSetup | None:
    """Before any token: report plugins that cannot load (once), list each MCP server's tools, and
    install those tools here (the workers install the same)."""
    from batchrun.prompt.tools import mcp as mcp_tools
    from batchrun.prompt.tools.catalog import ignored_plugins, plugin_problems

    for problem in plugin_problems().values():
        print(f"warning: toolset plugin not loaded, its tools are not offered: {problem}", file=sys.stderr)
    for why in ignored_plugins().values():
        print(f"warning: toolset plugin {why}; the built-in or MCP toolset is used", file=sys.stderr)
    setup = probe_mcp_servers(config) if config.mcp_servers else None
    try:
        mcp_tools.install(setup)
    except ValueError as exc:  # a tool name taken twice (two servers' names that read the same, a plugin's)
        raise UsageError(f"--mcp_config: {exc}") from None
    return setup


def toolset_listing() -> dict[str, list[str]]:
    """For --list_distributions: the toolsets beyond the built-ins (plugins, MCP servers), with their tools.
    Empty when there are none, so the listing is the reference's."""
    from batchrun.prompt.tools.catalog import all_tools, plugin_problems, toolset_names
    from batchrun.prompt.tools.registry import TOOLSETS, toolset_source

    tools = all_tools().values()
    listing = {
        name: [toolset_source(name), "tools: " + ", ".join(t.name for t in tools if t.toolset == name)]
        for name in toolset_names()
        if name not in TOOLSETS
    }
    for name, problem in plugin_problems().items():
        listing.setdefault(name, [f"NOT LOADED: {problem}"])
    return listing


# ----------------------------------------------------------------------------- SIGTERM as Ctrl-C

_TERM_PENDING = threading.Event()  # a SIGTERM whose KeyboardInterrupt no handler has taken yet


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM ends the run like Ctrl-C.

    Python drops an exception raised where it cannot propagate (a weakref callback during an import,
    a ``__del__``); until one of the run's handlers has taken it (``_interrupt_handled``), the signal
    is sent again."""
    if not _TERM_PENDING.is_set():
        _TERM_PENDING.set()
        threading.Thread(target=_resend_until_handled, name="sigterm-resend", daemon=True).start()
    raise KeyboardInterrupt


def _resend_until_handled() -> None:
    while True:
        time.sleep(0.5)
        if not _TERM_PENDING.is_set():
            return
        os.kill(os.getpid(), signal.SIGTERM)


def _interrupt_handled() -> None:
    _TERM_PENDING.clear()


def _quiet_unraisable(unraisable: Any) -> None:
    """A dropped KeyboardInterrupt is no error to print: the signal is sent again (see _interrupt)."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)
