"""batchrun/prompt/loop.py on its own: run_agent against a model over loopback HTTP, with the real
terminal/file tools on a local sandbox.

Most tests use the scripted fake model (its directives choose the turns); where a test needs turns the
fake cannot script (a context limit after the first turn, duplicate call ids, an exact sequence of
invalid calls), a small server answers a fixed list of replies in order."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.limiter import Limiter
from batchrun.prompt.llm import ContextLimitError, LLMClient, LLMConfig, LLMError, Usage
from batchrun.prompt.loop import MAX_INVALID_TURNS, LoopLimits, PromptTimeout, run_agent, turn_seed
from batchrun.prompt.sandboxes.base import SandboxError, SandboxSpec
from batchrun.prompt.sandboxes.local import LocalSandbox
from batchrun.prompt.tools.catalog import tools_for_toolsets
from batchrun.prompt.tools.registry import ToolContext
from batchrun.prompt.trajectory import invalid_tool_call

TOOLS = tools_for_toolsets(["terminal", "file"])


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[ToolContext]:
    box = LocalSandbox(SandboxSpec(run_name="loop", prompt_index=0), base_dir=str(tmp_path))
    box.start()
    try:
        yield ToolContext(sandbox=box, tool_timeout_s=30.0)
    finally:
        box.stop()


def client(base_url: str, **cfg: Any) -> LLMClient:
    return LLMClient(LLMConfig(model="fake-model", base_url=base_url, api_key="sk-loop-test", **cfg))


def agent(llm: LLMClient, prompt: str, ctx: ToolContext, tools=TOOLS, **kw: Any):
    limits = kw.pop("limits", LoopLimits(max_turns=10))
    return run_agent(llm=llm, prompt=prompt, tools=tools, ctx=ctx, limits=limits, **kw)


def requests_of(server: FakeModelServer) -> list[dict]:
    return server.stats()["last_requests"]


def roles(messages: list[dict]) -> list[str]:
    return [m["role"] for m in messages]


# ----------------------------------------------------------------------------- a server of fixed replies


def reply(
    content: str = "", calls: list[tuple[str | None, str, str]] = (), finish: str | None = None
) -> dict:
    """A chat.completion; ``calls``: (id, name, arguments text) each."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in calls
        ]
    finish = finish or ("tool_calls" if calls else "stop")
    return {
        "model": "fake-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


CONTEXT_FULL = (
    400,
    {
        "error": {
            "message": "This model's maximum context length is 4096 tokens.",
            "code": "context_length_exceeded",
        }
    },
)


class Replies:
    """Answers each chat request with the next of ``replies`` (a completion, or (status, body)); keeps
    every request body."""

    def __init__(self, replies: list[Any]):
        self.replies = list(replies)
        self.bodies: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                item = outer.replies.pop(0)
                status, body = item if isinstance(item, tuple) else (200, item)
                kind = "application/json"
                if isinstance(body, list):  # chat.completion.chunk events: a stream
                    kind = "text/event-stream"
                    data = "".join(f"data: {json.dumps(c)}\n\n" for c in [*body, "[DONE]"]).encode()
                    data = data.replace(b'data: "[DONE]"', b"data: [DONE]")
                else:
                    data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_port}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def replies():
    made: list[Replies] = []

    def make(*items: Any) -> Replies:
        made.append(Replies(list(items)))
        return made[-1]

    yield make
    for r in made:
        r.close()


# ----------------------------------------------------------------------------- the final answer


def test_an_answer_without_tool_calls_ends_the_prompt_completed(server: FakeModelServer, ctx: ToolContext):
    result = agent(client(server.base_url), "Say hello [no_reasoning]", ctx, tools=[])
    assert (result.completed, result.partial, result.stop_reason) == (True, False, "final_answer")
    assert (result.api_calls, result.tool_calls) == (1, 0)
    assert result.messages == [
        {"role": "user", "content": "Say hello [no_reasoning]"},
        {"role": "assistant", "content": "Final answer for 'say-hello'.", "reasoning": None},
    ]
    assert "tools" not in requests_of(server)[0] or not requests_of(server)[0]["tools"]


