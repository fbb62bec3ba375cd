"""mixture_of_agents against the fake endpoint: reference models in parallel, then the aggregator."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from batchrun.prompt.tools import moa
from batchrun.prompt.tools.catalog import available_toolsets
from batchrun.prompt.tools.config import ToolConfigError, ToolSettings, moa_config


def test_references_then_aggregator(tools_llm, tool_ctx, call_tool):
    ctx = tool_ctx({"MOA_REFERENCE_MODELS": "ref-a, ref-b", "MOA_AGGREGATOR_MODEL": "agg"})
    tools_llm.reset_stats()
    out = call_tool(ctx, "mixture_of_agents", user_prompt="Prove that sqrt 2 is irrational")
    assert out["success"] is True
    assert out["models_used"] == {"reference_models": ["ref-a", "ref-b"], "aggregator_model": "agg"}
    requests = tools_llm.stats()["last_requests"]
    assert len(requests) == 3
    refs, aggregation = requests[:2], requests[2]
    assert sorted(r["model"] for r in refs) == ["ref-a", "ref-b"]
    for r in refs:
        assert r["messages"] == [{"role": "user", "content": "Prove that sqrt 2 is irrational"}]
        assert r["temperature"] == 0.6
    assert aggregation["model"] == "agg" and aggregation["temperature"] == 0.4
    system, user = aggregation["messages"]
    reference_answer = "Final answer for 'prove-that-sqrt-2'."
    assert system["role"] == "system" and system["content"].count(reference_answer) == 2
    assert user == {"role": "user", "content": "Prove that sqrt 2 is irrational"}
    assert out["response"] == reference_answer  # what the aggregator said


def test_defaults_to_the_run_model(clean_tool_env):
    cfg = moa_config(ToolSettings(llm_base_url="http://x/v1", llm_api_key="k", llm_model="run-model"))
    assert (cfg.reference_models, cfg.aggregator_model, cfg.api_key) == (("run-model",), "run-model", "k")


def test_failed_reference_is_left_out(monkeypatch, tool_ctx, call_tool):
    real_ask = moa._ask

    def ask(cfg, model, messages, temperature, timeout_s, usage=None, ctx=None):
        if model == "broken":
            raise RuntimeError("HTTP 503: overloaded")
        return real_ask(cfg, model, messages, temperature, timeout_s, usage, ctx)

    monkeypatch.setattr(moa, "_ask", ask)
    out = call_tool(
        tool_ctx({"MOA_REFERENCE_MODELS": "broken,good"}), "mixture_of_agents", user_prompt="Hard question"
    )
    assert out["success"] is True
    assert out["models_used"]["reference_models"] == ["good"]
    assert out["failed_models"] == {"broken": "HTTP 503: overloaded"}


def test_too_few_answers_is_an_error(tool_ctx, call_tool):
    ctx = tool_ctx({"MOA_REFERENCE_MODELS": "a,b"})
    out = call_tool(ctx, "mixture_of_agents", user_prompt="doomed [error:500]")
    assert "only 0 of 2 reference models answered" in out["error"] and "HTTP 500" in out["error"]


def test_configuration(clean_tool_env):
    run = ToolSettings(llm_base_url="http://x/v1", llm_model="m")
    assert "moa" not in available_toolsets()
    assert "moa" in available_toolsets(run)
    with pytest.raises(ToolConfigError, match="MOA_MIN_SUCCESSFUL"):
        available_toolsets(replace(run, tool_env={"MOA_REFERENCE_MODELS": "a", "MOA_MIN_SUCCESSFUL": "2"}))
    with pytest.raises(ToolConfigError, match="MOA_REFERENCE_TEMPERATURE"):
        available_toolsets(replace(run, tool_env={"MOA_REFERENCE_TEMPERATURE": "hot"}))


@pytest.mark.parametrize("name", ["MOA_REFERENCE_TEMPERATURE", "MOA_AGGREGATOR_TEMPERATURE"])
def test_a_temperature_over_2_stops_the_run_at_start_naming_the_variable(
    clean_tool_env, server, tmp_path, monkeypatch, capsys, name
):
    """A moa temperature of 50 was taken and sent with each of the tool's model calls, which an endpoint
    that keeps --temperature's range (0 to 2: OpenAI, OpenRouter) refuses, each time after the agent's
    model paid for its turn. Bounded as --temperature is: exit 2 at start, before any model call."""
    from helpers import exit_code, requests, write_rows

    run = ToolSettings(llm_base_url="http://x/v1", llm_model="m")
    for ok in ("0", "2"):
        assert getattr(moa_config(replace(run, tool_env={name: ok})), name[4:].lower()) == float(ok)
    monkeypatch.setenv(name, "50")
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "think [calls:1]", "toolsets": ["moa"]}])
    assert exit_code(server, dataset, tmp_path / "data", sandbox="local", local_isolation="none") == 2
    assert f"{name} must be at most 2, got '50'" in capsys.readouterr().err
    assert server.stats()["check_calls"] == 0 and not requests(server)


def test_agent_loop_with_moa(tool_ctx, run_tool_loop):
    messages = run_tool_loop(tool_ctx(), "What is the 10th prime?", ["moa"])
    tool = next(m for m in messages if m["role"] == "tool")
    assert tool["name"] == "mixture_of_agents"
    assert json.loads(tool["content"])["response"].startswith("Final answer for 'what-is-the-10th'")


def test_the_tools_model_calls_go_through_the_runs_client(tools_llm, tool_ctx, call_tool):
    """The run's limiter, pause and budget: each reference and aggregator call reserves with the
    run's budget gate and takes the run's limiter; a 429 pauses the run's limiter."""
    from batchrun.prompt.limiter import Limiter
    from batchrun.prompt.llm import LLMClient, LLMConfig

    class Gate:
        def __init__(self):
            self.reserved, self.settled = [], []

        def reserve(self, tokens, deadline, priority=0, model=None):
            self.reserved.append(tokens)
            return len(self.reserved), 0.0

        def settle(self, ticket, usage):
            self.settled.append((ticket, usage))

    gate, limiter = Gate(), Limiter()
    run_client = LLMClient(
        LLMConfig(model="run", base_url="http://127.0.0.1:9/v1", api_key="k"), limiter, gate=gate
    )
    ctx = tool_ctx({"MOA_REFERENCE_MODELS": "ref-a, ref-b", "MOA_AGGREGATOR_MODEL": "agg"})
    ctx.llm = run_client
    out = call_tool(ctx, "mixture_of_agents", user_prompt="A question")
    assert out["success"] is True
    assert len(gate.reserved) == 3 and all(t > 0 for t in gate.reserved)  # two references, the aggregator
    assert [u["completion_tokens"] > 0 for _, u in gate.settled] == [True, True, True]
    assert ctx.usage is None or ctx.usage.calls == 3
    limited = tool_ctx({"MOA_REFERENCE_MODELS": "ref-a", "MOA_AGGREGATOR_MODEL": "agg"})
    limited.llm = run_client
    out = call_tool(limited, "mixture_of_agents", user_prompt="busy [flaky:1]")
    assert limiter._paused_until > 0  # the tool's 429 paused the run's limiter (no SDK retries of its own)


