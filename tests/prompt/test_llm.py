"""batchrun/prompt/llm.py: extra_body from the flags, native reasoning fields, and the client over HTTP to the fake."""

from __future__ import annotations

import json
import threading
import time

import pytest

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.llm import (
    CONTEXT_LIMIT_SIGNS,
    ENCRYPTED_REASONING,
    ContextLimitError,
    LLMClient,
    LLMConfig,
    LLMError,
    build_extra_body,
    dialect_warnings,
    is_context_limit,
    native_reasoning,
    resolve_dialect,
)

# ----------------------------------------------------------------------------- build_extra_body


def _cfg(**kw) -> LLMConfig:
    """An OpenRouter-dialect config on a local address (the dialect is forced, not guessed from the host)."""
    return LLMConfig(model="m", base_url="http://127.0.0.1:9/v1", **{"dialect": "openrouter", **kw})


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


def test_native_reasoning_from_reasoning_content_is_kept_as_written():
    assert native_reasoning({"reasoning_content": "  deep thought \n"}) == "  deep thought "
    # the one line break inside each tag is the record's <think>\n...\n</think> envelope's own
    assert native_reasoning({"reasoning_content": "\n\ndeep\n\n"}) == "\ndeep\n"
    assert native_reasoning({"reasoning_content": " \n\t"}) is None  # blanks only: no reasoning


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
        server,
        providers_allowed=("a", "b"),
        provider_sort="price",
        reasoning_effort="high",
        max_tokens=77,
        dialect="openrouter",
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
    with pytest.raises(LLMError) as info:  # a 429 waited out twice (backed off from the second on)
        _client(server, max_rate_limit_retries=2).chat(_user(f"broken endpoint {prompt}"), [TERMINAL])
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
    assert time.monotonic() - started < 5.5  # three tries of 2 s each would take 6 s


def test_rate_limit_is_retried_with_less_time_left_than_request_timeout(server):
    client = _client(server, max_retries=3, request_timeout_s=600)
    turn = client.chat(_user("retry me later [flaky:2] [calls:0]"), [], deadline=time.monotonic() + 300.0)
    assert turn.finish_reason == "stop"


@pytest.mark.slow
def test_persistent_429_without_retry_after_backs_off_exponentially():
    """A 429 that never clears and says no Retry-After must not be hammered. OpenAI's insufficient_quota
    (a spent quota, no Retry-After either) is no rate limit: asked once, it fails the call at once."""
    from helpers import ScriptedEndpoint

    limited = {"error": {"message": "Rate limit reached for requests", "code": "rate_limit_exceeded"}}
    with ScriptedEndpoint(lambda call, calls: (429, limited)) as endpoint:
        client = LLMClient(LLMConfig(model="m", base_url=endpoint.base_url, api_key="k", max_retries=3))
        with pytest.raises(LLMError) as info:
            client.chat(_user("limited"), [], deadline=time.monotonic() + 3.0)
    assert info.value.error_class == "http_429"
    # exponential back-off from 0.5 s (jitter 0.5-1x): at most 4-5 attempts in 3 s
    hits = len(endpoint.calls)
    assert hits <= 5, f"{hits} requests in 3 s"
    quota = {"error": {"message": "You exceeded your current quota", "code": "insufficient_quota"}}
    with ScriptedEndpoint(lambda call, calls: (429, quota)) as endpoint:
        client = LLMClient(LLMConfig(model="m", base_url=endpoint.base_url, api_key="k", max_retries=3))
        with pytest.raises(LLMError) as info:
            client.chat(_user("quota"), [], deadline=time.monotonic() + 3.0)
    assert info.value.error_class == "insufficient_quota" and len(endpoint.calls) == 1


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


# ----------------------------------------------------------------------------- dialects


@pytest.mark.parametrize(
    ("base_url", "dialect"),
    [
        ("https://openrouter.ai/api/v1", "openrouter"),
        ("https://api.openai.com/v1", "openai"),
        ("http://127.0.0.1:8080/v1", "local"),
        ("http://gpu-box:8000/v1", "local"),
        ("http://localhost:11434/v1", "ollama"),
        ("https://notopenrouter.ai.example/v1", "openai"),  # an unknown remote host: standard fields only
        ("https://api.example.com/v1", "openai"),
        ("http://10.1.2.3:8000/v1", "local"),  # a private network
        ("http://192.168.1.20:11434/v1", "ollama"),
        ("http://[::1]:8080/v1", "local"),
        ("http://llm.internal:8000/v1", "local"),
    ],
)
def test_dialect_follows_the_host(base_url, dialect):
    assert resolve_dialect(base_url) == dialect
    assert resolve_dialect(base_url, "openai") == "openai"  # the flag wins


