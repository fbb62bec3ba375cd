"""The start check (batchrun/run/preflight.py): one minimal real chat call before any prompt.

A scripted endpoint answers the chat call the way LiteLLM's proxy and others refuse a run that cannot
work (a wrong key as 400, a model name it rejects, a field it does not take): the run exits 2 naming
the status and the server's message, before any prompt's request, and never prints the key.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import OK_REPLY, ScriptedEndpoint, exit_code, write_jsonl

from batchrun.config import UsageError
from batchrun.prompt.llm import LLMConfig
from batchrun.run.preflight import Unavailable, check_chat

KEY = "sk-start-check-secret-123"


def Endpoint(status: int, message: str = "") -> ScriptedEndpoint:
    """Answers GET /models with 404 and every chat call with ``status`` and ``message``."""

    def answer(call: dict, calls: list[dict]):
        if status == 200:
            return 200, OK_REPLY
        return status, {"error": {"message": message, "type": "invalid_request_error", "code": str(status)}}

    return ScriptedEndpoint(answer)


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (400, "Authentication Error, Invalid proxy server token passed. Received API Key = sk-...123"),
        (400, "Invalid model name passed in model=nope. Call `/v1/models` to view available models"),
        (401, "Incorrect API key provided"),
        (403, "This key may not use this model"),
        (404, "The model `nope` does not exist"),
        (422, "Unprocessable Entity: extra fields not permitted (chat_template_kwargs)"),
    ],
)
def test_a_refused_start_check_names_the_status_and_the_servers_message(status, message):
    with Endpoint(status, message) as ep:
        with pytest.raises(UsageError) as info:
            check_chat(LLMConfig(model="nope", base_url=ep.base_url, api_key=KEY))
        assert len(ep.calls) == 1  # one call, not retried
    text = str(info.value)
    assert f"HTTP {status}" in text and message[:40] in text
    assert KEY not in text


def test_the_start_check_sends_the_model_and_the_dialects_fields():
    with Endpoint(200) as ep:
        check_chat(LLMConfig(model="m1", base_url=ep.base_url, api_key=KEY, reasoning_disabled=True))
        (call,) = ep.calls
    assert call["body"]["model"] == "m1" and call["check"] == "1"
    assert call["body"]["chat_template_kwargs"] == {
        "enable_thinking": False,
        "thinking": False,
    }  # local dialect
    assert call["body"]["max_tokens"] <= 16


def test_a_run_against_a_refusing_endpoint_exits_2_before_any_prompt(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"task {i}" for i in range(5)])
    with Endpoint(400, "Invalid model name passed in model=nope") as ep:
        code = exit_code(None, dataset, tmp_path / "data", model="nope", base_url=ep.base_url, api_key=KEY)
        calls = len(ep.calls)
    err = capsys.readouterr().err
    assert code == 2
    assert calls == 1  # the start check only: no prompt sent a doomed request
    assert "HTTP 400" in err and "Invalid model name" in err and KEY not in err
    assert not (tmp_path / "data" / "run").exists()  # nothing left: not even its lock file
    # A directory that was there before the refused run stays (with what it held).
    (tmp_path / "data" / "run").mkdir(parents=True)
    with Endpoint(400, "Invalid model name passed in model=nope") as ep:
        assert (
            exit_code(None, dataset, tmp_path / "data", model="nope", base_url=ep.base_url, api_key=KEY) == 2
        )
    assert (tmp_path / "data" / "run").is_dir()


@pytest.mark.parametrize("key_from", ["flag", "environment"])
def test_an_endpoint_that_quotes_the_key_in_its_refusal_never_gets_it_printed(
    tmp_path, capsys, monkeypatch, key_from
):
    import base64

    def answer(call: dict, calls: list[dict]):
        auth = call["headers"].get("Authorization", "")
        b64 = base64.b64encode(auth.removeprefix("Bearer ").encode()).decode()
        return 401, {"error": {"message": f"invalid key {auth} (base64 {b64})"}}

    dataset = write_jsonl(tmp_path / "d.jsonl", ["task"])
    extra = {"api_key": KEY} if key_from == "flag" else {}
    if key_from == "environment":
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with ScriptedEndpoint(answer) as ep:
        code = exit_code(None, dataset, tmp_path / "data", model="m", base_url=ep.base_url, **extra)
    out, err = capsys.readouterr()
    assert code == 2 and "HTTP 401" in err and "invalid key Bearer [REDACTED]" in err, err
    assert KEY not in out + err and base64.b64encode(KEY.encode()).decode()[:-4] not in out + err


@pytest.mark.parametrize("flag", ["base_url", "num_workers", "endpoint_dialect", "budget_usd"])
def test_a_key_pasted_into_the_wrong_flag_is_not_repeated(tmp_path, capsys, flag):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["task"])
    code = exit_code(None, dataset, tmp_path / "data", **{flag: KEY})
    err = capsys.readouterr().err
    assert code == 2 and f"--{flag}" in err and KEY not in err and "not shown" in err, err


def test_a_per_prompt_usd_cap_against_an_endpoint_that_reports_no_cost_exits_2_before_any_prompt(
    tmp_path, capsys
):
    """--max_prompt_usd compares the prompt's reported cost: against an endpoint that reports none it
    stayed at $0, so the cap never ended a prompt, and every prompt spent up to its turns uncapped."""
    import copy

    reply = copy.deepcopy(OK_REPLY)
    reply["usage"] = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    dataset = write_jsonl(tmp_path / "d.jsonl", ["task"])
    with ScriptedEndpoint(lambda call, calls: (200, reply)) as ep:
        code = exit_code(
            None, dataset, tmp_path / "data", model="m", base_url=ep.base_url, api_key=KEY,
            max_prompt_usd=0.01,
        )  # fmt: skip
        sent = [c for c in ep.calls if not c["check"]]
    err = capsys.readouterr().err
    assert code == 2 and "--max_prompt_usd needs each answer's cost" in err and "--max_prompt_tokens" in err
    assert not sent and not (tmp_path / "data" / "run").exists()


@pytest.mark.parametrize("priced", [False, True], ids=["no_cost", "cost"])
def test_a_usd_budget_against_an_endpoint_that_reports_no_cost_exits_2_before_any_prompt(
    tmp_path, capsys, priced
):
    """OpenAI, vLLM and llama.cpp report no usage.cost: a --budget_usd would count nothing and spend on."""
    import copy

    reply = copy.deepcopy(OK_REPLY)
    reply.setdefault("usage", {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})
    if priced:
        reply["usage"]["cost"] = 0.00001
    dataset = write_jsonl(tmp_path / "d.jsonl", ["task"])
    with ScriptedEndpoint(lambda call, calls: (200, reply)) as ep:
        code = exit_code(
            None, dataset, tmp_path / "data", model="m", base_url=ep.base_url, api_key=KEY, budget_usd=5,
            max_tokens=16,
        )  # fmt: skip
        sent = [c for c in ep.calls if not c["check"]]
    err = capsys.readouterr().err
    if priced:
        assert code == 0 and sent, err
    else:
        assert code == 2 and "--budget_usd needs each answer's cost" in err and "--budget_tokens" in err
        assert not sent and not (tmp_path / "data" / "run").exists()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_endpoint_whose_answers_carry_no_finish_reason_is_refused_before_any_prompt(
    tmp_path, capsys, stream
):
    """A proxy that drops finish_reason makes every final answer a discard (unknown_finish_reason: it may
    be cut short): before, the run spent on every prompt and kept none. With --stream the start check
    (not streamed) cannot tell what the stream will carry: a warning, and the run goes on."""
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"}}]}
    dataset = write_jsonl(tmp_path / "d.jsonl", ["task"])
    with ScriptedEndpoint(lambda call, calls: (200, reply)) as ep:
        code = exit_code(
            None, dataset, tmp_path / "data", model="m", base_url=ep.base_url, api_key=KEY, stream=stream
        )
        sent = [c for c in ep.calls if not c["check"]]
    err = capsys.readouterr().err
    assert "no finish_reason" in err and KEY not in err, err
    if stream:
        assert code == 0 and sent
    else:
        assert code == 2 and not sent and not (tmp_path / "data" / "run").exists()


ESCAPES = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mred\x9b"  # set the title, clear the screen, colour; a C1 CSI


def test_an_endpoints_control_characters_never_reach_the_terminal(tmp_path, capsys):
    """A hostile endpoint's error text (and the model ids it lists) reached the console as it was, in
    the start check's error, the --verbose failure lines and the closing summary: its ESC sequences
    set the terminal's title, cleared it, hid text. They are shown as \\xNN now; failed.jsonl keeps them."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["p1"])
    models = (200, {"object": "list", "data": [{"id": f"evil{ESCAPES}"}]})

    def refused(call, calls):
        return 400, {"error": {"message": f"no {ESCAPES}"}}

    def fails_prompts(call, calls):
        return (200, OK_REPLY) if call["check"] else (500, {"error": {"message": f"boom {ESCAPES}"}})

    with ScriptedEndpoint(refused, get=models) as ep:
        assert exit_code(None, dataset, tmp_path / "data", model="m", base_url=ep.base_url) == 2
    with ScriptedEndpoint(fails_prompts, get=models) as ep:
        run = dict(model="m", base_url=ep.base_url, api_key="k", verbose=True, max_retries=0, run_name="r2")
        assert exit_code(None, dataset, tmp_path / "data", **run) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err and "\x9b" not in out + err
    assert (out + err).count("boom \\x1b]0;PWNED\\x07") == 2, out + err  # the verbose line, the summary
    assert "no \\x1b]0;PWNED" in err and "evil\\x1b]0;PWNED" in err
    (failed,) = [json.loads(line) for line in (tmp_path / "data" / "r2" / "failed.jsonl").open()]
    assert ESCAPES in failed["error"]  # the file keeps what the endpoint said


