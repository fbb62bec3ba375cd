"""batchrun/prompt/llm.py: extra_body from the flags, native reasoning fields, and the client over HTTP to the fake."""

from __future__ import annotations

import time

import pytest

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.llm import LLMClient, LLMConfig, LLMError, build_extra_body, native_reasoning

# ----------------------------------------------------------------------------- build_extra_body


def _cfg(**kw) -> LLMConfig:
    return LLMConfig(model="m", base_url="http://127.0.0.1:9/v1", **kw)


def test_extra_body_empty_when_no_flag_is_set():
    assert build_extra_body(_cfg()) == {}


def test_extra_body_provider_preferences():
    body = build_extra_body(
        _cfg(
            providers_allowed=("a", "b"),
            providers_ignored=("c",),
            providers_order=("b", "a"),
            provider_sort="price",
        )
    )
    assert body == {"provider": {"only": ["a", "b"], "ignore": ["c"], "order": ["b", "a"], "sort": "price"}}


def test_extra_body_sort_alone():
    assert build_extra_body(_cfg(provider_sort="latency")) == {"provider": {"sort": "latency"}}


@pytest.mark.parametrize("effort", ["minimal", "high", "xhigh"])
def test_extra_body_reasoning_effort(effort):
    assert build_extra_body(_cfg(reasoning_effort=effort)) == {
        "reasoning": {"enabled": True, "effort": effort}
    }


def test_extra_body_reasoning_disabled_wins_over_effort():
    body = build_extra_body(_cfg(reasoning_effort="high", reasoning_disabled=True, providers_allowed=("a",)))
    assert body == {"provider": {"only": ["a"]}, "reasoning": {"effort": "none"}}


def test_explicit_extra_body_is_sent_as_given():
    cfg = _cfg(reasoning_effort="high", extra_body={"custom": 1})
    assert cfg.request_extra_body() == {"custom": 1}


# ----------------------------------------------------------------------------- native_reasoning


def test_native_reasoning_from_reasoning_content():
    assert native_reasoning({"reasoning_content": "  deep thought \n"}) == "deep thought"


def test_native_reasoning_from_reasoning():
    assert (
        native_reasoning({"content": "x", "reasoning": "from the reasoning field"})
        == "from the reasoning field"
    )


def test_native_reasoning_from_reasoning_details():
    details = [
        {"type": "reasoning.text", "text": "step one"},
        {"type": "reasoning.encrypted", "data": "b64=="},  # nothing readable: skipped
        "not a dict",
        {"type": "reasoning.summary", "summary": "the summary"},
        {"type": "reasoning.text", "text": "   "},
    ]
    assert native_reasoning({"reasoning_details": details}) == "step one\n\nthe summary"


def test_native_reasoning_prefers_a_non_empty_field():
    assert native_reasoning({"reasoning_content": "", "reasoning": "second"}) == "second"
    assert native_reasoning({"reasoning_content": None, "reasoning_details": [{"text": "third"}]}) == "third"


@pytest.mark.parametrize(
    "message",
    [
        {},
        {"content": "<think>x</think>"},
        {"reasoning": "  "},
        {"reasoning_details": []},
        {"reasoning_details": "x"},
    ],
)
def test_native_reasoning_none(message):
    assert native_reasoning(message) is None


# ----------------------------------------------------------------------------- the client over HTTP