def _body(base_url: str, **kw) -> dict:
    return build_extra_body(LLMConfig(model="m", base_url=base_url, **kw))


def test_local_servers_get_template_kwargs_and_top_level_effort():
    url = "http://127.0.0.1:8080/v1"
    assert _body(url, reasoning_disabled=True, reasoning_effort="high") == {
        "chat_template_kwargs": {"enable_thinking": False, "thinking": False}
    }
    assert _body(url, reasoning_effort="none")["chat_template_kwargs"]["enable_thinking"] is False
    assert _body(url, reasoning_effort="medium") == {
        "chat_template_kwargs": {"enable_thinking": True, "thinking": True},
        "reasoning_effort": "medium",
    }
    # vLLM and SGLang validate reasoning_effort as low/medium/high: other levels are mapped
    assert _body(url, reasoning_effort="ultra")["reasoning_effort"] == "high"
    assert _body(url, reasoning_effort="minimal")["reasoning_effort"] == "low"
    assert _body(url) == {}


def test_ollama_gets_reasoning_effort_none_to_switch_thinking_off():
    """Ollama's /v1 ignores chat_template_kwargs; reasoning_effort "none" is its off switch."""
    url = "http://127.0.0.1:11434/v1"
    assert _body(url, reasoning_disabled=True) == {"reasoning_effort": "none"}
    assert _body(url, reasoning_effort="xhigh") == {"reasoning_effort": "high"}
    assert _body(url) == {}


def test_openai_gets_only_top_level_reasoning_effort():
    url = "https://api.openai.com/v1"
    assert _body(url, reasoning_disabled=True, providers_allowed=("x",)) == {"reasoning_effort": "none"}
    assert _body(url, reasoning_effort="max") == {"reasoning_effort": "xhigh"}
    assert _body(url, reasoning_effort="low") == {"reasoning_effort": "low"}


def test_provider_flags_reach_only_openrouter_and_are_warned_about_elsewhere():
    cfg = LLMConfig(model="m", base_url="http://127.0.0.1:8080/v1", providers_allowed=("a",))
    assert "provider" not in build_extra_body(cfg)
    assert any("OpenRouter only" in w for w in dialect_warnings(cfg))
    forced = LLMConfig(
        model="m", base_url="http://127.0.0.1:8080/v1", providers_allowed=("a",), dialect="openrouter"
    )
    assert build_extra_body(forced)["provider"] == {"only": ["a"]}
    assert dialect_warnings(forced) == []


def test_reasoning_disabled_that_does_not_take_effect_is_warned_once(server, capsys):
    client = _client(server, reasoning_disabled=True)
    client.chat(_user("still thinking [calls:0]"), [])
    client.chat(_user("still thinking again [calls:0]"), [])
    err = capsys.readouterr().err
    assert err.count("--reasoning_disabled was sent (local dialect)") == 1


# ----------------------------------------------------------------------------- context limits


@pytest.mark.parametrize("sign", CONTEXT_LIMIT_SIGNS, ids=lambda c: f"{c.server}:{c.pattern}")
def test_every_servers_context_limit_is_recognised(sign):
    """Each entry's own example, the way that server sends it (code/type in the error object, or wording)."""
    if sign.field == "message":
        body = {"error": {"message": sign.example, "type": "BadRequestError", "code": 400}}
        assert is_context_limit(400, body, f"HTTP 400: {sign.example}")
    else:
        body = {"error": {"message": sign.example, sign.field: sign.pattern}}
        assert is_context_limit(400, body, "HTTP 400: (wording unknown)")


