"""Budgets as caps (batchrun/run/budget.py) and usage an endpoint does not report credibly.

The rule is tested as data (the parent's Budget) and end to end: a run with many prompts in flight
against the fake model, and one against a scripted endpoint whose ``usage`` is odd.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from helpers import ScriptedEndpoint, requests, run, write_jsonl

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.llm import Usage, credible_usage
from batchrun.run.budget import Budget


class Spent:
    def __init__(self):
        self.tokens, self.usd = 0, 0.0

    def __call__(self):
        return self.tokens, self.usd


def test_a_call_is_granted_only_when_spent_plus_reserved_plus_its_worst_case_fits():
    spent = Spent()
    budget = Budget(1000, None, spent)
    assert budget.request("w", 1, 400) == [("w", 1, True)]
    assert budget.request("w", 2, 400) == [("w", 2, True)]
    assert budget.request("w", 3, 400) == []  # 0 + 800 reserved + 400 > 1000: it waits
    spent.tokens += 300
    assert budget.settle("w", 1, 300, 0.0) == []  # 300 + 400 + 400 > 1000: still waits
    spent.tokens += 300
    assert budget.settle("w", 2, 300, 0.0) == [("w", 3, True)]  # 600 + 0 + 400 fits exactly
    assert budget.request("x", 1, 100) == []  # behind nobody, but 600 + 400 + 100 > 1000
    spent.tokens += 400
    # Nothing in flight and 1000 + 100 > 1000: it never will fit, the budget is reached.
    assert budget.settle("w", 3, 400, 0.0) == [("x", 1, False)]
    assert budget.exhausted


def test_a_usd_budget_learns_the_price_one_call_at_a_time():
    spent = Spent()
    budget = Budget(None, 1.0, spent)
    assert budget.request("w", 1, 1000) == [("w", 1, True)]
    assert budget.request("w", 2, 1000) == []  # no price seen yet: one at a time
    spent.tokens, spent.usd = 1000, 0.125
    assert budget.settle("w", 1, 1000, 0.125) == [("w", 2, True)]  # $0.000125/token: 0.125 + 0.125 fits
    for rid in range(3, 10):
        budget.request("w", rid, 1000)
    assert len(budget.reserved) == 7  # 0.125 spent + 7 x $0.125 reserved = $1; the 8th waits
    assert len(budget.waiting) == 1


def test_a_dead_worker_frees_its_reservations():
    budget = Budget(1000, None, Spent())
    budget.request("a", 1, 900)
    assert budget.request("b", 1, 900) == []
    assert budget.drop("a") == [("b", 1, True)]


@pytest.mark.parametrize(
    ("usage", "fault"),
    [
        (None, "no usage"),
        ({"prompt_tokens": "120", "completion_tokens": "7"}, "prompt_tokens not a number"),
        ({"prompt_tokens": -1000000, "completion_tokens": 5}, "prompt_tokens negative"),
        ({"prompt_tokens": float("nan"), "completion_tokens": 5}, "prompt_tokens NaN or infinite"),
        ({"prompt_tokens": 10, "completion_tokens": 10**12}, "completion_tokens absurd"),
        ({"prompt_tokens": 10, "completion_tokens": 5, "cost": float("nan")}, "cost NaN or infinite"),
        ({"prompt_tokens": 10, "completion_tokens": 5, "cost": -600.0}, "cost negative"),
        ({"prompt_tokens": 0, "completion_tokens": 5}, "prompt_tokens zero"),
        ({"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10}, "completion_tokens zero"),
    ],
)
def test_odd_usage_is_estimated_never_added_as_it_is(usage, fault):
    clean, why = credible_usage(usage, 111, 22)
    assert fault in why
    assert clean["estimated"] is True
    for key in ("prompt_tokens", "completion_tokens"):
        assert isinstance(clean[key], int) and 0 <= clean[key] <= 10**7
    assert "cost" not in clean or (math.isfinite(clean["cost"]) and clean["cost"] >= 0)
    tally = Usage()
    tally.add(clean)
    assert tally.total_tokens > 0 and tally.cost_usd >= 0 and tally.as_dict()["estimated_calls"] == 1


def test_credible_usage_is_kept_exactly():
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "cost": 0.002}
    clean, why = credible_usage(usage, 999, 999)
    assert why is None and clean["prompt_tokens"] == 10 and clean["completion_tokens"] == 5
    assert clean["cost"] == 0.002 and "estimated" not in clean


def test_the_images_api_s_input_and_output_tokens_are_its_counts():
    """An image call's usage names them input_tokens / output_tokens (OpenAI's images API): read as
    missing, a budget counted the request's estimate alone (some 30 tokens for an image of thousands)."""
    usage = {"input_tokens": 50, "output_tokens": 4160, "total_tokens": 4210}
    clean, why = credible_usage(usage, 30, 0)
    assert why is None and (clean["prompt_tokens"], clean["completion_tokens"]) == (50, 4160)
    clean, _ = credible_usage({"prompt_tokens": 7, "completion_tokens": 3, "input_tokens": 99}, 1, 1)
    assert (clean["prompt_tokens"], clean["completion_tokens"]) == (7, 3)  # the chat names win


