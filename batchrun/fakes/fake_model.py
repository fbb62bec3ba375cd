"""A deterministic scripted model behind a small OpenAI-compatible HTTP server.

Used by the tests (the runner's model client and the ``openai`` SDK talk to it over HTTP), by the benchmarks
(a set latency, hundreds of concurrent requests) and for a zero-cost dry run (``--model=mock``).

Server (standard library only)::

    with FakeModelServer(latency_s=0.1) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        ...
        server.stats()  # requests, max_in_flight, in_flight, first_request_at, last_request_at, last_response_at,
                        # status_counts, hangups, tokens, ...

    python -m batchrun.fakes.fake_model --port 8000 --latency 0.1   # prints its base_url, serves until killed

Endpoints: ``POST /v1/chat/completions``, ``GET /v1/models`` (lists ``mock``), ``GET /stats``
(the counters as JSON; status_counts keys become strings there), ``POST /reset``, and for the
image tools ``POST /v1/images/generations`` (see "Images" below).
With ``api_key=...`` the ``/v1/*`` endpoints demand ``Authorization: Bearer <key>`` (else 401).
With ``stream: true`` the same reply comes as server-sent ``chat.completion.chunk`` events (see
:func:`stream_chunks`): content, reasoning and tool-call arguments cut into pieces, the usage in a last
chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``.

The policy (:func:`respond`, a pure function of the request body)
------------------------------------------------------------------
The *prompt* is the last user message before the conversation's first tool call or tool result
(so few-shot prefill messages before the prompt and user messages appended later are not taken
for it); without prefill this is simply the first user message. Turn ``k`` is the number of
assistant messages after the prompt. Tool arguments are built from the offered tools' JSON schemas
(only properties the schema declares; required fields the policy has no value for are filled by
type, strings with the prompt text).

Default plan, by the tools offered (``tool_choice: "none"`` counts as no tools):

* ``terminal``/``write_file``/``read_file``/``search_files`` offered (any of them) -> **3 model calls**:
  turn 0 calls ``terminal`` (``echo <slug> && pwd``) and ``write_file``
  (``notes/answer_<hash8>.txt``) in parallel, whichever are offered (if neither: ``search_files``,
  else ``read_file``); turn 1 reads the file back with ``read_file`` if ``write_file`` is offered,
  else ``search_files``, else ``terminal`` (``ls -la``), else ``read_file``; turn 2 answers.
* only other tools offered -> **2 model calls**: turn 0 calls the first offered tool, turn 1 answers.
* no tools -> **1 model call**: the answer.

The answer (``finish_reason: "stop"``) quotes the first 80 characters of the last tool message, so
a test can see tool results reached the model. A turn past the plan always answers.

By default every assistant message carries the same short reasoning text natively, in both
``message.reasoning_content`` and ``message.reasoning``.

Directives (written anywhere in the prompt text; they combine):

=======================  ==========================================================================
``[no_reasoning]``       no reasoning at all (no native fields, no scratchpad)
``[scratchpad]``         reasoning as ``<REASONING_SCRATCHPAD>...</REASONING_SCRATCHPAD>`` at the start
                         of ``content``, not native
``[reasoning_details]``  reasoning only as ``reasoning_details: [{"type": "reasoning.text", "text"}]``
``[hallucinate]``        an extra first turn calling ``teleport`` (never offered); then the plan (+1 call)
``[bad_json]``           an extra first turn calling the first offered tool (``terminal`` preferred)
                         with arguments that are not valid JSON; then the plan (+1 call; no effect
                         when no tools are offered)
``[calls:N]``            N single-call tool turns cycling through terminal, write_file, read_file,
                         search_files, other tools (whichever offered), then the answer (N+1 calls)
``[loop]``               never answers: every turn calls ``terminal`` (``echo again``) if offered,
                         else the first offered tool, else ``terminal`` anyway
``[truncate]``           every response is partial content with ``finish_reason: "length"``, no calls
``[error:CODE]``         (server) every request answers HTTP CODE (400, 401, 404, 429, 500, any 4xx/5xx)
                         with an OpenAI-style ``{"error": {message, type, code}}`` body
``[quote_auth]``         (server) the error message (with ``[error:CODE]``), else every reply's words,
                         begin with the request's ``Authorization`` header and path (``auth=... url=...``),
                         as a hostile or careless endpoint may quote the credentials it got
``[quote_request]``      (server) with ``[error:CODE]``: the error message quotes the request's
                         ``messages`` as JSON, as some endpoints do on a 400 (system prompt included)
``[retry_after:S]``      (server) with ``[error:429]``: ask for S seconds (``retry-after-ms``) instead of 1 ms
``[flaky:N]``            (server) the first N requests for this prompt text answer 429 with
                         ``Retry-After: 0``, then normal
``[garbage]``            (server) 200 with a body that is not JSON
``[hangup]``             (server) the connection is closed without a response
``[slow:S]``             (server) sleep S seconds before answering (on top of ``latency_s``)
``[empty_answer]``       the final answer's content is empty (reasoning only)
``[literal_tool_call]``  the final answer's words end with a literal ``<tool_call>`` block (never a call)
``[unclosed_think]``     the final answer's words open ``<think>`` and never close it
``[think_in_reasoning]`` every reasoning text holds a literal ``</think>``
``[served_other]``       the response's ``model`` is ``mock-served-other``, not the requested name
``[truncate_call]``      the first response calls ``terminal`` with arguments cut off mid-JSON,
                         ``finish_reason: "length"``
``[run:CMD]``            instead of the default plan, turn 0 calls ``terminal`` with CMD (any text
                         without ``]``; several ``[run:...]`` are several turns, in order), then the
                         answer (quoting the last command's output)
``[answer:TEXT]``        the final answer ends with the line ``ANSWER: TEXT`` (graded runs: a model
                         that answers right or wrong on purpose)
``[answers:A|B|...]``    as ``[answer:...]``, the answer chosen by the request's ``seed`` (seed mod
                         the number of answers; the first without a seed): with ``--seed_per_request``
                         the samples of one row answer differently, reproducibly
``[verdict:TEXT]``       a judge's request (its system message begins "You grade"): the reply's words
                         are TEXT alone (the agent's own requests are answered as usual)
``[finish:VALUE]``       the final answer's ``finish_reason`` is VALUE (``content_filter``, ``error``,
                         ``end_turn``...; ``null`` for none: streamed, no finish chunk before [DONE])
``[cut_stream:N]``       (server) the first N streamed requests for this prompt text end before their
                         finish chunk: no finish_reason, no [DONE] (a stream cut short)
``[plain_body]``         (server) a streamed request is answered with the plain JSON body, as a server
                         that does not stream does
=======================  ==========================================================================

Server-side 429/5xx answers also carry ``retry-after-ms: 1``: the ``openai`` SDK ignores
``Retry-After: 0`` (only delays > 0 count) and would fall back to its 0.5 s, 1 s, 2 s... backoff;
with it the SDK's retries are immediate and tests stay fast. The request's ``reasoning``,
``provider`` and ``max_tokens`` fields do not change the policy; they are kept in
``stats()["last_requests"]`` for inspection.

Images (vision and image generation)
------------------------------------
A request whose last user message holds ``image_url`` parts (vision) is answered as usual, plus a
sentence naming each image: ``I see image 1: image/png 8x6, sha256 <12 hex>.`` (data URLs are
decoded; other URLs are only named). ``POST /v1/images/generations`` (``prompt``, ``size`` "WxH",
``response_format`` b64_json (default) or url) returns one solid-colour PNG of that size whose
colour derives from the prompt (:func:`batchrun.fakes.fake_services.color_for`); with ``url`` it is served
at ``GET /v1/images/files/<name>.png``. ``[error:CODE]`` in the prompt answers HTTP CODE.

Reading the reasoning through the ``openai`` SDK: the response models allow extra fields, so
``msg = completion.choices[0].message`` gives ``msg.reasoning_content``, ``msg.reasoning`` and
``msg.reasoning_details`` by attribute (raw JSON values: ``reasoning_details`` is a list of dicts)
and all of them in ``msg.model_extra``. Fields the response lacks are absent: use
``getattr(msg, "reasoning_content", None)`` or ``(msg.model_extra or {}).get(...)``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MOCK_MODEL = "mock"
NOTES_DIR = "notes"
LAST_REQUESTS_KEPT = 50

# ---------------------------------------------------------------------------------------------
# Directives
# ---------------------------------------------------------------------------------------------

_FLAG_RE = re.compile(
    r"\[(no_reasoning|scratchpad|reasoning_details|hallucinate|bad_json|garbage|hangup|loop|truncate|quote_request|quote_auth"
    r"|empty_answer|literal_tool_call|unclosed_think|think_in_reasoning|served_other|truncate_call|plain_body)\]"
)
_VALUE_RE = re.compile(r"\[(error|flaky|slow|calls|retry_after|cut_stream):\s*([0-9]+(?:\.[0-9]+)?)\]")
# Directives with free text (a command, an answer): anything up to the closing bracket.
_TEXT_RE = re.compile(r"\[(run|answers|answer|finish|verdict):([^\]]*)\]")
_ANY_DIRECTIVE_RE = re.compile(_FLAG_RE.pattern + "|" + _VALUE_RE.pattern + "|" + _TEXT_RE.pattern)


@dataclass(frozen=True)
class Directives:
    no_reasoning: bool = False
    scratchpad: bool = False
    reasoning_details: bool = False
    hallucinate: bool = False
    bad_json: bool = False
    garbage: bool = False
    hangup: bool = False
    loop: bool = False
    truncate: bool = False
    quote_request: bool = False
    quote_auth: bool = False
    empty_answer: bool = False
    literal_tool_call: bool = False
    unclosed_think: bool = False
    think_in_reasoning: bool = False
    served_other: bool = False
    truncate_call: bool = False
    plain_body: bool = False
    error: int | None = None
    retry_after: float | None = None
    flaky: int = 0
    slow: float = 0.0
    calls: int | None = None
    cut_stream: int = 0
    run: tuple[str, ...] = ()  # [run:CMD]: terminal commands, one turn each
    answer: str | None = None  # [answer:TEXT]
    answers: tuple[str, ...] = ()  # [answers:A|B]: one by the request's seed
    finish: str | None = None  # [finish:VALUE]: the final answer's finish_reason ("null": none)
    verdict: str | None = None  # [verdict:TEXT]: a judge's reply


def parse_directives(prompt: str) -> Directives:
    """The directives written in ``prompt`` (see the module docstring)."""
    flags = {m.group(1): True for m in _FLAG_RE.finditer(prompt)}
    values: dict[str, Any] = {}
    for m in _VALUE_RE.finditer(prompt):
        name, raw = m.group(1), m.group(2)
        if name in ("slow", "retry_after"):
            values[name] = float(raw)
        else:
            values[name] = int(float(raw))
    if "error" in values and not 400 <= values["error"] <= 599:
        del values["error"]
    texts = [(m.group(1), m.group(2).strip()) for m in _TEXT_RE.finditer(prompt)]
    values["run"] = tuple(text for name, text in texts if name == "run" and text)
    answers = [text for name, text in texts if name == "answer"]
    if answers:
        values["answer"] = answers[-1]
    verdicts = [text for name, text in texts if name == "verdict"]
    if verdicts:
        values["verdict"] = verdicts[-1]
    finishes = [text for name, text in texts if name == "finish" and text]
    if finishes:
        values["finish"] = finishes[-1]
    choices = [text for name, text in texts if name == "answers"]
    if choices:
        values["answers"] = tuple(a.strip() for a in choices[-1].split("|"))
    return Directives(**flags, **values)


# ---------------------------------------------------------------------------------------------
# Reading the request
# ---------------------------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def find_prompt(messages: list[dict[str, Any]]) -> tuple[int, str]:
    """(index, text) of the prompt: the last user message before the first tool call/result.

    Returns (-1, "") when there is no user message.
    """
    end = len(messages)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            continue
        if msg.get("role") == "tool" or (msg.get("role") == "assistant" and msg.get("tool_calls")):
            end = i
            break
    for i in range(end - 1, -1, -1):
        msg = messages[i]
        if isinstance(msg, dict) and msg.get("role") == "user":
            return i, _text_of(msg.get("content"))
    return -1, ""


def _offered_tools(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Offered tool name -> its parameters JSON schema, in the order offered."""
    if body.get("tool_choice") == "none":
        return {}
    offered: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if isinstance(name, str) and name:
            params = fn.get("parameters")
            offered[name] = params if isinstance(params, dict) else {}
    return offered