def test_context_limit_behind_openrouter_metadata_raw():
    body = {
        "error": {
            "message": "Provider returned error",
            "code": 400,
            "metadata": {"raw": "prompt is too long: 9 > 8"},
        }
    }
    assert is_context_limit(400, body, "HTTP 400: Provider returned error")


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (400, "Invalid 'tools[0].function.name': string does not match pattern"),
        (400, "max_tokens must be at least 1"),
        (503, "This model's maximum context length is 8192 tokens"),  # a 5xx is retried, by wording
        (401, "Invalid API key"),
    ],
)
def test_other_errors_are_not_context_limits(status, message):
    assert not is_context_limit(status, {"error": {"message": message}}, f"HTTP {status}: {message}")


def test_llama_cpp_context_overflow_raises_context_limit():
    """The exact body llama-server sends (type exceed_context_size_error), over HTTP through the SDK."""
    import json

    body = json.dumps(
        {
            "error": {
                "code": 400,
                "message": "request (5566 tokens) exceeds the available context size (1024 tokens), try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 5566,
                "n_ctx": 1024,
            }
        }
    ).encode()

    from helpers import ScriptedEndpoint

    with ScriptedEndpoint(lambda call, calls: (400, body)) as endpoint:
        cfg = LLMConfig(model="m", base_url=endpoint.base_url, max_retries=3)
        with pytest.raises(ContextLimitError) as info:
            LLMClient(cfg).chat(_user("hi"), [])
        assert info.value.error_class == "context_limit" and "5566 tokens" in str(info.value)


# ----------------------------------------------------------------------------- reasoning fields


def test_encrypted_only_reasoning_details_count_as_reasoning():
    details = [
        {"type": "reasoning.encrypted", "data": "gAAAA...", "id": "rs_1", "format": "openai-responses-v1"}
    ]
    assert native_reasoning({"content": "x", "reasoning_details": details}) == ENCRYPTED_REASONING


def test_summary_parts_of_reasoning_details():
    details = [{"type": "reasoning.summary", "summary": "first, check the file"}]
    assert native_reasoning({"reasoning_details": details}) == "first, check the file"


@pytest.mark.parametrize(
    ("content", "reasoning", "rest"),
    [
        # the envelope's own line breaks (inside the tags, one after </think>) go; the rest stays
        ("<think>\nplan it\n</think>\n\nThe answer.", "plan it", "\nThe answer."),
        ("plan it\n</think>\n\nThe answer.", "plan it", "\nThe answer."),  # template opened the block
        ("<think>plan it</think>The answer. ", "plan it", "The answer. "),
        ("<think>\n\n  plan it\n\n</think>\n", "\n  plan it\n", ""),
        ("No reasoning here.", None, "No reasoning here."),
        ("  Words with their spaces  \n", None, "  Words with their spaces  \n"),
    ],
)
def test_inline_think_is_split_from_the_content(content, reasoning, rest):
    from batchrun.sharegpt import gpt_value, parse_gpt_value, split_reasoning

    assert split_reasoning(content) == (reasoning, rest)
    assert parse_gpt_value(gpt_value(reasoning, rest, [])) == (reasoning, rest, [])


def test_a_reply_in_the_records_shape_is_recorded_byte_for_byte():
    from batchrun.sharegpt import gpt_value, split_reasoning

    reply = "<think>\nplan it\n</think>\n\nThe answer.\n"
    assert gpt_value(*split_reasoning(reply), []) == reply


# ----------------------------------------------------------------------------- streaming


@pytest.mark.parametrize(
    "prompt",
    [
        "stream check [calls:2]",
        "stream check [reasoning_details]",
        "stream check [scratchpad]",
        "stream final [calls:0]",
    ],
)
def test_streaming_gives_the_same_turn_as_a_plain_call(server, prompt):
    plain = _client(server).chat(_user(prompt), [TERMINAL])
    streamed = _client(server, stream=True).chat(_user(prompt), [TERMINAL])
    assert streamed == plain
    req = server.stats()["last_requests"][-1]
    assert req["stream"] is True and req["stream_options"] == {"include_usage": True}


def test_streaming_tallies_usage_from_the_last_chunk(server):
    from batchrun.prompt.llm import Usage

    usage = Usage()
    turn = _client(server, stream=True).chat(_user("usage check [calls:1]"), [TERMINAL], usage=usage)
    assert turn.usage["prompt_tokens"] > 0 and usage.completion_tokens == turn.usage["completion_tokens"] > 0
    assert turn.served_model == "fake-model"