TERMINAL = {
    "type": "function",
    "function": {
        "name": "terminal",
        "description": "run",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


@pytest.fixture(scope="module")
def server():
    with FakeModelServer(latency_s=0) as srv:
        yield srv


def _client(server, **kw) -> LLMClient:
    kw.setdefault("max_retries", 0)
    kw.setdefault("request_timeout_s", 10)
    return LLMClient(LLMConfig(model="fake-model", base_url=server.base_url, api_key="k", **kw))


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_reads_native_reasoning_and_tool_calls(server):
    turn = _client(server).chat(_user("list the files"), [TERMINAL])
    assert turn.reasoning and "list the files" in turn.reasoning
    assert turn.finish_reason == "tool_calls"
    assert [c.name for c in turn.tool_calls] == ["terminal"]
    assert '"command"' in turn.tool_calls[0].arguments
    assert turn.usage["total_tokens"] > 0


def test_chat_reads_reasoning_details(server):
    turn = _client(server).chat(_user("details please [reasoning_details]"), [TERMINAL])
    assert turn.reasoning and "details please" in turn.reasoning


def test_chat_leaves_scratchpad_in_the_content(server):
    turn = _client(server).chat(_user("pad please [scratchpad] [calls:0]"), [])
    assert turn.reasoning is None
    assert turn.content.startswith("<REASONING_SCRATCHPAD>")


def test_chat_without_reasoning(server):
    turn = _client(server).chat(_user("bare [no_reasoning] [calls:0]"), [])
    assert turn.reasoning is None
    assert turn.finish_reason == "stop"


def test_request_carries_extra_body_and_max_tokens(server):
    client = _client(
        server, providers_allowed=("a", "b"), provider_sort="price", reasoning_effort="high", max_tokens=77
    )
    client.chat(_user("extra body check [calls:0]"), [])
    req = server.stats()["last_requests"][-1]
    assert req["provider"] == {"only": ["a", "b"], "sort": "price"}
    assert req["reasoning"] == {"enabled": True, "effort": "high"}
    assert req["max_tokens"] == 77


def test_plain_request_has_no_openrouter_fields(server):
    _client(server).chat(_user("plain body check [calls:0]"), [])
    req = server.stats()["last_requests"][-1]
    assert "provider" not in req and "reasoning" not in req and "max_tokens" not in req
    assert "tools" not in req  # no tools offered: the key is left out


@pytest.mark.parametrize(
    ("prompt", "error_class"),
    [
        ("[error:500]", "http_500"),
        ("[error:404]", "http_404"),
        ("[error:429]", "http_429"),
        ("[error:400]", "http_400"),
        ("[garbage]", "bad_response"),
        ("[hangup]", "connection"),
    ],
)
def test_endpoint_errors_become_llm_errors_with_a_class(server, prompt, error_class):
    with pytest.raises(LLMError) as info:
        _client(server).chat(_user(f"broken endpoint {prompt}"), [TERMINAL])
    assert info.value.error_class == error_class
    assert str(info.value)


def test_client_retries_rate_limits(server):
    before = server.stats()["requests_by_prompt"].get("retry me [flaky:2] [calls:0]", 0)
    turn = _client(server, max_retries=2).chat(_user("retry me [flaky:2] [calls:0]"), [])
    assert turn.finish_reason == "stop"
    assert server.stats()["requests_by_prompt"]["retry me [flaky:2] [calls:0]"] - before == 3


def test_wrong_key_is_http_401():
    with FakeModelServer(api_key="right-key") as srv:
        client = LLMClient(LLMConfig(model="m", base_url=srv.base_url, api_key="wrong-key", max_retries=0))
        with pytest.raises(LLMError) as info:
            client.chat(_user("hi"), [])
    assert info.value.error_class == "http_401"
    assert info.value.status == 401


def test_call_timeout_is_a_timeout_error(server):
    with pytest.raises(LLMError) as info:
        _client(server).chat(_user("too slow [slow:2] [calls:0]"), [], deadline=time.monotonic() + 1.0)
    assert info.value.error_class == "timeout"


def test_call_timeout_bounds_the_retries_too(server):
    """The deadline is the prompt's: retries of a slow endpoint must not run past it."""

    started = time.monotonic()
    with pytest.raises(LLMError):
        _client(server, max_retries=3).chat(
            _user("too slow again [slow:2] [calls:0]"), [], deadline=time.monotonic() + 1.0
        )
    assert time.monotonic() - started < 2.5


def test_rate_limit_is_retried_with_less_time_left_than_request_timeout(server):
    client = _client(server, max_retries=3, request_timeout_s=600)
    turn = client.chat(_user("retry me later [flaky:2] [calls:0]"), [], deadline=time.monotonic() + 300.0)
    assert turn.finish_reason == "stop"


@pytest.mark.slow
def test_persistent_429_without_retry_after_backs_off_exponentially():
    """A 429 that never clears (OpenAI's insufficient_quota has no Retry-After) must not be hammered."""
    import http.server
    import threading

    hits = []

    class Always429(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hits.append(time.monotonic())
            body = b'{"error": {"message": "You exceeded your current quota", "code": "insufficient_quota"}}'
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Always429)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        client = LLMClient(LLMConfig(model="m", base_url=base_url, api_key="k", max_retries=3))
        with pytest.raises(LLMError) as info:
            client.chat(_user("quota"), [], deadline=time.monotonic() + 3.0)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert info.value.error_class == "http_429"
    # exponential back-off from 0.5 s (jitter 0.5-1x): at most 4-5 attempts in 3 s
    assert len(hits) <= 5, f"{len(hits)} requests in 3 s"


def test_provider_pinning_and_data_collection_reach_extra_body():
    cfg = LLMConfig(
        model="m",
        base_url="https://openrouter.ai/api/v1",
        providers_order=("a",),
        provider_allow_fallbacks=False,
        provider_data_collection="deny",
    )
    assert build_extra_body(cfg)["provider"] == {
        "order": ["a"],
        "allow_fallbacks": False,
        "data_collection": "deny",
    }
    assert build_extra_body(cfg)["usage"] == {"include": True}  # OpenRouter reports each call's cost
    plain = LLMConfig(model="m", base_url="http://localhost:8000/v1")
    assert build_extra_body(plain) == {}  # a plain endpoint gets no field it may not know


def test_answers_from_less_strict_servers_are_normalised():
    """Some OpenAI-compatible servers send arguments as an object, or content as a list of parts."""
    from batchrun.prompt.llm import _parse_payload

    turn = _parse_payload(
        {
            "choices": [
                {
                    "finish_reason": "tool_calls",
                    "message": {
                        "content": [{"type": "text", "text": "Let me "}, {"type": "text", "text": "look."}],
                        "tool_calls": [{"function": {"name": "terminal", "arguments": {"command": "ls"}}}],
                    },
                }
            ]
        }
    )
    assert turn.content == "Let me look."
    assert turn.tool_calls[0].arguments == '{"command": "ls"}'
    assert turn.tool_calls[0].id == "call_0"
    assert turn.usage == {}