def test_the_reference_models_wait_out_of_the_prompts_one_allowance(tool_ctx, call_tool, monkeypatch):
    """The reference models' calls run on threads of their own, and each of those had a fresh allowance of
    credited waits (MAX_SLOT_WAIT_S, an hour), the prompt's own untouched: under another prompt's 429
    pause, a mixture_of_agents call near the deadline held its prompt an hour past it, and the prompt's
    next call another hour (past its Docker container's lifetime). Allowance 1 s, the references' time
    0.2 s: the tool took 1.0 s and the prompt then credited 1.0 s more (2.0 s past); now 1.2 s at most."""
    import time

    from batchrun.prompt import limiter as limiter_module
    from batchrun.prompt.limiter import Limiter, LimitTimeout
    from batchrun.prompt.llm import LLMClient, LLMConfig

    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 1.0)
    ctx = tool_ctx({"MOA_REFERENCE_MODELS": "ref-a, ref-b, ref-c", "MOA_AGGREGATOR_MODEL": "agg"})
    limiter = Limiter()
    ctx.llm = LLMClient(LLMConfig(model="run", base_url=ctx.settings.llm_base_url, api_key="k"), limiter)
    ctx.tool_timeout_s = 0.4  # the references get half: 0.2 s
    limiter.begin_prompt()
    limiter.pause_until(time.time() + 10.0)  # relayed from another prompt's 429
    start = time.monotonic()
    out = call_tool(ctx, "mixture_of_agents", user_prompt="A question")
    assert "only 0 of 3 reference models answered" in out["error"]
    before = limiter.credited_s()
    with pytest.raises(LimitTimeout):  # the agent's next call, at its deadline
        limiter.acquire(time.monotonic() + 0.01)
    past = time.monotonic() - start - 0.2
    assert past < 1.0 + 0.3, past  # the one allowance, not one per thread and one more for the prompt
    assert limiter.credited_s() - before <= 1.0