def odd_usage(usage_text: str, content: str = "The answer is 4.") -> ScriptedEndpoint:
    """Every answer is a final one (with reasoning) whose usage is ``usage_text`` (not always valid JSON)."""
    body = (
        '{"model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": '
        f'{{"role": "assistant", "content": "{content}", "reasoning_content": "2+2"}}}}], '
        f'"usage": {usage_text}}}'
    ).encode()
    return ScriptedEndpoint(lambda call, calls: (200, body), get=(200, {"data": []}))


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("budget", [{"budget_tokens": 50_000}, {}], ids=["budget", "no_budget"])
def test_a_run_against_odd_usage_counts_estimates_warns_once_and_writes_strict_json(tmp_path, capsys, budget):
    """Without a budget the worker sends no spend per call, but still the first faulty one: the warning."""
    endpoint = odd_usage('{"prompt_tokens": "120", "completion_tokens": -5, "cost": NaN}')
    try:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"What is 2+2? ({i})" for i in range(6)])
        run(
            None,
            dataset,
            tmp_path / "data",
            model="m",
            base_url=endpoint.base_url,
            api_key="sk-test-odd",
            max_tokens=50,
            num_workers=1,
            **budget,
        )
    finally:
        endpoint.close()
    err = capsys.readouterr().err
    assert err.count("reports usage that cannot be trusted") == 1  # one warning per run
    run_dir = tmp_path / "data" / "run"
    stats = _strict((run_dir / "statistics.json").read_text())
    records = [_strict(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 6
    for rec in records:
        usage = rec["metadata"]["usage"]
        assert usage["estimated_calls"] == 1 and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        # A NaN cost is no cost, not a NaN in the file: unreported, and typed 0.0 as every unknown count is.
        assert usage["cost_usd"] == 0.0 and "cost_usd" in json.loads(usage["unreported"])
    spent = stats["this_run"]["budget"]["spent_tokens"]
    assert spent > 0  # the budget counted the estimates, not 0
    # The live spend of the faulty call sent at once is not counted twice when its outcome comes (the
    # start check's answer, estimated too, is counted apart).
    assert spent - stats["this_run"]["budget"]["check_tokens"] == sum(
        r["metadata"]["usage"]["prompt_tokens"] + r["metadata"]["usage"]["completion_tokens"] for r in records
    )


def test_an_endpoint_that_says_every_call_was_zero_tokens_is_held_to_the_budget(tmp_path):
    """Usage of 0 tokens (and a cost of 0) for answers of 30 KB each, from an endpoint or a proxy that
    zeroes its counts: every call was counted free, so --budget_tokens let all 40 prompts run (some
    400,000 tokens by the runner's own count, against a cap of 40,000)."""
    endpoint = odd_usage(
        '{"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0}', "z" * 30_000
    )
    try:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Write a lot ({i})" for i in range(40)])
        run(
            None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key="sk-test-zero",
            max_tokens=10_000, num_workers=1, budget_tokens=40_000,
        )  # fmt: skip
    finally:
        endpoint.close()
    status = json.loads((tmp_path / "data" / "run" / "status.json").read_text())
    assert status["budget"]["reached"] is True
    assert 0 < status["budget"]["spent_tokens"] <= 40_000
    assert status["done"] < 40 and status["skipped_budget"] > 0


def _capped_run(server, tmp_path, prompts: list[str], cap: int, per_worker: int, **flags) -> dict:
    """A run of ``prompts`` on two workers under --budget_tokens=``cap``; the endpoint's counters after it."""
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    run(
        server, dataset, tmp_path / "data", num_workers=2, prompts_per_worker=per_worker, budget_tokens=cap,
        max_tokens=100, batch_size=10, **flags,
    )  # fmt: skip
    return server.stats()


def test_many_prompts_in_flight_spend_at_most_the_budget(tmp_path):
    """40 prompts in flight at once, 3 calls each, ~2,000 tokens a call: without reservations the run
    overshot by up to one call per prompt in flight (~80,000 tokens past a 20,000 cap)."""
    cap = 20_000
    with FakeModelServer(latency_s=0.2) as server:
        served = _capped_run(server, tmp_path, [f"Task {i} [calls:2]" for i in range(60)], cap, 20)
    spent_at_server = served["prompt_tokens"] + served["completion_tokens"]
    assert spent_at_server <= cap  # what the endpoint itself counted
    assert spent_at_server >= cap * 0.7  # and the cap was used, not refused early
    status = json.loads((Path(tmp_path) / "data" / "run" / "status.json").read_text())
    assert status["budget"]["reached"] is True
    assert status["budget"]["spent_tokens"] <= cap


def test_a_prompt_under_way_gets_the_budget_before_one_not_started():
    spent = Spent()
    budget = Budget(1000, None, spent)
    assert budget.request("w", 1, 900) == [("w", 1, True)]
    assert budget.request("w", 2, 900, priority=0) == []  # a new prompt's first call
    assert budget.request("w", 3, 900, priority=2) == []  # the third call of a prompt under way
    spent.tokens += 50
    assert budget.settle("w", 1, 50, 0.0) == [("w", 3, True)]  # it goes first, though it came later


def test_a_new_prompt_starts_only_when_the_budget_also_holds_the_prompts_under_way():
    spent = Spent()
    budget = Budget(10_000, None, spent)
    # A finished prompt taught: 4 calls of ~1,000 tokens.
    budget.prompt_done("old", 4, 4000)
    assert budget.request("w", 1, 1000, 0, prompt="a") == [("w", 1, True)]  # alone: it starts
    spent.tokens += 1000
    budget.settle("w", 1, 1000, 0.0)
    # "a" still expects 3 calls (3,000); "b" needs its own 4,000: 1,000 + 3,000 + 4,000 fits 10,000.
    assert budget.request("w", 2, 1000, 0, prompt="b") == [("w", 2, True)]
    # "c" would need 4,000 more on top of a's 3,000 and b's 3,000 (+ b's call in flight): it waits.
    assert budget.request("w", 3, 1000, 0, prompt="c") == []
    assert budget.request("w", 4, 1000, 1, prompt="a") == [("w", 4, True)]  # a prompt under way goes on
    assert not budget.exhausted


@pytest.mark.parametrize("budget", [{"budget_tokens": 10**9}, {}], ids=["budget", "no_budget"])
def test_spend_crosses_the_process_boundary_per_call_only_for_a_budget(tmp_path, monkeypatch, budget):
    """With a run-wide budget every answered call is reported at once (the parent holds the run to it);
    without one the outcome's usage is the spend, so a prompt's calls cost no message each, and the
    run's totals are the same."""
    from batchrun.protocol import Spend
    from batchrun.run.dispatch import Dispatch

    seen = []
    handle = Dispatch.handle

    def counting(self, event, track, inbox):
        if isinstance(event.message, Spend):
            seen.append(event.message)
        return handle(self, event, track, inbox)

    monkeypatch.setattr(Dispatch, "handle", counting)
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i}" for i in range(4)])  # 3 calls each
        run(server, dataset, tmp_path / "data", max_tokens=100, **budget)
        served = server.stats()
    assert len(seen) == (12 if budget else 0)
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    billed = (
        served["prompt_tokens"] + served["completion_tokens"] + served["check_tokens"]
    )  # the start check's too
    assert (
        stats["this_run"]["usage"]["prompt_tokens"] + stats["this_run"]["usage"]["completion_tokens"]
        == billed
    )
    assert stats["this_run"]["budget"]["spent_tokens"] == billed


def test_until_a_prompt_finished_a_tight_budget_starts_one_prompt_at_a_time():
    """The guess of 3 calls a prompt is only a guess: before any prompt has finished, a second prompt
    starts only while the budget holds twice what it and the prompts under way are guessed to spend.
    Before, 20,000 tokens let three prompts of ~2,200-token calls start at once; they took 4 calls each,
    and all three were stopped by the budget, unfinished (0 trajectories for 18,000 tokens)."""
    spent = Spent()
    budget = Budget(20_000, None, spent)
    assert budget.request("w", 1, 2200, 0, prompt="a") == [("w", 1, True)]  # alone: it starts
    assert budget.request("x", 1, 2200, 0, prompt="b") == []  # 2 x (a's 3 calls + b's 3 calls) > 20,000
    spent.tokens += 2200
    assert budget.settle("w", 1, 2200, 0.0) == []
    assert budget.request("w", 2, 2300, 1, prompt="a") == [("w", 2, True)]  # a goes on
    # A large budget starts many prompts before any finished.
    big = Budget(1_000_000, None, Spent())
    granted = [big.request(f"w{i}", 1, 2200, 0, prompt=i) for i in range(200)]
    # With n under way (each holding its first call, and twice its 2 more guessed) the next starts while
    # 2,200 x (5n + 6) <= 1,000,000: up to n = 89, so 90 prompts start before any finished.
    assert sum(1 for g in granted if g) == 90


def test_once_prompts_finished_none_starts_that_the_rest_of_the_budget_cannot_finish():
    """The budget is reached when the rest of it holds no whole prompt (as this run's prompts cost), not
    when a lone first call no longer fits: a prompt is not started only to be stopped by the budget."""
    spent = Spent()
    budget = Budget(20_000, None, spent)
    spent.tokens = 16_000
    budget.prompt_done("a", 4, 8000)
    budget.prompt_done("b", 4, 8000)
    # 4,000 left: the first call would fit, the prompt (8,000 as a and b cost) would not.
    assert budget.request("w", 1, 2200, 0, prompt="c") == [("w", 1, False)]
    assert budget.exhausted


def test_prompts_of_uneven_length_leave_room_for_the_longest_one_seen():
    spent = Spent()
    budget = Budget(20_000, None, spent)
    budget.prompt_done("a", 2, 2000)  # 1,000 tokens a call; prompts took 2 and 6 calls (mean 4)
    budget.prompt_done("b", 6, 6000)
    spent.tokens = 8000
    # 12,000 left: c's 4,000 (mean) fits; with d under way (3,000 more expected) c needs its own 4,000
    # and the 2,000 by which a prompt went past the mean.
    assert budget.request("w", 1, 1000, 0, prompt="d") == [("w", 1, True)]
    assert budget.request("x", 1, 1000, 0, prompt="c") == [("x", 1, True)]  # 8,000+1,000+3,000+4,000+2,000
    assert budget.request("y", 1, 1000, 0, prompt="e") == []


def test_a_retried_first_call_of_a_prompt_under_way_is_not_held_behind_prompts_not_started():
    """A retry of a prompt's first call has made no call yet (priority 0), but its prompt is under way:
    it must not wait behind a prompt that cannot start until it finishes (they would wait for each other)."""
    spent = Spent()
    budget = Budget(20_000, None, spent)
    assert budget.request("w", 1, 2200, 0, prompt="a") == [("w", 1, True)]
    assert budget.request("x", 1, 2200, 0, prompt="b") == []  # waits for a
    assert budget.settle("w", 1, 0, 0.0) == []  # a's first attempt failed (a 5xx): nothing spent
    assert budget.request("w", 2, 2200, 0, prompt="a") == [("w", 2, True)]  # its retry goes


def test_a_tight_budget_finishes_whole_prompts(tmp_path, capsys):
    """20 prompts of 4 calls, 4 workers, a budget for about two and a half prompts: the run finishes
    two and stops none it started (before: every prompt started was stopped unfinished)."""
    per_prompt = _cost_of_one_prompt(tmp_path / "probe")
    cap = int(per_prompt * 2.5)
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:3]" for i in range(20)])
        run(server, dataset, tmp_path / "data", num_workers=4, budget_tokens=cap, max_tokens=100)
        served = server.stats()
    assert served["prompt_tokens"] + served["completion_tokens"] <= cap
    run_dir = tmp_path / "data" / "run"
    finished = (run_dir / "trajectories.jsonl").read_text().splitlines()
    assert len(finished) == 2
    failed = [json.loads(line) for line in (run_dir / "failed.jsonl").read_text().splitlines()]
    started = [f["prompt"] for f in failed if f["usage"]["calls"] or f["usage"]["requests"]]
    assert started == []  # every prompt the budget stopped had cost nothing
    budget = json.loads((run_dir / "statistics.json").read_text())["this_run"]["budget"]
    assert budget["stopped_in_flight"] == 18 and budget["stopped_unfinished"] == 0
    assert "the rest holds no whole prompt" in capsys.readouterr().err
    assert sum(requests(server).values()) == 8


