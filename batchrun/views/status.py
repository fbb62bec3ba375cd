"""Print a run's live status (``status.json`` in the run directory), from any terminal.

    python -m batchrun.views.status data/<run_name>             # once
    python -m batchrun.views.status data/<run_name> --watch 5   # every 5 s until the run ends (Ctrl-C stops)
    python -m batchrun.views.status data/<run_name> --json      # the file plus the checks below, as JSON

The runner rewrites ``status.json`` every few seconds. Counters: ``done`` counts trajectories,
``failed``, ``discarded`` and ``skipped_budget`` the other outcomes; together they are the settled
part of ``total``. Times (``started_at``, ``updated_at``, ``last_event_at``) are Unix seconds
or ISO 8601 strings. Two checks are added: a run marked running whose process is gone from this
host is "not running", and one without an event for ``STALL_AFTER_S`` is flagged as stalled.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

from batchrun.run.run_dir import check_run_dir
from batchrun.secrets import terminal_safe
from batchrun.sharegpt import finite_number, finite_value, parse_json
from batchrun.storage import pid_alive
from batchrun.views.flags import ViewParser

STALL_AFTER_S = 60.0
# --watch's shortest refresh, in seconds: the runner rewrites status.json every few seconds, so a tenth of
# one is already more often than anything changes. The longest is the runner's longest duration (a week,
# batchrun.config.MAX_DURATION_S).
MIN_WATCH_S = 0.1
# What json.dumps(ensure_ascii=False) leaves raw and a terminal may obey (DEL, the C1 controls: \x9b is
# a CSI), and the two line separators some readers split a line at: written as \uXXXX, the same JSON.
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029]")
STATUS_NAME = "status.json"


def to_epoch(value: Any) -> float | None:
    """Unix seconds from a number or an ISO 8601 string (naive means local time); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return finite_number(value)
    if isinstance(value, str) and value.strip():
        try:
            return dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "–"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def fmt_count(n: float | None) -> str:
    """Exact below 100,000, then compact (1.23M): token counts grow long."""
    if n is None:
        return "–"
    if abs(n) < 100_000:
        return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


def fmt_usd(x: float | None) -> str:
    if x is None:
        return "–"
    return f"${x:,.2f}" if abs(x) >= 1 or x == 0 else f"${x:.4f}"


def checks(status: dict[str, Any], now: float, alive: bool | None = None) -> dict[str, Any]:
    """What the raw file does not say: progress, ages, and whether the run looks stalled or dead."""
    total = finite_value(status.get("total"))
    settled = sum(finite_value(status.get(k)) or 0 for k in ("done", "failed", "discarded", "skipped_budget"))
    # Before the first prompt settles, quiet time counts from the start: a run stuck there is stalled too.
    last_event = to_epoch(status.get("last_event_at")) or to_epoch(status.get("started_at"))
    updated = to_epoch(status.get("updated_at"))
    running = status.get("state") == "running"
    quiet_s = now - last_event if last_event is not None else None
    return {
        "settled": settled,
        "progress": settled / total if total else None,
        "updated_age_s": now - updated if updated is not None else None,
        "quiet_s": quiet_s,
        "stalled": bool(running and quiet_s is not None and quiet_s > STALL_AFTER_S),
        "pid_alive": alive,
        "not_running": bool(running and alive is False),
    }