# ----------------------------------------------------------------------------- what the user sees


def test_a_retried_500_says_it_was_retried(server):
    with pytest.raises(LLMError) as info:
        _client(server, max_retries=3).chat(_user("always broken [error:500]"), [])
    assert info.value.error_class == "http_500"
    assert str(info.value).endswith("(failed 4 times: 1 try + 3 retries)")


def test_closing_summary_names_each_failure_class_with_its_message(server, tmp_path, capsys):
    from helpers import write_jsonl

    import batch_runner

    dataset = write_jsonl(
        tmp_path / "d.jsonl", ["a [error:500]", "b [error:500]", "c [error:404]", "fine [calls:0]"]
    )
    batch_runner.main(
        dataset_file=str(dataset),
        batch_size=4,
        run_name="fails",
        model="fake-model",
        base_url=server.base_url,
        api_key="k",
        output_dir=str(tmp_path),
        num_workers=1,
        distribution="terminal_only",
        max_failure_rate=1.0,
        max_retries=2,
    )
    out = capsys.readouterr().out
    assert f"Failed this run: 3 prompt(s); each one in {tmp_path / 'fails' / 'failed.jsonl'}" in out
    assert (
        "  http_500 x2: HTTP 500: Scripted error 500 (mock directive [error:500]) (failed 3 times: 1 try + 2 retries)  (2 of 2)"
        in out
    )
    assert "  http_404 x1: HTTP 404: Scripted error 404" in out


class _Lines:
    """The part of an HTTP response _read_stream uses."""

    def __init__(self, lines: list[str]):
        self.lines, self.closed = lines, False

    def iter_lines(self):
        yield from self.lines

    def close(self):
        self.closed = True


def test_an_error_event_mid_stream_is_classified_like_an_http_error():
    from batchrun.prompt.llm import _read_stream

    event = {
        "error": {
            "code": 400,
            "type": "exceed_context_size_error",
            "message": "request (9000 tokens) exceeds",
        }
    }
    raw = _Lines([": keep-alive", "", "data: " + __import__("json").dumps(event)])
    with pytest.raises(ContextLimitError):
        _read_stream(raw)
    assert raw.closed
    raw = _Lines(['data: {"error": {"message": "upstream went away", "code": 502}}'])
    with pytest.raises(LLMError) as info:
        _read_stream(raw)
    assert info.value.error_class == "http_502"