def _cost_of_one_prompt(out: Path) -> int:
    out.mkdir()
    with FakeModelServer() as server:
        dataset = write_jsonl(out / "d.jsonl", ["Task 0 [calls:3]"])
        run(server, dataset, out / "data", num_workers=1, max_tokens=100)
        served = server.stats()
    assert sum(requests(server).values()) == 4
    return served["prompt_tokens"] + served["completion_tokens"]


def test_an_answer_without_a_cost_is_counted_at_the_price_seen_or_ends_a_usd_budget():
    """An answer with no usage.cost was free by its own account: a --budget_usd counted nothing for it."""
    spent = Spent()
    budget = Budget(None, 1.0, spent)
    assert budget.request("w", 1, 1000) == [("w", 1, True)]
    assert budget.request("w", 2, 1000) == []
    spent.tokens, spent.usd = 1000, 0.25
    assert budget.settle("w", 1, 1000, 0.25) == [("w", 2, True)]  # $0.00025 a token
    budget.request("w", 3, 1000)
    spent.tokens += 1000
    budget.settle("w", 2, 1000, 0.0, priced=False)  # no cost: counted at $0.00025 a token
    assert budget.estimated_usd == 0.25 and not budget.unmeasured
    # 0.25 spent + 0.25 estimated + 0.25 reserved (call 3) + 0.25: the next fits exactly, none after it.
    assert budget.request("w", 4, 1000) == [("w", 4, True)]
    assert budget.request("w", 5, 1000) == []

    first = Budget(None, 1.0, Spent())
    first.request("w", 1, 1000)
    first.request("w", 2, 1000)
    # The first answer reports no cost: no price to count it at, the budget cannot be kept.
    assert first.settle("w", 1, 1000, 0.0, priced=False) == [("w", 2, False)]
    assert first.unmeasured and first.exhausted
    assert Budget(1000, None, Spent()).settle("w", None, 10, 0.0, priced=False) == []  # tokens only: fine


