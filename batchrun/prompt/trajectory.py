"""Turn one prompt's conversation into a ShareGPT record, and check the sample's quality (the worker's side).

The text convention is ``batchrun.sharegpt``'s; it is reversible: parsing a gpt ``value`` back gives
exactly the turn's reasoning, words and the calls in its structured ``tool_calls`` list. The model's
words are never rewritten to make that so; a sample where it does not hold is discarded
(:func:`ambiguous_markup`).
"""

from __future__ import annotations

import re
from typing import Any

from batchrun.record import RECORD_FIELDS, conform_score, is_tool_failure, normalize_metadata
from batchrun.sharegpt import (
    gpt_value,
    parse_gpt_value,
    strict_arguments,
    system_value,
    tool_response_block,
)


def to_sharegpt(
    messages: list[dict[str, Any]], tool_schemas: list[dict[str, Any]], system: str | None = None
) -> list[dict[str, Any]]:
    """Convert saved OpenAI-style messages (user/assistant/tool) to ShareGPT ``conversations``.

    ``system``: the row's own system prompt, saved at the start of the system entry.

    Assistant messages carry their reasoning in a ``reasoning`` key (already extracted from
    native fields or scratchpad tags). Consecutive tool results become one ``tool`` entry.
    """
    conv: list[dict[str, Any]] = [
        {"from": "system", "value": system_value(tool_schemas, system), "tool_calls": []}
    ]
    # The blocks of the tool results since the last other message, joined once into their entry: appended
    # one at a time, each result copied the whole entry so far (10,000 results of one reply took 38 s).
    blocks: list[str] = []
    for msg in messages:
        role = msg["role"]
        if role != "tool" and blocks:
            conv.append({"from": "tool", "value": "\n".join(blocks), "tool_calls": []})
            blocks = []
        if role == "user":
            conv.append({"from": "human", "value": msg["content"], "tool_calls": []})
        elif role == "assistant":
            calls = msg.get("tool_calls") or []
            # ``tool_calls`` is on every entry (an empty list when none; the schema types its elements):
            # a key present in some entries only makes datasets load the conversation as untyped JSON.
            entry: dict[str, Any] = {
                "from": "gpt",
                "value": gpt_value(msg.get("reasoning"), msg.get("content") or "", calls),
                "tool_calls": [],
            }
            if calls:
                entry["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    }
                    for c in calls
                ]
            conv.append(entry)
        elif role == "tool":
            blocks.append(tool_response_block(msg["tool_call_id"], msg.get("name", ""), msg["content"]))
    if blocks:
        conv.append({"from": "tool", "value": "\n".join(blocks), "tool_calls": []})
    return conv


def empty_tool_stats(names: list[str]) -> dict[str, dict[str, int]]:
    return {n: {"count": 0, "success": 0, "failure": 0} for n in names}


def build_record(
    *,
    prompt_index: int,
    messages: list[dict[str, Any]],
    tool_schemas: list[dict[str, Any]],
    known_tools: list[str],
    metadata: dict[str, Any],
    completed: bool,
    partial: bool,
    api_calls: int,
    toolsets_used: list[str],
    system: str | None = None,
    score: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The SPEC record for one finished prompt, with tool statistics over every known tool.

    ``system``: the row's own system prompt, saved in the system entry (never the ephemeral one)."""
    stats = empty_tool_stats(known_tools)
    names_by_id = {}
    for msg in messages:
        if msg["role"] == "assistant":
            for c in msg.get("tool_calls") or []:
                names_by_id[c["id"]] = c["function"]["name"]
        elif msg["role"] == "tool":
            name = names_by_id.get(msg["tool_call_id"], msg.get("name", ""))
            entry = stats.setdefault(name, {"count": 0, "success": 0, "failure": 0})
            entry["count"] += 1
            entry["failure" if is_tool_failure(msg["content"]) else "success"] += 1
    record = {
        "prompt_index": prompt_index,
        "conversations": to_sharegpt(messages, tool_schemas, system),
        "metadata": normalize_metadata(metadata),
        "completed": completed,
        "partial": partial,
        "api_calls": api_calls,
        "toolsets_used": toolsets_used,
        "tool_stats": stats,
        "tool_error_counts": {name: s["failure"] for name, s in stats.items()},
        "score": conform_score(score),  # batchrun.scoring fills it in while the sandbox is up
    }
    assert tuple(record) == RECORD_FIELDS  # batchrun.record defines the fields; this writes them
    return record


# ----------------------------------------------------------------------------- quality checks of a sample


def invalid_tool_call(messages: list[dict[str, Any]]) -> bool:
    """Whether any saved call's arguments are not a JSON object (bad JSON, or cut off by the length limit)."""
    for msg in messages:
        if msg.get("role") != "assistant":
            continue
        for call in msg.get("tool_calls") or []:
            try:
                args = strict_arguments(call["function"]["arguments"])
            except (ValueError, TypeError):
                return True
            if not isinstance(args, dict):
                return True
    return False


def unoffered_call(messages: list[dict[str, Any]], offered: set[str], known: set[str]) -> str | None:
    """Why a sample calls a tool it was not given, or None: ``unknown_tool`` (no such tool: hallucinated)
    or ``tool_not_offered`` (a tool that exists, but not among this prompt's). Either way the calls and
    their error results would teach a trainer to call what is not there."""
    names = {
        call["function"]["name"]
        for msg in messages
        if msg.get("role") == "assistant"
        for call in msg.get("tool_calls") or []
    }
    if names - known:
        return "unknown_tool"
    if names - offered:
        return "tool_not_offered"
    return None


def empty_answer(messages: list[dict[str, Any]]) -> bool:
    """Whether the final assistant turn (no calls) has no words: empty, or reasoning only."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    return last is not None and not last.get("tool_calls") and not (last.get("content") or "").strip()


_LOOSE_CALL_RE = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def ambiguous_markup(messages: list[dict[str, Any]], conversations: list[dict[str, Any]]) -> bool:
    """Whether some gpt value does not parse back to exactly its turn's reasoning, words and calls.

    Beyond this module's own parser, markup a looser reader would misread counts too: ``<think>`` or
    ``</think>`` in the words or ``</think>`` in the reasoning, a ``<REASONING_SCRATCHPAD>`` tag in the
    words, and a ``<tool_call>...</tool_call>`` span in the words or the reasoning.
    """
    turns = [m for m in messages if m.get("role") == "assistant"]
    values = [c["value"] for c in conversations if c.get("from") == "gpt"]
    if len(turns) != len(values):
        return True
    for msg, value in zip(turns, values, strict=True):
        reasoning, words = msg.get("reasoning") or None, msg.get("content") or ""
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls") or []
        ]
        if "<think>" in words or "</think>" in words or (reasoning and "</think>" in reasoning):
            return True
        if "REASONING_SCRATCHPAD>" in words:  # loose readers (and the text scorers) take it for reasoning
            return True
        if _LOOSE_CALL_RE.search(words) or (reasoning and _LOOSE_CALL_RE.search(reasoning)):
            return True
        try:
            parsed = parse_gpt_value(value)
        except (ValueError, KeyError, TypeError):
            return True
        if parsed != (reasoning, words, calls):
            return True
    return False