def test_a_429_of_the_prompts_own_tool_is_its_own_wait(monkeypatch):
    """A pause the prompt's own tool call caused (a reference model's 429, on a thread of its own) is the
    prompt's own time, as one its agent's call caused: it was credited to the agent's next call (0.3 s
    of a 0.3 s allowance, the deadline 0.05 s away); now that call fails at its deadline at once."""
    import contextvars
    import threading
    import time

    from batchrun.prompt import limiter as limiter_module
    from batchrun.prompt.limiter import Limiter, LimitTimeout

    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 0.3)
    limiter = Limiter()
    limiter.begin_prompt()
    tool_thread = threading.Thread(target=contextvars.copy_context().run, args=(limiter.pause, 5.0))
    tool_thread.start()
    tool_thread.join()
    start = time.monotonic()
    with pytest.raises(LimitTimeout):
        limiter.acquire(start + 0.05)
    assert time.monotonic() - start < 0.1
    assert limiter.credited_s() == 0.0


def test_the_reference_models_queued_for_a_slot_are_each_credited_their_wait(tool_ctx, call_tool):
    """The reference models' calls wait for a request slot at once: the first held the prompt's whole
    allowance for its wait and the others were charged theirs: 3 references queued 0.6 s behind another
    prompt's request on a one-slot endpoint, 0.3 s each to their deadline, answered 1 of 3 (the tool
    failed: 'only 1 of 3 reference models answered'). Now each wait is credited, as one was before."""
    import threading
    import time

    from batchrun.prompt.limiter import Limiter
    from batchrun.prompt.llm import LLMClient, LLMConfig

    ctx = tool_ctx(
        {
            "MOA_REFERENCE_MODELS": "ref-a, ref-b, ref-c",
            "MOA_AGGREGATOR_MODEL": "agg",
            "MOA_MIN_SUCCESSFUL": "3",
        }
    )
    limiter = Limiter(max_concurrent=1)
    ctx.llm = LLMClient(LLMConfig(model="run", base_url=ctx.settings.llm_base_url, api_key="k"), limiter)
    ctx.tool_timeout_s = 0.6  # the references get half: 0.3 s
    limiter.acquire(time.monotonic() + 60)  # another prompt's request holds the one slot for 0.6 s
    threading.Timer(0.6, limiter.release).start()
    limiter.begin_prompt()
    out = call_tool(ctx, "mixture_of_agents", user_prompt="A question")
    assert out.get("success") is True, out
    assert sorted(out["models_used"]["reference_models"]) == ["ref-a", "ref-b", "ref-c"]
