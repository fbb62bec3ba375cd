"""The refused-key stop (batchrun/run/endpoint_watch.py): calls refused mid-run for the key's or the
account's reasons (401, 402, 403, OpenAI's 429 ``insufficient_quota``) pause the run and send one probe; a refused probe stops the run (exit
8, the endpoint's words and the resume command printed), an answered one lets it go on. Before, a key
revoked or credits spent mid-run sent every remaining prompt to be refused, each one a failure."""

from __future__ import annotations

import json
import shlex
import time

import pytest
from helpers import OK_REPLY, ScriptedEndpoint, exit_code, read_jsonl, wait_for, write_jsonl, write_rows

from batchrun.prompt.llm import LLMError
from batchrun.run.endpoint_watch import (
    DEAD_AFTER,
    EXIT_ENDPOINT_DEAD,
    EXIT_ENDPOINT_REFUSED,
    REFUSED_AFTER,
    EndpointWatch,
)
from batchrun.views import score

KEY = "sk-refused-0123456789abcdef"
SLOTS = 2 * 4  # the prompts in flight (2 workers x 4)
# The most prompt calls refused after the 3 answered: the refusals that trip the stop, what was in flight,
# and what each slot started before the run's pause reached its worker (one more each on a loaded
# machine: 19 seen with three busy loops beside the test, the bound this replaced).
REFUSED_CALLS_AT_MOST = REFUSED_AFTER + 2 * SLOTS
SLEEP_TOOL_CALL = {
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "terminal", "arguments": '{"command": "sleep 0.5"}'},
                    }
                ],
            },
        }
    ]
}
NO_WORD = LLMError("http_401", "Invalid API key", 401)  # a probe's refusal
NO_CREDITS = {"error": {"message": f"Insufficient credits for key {KEY}. Add more credits", "code": 402}}


