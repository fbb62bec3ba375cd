"""batchrun/prompt/jsonbody.py: a conversation's request bodies encoded once per message, the same bytes
as encoding each whole body, and what UTF-8 JSON cannot carry (lone surrogates, NaN)."""

from __future__ import annotations

import json

import pytest

from batchrun.prompt.jsonbody import RequestEncoder, encode_json
from batchrun.prompt.llm import LLMError
from tests.prompt.test_httpclient import Scripted, answer, completion, llm


def whole(body) -> bytes:
    """What the request path sent before the encoder: json.dumps of the whole body."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "terminal",
            "description": 'Run a command; «quotes» and "escapes"\n',
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def conversation_turns():
    """A conversation as the loop grows it: each turn's messages appended to the same list."""
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": 'Привет 🌍 \\ "x"'}]
    yield sent
    for turn in range(3):
        call = {
            "id": f"c{turn}",
            "type": "function",
            "function": {"name": "terminal", "arguments": '{"a":1}'},
        }
        sent.append({"role": "assistant", "content": f"turn {turn} ü", "tool_calls": [call]})
        sent.append(
            {"role": "tool", "tool_call_id": f"c{turn}", "name": "terminal", "content": "a\u2028b\x00\t"}
        )
        yield sent


def test_every_turn_is_byte_for_byte_the_whole_body_encoded():
    encoder = RequestEncoder()
    for sent in conversation_turns():
        body = {"model": "m", "messages": sent, "tools": TOOLS, "max_tokens": 64, "temperature": 0.25}
        body |= {"stream_options": {"include_usage": True}, "provider": {"only": ["a"]}}
        assert encoder.encode(body) == whole(body)


def test_a_message_replaced_by_another_object_is_encoded_anew():
    encoder = RequestEncoder()
    sent = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "old"}]
    encoder.encode({"model": "m", "messages": sent})
    sent[1] = {"role": "assistant", "content": "new"}
    shorter = sent[:1]
    assert encoder.encode({"model": "m", "messages": sent}) == whole({"model": "m", "messages": sent})
    assert encoder.encode({"model": "m", "messages": shorter}) == whole({"model": "m", "messages": shorter})


def test_other_tools_are_encoded_anew():
    encoder = RequestEncoder()
    sent = [{"role": "user", "content": "x"}]
    encoder.encode({"model": "m", "messages": sent, "tools": TOOLS})
    other = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    assert encoder.encode({"model": "m", "messages": sent, "tools": other}) == whole(
        {"model": "m", "messages": sent, "tools": other}
    )


def test_a_lone_surrogate_is_sent_escaped_and_reads_back_the_same():
    message = {"role": "assistant", "content": "broken \ud800 text, café"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, message]}
    encoded = RequestEncoder().encode(body)
    assert json.loads(encoded.decode("utf-8")) == body  # strict UTF-8, and the very same strings
    assert b"\\ud800" in encoded
    assert encode_json("\udfff") == b'"\\udfff"'


def test_nan_is_refused_as_before():
    with pytest.raises(ValueError):
        RequestEncoder().encode({"model": "m", "messages": [], "temperature": float("nan")})


def test_a_nan_in_the_request_fails_the_call_as_a_bad_request_without_sending_it():
    with Scripted(lambda *a: None) as srv:
        client = llm(srv.base_url, extra_body={"x": float("inf")})
        with pytest.raises(LLMError) as info:
            client.chat([{"role": "user", "content": "hi"}], [])
        assert info.value.error_class == "bad_request"
        assert srv.requests == []


def test_a_reply_with_a_lone_surrogate_goes_back_to_the_endpoint_unchanged():
    """The endpoint's JSON may escape a lone surrogate; the next request carries it back, as valid
    UTF-8 JSON, instead of failing the prompt."""
    reply = json.dumps(completion("odd \ud83d reply")).encode()  # json.dumps escapes it: valid JSON

    def serve(n, conn, rfile, server):
        while server.next_request(rfile) is not None:
            conn.sendall(answer(200, reply, {"Content-Type": "application/json"}))

    with Scripted(serve) as srv:
        client = llm(srv.base_url)
        sent = [{"role": "user", "content": "hi"}]
        encoder = RequestEncoder()
        turn = client.chat(sent, TOOLS, encoder=encoder)
        assert turn.content == "odd \ud83d reply"
        sent.append({"role": "assistant", "content": turn.content})
        sent.append({"role": "user", "content": "again"})
        client.chat(sent, TOOLS, encoder=encoder)
        second = json.loads(srv.requests[1].body.decode("utf-8"))
        assert second["messages"] == sent and second["tools"] == TOOLS
        assert json.loads(srv.requests[0].body) == {"model": "m", "messages": sent[:1], "tools": TOOLS}
