"""The agent loop for one prompt: ask the model, run its tool calls in the sandbox, repeat.

The loop never raises for what the model did (unknown tools, bad arguments, failing commands
are observations it sees). It raises for infrastructure failure: :class:`batchrun.prompt.llm.LLMError`
after the model client's own retries, :class:`batchrun.prompt.sandboxes.SandboxError`, or :class:`PromptTimeout`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchrun.prompt.jsonbody import RequestEncoder
from batchrun.prompt.llm import (
    CALLED_TOOLS,
    AssistantTurn,
    ContextLimitError,
    LLMClient,
    LLMError,
    PromptCapReached,
    Usage,
    finish_kind,
)
from batchrun.prompt.tools.catalog import execute_tool_call
from batchrun.prompt.tools.registry import Tool, ToolContext
from batchrun.sharegpt import canonical_arguments, split_leading_reasoning, strict_arguments

MAX_INVALID_TURNS = 3  # consecutive turns whose every tool call was invalid before we stop the prompt
# Bounds on what one prompt's conversation holds in this process (it is held several times over: the
# messages, the request's bytes, the record, its line): a reply's calls past MAX_CALLS_PER_TURN are not
# run (each is answered that it was not) and the prompt ends as partial, invalid_tool_calls; once the
# conversation holds MAX_CONVERSATION_CHARS (no model's context is that large) the calls left are not
# run either and it ends as partial, context_limit. 3,000 calls of 64 KB output each in one reply made a
# 198 MB record and took 1.36 GB of this machine's memory before.
MAX_CALLS_PER_TURN = 128
MAX_CONVERSATION_CHARS = 32 * 1024 * 1024

# How a prompt ends when its last reply is not the model's finished words: the sample is discarded with
# this reason (batchrun.prompt.attempt), never kept, partial or not. ``content_filter``: the provider's
# filter stopped or replaced the reply. ``unknown_finish_reason``: a final answer whose finish_reason is
# null, missing or unknown, so nothing says it was not cut short. ``missing_tool_calls``: a reply whose
# finish_reason says it stopped to call tools, with no call in it: the calls were lost, the words are
# only what preceded them. ``refusal``: the reply carries a refusal (OpenAI's ``message.refusal``, words
# the model sent apart from its content): kept as the turn's words in the discard, never as an answer.
# Stop reasons whose sample no flag keeps: the last reply was filtered, refused or may be cut short, or a
# tool result held a secret of the run (it was not sent on to the model; the sample is a discard).
REPLY_DISCARDS = (
    "content_filter",
    "unknown_finish_reason",
    "missing_tool_calls",
    "secret_in_output",
    "refusal",
)


class PromptTimeout(RuntimeError):
    """The prompt's wall-clock limit was reached."""


@dataclass
class LoopLimits:
    max_turns: int = 10  # model calls per prompt
    prompt_timeout_s: float = 1800.0  # wall clock for the whole prompt
    tool_timeout_s: float = 180.0  # one tool call
    max_prompt_tokens: int | None = None  # tokens (prompt + completion) one prompt may spend; then partial
    max_prompt_usd: float | None = None  # dollars one prompt may spend (when the endpoint reports cost)


@dataclass
class LoopResult:
    messages: list[
        dict[str, Any]
    ]  # what is saved: user prompt, assistant turns (with "reasoning"), tool results
    api_calls: int
    completed: bool
    partial: bool
    stop_reason: (
        str  # final_answer | max_turns | truncated | context_limit | invalid_tool_calls | prompt_budget
        # | content_filter | unknown_finish_reason | missing_tool_calls | secret_in_output | refusal
        # (REPLY_DISCARDS)
    )
    tool_calls: int = 0
    served_model: str | None = None  # the last answered response's ``model``, when it named one


