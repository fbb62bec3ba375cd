"""The scripted fake model, its policy and its HTTP server, driven through the real ``openai`` client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from batchrun.fakes.fake_model import FakeModelServer, find_prompt, parse_directives, respond


def _tool(name: str, props: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": name,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


S = {"type": "string"}
TERMINAL = _tool("terminal", {"command": S, "timeout": {"type": "integer"}}, ["command"])
READ_FILE = _tool("read_file", {"path": S, "offset": {"type": "integer"}}, ["path"])
WRITE_FILE = _tool("write_file", {"path": S, "content": S}, ["path", "content"])
SEARCH_FILES = _tool("search_files", {"pattern": S, "path": S}, ["pattern"])
WEB_SEARCH = _tool("web_search", {"query": S, "limit": {"type": "integer"}}, ["query", "limit"])
ALL = [TERMINAL, READ_FILE, WRITE_FILE, SEARCH_FILES, WEB_SEARCH]


@pytest.fixture(scope="module")
def server():
    with FakeModelServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    server.reset_stats()
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=10)


def _ask(client, prompt: str, tools=None, messages=None, **kw):
    msgs = messages or [{"role": "user", "content": prompt}]
    extra = {"tools": tools} if tools else {}
    return client.chat.completions.create(model="test-model", messages=msgs, **extra, **kw)


def _converse(client, prompt: str, tools, limit: int = 8):
    """Drive the model like an agent loop, feeding back a canned result per tool call.

    Returns (number of model calls, messages, last completion)."""
    messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": prompt}]
    for n in range(1, limit + 1):
        completion = _ask(client, prompt, tools, messages=messages)
        msg = completion.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return n, messages, completion
        for call in msg.tool_calls:
            result = json.dumps({"output": f"result of {call.function.name} #{n}", "exit_code": 0})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return limit, messages, completion


# --- the policy, without HTTP --------------------------------------------------------------------


def test_respond_is_deterministic_and_valid():
    body = {"model": "m", "messages": [{"role": "user", "content": "List files"}], "tools": ALL}
    a, b = respond(body), respond(json.loads(json.dumps(body)))
    assert a == b
    assert a["object"] == "chat.completion" and a["model"] == "m"
    usage = a["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    calls = a["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["terminal", "write_file"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "echo list-files && pwd"}
    write = json.loads(calls[1]["function"]["arguments"])
    assert set(write) == {"path", "content"} and write["path"].startswith("notes/answer_")


def test_arguments_fit_the_offered_schema():
    terminal = _tool("terminal", {"cmd": S, "background": {"type": "boolean"}}, ["cmd", "background"])
    out = respond({"messages": [{"role": "user", "content": "hi"}], "tools": [terminal]})
    args = json.loads(out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert args == {"cmd": "echo hi && pwd", "background": False}
    out = respond({"messages": [{"role": "user", "content": "find cats"}], "tools": [WEB_SEARCH]})
    args = json.loads(out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert args == {"query": "find cats", "limit": 1}


def test_prompt_is_found_after_prefill_messages():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "few-shot question"},
        {"role": "assistant", "content": "few-shot answer"},
        {"role": "user", "content": "the real prompt"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
        {"role": "user", "content": "a nudge appended later"},
    ]
    assert find_prompt(messages) == (3, "the real prompt")
    assert find_prompt([{"role": "system", "content": "s"}]) == (-1, "")


def test_parse_directives():
    d = parse_directives("x [flaky:2] [slow:0.5] [error:429] [calls:3] [scratchpad] [loop]")
    assert (d.flaky, d.slow, d.error, d.calls, d.scratchpad, d.loop) == (2, 0.5, 429, 3, True, True)
    assert parse_directives("plain [unknown] text") == parse_directives("")


# --- over HTTP with the openai SDK --------------------------------------------------------------


def test_tool_turn_then_final_answer_with_native_reasoning(client, server):
    first = _ask(client, "Count the files", ALL)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["terminal", "write_file"]
    # openai's response models allow extra fields: unknown keys are plain attributes (raw JSON
    # values) and are also collected in `model_extra`.
    msg = choice.message
    assert msg.reasoning_content and msg.reasoning == msg.reasoning_content
    assert msg.model_extra["reasoning_content"] == msg.reasoning_content
    assert getattr(msg, "reasoning_details", None) is None

    server.reset_stats()
    calls, messages, last = _converse(client, "Count the files", ALL)
    assert calls == 3
    # messages: system, user, assistant (terminal + write_file), 2 tool results, assistant (read_file)...
    assert [c["function"]["name"] for c in messages[5]["tool_calls"]] == ["read_file"]
    read_args = json.loads(messages[5]["tool_calls"][0]["function"]["arguments"])
    write_args = json.loads(messages[2]["tool_calls"][1]["function"]["arguments"])
    assert read_args == {"path": write_args["path"]}  # reads back the file it wrote
    final = last.choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "result of read_file #2" in final.message.content  # the tool result reached the model
    assert final.message.reasoning_content
    assert last.model == "test-model"
    assert server.stats()["status_counts"] == {200: 3}


@pytest.mark.parametrize(
    ("prompt", "tools", "expected"),
    [
        ("p", ALL, 3),
        ("p", [TERMINAL], 3),
        ("p", [READ_FILE, WRITE_FILE], 3),
        ("p", [SEARCH_FILES], 3),
        ("p", [WEB_SEARCH], 2),
        ("p", None, 1),
        ("p [hallucinate]", ALL, 4),
        ("p [hallucinate]", None, 2),
        ("p [bad_json]", ALL, 4),
        ("p [bad_json]", None, 1),
        ("p [calls:5]", ALL, 6),
        ("p [calls:2]", [WEB_SEARCH], 3),
        ("p [loop]", ALL, 8),
    ],
)
def test_calls_per_prompt(client, prompt, tools, expected):
    calls, _, last = _converse(client, prompt, tools, limit=8)
    assert calls == expected
    if "[loop]" in prompt:
        assert last.choices[0].message.tool_calls[0].function.arguments == '{"command": "echo again"}'
    else:
        assert last.choices[0].finish_reason == "stop"


def test_calls_directive_cycles_through_offered_tools(client):
    _, messages, _ = _converse(client, "go [calls:5]", [TERMINAL, READ_FILE, WEB_SEARCH])
    names = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
    assert names == ["terminal", "read_file", "web_search", "terminal", "read_file"]


def test_reasoning_directives(client):
    msg = _ask(client, "hi [no_reasoning]", ALL).choices[0].message
    assert msg.model_extra == {} and "SCRATCHPAD" not in (msg.content or "")

    msg = _ask(client, "hi [scratchpad]", ALL).choices[0].message
    assert msg.content.startswith("<REASONING_SCRATCHPAD>") and "</REASONING_SCRATCHPAD>" in msg.content
    assert msg.model_extra == {}

    msg = _ask(client, "hi [reasoning_details]").choices[0].message
    assert set(msg.model_extra) == {"reasoning_details"}
    detail = msg.reasoning_details[0]  # a plain dict, not a model
    assert detail["type"] == "reasoning.text" and detail["text"]


def test_hallucinate_and_bad_json(client):
    calls = _ask(client, "x [hallucinate]", ALL).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["teleport"]

    calls = _ask(client, "x [bad_json]", ALL).choices[0].message.tool_calls
    assert calls[0].function.name == "terminal"
    assert calls[0].function.arguments == '{"command": "ls"'
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0].function.arguments)


def test_truncate(client):
    choice = _ask(client, "write an essay [truncate]", ALL).choices[0]
    assert choice.finish_reason == "length" and choice.message.content and not choice.message.tool_calls


@pytest.mark.parametrize(
    ("code", "exc"),
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (404, openai.NotFoundError),
        (429, openai.RateLimitError),
        (500, openai.InternalServerError),
    ],
)
def test_error_directives(client, server, code, exc):
    with pytest.raises(exc) as info:
        _ask(client, f"x [error:{code}]")
    assert info.value.status_code == code
    assert set(info.value.body) >= {"message", "type", "code"}  # the SDK unwraps {"error": {...}}
    assert server.stats()["status_counts"] == {code: 1}


def test_flaky_then_sdk_retries_succeed(server):
    server.reset_stats()
    prompt = "try again [flaky:2]"
    retrying = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=3)
    out = _ask(retrying, prompt)
    assert out.choices[0].finish_reason == "stop"
    stats = server.stats()
    assert stats["status_counts"] == {429: 2, 200: 1}
    assert stats["requests_by_prompt"] == {prompt: 3}

    server.reset_stats()
    raw = urllib.request.Request(
        server.base_url + "/chat/completions",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(raw, timeout=5)
    assert info.value.code == 429 and info.value.headers["Retry-After"] == "0"


def test_garbage_hangup_slow(client, server):
    with pytest.raises(ValueError):  # the SDK raises json.JSONDecodeError, not an openai error
        _ask(client, "x [garbage]")
    with pytest.raises(openai.APIConnectionError):
        _ask(client, "x [hangup]")
    t0 = time.monotonic()
    assert _ask(client, "x [slow:0.3]").choices[0].finish_reason == "stop"
    assert time.monotonic() - t0 >= 0.3
    stats = server.stats()
    assert stats["hangups"] == 1 and stats["status_counts"] == {200: 2}


def test_stream_is_the_same_reply_in_chunks(client):
    """The SDK's own stream reader joins the chunks back into the non-streaming reply."""
    plain = _ask(client, "stream me [calls:2]", [TERMINAL]).choices[0].message
    chunks = list(
        _ask(client, "stream me [calls:2]", [TERMINAL], stream=True, stream_options={"include_usage": True})
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    args: dict[int, str] = {}
    for c in chunks:
        for call in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
    assert len(chunks) > 5 and content == plain.content
    assert [args[i] for i in sorted(args)] == [t.function.arguments for t in plain.tool_calls]
    assert chunks[-1].usage.prompt_tokens > 0 and not chunks[-1].choices


def test_last_requests_keep_extra_body(client, server):
    _ask(
        client,
        "routed",
        max_tokens=123,
        extra_body={"provider": {"only": ["a"]}, "reasoning": {"enabled": True, "effort": "high"}},
    )
    last = server.stats()["last_requests"][-1]
    assert last["provider"] == {"only": ["a"]}
    assert last["reasoning"] == {"enabled": True, "effort": "high"}
    assert last["max_tokens"] == 123 and last["messages"][0]["content"] == "routed"


def test_concurrency_counters():
    # 1 s: all 20 must overlap, and opening 20 clients' connections on a busy 2-core machine once
    # took longer than 0.2 s (max_in_flight 19).
    with FakeModelServer(latency_s=1.0) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        barrier = threading.Barrier(20)

        def one(i):
            barrier.wait()
            return _ask(c, f"prompt {i}", ALL).choices[0].finish_reason

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(one, range(20)))
        assert results == ["tool_calls"] * 20
        stats = srv.stats()
        assert stats["max_in_flight"] == 20 and stats["in_flight"] == 0
        assert stats["requests"] == 20 and stats["status_counts"] == {200: 20}
        assert stats["prompt_tokens"] > 0 and stats["completion_tokens"] > 0
        assert len(stats["requests_by_prompt"]) == 20