def _usage_endpoint(priced_answers: int) -> ScriptedEndpoint:
    """A priced start check, then ``priced_answers`` priced final answers, then answers without a cost
    (1,010 tokens each, $0.00101 when priced)."""

    def answer(call, calls):
        usage = {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010, "cost": 0.00101}
        answered = sum(1 for c in calls[:-1] if not c["check"])
        if not call["check"] and answered >= priced_answers:
            del usage["cost"]
        message = {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "2+2"}
        return 200, {
            "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
            "usage": usage,
        }

    return ScriptedEndpoint(answer, get=(200, {"data": []}))


@pytest.mark.parametrize("priced_answers", [1, 0], ids=["priced_first", "unpriced_first"])
def test_a_usd_budget_counts_answers_without_a_cost_or_stops_when_it_cannot(tmp_path, capsys, priced_answers):
    """The start check showed a cost, the run's answers then stop reporting it (a provider that does not
    price, a judge endpoint): before, each counted $0 and all 12 prompts ran past a $0.005 budget."""
    endpoint = _usage_endpoint(priced_answers)
    try:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"What is 2+2? ({i})" for i in range(12)])
        try:
            run(
                None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key="sk-test-usd",
                max_tokens=16, num_workers=1, budget_usd=0.005,
            )  # fmt: skip
            code = 0
        except SystemExit as exc:
            code = int(exc.code)
        sent = [c for c in endpoint.calls if not c["check"]]
    finally:
        endpoint.close()
    err = capsys.readouterr().err
    run_dir = tmp_path / "data" / "run"
    budget = json.loads((run_dir / "statistics.json").read_text())["this_run"]["budget"]
    done = len((run_dir / "trajectories.jsonl").read_text().splitlines())
    if priced_answers:
        # The start check's $0.00101 and the first answer's spent, then each answer counted at $0.000001
        # a token: 3 answers, not 12.
        assert code == 0 and "reported no cost" in err and "--budget_usd" in err, err
        assert 2 <= len(sent) <= 4 and done == len(sent), (len(sent), done)
        assert budget["check_usd"] == 0.00101
        assert budget["reached"] is True and budget["estimated_usd"] >= 0.00101
        assert budget["spent_usd"] + budget["estimated_usd"] <= 0.005
        # The stop names what was counted for the answers without a cost, not only what they reported.
        reached = next(line for line in err.splitlines() if line.startswith("Budget reached"))
        assert f"+ ~${budget['estimated_usd']:.4f} for answers without a cost" in reached, reached
    else:
        assert code == 6 and "--budget_usd cannot be kept" in err and "--resume" in err, err
        assert len(sent) == 1 and done <= 1  # one call at a time until a price: nothing after it
        assert budget["unmeasured"] is True and budget["reached"] is True