def format_status(status: dict[str, Any], now: float, alive: bool | None = None) -> str:
    """A few readable lines about a run. ``now`` is Unix seconds; ``alive`` is whether the run's
    process exists (None: not checked, e.g. the run is on another host)."""
    c = checks(status, now, alive)
    state = str(status.get("state") or "unknown")
    started = to_epoch(status.get("started_at"))
    code = status.get("exit_code")
    shown = (
        f"{state} (exit code {code})" if type(code) is int and code != 0 else state
    )  # a stop, not a finish
    head = [f"Run {status.get('run_name') or '?'}: {shown}"]
    if status.get("pid") is not None:
        head.append(f"pid {status['pid']}" + (f" on {status['host']}" if status.get("host") else ""))
    if started is not None:
        head.append(f"started {fmt_duration(now - started)} ago")
    if c["updated_age_s"] is not None:
        head.append(f"updated {fmt_duration(c['updated_age_s'])} ago")
    lines = [" · ".join(head)]

    total = finite_value(status.get("total"))
    pct = f" ({c['progress']:.1%})" if c["progress"] is not None else ""
    progress = f"Progress: {fmt_count(c['settled'])} of {fmt_count(total)} prompts{pct}"
    parts = [
        f"{fmt_count(finite_value(status.get(k)) or 0)} {label}"
        for k, label in (("done", "done"), ("discarded", "discarded"), ("failed", "failed"))
    ]
    if finite_value(status.get("skipped_budget")):
        parts.append(f"{fmt_count(status['skipped_budget'])} not started (budget)")
    if finite_value(status.get("in_flight")) is not None:
        parts.append(f"{fmt_count(status['in_flight'])} in flight")
    lines.append(f"{progress} · {' · '.join(parts)}")

    rate, tpm = finite_value(status.get("rate_per_min")), finite_value(status.get("tokens_per_min"))
    eta = (
        "done"
        if state == "finished"
        else fmt_duration(finite_value(status.get("eta_s")))
        if state == "running"
        else "–"
    )
    lines.append(
        f"Rate: {fmt_count(rate) if rate is not None else '–'} prompts/min · "
        f"{fmt_count(tpm) if tpm is not None else '–'} tokens/min · ETA {eta}"
        + (
            f" · {fmt_count(status['rate_limit_pauses'])} rate-limit pauses"
            if finite_value(status.get("rate_limit_pauses"))
            else ""
        )
    )

    prompt_t, completion_t = (
        finite_value(status.get("prompt_tokens")),
        finite_value(status.get("completion_tokens")),
    )
    spend = [fmt_usd(finite_value(status.get("cost_usd")))]
    # Of the prompt tokens, those the endpoint served from its prompt cache and wrote to it (billed at other
    # prices; absent from status.json files written before they were counted, and when no endpoint said).
    cache = [
        f"{fmt_count(n)} {label}"
        for key, label in (("cached_tokens", "cached"), ("cache_write_tokens", "written to the cache"))
        if (n := finite_value(status.get(key)))
    ]
    prompt_part = f"{fmt_count(prompt_t)} prompt" + (f" ({', '.join(cache)})" if cache else "")
    spend.append(f"{prompt_part} + {fmt_count(completion_t)} completion tokens")
    unanswered = finite_value(status.get("unanswered_tokens"))
    if unanswered:  # attempts that failed mid-answer, perhaps billed: the budgets count them
        spend[-1] += f" + ~{fmt_count(unanswered)} of failed attempts"
    spend.append(
        f"{fmt_count(finite_value(status.get('api_calls')))} model calls · {fmt_count(finite_value(status.get('tool_calls')))} tool calls"
    )
    lines.append("Spend: " + " · ".join(spend))

    budget = status.get("budget") if isinstance(status.get("budget"), dict) else {}
    limits = []
    for limit_key, spent_key, fmt in (("usd", "spent_usd", fmt_usd), ("tokens", "spent_tokens", fmt_count)):
        limit, spent = finite_value(budget.get(limit_key)), finite_value(budget.get(spent_key))
        if spent is not None:  # as the budget counts: failed attempts and earlier invocations too
            extra = ("unanswered_tokens", "earlier_tokens") if limit_key == "tokens" else ("earlier_usd",)
            spent += sum(finite_value(budget.get(k)) or 0 for k in extra)
        if limit is not None:
            share = f" ({spent / limit:.0%})" if spent is not None and limit > 0 else ""
            hit = budget.get("reached") is True or (spent is not None and spent >= limit)
            reached = " REACHED: no new prompts are started" if hit else ""
            limits.append(f"{fmt(spent)} of {fmt(limit)}{share}{reached}")
    if limits:
        lines.append("Budget: " + " · ".join(limits))

    if state == "failed" and isinstance(status.get("error"), str):
        lines.append(f"FAILED: {status['error']}")
    if c["not_running"]:
        lines.append(
            f"WARNING: not running: state says running but process {status.get('pid')} is gone "
            "(killed or crashed); continue it with --resume"
        )
    elif c["stalled"]:
        lines.append(f"WARNING: stalled? no event for {fmt_duration(c['quiet_s'])} while running")
    if state == "running" and not c["not_running"] and (c["updated_age_s"] or 0) > STALL_AFTER_S:
        lines.append(
            f"WARNING: the status file has not been rewritten for {fmt_duration(c['updated_age_s'])}; "
            "the runner may be hung or gone"
        )
    return "\n".join(lines)


