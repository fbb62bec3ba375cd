"""Secrets never reach a file or a stream, and a kept sample is never rewritten.

:class:`Redactor` knows two kinds of text:

* **secrets**: the run's API key, tool-provider keys and other secret-looking environment values,
  MCP servers' env and header values, and the credentials a URL carries (:func:`url_secrets`: its
  password, its query's keys and tokens) in the flags and in the environment (proxies, tools' URLs).
  A secret written as an ``Authorization`` value (``Bearer <token>``, ``Basic <base64>``) counts with
  its credential alone too: a server that refuses it quotes the token, not the header. They are replaced wherever they appear in side files, logs and
  messages, in every form they may take there: as written, JSON-escaped (once or twice), URL-quoted,
  base64-encoded (at any byte alignment, standard and URL-safe alphabets, across the line breaks of
  wrapped output) and in any letter case.
  A sample whose own text holds one is not kept: :meth:`Redactor.finds_secret` tells the recorder,
  which discards it as ``secret_in_output`` (redacted in ``discarded.jsonl``).
* **scaffolding**: the ephemeral system prompt and the prefill contents. They are not secrets and are
  never saved as messages; an endpoint's error that quotes the request is redacted of them in side
  files (``__call__``), but the model's own words are never changed for resembling them
  (:meth:`Redactor.sample` redacts secrets only).

A secret-named variable whose value is too short or too ordinary to be a secret (a word, a number,
an identifier such as a tool name) is not used as a pattern: it would redact ordinary words
everywhere. :attr:`Redactor.ignored` names those variables for the start line.
"""

from __future__ import annotations

import base64
import bisect
import json
import os
import re
import string
import urllib.parse

from batchrun.prompt.llm import NO_KEY

# Environment variables whose values are secrets wherever they turn up (tool-provider keys and the like).
SECRET_NAME = re.compile(r"(_KEY|_TOKEN|_SECRET|PASSWORD|_PASS)$|^(API_KEY|TOKEN|SECRET)$", re.IGNORECASE)

MIN_SECRET_CHARS = 8  # shorter values would redact ordinary words everywhere
MIN_SCAFFOLD_CHARS = 8  # a prefill "ok" is no pattern either
# Values that are words, numbers, identifiers or plain paths: what a variable holds when it is a
# setting, not a credential ("changeme" aside, a real key has digits or mixed symbols).
ORDINARY = re.compile(
    r"[/~.]*[A-Za-z]+(?:[ _.\-/:]+[A-Za-z]+)*/?"  # a word, words, an identifier (web_search), a path without digits
    r"|[+-]?\d+(?:[.,]\d+)*"  # a number
    r"|(?:true|false|yes|no|on|off|none|null)",
    re.IGNORECASE,
)
REDACTED = "[REDACTED]"
# Query parameters whose values are credentials, by how their names end: ?api_key=, ?key=, ?apiKey=,
# ?access_token=, ?client_secret=, ?password=, ?sig=, ?X-Amz-Signature=, ?X-Goog-Credential=; not
# ?keyword=, ?passage=, ?author= or ?signal= (a search's words are no secret).
SECRET_PARAM = re.compile(
    r"(?:key|token|secret|pass|passwd|password|pwd|auth|authorization|sig|signature|credentials?)$",
    re.IGNORECASE,
)
# A URL in an environment value (a proxy, a tool's endpoint, a database): any scheme.
_URL_VALUE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
# An Authorization-style value: the scheme, then the credential.
_AUTH_VALUE = re.compile(r"(bearer|basic|token|bot|apikey|api-key|key|digest)\s+(\S+)", re.IGNORECASE)

