"""Secrets never reach a file or a stream: :class:`Redactor` replaces their values before any write."""

from __future__ import annotations

import json
import os
import re

from batchrun.prompt.llm import NO_KEY

# Environment variables whose values are secrets wherever they turn up (tool-provider keys and the like).
SECRET_NAME = re.compile(r"(_KEY|_TOKEN|_SECRET|PASSWORD|_PASS)$|^(API_KEY|TOKEN|SECRET)$", re.IGNORECASE)


class Redactor:
    """Replaces secret values (the API key, secret-looking environment variables) before any write."""

    def __init__(self, api_key: str | None, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        values = {v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8}
        if api_key and api_key != NO_KEY and len(api_key) >= 6:  # "x" for a local server is no secret
            values.add(api_key)
        # Also their JSON-escaped forms, since lines are redacted after serialisation.
        forms = values | {json.dumps(v)[1:-1] for v in values}
        self._pattern = (
            re.compile("|".join(re.escape(v) for v in sorted(forms, key=len, reverse=True)))
            if forms
            else None
        )

    def __call__(self, text: str) -> str:
        return self._pattern.sub("[REDACTED]", text) if self._pattern else text