def local_alive(status: dict[str, Any]) -> bool | None:
    """Whether the run's process lives, when it ran on this host; None when that cannot be told."""
    pid = status.get("pid")
    if (
        status.get("host") not in (None, socket.gethostname())
        or isinstance(pid, bool)
        or not isinstance(pid, int)
    ):
        return None  # another host's, or no pid a process can have (a damaged file): cannot be told
    if pid <= 0:
        return None
    return pid_alive(status.get("pid"))


def read_status(run_dir: Path) -> dict[str, Any]:
    """The status file; retried once, as a reader may meet it between the runner's writes."""
    path = run_dir / STATUS_NAME
    for attempt in range(2):
        try:
            obj = parse_json(path.read_text(encoding="utf-8"))
            if isinstance(obj, dict):
                return obj
        except FileNotFoundError:
            raise
        except (OSError, ValueError):
            pass
        if attempt == 0:
            time.sleep(0.2)
    raise ValueError(f"{path} is not a JSON object")


def show(run_dir: Path, as_json: bool) -> dict[str, Any]:
    status = read_status(run_dir)
    now = time.time()
    alive = local_alive(status)
    if as_json:
        text = json.dumps({**status, "checks": checks(status, now, alive)}, ensure_ascii=False)
        print(_JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text), flush=True)
    else:
        # The run's name and its error (an endpoint's text) are the file's: shown, never obeyed.
        print(terminal_safe(format_status(status, now, alive)), flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = ViewParser(prog="python -m batchrun.views.status", description="Show a run's live status.")
    parser.add_argument("run_dir", type=Path, help="the run's directory, e.g. data/my_run")
    parser.add_argument(
        "--watch",
        metavar="N",
        help=f"refresh every N seconds until the run ends ({MIN_WATCH_S:g} to 604800, a week)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (one object a line with --watch)")
    args = parser.parse_args(argv)
    if args.watch is not None:
        from batchrun.config import MAX_DURATION_S, UsageError, float_flag

        # Only <= 0 was refused: inf and 1e30 printed a status, then an OverflowError traceback (the sleep's
        # timestamp); nan an "Invalid value NaN" naming no flag; 1e-300 read the file 4,000 times a second.
        try:
            args.watch = float_flag(MIN_WATCH_S, MAX_DURATION_S)(args.watch, "watch")
        except UsageError as exc:
            parser.error(str(exc))
    problem = check_run_dir(args.run_dir)
    if args.run_dir.exists() and not args.run_dir.is_dir():
        problem = f"{args.run_dir} is a file; name a run's directory (data/<run_name>)"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    clear = args.watch is not None and not args.json and sys.stdout.isatty()
    try:
        while True:
            if clear:
                print("\033[H\033[J", end="")
            status = show(args.run_dir, args.json)
            if args.watch is None or status.get("state") != "running" or local_alive(status) is False:
                return 0
            time.sleep(args.watch)
    except FileNotFoundError:
        print(
            f"error: no {STATUS_NAME} in {args.run_dir} (the run has not started yet, or its runner writes no status)",
            file=sys.stderr,
        )
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
