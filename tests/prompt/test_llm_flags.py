"""The flags that shape the model request (extra_body: routing, reasoning, max_tokens), end to end."""

from __future__ import annotations

from helpers import (
    run,
    write_jsonl,
)

from batchrun.fakes.fake_model import FakeModelServer


def _last_request(server: FakeModelServer) -> dict:
    return server.stats()["last_requests"][-1]


def test_flags_reach_the_request_as_extra_body(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["route me [calls:0]"])
    run(
        server,
        dataset,
        tmp_path / "data",
        providers_allowed="a,b",
        provider_sort="price",
        reasoning_effort="high",
        max_tokens=321,
        endpoint_dialect="openrouter",  # the fake listens on 127.0.0.1, which auto takes for a local server
    )
    req = _last_request(server)
    assert req["provider"] == {"only": ["a", "b"], "sort": "price"}
    assert req["reasoning"] == {"enabled": True, "effort": "high"}
    assert req["max_tokens"] == 321
    assert req["model"] == "fake-model"


def test_reasoning_disabled_wins_over_effort(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["think less [calls:0]"])
    run(
        server,
        dataset,
        tmp_path / "data",
        reasoning_effort="high",
        reasoning_disabled=True,
        providers_ignored="x",
        endpoint_dialect="openrouter",
    )
    req = _last_request(server)
    assert req["reasoning"] == {"effort": "none"}
    assert req["provider"] == {"ignore": ["x"]}


def test_a_local_endpoint_gets_its_own_dialect(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["think less locally [calls:0]"])
    run(
        server,
        dataset,
        tmp_path / "data",
        reasoning_effort="high",
        reasoning_disabled=True,
        providers_ignored="x",
    )
    req = _last_request(server)
    assert req["chat_template_kwargs"] == {"enable_thinking": False, "thinking": False}
    assert "reasoning" not in req and "provider" not in req and "reasoning_effort" not in req


def test_no_openrouter_fields_without_flags(server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["plain endpoint [calls:0]"])
    run(server, dataset, tmp_path / "data")
    req = _last_request(server)
    assert "provider" not in req and "reasoning" not in req and "max_tokens" not in req
