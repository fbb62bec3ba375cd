"""Turn one prompt's conversation into a ShareGPT record (Hermes function-calling convention).

The conversion is reversible where it matters: parsing a gpt ``value`` back with
:func:`parse_tool_calls` gives exactly the calls in its structured ``tool_calls`` list.
"""

from __future__ import annotations

import json
import re
from typing import Any

SYSTEM_PREAMBLE = (
    "You are an assistant that can call functions. The functions you may call are described, "
    "as JSON schemas, between the <tools> and </tools> tags below. Call a function only when it "
    "helps with the user's request, and never guess argument values.\n"
    "<tools>\n{tools}\n</tools>\n"
    'To call a function, write a JSON object with the keys "name" and "arguments" between '
    "<tool_call> and </tool_call> tags, one object per call:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>\n'
    "Each result comes back between <tool_response> and </tool_response> tags."
)

_TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_SCRATCHPAD_RE = re.compile(r"<REASONING_SCRATCHPAD>(.*?)</REASONING_SCRATCHPAD>\s*", re.DOTALL)
_THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def split_reasoning(content: str | None) -> tuple[str | None, str]:
    """Pull reasoning written inline out of a message's content.

    ``<REASONING_SCRATCHPAD>`` blocks, a leading ``<think>...</think>`` (models served without a
    reasoning parser), or text before a lone ``</think>`` (templates that open the think block in the
    generation prompt, so the reply starts inside it).
    """
    text = content or ""
    parts = [m.strip() for m in _SCRATCHPAD_RE.findall(text)]
    text = _SCRATCHPAD_RE.sub("", text)
    think = _THINK_RE.match(text)
    if think:
        parts.append(think.group(1).strip())
        text = text[think.end() :]
    elif "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
        before, text = text.split("</think>", 1)
        parts.append(before.strip())
        text = text.lstrip()
    reasoning = "\n\n".join(p for p in parts if p)
    return (reasoning or None), text


def canonical_arguments(raw: str) -> str:
    """The arguments string saved in ``tool_calls``: canonical JSON when it parses, else the raw text."""
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        return raw


def _tool_call_block(name: str, arguments: str) -> str:
    try:
        args: Any = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        args = arguments  # not JSON: kept verbatim as a string so it still round-trips
    if isinstance(args, str):
        args = arguments  # a JSON string (double-encoded arguments): the raw text, so parsing gives it back
    return (
        "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    )


def parse_tool_calls(value: str) -> list[dict[str, str]]:
    """Read the ``<tool_call>`` blocks of a gpt value back as ``[{"name", "arguments"}]``."""
    calls = []
    for block in _TOOL_CALL_RE.findall(value):
        obj = json.loads(block)
        args = obj["arguments"]
        calls.append(
            {
                "name": obj["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
            }
        )
    return calls


_TAG_RE = re.compile(r"<(/?)tool_call>")


def _escape_tags(text: str) -> str:
    """Literal tool-call tags in free text would parse back as calls that were never made."""
    return _TAG_RE.sub(r"&lt;\1tool_call&gt;", text)


def gpt_value(reasoning: str | None, content: str, tool_calls: list[dict[str, Any]]) -> str:
    parts = []
    if reasoning:
        parts.append(f"<think>\n{_escape_tags(reasoning)}\n</think>")
    if content.strip():
        parts.append(_escape_tags(content.strip()))
    parts.extend(_tool_call_block(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls)
    return "\n".join(parts)


def tool_response_block(tool_call_id: str, name: str, content: str) -> str:
    try:
        body: Any = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        body = content
    payload = {"tool_call_id": tool_call_id, "name": name, "content": body}
    return "<tool_response>\n" + json.dumps(payload, ensure_ascii=False) + "\n</tool_response>"


def to_sharegpt(messages: list[dict[str, Any]], tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Convert saved OpenAI-style messages (user/assistant/tool) to ShareGPT ``conversations``.

    Assistant messages carry their reasoning in a ``reasoning`` key (already extracted from
    native fields or scratchpad tags). Consecutive tool results become one ``tool`` entry.
    """
    tools_json = json.dumps([s["function"] for s in tool_schemas], ensure_ascii=False)
    conv: list[dict[str, Any]] = [{"from": "system", "value": SYSTEM_PREAMBLE.format(tools=tools_json)}]
    for msg in messages:
        role = msg["role"]
        if role == "user":
            conv.append({"from": "human", "value": msg["content"]})
        elif role == "assistant":
            calls = msg.get("tool_calls") or []
            entry: dict[str, Any] = {
                "from": "gpt",
                "value": gpt_value(msg.get("reasoning"), msg.get("content") or "", calls),
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
            block = tool_response_block(msg["tool_call_id"], msg.get("name", ""), msg["content"])
            if conv[-1]["from"] == "tool":
                conv[-1]["value"] += "\n" + block
            else:
                conv.append({"from": "tool", "value": block})
    return conv


def is_tool_failure(content: str) -> bool:
    """SPEC's rule: non-null ``error`` (also nested in ``content``), ``success: false``, or error-like text."""
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        text = (content or "").strip()
        return not text or text.lower().startswith("error:")
    if isinstance(data, dict):
        if data.get("error") is not None or data.get("success") is False:
            return True
        inner = data.get("content")
        if isinstance(inner, dict) and (inner.get("error") is not None or inner.get("success") is False):
            return True
    return False


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
) -> dict[str, Any]:
    """The SPEC record for one finished prompt, with tool statistics over every known tool."""
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
    return {
        "prompt_index": prompt_index,
        "conversations": to_sharegpt(messages, tool_schemas),
        "metadata": metadata,
        "completed": completed,
        "partial": partial,
        "api_calls": api_calls,
        "toolsets_used": toolsets_used,
        "tool_stats": stats,
        "tool_error_counts": {name: s["failure"] for name, s in stats.items()},
    }


def reasoning_counts(conversations: list[dict[str, Any]]) -> tuple[int, int]:
    """(gpt turns with reasoning, gpt turns in all) of a ShareGPT conversation."""
    gpt = [c for c in conversations if c.get("from") == "gpt"]
    return sum(1 for c in gpt if c.get("value", "").startswith("<think>")), len(gpt)


def first_human(conversations: list[dict[str, Any]]) -> str | None:
    for c in conversations:
        if c.get("from") == "human":
            return c.get("value")
    return None


def used_tool_names(record: dict[str, Any]) -> set[str]:
    names = set()
    for c in record.get("conversations", []):
        for call in c.get("tool_calls") or []:
            names.add(call["function"]["name"])
    return names