def test_tool_calls_run_in_the_sandbox_and_their_results_reach_the_model(
    server: FakeModelServer, ctx: ToolContext
):
    result = agent(client(server.base_url), "Take notes on loops", ctx)
    assert result.stop_reason == "final_answer" and (result.api_calls, result.tool_calls) == (3, 3)
    assert roles(result.messages) == ["user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    first = result.messages[1]["tool_calls"]
    assert [c["function"]["name"] for c in first] == ["terminal", "write_file"]
    # Each result answers its own call, in order, and comes from the sandbox.
    assert [m["tool_call_id"] for m in result.messages[2:4]] == [c["id"] for c in first]
    assert [m["name"] for m in result.messages[2:4]] == ["terminal", "write_file"]
    assert "take-notes-on-loops" in json.loads(result.messages[2]["content"])["output"]
    notes = ctx.sandbox.run("cat notes/answer_*.txt", timeout_s=10).output
    assert "slug: take-notes-on-loops" in notes
    assert "slug: take-notes-on-loops" in result.messages[5]["content"]  # read_file read it back
    # The model was sent every result: its answer quotes the last one.
    last_sent = requests_of(server)[-1]["messages"]
    assert [m for m in last_sent if m["role"] == "tool"] == [
        m for m in result.messages if m["role"] == "tool"
    ]
    assert "The last tool result said:" in result.messages[-1]["content"]


def test_the_log_hears_every_tool_call_with_its_result(server: FakeModelServer, ctx: ToolContext):
    heard: list[dict] = []
    result = agent(client(server.base_url), "Take notes", ctx, log=heard.append)
    tool_msgs = [m for m in result.messages if m["role"] == "tool"]
    assert [(h["tool"], h["result"]) for h in heard] == [(m["name"], m["content"]) for m in tool_msgs]
    assert all(isinstance(h["args"], str) and json.loads(h["args"]) for h in heard)


def test_the_answering_model_is_reported(server: FakeModelServer, ctx: ToolContext):
    assert (
        agent(client(server.base_url), "hi [served_other]", ctx, tools=[]).served_model == "mock-served-other"
    )
    assert agent(client(server.base_url), "hi", ctx, tools=[]).served_model == "fake-model"


# ----------------------------------------------------------------------------- limits


def test_the_turn_limit_stops_a_model_that_never_answers(server: FakeModelServer, ctx: ToolContext):
    result = agent(client(server.base_url), "go on [loop]", ctx, limits=LoopLimits(max_turns=3))
    assert (result.completed, result.partial, result.stop_reason) == (False, True, "max_turns")
    assert server.stats()["requests"] == 3 and (result.api_calls, result.tool_calls) == (3, 3)
    assert roles(result.messages) == ["user"] + ["assistant", "tool"] * 3  # the last turn's call ran too


def test_a_truncated_turn_ends_the_prompt_without_running_its_calls(
    server: FakeModelServer, ctx: ToolContext
):
    result = agent(client(server.base_url), "long [truncate_call]", ctx)
    assert (result.completed, result.partial, result.stop_reason) == (False, True, "truncated")
    assert result.tool_calls == 0 and roles(result.messages) == ["user", "assistant"]
    assert (
        result.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"command": "echo a very long comm'
    )


def finished_as(answer: dict, finish: str | None) -> dict:
    """``answer`` with its finish_reason set to ``finish`` (``"missing"``: no such field at all)."""
    choice = answer["choices"][0]
    if finish == "missing":
        del choice["finish_reason"]
    else:
        choice["finish_reason"] = finish
    return answer


@pytest.mark.parametrize("finish", ["content_filter", "SAFETY", "refusal"])
def test_a_filtered_reply_ends_the_prompt_as_content_filter_without_running_its_calls(
    finish, replies, ctx: ToolContext
):
    script = replies(
        finished_as(reply("Let me", calls=[("a", "terminal", '{"command": "echo hi"}')]), finish)
    )
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert (result.completed, result.partial, result.stop_reason) == (False, True, "content_filter")
    assert result.tool_calls == 0 and roles(result.messages) == ["user", "assistant"]


@pytest.mark.parametrize("finish", [None, "missing", "", "paused"])
def test_a_final_answer_that_does_not_say_it_finished_is_not_completed(finish, replies, ctx: ToolContext):
    """Null, missing or unknown: nothing says the words were not cut short (a proxy may drop the field)."""
    script = replies(finished_as(reply("The answer is"), finish))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert (result.completed, result.partial, result.stop_reason) == (False, True, "unknown_finish_reason")
    assert result.messages[-1]["content"] == "The answer is"


@pytest.mark.parametrize("finish", ["stop", "STOP", "end_turn", "eos", "stop_sequence"])
def test_final_answers_ended_as_real_servers_say_are_completed(finish, replies, ctx: ToolContext):
    script = replies(finished_as(reply("The answer is 4."), finish))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert (result.completed, result.partial, result.stop_reason) == (True, False, "final_answer")


def test_a_tool_call_turn_without_a_finish_reason_runs_its_calls_and_goes_on(replies, ctx: ToolContext):
    """Its calls' arguments are checked as JSON anyway (a cut call is invalid_tool_call): only the
    final answer needs its finish_reason."""
    first = finished_as(reply(calls=[("a", "terminal", '{"command": "echo hi"}')]), None)
    script = replies(first, reply("done"))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert (result.completed, result.stop_reason, result.tool_calls) == (True, "final_answer", 1)


def test_an_expired_deadline_raises_before_any_model_call(server: FakeModelServer, ctx: ToolContext):
    with pytest.raises(PromptTimeout, match="prompt exceeded its 0 s limit"):
        agent(client(server.base_url), "hi", ctx, limits=LoopLimits(prompt_timeout_s=0))
    assert server.stats()["requests"] == 0


def test_a_model_call_cut_by_the_deadline_is_a_prompt_timeout(server: FakeModelServer, ctx: ToolContext):
    with pytest.raises(PromptTimeout, match="prompt exceeded its 0.5 s limit"):
        agent(client(server.base_url), "hi [slow:5]", ctx, tools=[], limits=LoopLimits(prompt_timeout_s=0.5))


def test_a_tool_call_gets_what_is_left_of_the_deadline_and_then_the_prompt_times_out(
    server: FakeModelServer, ctx: ToolContext
):
    with pytest.raises(PromptTimeout):
        agent(client(server.base_url), "wait [run:sleep 5]", ctx, limits=LoopLimits(prompt_timeout_s=1.0))
    assert ctx.tool_timeout_s == 1.0  # under a second left: the floor of one second, not the 180 s default
    assert server.stats()["requests"] == 1  # the model was not called again after the deadline


def test_a_tool_call_is_bounded_by_the_tool_timeout(server: FakeModelServer, ctx: ToolContext):
    agent(client(server.base_url), "list [run:true]", ctx, limits=LoopLimits(tool_timeout_s=7.0))
    assert ctx.tool_timeout_s == 7.0


def test_a_run_wide_pause_for_another_prompt_moves_the_deadline(server: FakeModelServer, ctx: ToolContext):
    limiter = Limiter()
    limiter.pause_until(time.time() + 1.5)  # relayed from the parent: another prompt's 429
    llm = LLMClient(LLMConfig(model="fake-model", base_url=server.base_url), limiter)
    result = agent(llm, "list [run:true]", ctx, limits=LoopLimits(prompt_timeout_s=1.0))
    assert result.stop_reason == "final_answer" and result.api_calls == 2


def test_the_prompt_token_cap_ends_the_prompt_partial(server: FakeModelServer, ctx: ToolContext):
    usage = Usage()
    result = agent(
        client(server.base_url), "Take notes", ctx, usage=usage, limits=LoopLimits(max_prompt_tokens=1)
    )
    assert (result.completed, result.partial, result.stop_reason) == (False, True, "prompt_budget")
    assert result.api_calls == 1 and result.tool_calls == 2  # the turn's calls ran; no further model call
    stats = server.stats()
    assert usage.total_tokens == stats["prompt_tokens"] + stats["completion_tokens"] > 0


def test_the_prompt_dollar_cap_counts_what_was_spent_before(ctx: ToolContext):
    with FakeModelServer(cost_per_token=0.001) as server:
        usage = Usage()
        result = agent(
            client(server.base_url), "Take notes", ctx, usage=usage, limits=LoopLimits(max_prompt_usd=0.01)
        )
        assert result.stop_reason == "prompt_budget" and result.api_calls == 1
        assert usage.cost_usd == pytest.approx(server.stats()["cost_usd"]) and usage.cost_usd >= 0.01
        spent = agent(
            client(server.base_url), "again", ctx, usage=usage, limits=LoopLimits(max_prompt_usd=0.01)
        )
        assert spent.stop_reason == "prompt_budget" and spent.api_calls == 0
        assert spent.messages == [{"role": "user", "content": "again"}]


def test_the_usage_counts_every_call_when_no_cap_is_set(server: FakeModelServer, ctx: ToolContext):
    usage = Usage()
    agent(client(server.base_url), "Take notes", ctx, usage=usage)
    stats = server.stats()
    assert usage.total_tokens == stats["prompt_tokens"] + stats["completion_tokens"]


# ----------------------------------------------------------------------------- invalid calls


def test_an_unknown_tool_is_an_observation_and_the_prompt_goes_on(server: FakeModelServer, ctx: ToolContext):
    result = agent(client(server.base_url), "Take notes [hallucinate]", ctx)
    assert result.stop_reason == "final_answer" and result.api_calls == 4
    assert result.messages[1]["tool_calls"][0]["function"]["name"] == "teleport"
    error = json.loads(result.messages[2]["content"])["error"]
    assert error.startswith("Unknown tool 'teleport'. Available tools: ") and "terminal" in error


def test_arguments_that_are_not_json_are_kept_as_sent_and_reported(server: FakeModelServer, ctx: ToolContext):
    result = agent(client(server.base_url), "Take notes [bad_json]", ctx)
    assert result.stop_reason == "final_answer" and result.api_calls == 4
    sent_args = result.messages[1]["tool_calls"][0]["function"]["arguments"]
    assert sent_args == '{"command": "ls"'  # the model's words, not repaired
    assert "Invalid JSON in arguments of terminal" in json.loads(result.messages[2]["content"])["error"]


@pytest.mark.parametrize(
    "arguments",
    ['{"command": "echo ran", "timeout": NaN}', '{"command": "echo ran", "timeout": 1e999}',
     '{"command": "echo other", "command": "echo ran"}', '{"command": "echo ran \\udc80"}'],
)  # fmt: skip
def test_arguments_only_python_reads_as_json_are_not_run_and_are_kept_as_sent(
    arguments: str, replies, ctx: ToolContext
):
    """NaN, a number no double holds, a key given twice: Python's reader takes them (and would run the
    command), every strict reader refuses or reads them another way. Saved as sent, never re-encoded
    (``json.dumps`` would write a bare NaN or Infinity into the training file), and not run."""
    script = replies(reply(calls=[("a", "terminal", arguments)]), reply("done"))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert result.stop_reason == "final_answer"
    assert result.messages[1]["tool_calls"][0]["function"]["arguments"] == arguments
    error = json.loads(result.messages[2]["content"])["error"]
    assert (
        error.startswith("Invalid JSON in arguments of terminal: ")
        and "ran" not in result.messages[2]["content"]
    )
    assert invalid_tool_call(result.messages)


def test_three_turns_of_only_invalid_calls_stop_the_prompt(server: FakeModelServer, ctx: ToolContext):
    # No tools offered: every call the looping model makes (terminal) is to a tool not offered.
    result = agent(client(server.base_url), "go [loop]", ctx, tools=[])
    assert (result.completed, result.partial, result.stop_reason) == (False, True, "invalid_tool_calls")
    assert result.api_calls == MAX_INVALID_TURNS == 3 and result.tool_calls == 3


def test_a_valid_turn_resets_the_invalid_streak_and_a_mixed_turn_is_not_invalid(replies, ctx: ToolContext):
    bad_name = reply(calls=[("a", "teleport", "{}")])
    not_object = reply(calls=[("b", "terminal", "[1, 2]")])  # JSON, but not an arguments object
    mixed = reply(calls=[("c", "teleport", "{}"), ("d", "terminal", '{"command": "true"}')])
    no_args = reply(
        calls=[("e", "terminal", "")]
    )  # no arguments: saved as {}, a schema error, not invalid JSON
    script = replies(bad_name, not_object, mixed, bad_name, no_args, bad_name, reply("done"))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert result.stop_reason == "final_answer" and result.api_calls == 7
    calls = [c for m in result.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in calls if c["id"] == "e"] == ["{}"]  # saved as {}


def test_the_invalid_streak_counts_non_object_arguments(replies, ctx: ToolContext):
    not_object = reply(calls=[("b", "terminal", "[1, 2]")])
    script = replies(not_object, reply(calls=[("a", "teleport", "{}")]), not_object, reply("never asked"))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert result.stop_reason == "invalid_tool_calls" and result.api_calls == 3


# ----------------------------------------------------------------------------- model errors


def test_a_context_limit_on_the_first_call_fails_the_prompt(replies, ctx: ToolContext):
    script = replies(CONTEXT_FULL)
    with pytest.raises(ContextLimitError):
        agent(client(script.base_url, max_retries=0), "p", ctx)


def test_a_context_limit_later_ends_the_prompt_partial_with_what_it_has(replies, ctx: ToolContext):
    script = replies(reply(calls=[("a", "terminal", '{"command": "echo hi"}')]), CONTEXT_FULL)
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert (result.completed, result.partial, result.stop_reason) == (False, True, "context_limit")
    assert result.api_calls == 1 and roles(result.messages) == ["user", "assistant", "tool"]


def test_an_endpoint_error_propagates_as_itself(server: FakeModelServer, ctx: ToolContext):
    with pytest.raises(LLMError) as info:
        agent(client(server.base_url, max_retries=0), "hi [error:500]", ctx)
    assert not isinstance(info.value, PromptTimeout) and info.value.status == 500


def test_a_sandbox_failure_fails_the_prompt_instead_of_being_shown_to_the_model(
    server: FakeModelServer, ctx: ToolContext
):
    ctx.sandbox.stop()  # the sandbox is gone: infrastructure, not something the model did
    with pytest.raises(SandboxError):
        agent(client(server.base_url), "Take notes", ctx)
    assert server.stats()["requests"] == 1


# ----------------------------------------------------------------------------- what is sent and what is saved


def test_system_prompts_and_prefill_are_sent_but_not_saved(server: FakeModelServer, ctx: ToolContext):
    prefill = [{"role": "user", "content": "example question"}, {"role": "assistant", "content": "example"}]
    result = agent(
        client(server.base_url),
        "real question",
        ctx,
        tools=[],
        system_prompt="You are the row's assistant.",
        ephemeral_system_prompt="Be brief.",
        prefill_messages=prefill,
    )
    sent = requests_of(server)[0]["messages"]
    assert sent == [
        {"role": "system", "content": "You are the row's assistant.\n\nBe brief."},  # one system message
        *prefill,
        {"role": "user", "content": "real question"},
    ]
    assert (
        roles(result.messages) == ["user", "assistant"] and result.messages[0]["content"] == "real question"
    )


def test_each_turn_sends_its_own_seed_and_none_without_a_request_seed(
    server: FakeModelServer, ctx: ToolContext
):
    agent(client(server.base_url), "Take notes", ctx, request_seed=42)
    seeds = [body.get("seed") for body in requests_of(server)]
    assert seeds == [turn_seed(42, 0), turn_seed(42, 1), turn_seed(42, 2)] and len(set(seeds)) == 3
    server.reset_stats()
    agent(client(server.base_url), "Take notes", ctx)
    assert all("seed" not in body for body in requests_of(server))


def test_turn_seed_is_fixed_and_in_range():
    assert turn_seed(7, 3) == turn_seed(7, 3) != turn_seed(8, 3)
    assert all(0 <= turn_seed(base, t) <= 2**31 - 1 for base in (0, 1, 2**40) for t in range(50))


def test_native_reasoning_is_saved_apart_and_not_sent_back(server: FakeModelServer, ctx: ToolContext):
    result = agent(client(server.base_url), "Take notes", ctx)
    first = result.messages[1]
    assert first["reasoning"].startswith('The user asks: "Take notes". Turn 0')
    assert first["content"] == "Let me use terminal, write_file."
    sent_back = requests_of(server)[1]["messages"][1]
    assert sent_back["role"] == "assistant" and "reasoning" not in sent_back
    assert sent_back["tool_calls"] == first["tool_calls"]


def test_a_leading_think_block_becomes_reasoning_and_goes_back_as_written(replies, ctx: ToolContext):
    words = "<think>check the file</think>Let me look."
    script = replies(reply(words, calls=[("a", "terminal", '{"command":  "true"}')]), reply("done"))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    saved = result.messages[1]
    assert (saved["reasoning"], saved["content"]) == ("check the file", "Let me look.")
    assert saved["tool_calls"][0]["function"]["arguments"] == '{"command":  "true"}'  # as written
    assert script.bodies[1]["messages"][1]["content"] == words


@pytest.mark.parametrize(
    ("words", "reasoning", "content"),
    [
        # A template that opens the think block in its generation prompt: the reply closes it at a line's end.
        ("The user wants it.\n</think>\n\nDone.", "The user wants it.", "\nDone."),
        ("Checked.</think>\nDone.", "Checked.", "Done."),
        # Mid-sentence it is the words' own: before, a model without reasoning became one with, its answer
        # cut to " to close" (the sample kept, no_reasoning passed, the answer lost).
        ("ANSWER: use </think> to close", None, "ANSWER: use </think> to close"),
    ],
)
def test_a_lone_closing_think_tag_ends_reasoning_only_at_a_lines_end(
    replies, ctx: ToolContext, words, reasoning, content
):
    script = replies(reply(words))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    saved = result.messages[-1]
    assert (saved["reasoning"], saved["content"]) == (reasoning, content)


# Number forms, escapes, spacing and key order a re-encoding would change: 1e2 became 100.0, \u00e9 é.
MODEL_ARGUMENTS = '{"command":"echo \\u00e9" ,\n "timeout":1e2}'


def _streamed(args: str) -> list[dict]:
    """A reply calling terminal with ``args`` cut into pieces, as chat.completion.chunk events."""
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "terminal", "arguments": ""}}
    pieces = [args[i : i + 7] for i in range(0, len(args), 7)]
    return [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]},
        *(
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}}]}
            for p in pieces
        ),  # fmt: skip
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_arguments_are_saved_and_sent_back_as_the_model_wrote_them(replies, ctx: ToolContext, stream):
    first = _streamed(MODEL_ARGUMENTS) if stream else reply(calls=[("c1", "terminal", MODEL_ARGUMENTS)])
    script = replies(first, reply("done"))
    result = agent(client(script.base_url, max_retries=0, stream=stream), "p", ctx)
    assert result.messages[1]["tool_calls"][0]["function"]["arguments"] == MODEL_ARGUMENTS
    sent_back = script.bodies[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent_back == MODEL_ARGUMENTS
    assert json.loads(result.messages[2]["content"])["output"].strip() == "é"  # run as the model meant


REFUSAL = "I'm sorry, but I can't help with that."


def _refusing(stream: bool, content: str | None = None, calls: list | None = None) -> dict | list:
    """OpenAI's refusal: ``message.refusal`` with ``content`` null (or streamed in ``delta.refusal`` pieces)."""
    if stream:
        return [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": content, "refusal": ""}}]},
            *({"choices": [{"index": 0, "delta": {"refusal": p}}]} for p in (REFUSAL[:9], REFUSAL[9:])),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
    body = reply(calls=calls or [])
    body["choices"][0]["message"].update(content=content, refusal=REFUSAL)
    body["choices"][0]["finish_reason"] = "stop"
    return body


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_ends_the_prompt_with_its_text_as_the_turns_words(replies, ctx: ToolContext, stream):
    """Before, the refusal was dropped: an empty answer (discarded as empty_answer with no trace of it,
    or kept with --keep_empty_answers as a final answer of no words)."""
    script = replies(_refusing(stream))
    result = agent(client(script.base_url, max_retries=0, stream=stream), "p", ctx)
    assert (result.stop_reason, result.completed, result.api_calls) == ("refusal", False, 1)
    assert result.messages[-1]["content"] == REFUSAL


def test_a_refusal_beside_words_and_calls_keeps_both_and_runs_no_call(replies, ctx: ToolContext):
    script = replies(
        _refusing(False, content="Partly:", calls=[("a", "terminal", '{"command": "echo ran"}')])
    )
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    assert result.stop_reason == "refusal" and result.tool_calls == 0
    assert result.messages[-1]["content"] == f"Partly:\n\n{REFUSAL}"
    assert [m["role"] for m in result.messages] == ["user", "assistant"]


def test_with_reasoning_disabled_think_tags_stay_in_the_words(replies, ctx: ToolContext):
    words = "<think>not reasoning</think>answer"
    script = replies(reply(words))
    result = agent(client(script.base_url, max_retries=0, reasoning_disabled=True), "p", ctx)
    assert (result.messages[1]["reasoning"], result.messages[1]["content"]) == (None, words)


def test_missing_and_repeated_call_ids_are_made_unique(replies, ctx: ToolContext):
    calls = [("x", "terminal", '{"command": "echo 1"}'), ("x", "terminal", '{"command": "echo 2"}'), (None, "terminal", '{"command": "echo 3"}')]  # fmt: skip
    script = replies(reply(calls=calls), reply("done"))
    result = agent(client(script.base_url, max_retries=0), "p", ctx)
    ids = [c["id"] for c in result.messages[1]["tool_calls"]]
    assert len(set(ids)) == 3 and ids[0] == "x"
    assert [m["tool_call_id"] for m in result.messages[2:5]] == ids
    assert [json.loads(m["content"])["output"].strip() for m in result.messages[2:5]] == ["1", "2", "3"]
    assert [c["id"] for c in script.bodies[1]["messages"][1]["tool_calls"]] == ids  # sent as saved


# ----------------------------------------------------------------------------- bounds on what one prompt holds


def test_calls_past_the_per_reply_bound_are_not_run_and_the_prompt_ends(replies, ctx: ToolContext):
    from batchrun.prompt.loop import MAX_CALLS_PER_TURN

    n = MAX_CALLS_PER_TURN + 40
    calls = [(f"c{i}", "terminal", json.dumps({"command": f"echo {i} >> ran.txt"})) for i in range(n)]
    script = replies(reply(calls=calls), reply("never asked"))
    result = agent(client(script.base_url), "do it", ctx)
    assert (result.stop_reason, result.partial, result.api_calls) == ("invalid_tool_calls", True, 1)
    tools = [m for m in result.messages if m["role"] == "tool"]
    assert len(tools) == n  # every call answered: the conversation stays well formed
    assert all("Not run: more than" in m["content"] for m in tools[MAX_CALLS_PER_TURN:])
    ran = ctx.sandbox.run("wc -l < ran.txt", timeout_s=10).output.strip()
    assert ran == str(MAX_CALLS_PER_TURN)
    assert len(script.bodies) == 1


def test_a_conversation_past_its_size_bound_ends_as_a_context_limit(replies, ctx: ToolContext, monkeypatch):
    from batchrun.prompt import loop

    monkeypatch.setattr(loop, "MAX_CONVERSATION_CHARS", 50_000)
    big = json.dumps({"command": "head -c 30000 /dev/zero | tr '\\0' x"})
    script = replies(
        reply(calls=[("a", "terminal", big)]),
        reply(calls=[("b", "terminal", big), ("c", "terminal", big), ("d", "terminal", big)]),
        reply("never asked"),
    )
    result = agent(client(script.base_url), "do it", ctx)
    assert (result.stop_reason, result.partial, result.api_calls) == ("context_limit", True, 2)
    tools = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert len(tools) == 4 and "Not run" not in tools[0] + tools[1], tools
    assert all("Not run: the conversation holds more than 50000 characters" in t for t in tools[2:])
    assert len(script.bodies) == 2


class _SlowBudget:
    """The run's budget as a call sees it, granting each reservation after ``wait_s`` (reservations in
    flight elsewhere held it); keeps what each was settled with."""

    def __init__(self, wait_s: float):
        self.wait_s, self.settled = wait_s, []

    def reserve(self, tokens, deadline, priority=0, model=None):
        time.sleep(self.wait_s)
        return len(self.settled), self.wait_s

    def settle(self, ticket, usage):
        self.settled.append(usage)


def test_a_wait_for_the_budget_is_credited_to_the_prompt_not_to_its_call_alone(
    server: FakeModelServer, ctx: ToolContext
):
    """Waiting for the run's budget moved the call's deadline but not the prompt's: a prompt whose
    reservations waited 0.4 s each, under a 0.5 s timeout, had its second call sent and paid after its
    deadline and then ended timed out, its answers lost. The wait is credited as a slot wait is."""
    llm = client(server.base_url)
    llm.gate = _SlowBudget(0.4)
    llm.limiter.begin_prompt()
    result = agent(llm, "Take notes on loops", ctx, limits=LoopLimits(max_turns=10, prompt_timeout_s=0.5))
    assert result.stop_reason == "final_answer" and result.api_calls == 3
    assert llm.limiter.credited_s() >= 1.2


def test_a_wait_for_the_budget_past_the_prompts_allowance_sends_no_call(
    server: FakeModelServer, ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
):
    """Past the prompt's allowance of credited waits, the budget's wait counts against its deadline: a
    call whose prompt's time ran out meanwhile is not sent (it was, and paid, with nothing to keep)."""
    from batchrun.prompt import limiter as limiter_module

    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 0.1)
    llm = client(server.base_url)
    llm.gate = _SlowBudget(0.8)
    llm.limiter.begin_prompt()
    with pytest.raises(PromptTimeout):
        agent(llm, "hi", ctx, tools=[], limits=LoopLimits(prompt_timeout_s=0.5))
    assert server.stats()["requests"] == 0
    assert llm.gate.settled == [None]  # the reservation was given back, not held