def test_a_budget_below_one_call_says_why_the_call_does_not_fit():
    """A --budget_tokens smaller than one call's worst case ran nothing and said only "Budget reached
    ($0.0000, 0 tokens)": nothing named the call's estimate or what was left."""
    budget = Budget(2000, None, Spent())
    assert budget.request("w", 1, 2229, 0, prompt="a") == [("w", 1, False)]
    assert budget.exhausted
    assert "~2,229 tokens" in budget.why and "2,000 are left" in budget.why, budget.why


def test_the_start_check_is_spent_and_counted_like_any_call(tmp_path):
    """The start check is a real chat call the endpoint bills: the run's spend and its budget count it
    (before, a run's spent_tokens left it out, so what the endpoint billed could pass the budget)."""
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:1]" for i in range(3)])
        run(server, dataset, tmp_path / "data", budget_tokens=10**6, max_tokens=100)
        served = server.stats()
    assert served["check_calls"] == 1 and served["check_tokens"] > 0
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    budget = stats["this_run"]["budget"]
    billed = served["prompt_tokens"] + served["completion_tokens"] + served["check_tokens"]
    assert budget["spent_tokens"] == billed
    assert budget["check_calls"] == 1 and budget["check_tokens"] == served["check_tokens"]
    assert stats["runs"][-1]["prompt_tokens"] + stats["runs"][-1]["completion_tokens"] == billed


def test_what_prompts_stopped_unfinished_spent_is_counted_and_said(tmp_path, capsys):
    """Prompts longer than the budget can pay for are stopped after spending: the summary says how much
    of the run's spend gave no sample (before: only how many prompts, in statistics.json alone)."""
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Long task {i} [calls:10]" for i in range(6)])
        run(server, dataset, tmp_path / "data", num_workers=1, prompts_per_worker=2, budget_tokens=22_000,
            max_tokens=100)  # fmt: skip
    run_dir = tmp_path / "data" / "run"
    budget = json.loads((run_dir / "statistics.json").read_text())["this_run"]["budget"]
    failed = [json.loads(line) for line in (run_dir / "failed.jsonl").read_text().splitlines()]
    started = [f["usage"] for f in failed if f["usage"]["calls"]]
    assert budget["stopped_unfinished"] == len(started) >= 1
    assert (
        budget["unfinished_tokens"] == sum(u["prompt_tokens"] + u["completion_tokens"] for u in started) > 0
    )
    out = capsys.readouterr().out
    assert f"The budget stopped {len(started)} prompt(s) after they had made model calls: " in out
    assert f"{budget['unfinished_tokens']:,} tokens (" in out and "--resume runs them again" in out


def test_attempts_that_broke_mid_answer_count_against_the_budget(tmp_path):
    """A stream cut before its end was billed by the endpoint but counted by nobody: retried, each such
    attempt spent past --budget_tokens (here the endpoint billed 23,402 tokens on a 12,000 cap). Now each
    counts as the runner's estimate of its request and of what had arrived of its answer."""
    cap = 12_000
    with FakeModelServer(latency_s=0.05) as server:
        prompts = [f"Task {i} [calls:1] [cut_stream:2]" for i in range(40)]
        served = _capped_run(server, tmp_path, prompts, cap, 5, stream=True, max_retries=2)
    billed = served["prompt_tokens"] + served["completion_tokens"]  # cut attempts included
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    budget = stats["this_run"]["budget"]
    assert budget["reached"] is True
    assert billed <= cap, (billed, budget)
    assert budget["unanswered_tokens"] > 0
    assert budget["spent_tokens"] + budget["unanswered_tokens"] >= billed - served["check_tokens"]
    assert stats["this_run"]["usage"]["unanswered_tokens"] == budget["unanswered_tokens"]
    assert stats["run_totals"]["unanswered_tokens"] == budget["unanswered_tokens"]


def test_a_failed_attempt_s_tokens_before_any_price_are_priced_once_one_is_seen():
    spent = Spent()
    budget = Budget(None, 1.0, spent)
    assert budget.request("w", 1, 1000) == [("w", 1, True)]
    budget.settle("w", 1, 0, 0.0, priced=False, unanswered=800)  # broke mid-answer: no price yet
    assert budget.estimated_usd == 0.0 and not budget.unmeasured  # held, not a reason to stop
    assert budget.request("w", 2, 1000) == [("w", 2, True)]
    spent.tokens, spent.usd = 1000, 0.001
    budget.settle("w", 2, 1000, 0.001)  # $1e-6 a token
    assert budget.estimated_usd == pytest.approx(800e-6)
    budget.settle("w", None, 0, 0.0, priced=False, unanswered=500)
    assert budget.estimated_usd == pytest.approx(1300e-6)