def test_a_models_tool_calls_and_their_output_never_reach_the_terminal_as_control_characters(
    tmp_path, capsys
):
    """--verbose previews each tool call: its arguments are the model's words, its result a command's
    output. JSON keeps the C1 controls (CSI U+009B: ESC [ in one character) raw in both, and the
    previews reached the console as they were: a hostile model could clear the screen, hide text."""
    dataset = write_jsonl(tmp_path / "d.jsonl", ["p1"])
    # The command's output holds a C1 CSI (UTF-8) then "2J"; its arguments hold one raw (JSON allows it).
    command = "printf 'A\\302\\2332JB' # \x9b8m"
    calls = [{"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": json.dumps({"command": command}, ensure_ascii=False)}}]  # fmt: skip
    tool_turn = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": "", "tool_calls": calls},
            }
        ]
    }

    def answer(call, seen):
        if call["check"] or any(m.get("role") == "tool" for m in call["body"]["messages"]):
            return 200, OK_REPLY
        return 200, tool_turn

    with ScriptedEndpoint(answer) as ep:
        run = dict(
            model="m",
            base_url=ep.base_url,
            api_key="k",
            verbose=True,
            max_retries=0,
            num_workers=1,
            keep_no_reasoning=True,
        )
        assert exit_code(None, dataset, tmp_path / "data", **run) == 0
    err = capsys.readouterr().err
    assert "terminal(" in err and "A\\x9b2JB" in err and "# \\x9b8m" in err  # shown, not obeyed
    assert "\x9b" not in err