@pytest.mark.parametrize("field", ["arguments", "reasoning_details"])
def test_a_long_stream_of_small_pieces_is_assembled_whole(field):
    # A stream of about 32 MiB (--max_response_mb) of 4-character pieces of one call's arguments, or of
    # OpenRouter's reasoning_details: each piece appended to the string so far copied all of it, 75 s of
    # one core in a process of its own (8 s here, where the allocator is warmer; 128,000 pieces, a 512 KB
    # argument: 7.5 s), all of it against the prompt's deadline. Joined once: ~1.7 s (benchmarks/README.md;
    # speed is measured there, not asserted here).
    import json

    from batchrun.prompt.llm import _read_stream

    def chunk(delta, finish=None):
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    n = 370_000
    if field == "arguments":
        first = {
            "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "write_file", "arguments": ""}}]
        }
        piece = {"tool_calls": [{"index": 0, "function": {"arguments": "abcd"}}]}
    else:
        first = {"reasoning_details": [{"type": "reasoning.text", "index": 0, "text": ""}]}
        piece = {"reasoning_details": [{"type": "reasoning.text", "index": 0, "text": "abcd"}]}
    lines = [chunk(first)] + [chunk(piece)] * n + [chunk({}, "stop"), "data: [DONE]"]
    message = _read_stream(_Lines(lines))["choices"][0]["message"]
    if field == "arguments":
        assert message["tool_calls"] == [
            {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": "abcd" * n}}
        ]
    else:
        assert message["reasoning_details"] == [{"type": "reasoning.text", "index": 0, "text": "abcd" * n}]


# ----------------------------------------------------------------------------- attempts that may be billed


class _Gate:
    """The run's budget as a call sees it: grants everything, keeps what each attempt settled with."""

    def __init__(self):
        self.settled = []

    def reserve(self, tokens, deadline, priority=0, model=None):
        return len(self.settled), 0.0

    def settle(self, ticket, usage):
        self.settled.append(usage)


@pytest.mark.parametrize(
    ("text", "kw", "billed"),
    [
        ("[cut_stream:1] [calls:0]", {"stream": True, "max_retries": 1}, True),  # ended before its end
        ("[garbage] [calls:0]", {}, True),  # a 200 whose body is no JSON
        ("[hangup] [calls:0]", {}, True),  # closed after the request reached it
        ("[slow:3] [calls:0]", {"request_timeout_s": 0.5}, True),  # no answer yet: perhaps generating
        ("[error:500] [calls:0]", {}, False),  # refused with a status: not run
        ("[error:429] [calls:0]", {"max_rate_limit_retries": 0}, False),
    ],
)
def test_a_failed_attempt_that_may_have_been_billed_counts_its_estimate(server, text, kw, billed):
    """Before, a failed attempt counted nothing: an endpoint that breaks its answers (billed all the
    same) spent past --budget_tokens by a factor of the retries."""
    from batchrun.prompt.llm import Usage

    usage, gate = Usage(), _Gate()
    client = _client(server, **kw)
    client.gate = gate
    try:
        client.chat(_user(text), [], usage=usage, max_tokens=50)
    except LLMError:
        pass
    failed = [s for s in gate.settled if not (s or {}).get("completion_tokens")]
    assert failed, gate.settled
    if billed:
        # The request's estimate (its bytes / 3) at least; the completion limit at most beyond it.
        assert usage.unanswered_tokens >= 20 and failed[0] == {"unanswered_tokens": usage.unanswered_tokens}
        if "slow" in text:
            assert usage.unanswered_tokens >= 50  # nothing arrived: the completion limit counts
    else:
        assert usage.unanswered_tokens == 0 and all(not s for s in failed)
    assert usage.as_dict()["unanswered_tokens"] == usage.unanswered_tokens


def test_an_endpoint_that_cannot_be_reached_bills_nothing():
    from batchrun.prompt.llm import Usage

    usage = Usage()
    with pytest.raises(LLMError):
        LLMClient(LLMConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0)).chat(
            _user("hi"), [], usage=usage
        )
    assert usage.requests == 1 and usage.unanswered_tokens == 0


def test_a_llama_servers_request_slots_hold_back_no_other_endpoint():
    """The slots a run reads from a llama-server's /props are that server's: a judge's or a tool's
    model on another endpoint (a remote judge of a local agent) does not wait for them, nor hold one
    while the server could take the next request."""

    from batchrun.prompt.limiter import Limiter

    with FakeModelServer(latency_s=0) as llama, FakeModelServer(latency_s=0) as elsewhere:
        limiter = Limiter(max_concurrent=1)
        client = LLMClient(LLMConfig(model="mock", base_url=llama.base_url, api_key="k"), limiter)
        client.slot_endpoint = llama.base_url
        judge = client.for_endpoint(elsewhere.base_url, "k2")
        limiter.acquire(time.monotonic() + 5)  # the server's one slot is taken
        message = [{"role": "user", "content": "Say hi [calls:0]"}]
        started = time.monotonic()
        judge.chat(message, [], deadline=time.monotonic() + 10)
        assert time.monotonic() - started < 2
        answered: list[object] = []
        queued = threading.Thread(target=lambda: answered.append(client.chat(message, [])))
        queued.start()
        time.sleep(0.3)
        assert not answered  # the llama-server's own request waits its turn
        limiter.release()
        queued.join(10)
        assert answered
        client.close(), judge.close()