def test_a_judge_s_attempts_that_broke_mid_answer_stay_in_the_spend(tmp_path):
    """The judge's failed attempts were counted as they happened, then taken out of the spend again when
    the sample's outcome came (the score's judge_usage has no unanswered_tokens): against an endpoint
    whose judge answers broke, a 20,000-token budget was billed 20,230."""

    def answer(call, calls):
        if call["check"] or call["body"]["model"] != "judge-model":
            message = {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "2+2"}
            usage = {"prompt_tokens": 1000, "completion_tokens": 10}
            return 200, {
                "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                "usage": usage,
            }
        return 200, b'{"choices": [{"index": 0, "message": {"content": "{\\"score\\": 1'  # cut short

    endpoint = ScriptedEndpoint(answer, get=(200, {"data": []}))
    try:
        dataset = tmp_path / "d.jsonl"
        dataset.write_text(
            "".join(json.dumps({"prompt": f"2+2? ({i})", "answer": "4"}) + "\n" for i in range(2))
        )
        run(
            None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key="sk-test-judge",
            max_tokens=50, num_workers=1, max_retries=1, budget_tokens=10**6, scorer="judge",
            judge_model="judge-model",
        )  # fmt: skip
        judged = [c for c in endpoint.calls if c["body"]["model"] == "judge-model" and not c["check"]]
    finally:
        endpoint.close()
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    budget = stats["this_run"]["budget"]
    assert len(judged) == 4  # 2 samples, each judged twice (one retry), every answer broken
    # Each broken attempt counts at least its request's estimate (bytes / 3) and the judge's 512-token limit
    # is not reached by the few bytes that arrived.
    assert budget["unanswered_tokens"] >= sum(len(json.dumps(c["body"])) // 3 for c in judged) > 0
    assert stats["this_run"]["usage"]["unanswered_tokens"] == budget["unanswered_tokens"]


def test_a_usd_budget_learns_each_model_s_price_before_its_calls_go_in_parallel():
    """A judge (or a tool's model) dearer than the run's model was reserved at the run's model's price:
    every prompt's judge call went at once, and a judge 100 times dearer billed $0.16 on a $0.05 budget.
    A model not priced yet goes one call at a time, as the run's first call does."""
    spent = Spent()
    budget = Budget(None, 1.0, spent)
    assert budget.request("w", 1, 1000, model="agent") == [("w", 1, True)]
    spent.tokens, spent.usd = 1000, 0.001
    budget.settle("w", 1, 1000, 0.001)  # the agent's model: $0.000001 a token
    assert budget.request("w", 2, 1000, 1, model="agent") == [("w", 2, True)]
    assert budget.request("w", 3, 1000, 1, model="judge") == [("w", 3, True)]  # its first call
    assert budget.request("x", 1, 1000, 1, model="judge") == []  # waits for the judge's price
    assert budget.request("x", 2, 1000, 1, model="agent") == []  # behind it, in order
    spent.tokens, spent.usd = 2000, 0.101
    assert budget.settle("w", 3, 1000, 0.1) == [("x", 1, True), ("x", 2, True)]  # $0.0001 a token now
    assert budget.usd_per_token == pytest.approx(1e-4)
    # Reserved at the judge's price: 0.101 spent + 3 x 1,000 in flight x $0.0001 = $0.401.
    for rid in range(3, 10):
        budget.request("x", rid, 1000, 1, model="judge")
    assert len(budget.reserved) == 8 and len(budget.waiting) == 2  # $0.101 + 8 x $0.1 <= $1 < + 9 x


@pytest.mark.parametrize(
    "usage",
    [
        # xAI's way: completion_tokens without the reasoning, total_tokens with it.
        {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 1620,
         "completion_tokens_details": {"reasoning_tokens": 1500}},
        {"prompt_tokens": 100, "completion_tokens": 20, "completion_tokens_details": {"reasoning_tokens": 1500}},
    ],
)  # fmt: skip
def test_reasoning_counted_apart_from_the_completion_is_counted(usage):
    """An endpoint that counts reasoning apart from completion_tokens bills it all the same: the budgets
    counted 20 completion tokens of 1,520 (a 40,000-token budget was billed 71,784)."""
    clean, why = credible_usage(usage, 999, 999)
    assert why is None and "estimated" not in clean
    assert clean["completion_tokens"] == 1520 and clean["total_tokens"] == 1620
    assert clean["completion_tokens_details"]["reasoning_tokens"] == 1500


def test_a_run_s_budget_holds_all_its_invocations(tmp_path):
    """--resume with the same budget spent a second budget (the budget counted one invocation's spend):
    the earlier invocations' spend counts, so the same budget again spends (nearly) nothing more, and a
    larger one lets the run spend only the difference."""
    cap = 6_000
    out = tmp_path / "data"
    with FakeModelServer(latency_s=0.02) as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:1]" for i in range(30)])

        def billed() -> int:
            stats = server.stats()
            return stats["prompt_tokens"] + stats["completion_tokens"] + stats["check_tokens"]

        run(server, dataset, out, num_workers=1, budget_tokens=cap, max_tokens=100)
        first = billed()
        assert first <= cap
        stats = json.loads((out / "run" / "statistics.json").read_text())
        assert stats["this_run"]["budget"]["reached"] is True and stats["remaining_for_resume"] > 0
        run(server, dataset, out, num_workers=1, budget_tokens=cap, max_tokens=100, resume=True)
        assert billed() <= cap + 100  # at most the start check past it (before: a second budget)
        second = billed()
        run(server, dataset, out, num_workers=1, budget_tokens=3 * cap, max_tokens=100, resume=True)
        third = billed()
    assert third <= 3 * cap, (first, second, third)
    assert third - second > cap  # the larger budget's room was used
    stats = json.loads((out / "run" / "statistics.json").read_text())
    assert stats["this_run"]["budget"]["earlier_tokens"] == second
    totals = stats["run_totals"]
    assert totals["prompt_tokens"] + totals["completion_tokens"] + totals["unanswered_tokens"] == third


