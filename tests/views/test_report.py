"""The HTML report (batchrun/views/report.py): numbers against statistics.json, escaping of hostile content,
streaming with a cap on the listed conversations, the CLI, and the page as headless Chromium renders it.
"""

from __future__ import annotations

import dataclasses
import html
import html.parser
import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from helpers import read_jsonl

import batch_runner
from batchrun.views import report

ROOT = Path(__file__).resolve().parents[2]
XSS_PROMPT = (
    "Check <script>alert(1)</script> then </script><!-- x --> and <img src=x onerror=alert(2)> [calls:2]"
)
PROMPTS = [
    "Write fib.py computing the first ten Fibonacci numbers and run it.",
    "List the files of the working directory.",
    "Count the words of a sentence you write to notes.txt.",
    XSS_PROMPT,
    "[no_reasoning] answer at once",
    "[error:500] this request fails",
    "[hallucinate] call a tool that does not exist",
    "[truncate] stop early",
]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run with the fake model: trajectories, discards (the hallucinated call's too), a failure, a partial."""
    base = tmp_path_factory.mktemp("report")
    dataset = base / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS), "utf-8")
    batch_runner.main(
        dataset_file=str(dataset),
        batch_size=3,
        run_name="demo",
        model="mock",
        output_dir=str(base / "data"),
        distribution="terminal_only",
        num_workers=2,
    )
    run_dir = base / "data" / "demo"
    report.write_report(run_dir)
    return run_dir


def _scored_run(tmp_path: Path, rows: list[dict], run_name: str, **flags) -> Path:
    """A real run of ``rows`` with the fake model, scored by `exact` on its `ANSWER:` line, one worker."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    args = dict(
        dataset_file=str(dataset), batch_size=2, run_name=run_name, model="mock", output_dir=str(tmp_path / "data"),
        distribution="terminal_only", num_workers=1, scorer="exact", answer_pattern="ANSWER: (.*)",
    )  # fmt: skip
    assert batch_runner.main(**{**args, **flags}) == 0
    return tmp_path / "data" / run_name


class Page(html.parser.HTMLParser):
    """Collects the ``data-stat`` numbers, table rows, start tags and script bodies of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stats: dict[str, str] = {}
        self.tags: list[str] = []
        self.scripts: list[tuple[dict, str]] = []
        self.hist_n: dict[str, int] = {}
        self.rows: dict[str, list[list[str]]] = {}  # table class -> rows of cell texts
        self._stat: str | None = None
        self._script: dict | None = None
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if "data-stat" in a:
            self._stat = a["data-stat"]
            self.stats[self._stat] = ""
        if "data-hist" in a:
            self.hist_n[a["data-hist"]] = int(a["data-n"])
        if tag == "script":
            self._script = a
            self.scripts.append((a, ""))
        if tag == "table":
            self._table = a.get("class", "")
            self.rows.setdefault(self._table, [])
        if tag == "tr" and self._table is not None:
            self.rows[self._table].append([])
        if tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None
        if tag == "td" and self._cell is not None:
            self.rows[self._table][-1].append("".join(self._cell))
            self._cell = None
        if tag == "table":
            self._table = None
        if tag == "div":
            self._stat = None

    def handle_data(self, data):
        if self._stat is not None:
            self.stats[self._stat] += data
        if self._script is not None:
            attrs, body = self.scripts[-1]
            self.scripts[-1] = (attrs, body + data)
        if self._cell is not None:
            self._cell.append(data)


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text("utf-8"))
    return page


def number(text: str) -> int:
    return int(text.replace(",", ""))


def payload(page: Page) -> dict:
    (body,) = [b for a, b in page.scripts if a.get("id") == "report-data"]
    return json.loads(body)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchrun.views.report", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


# ----------------------------------------------------------------------------- the page's content


def test_headline_numbers_match_the_run_files(demo_run: Path) -> None:
    stats = json.loads((demo_run / "statistics.json").read_text())
    page = parse(demo_run / "report.html")
    assert number(page.stats["trajectories"]) == stats["trajectories"] == 5
    assert number(page.stats["discarded"]) == stats["discarded"]["total"] == 2
    assert number(page.stats["failed"]) == stats["failed_attempts"]["total"] == 1
    # A call to a tool that does not exist makes the sample a discard at once, not a drop at merge.
    assert number(page.stats["dropped"]) == sum(stats["dropped_at_merge"].values()) == 0
    assert number(page.stats["no_reasoning_discards"]) == 1
    assert page.stats["reasoning_coverage"] == f"{stats['reasoning']['coverage']:.1%}"
    outcomes = {(kind, reason): number(n) for kind, reason, n in page.rows["narrow outcomes"][1:]}
    run_usage = dict(page.rows["narrow kv run-usage"][1:])
    assert number(run_usage["prompt_tokens"]) == stats["this_run"]["usage"]["prompt_tokens"] > 0
    assert outcomes == {
        ("trajectory", "completed"): stats["completed"],
        ("trajectory", "partial"): stats["partial"],
        ("discarded", "no_reasoning"): 1,
        ("discarded", "unknown_tool"): 1,
        ("failed attempt", "http_500"): 1,
    }