def test_a_judge_on_the_llama_server_gets_the_next_request_slot_before_prompts_under_way():
    """The judge's call is the last step of a prompt whose agent is done (its sandbox open for the
    verify, its record unwritten): it goes before every prompt still under way. Its own Usage made it
    a first call (priority 0): behind 3 prompts under way taking turns on one slot, it got it last."""

    from batchrun.prompt.limiter import Limiter
    from batchrun.prompt.llm import JUDGE_SLOT_PRIORITY
    from batchrun.scoring import RowCheck, judge_score

    with FakeModelServer(latency_s=0) as llama:
        limiter = Limiter(max_concurrent=1)
        judge = LLMClient(LLMConfig(model="mock", base_url=llama.base_url, api_key="k"), limiter)
        judge.slot_priority = JUDGE_SLOT_PRIORITY  # as batchrun/run/worker.py sets it
        limiter.acquire(time.monotonic() + 5)  # the server's one slot is taken
        order: list[str] = []

        def under_way(name: str) -> None:
            limiter.acquire(time.monotonic() + 30, 3)  # a prompt's fourth call
            order.append(name)
            time.sleep(0.2)
            limiter.release()

        threads = [threading.Thread(target=under_way, args=(f"prompt{n}",)) for n in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        record = {"conversations": [{"from": "gpt", "value": "4"}]}
        judged = threading.Thread(
            target=lambda: order.append(
                "judge" if judge_score(judge, "2+2?", record, RowCheck(answer="4"), None) else ""
            )
        )
        judged.start()
        time.sleep(0.2)
        limiter.release()
        for t in [*threads, judged]:
            t.join(10)
        assert order[0] == "judge", order
        judge.close()


def _requests_until_a_2s_rate_limit_clears(retry_after) -> int:
    """The requests one call sends to an endpoint that answers 429 for 2 s, with ``retry_after()``'s headers."""
    from helpers import OK_REPLY, ScriptedEndpoint

    start = time.monotonic()

    def busy(call, calls):
        if time.monotonic() - start < 2.0:
            return 429, {"error": {"message": "rate limited"}}, retry_after()
        return 200, OK_REPLY

    with ScriptedEndpoint(busy) as endpoint:
        client = LLMClient(LLMConfig(model="m", base_url=endpoint.base_url, api_key="k"))
        turn = client.chat(_user("hi"), [], deadline=time.monotonic() + 60.0)
    assert turn.finish_reason == "stop"
    return len(endpoint.calls)


@pytest.mark.parametrize("header", [{"Retry-After": "0"}, {"retry-after-ms": "1"}])
def test_a_retry_after_of_no_time_said_again_and_again_is_backed_off_from(header):
    """A numeric Retry-After of 0 (or 1 ms) was honoured at every retry: a 429 lasting 2 s was asked 31
    times in 0.2 s and the call failed (http_429), each 429 a run-wide pause relayed to every worker. The
    first retry still goes when asked; from the second on, the wait is at least the exponential back-off,
    so the call is answered after a few requests."""
    hits = _requests_until_a_2s_rate_limit_clears(lambda: header)
    assert hits <= 8, f"{hits} requests"


def test_a_retry_after_date_already_past_backs_off_as_without_one():
    """A server whose clock runs behind ours sends a Retry-After date that is already past here: taken for
    0 s, a 429 lasting 2 s was retried 31 times in 0.23 s and the call failed (http_429). Such a date says
    nothing of how long to wait: backed off exponentially, the call is answered after a few requests."""
    import email.utils

    def past() -> dict:
        return {"Retry-After": email.utils.formatdate(time.time() - 4, usegmt=True)}

    hits = _requests_until_a_2s_rate_limit_clears(past)
    assert hits <= 8, f"{hits} requests"


def _choice(text: str, index: int = 0, role: str = "assistant") -> dict:
    return {"index": index, "finish_reason": "stop", "message": {"role": role, "content": text}}


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _delta(text: str, index: int = 0, role: str | None = None, finish: str | None = None) -> dict:
    delta = {"content": text} | ({"role": role} if role else {})
    return {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


@pytest.mark.parametrize(
    ("stream", "reply"),
    [
        (False, {"choices": [_choice("The answer is 4."), _choice("The answer is 5.", 1)]}),
        (False, {"choices": [_choice("The answer is 4.", role="user")]}),
        (False, {"choices": [_choice("The answer is 4.", role="tool")]}),
        (
            True,
            _sse([_delta("The answer is 4.", finish="stop"), _delta("The answer is 5.", 1, finish="stop")]),
        ),
        (True, _sse([_delta("The answer is 4.", role="user", finish="stop")])),
        (False, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 0}}),
        (True, b"data: [DONE]\n\n"),
        (True, _sse([{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 0}}])),
    ],
    ids=[
        "two_choices", "role_user", "role_tool", "stream_two_choices", "stream_role_user", "no_choice",
        "stream_done_alone", "stream_usage_alone",
    ],
)  # fmt: skip
def test_an_ambiguous_reply_is_a_bad_response_not_its_first_choice(stream, reply):
    """A reply of several choices (n was never asked for) was read as its first, and a message of another
    role than the assistant's as the assistant's: kept as a good sample, though nothing says which of the
    endpoint's answers is the model's turn. Each is a bad response: retried, then a failure that --resume
    runs again. So is a reply with no choice at all; streamed (a bare [DONE], usage alone), it was kept
    as an empty answer without a finish_reason, a discard no --resume runs again."""
    from helpers import ScriptedEndpoint

    with ScriptedEndpoint(lambda call, calls: (200, reply)) as endpoint:
        client = LLMClient(
            LLMConfig(model="m", base_url=endpoint.base_url, api_key="k", max_retries=1, stream=stream)
        )
        with pytest.raises(LLMError) as info:
            client.chat(_user("hi"), [], deadline=time.monotonic() + 30.0)
    assert info.value.error_class == "bad_response", info.value
    assert len(endpoint.calls) == 2  # retried once, like a 5xx