def test_many_concurrent_connections():
    with FakeModelServer(latency_s=1.0) as srv:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

        def one(_):
            req = urllib.request.Request(
                srv.base_url + "/chat/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())["choices"][0]["finish_reason"]

        with ThreadPoolExecutor(300) as pool:
            assert list(pool.map(one, range(300))) == ["stop"] * 300
        assert srv.stats()["max_in_flight"] >= 150


def test_stats_reset_and_models_over_http(client, server):
    _ask(client, "hello")
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/stats", timeout=5) as resp:
        stats = json.loads(resp.read())
    assert stats["requests"] == 1 and stats["status_counts"] == {"200": 1}  # JSON keys are strings
    req = urllib.request.Request(server.base_url.removesuffix("/v1") + "/reset", data=b"", method="POST")
    urllib.request.urlopen(req, timeout=5).close()
    assert server.stats()["requests"] == 0
    assert [m.id for m in client.models.list()] == ["mock"]


def test_api_key_required():
    with FakeModelServer(api_key="secret") as srv:
        bad = openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            _ask(bad, "hi")
        assert info.value.body["type"] == "authentication_error"
        good = openai.OpenAI(base_url=srv.base_url, api_key="secret", max_retries=0)
        assert _ask(good, "hi").choices[0].finish_reason == "stop"
        assert srv.stats()["status_counts"] == {401: 1, 200: 1}


def test_module_entry_point():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun.fakes.fake_model", "--port", "0", "--latency", "0"],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base_url = proc.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        assert _ask(c, "hi").choices[0].finish_reason == "stop"
    finally:
        proc.terminate()
        proc.wait(timeout=5)
