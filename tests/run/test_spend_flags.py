"""The spend and rate flags end to end: ``batch_runner.main(...)`` in-process against the scripted fake
model. What is checked is what the provider would see (the fake server's counters: requests in flight,
request times, requests per prompt) and what the user reads back (records, statistics.json, status.json).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
from helpers import read_jsonl, run, write_jsonl

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.sharegpt import first_human

COST_PER_TOKEN = 1e-6  # the fake reports usage.cost = total_tokens * this


def by_prompt(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in records:
        out[first_human(rec["conversations"])].append(rec)
    return out


def read_json(path: Path) -> dict:
    return json.loads(path.read_text("utf-8"))


@pytest.fixture
def priced_server():
    """Answers carry usage.cost, as OpenRouter's do."""
    with FakeModelServer(latency_s=0, cost_per_token=COST_PER_TOKEN) as srv:
        yield srv


# ----------------------------------------------------------------------------- request rate and concurrency


def test_max_concurrent_requests_bounds_requests_in_flight(server, tmp_path):
    prompts = [f"Slow task {i} [slow:0.3] [calls:1]" for i in range(8)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(server, dataset, tmp_path / "data", num_workers=2, max_concurrent_requests=2)
    stats = server.stats()
    assert stats["max_in_flight"] <= 2  # without the flag: up to all 8 prompts at once
    assert stats["requests"] == 8 * 2
    records = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in records) == sorted(prompts)
    assert all(r["completed"] for r in records)
    # statistics.json says what limited them
    limit = read_json(tmp_path / "data" / "run" / "statistics.json")["this_run"]["requests_in_flight_limit"]
    assert limit == {
        "requests": 2,
        "per_worker": 1,
        "set_by": "--max_concurrent_requests",
        "endpoint_slots": None,
    }


@pytest.mark.parametrize(
    ("slots", "workers", "prompts", "flag", "per_worker"),
    [
        (1, 1, 20, None, 2),  # one request at the server, one in its queue; 18 wait here
        (2, 1, 20, None, 3),
        (1, 4, 20, None, 1),  # each worker sends one at a time: at least one a worker
        (3, 2, 20, None, 2),  # rounded up: no slot idles
        (16, 1, 16, None, None),  # the server serves every prompt in flight: no limit, as before
        (8, 1, 8, None, None),
        (1, 1, 1, None, None),  # one prompt to run
        (None, 1, 20, None, None),  # not a llama-server (or it did not say): as before
        (1, 1, 20, 4, 4),  # the user's --max_concurrent_requests wins
    ],
)
def test_against_a_llama_server_requests_in_flight_follow_its_slots(
    slots, workers, prompts, flag, per_worker, capsys, tmp_path
):
    from batchrun.cli import request_limit
    from batchrun.config import RunConfig

    config = RunConfig.from_flags(
        dataset_file=str(write_jsonl(tmp_path / "d.jsonl", ["hi"])), batch_size=1, run_name="r",
        num_workers=workers, prompts_per_worker=16,
        max_concurrent_requests=flag,
    )  # fmt: skip
    limit = request_limit(config, prompts, slots, "http://127.0.0.1:8080/v1")
    assert limit.per_worker == per_worker
    said = capsys.readouterr().out
    if per_worker is None:
        assert limit.as_dict() is None and not said
    elif flag is None:
        assert limit.as_dict() == {
            "requests": per_worker * workers,
            "per_worker": per_worker,
            "set_by": "llama.cpp total_slots",
            "endpoint_slots": slots,
        }
        assert f"serves {slots} request" in said and "does not count against --prompt_timeout" in said
        # More workers than the slots and one: the surplus waits in the server's queue, and is told so.
        assert ("fewer --num_workers" in said) == (per_worker * workers > slots + 1)