def estimate_tokens(text: str) -> int:
    return len(text) // 4 + 1


# ---------------------------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------------------------

_ALIASES = {
    "command": ("command", "cmd"),
    "path": ("path", "file_path", "filepath", "filename", "file"),
    "content": ("content", "text", "contents", "data"),
    "pattern": ("pattern", "query", "regex", "search"),
}
FAMILY = ("terminal", "write_file", "read_file", "search_files")


def _build_args(schema: dict[str, Any], wanted: dict[str, Any], prompt: str) -> dict[str, Any]:
    """Arguments fitting ``schema``: the wanted values under the names the schema uses, plus
    required properties filled by type. Without declared properties, ``wanted`` as given."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if not props:
        return dict(wanted)
    args: dict[str, Any] = {}
    for key, value in wanted.items():
        for alias in _ALIASES.get(key, (key,)):
            if alias in props:
                args[alias] = value
                break
    for name in schema.get("required") or []:
        if name in args or not isinstance(name, str):
            continue
        spec = props.get(name) if isinstance(props.get(name), dict) else {}
        if spec.get("enum"):
            args[name] = spec["enum"][0]
            continue
        kind = spec.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        args[name] = {
            "integer": 1,
            "number": 1,
            "boolean": False,
            "array": [],
            "object": {},
        }.get(kind, prompt[:200])
    return args


class _Script:
    """Everything the policy derives from one request."""

    def __init__(self, body: dict[str, Any]):
        self.body = body
        messages = body.get("messages") or []
        self.messages = [m for m in messages if isinstance(m, dict)]
        idx, self.prompt = find_prompt(self.messages)
        after = self.messages[idx + 1 :] if idx >= 0 else self.messages
        self.turn = sum(1 for m in after if m.get("role") == "assistant")
        tool_msgs = [m for m in after if m.get("role") == "tool"]
        self.last_tool = _text_of(tool_msgs[-1].get("content")) if tool_msgs else None
        self.d = parse_directives(self.prompt)
        self.offered = _offered_tools(body)
        clean = _ANY_DIRECTIVE_RE.sub(" ", self.prompt)
        words = re.findall(r"[a-z0-9]+", clean.lower())
        self.slug = "-".join(words[:4])[:40].strip("-") or "prompt"
        self.hash8 = hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()[:8]
        self.notes_path = f"{NOTES_DIR}/answer_{self.hash8}.txt"
        self.short_prompt = " ".join(clean.split())[:60]

    # -- calls -----------------------------------------------------------------------------

    def call(self, name: str, wanted: dict[str, Any]) -> tuple[str, str]:
        schema = self.offered.get(name, {})
        return name, json.dumps(_build_args(schema, wanted, self.prompt), ensure_ascii=False)

    def terminal(self, command: str) -> tuple[str, str]:
        return self.call("terminal", {"command": command})

    def write_file(self) -> tuple[str, str]:
        text = f"Notes for: {self.short_prompt}\nslug: {self.slug}\n"
        return self.call("write_file", {"path": self.notes_path, "content": text})

    def read_file(self) -> tuple[str, str]:
        return self.call("read_file", {"path": self.notes_path})

    def search_files(self) -> tuple[str, str]:
        return self.call("search_files", {"pattern": self.slug, "path": "."})

    def other(self, name: str) -> tuple[str, str]:
        return self.call(name, {})

    # -- plans -----------------------------------------------------------------------------

    def default_plan(self) -> list[list[tuple[str, str]]]:
        has = self.offered.__contains__
        if any(has(n) for n in FAMILY):
            t0 = []
            if has("terminal"):
                t0.append(self.terminal(f"echo {self.slug} && pwd"))
            if has("write_file"):
                t0.append(self.write_file())
            if not t0:
                t0.append(self.search_files() if has("search_files") else self.read_file())
            if has("read_file") and has("write_file"):
                t1 = self.read_file()
            elif has("search_files"):
                t1 = self.search_files()
            elif has("terminal"):
                t1 = self.terminal("ls -la")
            else:
                t1 = self.read_file()
            return [t0, [t1]]
        if self.offered:
            return [[self.other(next(iter(self.offered)))]]
        return []

    def calls_plan(self, n: int) -> list[list[tuple[str, str]]]:
        cycle: list[Any] = []
        if "terminal" in self.offered:
            cycle.append("terminal")
        for name, make in (
            ("write_file", self.write_file),
            ("read_file", self.read_file),
            ("search_files", self.search_files),
        ):
            if name in self.offered:
                cycle.append(make)
        cycle += [name for name in self.offered if name not in FAMILY]
        if not cycle:
            return []
        plan = []
        for i in range(n):
            item = cycle[i % len(cycle)]
            if item == "terminal":
                plan.append([self.terminal(f"echo step {i + 1} of {n}")])
            elif callable(item):
                plan.append([item()])
            else:
                plan.append([self.other(item)])
        return plan

    def plan(self) -> list[list[tuple[str, str]]]:
        prefix: list[list[tuple[str, str]]] = []
        if self.d.hallucinate:
            prefix.append([("teleport", json.dumps({"destination": self.slug}))])
        if self.d.bad_json and self.offered:
            name = "terminal" if "terminal" in self.offered else next(iter(self.offered))
            _, args = self.terminal("ls") if name == "terminal" else self.other(name)
            prefix.append([(name, args[:-1])])  # drop the closing brace: not valid JSON
        if self.d.run:
            body = [[self.terminal(command)] for command in self.d.run]
        elif self.d.calls is not None:
            body = self.calls_plan(self.d.calls)
        else:
            body = self.default_plan()
        return prefix + body

    def loop_call(self) -> tuple[str, str]:
        if "terminal" in self.offered or not self.offered:
            return self.terminal("echo again")
        return self.other(next(iter(self.offered)))

    # -- the answer ------------------------------------------------------------------------

    def judging(self) -> bool:
        """Whether this is a judge's request (batchrun.scoring.JUDGE_SYSTEM), not the agent's."""
        return any(
            m.get("role") == "system" and _text_of(m.get("content")).startswith("You grade")
            for m in self.messages
        )

    def reasoning_text(self, action: str) -> str:
        return f'The user asks: "{self.short_prompt}". Turn {self.turn}: I will {action}.'

    def message(self) -> tuple[dict[str, Any], str]:
        """(assistant message, finish_reason) for this turn."""
        calls: list[tuple[str, str]] = []
        if self.d.truncate:
            action, content, finish = "answer at length", "This answer is cut off in the mid", "length"
        elif self.d.truncate_call:
            calls = [("terminal", '{"command": "echo a very long comm')]
            action, content, finish = "call terminal at length", "Let me use terminal.", "length"
        else:
            if self.d.loop:
                calls = [self.loop_call()]
            else:
                plan = self.plan()
                calls = plan[self.turn] if self.turn < len(plan) else []
            if calls:
                names = ", ".join(name for name, _ in calls)
                action, content, finish = f"call {names}", f"Let me use {names}.", "tool_calls"
            else:
                content = f"Final answer for '{self.slug}'."
                if self.last_tool is not None:
                    quoted = " ".join(self.last_tool.split())[:80]
                    content += f" The last tool result said: {quoted}"
                seen = _describe_images(self.messages)
                if seen:
                    content += f" {seen}"
                if self.d.literal_tool_call:
                    content += '\nA call looks like\n<tool_call>\n{"name": "terminal", "arguments": {}}\n</tool_call>'
                if self.d.unclosed_think:
                    content = f"<think>{content}"
                if self.d.answer is not None:
                    content += f"\nANSWER: {self.d.answer}"
                elif self.d.answers:
                    seed = self.body.get("seed")
                    pick = (
                        seed % len(self.d.answers)
                        if isinstance(seed, int) and not isinstance(seed, bool)
                        else 0
                    )
                    content += f"\nANSWER: {self.d.answers[pick]}"
                if self.d.empty_answer:
                    content = ""
                if self.d.verdict is not None and self.judging():
                    content = self.d.verdict
                action, finish = "give the final answer", "stop"
                if self.d.finish is not None:
                    finish = None if self.d.finish == "null" else self.d.finish
        reasoning = self.reasoning_text(action)
        if self.d.think_in_reasoning:
            reasoning += " Then </think> appears inside the reasoning."
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.d.no_reasoning:
            pass
        elif self.d.scratchpad:
            msg["content"] = f"<REASONING_SCRATCHPAD>{reasoning}</REASONING_SCRATCHPAD>\n{content}"
        elif self.d.reasoning_details:
            msg["reasoning_details"] = [{"type": "reasoning.text", "text": reasoning}]
        else:
            msg["reasoning_content"] = reasoning
            msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = [
                {
                    "id": f"call_{self.hash8}_{self.turn}_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                for i, (name, args) in enumerate(calls)
            ]
        return msg, finish


def _prompt_token_text(body: dict[str, Any]) -> str:
    parts = []
    for msg in body.get("messages") or []:
        if isinstance(msg, dict):
            parts.append(_text_of(msg.get("content")))
            for call in msg.get("tool_calls") or []:
                if isinstance(call, dict):
                    parts.append(json.dumps(call.get("function"), ensure_ascii=False))
    if body.get("tools"):
        parts.append(json.dumps(body["tools"], ensure_ascii=False))
    return "\n".join(parts)


def respond(request_body: dict[str, Any]) -> dict[str, Any]:
    """The chat.completion the scripted model gives for ``request_body`` (deterministic).

    Server-side directives (error, flaky, garbage, hangup, slow) are not handled here.
    """
    script = _Script(request_body)
    msg, finish = script.message()
    completion_text = "\n".join(
        [msg.get("content") or "", msg.get("reasoning_content") or ""]
        + [d["text"] for d in msg.get("reasoning_details", [])]
        + [c["function"]["name"] + c["function"]["arguments"] for c in msg.get("tool_calls", [])]
    )
    prompt_tokens = estimate_tokens(_prompt_token_text(request_body))
    completion_tokens = estimate_tokens(completion_text)
    digest = hashlib.sha256(
        json.dumps(request_body.get("messages"), sort_keys=True, default=str).encode("utf-8")
    ).hexdigest()[:24]
    return {
        "id": f"chatcmpl-mock-{digest}",
        "object": "chat.completion",
        "created": 0,  # the server stamps the current time
        "model": "mock-served-other" if script.d.served_other else request_body.get("model") or MOCK_MODEL,
        "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def cache_details(body: dict[str, Any], usage: dict[str, Any]) -> dict[str, int]:
    """A prompt cache's counts for a request (``--prompt-cache``): the tools and every message but the
    last were sent before, in this conversation's call before (or, in its first call, by another prompt)."""
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    prefix = {"messages": messages[:-1], "tools": body.get("tools")}
    seen = estimate_tokens(_prompt_token_text(prefix)) if len(messages) > 1 else 0
    cached = min(seen, usage["prompt_tokens"])
    return {"cached_tokens": cached, "cache_write_tokens": usage["prompt_tokens"] - cached}


