"""Turn one prompt's conversation into a ShareGPT record (Hermes function-calling convention).

The conversion is reversible: parsing a gpt ``value`` back (:func:`parse_gpt_value`) gives exactly
the turn's reasoning, words and the calls in its structured ``tool_calls`` list. The model's words are
never rewritten to make that so; a sample where it does not hold is discarded (:func:`ambiguous_markup`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from batchrun.record import (
    RECORD_FIELDS,
    conform_score,
    names_of,
    normalize_metadata,
)
from batchrun.sharegpt import first_human  # noqa: F401  (its readers import it from here too)

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
SYSTEM_PREAMBLE_START = SYSTEM_PREAMBLE.split("\n", 1)[0].split(".", 1)[0]  # its fixed first words

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
    parts: list[str] = []
    if "<REASONING_SCRATCHPAD>" in text:  # a plain search first: most replies have none
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
    """The arguments string saved in ``tool_calls``: canonical JSON when it parses, else the raw text.

    No arguments at all (an empty string, as some servers send for a tool without parameters) is ``{}``.
    """
    if not (raw or "").strip():
        return "{}"
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


def tool_call_text(name: str, arguments: str) -> str:
    """One call's ``<tool_call>`` block exactly as a gpt value holds it (readers strip it back off)."""
    return _tool_call_block(name, arguments)


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


def gpt_value(reasoning: str | None, content: str, tool_calls: list[dict[str, Any]]) -> str:
    """A gpt turn as text. The model's words are never rewritten: a turn whose words would not parse
    back as written is discarded instead (see :func:`ambiguous_markup`)."""
    # A turn without reasoning opens with an empty think block, as the reference renders it: every gpt
    # turn has the same shape for a trainer (and the block parses back as no reasoning).
    parts = [f"<think>\n{reasoning}\n</think>" if reasoning else "<think>\n</think>"]
    if content.strip():
        parts.append(content.strip())
    parts.extend(_tool_call_block(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls)
    return "\n".join(parts)


def tool_response_block(tool_call_id: str, name: str, content: str) -> str:
    try:
        body: Any = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        body = content
    payload = {"tool_call_id": tool_call_id, "name": name, "content": body}
    return "<tool_response>\n" + json.dumps(payload, ensure_ascii=False) + "\n</tool_response>"


def system_value(tool_schemas: list[dict[str, Any]], system: str | None = None) -> str:
    """The record's system entry: the row's own system prompt (when it has one), a blank line, then the
    function-calling preamble with the offered tools. :func:`split_system_value` reads it back."""
    tools_json = json.dumps([system_tool_entry(s["function"]) for s in tool_schemas], ensure_ascii=False)
    preamble = SYSTEM_PREAMBLE.format(tools=tools_json)
    return f"{system}\n\n{preamble}" if system else preamble


def system_tool_entry(function: dict[str, Any]) -> dict[str, Any]:
    """One tool as the system text lists it, with the keys the reference's entries carry: ``name``,
    ``description``, ``parameters`` and ``required`` (null there too; the required arguments are in
    ``parameters``). :func:`offered_tools` reads it back as the OpenAI function schema."""
    return {
        "name": function["name"],
        "description": function.get("description", ""),
        "parameters": function.get("parameters", {}),
        "required": None,
    }


def split_system_value(value: str) -> str | None:
    """The row's own system prompt in a record's system entry (what precedes the preamble), or None."""
    # JSON text holds no raw newline, so the last "\n<tools>\n" is the preamble's own.
    start = value.rfind(SYSTEM_PREAMBLE_START, 0, max(value.rfind("\n<tools>\n"), 0))
    if start <= 0:
        return None
    return value[:start].removesuffix("\n\n") or None


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
    for msg in messages:
        role = msg["role"]
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
            block = tool_response_block(msg["tool_call_id"], msg.get("name", ""), msg["content"])
            if conv[-1]["from"] == "tool":
                conv[-1]["value"] += "\n" + block
            else:
                conv.append({"from": "tool", "value": block, "tool_calls": []})
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


def reasoning_counts(conversations: list[dict[str, Any]]) -> tuple[int, int]:
    """(gpt turns with reasoning, gpt turns in all) of a ShareGPT conversation."""
    gpt = [c for c in conversations if c.get("from") == "gpt"]
    # A closed, non-empty envelope: words that open <think> and never close it are not reasoning.
    return sum(1 for c in gpt if _has_reasoning(c.get("value", ""))), len(gpt)


def _has_reasoning(value: str) -> bool:
    found = _THINK_RE.match(value)
    return found is not None and bool(found.group(1).strip())


# ----------------------------------------------------------------------------- quality checks of a sample


def invalid_tool_call(messages: list[dict[str, Any]]) -> bool:
    """Whether any saved call's arguments are not a JSON object (bad JSON, or cut off by the length limit)."""
    for msg in messages:
        if msg.get("role") != "assistant":
            continue
        for call in msg.get("tool_calls") or []:
            try:
                args = json.loads(call["function"]["arguments"])
            except (json.JSONDecodeError, TypeError):
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
    ``</think>`` in the words or ``</think>`` in the reasoning, and a ``<tool_call>...</tool_call>``
    span in the words or the reasoning.
    """
    turns = [m for m in messages if m.get("role") == "assistant"]
    values = [c["value"] for c in conversations if c.get("from") == "gpt"]
    if len(turns) != len(values):
        return True
    for msg, value in zip(turns, values, strict=True):
        reasoning, words = msg.get("reasoning") or None, (msg.get("content") or "").strip()
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls") or []
        ]
        if "<think>" in words or "</think>" in words or (reasoning and "</think>" in reasoning):
            return True
        if _LOOSE_CALL_RE.search(words) or (reasoning and _LOOSE_CALL_RE.search(reasoning)):
            return True
        try:
            parsed = parse_gpt_value(value)
        except (json.JSONDecodeError, KeyError, TypeError):
            return True
        if parsed != ((reasoning.strip() if reasoning else None), words, calls):
            return True
    return False


def used_tool_names(record: dict[str, Any]) -> set[str]:
    names = set()
    for c in record.get("conversations", []):
        for call in c.get("tool_calls") or []:
            names.add(call["function"]["name"])
    return names


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _identity_fields_ok(fields: dict[str, Any]) -> bool:
    """The row_* identity fields and sample_index, where present, have their types (absent: an older version)."""

    def names(value: Any) -> bool:
        if value is None or value == "":
            return True
        if isinstance(value, str):  # JSON text of a name list, as records write it
            return names_of(value) is not None
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    turns, sample = fields.get("row_max_turns"), fields.get("sample_index")
    return (
        names(fields.get("row_toolsets"))
        and names(fields.get("row_tools"))
        and _optional_str(fields.get("row_system_sha256"))
        and (turns is None or _count(turns))
        and (sample is None or _count(sample))
    )


def valid_record(rec: Any) -> bool:
    """Whether a line read back from a batch file has the shape every reader relies on.

    Valid JSON of the wrong shape (``null``, a list, ``"conversations": "x"``, ``"tool_stats": 5``)
    is skipped and counted like a torn line, by merge, resume, statistics, checkpoint and report.
    """
    if not isinstance(rec, dict):
        return False
    conv = rec.get("conversations")
    if not isinstance(conv, list) or not conv:
        return False
    for turn in conv:
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
            return False
        if not isinstance(turn.get("value"), str):
            return False
        calls = turn.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list)
            and all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                for c in calls
            )
        ):
            return False
    if first_human(conv) is None:
        return False
    stats = rec.get("tool_stats", {})
    if not isinstance(stats, dict) or not all(
        isinstance(s, dict) and all(_count(s.get(k, 0)) for k in ("count", "success", "failure"))
        for s in stats.values()
    ):
        return False
    meta = rec.get("metadata", {})
    if not isinstance(meta, dict) or not isinstance(meta.get("usage", {}), dict):
        return False
    if not (
        _optional_str(meta.get("image")) and _optional_str(meta.get("cwd")) and _identity_fields_ok(meta)
    ):
        return False
    index, calls_made = rec.get("prompt_index"), rec.get("api_calls", 0)
    return (index is None or _count(index)) and (calls_made is None or _count(calls_made))


def valid_outcome_row(row: Any, field: str) -> bool:
    """A discarded.jsonl (``field="reason"``) or failed.jsonl (``"error_class"``) row of the right shape."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("prompt"), str)
        and isinstance(row.get(field), str)
        and _optional_str(row.get("image"))
        and _optional_str(row.get("cwd"))
        and _identity_fields_ok(row)
        and (row.get("record") is None or valid_record(row["record"]))
        and isinstance(row.get("usage", {}), dict)
    )