def run_agent(
    *,
    llm: LLMClient,
    prompt: str,
    tools: list[Tool],
    ctx: ToolContext,
    limits: LoopLimits,
    ephemeral_system_prompt: str | None = None,
    prefill_messages: list[dict[str, Any]] | None = None,
    usage: Usage | None = None,
    log=None,
    system_prompt: str | None = None,
    request_seed: int | None = None,
    holds_secret: Callable[[str], bool] | None = None,
) -> LoopResult:
    """Run one prompt to a final answer or a limit. ``usage`` collects tokens and cost as calls happen,
    so a prompt that fails half-way still accounts for what it spent.

    ``system_prompt`` (the row's own, saved by the caller in the record) and the ephemeral one (never
    saved) reach the model as one system message, the row's first. ``request_seed``: each model call
    sends a seed derived from it and the turn number (None: no seed is sent). ``holds_secret``: a tool
    result it finds a secret of the run in ends the prompt there (``secret_in_output``): the secret is
    never sent on to the model (a tool's key quoted in its error, an MCP server's token, a command's
    output), and the sample is a discard, as the recorder would make it."""
    # A run-wide pause for another prompt's 429 moves this prompt's deadline (the limiter credits it).
    limiter = getattr(llm, "limiter", None)
    credited_at_start = limiter.credited_s() if limiter is not None else 0.0
    end = time.monotonic() + limits.prompt_timeout_s

    def deadline_now() -> float:
        return end + (limiter.credited_s() - credited_at_start if limiter is not None else 0.0)

    usage = usage if usage is not None else Usage()
    schemas = [t.openai_schema() for t in tools]
    encoder = RequestEncoder()  # each message is encoded once: `sent` only grows, nothing in it changes
    offered = {t.name for t in tools}
    # What the model sees; the ephemeral system prompt and prefill never reach `saved`.
    sent: list[dict[str, Any]] = []
    # One system message: several, or one after other turns, are refused by some chat templates.
    system = "\n\n".join(p for p in (system_prompt, ephemeral_system_prompt) if p)
    if system:
        sent.append({"role": "system", "content": system})
    sent.extend(prefill_messages or [])
    user = {"role": "user", "content": prompt}
    sent.append(user)
    saved: list[dict[str, Any]] = [user]
    result = LoopResult(messages=saved, api_calls=0, completed=False, partial=True, stop_reason="max_turns")
    invalid_streak = 0
    size = len(prompt)  # characters the conversation holds (beyond the system prompt and prefill)

    while result.api_calls < limits.max_turns:
        deadline = deadline_now()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PromptTimeout(f"prompt exceeded its {limits.prompt_timeout_s:g} s limit")
        if over_budget(usage, limits, getattr(llm, "usd_per_token", 0.0)):
            result.stop_reason = "prompt_budget"
            return result
        try:
            seed = None if request_seed is None else turn_seed(request_seed, result.api_calls)
            turn = llm.chat(sent, schemas, deadline=deadline, usage=usage, seed=seed, encoder=encoder)
        except ContextLimitError:
            if result.api_calls == 0:
                raise
            result.stop_reason = "context_limit"
            return result
        except PromptCapReached:
            if result.api_calls == 0:  # no turn to keep: failed (class prompt_budget), --resume runs it
                raise
            result.stop_reason = "prompt_budget"
            return result
        except LLMError as exc:
            if time.monotonic() >= deadline_now():
                raise PromptTimeout(
                    f"prompt exceeded its {limits.prompt_timeout_s:g} s limit ({exc})"
                ) from exc
            raise
        result.api_calls += 1
        result.served_model = turn.served_model or result.served_model
        assistant_saved, assistant_sent = _assistant_messages(
            turn, reasoning_disabled=getattr(getattr(llm, "cfg", None), "reasoning_disabled", False)
        )
        saved.append(assistant_saved)
        sent.append(assistant_sent)
        finish = finish_kind(turn.finish_reason)
        if turn.refusal is not None:  # whatever its finish_reason: its calls, if any, are not run
            result.stop_reason = "refusal"
            return result
        if finish == "length":
            result.stop_reason = "truncated"
            return result
        if finish == "content_filter":  # its calls too may be what the filter left of them: not run
            result.stop_reason = "content_filter"
            return result
        if not turn.tool_calls:
            if finish != "finished":
                result.stop_reason = "unknown_finish_reason"
                return result
            if str(turn.finish_reason).lower() in CALLED_TOOLS:
                result.stop_reason = "missing_tool_calls"
                return result
            result.completed, result.partial, result.stop_reason = True, False, "final_answer"
            return result
        invalid = 0
        size += _chars(assistant_saved)
        bounded: str | None = None  # why the prompt ends after this turn: a bound was reached
        for i, call in enumerate(assistant_saved["tool_calls"]):
            name, args = call["function"]["name"], call["function"]["arguments"]
            remaining = deadline_now() - time.monotonic()
            if remaining <= 0:
                raise PromptTimeout(f"prompt exceeded its {limits.prompt_timeout_s:g} s limit")
            if i >= MAX_CALLS_PER_TURN:
                bounded = "invalid_tool_calls"
                content = _not_run(f"more than {MAX_CALLS_PER_TURN} tool calls in one reply")
            elif size >= MAX_CONVERSATION_CHARS:
                bounded = bounded or "context_limit"
                content = _not_run(f"the conversation holds more than {MAX_CONVERSATION_CHARS} characters")
            else:
                ctx.tool_timeout_s = max(1.0, min(limits.tool_timeout_s, remaining))
                content = execute_tool_call(name, args, ctx, offered)
                result.tool_calls += 1
            size += len(content)
            if name not in offered or _is_invalid_json(args):
                invalid += 1
            if log:
                log({"tool": name, "args": args, "result": content})
            tool_msg = {"role": "tool", "tool_call_id": call["id"], "name": name, "content": content}
            saved.append(tool_msg)
            sent.append(tool_msg)
            if holds_secret is not None and holds_secret(content):
                result.stop_reason = "secret_in_output"
                return result
        invalid_streak = invalid_streak + 1 if invalid == len(assistant_saved["tool_calls"]) else 0
        if invalid_streak >= MAX_INVALID_TURNS:
            result.stop_reason = "invalid_tool_calls"
            return result
        if bounded is None and size >= MAX_CONVERSATION_CHARS:
            bounded = "context_limit"
        if bounded is not None:
            result.stop_reason = bounded
            return result
    return result