def test_a_spent_budget_refuses_the_resume_before_any_call(tmp_path, capsys):
    out = tmp_path / "data"
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:0]" for i in range(20)])
        run(server, dataset, out, num_workers=1, budget_tokens=4_000, max_tokens=100)
        spent = server.stats()
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:  # a smaller budget than was spent: nothing is left
            run(server, dataset, out, num_workers=1, budget_tokens=1_000, max_tokens=100, resume=True)
        assert server.stats()["requests"] == spent["requests"]  # not even the start check
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--resume: the earlier invocations of this run spent its budget: --budget_tokens=1000 (they spent"
        in err
    )
    assert "give a larger one to go on" in err


def _killed_before_statistics(run_dir: Path) -> None:
    """The run directory as a kill -9 after the invocation's last status.json, before its statistics.json,
    leaves it (the statistics.json of the invocation before is gone too: it wrote none). Returns in the
    next second: an invocation is known by the second it started (``started_at``)."""
    time.sleep(1.01 - time.time() % 1)
    (run_dir / "statistics.json").unlink()
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "state": "running"}))


def test_an_invocation_killed_twice_in_a_row_keeps_both_in_the_books_and_the_budget(tmp_path):
    """A resume of a killed invocation overwrote the status.json that alone held the killed one's spend;
    killed in turn, the next resume counted only the second: the first one's tokens left run_totals and
    earlier_tokens (a resume of a run killed twice got its first invocation's spend back as budget)."""
    out = tmp_path / "data"
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:1]" for i in range(6)])
        run(server, dataset, out, num_workers=1, budget_tokens=10**6, max_tokens=100)
        billed = server.stats()["prompt_tokens"] + server.stats()["completion_tokens"]
        billed += server.stats()["check_tokens"]
        _killed_before_statistics(out / "run")  # the first invocation: killed
        run(server, dataset, out, num_workers=1, budget_tokens=10**6, max_tokens=100, resume=True)
        assert json.loads((out / "run" / "status.json").read_text())["budget"]["earlier_tokens"] == billed
        _killed_before_statistics(out / "run")  # the resume: killed in turn
        run(server, dataset, out, num_workers=1, budget_tokens=10**6, max_tokens=100, resume=True)
        assert server.stats()["prompt_tokens"] + server.stats()["completion_tokens"] <= billed
    stats = json.loads((out / "run" / "statistics.json").read_text())
    assert stats["this_run"]["budget"]["earlier_tokens"] == billed  # before: 0, the second one's
    totals = stats["run_totals"]
    assert totals["runs"] == 3
    assert totals["prompt_tokens"] + totals["completion_tokens"] + totals["unanswered_tokens"] == billed
    assert [r.get("ended", "")[:18] for r in stats["runs"]] == ["without statistics"] * 2 + [""]


def _first_run(key: str, value: object):
    """A damage to statistics.json: the first ``runs`` entry's ``key`` set to ``value``."""

    def damage(text: str) -> str:
        stats = json.loads(text)
        stats["runs"][0][key] = value
        return json.dumps(stats)  # an infinity as Infinity, which Python's reader takes

    return damage