# Control characters but the line break and the tab: what an endpoint's error, a model id it lists or a
# row's id could hold to drive the terminal (ESC sequences that set its title, clear it, hide text).
_TERMINAL_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` for the console: control characters shown as ``\\xNN``, not obeyed (line breaks and tabs
    kept). Only for what is printed: the files keep the text as it was."""
    return _TERMINAL_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# A line break between two base64 characters, as written or JSON-escaped once or more (a tool's
# output is JSON inside a record's string): base64(1) and MIME wrap their output at 76 characters,
# PEM at 64, so a secret's encoded form may straddle one.
_B64_BREAK = re.compile(r"(?<=[A-Za-z0-9+/=_-])(?:\\+r\\+n|\\+n|\r\n|\n)(?=[A-Za-z0-9+/_-])")
# Before that regex (~0.2 ms a record): whether a line of 24 base64 characters or more ends at a line
# break (plain, or the backslash of an escaped one) anywhere, by a byte translation (~8 us a record).
# base64(1), MIME, PEM and openssl wrap at 64 or 76; a record's hashes and ids end in a quote.
_B64_CHARS = (string.ascii_letters + string.digits + "+/=_-").encode()
_B64_CLASSES = bytes(
    ord("a") if b in _B64_CHARS else ord("\n") if b in b"\r\n" else b if b == ord("\\") else ord(" ")
    for b in range(256)
)
_B64_LINE = b"a" * 24


def _may_wrap_base64(text: str) -> bool:
    classes = text.encode("utf-8", "surrogatepass").translate(_B64_CLASSES)
    return _B64_LINE + b"\\" in classes or _B64_LINE + b"\n" in classes


def looks_like_secret(value: str) -> bool:
    """Whether an environment value is a credential rather than an ordinary setting."""
    value = value.strip()
    return len(value) >= MIN_SECRET_CHARS and ORDINARY.fullmatch(value) is None


def url_secrets(url: str) -> list[str]:
    """The credentials ``url`` carries: its password (``https://user:PASSWORD@host``) and the values of
    its query parameters named like credentials (``?api_key=KEY``, ``&token=``), URL-unquoted. A model
    client sends them to the endpoint, which may quote them back; a message may show the URL."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        password = parts.password
    except ValueError:  # a URL urllib cannot read (a bad port, a bracket): its userinfo by hand
        userinfo = url.partition("://")[2].rpartition("@")[0]
        password = userinfo.partition(":")[2] or None if userinfo else None
        parts = None
    found = [urllib.parse.unquote(password)] if password else []
    query = parts.query if parts is not None else url.partition("?")[2].partition("#")[0]
    found += [v for k, v in urllib.parse.parse_qsl(query, keep_blank_values=False) if SECRET_PARAM.search(k)]
    return [v for v in found if v]


def _credentials(value: str) -> list[str]:
    """The credential inside an Authorization-style value (``Bearer <token>``; ``Basic <base64>``: the
    password it encodes), besides the value itself."""
    m = _AUTH_VALUE.fullmatch(value.strip())
    if m is None:
        return []
    found = [m.group(2)]
    if m.group(1).lower() == "basic":
        try:
            user_pass = base64.b64decode(m.group(2), validate=True).decode("utf-8")
        except ValueError:  # not base64, or not UTF-8: the token as it is
            return found
        found += [user_pass, user_pass.partition(":")[2]]
    return [v for v in found if v]


def _base64_forms(value: str) -> set[str]:
    """The base64 text of ``value`` as it appears inside a longer encoded string, at each of the three
    byte alignments and in both alphabets: only the characters that depend on ``value`` alone."""
    raw = value.encode("utf-8", "surrogatepass")
    forms = set()
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + raw).decode().rstrip("=")
        start = (pad * 8 + 5) // 6  # characters that mix in the padding bytes
        end = len(encoded) - (1 if (pad + len(raw)) % 3 else 0)  # the last one mixes in what follows
        piece = encoded[start:end]
        if len(piece) >= MIN_SECRET_CHARS:
            forms |= {piece, piece.replace("+", "-").replace("/", "_")}
    return forms


def _forms(values: set[str], *, encodings: bool) -> set[str]:
    """Each value as written and JSON-escaped (ASCII-escaped or not, once or twice: an endpoint's error
    quoting the request body is JSON inside a string); with ``encodings``, URL-quoted and base64 too."""
    forms = set(values)
    for v in values:
        for ascii_only in (True, False):
            once = json.dumps(v, ensure_ascii=ascii_only)[1:-1]
            forms |= {once, json.dumps(once, ensure_ascii=ascii_only)[1:-1]}
        if encodings:
            forms |= {urllib.parse.quote(v, safe=""), urllib.parse.quote_plus(v), urllib.parse.quote(v)}
    return {f for f in forms if f}


def _escaped_pattern(values: set[str]) -> re.Pattern[str] | None:
    """Each value with any of its characters written as a JSON ``\\u`` escape (once or more: inside a
    JSON string the backslash is escaped too), in any letter case. A model's tool-call arguments are
    kept as it wrote them: ``{"key": "\\u0073k-..."}`` is the key ``sk-...`` to any reader of them."""
    if not values:
        return None

    def char(c: str) -> str:
        return re.escape(c) if ord(c) > 0xFFFF else f"(?:{re.escape(c)}|\\\\+u{ord(c):04x})"

    alternatives = ("".join(char(c) for c in v) for v in sorted(values, key=len, reverse=True))
    return re.compile("|".join(alternatives), re.IGNORECASE)


_ESCAPE = re.compile(r"\\+u([0-9a-fA-F]{4})")


def _escapes(text: str) -> bool:
    """Whether ``text`` may hold a ``\\u`` escape (in either letter case)."""
    return "\\u" in text or "\\U" in text


def _joined(text: str) -> tuple[str, list[int], list[int]]:
    """``text`` without the line breaks between base64 characters, and where each of its unbroken
    pieces starts in it and in ``text``."""
    pieces, starts, origins = [], [], []
    done = length = 0
    for m in _B64_BREAK.finditer(text):
        pieces.append(text[done : m.start()])
        starts.append(length)
        origins.append(done)
        length += m.start() - done
        done = m.end()
    pieces.append(text[done:])
    starts.append(length)
    origins.append(done)
    return "".join(pieces), starts, origins


def _pattern(forms: set[str], *, ignore_case: bool) -> re.Pattern[str] | None:
    if not forms:
        return None
    alternatives = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    return re.compile(alternatives, re.IGNORECASE if ignore_case else 0)


class Redactor:
    """Replaces secrets (and, in side files, scaffolding) before any write; see the module docstring.

    ``secrets``: further secret values (MCP servers' env and header values). ``scaffolding``: the
    ephemeral system prompt and the prefill contents.
    """

    def __init__(
        self,
        api_key: str | None,
        environ: dict[str, str] | None = None,
        secrets: tuple[str, ...] = (),
        scaffolding: tuple[str, ...] = (),
    ):
        env = os.environ if environ is None else environ
        named = {k: v for k, v in env.items() if SECRET_NAME.search(k) and v}
        values = {v for v in named.values() if looks_like_secret(v)}
        # A URL anywhere in the environment (HTTPS_PROXY=http://user:pw@..., VISION_BASE_URL=...?key=):
        # its credentials, when they look like secrets (a word of a password would redact that word).
        values |= {
            c
            for v in env.values()
            if _URL_VALUE.match(v or "")
            for c in url_secrets(v)
            if looks_like_secret(c)
        }
        # Variables that look like secrets by name but hold a word or a number: not patterns (said at start).
        self.ignored = sorted(k for k, v in named.items() if not looks_like_secret(v))
        if api_key and api_key != NO_KEY and len(api_key) >= 6:  # "x" for a local server is no secret
            values.add(api_key)
        values |= {v for v in secrets if isinstance(v, str) and len(v.strip()) >= MIN_SECRET_CHARS}
        # "Bearer <token>" given as a header value or a variable: the token alone is a secret too.
        values |= {c for v in list(values) for c in _credentials(v) if len(c.strip()) >= MIN_SECRET_CHARS}
        scaffold = {v for v in scaffolding if isinstance(v, str) and len(v.strip()) >= MIN_SCAFFOLD_CHARS}
        # Text forms match in any letter case (an upper-cased header, a title-cased log); base64 only
        # exactly, since its letter case is part of the encoding.
        self.values = frozenset(values)  # the secret values themselves (a worker's gate: same set)
        encoded = {f for v in values for f in _base64_forms(v)}
        self._encoded = _pattern(encoded, ignore_case=False)
        texts = _forms(values, encodings=True)
        self._secrets = [p for p in (_pattern(texts, ignore_case=True), self._encoded) if p is not None]
        self._escaped = _escaped_pattern(values)  # only where a text holds a \u escape (see _escapes)
        # finds_secret on an ASCII record (most are) with ASCII secrets: the same answer as the patterns
        # by plain substring tests, ~20x faster than an IGNORECASE search (see finds_secret).
        self._ascii_forms: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        if all(f.isascii() for f in texts | encoded):
            self._ascii_forms = (tuple(sorted({f.lower() for f in texts})), tuple(sorted(encoded)))
        self._scaffolding = _pattern(_forms(scaffold - values, encodings=False), ignore_case=False)

    @classmethod
    def for_config(cls, config: object) -> Redactor:
        """The run's redactor: its key, the environment, its MCP secrets and its scaffolding."""
        return cls(
            getattr(config, "resolved_api_key", None),
            secrets=tuple(config.secret_texts()),  # type: ignore[attr-defined]
            scaffolding=tuple(config.scaffolding_texts()),  # type: ignore[attr-defined]
        )

    @classmethod
    def for_endpoint(cls, api_key: object, *urls: object, environ: dict[str, str] | None = None) -> Redactor:
        """A key and the credentials its endpoints' URLs carry (:func:`url_secrets`), with the
        environment's secrets (``environ``: {} for none), for what comes before or beside a run's own
        redactor: a refused start, a client's errors, a re-scoring."""
        secrets = tuple(s for url in urls if isinstance(url, str) for s in url_secrets(url))
        return cls(api_key if isinstance(api_key, str) else None, environ, secrets=secrets)

    def __call__(self, text: str) -> str:
        """For side files, logs and messages: secrets and scaffolding replaced."""
        text = self.sample(text)
        return self._scaffolding.sub(REDACTED, text) if self._scaffolding else text

    def sample(self, text: str) -> str:
        """For what a model or a tool said (discarded samples, a row's identity): secrets only."""
        for pattern in self._secrets:
            text = pattern.sub(REDACTED, text)
        if self._escaped is not None and _escapes(text):
            text = self._escaped.sub(REDACTED, text)
        return self._redact_wrapped(text)

    def _redact_wrapped(self, text: str) -> str:
        """The base64 forms that straddle a line break (wrapped output), each replaced from its first
        character to its last, the line breaks between them included."""
        if self._encoded is None or not _may_wrap_base64(text):
            return text
        joined, starts, origins = _joined(text)
        found = [(m.start(), m.end()) for m in self._encoded.finditer(joined)]
        if not found:
            return text

        def origin(pos: int) -> int:
            k = bisect.bisect_right(starts, pos) - 1
            return origins[k] + pos - starts[k]

        out, done = [], 0
        for a, b in found:
            out += [text[done : origin(a)], REDACTED]
            done = origin(b - 1) + 1
        return "".join(out) + text[done:]

    def finds_secret(self, text: str) -> bool:
        """Whether ``text`` (a sample's serialised record) holds a secret in any of its forms, some of its
        characters written as ``\\u`` escapes too (:func:`_escaped_pattern`: what a model's arguments,
        kept as it wrote them, may hold): such text is looked at once more with its escapes read."""
        if self._finds(text):
            return True
        if self._escaped is None or not _escapes(text):
            return False
        read = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)  # ~2x a plain look, not a regex's 4x
        return read != text and self._finds(read)

    def _finds(self, text: str) -> bool:
        """Whether ``text`` (a sample's serialised record) holds a secret in any of its forms.

        Where the text and every form are ASCII, an IGNORECASE match of a form is exactly an ASCII
        case-insensitive one (the only other characters ``re`` folds together with ASCII letters, such
        as the Kelvin sign or the long s, are not ASCII), that is a substring of the lower-cased text;
        the base64 forms are matched exactly. Any other text goes through the patterns."""
        if self._ascii_forms is not None and text.isascii():
            folded, exact = self._ascii_forms
            if folded:
                lowered = text.lower()
                if any(f in lowered for f in folded):
                    return True
            if any(f in text for f in exact):
                return True
        elif any(pattern.search(text) for pattern in self._secrets):
            return True
        # Base64 wrapped into lines (what `base64` writes by default): the forms across the breaks.
        if self._encoded is None or not _may_wrap_base64(text):
            return False
        return self._encoded.search(_B64_BREAK.sub("", text)) is not None

    def start_note(self) -> str | None:
        """The start line's note on secret-named variables that are not treated as secrets, if any."""
        if not self.ignored:
            return None
        return (
            f"note: not redacting {', '.join(self.ignored)}: named like secrets, but each holds a word or a "
            f"number (or fewer than {MIN_SECRET_CHARS} characters), which would redact ordinary text"
        )