def anthropic_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """``usage`` as Anthropic counts it: ``input_tokens`` are the prompt's tokens neither read from the
    cache nor written to it, ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` the rest."""
    details = (
        usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    )
    read, written = details.get("cached_tokens", 0), details.get("cache_write_tokens", 0)
    out = {
        "input_tokens": usage["prompt_tokens"] - read - written,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": written,
    }
    return {**out, **({"cost": usage["cost"]} if "cost" in usage else {})}


def _pieces(text: str, n: int = 3) -> list[str]:
    """``text`` cut into up to ``n`` pieces, so a client must join deltas to get it back."""
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)]


def stream_chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A chat.completion as the chat.completion.chunk events a streaming server sends for it."""
    choice = completion["choices"][0]
    msg = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model") if k in completion}
    head["object"] = "chat.completion.chunk"
    if "provider" in completion:
        head["provider"] = completion["provider"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    for key in ("reasoning_content", "reasoning"):
        for piece in _pieces(msg.get(key) or ""):
            out.append(chunk({key: piece}))
    for d in msg.get("reasoning_details") or []:
        for piece in _pieces(d.get("text") or ""):
            out.append(chunk({"reasoning_details": [{**d, "text": piece}]}))
    for piece in _pieces(msg.get("content") or ""):
        out.append(chunk({"content": piece}))
    for i, call in enumerate(msg.get("tool_calls") or []):
        fn = call["function"]
        first = {
            "index": i,
            "id": call["id"],
            "type": "function",
            "function": {"name": fn["name"], "arguments": ""},
        }
        out.append(chunk({"tool_calls": [first]}))
        for piece in _pieces(fn["arguments"]):
            out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
    out.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": completion["usage"]})
    return out


# ---------------------------------------------------------------------------------------------
# HTTP server
# ---------------------------------------------------------------------------------------------

_ERROR_KINDS = {
    400: ("invalid_request_error", "invalid_request", "Bad request (mock)"),
    401: ("authentication_error", "invalid_api_key", "Invalid or missing API key (mock)"),
    402: ("insufficient_quota", "insufficient_quota", "Insufficient credits (mock)"),
    403: ("permission_error", "forbidden", "Forbidden (mock)"),
    404: ("not_found_error", "model_not_found", "The model does not exist (mock)"),
    429: ("rate_limit_error", "rate_limit_exceeded", "Rate limit reached (mock)"),
}


def error_body(status: int, message: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body for ``status``."""
    kind, code, default = _ERROR_KINDS.get(
        status,
        ("server_error", "server_error", "Internal server error (mock)")
        if status >= 500
        else ("invalid_request_error", str(status), f"HTTP {status} (mock)"),
    )
    return {"error": {"message": message or default, "type": kind, "code": code, "param": None}}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() must not wait for idle keep-alive connections
    request_queue_size = 1024
    allow_reuse_address = True
    fake: FakeModelServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout)):
            return  # the client went away; nothing to report
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out as separate writes; with Nagle on, the body waits for the client's
    # delayed ACK (~40 ms a request). Real servers (uvicorn, vLLM) set TCP_NODELAY too.
    disable_nagle_algorithm = True
    server_version = "FakeModel/1.0"
    timeout = 120  # an idle keep-alive connection is closed after this many seconds
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        if self.server.fake.verbose:
            super().log_message(format, *args)

    # -- helpers ---------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, payload: bytes, content_type: str, headers: dict[str, str] | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        # Headers and body in one write: one segment, so the client reads the answer in one recv
        # (end_headers() would send the headers on their own first).
        self._headers_buffer.append(b"\r\n")
        head, self._headers_buffer = b"".join(self._headers_buffer), []
        self.wfile.write(head + payload)
        self.wfile.flush()

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode("utf-8"), "application/json", headers)

    def _error(self, status: int, message: str | None = None) -> None:
        headers = {"retry-after-ms": "1"} if status == 429 or status >= 500 else None
        self._json(status, error_body(status, message), headers)

    def _authorized(self) -> bool:
        key = self.server.fake.api_key
        return key is None or self.headers.get("Authorization", "") == f"Bearer {key}"

    def _unauthorized(self) -> None:
        """401; with ``quote_auth`` its message quotes the credentials it got, as some proxies do."""
        quoted = f": {self._credentials_seen()}" if self.server.fake.quote_auth else ""
        self._error(401, f"{_ERROR_KINDS[401][2]}{quoted}" if quoted else None)

    def _credentials_seen(self) -> str:
        """What an endpoint that quotes its request's credentials says ([quote_auth], ``quote_auth``)."""
        return f"auth={self.headers.get('Authorization', '')} url={self.path}"

    # -- routes ----------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/stats":
            self._json(200, self.server.fake.stats())
        elif path in ("/v1/models", "/models"):
            if not self._authorized() and not self.server.fake.quote_auth:  # such a gateway lists to anyone
                self._unauthorized()
                return
            model = {"id": MOCK_MODEL, "object": "model", "created": 0, "owned_by": "fake_model"}
            self._json(200, {"object": "list", "data": [model]})
        elif path.startswith(("/v1/images/files/", "/images/files/")):
            self._image_file(path.rsplit("/", 1)[-1])
        else:
            self._error(404, f"Unknown path {path!r} (mock)")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        raw = self._read_body()
        if path == "/reset":
            self.server.fake.reset_stats()
            self._json(200, {"ok": True})
        elif path.removeprefix("/v1") == "/chat/completions" and self.headers.get("X-Batch-Runner-Check"):
            # The runner's start check (one minimal chat call): answered like any, but counted apart
            # (``check_calls``, ``check_tokens``), so the other counters show the prompts' own calls.
            if not self._authorized():
                self._unauthorized()
                return
            try:
                completion = respond(json.loads(raw.decode("utf-8")))
                if self.server.fake.cost_per_token > 0 or self.server.fake.free:  # priced like every answer
                    usage = completion["usage"]  # (--budget_usd checks it)
                    usage["cost"] = round(usage["total_tokens"] * self.server.fake.cost_per_token, 10)
                self.server.fake._count_check(completion["usage"]["total_tokens"])
                self._json(200, completion)
            except (ValueError, TypeError, AttributeError) as exc:
                self._error(400, f"Bad start check request: {exc}")
        elif path.removeprefix("/v1") in ("/chat/completions", "/images/generations"):
            handle = self._chat if path.endswith("/chat/completions") else self._images
            fake = self.server.fake
            fake._enter()  # counted in flight while it is answered
            try:
                handle(raw)
            finally:
                fake._leave()
        else:
            self._error(404, f"Unknown path {path!r} (mock)")

    def _chat(self, raw: bytes) -> None:
        fake = self.server.fake
        if fake.latency_s > 0:
            time.sleep(fake.latency_s)
        if not self._authorized():
            fake._count(401)
            self._unauthorized()
            return
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            fake._count(400)
            self._error(400, f"Request body is not valid JSON: {exc}")
            return
        if not isinstance(body, dict):
            fake._count(400)
            self._error(400, "Request body must be a JSON object")
            return
        fake._record_request(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            fake._count(400)
            self._error(400, "'messages' must be a non-empty array")
            return
        _, prompt = find_prompt([m for m in messages if isinstance(m, dict)])
        seen = fake._count_prompt(prompt)
        d = parse_directives(prompt)
        if d.slow > 0:
            time.sleep(d.slow)
        if d.hangup:
            fake._count_hangup()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if d.error is not None:
            fake._count(d.error)
            message = f"Scripted error {d.error} (mock directive [error:{d.error}])"
            if d.quote_request:
                message = f"Invalid request: {json.dumps(messages)}"
            if d.quote_auth:
                message = f"{self._credentials_seen()} {message}"
            if d.error == 429 and d.retry_after is not None:
                ms = str(int(d.retry_after * 1000))
                self._json(429, error_body(429, message), {"retry-after-ms": ms})
                return
            self._error(d.error, message)
            return
        if seen < d.flaky:
            fake._count(429)
            self._json(
                429,
                error_body(429, f"Scripted rate limit {seen + 1} of {d.flaky} (mock directive [flaky])"),
                {"Retry-After": "0", "retry-after-ms": "1"},
            )
            return
        if fake._scheduled_rate_limit():
            fake._count(429)
            self._json(429, error_body(429, "Rate limited (rate_limit_every)"), {"retry-after-ms": "50"})
            return
        if d.garbage:
            fake._count(200)
            self._send(200, b"<html>this is not JSON {{{", "application/json")
            return
        completion = respond(body)
        completion["created"] = int(time.time())
        if d.quote_auth:
            message = completion["choices"][0]["message"]
            message["content"] = f"{self._credentials_seen()}\n{message.get('content') or ''}"
        if fake.cost_per_token > 0:
            usage = completion["usage"]
            usage["cost"] = round(usage["total_tokens"] * fake.cost_per_token, 10)
            completion["provider"] = "MockProvider"
        elif fake.free:
            completion["usage"]["cost"] = 0.0
        if fake.prompt_tokens_details is not None:
            completion["usage"]["prompt_tokens_details"] = fake.prompt_tokens_details
        elif fake.prompt_cache:
            completion["usage"]["prompt_tokens_details"] = cache_details(body, completion["usage"])
        fake._count(200, completion["usage"])
        if fake.anthropic_usage:
            completion["usage"] = anthropic_usage(completion["usage"])
        if body.get("stream") and not d.plain_body:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = stream_chunks(completion, include_usage)
            end = b"data: [DONE]\n\n"
            if seen < d.cut_stream:  # what came before the finish chunk, then the body ends
                chunks = [c for c in chunks if c["choices"] and not c["choices"][0]["finish_reason"]]
                end = b""
            events = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
            self._send(200, events + end, "text/event-stream")
            return
        self._json(200, completion)

    # -- images (vision answers are in the policy; see "Images" in the module docstring) ----

    def _images(self, raw: bytes) -> None:
        import base64

        from batchrun.fakes.fake_services import color_for, make_png

        fake = self.server.fake
        if not self._authorized():
            fake._count(401)
            self._unauthorized()
            return
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str) or not body["prompt"]:
            fake._count(400)
            self._error(400, "'prompt' must be a non-empty string")
            return
        fake._record_request(body)
        d = parse_directives(body["prompt"])
        if d.error is not None:
            fake._count(d.error)
            self._error(d.error, f"Scripted error {d.error} (mock directive [error:{d.error}])")
            return
        m = re.fullmatch(r"(\d{1,4})x(\d{1,4})", str(body.get("size") or "1024x1024"))
        if m is None or not (0 < int(m.group(1)) <= 4096 and 0 < int(m.group(2)) <= 4096):
            fake._count(400)
            self._error(400, f"Unsupported size {body.get('size')!r} (mock)")
            return
        png = make_png(int(m.group(1)), int(m.group(2)), color_for(body["prompt"]))
        item: dict[str, Any] = {"revised_prompt": body["prompt"]}
        if body.get("response_format") == "url":
            name = hashlib.sha256(png).hexdigest()[:16] + ".png"
            fake._store_image(name, png)
            host, port = self.server.server_address[:2]
            item["url"] = f"http://{host}:{port}/v1/images/files/{name}"
        else:
            item["b64_json"] = base64.b64encode(png).decode("ascii")
        fake._count(200)
        self._json(200, {"created": int(time.time()), "data": [item]})

    def _image_file(self, name: str) -> None:
        png = self.server.fake._images.get(name)
        if png is None:
            self._error(404, f"No image {name!r} (mock)")
        else:
            self._send(200, png, "image/png")