def _chars(message: dict[str, Any]) -> int:
    """The characters an assistant message holds: its words, reasoning and calls' names and arguments."""
    calls = message.get("tool_calls") or ()
    return (
        len(message.get("content") or "")
        + len(message.get("reasoning") or "")
        + sum(len(c["function"]["name"]) + len(c["function"]["arguments"]) for c in calls)
    )


def _not_run(why: str) -> str:
    """The tool message of a call not run because a bound of the prompt was reached."""
    return json.dumps({"error": f"Not run: {why}; the prompt ends here."})


def _assistant_messages(
    turn: AssistantTurn, *, reasoning_disabled: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved form (reasoning split out, canonical arguments) and the form sent back to the model.

    Words are read as reasoning only where the endpoint sent no reasoning field and reasoning is not
    disabled, and only a block at the reply's very start (``<think>...</think>`` or
    ``<REASONING_SCRATCHPAD>...</REASONING_SCRATCHPAD>``, or words before a lone ``</think>`` when the
    template opened the block). Anywhere else a tag stays in the words, where the ``ambiguous_markup``
    filter finds it: a stray ``</think>`` never turns words into reasoning, nor are words rejoined
    around a scratchpad taken out of their middle."""
    if turn.reasoning is None and not reasoning_disabled:
        scratch_reasoning, content = split_leading_reasoning(turn.content)
    else:
        scratch_reasoning, content = None, turn.content or ""
    if turn.refusal is not None:  # the model's words, sent in their own field: the discard shows them
        content = f"{content}\n\n{turn.refusal}" if content else turn.refusal
    reasoning = turn.reasoning or scratch_reasoning
    if turn.reasoning and scratch_reasoning:
        reasoning = f"{turn.reasoning}\n\n{scratch_reasoning}"
    calls = []
    seen_ids: set[str] = set()
    for i, c in enumerate(turn.tool_calls):
        call_id, n = c.id, i + 1
        while not call_id or call_id in seen_ids:  # missing or repeated: the first free call_<n>
            call_id, n = f"call_{n}", n + 1
        seen_ids.add(call_id)
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": canonical_arguments(c.arguments)},
            }
        )
    saved: dict[str, Any] = {"role": "assistant", "content": content, "reasoning": reasoning}
    sent: dict[str, Any] = {"role": "assistant", "content": turn.content or ""}
    if calls:
        saved["tool_calls"] = calls
        sent["tool_calls"] = calls
    return saved, sent


def turn_seed(base: int, turn: int) -> int:
    """The ``seed`` of a prompt's ``turn``-th model call: fixed by ``base`` and the turn, within 0..2**31-1
    (the range every endpoint that takes a seed accepts)."""
    digest = hashlib.sha256(f"{base}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _is_invalid_json(args: str) -> bool:
    if not args.strip():
        return False
    try:
        return not isinstance(strict_arguments(args), dict)
    except ValueError:
        return True


def over_budget(usage: Usage, limits: LoopLimits, price: float = 0.0) -> bool:
    """The per-prompt cap: a runaway prompt ends as partial instead of spending on. The caps go on the
    prompt's usage, which the model client also checks between the retries of one call."""
    usage.cap_tokens, usage.cap_usd = limits.max_prompt_tokens, limits.max_prompt_usd
    return usage.over_cap(price)
