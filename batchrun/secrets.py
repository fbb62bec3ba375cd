"""Secrets never reach a file or a stream: :class:`Redactor` replaces their values before any write."""

from __future__ import annotations

import json
import os
import re

from batchrun.prompt.llm import NO_KEY

# Environment variables whose values are secrets wherever they turn up (tool-provider keys and the like).
SECRET_NAME = re.compile(r"(_KEY|_TOKEN|_SECRET|PASSWORD|_PASS)$|^(API_KEY|TOKEN|SECRET)$", re.IGNORECASE)


MIN_SECRET_CHARS = 8  # shorter values (a prefill "ok") would redact ordinary words everywhere


class Redactor:
    """Replaces secret values before any write: the API key, secret-looking environment variables,
    and ``secrets`` (the ephemeral system prompt and the prefill contents, which an endpoint may
    quote back in an error message)."""

    def __init__(
        self, api_key: str | None, environ: dict[str, str] | None = None, secrets: tuple[str, ...] = ()
    ):
        env = os.environ if environ is None else environ
        values = {v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_CHARS}
        if api_key and api_key != NO_KEY and len(api_key) >= 6:  # "x" for a local server is no secret
            values.add(api_key)
        values |= {v for v in secrets if isinstance(v, str) and len(v.strip()) >= MIN_SECRET_CHARS}
        # Also their JSON-escaped forms (lines are redacted after serialisation), ASCII-escaped or not,
        # and escaped twice: an endpoint's error that quotes the request body is JSON inside a string.
        forms = set(values)
        for v in values:
            for ascii_only in (True, False):
                once = json.dumps(v, ensure_ascii=ascii_only)[1:-1]
                forms |= {once, json.dumps(once, ensure_ascii=ascii_only)[1:-1]}
        self._pattern = (
            re.compile("|".join(re.escape(v) for v in sorted(forms, key=len, reverse=True)))
            if forms
            else None
        )

    def __call__(self, text: str) -> str:
        return self._pattern.sub("[REDACTED]", text) if self._pattern else text