@pytest.mark.parametrize("where", ["own_endpoint", "run_endpoint"])
def test_a_judge_that_cannot_answer_exits_2_before_any_prompt(tmp_path, capsys, monkeypatch, where):
    """--judge_model with a typo (or a key, or an endpoint, that refuses it): the run spent on every prompt
    and every sample came back unscored (`score.status: error`), since only the run's own model had a
    start check. The judge has its own now, on its own endpoint or the run's."""
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-secret-456")

    def answer(call: dict, calls: list[dict]):
        if call["body"]["model"] == "judge-nope":
            return 404, {"error": {"message": "The model `judge-nope` does not exist"}}
        return 200, OK_REPLY

    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"prompt": "task", "rubric": "r"}) + "\n")
    with ScriptedEndpoint(answer) as run_ep, ScriptedEndpoint(answer) as judge_ep:
        judge_url = judge_ep.base_url if where == "own_endpoint" else run_ep.base_url
        code = exit_code(
            None, dataset, tmp_path / "data", model="m", base_url=run_ep.base_url, api_key=KEY,
            scorer="judge", judge_model="judge-nope", judge_base_url=judge_url,
        )  # fmt: skip
        sent = [c for c in run_ep.calls + judge_ep.calls if not c["check"]]
        checks = [c["body"]["model"] for c in run_ep.calls + judge_ep.calls if c["check"]]
    err = capsys.readouterr().err
    assert code == 2 and not sent, err
    assert checks == ["m", "judge-nope"]
    assert "the judge's endpoint" in err and "HTTP 404" in err and "judge-nope" in err
    assert "sk-judge-secret-456" not in err and KEY not in err
    assert not (tmp_path / "data" / "run").exists()


LOADING = {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}  # llama-server's


def test_a_503_that_does_not_say_loading_fails_the_start_check_at_once(tmp_path, capsys):
    """Only a server loading its model is waited for (--endpoint_grace): a proxy whose upstream is gone
    answers 503 too, and a run against it took the whole grace, 120 s, to exit 2 (0.6 s now)."""
    down = (503, {"error": {"message": "upstream connect error"}})
    endpoint = ScriptedEndpoint(lambda call, calls: down, get=down)
    dataset = write_jsonl(tmp_path / "d.jsonl", ["hi"])
    started = time.monotonic()
    try:
        code = exit_code(None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key=KEY)
    finally:
        endpoint.close()
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2 and "failed the start check: HTTP 503: upstream connect error" in err
    assert "not ready" not in err and took < 30, f"exited after {took:.1f} s"
    assert len(endpoint.calls) == 2  # the start check and its one retry; no prompt


def test_a_server_loading_its_model_is_asked_again_until_it_answers(tmp_path, capsys):
    """llama-server's 503 "Loading model" (on /models and the chat call alike) is waited for."""
    ready_at = time.monotonic() + 2.5

    def answer(call, calls):
        return (200, OK_REPLY) if time.monotonic() >= ready_at else (503, LOADING)

    endpoint = ScriptedEndpoint(answer)
    try:
        check_chat(
            LLMConfig(model="m", base_url=endpoint.base_url, api_key=KEY),
            unavailable=Unavailable(60, "the endpoint", endpoint.base_url),
        )
    finally:
        endpoint.close()
    assert time.monotonic() >= ready_at and endpoint.calls[-1]["check"]
    assert "is not ready (HTTP 503: Loading model" in capsys.readouterr().err