# OpenAI's answer once the account's quota or credit is spent: a 429 that no wait ends.
QUOTA_SPENT = {
    "error": {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}


def out_of_credits_after(answered: int, refusal, reply: dict = OK_REPLY):
    """Answers (``reply``) the start check and the first ``answered`` prompt calls, then ``refusal`` to
    everything (probes included): a reply, or a function that gives one."""

    def answer(call: dict, calls: list[dict]):
        if call["check"] and sum(1 for c in calls if c["check"]) == 1:
            return 200, reply
        if not call["check"] and sum(1 for c in calls if not c["check"]) <= answered:
            return 200, reply
        return refusal() if callable(refusal) else refusal

    return answer


def run_against(tmp_path, capsys, answer, prompts: list[str] | int, **flags):
    """A run of ``prompts`` (or that many ``task N`` rows) against an endpoint whose every answer
    ``answer`` gives: its exit code, its console, the endpoint, and the run's directory."""
    if isinstance(prompts, int):
        prompts = [f"task {i}" for i in range(prompts)]
    endpoint = ScriptedEndpoint(answer)
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    try:
        code = exit_code(
            None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key=KEY, **flags
        )
    finally:
        endpoint.close()
    return code, capsys.readouterr().err, endpoint, tmp_path / "data" / "run"


def refused_from_the_fourth_call(tmp_path, capsys, refusal, prompts: int, **flags):
    """A run of ``prompts`` rows (2 workers x 4, --endpoint_grace=2 unless ``flags`` say) against an
    endpoint that answers the start check and the first 3 prompt calls, then ``refusal``."""
    flags = {"num_workers": 2, "prompts_per_worker": 4, "batch_size": 10, "endpoint_grace": 2, **flags}
    return run_against(tmp_path, capsys, out_of_credits_after(3, refusal), prompts, **flags)


def test_credits_spent_mid_run_stop_it_with_its_own_exit_code_and_the_endpoints_words(tmp_path, capsys):
    code, err, endpoint, run_dir = refused_from_the_fourth_call(tmp_path, capsys, (402, NO_CREDITS), 60)
    # Before: every one of the 57 prompts failed http_402 (exit 3; 0 at the tests' max_failure_rate).
    assert code == EXIT_ENDPOINT_REFUSED, err
    assert "were refused (last: http_402)" in err
    assert "HTTP 402: Insufficient credits" in err and "resume=True" in err
    assert "still refuses the run's calls after 2 s" in err
    assert endpoint.checks() == 2  # the start check, then one probe (the next would be 5 s on): refused
    # Without the stop: 60 prompt calls. With it: the 3 answered and REFUSED_CALLS_AT_MOST.
    assert endpoint.prompt_calls() <= 3 + REFUSED_CALLS_AT_MOST
    stats = json.loads((run_dir / "statistics.json").read_text())
    # The 3 answered prompts ended (kept, or set aside: "OK" has no reasoning); nothing else is lost.
    assert stats["trajectories"] + stats["discarded"]["total"] == 3 and stats["remaining_for_resume"] == 57
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert failed and {f["error_class"] for f in failed} <= {"http_402", "budget"}
    assert len(failed) < 57 - 20
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("finished", EXIT_ENDPOINT_REFUSED)
    for path in run_dir.iterdir():  # the endpoint quoted the key: it is in no file, as on the console
        assert KEY not in path.read_text("utf-8", "replace"), path.name
    assert KEY not in err


def test_refusals_of_the_prompts_own_do_not_stop_the_run(tmp_path, capsys):
    """A provider's moderation refuses a flagged prompt with 403: a dataset with 32 such rows in a row
    pauses the run for a probe after each 8 refusals, each answered, and the run goes on to its end,
    saying so once."""

    def moderated(call: dict, calls: list[dict]):
        if not call["check"] and "flagged" in json.dumps(call["body"]):
            return 403, {"error": {"message": "Your input was flagged by moderation", "code": 403}}
        return 200, OK_REPLY

    prompts = [f"flagged {i}" for i in range(32)] + [f"task {i}" for i in range(12)]
    code, err, endpoint, run_dir = run_against(
        tmp_path, capsys, moderated, prompts, num_workers=1, prompts_per_worker=4, batch_size=8
    )
    assert code == 0, err
    assert err.count("were refused (last: http_403)") == err.count("the endpoint answered the probe") == 1
    assert endpoint.checks() >= 3  # the start check and a probe for each 8 refusals in a row
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["trajectories"] + stats["discarded"]["total"] == 12 and stats["remaining_for_resume"] == 32
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert sorted(f["prompt_index"] for f in failed) == list(range(32))
    assert {f["error_class"] for f in failed} == {"http_403"}


@pytest.mark.parametrize("budget", [{}, {"budget_tokens": 10_000_000}], ids=["no_budget", "budget"])
def test_a_key_refused_as_the_last_prompts_run_stops_the_run_without_waiting_out_the_grace(
    tmp_path, capsys, budget
):
    """The key refused while the run's last prompts were in flight (seen against a real llama-server, its
    key rotated with all ten prompts under way): every one was refused, the run ended before the grace
    with no prompt left to hold, and it exited as if nothing were wrong with the key (0 here, 3 at the
    default --max_failure_rate), its prompts failed http_402. Now the probe's word decides as the run
    ends: refused, the run's refused-key stop (exit 8), without waiting out --endpoint_grace. With a
    budget the probe's call is granted by the dispatch loop, which goes on answering while it waits for
    the probe's word (here its reservation mostly comes before the last outcome; one that came after
    would find a loop that only waited, and the grace waited out, its refused key called a dead
    endpoint)."""
    # Refused from the first prompt call: an answer reported after refusals (sent before them, answered
    # later) would start the count of refusals in a row again, and the run could end before it trips.
    code, err, endpoint, run_dir = run_against(
        tmp_path, capsys, out_of_credits_after(0, (402, NO_CREDITS)), REFUSED_AFTER,
        num_workers=2, prompts_per_worker=4, endpoint_grace=60, **budget,
    )  # fmt: skip
    assert code == EXIT_ENDPOINT_REFUSED, err
    assert "refused the run's last calls and its probe (HTTP 402: Insufficient credits" in err
    assert "and nothing is left to run: the run stops without waiting out --endpoint_grace" in err
    assert (
        "The run stopped: the endpoint refused its calls, and its probe as the run's last prompts ended"
        in err
    )
    assert endpoint.checks() == 2  # the start check, then one probe (the next would be 5 s on)
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["remaining_for_resume"] == REFUSED_AFTER
    assert {f["error_class"] for f in read_jsonl(run_dir / "failed.jsonl")} == {"http_402"}
    assert KEY not in err


def test_answers_to_calls_sent_before_the_refusals_neither_end_them_nor_the_probing():
    """An answer counts for the endpoint's health only if its call went out after the first of the
    failures or refusals in a row: one sent before says nothing of now (a long answer under way as the
    key was revoked)."""
    watch = EndpointWatch(cfg=None, grace_s=60, pause=lambda until: None, probe=lambda cfg, usage: NO_WORD)
    for i in range(REFUSED_AFTER - 1):
        assert watch.report("http_401", refused=True, sent_at=100.0 + i) is None
        assert watch.report(None, sent_at=99.0) is None  # sent before the first refusal: not counted
    assert watch.refusals == REFUSED_AFTER - 1
    assert "were refused" in watch.report("http_401", refused=True, sent_at=110.0)
    watch.report(None, sent_at=99.5)  # sent before too: not the probe's answer
    assert "answered" not in (watch.tick() or "") and watch.probing_since is not None
    watch.report(None, sent_at=100.5)  # sent after the first refusal: the endpoint answers
    assert "answered the probe" in watch.tick() and watch.probing_since is None
    assert watch.refusals == 0


def test_a_worker_reports_answers_after_a_failure_until_one_to_a_call_sent_after_it(monkeypatch):
    from batchrun.run import worker

    sent: list = []
    monkeypatch.setattr(worker, "send", sent.append)
    health = worker.HealthReporter()
    health(None, False, 5.0)  # healthy: nothing said
    health("http_503", False, 10.0)
    health(None, False, 8.0)  # a call sent before the failure: said, and still failing
    health(None, False, 12.0)  # sent after it: said, and no longer failing
    health(None, False, 13.0)
    assert [(m.error_class, m.sent_at) for m in sent] == [("http_503", 10.0), (None, 8.0), (None, 12.0)]


def test_a_long_answer_under_way_as_the_key_is_revoked_is_not_the_probes_answer(tmp_path, capsys):
    """Four calls answered late (a long generation under way as the credits ran out) while every later
    call is refused: each answer began the refusals in a row again, and one that came while the run was
    paused was taken for the probe's answer ("the refusals were the prompts' own"), so the run went on
    starting prompts only to have them refused. Now those answers, to calls sent before the refusals,
    count for nothing: the run stops on the refused probe (exit 8)."""

    def late_then_refused(call: dict, calls: list[dict]):
        prompt_calls = sum(1 for c in calls if not c["check"])
        if call["check"] and sum(1 for c in calls if c["check"]) == 1:
            return 200, OK_REPLY
        if not call["check"] and prompt_calls <= 4:
            return 200, lambda: (time.sleep(2.0), OK_REPLY)[1]
        if not call["check"] and prompt_calls <= 8:
            # The other four prompts sent with them run a tool first: every refusal is of a call sent
            # clearly after the four long ones (sent together, which went first is a matter of
            # microseconds on a loaded machine).
            return 200, SLEEP_TOOL_CALL
        return 402, NO_CREDITS

    code, err, endpoint, run_dir = run_against(
        tmp_path,
        capsys,
        late_then_refused,
        40,
        num_workers=1,
        prompts_per_worker=8,
        endpoint_grace=4,
        distribution="terminal_only",
    )  # fmt: skip  (one worker: its own refusals make it report its late answers)
    assert code == EXIT_ENDPOINT_REFUSED, err
    assert "the endpoint answered the probe" not in err
    assert err.count("were refused (last: http_402)") == 1
    assert endpoint.prompt_calls() <= 8 + REFUSED_CALLS_AT_MOST
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["trajectories"] + stats["discarded"]["total"] == 4  # the four long answers


def test_a_watch_probing_as_the_run_ends_decides_on_its_probes_word():
    """EndpointWatch.conclude, each word of the probe: answered (no stop), refused (the refused-key
    stop), not answered (the dead-endpoint stop); and a watch not probing concludes nothing."""
    refusal = LLMError("http_401", "Invalid API key", 401)
    for answer, dead, refused, said in [
        (True, False, None, None),
        (refusal, True, "HTTP 401: Invalid API key", "refused the run's last calls and its probe (HTTP 401"),
        (False, True, None, "refused the run's last calls and did not answer its probe"),
    ]:
        pauses: list[float] = []
        watch = EndpointWatch(cfg=None, grace_s=60, pause=pauses.append, probe=lambda cfg, usage, a=answer: a)
        assert watch.conclude() is None and not watch.dead  # not probing: nothing to decide
        for _ in range(REFUSED_AFTER):
            watch.report("http_401", refused=True)
        assert wait_for(lambda w=watch: not w.awaits_probe(), 10.0)  # the probe has its word
        line = watch.conclude()
        assert (watch.dead, watch.refused, watch.concluded) == (dead, refused, dead)
        assert (line is None) if said is None else (said in line), line
        assert watch.probing_since is None and watch.conclude() is None
    # Probing for failures (a 503 each), the probe not answered: the dead-endpoint stop.
    watch = EndpointWatch(cfg=None, grace_s=60, pause=lambda until: None, probe=lambda cfg, usage: False)
    for _ in range(DEAD_AFTER):
        watch.report("http_503")
    assert wait_for(lambda: not watch.awaits_probe(), 10.0)
    assert "failed the run's last calls and did not answer its probe" in watch.conclude()
    assert watch.dead and watch.refused is None


def test_the_prompts_own_refusals_as_the_run_ends_leave_its_exit_as_it_was(tmp_path, capsys):
    """The last 8 rows flagged by the provider's moderation (403), the probe answered as the run ends:
    the refusals were the prompts' own, and the run ends as it would (no stop, exit 0 at the tests'
    --max_failure_rate), its flagged prompts failed."""

    def moderated(call: dict, calls: list[dict]):
        if not call["check"] and "flagged" in json.dumps(call["body"]):
            return 403, {"error": {"message": "Your input was flagged by moderation", "code": 403}}
        return 200, OK_REPLY

    prompts = [f"task {i}" for i in range(3)] + [f"flagged {i}" for i in range(REFUSED_AFTER)]
    code, err, endpoint, run_dir = run_against(
        tmp_path, capsys, moderated, prompts, num_workers=2, prompts_per_worker=4, endpoint_grace=60
    )
    assert code == 0, err
    assert "The run stopped" not in err and "nothing is left to run" not in err
    assert json.loads((run_dir / "statistics.json").read_text())["remaining_for_resume"] == REFUSED_AFTER


def test_a_refused_probe_stops_the_watch_after_the_grace_and_an_answer_between_refusals_resets_it():
    pauses: list[float] = []
    answers = [LLMError("http_401", "Invalid API key", 401)]
    watch = EndpointWatch(cfg=None, grace_s=0.5, pause=pauses.append, probe=lambda cfg, usage: answers[0])
    for _ in range(REFUSED_AFTER - 1):
        assert watch.report("http_401", refused=True) is None
    assert watch.report(None) is None  # an answer: the refusals were not in a row
    assert watch.refusals == 0
    lines = [watch.report("http_401", refused=True) for _ in range(REFUSED_AFTER)]
    assert lines[-1] and "were refused" in lines[-1] and pauses and not any(lines[:-1])
    assert watch.failures == 0  # a refusal is an answer of the endpoint's, not a failure to reach it
    said = []
    for _ in range(100):
        line = watch.tick()
        said += [line] if line else []
        if watch.dead:
            break
        watch._back.wait(0.05)
    assert len(said) == 2 and "refused the run's probe too (HTTP 401: Invalid API key)" in said[0]
    assert (
        "still refuses the run's calls after 0.5 s (--endpoint_grace: HTTP 401: Invalid API key)" in said[1]
    )
    assert watch.dead and watch.refused == "HTTP 401: Invalid API key"
    # A failure to reach it after the stop starts nothing more.
    assert all(watch.report("http_503") is None for _ in range(20))
    # Refused, then answered within the grace (credits topped up): the run goes on.
    watch = EndpointWatch(cfg=None, grace_s=60, pause=pauses.append, probe=lambda cfg, usage: answers[0])
    for _ in range(REFUSED_AFTER):
        watch.report("http_402", refused=True)
    for _ in range(100):
        if watch._probe_refused is not None:
            break
        watch._back.wait(0.05)
    assert "refused the run's probe too" in watch.tick() and not watch.dead
    watch.report(None)  # a prompt's call answered (or the next probe, 5 s on)
    assert watch.tick() and not watch.dead and watch.probing_since is None


def test_a_spent_quota_429_stops_the_run_instead_of_being_waited_out(tmp_path, capsys):
    """OpenAI answers 429 ``insufficient_quota`` once the account's quota is spent. Waited out as a rate
    limit, 20 prompts made 111 doomed calls in 300 s, 8 failed so far (each at its deadline); now each
    such call fails at once as a refusal, and the refused-key stop ends the run."""
    code, err, endpoint, run_dir = refused_from_the_fourth_call(tmp_path, capsys, (429, QUOTA_SPENT), 40)
    assert code == EXIT_ENDPOINT_REFUSED, err
    assert "were refused (last: insufficient_quota)" in err
    assert "(HTTP 429: You exceeded your current quota" in err
    assert endpoint.prompt_calls() <= 3 + REFUSED_CALLS_AT_MOST  # each refused call asked once
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert {f["error_class"] for f in failed} <= {"insufficient_quota", "budget"}
    assert json.loads((run_dir / "statistics.json").read_text())["remaining_for_resume"] == 37


def test_a_spent_quota_fails_the_start_check(tmp_path, capsys):
    """Spent before the run: the start check's 429 ``insufficient_quota`` exits 2 at once, no prompt run.
    Before, it was taken for a rate limit: "the run starts and waits as it must"."""
    code, err, endpoint, _ = run_against(tmp_path, capsys, lambda call, calls: (429, QUOTA_SPENT), 4)
    assert code == 2, err
    assert "refused the start check" in err and "You exceeded your current quota" in err
    assert endpoint.prompt_calls() == 0 and endpoint.checks() == 1


def test_only_a_spent_quota_429_is_final():
    """A 429 that says ``insufficient_quota`` (as its code or its type) fails the call as a refusal; any
    other 429 (a rate limit, a provider's per-minute quota) is still waited out."""
    from batchrun.prompt import httpclient
    from batchrun.prompt.llm import _Retry, _status_error, refused

    class Answer:  # what StatusError reads of a response
        status, headers = 429, {}

    def answer(body):
        return _status_error(httpclient.StatusError(Answer(), body))

    for body in (QUOTA_SPENT, {"error": {"message": "quota", "type": "insufficient_quota"}}):
        error = answer(body)
        assert isinstance(error, LLMError) and error.error_class == "insufficient_quota" and refused(error)
    for body in (
        {
            "error": {
                "message": "Rate limit reached for requests",
                "type": "requests",
                "code": "rate_limit_exceeded",
            }
        },
        {"error": {"code": 429, "message": "Quota exceeded per minute", "status": "RESOURCE_EXHAUSTED"}},
        None,
    ):
        assert isinstance(answer(body), _Retry)


def test_a_start_check_rate_limited_for_longer_than_the_grace_exits_2_at_once(tmp_path, capsys):
    """A 429 whose Retry-After asks more than --endpoint_grace (a quota over for the day) was waited
    110 s by the start check, then the run started, its prompts to fail. Now exit 2 at once, saying the
    wait asked; a short Retry-After is still waited for, and the run goes on."""
    day = {"error": {"message": "Rate limit reached for requests per day"}}
    code, err, endpoint, _ = run_against(
        tmp_path, capsys, lambda c, cs: (429, day, {"Retry-After": "86400"}), 4
    )
    assert code == 2, err
    assert "rate limits the run for longer than --endpoint_grace (120 s)" in err
    assert "Retry-After asks a wait of 86,400 s" in err and "No prompt was run" in err
    assert endpoint.checks() == 1 and endpoint.prompt_calls() == 0

    def briefly(call: dict, calls: list[dict]):
        if call["check"] and len(calls) == 1:
            return 429, day, {"Retry-After": "1"}
        return 200, OK_REPLY

    code, _, endpoint, _ = run_against(tmp_path, capsys, briefly, 4, run_name="brief")
    assert code == 0 and endpoint.checks() == 2 and endpoint.prompt_calls() == 4


def test_a_429_asking_a_longer_wait_than_the_grace_mid_run_stops_it(tmp_path, capsys):
    """A quota over for the day mid-run (429, Retry-After: 86400): each call waited 120 s at a time, and
    each prompt failed at its deadline (30 min and the 5 min its pauses are credited), then the next
    ones. Now such a call fails at once as a refusal, and the refused-key stop ends the run (exit 8)."""
    day = {"error": {"message": "Rate limit reached for requests per day"}}
    refusal = (429, day, {"Retry-After": "86400"})
    code, err, endpoint, run_dir = refused_from_the_fourth_call(tmp_path, capsys, refusal, 40)
    assert code == EXIT_ENDPOINT_REFUSED, err
    assert "were refused (last: http_429)" in err
    assert "(HTTP 429: Rate limit reached for requests per day (Retry-After asks a wait of 86,400 s))" in err
    assert endpoint.prompt_calls() <= 3 + REFUSED_CALLS_AT_MOST and endpoint.checks() == 2
    assert {f["error_class"] for f in read_jsonl(run_dir / "failed.jsonl")} <= {"http_429", "budget"}
    assert json.loads((run_dir / "statistics.json").read_text())["remaining_for_resume"] == 37


def test_a_model_retired_mid_run_stops_it(tmp_path, capsys):
    """The model gone mid-run (404 to every call, the probe too) stops the run as a refused key does; a
    404 of a prompt's own (no provider takes its image) is told apart by the probe, as a 403 is."""
    gone = {"error": {"message": "The model `m` does not exist", "code": 404}}
    code, err, endpoint, run_dir = refused_from_the_fourth_call(tmp_path, capsys, (404, gone), 30)
    assert code == EXIT_ENDPOINT_REFUSED, err
    assert "(HTTP 404: The model `m` does not exist)" in err and "the model is gone" in err
    assert endpoint.prompt_calls() <= 3 + REFUSED_CALLS_AT_MOST
    assert json.loads((run_dir / "statistics.json").read_text())["remaining_for_resume"] == 27


def test_credits_topped_up_within_the_grace_let_the_run_go_on(tmp_path, capsys):
    """Refused from the fourth call for a second (credits spent, then topped up, as an automatic top-up
    does): the probes go on for --endpoint_grace, the second one is answered, and the run goes to its
    end; the prompts refused meanwhile are failures a --resume runs again."""
    refused_since: list[float] = []

    def for_a_second():
        refused_since[:] = refused_since or [time.monotonic()]
        return (402, NO_CREDITS) if time.monotonic() - refused_since[0] < 1.0 else (200, OK_REPLY)

    code, err, endpoint, run_dir = refused_from_the_fourth_call(
        tmp_path, capsys, for_a_second, 30, endpoint_grace=30
    )
    assert code == 0, err
    assert "refused the run's probe too (HTTP 402" in err and "the endpoint answers again" not in err
    assert "the endpoint answered the probe" in err and endpoint.checks() >= 3
    stats = json.loads((run_dir / "statistics.json").read_text())
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert REFUSED_AFTER <= len(failed) <= REFUSED_CALLS_AT_MOST and {f["error_class"] for f in failed} == {
        "http_402"
    }
    assert stats["trajectories"] + stats["discarded"]["total"] + len(failed) == 30
    assert stats["remaining_for_resume"] == len(failed)


def _judged_run(tmp_path, capsys, monkeypatch, judge_ep, run_ep, rows: int, **flags):
    """A run of ``rows`` rows with an answer, judged as it runs (--scorer=judge) by a judge on its own
    endpoint: its exit code, its console (stderr, then stdout) and the run's directory."""
    monkeypatch.setenv("JUDGE_API_KEY", JUDGE_KEY)
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": f"task {i}", "answer": "OK"} for i in range(rows)])
    flags = {"num_workers": 2, "prompts_per_worker": 4, "batch_size": 10, "endpoint_grace": 2, **flags}
    code = exit_code(
        None, dataset, tmp_path / "data", model="m", base_url=run_ep.base_url, api_key=KEY,
        scorer="judge", judge_model="judge-m", judge_base_url=judge_ep.base_url, **flags,
    )  # fmt: skip
    console = capsys.readouterr()
    return code, console.err + console.out, tmp_path / "data" / "run"


JUDGE_KEY = "sk-judge-refused-0123456789"
VERDICT = {
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": '{"score": 1, "passed": true}'},
        }
    ]
}