def test_tool_table_and_histograms_match_the_trajectories(demo_run: Path) -> None:
    stats = json.loads((demo_run / "statistics.json").read_text())
    page = parse(demo_run / "report.html")
    table = {row[0]: [number(c) for c in row[1:4]] for row in page.rows["narrow tools"][1:]}
    expected = {
        n: [s["count"], s["success"], s["failure"]] for n, s in stats["tool_stats"].items() if s["count"]
    }
    assert table == expected and "terminal" in table
    records = read_jsonl(demo_run / "trajectories.jsonl")
    assert page.hist_n == {"turns": len(records), "tokens": len(records)}
    tokens = [r["metadata"]["prompt_tokens"] + r["metadata"]["completion_tokens"] for r in records]
    assert number(page.stats["prompt_tokens"]) == sum(r["metadata"]["prompt_tokens"] for r in records)
    assert f"max {report.fmt_compact(max(tokens))}" in (demo_run / "report.html").read_text()
    settings = dict(page.rows["narrow kv settings"][1:])
    assert settings["model"] == "mock" and settings["distribution"] == "terminal_only"


def test_hostile_content_is_escaped(demo_run: Path) -> None:
    text = (demo_run / "report.html").read_text("utf-8")
    page = parse(demo_run / "report.html")
    # Only the page's own two scripts: nothing from a prompt or a tool result became markup.
    assert page.tags.count("script") == 2
    assert "img" not in page.tags
    for markup in ("<script>alert", "</script><!--", "<!-- x", "<img"):
        assert markup not in text
    (body,) = [b for a, b in page.scripts if a.get("id") == "report-data"]
    assert "<" not in body and "\u2028" not in body
    data = payload(page)
    xss = [it for it in data["items"] if it["p"] == XSS_PROMPT]
    assert len(xss) == 1
    human = [t["v"] for t in xss[0]["t"] if t["k"] == "h"]
    assert human == [XSS_PROMPT]  # decoded back exactly


def test_discarded_samples_are_listed_with_their_reason(demo_run: Path) -> None:
    items = payload(parse(demo_run / "report.html"))["items"]
    assert sorted(it["r"] for it in items if it["o"] == "discarded") == ["no_reasoning", "unknown_tool"]
    assert sorted(it["o"] for it in items if it["o"] != "discarded") == ["completed"] * 4 + ["partial"]


