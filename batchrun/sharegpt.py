"""The records' ShareGPT text convention (Hermes function calling), written and read back, in one place.

What the ``from``/``value`` texts of a record's ``conversations`` hold: the system entry (a row's own
system prompt, then the function-calling preamble listing the offered tools), the gpt turns (a
``<think>`` block, the model's words, one ``<tool_call>`` block per call) and the tool entries (one
``<tool_response>`` block per result). The renderers are used by the worker
(``batchrun.prompt.trajectory`` builds a record from them); their inverses by the readers of saved
records (resume, merge, statistics, the views). The convention is reversible: parsing a gpt value back
(:func:`parse_gpt_value`) gives exactly the turn's reasoning, words and calls.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any


def first_human(conversations: list[dict[str, Any]]) -> str | None:
    """The first human entry's text (a record's prompt), or None when there is none."""
    for c in conversations:
        if isinstance(c, dict) and c.get("from") == "human":
            value = c.get("value")
            return value if isinstance(value, str) else None
    return None


# What a gpt turn's think block holds when the provider sent its reasoning encrypted only: a marker of the
# runner's (the record shows the turn reasoned, and coverage counts it), not words of the model's. The
# exporter gives trainers no reasoning for such a turn, never this text as the model's thinking.
ENCRYPTED_REASONING = "[reasoning encrypted by the provider]"

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
_THINK_RE = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)


def split_reasoning(content: str | None) -> tuple[str | None, str]:
    """Pull reasoning written inline out of a message's content.

    ``<REASONING_SCRATCHPAD>`` blocks, a leading ``<think>...</think>`` (models served without a
    reasoning parser), or text before a lone ``</think>`` (templates that open the think block in the
    generation prompt, so the reply starts inside it).

    A think block's text and the words after it are kept as the model wrote them, but for the one
    line break just inside each tag and the one right after ``</think>``: those are the envelope's
    own (:func:`gpt_value` writes them back), so a reply written as ``<think>\n...\n</think>\n...``
    comes back from the record byte for byte.
    """
    text = content or ""
    parts: list[str] = []
    if "<REASONING_SCRATCHPAD>" in text:  # a plain search first: most replies have none
        parts = [m.strip() for m in _SCRATCHPAD_RE.findall(text)]
        text = _SCRATCHPAD_RE.sub("", text)
    think = _THINK_RE.match(text)
    if think:
        parts.append(unwrap_reasoning(think.group(1)))
        text = text[think.end() :].removeprefix("\n")
    elif "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
        before, text = text.split("</think>", 1)
        parts.append(unwrap_reasoning(before))
        text = text.removeprefix("\n")
    reasoning = "\n\n".join(p for p in parts if p.strip())
    return (reasoning or None), text


_LEADING_BLOCKS = (
    re.compile(r"<REASONING_SCRATCHPAD>(.*?)</REASONING_SCRATCHPAD>", re.DOTALL),
    re.compile(r"<think>(.*?)</think>", re.DOTALL),
)


def split_leading_reasoning(content: str | None) -> tuple[str | None, str]:
    """The worker's reading of reasoning a reply wrote inline, so that its record gives back what the
    model wrote: one ``<REASONING_SCRATCHPAD>`` or ``<think>`` block at the very start of the reply, or
    the text before a lone ``</think>`` (templates that open the think block in the generation prompt).
    Its text and the words after it are kept as written but for the one line break just inside each tag
    and the one after the block, which are the envelope's (:func:`gpt_value` writes them back).

    Nothing else is moved: a block after a space or words, a second block, stays in the words as the
    model wrote it (the sample is then ``ambiguous_markup``). :func:`split_reasoning` instead reads any
    text loosely, scratchpads anywhere, for records other tools wrote; the worker's reading of
    ``Let me check.<REASONING_SCRATCHPAD>..</REASONING_SCRATCHPAD>\nDone.`` with it saved the words
    ``Let me check.Done.``, which the model never wrote. A lone ``</think>`` ends the reasoning only at a
    line's end (what follows it is nothing or a line break).
    """
    text = content or ""
    for block in _LEADING_BLOCKS:
        found = block.match(text)
        if found:
            return _reasoning_or_none(found.group(1)), text[found.end() :].removeprefix("\n")
    if "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
        before, rest = text.split("</think>", 1)
        # The block a template opened closes at a line's end ("...\n</think>\n\n", Qwen3's and
        # DeepSeek-R1's): one mid-sentence ("use </think> to close") is the words' own, and read as a
        # boundary it made a model without reasoning one with, its answer cut to " to close".
        if not rest or rest.startswith(("\n", "\r\n")):
            return _reasoning_or_none(before), rest.removeprefix("\n")
    return None, text


def _reasoning_or_none(inner: str) -> str | None:
    reasoning = unwrap_reasoning(inner)
    return reasoning if reasoning.strip() else None


def unwrap_reasoning(inner: str) -> str:
    """Reasoning without the one line break right after ``<think>`` and right before ``</think>``: those
    are the envelope's (:func:`gpt_value` writes them), whether the reasoning came inline or in a native
    field (servers differ in whether they keep them). Every other space and line break stays."""
    return inner.removeprefix("\n").removesuffix("\n")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a number a double holds; None for anything else: a bool, NaN, an
    infinity, or an integer past 1.8e308 (JSON has no limit: ``math.isfinite`` of one raised
    OverflowError, and one such count in a saved record ended every resume in a traceback)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def finite_value(value: Any) -> Any:
    """``value`` itself (an int stays an int) when :func:`finite_number` reads it as a number; else None."""
    return value if finite_number(value) is not None else None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: a JSON number, but no double holds it (written back: Infinity)
        raise ValueError(f"{text} is too large for a JSON reader's number")
    return value


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object from its pairs (``object_pairs_hook``), ValueError when it names a key twice."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"{key!r} is defined twice")
        obj[key] = value
    return obj


def parse_json(text: str | bytes, **options: Any) -> Any:
    """``json.loads`` for text from outside (a dataset line, a saved record, an endpoint's body, a
    flag's file): ``ValueError`` for whatever it cannot read. ``json.loads`` itself also raises a bare
    ValueError for an integer of more than 4300 digits (Python's limit on converting one) and a
    RecursionError for nesting past the interpreter's recursion limit, which is made a ValueError."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
    except ValueError as exc:
        if str(exc).startswith("Exceeds the limit"):  # Python's advice (set_int_max_str_digits) is not ours
            raise ValueError("a number of more than 4300 digits") from None
        raise


def strict_json(text: str) -> Any:
    """``text`` as JSON that every reader reads the same way; ValueError otherwise. Python's reader
    also takes ``NaN``, ``Infinity`` and ``-Infinity`` (no other reader does: written back, they make a
    line strict readers refuse), a number too large for a double (``1e999``, read as infinity and
    written back as ``Infinity``), and an object that names a key twice (it keeps the last; which one
    the model meant is anyone's guess). A model's tool-call arguments are read with this
    (:func:`strict_arguments`)."""
    return parse_json(text, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=unique_keys)


def strict_arguments(text: str) -> Any:
    """A call's arguments as :func:`strict_json` reads them; ValueError too when they escape a lone
    surrogate (``"\\ud800"``): Python's reader takes it, but strict readers refuse it or read another
    character, and it is text UTF-8 cannot carry (a record's reader, an export, a tool's command)."""
    value = strict_json(text)
    # A lone surrogate in the text itself (sent escaped in the endpoint's body) is the recorder's to find
    # (unencodable_text); one escaped in the arguments' own JSON shows only once they are read.
    if "\\u" in text and _encodes(text) and not _encodes(json.dumps(value, ensure_ascii=False)):
        raise ValueError("a lone surrogate escape (\\ud800-\\udfff) is not text")
    return value


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def canonical_arguments(raw: str) -> str:
    """The arguments string saved in ``tool_calls`` and sent back to the model: the model's own text, byte
    for byte (its spacing, escapes, number forms, key order, and any space or line break around the
    object), whether or not it parses (a call whose arguments are not a JSON object, see
    :func:`strict_json`, makes the sample an ``invalid_tool_call`` discard).

    No arguments at all (an empty or blank string, as some servers send for a tool without parameters)
    is ``{}``.
    """
    if not (raw or "").strip():
        return "{}"
    return raw


# What a <tool_call> block holds before its arguments: the block is this, the arguments, then "}".
_BLOCK_HEAD = '{{"name": {name}, "arguments": '


def _embeds_verbatim(arguments: str) -> bool:
    """Whether a call's arguments go into its block as they are: JSON every reader reads the same way
    (strictly, see :func:`strict_json`) and not a JSON string (double-encoded arguments go in as a
    string holding their text, so a reader of the block gets that text back, not its decoding)."""
    try:
        return not isinstance(strict_json(arguments), str)
    except (ValueError, TypeError):
        return False


def _tool_call_block(name: str, arguments: str) -> str:
    # The arguments are the model's text, embedded as written when they are JSON (the block is then one
    # JSON object whose "arguments" any JSON reader reads as the model's object); other text, as a JSON
    # string of it. parse_tool_calls gives the text back either way.
    head = _BLOCK_HEAD.format(name=json.dumps(name, ensure_ascii=False))
    text = arguments if _embeds_verbatim(arguments) else json.dumps(arguments, ensure_ascii=False)
    return "<tool_call>\n" + head + text + "}\n</tool_call>"


def tool_call_text(name: str, arguments: str) -> str:
    """One call's ``<tool_call>`` block exactly as a gpt value holds it (readers strip it back off)."""
    return _tool_call_block(name, arguments)


def parse_tool_calls(value: str) -> list[dict[str, str]]:
    """Read the ``<tool_call>`` blocks of a gpt value back as ``[{"name", "arguments"}]``: each call's
    arguments as the text its block was written from (the model's own, byte for byte)."""
    calls = []
    for block in _TOOL_CALL_RE.findall(value):
        obj = parse_json(block)
        calls.append({"name": obj["name"], "arguments": _block_arguments(block, obj)})
    return calls


def _block_arguments(block: str, obj: dict[str, Any]) -> str:
    """The arguments text of a block that :func:`_tool_call_block` wrote (between its head and its last
    ``}``); for any other block (written by another tool: other keys, other spacing), the JSON text of
    its "arguments" value."""
    args = obj["arguments"]
    if not isinstance(obj["name"], str) or isinstance(args, str):
        return _json_text(args)
    head = _BLOCK_HEAD.format(name=json.dumps(obj["name"], ensure_ascii=False))
    if block.startswith(head) and block.endswith("}"):
        text = block[len(head) : -1]
        if _embeds_verbatim(text):  # then it is the whole "arguments" value: no other key follows it
            return text
    return _json_text(args)


def gpt_value(reasoning: str | None, content: str, tool_calls: list[dict[str, Any]]) -> str:
    """A gpt turn as text. The model's words are never rewritten: a turn whose words would not parse
    back as written is discarded instead (see :func:`ambiguous_markup`)."""
    # A turn without reasoning opens with an empty think block, as the reference renders it: every gpt
    # turn has the same shape for a trainer (and the block parses back as no reasoning).
    parts = [f"<think>\n{reasoning}\n</think>" if reasoning else "<think>\n</think>"]
    if content:
        parts.append(content)  # exactly as the model wrote it, its spaces and line breaks too
    parts.extend(_tool_call_block(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls)
    return "\n".join(parts)


def tool_response_block(tool_call_id: str, name: str, content: str) -> str:
    try:
        body: Any = parse_json(content)
    except (ValueError, TypeError):
        body = content
    # A result is held as a JSON value only where that value reads back as the very text the model saw
    # (parse_tool_responses gives it back); else as that text (\u escapes, other spacing, a JSON string).
    if isinstance(body, str) or json.dumps(body, ensure_ascii=False) != content:
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


def reasoning_counts(conversations: list[dict[str, Any]]) -> tuple[int, int]:
    """(gpt turns with reasoning, gpt turns in all) of a ShareGPT conversation."""
    gpt = [c for c in conversations if c.get("from") == "gpt"]
    # A closed, non-empty envelope: words that open <think> and never close it are not reasoning.
    return sum(1 for c in gpt if _has_reasoning(c.get("value", ""))), len(gpt)


_THINK_OPEN_RE = re.compile(r"\s*<think>")
_NON_SPACE_RE = re.compile(r"\S")


def _has_reasoning(value: str) -> bool:
    """Whether ``value`` opens with a closed, non-empty ``<think>`` envelope (what ``_THINK_RE`` matches
    with something besides white space inside), found without copying the reasoning out: every kept
    record's every turn is asked, by the merge and the report."""
    opened = _THINK_OPEN_RE.match(value)
    if opened is None:
        return False
    end = value.find("</think>", opened.end())
    return end >= 0 and _NON_SPACE_RE.search(value, opened.end(), end) is not None


def used_tool_names(record: dict[str, Any]) -> set[str]:
    names = set()
    for c in record.get("conversations", []):
        for call in c.get("tool_calls") or []:
            names.add(call["function"]["name"])
    return names


# ----------------------------------------------------------------------------- reading a record back
# The inverses of the renderers above, for readers of saved records (the exporter).

_TOOL_RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def parse_gpt_value(value: str) -> tuple[str | None, str, list[dict[str, str]]]:
    """Split a gpt ``value`` into (reasoning, the model's words, ``[{"name", "arguments"}]``).

    A value in :func:`gpt_value`'s shape gives back exactly what it was written from, leading and
    trailing whitespace included: the reasoning between ``<think>\n`` and ``\n</think>``, the words
    after the line break that follows, up to the line break before the first call block. Any other
    value (another tool's records) is read loosely, as :func:`split_reasoning` reads a reply.
    """
    exact = _split_envelope(value)
    reasoning, rest = exact if exact is not None else split_reasoning(value)
    first = _TOOL_CALL_RE.search(rest)
    if first is None:
        return reasoning, rest, []
    content = rest[: first.start()]
    return reasoning, content.removesuffix("\n"), parse_tool_calls(rest)


def _split_envelope(value: str) -> tuple[str | None, str] | None:
    """(reasoning, what follows) of a value that opens as :func:`gpt_value` writes it, else None."""
    if value.startswith("<think>\n</think>"):
        reasoning, rest = None, value[len("<think>\n</think>") :]
    elif value.startswith("<think>\n"):
        end = value.find("</think>")  # the first: reasoning holding one is discarded (ambiguous_markup)
        if end == -1 or value[end - 1] != "\n":
            return None
        reasoning, rest = value[len("<think>\n") : end - 1] or None, value[end + len("</think>") :]
    else:
        return None
    if rest and not rest.startswith("\n"):
        return None
    return reasoning, rest[1:]


def parse_tool_responses(value: str) -> list[dict[str, Any]]:
    """The ``<tool_response>`` blocks of a tool entry as ``[{"tool_call_id", "name", "content"}]``.

    ``content`` is the result text the model saw (JSON results as compact JSON text, as tools return them).
    """
    out = []
    for block in _TOOL_RESPONSE_RE.findall(value):
        obj = parse_json(block)
        body = obj["content"]
        out.append(
            {
                "tool_call_id": obj["tool_call_id"],
                "name": obj.get("name", ""),
                "content": _json_text(body),
            }
        )
    return out


def tools_text(system_value: str) -> str | None:
    """The JSON text of the tool list in a system entry's preamble, or None when it has none.

    The preamble comes last, and JSON text holds no raw line break: the last ``<tools>`` and a line
    break are the preamble's, whatever a row's own system prompt before it says (``<tools>`` never
    closed, or a ``<tools>`` block of its own), and the first line break and ``</tools>`` after it close them.
    """
    start = system_value.rfind("<tools>\n")
    if start == -1:
        return None
    start += len("<tools>\n")
    end = system_value.find("\n</tools>", start)
    return None if end == -1 else system_value[start:end]


def offered_tools(system_value: str) -> list[dict[str, Any]]:
    """The tools a system entry offered, as OpenAI tool schemas (``{"type": "function", "function": ...}``)."""
    found = tools_text(system_value)
    if found is None:
        return []
    return [
        {"type": "function", "function": {k: v for k, v in f.items() if not (k == "required" and v is None)}}
        for f in parse_json(found)
    ]


def _json_text(value: Any) -> str:
    """A value a block held as JSON, as the text it stood for (a string stays as it is)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