def test_a_judge_whose_credits_run_out_mid_run_stops_it(tmp_path, capsys, monkeypatch):
    """The judge's key refused mid-run (--scorer=judge): before, every later sample was kept with a
    scorer error in place of its score (57 of 60 here), each after its agent's calls were paid for, and
    the run exited 0, its pass rate over the 3 samples judged. Now the judge's endpoint has the run's
    refused-key stop: exit 8, naming the judge; the samples not reached are left for --resume, which
    judges them once the judge answers again."""
    no_credits = {"error": {"message": f"Insufficient credits for key {JUDGE_KEY}", "code": 402}}
    topped_up = []  # the judge's credits, once the user has topped them up
    refusing = out_of_credits_after(3, (402, no_credits), VERDICT)
    judge = ScriptedEndpoint(lambda call, calls: (200, VERDICT) if topped_up else refusing(call, calls))
    with ScriptedEndpoint(lambda call, calls: (200, OK_REPLY)) as run_ep, judge as judge_ep:
        code, err, run_dir = _judged_run(tmp_path, capsys, monkeypatch, judge_ep, run_ep, 60)
        assert code == EXIT_ENDPOINT_REFUSED, err
        assert "8 judge calls in a row were refused (last: http_402)" in err
        assert "The run stopped: the judge's endpoint refused its calls" in err
        assert "HTTP 402: Insufficient credits" in err and "resume=True" in err
        assert judge_ep.checks() == 2  # its start check, then one probe: refused
        stats = json.loads((run_dir / "statistics.json").read_text())
        errors = stats["scores"]["scorer_errors"]
        # Scorer errors only for the samples refused before the stop: 8 in a row, those in flight (8 slots),
        # and those a worker ended before the pause reached it (more on a loaded machine); not every one.
        assert REFUSED_AFTER <= errors <= 30, stats["scores"]
        assert stats["remaining_for_resume"] == 60 - 3 - errors
        # The agent's calls stopped too: those of the prompts judged, refused, or in flight at the stop.
        assert len([c for c in run_ep.calls if not c["check"]]) <= 3 + errors + SLOTS
        for path in run_dir.iterdir():
            assert JUDGE_KEY not in path.read_text("utf-8", "replace"), path.name
        assert JUDGE_KEY not in err

        topped_up.append(True)
        code, err, run_dir = _judged_run(tmp_path, capsys, monkeypatch, judge_ep, run_ep, 60, resume=True)
        assert code == 0, err
        stats = json.loads((run_dir / "statistics.json").read_text())
        assert (
            stats["trajectories"] + stats["discarded"]["total"] == 60 and stats["remaining_for_resume"] == 0
        )
        # The samples refused before the stop keep their scorer error; the rest were judged.
        assert stats["scores"]["scorer_errors"] == errors and stats["scores"]["passed"] == 60 - errors
        # The summary names the re-scoring that judges those again, and only those.
        assert f"{errors} scorer error(s): this judges them again" in err, err
        (command,) = [line for line in err.splitlines() if "--only_errors" in line]
        assert shlex.split(command) == [
            "python", "-m", "batchrun.views.score", str(run_dir), "--scorer=judge", "--judge_model=judge-m",
            f"--judge_base_url={judge_ep.base_url.rstrip('/')}", "--only_errors",
        ]  # fmt: skip
        asked = len(judge_ep.calls)
        assert score.main(shlex.split(command)[3:]) == 0
    out = capsys.readouterr().out
    assert f"Judged again: {errors} sample(s) whose verdict in the run was a scorer error" in out
    # Judged again: its start check, then the errors' samples alone; every sample now has a verdict.
    assert len(judge_ep.calls) - asked == 1 + errors
    rescored = json.loads((run_dir / "statistics.json").read_text())["scores"]["rescored"]["judge"]
    assert (rescored["scorer_errors"], rescored["passed"], rescored["judged_again"]) == (0, 60, errors)
    assert rescored["only_errors"] is True
    lines = read_jsonl(run_dir / "scores.judge.jsonl")
    assert len(lines) == 60 and all(line["score"]["passed"] is True for line in lines)


def test_a_judge_that_dies_mid_run_stops_it(tmp_path, capsys, monkeypatch):
    """The judge's server gone mid-run (every call 503): before, every later sample was kept with a
    scorer error after the judge's retries; now the run stops as for its own dead endpoint (exit 5)."""

    judge = out_of_credits_after(3, (503, {"error": {"message": "upstream gone"}}), VERDICT)
    with ScriptedEndpoint(lambda call, calls: (200, OK_REPLY)) as run_ep, ScriptedEndpoint(judge) as judge_ep:
        code, err, run_dir = _judged_run(tmp_path, capsys, monkeypatch, judge_ep, run_ep, 60)
    assert code == EXIT_ENDPOINT_DEAD, err
    assert "judge calls in a row failed for the endpoint's reasons" in err
    assert "The run stopped: the judge's endpoint stopped answering" in err and "resume=True" in err
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["remaining_for_resume"] > 20