def test_max_rpm_spaces_the_requests(server, tmp_path):
    prompts = [f"Quick task {i} [calls:0]" for i in range(6)]  # one request each
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(server, dataset, tmp_path / "data", num_workers=1, max_rpm=120)  # 0.5 s apart
    stats = server.stats()
    assert stats["requests"] == 6
    span = stats["last_response_at"] - stats["first_request_at"]
    # Slots are 0.5 s apart from the first; a first request sent late on a loaded machine shortens the
    # span by its lateness, so one interval of slack. Unlimited, the fake answers all six in well under 1 s.
    assert span >= (6 - 2) * 0.5
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 6


def test_max_rpm_shared_by_more_prompts_in_flight_than_it_serves_exits_2_before_any_request(
    server, tmp_path, capsys
):
    # One worker's 6.5 requests a minute (one every 9.2 s) shared by its 16 prompts in flight: each
    # prompt's second call came 148 s after its first, past --prompt_timeout=20. Before, the run started:
    # the start check and 2 first calls paid, then 16 of 16 prompts failed (exit 3), on every --resume too.
    prompts = [f"Task {i}" for i in range(16)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    flags = dict(num_workers=1, max_rpm=6.5, prompt_timeout=20, batch_size=16)
    with pytest.raises(SystemExit) as info:
        run(server, dataset, tmp_path / "data", **flags)
    assert info.value.code == 2
    assert "lower --prompts_per_worker (to at most 2)" in capsys.readouterr().err
    assert server.stats()["requests"] == 0
    assert not (tmp_path / "data" / "run").exists()
    # Fewer prompts than that in flight (a small dataset, or the suggested --prompts_per_worker) can work.
    from batchrun.config import RunConfig

    common = dict(dataset_file=str(dataset), run_name="run", output_dir=str(tmp_path / "data"), model="mock")
    RunConfig.from_flags(**common, **flags, prompts_per_worker=2).check_rates(prompts=16)
    RunConfig.from_flags(**common, **flags).check_rates(prompts=2)


# ----------------------------------------------------------------------------- per-prompt caps

LONG = "A long task [calls:12]"  # 13 model calls, ~22k tokens, ~$0.022 if left alone
SHORT = ["A short task [calls:0]", "A usual task"]  # 1 and 3 calls, under 5k tokens each


@pytest.mark.parametrize(
    "flag, cap, spent",
    [("max_prompt_tokens", 6000, "total_tokens"), ("max_prompt_usd", 0.006, "cost_usd")],
)
def test_per_prompt_cap_ends_a_long_prompt_as_partial(priced_server, tmp_path, flag, cap, spent):
    dataset = write_jsonl(tmp_path / "d.jsonl", [LONG, *SHORT])
    run(priced_server, dataset, tmp_path / "data", num_workers=1, max_turns=20, **{flag: cap})
    records = by_prompt(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl"))
    (long_rec,) = records[LONG]
    assert long_rec["partial"] is True and long_rec["completed"] is False
    assert long_rec["metadata"]["stop_reason"] == "prompt_budget"
    usage = long_rec["metadata"]["usage"]
    used = usage["prompt_tokens"] + usage["completion_tokens"] if spent == "total_tokens" else usage[spent]
    assert used >= cap  # it stopped once the cap was reached ...
    served = priced_server.stats()["requests_by_prompt"]
    assert long_rec["api_calls"] == served[LONG] < 13  # ... not after the 13 calls it wanted
    for prompt in SHORT:
        (rec,) = records[prompt]
        assert rec["completed"] is True and rec["metadata"]["stop_reason"] == "final_answer"


@pytest.mark.parametrize(("flag", "cap"), [("max_prompt_tokens", 3000), ("max_prompt_usd", 0.003)])
def test_per_prompt_cap_holds_between_the_retries_of_one_call(priced_server, tmp_path, flag, cap):
    """The cap was checked between model calls only: the retries of one call whose streams broke
    mid-answer (billed all the same) went on past it, ~2.5x the cap. Now no retry once it is spent."""
    first = "Answered, then broken [calls:1]"
    broken = "Broken from the start [cut_stream:5] [calls:0]"
    dataset = write_jsonl(tmp_path / "d.jsonl", [first, broken])
    out = tmp_path / "data"
    run(priced_server, dataset, out, num_workers=1, stream=True, max_retries=5, **{flag: cap})
    served = priced_server.stats()["requests_by_prompt"]
    assert served[broken] < 4, served  # before: 6, every try and retry
    (failed,) = read_jsonl(out / "run" / "failed.jsonl")
    assert failed["error_class"] == "prompt_budget" and "not retried" in failed["error"]
    assert failed["usage"]["unanswered_tokens"] > 0


# ----------------------------------------------------------------------------- run-wide budgets

BUDGETED = [f"Budgeted task number {i} [slow:0.3] [calls:0]" for i in range(12)]  # ~1.4k tokens each


@pytest.mark.parametrize(
    "flag, budget, bigger, spent",
    [("budget_tokens", 4000, 10**9, "total_tokens"), ("budget_usd", 0.004, 1000.0, "cost_usd")],
)
def test_budget_stops_starting_prompts_and_resume_runs_the_rest(
    priced_server, tmp_path, flag, budget, bigger, spent
):
    dataset = write_jsonl(tmp_path / "d.jsonl", BUDGETED)
    out = tmp_path / "data"
    run_dir = out / "run"
    # One prompt at a time: the budget holds about three prompts; a call is sent only when its worst
    # case (its estimated prompt and the derived completion limit) still fits, so fewer run.
    one_at_a_time = dict(num_workers=1, prompts_per_worker=1, batch_size=4)
    run(priced_server, dataset, out, **one_at_a_time, **{flag: budget})

    stats = read_json(run_dir / "statistics.json")
    this_run = stats["this_run"]
    assert 1 <= this_run["attempted"] < len(BUDGETED)
    assert 0 < this_run["usage"][spent] <= budget  # a cap: never past it
    assert this_run["skipped_for_budget"] >= 1
    assert this_run["attempted"] + this_run["skipped_for_budget"] == len(BUDGETED)
    assert stats["remaining_for_resume"] == len(BUDGETED) - stats["trajectories"] > 0
    status = read_json(run_dir / "status.json")
    assert status["state"] == "finished"
    assert status["budget"]["reached"] is True
    assert status["budget"]["tokens" if flag == "budget_tokens" else "usd"] == budget
    assert status["budget"]["spent_tokens" if flag == "budget_tokens" else "spent_usd"] <= budget
    served_first = collections.Counter(priced_server.stats()["requests_by_prompt"])
    assert len(served_first) < len(BUDGETED)  # the provider never saw the rest
    first_trajectories = stats["trajectories"]

    run(priced_server, dataset, out, resume=True, **one_at_a_time, **{flag: bigger})

    stats = read_json(run_dir / "statistics.json")
    assert stats["this_run"]["attempted"] == len(BUDGETED) - first_trajectories  # only the rest ran
    assert stats["this_run"]["skipped_for_budget"] == 0
    assert stats["remaining_for_resume"] == 0
    assert read_json(run_dir / "status.json")["budget"]["reached"] is False
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["prompt_index"] for r in records) == list(range(len(BUDGETED)))  # each row once
    assert collections.Counter(first_human(r["conversations"]) for r in records) == collections.Counter(
        BUDGETED
    )


def test_a_usd_budget_with_the_mock_model_is_a_free_dry_run(tmp_path, capsys):
    """--model=mock is free (README, Budgets): its answers reported no cost, so a dry run of a --budget_usd
    configuration made one model call, stopped every prompt (class budget) and exited 6."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["one [calls:1]", "two [calls:1]", "three [calls:1]"])
    out = tmp_path / "data"
    run(None, dataset, out, budget_usd=0.01)  # raises SystemExit on a non-zero exit
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 3
    assert not (out / "run" / "failed.jsonl").exists()
    budget = read_json(out / "run" / "statistics.json")["this_run"]["budget"]
    assert budget["spent_usd"] == 0 and budget["unmeasured"] is False and budget["reached"] is False
    assert "reported no cost" not in capsys.readouterr().err