def test_a_reply_of_one_choice_whose_message_names_no_role_is_read():
    """What real servers send stays an answer: a message without a role, one choice."""
    from helpers import ScriptedEndpoint

    reply = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "OK"}}]}
    streamed = _sse([_delta("O", role="assistant"), _delta("K", role="", finish="stop")])
    for stream, body in ((False, reply), (True, streamed)):
        with ScriptedEndpoint(lambda call, calls, body=body: (200, body)) as endpoint:
            cfg = LLMConfig(model="m", base_url=endpoint.base_url, api_key="k", stream=stream)
            assert LLMClient(cfg).chat(_user("hi"), []).content == "OK"


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_an_error_in_an_answers_body_is_read_as_its_code_says(stream):
    """OpenRouter answers 200 and puts an error met while the model was producing the output in the body
    (or a stream's event): ``{"error": {"code": 502, "message": ...}}``. A plain body's was a bad_response
    whatever its code (a spent account's 402 asked again, a provider's 502 not an endpoint failure); a
    streamed 429 failed the call. Each is now read as its status would be: 5xx asked again and counted an
    endpoint failure, 429 waited out, 402 final and a refusal, no code a bad_response asked again."""
    from helpers import ScriptedEndpoint

    def body(code: int | None, message: str) -> bytes | dict:
        error = {"error": {"message": message, **({"code": code} if code else {})}}
        return b"data: " + json.dumps(error).encode() + b"\n\n" if stream else error

    ok = _sse([_delta("OK", finish="stop")]) if stream else {"choices": [_choice("OK")]}
    cases = [  # (the first answer, what the call ends with, requests made, what on_failure was told)
        (body(502, "Provider returned error"), "http_502", 2, [("http_502", False), ("http_502", False)]),
        (body(402, "Insufficient credits"), "http_402", 1, [("http_402", True)]),
        (body(None, "Something went wrong"), "bad_response" if not stream else "stream_error", 2, None),
    ]
    for first, error_class, requests, told in cases:
        seen: list[tuple[str | None, bool]] = []
        with ScriptedEndpoint(lambda call, calls, first=first: (200, first)) as endpoint:
            cfg = LLMConfig(model="m", base_url=endpoint.base_url, api_key="k", max_retries=1, stream=stream)
            client = LLMClient(
                cfg, on_failure=lambda cls, refused, sent_at, seen=seen: seen.append((cls, refused))
            )
            with pytest.raises(LLMError) as info:
                client.chat(_user("hi"), [], deadline=time.monotonic() + 30.0)
        assert (info.value.error_class, len(endpoint.calls)) == (error_class, requests), info.value
        assert told is None or seen == told
    limited = body(429, "Rate limit exceeded")
    with ScriptedEndpoint(lambda call, calls: (200, limited if len(calls) == 1 else ok)) as endpoint:
        cfg = LLMConfig(model="m", base_url=endpoint.base_url, api_key="k", max_retries=0, stream=stream)
        assert LLMClient(cfg).chat(_user("hi"), []).content == "OK"  # waited out, as a 429 status is
    assert len(endpoint.calls) == 2