def _describe_images(messages: list[dict[str, Any]]) -> str | None:
    from batchrun.fakes.fake_services import describe_images

    return describe_images(messages)


class FakeModelServer:
    """The scripted model served over HTTP on a daemon thread. See the module docstring."""

    def __init__(
        self,
        latency_s: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        verbose: bool = False,
        cost_per_token: float = 0.0,
        rate_limit_every: int = 0,
        ssl_context: Any = None,
        free: bool = False,
        quote_auth: bool = False,
        prompt_cache: bool = False,
        prompt_tokens_details: Any = None,
        anthropic_usage: bool = False,
    ):
        """``cost_per_token`` > 0: answers carry OpenRouter-style ``usage.cost`` and ``provider``;
        ``free``: answers carry ``usage.cost`` 0 (``--model=mock`` under ``--budget_usd``: a free dry run);
        ``rate_limit_every`` = N > 0: every Nth chat request answers 429 (retry-after-ms: 50);
        ``ssl_context`` (a server-side ``ssl.SSLContext``): serve HTTPS (``base_url`` says https);
        ``quote_auth``: a chat request without the right ``api_key`` is refused (401) quoting the
        Authorization header it got, as some gateways do; the model listing then answers anyone;
        ``prompt_cache``: usage says, OpenAI/OpenRouter-style, the prompt tokens served from a prompt cache
        (``prompt_tokens_details.cached_tokens``: those of every message but the last, which a provider
        saw in the call before) and written to it (``cache_write_tokens``: the rest);
        ``prompt_tokens_details``: instead, that value as it is (any JSON: a hostile endpoint's);
        ``anthropic_usage``: usage in Anthropic's names and convention (:func:`anthropic_usage`)."""
        self.anthropic_usage = anthropic_usage
        self.quote_auth = quote_auth
        self.prompt_cache = prompt_cache
        self.prompt_tokens_details = prompt_tokens_details
        self.cost_per_token = float(cost_per_token)
        self.free = free
        self.rate_limit_every = int(rate_limit_every)
        self.latency_s = float(latency_s)
        self.host = host
        self.port = port
        self.api_key = api_key
        self.verbose = verbose
        self.ssl_context = ssl_context
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._in_flight = 0
        self._images: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # served by URL
        self.reset_stats()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeModelServer:
        if self._httpd is not None:
            return self
        httpd = _HTTPServer((self.host, self.port), _Handler)
        httpd.fake = self
        if self.ssl_context is not None:
            httpd.socket = self.ssl_context.wrap_socket(httpd.socket, server_side=True)
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="fake-model", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeModelServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("FakeModelServer is not started")
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}/v1"

    def serve_forever(self) -> None:
        """Serve on the calling thread until interrupted (the module entry point)."""
        self.start()
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(timeout=0.5)
        finally:
            self.stop()

    # -- statistics ------------------------------------------------------------------------

    def reset_stats(self) -> None:
        with self._lock:
            self._requests = 0
            self._max_in_flight = self._in_flight
            self._first_request_at: float | None = None  # wall clock (time.time), for other processes
            self._last_response_at: float | None = None
            self._last_request_at: float | None = None
            self._status_counts: collections.Counter[int] = collections.Counter()
            self._hangups = 0
            self._prompt_tokens = 0
            self._completion_tokens = 0
            self._cost_usd = 0.0
            self._cached_tokens = 0  # prompt_tokens_details.cached_tokens reported (whole numbers of them)
            self._check_calls = self._check_tokens = 0  # start checks and probes (X-Batch-Runner-Check)
            self._chat_requests = 0
            self._by_prompt: collections.Counter[str] = collections.Counter()
            self._last_requests: collections.deque[dict[str, Any]] = collections.deque(
                maxlen=LAST_REQUESTS_KEPT
            )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self._requests,
                "in_flight": self._in_flight,
                "max_in_flight": self._max_in_flight,
                "first_request_at": self._first_request_at,
                "last_response_at": self._last_response_at,
                "last_request_at": self._last_request_at,
                "status_counts": dict(self._status_counts),
                "hangups": self._hangups,
                "prompt_tokens": self._prompt_tokens,
                "cached_tokens": self._cached_tokens,
                "completion_tokens": self._completion_tokens,
                "cost_usd": round(self._cost_usd, 10),
                "check_calls": self._check_calls,
                "check_tokens": self._check_tokens,
                "requests_by_prompt": dict(self._by_prompt),
                "last_requests": list(self._last_requests),
            }

    def _enter(self) -> None:
        now = time.time()
        with self._lock:
            if self._first_request_at is None:
                self._first_request_at = now
            self._last_request_at = now
            self._requests += 1
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)

    def _leave(self) -> None:
        now = time.time()
        with self._lock:
            self._in_flight -= 1
            self._last_response_at = now

    def _count(self, status: int, usage: dict[str, int] | None = None) -> None:
        with self._lock:
            self._status_counts[status] += 1
            if usage:
                self._prompt_tokens += usage["prompt_tokens"]
                self._completion_tokens += usage["completion_tokens"]
                self._cost_usd += usage.get("cost", 0.0)
                details = usage.get("prompt_tokens_details")
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
                if isinstance(cached, int) and not isinstance(cached, bool):
                    self._cached_tokens += cached

    def _count_check(self, tokens: int) -> None:
        with self._lock:
            self._check_calls += 1
            self._check_tokens += tokens

    def _scheduled_rate_limit(self) -> bool:
        if self.rate_limit_every <= 0:
            return False
        with self._lock:
            self._chat_requests += 1
            return self._chat_requests % self.rate_limit_every == 0

    def _count_hangup(self) -> None:
        with self._lock:
            self._hangups += 1

    def _count_prompt(self, prompt: str) -> int:
        """Count a request for ``prompt``; return how many came before it."""
        with self._lock:
            seen = self._by_prompt[prompt]
            self._by_prompt[prompt] = seen + 1
            return seen

    def _store_image(self, name: str, png: bytes) -> None:
        with self._lock:
            self._images[name] = png
            while len(self._images) > 100:
                self._images.popitem(last=False)

    def _record_request(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._last_requests.append(body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.fakes.fake_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds slept per request")
    parser.add_argument("--api-key", default=None, help="if set, demand 'Authorization: Bearer <key>'")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    parser.add_argument("--cost-per-token", type=float, default=0.0, help="report usage.cost (dollars/token)")
    parser.add_argument("--rate-limit-every", type=int, default=0, help="answer 429 to every Nth request")
    parser.add_argument(
        "--prompt-cache", action="store_true", help="report prompt_tokens_details.cached_tokens"
    )
    args = parser.parse_args(argv)
    server = FakeModelServer(
        latency_s=args.latency,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        verbose=args.verbose,
        cost_per_token=args.cost_per_token,
        rate_limit_every=args.rate_limit_every,
        prompt_cache=args.prompt_cache,
    )
    server.start()
    print(server.base_url, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