# --max_trajectories: spelt like every other flag of the runner and the views (which the README shows).
@pytest.mark.parametrize("flag", ["--max-trajectories", "--max_trajectories"])
def test_cli_writes_on_demand_atomically(demo_run: Path, flag: str) -> None:
    (demo_run / "report.html").unlink()
    done = cli(str(demo_run), flag, "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(demo_run / "report.html")
    assert not [p.name for p in demo_run.iterdir() if p.name.endswith(".tmp")]
    page = parse(demo_run / "report.html")
    assert len([it for it in payload(page)["items"] if it["o"] != "discarded"]) == 2
    assert "3 of 5 trajectories are not listed" in (demo_run / "report.html").read_text()
    report.write_report(demo_run)  # back to the default for the other tests


def test_cli_on_a_missing_directory(tmp_path: Path) -> None:
    done = cli(str(tmp_path / "nope"))
    assert done.returncode == 2 and "no run directory" in done.stderr


def test_cli_when_the_report_cannot_be_written(tmp_path: Path) -> None:
    # A run directory the page cannot be written into (a read-only mount, a full disk; here a
    # directory in report.html's place) ended in a WriteError traceback: one line naming the file.
    (tmp_path / "report.html").mkdir()
    (tmp_path / "batch_0.jsonl").write_text(json.dumps(synthetic_record(0)) + "\n")  # a run's
    done = cli(str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error: cannot write ") and str(tmp_path / "report.html") in done.stderr


def test_cli_refuses_a_directory_that_holds_no_run(tmp_path: Path, monkeypatch, capsys) -> None:
    # "" (the current directory) or an empty one got a report.html titled "Run report: ", exit 0.
    monkeypatch.chdir(tmp_path)
    for given, named in (("", "."), (str(tmp_path), str(tmp_path))):
        assert report.main([given]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {named} (the current directory) holds no run (no run_manifest.json")
    (tmp_path / "notes.txt").write_text("mine\n")
    assert report.main([str(tmp_path)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_cli_reports_a_run_killed_before_its_merge_holding_batch_files_only(tmp_path: Path) -> None:
    (tmp_path / "batch_3.jsonl").write_text(json.dumps(synthetic_record(0)) + "\n")
    done = cli(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert number(parse(tmp_path / "report.html").stats["trajectories"]) == 1


def test_cost_reported_by_the_endpoint(tmp_path: Path) -> None:
    """Against an endpoint that prices its answers, the report sums the records' metadata.usage.cost_usd."""
    from batchrun.fakes.fake_model import FakeModelServer

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3] + ["[calls:4] many"]))
    with FakeModelServer(cost_per_token=2e-6) as server:
        batch_runner.main(
            dataset_file=str(dataset),
            batch_size=2,
            run_name="priced",
            model="fake-model",
            base_url=server.base_url,
            api_key="sk-local-test",
            output_dir=str(tmp_path / "data"),
            distribution="terminal_only",
            num_workers=2,
        )
        endpoint_cost = server.stats()["cost_usd"]
    run_dir = tmp_path / "data" / "priced"
    page = parse(report.write_report(run_dir))
    costs = [r["metadata"]["usage"]["cost_usd"] for r in read_jsonl(run_dir / "trajectories.jsonl")]
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert page.stats["cost_usd"] == report.fmt_usd(sum(costs))
    assert sum(costs) == pytest.approx(endpoint_cost)  # nothing failed or was discarded here
    assert page.hist_n["cost"] == 4


# ----------------------------------------------------------------------------- large and partial runs


def synthetic_record(i: int, pad: int = 0) -> dict:
    """A small valid record; every third has ``metadata.usage``, every third the flat fields, the rest none."""
    meta: dict = {"batch_num": i // 100, "model": "m", "stop_reason": "final_answer"}
    if i % 3 == 0:
        meta["usage"] = {
            "calls": 2,
            "prompt_tokens": 100 + i,
            "completion_tokens": 10,
            "reasoning_tokens": 5,
            "cost_usd": 0.001,
            "retries": 1 if i % 2 else 0,
            "rate_limited": 0,
            "providers": ["ProvA" if i % 2 else "ProvB"],
        }
    elif i % 3 == 1:
        meta.update(prompt_tokens=50, completion_tokens=5)
    call = {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": "terminal", "arguments": '{"command": "ls"}'},
    }
    return {
        "prompt_index": i,
        "conversations": [
            {"from": "system", "value": 'pre <tools>\n[{"name": "terminal"}]\n</tools>'},
            {"from": "human", "value": f"prompt number {i} " + "x" * pad},
            {
                "from": "gpt",
                "value": '<think>\nhm\n</think>\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>',
                "tool_calls": [call],
            },
            {
                "from": "tool",
                "value": "<tool_response>\n"
                + json.dumps({"tool_call_id": f"c{i}", "name": "terminal", "content": {"error": "boom"}})
                + "\n</tool_response>",
            },
            {"from": "gpt", "value": "<think>\nok\n</think>\ndone"},
        ],
        "metadata": meta,
        "completed": True,
        "partial": False,
        "api_calls": 2 + i % 5,
        "toolsets_used": ["terminal"],
        "tool_stats": {"terminal": {"count": 1, "success": 0, "failure": 1}},
        "tool_error_counts": {"terminal": 1},
    }


def synthetic_run(run_dir: Path, n: int, pad: int) -> Path:
    """A run directory whose trajectories.jsonl holds ``n`` synthetic records (``pad`` bytes of text each)."""
    run_dir.mkdir()
    with (run_dir / "trajectories.jsonl").open("w") as fh:
        for i in range(n):
            fh.write(json.dumps(synthetic_record(i, pad)) + "\n")
    return run_dir


def test_the_page_is_written_a_part_at_a_time_not_held_whole(tmp_path: Path) -> None:
    """With 1,000 trajectories listed (500 kept, 500 discarded) the page is 8 MB, and writing it held it
    three or four times over (the data's JSON, its escaped copy, the page's concatenations, the redacted
    copy): now its sections and each trajectory's data are redacted and written as they come."""
    n, pad = 200, 20_000
    run_dir = synthetic_run(tmp_path / "big", n, pad)
    data = report.collect(run_dir, max_items=n)
    tracemalloc.start()
    try:
        report.write_report(
            run_dir, max_trajectories=n, redact=lambda text: text.replace("sk-", "[s]"), kept=data
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = (run_dir / "report.html").stat().st_size
    assert size > n * pad  # every trajectory is on the page
    assert peak < size / 2, f"peak {peak} writing a {size}-byte page: the page was held whole"
    assert len(payload(parse(run_dir / "report.html"))["items"]) == n


def test_large_run_streams_and_caps_the_list(tmp_path: Path) -> None:
    n, pad = 3000, 10_000
    run_dir = synthetic_run(tmp_path / "big", n, pad)
    file_size = (run_dir / "trajectories.jsonl").stat().st_size
    tracemalloc.start()
    try:
        report.write_report(run_dir, max_trajectories=40)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < file_size / 4, f"peak {peak} for a {file_size}-byte file: records were held in memory"
    text = (run_dir / "report.html").read_text()
    page = parse(run_dir / "report.html")
    assert len(payload(page)["items"]) == 40
    assert "2,960 of 3,000 trajectories are not listed" in text
    assert page.hist_n["turns"] == n
    with_tokens = [i for i in range(n) if i % 3 != 2]
    assert page.hist_n["tokens"] == len(with_tokens)
    assert page.hist_n["cost"] == n // 3
    assert f"{n - len(with_tokens):,} without a value" in text
    expected_prompt = sum(100 + i if i % 3 == 0 else 50 for i in with_tokens)
    assert number(page.stats["prompt_tokens"]) == expected_prompt
    assert page.stats["cost_usd"] == report.fmt_usd(0.001 * (n // 3))
    assert number(page.stats["retries"]) == sum(1 for i in range(0, n, 3) if i % 2)
    providers = {r[0]: number(r[1]) for r in page.rows["narrow providers"][1:]}
    assert providers == {"ProvA": 500, "ProvB": 500}
    tools = {row[0]: row[1:] for row in page.rows["narrow tools"][1:]}
    assert tools == {"terminal": ["3,000", "0", "3,000", "0.0%"]}
    assert payload(page)["systems"] == {
        "s0": {"v": 'pre <tools>\n[{"name": "terminal"}]\n</tools>', "tools": ["terminal"]}
    }


def test_a_hallucinated_tool_name_of_megabytes_is_cut_in_the_list(tmp_path: Path) -> None:
    # A model's made-up tool name may be as long as a whole reply. The list showed it whole three times
    # (the sample's tools, the call, the result): a 20 MB name made a 63 MB report.html.
    name = "t" * 1_000_000
    rec = synthetic_record(0, 0)
    gpt, tool = rec["conversations"][2], rec["conversations"][3]
    gpt["tool_calls"][0]["function"]["name"] = name
    gpt["value"] = gpt["value"].replace('"terminal"', json.dumps(name))
    tool["value"] = tool["value"].replace('"terminal"', json.dumps(name))
    rec["tool_stats"] = {
        "terminal": {"count": 0, "success": 0, "failure": 0},
        name: rec["tool_stats"]["terminal"],
    }
    rec["tool_error_counts"] = {"terminal": 0, name: 1}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    row = {"prompt": "prompt number 0 ", "row_key": "k", "sample_index": 0, "prompt_index": 0, "batch_num": 0}
    row.update(reason="unknown_tool", timestamp="2026-01-01T00:00:00", record=rec)
    (run_dir / "discarded.jsonl").write_text(json.dumps(row) + "\n")
    report.write_report(run_dir)
    assert (run_dir / "report.html").stat().st_size < 200_000
    (item,) = payload(parse(run_dir / "report.html"))["items"]
    shown = f"{'t' * report.MAX_NAME_CHARS}… [1,000,000 characters]"
    assert item["o"] == "discarded" and item["r"] == "unknown_tool"
    assert item["tools"] == {shown: 1}
    assert [c["n"] for t in item["t"] if t["k"] == "g" for c in t["c"]] == [shown]
    assert [r["n"] for t in item["t"] if t["k"] == "t" for r in t["r"]] == [shown]


def test_unmerged_run_reads_batch_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    (run_dir / "batch_0.jsonl").write_text(json.dumps(synthetic_record(0)) + "\n{torn\n")
    (run_dir / "batch_1.jsonl").write_text(json.dumps(synthetic_record(1)) + "\n")
    (run_dir / "status.json").write_text(json.dumps({"state": "running"}))
    text = report.write_report(run_dir).read_text()
    page = parse(run_dir / "report.html")
    assert number(page.stats["trajectories"]) == 2
    assert "not merged yet" in text and "still running" in text and "1 torn or invalid line(s)" in text


def _failing_run(run_dir: Path, n: int) -> Path:
    """``n`` kept samples of two rows, every one failed with its explanation and verify output."""
    run_dir.mkdir()
    with (run_dir / "trajectories.jsonl").open("w") as fh:
        for i in range(n):
            rec = synthetic_record(i)
            rec["metadata"].update(row_key=f"{i % 2:032x}", row_id=f"row-{i % 2}", sample_index=i // 2)
            rec["score"] = {
                "status": "failed",
                "value": 0.25,
                "passed": False,
                "scorer": "verify",
                "explanation": f"verify: exit 1 ({i})",
                "error": "",
                "verify_exit_code": 1,
                "verify_output": f"FAILED test_{i}\n" + "x" * 2000,
            }
            fh.write(json.dumps(rec) + "\n")
    return run_dir


def _entries(value: object, seen: set[int]) -> int:
    """Entries of every container (list, tuple, set, dict, dataclass) reachable from ``value``."""
    if id(value) in seen or isinstance(value, (str, bytes, int, float, Path)) or value is None:
        return 0
    seen.add(id(value))
    if isinstance(value, dict):
        return len(value) + sum(_entries(k, seen) + _entries(v, seen) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) + sum(_entries(v, seen) for v in value)
    if dataclasses.is_dataclass(value):
        return sum(_entries(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return 0


# A number or a (row, sample) per record, for the figures the page computes from them all (medians,
# the superseded discards); everything else the report holds is bounded.
PER_RECORD = {"turns", "tokens", "costs", "counted", "kept_at"}


def test_the_report_holds_no_scored_sample_beyond_what_it_lists(tmp_path: Path) -> None:
    """Every judged sample's (label, index, where, score) was held until the page was written: 100,000
    of them, with their explanations and verify output, held most of a run's end's 535 MB. The report
    now keeps counts (per row, per score value) and only the failing samples it lists."""
    held = {}
    for n in (40, 400):
        data = report.collect(_failing_run(tmp_path / f"run{n}", n), max_items=5)
        held[n] = sum(
            _entries(getattr(data, f.name), set())
            for f in dataclasses.fields(data)
            if f.name not in PER_RECORD
        )
    assert held[400] == held[40]
    report.write_report(tmp_path / "run400", max_trajectories=5)
    text = (tmp_path / "run400" / "report.html").read_text("utf-8")
    section = text[text.index('<section id="scores">') :]
    section = section[: section.index("</section>")]
    assert "Failing samples (400)" in section
    assert section.count('<details class="failing">') == 5 and "FAILED test_4\n" in section
    assert "395 more are not listed" in section
    page = parse(tmp_path / "run400" / "report.html")
    assert page.rows["scores"][1:] == [
        ["row-0", "200", "0", "0", "0.250"],
        ["row-1", "200", "0", "0", "0.250"],
    ]
    assert "0.25–0.25 score: 400 samples</title>" in section  # the histogram: one value, one bin


@pytest.mark.parametrize(
    "values",
    [
        [0.1] * 10,
        [1e16, 1.0, -1e16, 0.5],
        [0.1, 0.2, 0.3, 0.7, 1e-17, 0.9, 0.3333333333333333],
        [-0.0],
        [0.6666666666666666] * 7 + [1e-16] * 5,
    ],
)
def test_a_rows_mean_score_adds_as_sum_adds(values: list[float]) -> None:
    """The per-row table's mean, once ``sum(values) / len(values)`` over the row's samples held, now
    from a running total: the same float, on Pythons whose sum() compensates (3.12+) and those before."""
    row = report.RowScores()
    for v in values:
        row.add_value(v)
    assert row.mean() == sum(values) / len(values)


def test_a_crashed_run_is_not_reported_as_running(tmp_path: Path) -> None:
    # A run killed outright (kill -9, a lost terminal) leaves status.json saying "running": the
    # page said it "was still running" with numbers a snapshot, though its process was long gone.
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "crashed"
    run_dir.mkdir()
    (run_dir / "batch_0.jsonl").write_text(json.dumps(synthetic_record(0)) + "\n")
    status = {"state": "running", "pid": dead.pid, "host": socket.gethostname()}
    (run_dir / "status.json").write_text(json.dumps(status))
    text = report.write_report(run_dir).read_text()
    assert "still running" not in text
    assert f"process {dead.pid} is gone" in text and "--resume" in text
    # Alive, or on another host (the pid means nothing here), it is still said to be running.
    (run_dir / "status.json").write_text(json.dumps({**status, "pid": os.getpid()}))
    assert "still running" in report.write_report(run_dir).read_text()
    (run_dir / "status.json").write_text(json.dumps({**status, "host": "elsewhere"}))
    assert "still running" in report.write_report(run_dir).read_text()


@pytest.mark.parametrize(
    "damage",
    [
        {"scores": ["not", "a", "section"], "dropped_at_merge": [1, 2]},
        {"scores": {"pass_rate": 0.5, "pass_rate_95ci": None, "scored": None, "unscored": None,
                    "pass_at_k": ["x"], "mean_score": "high"}},
    ],
)  # fmt: skip
def test_a_statistics_json_of_another_shape_still_gets_its_page(tmp_path: Path, damage: dict) -> None:
    # statistics.json with sections of another shape (hand-edited, another tool's, damaged) ended
    # in a traceback (AttributeError, TypeError): the page is made from the run's records, the
    # figures it cannot read are left out.
    from helpers import run, write_rows

    rows = [{"prompt": "Say 42 [calls:0] [answer:42]", "answer": "42"}]
    run(None, write_rows(tmp_path / "d.jsonl", rows), tmp_path / "data")
    run_dir = tmp_path / "data" / "run"
    stats = json.loads((run_dir / "statistics.json").read_text())
    (run_dir / "statistics.json").write_text(json.dumps({**stats, **damage}))
    done = cli(str(run_dir))
    assert done.returncode == 0, done.stderr
    page = parse(run_dir / "report.html")
    assert number(page.stats["trajectories"]) == 1
    assert "pass_rate" not in page.stats  # not read from a section it cannot read


def test_empty_run_directory(tmp_path: Path) -> None:
    page = parse(report.write_report(tmp_path))
    assert number(page.stats["trajectories"]) == 0
    assert payload(page) == {"items": [], "systems": {}}


def test_script_json_escaping() -> None:
    hostile = {"a": "</script><script>alert(1)</script><!-- & \u2028 \u2029"}
    text = report.json_for_script(hostile)
    assert not set("<>&\u2028\u2029") & set(text)
    assert json.loads(text) == hostile


def test_histogram_bins() -> None:
    assert report.histogram([1, 2, 2, 4]) == [(1, 2, 1), (2, 3, 2), (3, 4, 0), (4, 5, 1)]
    bins = report.histogram([float(v) for v in range(0, 10_001, 7)])
    assert sum(c for _, _, c in bins) == len(range(0, 10_001, 7))
    assert all(hi - lo == bins[0][1] - bins[0][0] for lo, hi, _ in bins) and len(bins) <= 25
    assert report.histogram([0.5, 0.5]) == [(0.5, 0.5, 2)]
    # Scores: each value in the bin that starts at or below it (0.3 / 0.1 is 2.9999999999999996 in
    # floats, 1.0 // 0.1 is 9.0), and a top score of 1 in the last bin, closed, not in one of its own.
    scores = report.histogram([0.5, 0.5, 1.0, 0.3, 0.7, 0.0], 10)
    assert [(lo, c) for lo, _, c in scores if c] == [(0.0, 1), (0.3, 1), (0.5, 2), (0.7, 1), (0.9, 1)]
    assert scores[-1][:2] == (0.9, 1.0) and len(scores) == 10


# ----------------------------------------------------------------------------- in headless Chromium


@pytest.fixture
def report_page(browser, demo_run: Path):
    """The demo report opened from disk; any request other than the file itself is refused and kept."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    seen = {"requests": [], "errors": [], "dialogs": []}
    url = (demo_run / "report.html").as_uri()

    def route(r):
        if r.request.url == url:
            r.continue_()
        else:
            seen["requests"].append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda exc: seen["errors"].append(str(exc)))
    page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
    page.on("dialog", lambda d: (seen["dialogs"].append(d.message), d.dismiss()))
    page.goto(url)
    yield page, seen
    page.close()
    assert seen == {"requests": [], "errors": [], "dialogs": []}  # offline, no script error, no alert()


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.browser
def test_report_renders_in_chromium(report_page, demo_run: Path, tmp_path: Path) -> None:
    page, _ = report_page
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    width, height = png_size(shot)
    assert width == 1280 and height > 2000 and shot.stat().st_size > 50_000
    assert page.inner_text("#run-name") == "demo"
    outcomes = page.inner_text("#outcomes")
    assert "trajectories" in outcomes and "http_500" in outcomes and "unknown_tool" in outcomes
    assert page.inner_text('[data-stat="trajectories"]') == "5"
    assert page.locator("svg.chart").count() >= 4  # outcomes, tools, reasoning, two histograms
    assert "terminal" in page.inner_text("#tools")
    assert page.inner_text("#shown") == "7 of 7 shown"
    assert page.locator("details.traj").count() == 7


@pytest.mark.browser
def test_conversation_unfolds_and_shows_markup_as_text(report_page) -> None:
    page, _ = report_page
    item = page.locator("details.traj", has_text="onerror=alert(2)")
    item.locator("summary").first.click()
    human = item.locator(".turn.human .text")
    assert human.inner_text() == XSS_PROMPT  # shown as text, not run as markup
    call = item.locator("details.call").first
    args = call.locator("pre")
    assert not args.is_visible()
    assert call.locator("summary").inner_text().startswith("⚙ terminal(")
    call.locator("summary").click()
    assert args.is_visible() and '"command"' in args.inner_text()
    result = item.locator("details.result").first
    result.locator("summary").click()
    assert "exit_code" in result.locator("pre").inner_text()
    assert item.locator("details.think").count() == 3  # one reasoning fold per assistant turn


@pytest.mark.browser
def test_filter_box_and_outcome_select(report_page) -> None:
    from playwright.sync_api import expect

    page, _ = report_page
    visible = page.locator("details.traj:visible")
    page.fill("#filter", "ALERT(1)")
    expect(page.locator("#shown")).to_have_text("1 of 7 shown")
    assert visible.count() == 1 and "onerror" in visible.first.inner_text()
    page.fill("#filter", "")
    page.select_option("#outcome", "discarded")
    expect(page.locator("#shown")).to_have_text("2 of 7 shown")
    assert "discarded: no_reasoning" in " ".join(visible.nth(i).inner_text() for i in range(2))
    page.select_option("#outcome", "partial")
    assert "[truncate]" in visible.first.inner_text()
    page.select_option("#outcome", "")
    page.fill("#filter", "no such text anywhere")
    expect(page.locator("#shown")).to_have_text("0 of 7 shown")
    assert visible.count() == 0


def test_a_discarded_sample_with_a_lone_surrogate_still_gets_its_page(demo_run: Path, tmp_path: Path) -> None:
    """A model's broken text (a lone surrogate, kept escaped in the JSON line) cannot be UTF-8: the page
    shows U+FFFD for it instead of not being written at all."""
    import shutil

    run_dir = tmp_path / "demo"
    shutil.copytree(demo_run, run_dir)
    lines = (run_dir / "discarded.jsonl").read_text("utf-8").splitlines()
    row = json.loads(lines[0])
    row["record"]["conversations"][-1]["value"] = "broken \ud83d text"
    lines.append(json.dumps(row))  # ensure_ascii: the surrogate travels as the escape \ud83d
    (run_dir / "discarded.jsonl").write_text("\n".join(lines) + "\n", "utf-8")
    report.write_report(run_dir)
    assert "broken \ufffd text" in (run_dir / "report.html").read_text("utf-8")


def test_a_row_id_cannot_reverse_the_reports_own_words(tmp_path: Path) -> None:
    """A row id holding U+202E (right-to-left override) reversed everything after it to the end of its
    line: a failing sample's "#0 · kept · score 0.0 · exact: ..." read "... :tcaxe · 0.0 erocs · tpek · 0#"
    in Chromium, and the row's digest in the per-row table read backwards. The page shows such
    characters as their escapes (the JSONL files keep them)."""
    rows = [
        {"id": "\u202eevil", "prompt": "Say 4 [calls:0] [answer:5]", "answer": "4"},
        {"id": "iso\u2067late\u202bx", "prompt": "Say 2 [calls:0] [answer:3]", "answer": "2"},
    ]
    run_dir = _scored_run(tmp_path, rows, "rtl")
    assert read_jsonl(run_dir / "trajectories.jsonl")[0]["metadata"]["row_id"] in (
        "\u202eevil",
        "iso\u2067late\u202bx",
    )
    text = report.write_report(run_dir).read_text("utf-8")
    start = text.index('<script type="application/json" id="report-data">')
    shown = text[:start]  # the page's own markup; the JSON after it is read by the script, never laid out
    assert not any(ch in shown for ch in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
    assert "\\u202eevil" in html.unescape(shown) and "iso\\u2067late\\u202bx" in html.unescape(shown)


def test_a_report_of_the_batch_files_gives_the_pass_rate_of_the_samples_it_lists(tmp_path: Path) -> None:
    """A run killed (or still going) before its statistics.json: the report reads the batch files, but its
    pass rate, interval and pass@k came from statistics.json alone. A --resume killed mid-way showed the
    earlier invocation's figures (measured: 57.1% of n=210 over batch files holding 306 judged samples,
    174 passed); a first run killed showed none. They are now the records' own, as counted by hand."""
    rows = [
        {"id": f"r{i}", "prompt": f"Say {i} [calls:0] [answers:{i}|x]", "answer": str(i)} for i in range(6)
    ]
    run_dir = _scored_run(tmp_path, rows, "k", batch_size=3, seed_per_request=True)
    first = (run_dir / "statistics.json").read_text("utf-8")
    _scored_run(tmp_path, rows, "k", batch_size=3, seed_per_request=True, resume=True, samples_per_prompt=3)
    # As a kill -9 before the resume's merge leaves it: the first invocation's statistics.json and
    # trajectories.jsonl, the batch files newer.
    (run_dir / "statistics.json").write_text(first, "utf-8")
    os.utime(run_dir / "trajectories.jsonl", (1, 1))
    judged = [
        r["score"]["passed"]
        for path in sorted(run_dir.glob("batch_*.jsonl"))
        for r in read_jsonl(path)
        if r["score"]["passed"] is not None
    ]
    assert len(judged) == 18 and json.loads(first)["scores"]["scored"] == 6
    page = Page()
    page.feed(report.write_report(run_dir).read_text("utf-8"))
    assert page.stats["pass_rate"] == f"{sum(judged) / len(judged):.1%}"
    text = (run_dir / "report.html").read_text("utf-8")
    assert f"n={len(judged)}" in text and "pass@2" in page.stats  # 3 samples a row now, 1 before
    assert "From the samples recorded so far" in text
    assert "left for --resume" not in text  # the first invocation's 0: not said of the resume


DROP_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


@pytest.mark.parametrize("unreadable", ["directory", "failed.jsonl"])
def test_every_view_on_a_run_this_user_cannot_read_says_so(tmp_path: Path, unreadable: str) -> None:
    """Another user's run (the runner makes its directory mode 0700): report, export, score and compare
    ended in a PermissionError traceback, status said its status.json "is not a JSON object". Each now
    exits 2 naming what it cannot read. Root reads everything: its file-permission capabilities are
    dropped for the views' processes."""
    import shutil

    if os.geteuid() == 0 and not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to read as root without its file-permission override")
    prefix = DROP_DAC if os.geteuid() == 0 else []
    rows = [{"prompt": "Say 4 [calls:0] [answer:4]", "answer": "4"}, {"prompt": "[error:400] fails"}]
    run_dir = _scored_run(tmp_path, rows, "theirs", max_failure_rate=1.0)
    assert (run_dir / "failed.jsonl").is_file()
    target = run_dir if unreadable == "directory" else run_dir / "failed.jsonl"
    target.chmod(0)
    try:
        for view in (
            ["status", str(run_dir)],
            ["report", str(run_dir)],
            ["export", str(run_dir), "--format=openai", f"--out={tmp_path / 'out'}"],
            ["score", str(run_dir), "--scorer=includes"],
            ["compare", str(run_dir), str(run_dir)],
        ):
            done = subprocess.run(
                [*prefix, sys.executable, "-m", f"batchrun.views.{view[0]}", *view[1:]],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 2, (view, done.stderr)
            assert "Traceback" not in done.stderr, (view, done.stderr)
            assert done.stderr.startswith(f"error: cannot read {target}: Permission denied"), (
                view,
                done.stderr,
            )
    finally:
        target.chmod(0o700 if unreadable == "directory" else 0o600)
    assert not (tmp_path / "out").exists()


def test_the_runs_own_report_counts_its_discards_as_one_read_alone_does(tmp_path: Path) -> None:
    """The run's end hands the report each discarded.jsonl row from statistics' own pass, with its verdict on
    which rows stand (it read the file twice more for itself, and held every kept record's Line for that
    verdict). Its page is the page the report makes reading the run alone, with discards run again: four
    superseded (two samples discarded twice, then kept), one standing, and a malformed line."""
    from helpers import run, write_jsonl

    dataset = write_jsonl(tmp_path / "d.jsonl", ["terse [no_reasoning]", "fine", "brief [no_reasoning]"])
    out = tmp_path / "data"
    run(None, dataset, out)
    run(None, dataset, out, resume=True, rerun_discarded=True)  # both discarded again
    with (out / "run" / "discarded.jsonl").open("a") as fh:
        fh.write('{"reason": "no_reasoning"}\n')  # of no outcome row's shape: counted as invalid
    run(None, dataset, out, resume=True, rerun_discarded=True, keep_no_reasoning=True, force_resume=True)
    write_jsonl(dataset, ["terse [no_reasoning]", "fine", "brief [no_reasoning]", "late [no_reasoning]"])
    run(None, dataset, out, resume=True, force_resume=True)  # a new row, discarded: it stands
    run_dir = out / "run"
    assert len(read_jsonl(run_dir / "discarded.jsonl")) == 6
    own = (run_dir / "report.html").read_text("utf-8")
    alone = report.write_report(run_dir).read_text("utf-8")

    def page(text: str) -> str:
        return text.split(" · generated ", 1)[0] + text.split(" · generated ", 1)[1].split("</p>", 1)[1]

    assert page(own) == page(alone)
    data = report.collect(run_dir)
    # The first four superseded (both samples kept at last), the new row's standing, one line invalid.
    assert data.discarded == {"no_reasoning": 1} and data.invalid_lines == 1