@pytest.mark.parametrize(
    ("name", "damage", "named"),
    [
        ("statistics.json", lambda text: text[: len(text) // 2], "cannot be read"),
        ("statistics.json", lambda text: json.dumps({**json.loads(text), "runs": {}}), "runs is not a list"),
        ("statistics.json", _first_run("prompt_tokens", -5000), "prompt_tokens is -5000"),
        ("statistics.json", _first_run("cost_usd", "0.5"), 'cost_usd is "0.5"'),
        ("statistics.json", _first_run("completion_tokens", math.inf), "completion_tokens is Infinity"),
        ("statistics.json", _first_run("duration_s", None), "duration_s is null"),
        ("status.json", lambda text: text[:100], "cannot be read"),
        ("status.json", lambda text: text.replace('"prompt_tokens": ', '"prompt_tokens": 1e999, "x": ', 1),
         "prompt_tokens is Infinity"),
    ],
)  # fmt: skip
def test_a_damaged_record_of_the_earlier_spend_refuses_a_resume_under_a_budget(
    tmp_path, capsys, name, damage, named
):
    """A statistics.json or status.json damaged by hand or by a disk (truncated, a spend negative, not a
    number, infinite) counted as nothing: a --resume with the same --budget_tokens got the earlier spend
    back as budget (6,796 billed on a 6,000 cap). It stops before any call, naming the file; without a
    budget the run goes on with a warning."""
    out = tmp_path / "data"
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:1]" for i in range(30)])
        run(server, dataset, out, num_workers=1, budget_tokens=6_000, max_tokens=100)
        if name == "status.json":  # a killed invocation: its spend is in its last status.json only
            (out / "run" / "statistics.json").unlink()
        path = out / "run" / name
        path.write_text(damage(path.read_text()))
        spent = server.stats()["requests"]
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            run(server, dataset, out, num_workers=1, budget_tokens=6_000, max_tokens=100, resume=True)
        assert exit_info.value.code == 2
        assert server.stats()["requests"] == spent  # not even the start check
        err = capsys.readouterr().err
        assert f"--resume: {path}" in err and named in err
        assert "what the earlier invocations of this run spent cannot be read" in err
        run(server, dataset, out, num_workers=1, max_tokens=100, resume=True)  # no budget: goes on
        assert f"warning: --resume: {path}" in capsys.readouterr().err


def test_calls_in_flight_at_an_interrupt_are_counted_as_perhaps_billed(tmp_path):
    """Ctrl-C or SIGTERM ends the workers with calls in flight: the endpoint bills them, but no answer
    reports their spend. They were in no count: statistics.json said 41,143 tokens for 54,427 billed, and
    a resume got the rest back as budget. Each is counted as an attempt with no answer (its reservation)."""
    import signal
    import subprocess

    from helpers import runner_argv

    out = tmp_path / "data"
    with FakeModelServer() as server:
        dataset = write_jsonl(tmp_path / "d.jsonl", [f"Task {i} [calls:1] [slow:3]" for i in range(8)])
        args = runner_argv(
            dataset, out, server, "--batch_size=4", "--prompts_per_worker=4", "--budget_tokens=1000000",
            "--max_tokens=100",
        )  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and server.stats()["in_flight"] < 4:
                time.sleep(0.05)
            assert server.stats()["in_flight"] == 4  # the four prompts' first calls
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 130
        finally:
            proc.kill()
        while server.stats()["in_flight"] and time.monotonic() < deadline + 10:
            time.sleep(0.05)  # the endpoint answers (and bills) them all the same
        stats = server.stats()
    billed = stats["prompt_tokens"] + stats["completion_tokens"] + stats["check_tokens"]
    budget = json.loads((out / "run" / "statistics.json").read_text())["this_run"]["budget"]
    assert budget["spent_tokens"] == stats["check_tokens"]  # no answer came back before the interrupt
    assert budget["spent_tokens"] + budget["unanswered_tokens"] >= billed  # before: 31 of 6,667
    assert (
        json.loads((out / "run" / "status.json").read_text())["unanswered_tokens"]
        == budget["unanswered_tokens"]
    )


def test_calls_in_flight_at_a_kill_count_from_the_last_status(tmp_path):
    """A kill -9 with calls in flight: the endpoint bills them, and the killed invocation's books (its last
    status.json) held only what had been answered. status.json now holds the budget's reservations for
    calls in flight, and a resume counts them as perhaps billed (unanswered_tokens) in the killed one's
    runs entry, the budget's earlier_tokens with it."""
    from batchrun.run.recorder import Recorder, lost_runs
    from batchrun.secrets import Redactor

    recorder = Recorder(tmp_path / "run", "run", Redactor(None))
    recorder.run_dir.mkdir()
    recorder.reserved_tokens = lambda: 4321
    recorder.write_status("running", force=True)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["reserved_tokens"] == 4321
    (entry,) = lost_runs(status, [])
    assert entry["unanswered_tokens"] == 4321 + status["unanswered_tokens"]
    recorder.write_status("finished", force=True)  # a run that ended has nothing in flight
    assert json.loads((tmp_path / "run" / "status.json").read_text())["reserved_tokens"] == 0


def test_two_invocations_started_in_one_second_are_two_entries_in_the_books():
    """A runs entry was matched to a killed invocation's status.json by the second it started: a resume
    started in the same second as the invocation before it (a script that resumes at once) was taken
    for it, and its spend left the books and the budget. Each invocation has an id now; files written
    before it are still matched by the second."""
    from batchrun.run.recorder import lost_runs

    finished = {
        "started_at": "2026-12-05T20:00:00",
        "invocation": "aaaa",
        "duration_s": 1.0,
        "prompt_tokens": 5,
    }
    killed = {"started_at": "2026-12-05T20:00:00", "invocation": "bbbb", "updated_at": "2026-12-05T20:00:00",
              "state": "running", "prompt_tokens": 700, "completion_tokens": 0, "cost_usd": 0.0}  # fmt: skip
    (entry,) = lost_runs(killed, [finished])
    assert entry["invocation"] == "bbbb" and entry["prompt_tokens"] == 700
    assert lost_runs({**killed, "invocation": "aaaa"}, [finished]) == []  # it wrote its statistics
    old_killed = {k: v for k, v in killed.items() if k != "invocation"}
    old_finished = {k: v for k, v in finished.items() if k != "invocation"}
    assert lost_runs(old_killed, [old_finished]) == []  # older files: by the second, as before


def test_the_overshoot_in_usd_is_counted_as_the_budget_counts():
    """overshoot_usd left out estimated_usd (answers without a cost, failed attempts at the price seen),
    which the budget itself counts: a run past its budget by those said it was within it."""
    from batchrun.run.recorder import Recorder
    from batchrun.secrets import Redactor

    recorder = Recorder(Path("unused"), "run", Redactor(None), budget_usd=1.0)
    recorder.spend["cost_usd"] = 0.9
    recorder.budget_estimated_usd = 0.3
    recorder.earlier_usd = 0.1
    assert recorder.budget_summary()["overshoot_usd"] == pytest.approx(0.3)
