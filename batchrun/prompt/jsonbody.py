"""A model request's JSON body, each message of a conversation encoded once.

A prompt's conversation grows by a few messages a turn and is sent whole every turn, with the same
tool schemas each time: encoding the whole body afresh made each call re-encode everything before
it. :class:`RequestEncoder` keeps the bytes of what it has encoded (the messages and the tools list
it was given, by identity) and joins them; the result is byte for byte what ``json.dumps`` of the
whole body gives (compact, UTF-8, no NaN), except that text holding a lone surrogate (which UTF-8
cannot carry) is sent with that character as a ``\\udXXX`` escape, so the endpoint reads the very
same string, instead of failing the call.

The stdlib ``json`` is used, not ``orjson``: with the cache only the new messages of each turn are
encoded (a few µs each; see benchmarks/README.md), and ``orjson`` writes NaN as ``null`` where the
request must refuse it, and refuses lone surrogates and integers past 64 bits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_COMPACT = {"separators": (",", ":"), "allow_nan": False}


def encode_json(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON; ``ValueError`` for NaN or infinity (never sent)."""
    try:
        return json.dumps(value, ensure_ascii=False, **_COMPACT).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escaped, so the same string arrives
        return json.dumps(value, ensure_ascii=True, **_COMPACT).encode("ascii")


class RequestEncoder:
    """The request bodies of one conversation, whose messages are never changed once sent (they are
    recognised by identity: a message changed in place would be sent as it was first encoded).
    One per conversation, used by one thread at a time."""

    def __init__(self) -> None:
        self._messages: list[tuple[Any, bytes]] = []
        self._tools: tuple[Any, bytes] | None = None

    def encode(self, body: dict[str, Any]) -> bytes:
        """``body`` as :func:`encode_json` gives it; its ``messages`` and ``tools`` from the cache."""
        parts = []
        for key, value in body.items():
            if key == "messages" and isinstance(value, list):
                encoded = self._encode_messages(value)
            elif key == "tools" and isinstance(value, list):
                encoded = self._encode_tools(value)
            else:
                encoded = encode_json(value)
            parts.append(encode_json(key) + b":" + encoded)
        return b"{" + b",".join(parts) + b"}"

    def _encode_messages(self, messages: Sequence[Any]) -> bytes:
        known = self._messages
        pieces = [
            known[i][1] if i < len(known) and known[i][0] is message else encode_json(message)
            for i, message in enumerate(messages)
        ]
        self._messages = list(zip(messages, pieces, strict=True))
        return b"[" + b",".join(pieces) + b"]"

    def _encode_tools(self, tools: list[Any]) -> bytes:
        if self._tools is None or self._tools[0] is not tools:
            self._tools = (tools, encode_json(tools))
        return self._tools[1]