# ----------------------------------------------------------------------------- reading a record back
# The inverses of the renderers above, for readers of saved records (the exporter): they live here so
# the text convention is written and read in one place.

_TOOLS_RE = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_TOOL_RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def parse_gpt_value(value: str) -> tuple[str | None, str, list[dict[str, str]]]:
    """Split a gpt ``value`` into (reasoning, the model's words, ``[{"name", "arguments"}]``).

    ``gpt_value`` writes the calls after the words, so the words end where the first call block starts.
    """
    reasoning, rest = split_reasoning(value)
    first = _TOOL_CALL_RE.search(rest)
    content = rest if first is None else rest[: first.start()]
    return reasoning, content.removesuffix("\n"), parse_tool_calls(rest)


def parse_tool_responses(value: str) -> list[dict[str, Any]]:
    """The ``<tool_response>`` blocks of a tool entry as ``[{"tool_call_id", "name", "content"}]``.

    ``content`` is the result text the model saw (JSON results as compact JSON text, as tools return them).
    """
    out = []
    for block in _TOOL_RESPONSE_RE.findall(value):
        obj = json.loads(block)
        body = obj["content"]
        out.append(
            {
                "tool_call_id": obj["tool_call_id"],
                "name": obj.get("name", ""),
                "content": body if isinstance(body, str) else json.dumps(body, ensure_ascii=False),
            }
        )
    return out


def offered_tools(system_value: str) -> list[dict[str, Any]]:
    """The tools a system entry offered, as OpenAI tool schemas (``{"type": "function", "function": ...}``)."""
    found = _TOOLS_RE.findall(system_value)  # the last block: a row's own system prompt comes first
    if not found:
        return []
    return [
        {"type": "function", "function": {k: v for k, v in f.items() if not (k == "required" and v is None)}}
        for f in json.loads(found[-1])
    ]
