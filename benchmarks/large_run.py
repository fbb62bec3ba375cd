#!/usr/bin/env python3
"""Merge, statistics and the resume scan over a large run: time and peak memory.

    python benchmarks/large_run.py --records 100000             # generate (once), then measure
    python benchmarks/large_run.py --records 100000 --dir /tmp/br-large --keep

Generates ``--records`` synthetic trajectory records into ``batch_*.jsonl`` files of a run
directory (built with ``batchrun.prompt.trajectory.build_record`` from the real tool schemas, so they look
like real output: a system prompt with the tool schemas of 1.7-6.8 KB, 2 to 8 model turns with
reasoning, tool calls and results of 50 B to 4 KB), and the matching dataset file. Then each
step runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is its own:

* ``json.loads``: every line of every batch file parsed, nothing kept (the floor);
* ``load_dataset``: the dataset read into rows (both steps below need it);
* ``scan_finished``: the resume scan (``BatchRunner.scan_finished``);
* ``merge + statistics``: ``BatchRunner.merge`` and ``BatchRunner.statistics``, as a run ends;
* ``merge + statistics + report``: the merge fed to the scores and the report, as a run's end does it;
* ``scan + merge + statistics + report``: the same after the resume scan, as a ``--resume`` does it
  (the merge takes the scan's verdicts on the batch files, when the checkout has them);
* ``batch_runner.py --resume``: the whole command on a dataset whose prompts are all done
  (zero model calls: it loads, scans, merges and writes statistics).

Targets (issue 5): peak RSS under 200 MB, time within 3x of bare ``json.loads``. Ratios are of CPU
time (wall time is printed too): on a shared machine wall time moves with the neighbours' load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN_NAME = "large"
TOOLSET_CHOICES = (("terminal",), ("terminal", "file"), ("terminal", "file", "web"))
WORDS = (
    "alpha beta gamma delta config server module parse error build test deploy cache index "
    "request response thread process memory file path user data table query value result"
).split()


def _fed(kept):
    """``statistics``' ``kept`` (the report fed discarded.jsonl's rows by its pass), where the checkout has it."""
    import inspect

    from batchrun.run import finish

    return {"kept": kept} if "kept" in inspect.signature(finish.statistics).parameters else {}


# ----------------------------------------------------------------------------- generator


def _text(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def _tool_output(rng: random.Random, name: str) -> str:
    """A tool result as the registry returns it: JSON text of a dict."""
    size = int(rng.choice((60, 150, 400, 800, 1500, 3000)) * rng.uniform(0.7, 1.3))
    if name == "read_file":
        lines = [f"{i + 1:6d}|{_text(rng, rng.randint(10, 90))}" for i in range(max(1, size // 60))]
        body = {"content": "\n".join(lines), "total_lines": len(lines), "truncated": False}
    elif name == "write_file":
        body = {"bytes_written": size, "path": "notes/out.txt"}
    elif name == "web_search":
        body = {"results": [{"title": _text(rng, 40), "url": f"https://example.org/{i}", "snippet": _text(rng, 200)} for i in range(max(1, size // 300))]}  # fmt: skip
    else:
        body = {"output": _text(rng, size), "exit_code": rng.choice((0, 0, 0, 1)), "error": None}
    return json.dumps(body, ensure_ascii=False)


def _args(rng: random.Random, name: str) -> dict:
    if name == "terminal":
        return {"command": f"cd src && grep -rn {rng.choice(WORDS)} . | head -n 20"}
    if name == "write_file":
        return {"path": f"notes/{rng.choice(WORDS)}.md", "content": _text(rng, rng.randint(100, 1500))}
    if name == "web_search":
        return {"query": _text(rng, 40)}
    return {"path": f"src/{rng.choice(WORDS)}.py"}


def make_record(i: int, rng: random.Random, schemas: dict, known: list[str]) -> tuple[str, dict]:
    from batchrun.identity import row_key
    from batchrun.prompt.trajectory import build_record

    toolsets = rng.choice(TOOLSET_CHOICES)
    tools = schemas[toolsets]
    names = [t["function"]["name"] for t in tools]
    prompt = f"Task {i}: {_text(rng, rng.randint(60, 400))}"
    messages: list[dict] = [{"role": "user", "content": prompt}]
    for turn in range(rng.randint(1, 6)):
        calls = []
        for k in range(rng.choice((1, 1, 1, 2))):
            name = rng.choice(names)
            calls.append({"id": f"call_{turn}_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(_args(rng, name))}})  # fmt: skip
        messages.append({"role": "assistant", "content": _text(rng, rng.randint(0, 120)), "reasoning": _text(rng, rng.randint(150, 700)), "tool_calls": calls})  # fmt: skip
        for c in calls:
            name = c["function"]["name"]
            messages.append({"role": "tool", "tool_call_id": c["id"], "name": name, "content": _tool_output(rng, name)})  # fmt: skip
    messages.append({"role": "assistant", "content": _text(rng, rng.randint(100, 900)), "reasoning": _text(rng, rng.randint(100, 500))})  # fmt: skip
    api_calls = sum(1 for m in messages if m["role"] == "assistant")
    metadata = {
        "batch_num": 0, "timestamp": "2026-01-01T00:00:00", "model": "synthetic", "stop_reason": "final_answer",
        "duration_s": round(rng.uniform(5, 120), 3), "sandbox": "docker", "isolation": "docker",
        "sandbox_start_s": 0.4, "sandbox_stop_s": 0.2, "prompt_tokens": rng.randint(2000, 40000),
        "completion_tokens": rng.randint(200, 4000),
        # As the runner writes them (before, empty: every record read as another row's, held back by the
        # merge and read a second time, which a real run's records are not).
        "row_key": row_key(prompt), "row_id": "", "row_fields": "{}", "occurrence": 0,
    }  # fmt: skip
    record = build_record(
        prompt_index=i,
        messages=messages,
        tool_schemas=tools,
        known_tools=known,
        metadata=metadata,
        completed=True,
        partial=False,
        api_calls=api_calls,
        toolsets_used=list(toolsets),
    )
    return prompt, record


def generate(
    run_dir: Path, dataset: Path, n: int, batch_size: int, seed: int, discard_fraction: float = 0.0
) -> None:
    from batchrun.prompt.tools.catalog import known_tool_names, tools_for_toolsets
    from batchrun.run.recorder import set_aside_row  # a discard row as the recorder writes one

    schemas = {ts: [t.openai_schema() for t in tools_for_toolsets(list(ts))] for ts in TOOLSET_CHOICES}
    known = known_tool_names()
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    total = 0
    chosen = random.Random(seed + 1)  # which records are discards (the records are the same either way)
    with dataset.open("w", encoding="utf-8") as ds, (run_dir / "discarded.jsonl").open("w") as discards:
        for b in range(0, n, batch_size):
            with (run_dir / f"batch_{b // batch_size}.jsonl").open("w", encoding="utf-8") as fh:
                for i in range(b, min(b + batch_size, n)):
                    prompt, record = make_record(i, rng, schemas, known)
                    record["metadata"]["batch_num"] = b // batch_size
                    if chosen.random() < discard_fraction:
                        line = json.dumps(set_aside_row(record, "no_reasoning"), ensure_ascii=False) + "\n"
                        discards.write(line)
                    else:
                        line = json.dumps(record, ensure_ascii=False) + "\n"
                        fh.write(line)
                    total += len(line.encode("utf-8"))
                    ds.write(json.dumps({"prompt": prompt}, ensure_ascii=False) + "\n")
    manifest = {
        "model": "synthetic", "distribution": "default", "max_turns": 10, "seed": 0, "reasoning_effort": None,
        "reasoning_disabled": False, "sandbox": "local", "dataset_file": str(dataset),
    }  # fmt: skip
    (run_dir / "run_manifest.json").write_text(json.dumps(manifest, indent=2))
    print(
        f"generated {n} records, {total / 1e6:.0f} MB ({total / n / 1e3:.1f} KB/record) in "
        f"{(n + batch_size - 1) // batch_size} batch files, "
        f"{time.monotonic() - started:.0f} s"
    )


# ----------------------------------------------------------------------------- the steps (each in its own process)


def _config(output_dir: Path, dataset: Path):
    from batchrun.config import RunConfig

    return RunConfig.from_flags(
        dataset_file=str(dataset), batch_size=100, run_name=RUN_NAME, model="synthetic",
        base_url="http://127.0.0.1:9/v1", api_key="sk-large-run", output_dir=str(output_dir), resume=True,
    )  # fmt: skip


def step(name: str, output_dir: Path, dataset: Path) -> dict:
    run_dir = output_dir / RUN_NAME
    t0, c0 = time.perf_counter(), time.process_time()
    extra: dict = {}
    if name in ("json.loads", "json.loads, discards too"):
        n = 0
        paths = sorted(run_dir.glob("batch_*.jsonl"))
        if name != "json.loads":  # each discard row holds its record: as much to parse as a kept one
            paths.append(run_dir / "discarded.jsonl")
        for path in paths:
            with path.open("rb") as fh:
                for raw in fh:
                    json.loads(raw)
                    n += 1
        extra["records"] = n
    elif name == "read bytes":
        n = 0
        for path in sorted(run_dir.glob("batch_*.jsonl")):
            with path.open("rb") as fh:
                for raw in fh:
                    n += len(raw)
        extra["bytes"] = n
    else:
        from batchrun.run import finish
        from batchrun.run.dataset import load_dataset
        from batchrun.run.recorder import Recorder
        from batchrun.run.resume import scan_finished
        from batchrun.secrets import Redactor

        t0 = time.perf_counter()
        rows, _ = load_dataset(str(dataset))
        t_rows = time.perf_counter()
        extra["load_dataset_s"] = round(t_rows - t0, 2)
        config = _config(output_dir, dataset)
        recorder = Recorder(config.run_dir, RUN_NAME, Redactor(config.resolved_api_key))
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "scan_finished":
            done = scan_finished(config.run_dir, rerun_discarded=False)
            extra["finished"] = sum(done.values())
        elif name == "merge + statistics + report":  # as a run's end and a resume do it (cli.run_steps)
            recorder.track_rows(finish.pending_samples(rows, []))  # as cli.run_steps: every row tracked
            kept = finish.KeptFeed(config, rows, recorder)
            totals = finish.merge(
                config.run_dir, rows, recorder, written=kept, wanted=kept.wanted, excluded=kept.excluded
            )
            t_merge = time.perf_counter()
            stats = finish.statistics(
                config, rows, totals, recorder, "none", scores=kept.scores, **_fed(kept)
            )
            t_stats = time.perf_counter()
            finish.write_report(config.run_dir, config.report_max_trajectories, recorder.redact, kept.report)
            extra["merge_s"] = round(t_merge - t0, 2)
            extra["statistics_s"] = round(t_stats - t_merge, 2)
            extra["report_s"] = round(time.perf_counter() - t_stats, 2)
            extra["trajectories"] = stats["trajectories"]
        elif name == "scan + merge + statistics + report":  # as a --resume does it (cli.run_steps)
            from batchrun.run import resume

            checked = resume.CheckedFiles() if hasattr(resume, "CheckedFiles") else None
            given = {} if checked is None else {"checked": checked}
            todo = resume.resume_filter(
                rows, config.run_dir, recorder.sample_text, rerun_discarded=False, **given
            )
            recorder.track_rows(finish.pending_samples(rows, todo))  # as cli.run_steps
            if hasattr(checked, "take_counts"):  # as cli.run_steps: the scan's counts are not held meanwhile
                checked.take_counts()
            t_scan = time.perf_counter()
            kept = finish.KeptFeed(config, rows, recorder)
            totals = finish.merge(
                config.run_dir,
                rows,
                recorder,
                written=kept,
                wanted=kept.wanted,
                excluded=kept.excluded,
                **given,
            )
            stats = finish.statistics(
                config, rows, totals, recorder, "none", scores=kept.scores, **_fed(kept)
            )
            finish.write_report(config.run_dir, config.report_max_trajectories, recorder.redact, kept.report)
            extra["scan_s"] = round(t_scan - t0, 2)
            extra["trajectories"] = stats["trajectories"]
        elif name == "merge + statistics":
            recorder.track_rows(finish.pending_samples(rows, []))
            totals = finish.merge(config.run_dir, rows, recorder)
            t_merge = time.perf_counter()
            stats = finish.statistics(config, rows, totals, recorder, "none")
            extra["merge_s"] = round(t_merge - t0, 2)
            extra["statistics_s"] = round(time.perf_counter() - t_merge, 2)
            extra["trajectories"] = stats["trajectories"]
            extra["remaining"] = stats["remaining_for_resume"]
        else:
            raise SystemExit(f"unknown step {name}")
    return {
        "step": name,
        "seconds": round(time.perf_counter() - t0, 2),
        "cpu_s": round(time.process_time() - c0, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        **extra,
    }


def run_step(name: str, output_dir: Path, dataset: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--_step", name, "--dir", str(output_dir), "--dataset", str(dataset)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"step {name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cli(output_dir: Path, dataset: Path) -> dict:
    """``batch_runner.py --resume`` as a user runs it; peak RSS of the process (no pool starts)."""
    cmd = [
        sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=100",
        f"--run_name={RUN_NAME}", "--model=synthetic", "--base_url=http://127.0.0.1:9/v1",
        "--api_key=sk-large-run", f"--output_dir={output_dir}", "--resume",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, ru = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(out[-3000:], file=sys.stderr)
    return {
        "step": "batch_runner.py --resume",
        "seconds": round(seconds, 2),
        "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
        "peak_rss_mb": round(ru.ru_maxrss / 1024, 1),
        "exit_code": code,
        "model_calls": "0" if "0 attempted" in out else "?",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--batch_size", type=int, default=100, help="records per batch file")
    p.add_argument("--dir", default="/tmp/br-large", help="output dir (run dir is <dir>/large)")
    p.add_argument("--dataset", default=None, help="default: <dir>/prompts.jsonl")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--discard_fraction",
        type=float,
        default=0.0,
        help="this share of the samples written as discards (discarded.jsonl rows holding their records)",
    )
    p.add_argument("--regenerate", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument(
        "--no-cli", dest="cli", action="store_false", help="skip the batch_runner.py --resume step"
    )
    p.add_argument("--_step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    output_dir = Path(args.dir)
    dataset = Path(args.dataset) if args.dataset else output_dir / "prompts.jsonl"
    if args._step:
        print(json.dumps(step(args._step, output_dir, dataset)))
        return 0
    run_dir = output_dir / RUN_NAME
    discards = f"-{args.discard_fraction}" if args.discard_fraction else ""
    marker = output_dir / f".generated-{args.records}-{args.batch_size}-{args.seed}{discards}"
    if args.regenerate or not marker.exists():
        import shutil

        shutil.rmtree(output_dir, ignore_errors=True)
        generate(run_dir, dataset, args.records, args.batch_size, args.seed, args.discard_fraction)
        marker.touch()
    nbytes = sum(p.stat().st_size for p in run_dir.glob("batch_*.jsonl"))
    print(f"{args.records} records, {nbytes / 1e6:.0f} MB in {run_dir}; each step in a fresh process")
    steps = (
        "read bytes",
        "json.loads",
        *(("json.loads, discards too",) if (run_dir / "discarded.jsonl").exists() else ()),
        "scan_finished",
        "merge + statistics",
        "merge + statistics + report",
        "scan + merge + statistics + report",
    )
    results = [run_step(name, output_dir, dataset) for name in steps]
    if args.cli:
        results.append(run_cli(output_dir, dataset))
    base = next(r for r in results if r["step"] == "json.loads")
    print(f"\n{'step':<30}{'wall':>9}{'CPU':>9}{'CPU / json.loads':>18}{'peak RSS':>10}  details")
    for r in results:
        details = {k: v for k, v in r.items() if k not in ("step", "seconds", "cpu_s", "peak_rss_mb")}
        ratio = r["cpu_s"] / base["cpu_s"] if base["cpu_s"] else float("nan")
        print(
            f"{r['step']:<30}{r['seconds']:>8.2f}s{r['cpu_s']:>8.2f}s{ratio:>17.2f}x{r['peak_rss_mb']:>7.0f} MB  {details}"
        )
    ok_rss = all(r["peak_rss_mb"] < 200 for r in results)
    ok_time = all(
        r["cpu_s"] <= 3 * base["cpu_s"]
        for r in results
        if r["step"] in ("scan_finished", "merge + statistics")
    )
    print(
        f"\ntargets: peak RSS < 200 MB: {'met' if ok_rss else 'MISSED'}; scan_finished and merge + statistics "
        f"within 3x the CPU time of json.loads: {'met' if ok_time else 'MISSED'} (CPU time: the machine is shared, "
        "so wall time moves with the load)"
    )
    if not args.keep:
        import shutil

        shutil.rmtree(output_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
