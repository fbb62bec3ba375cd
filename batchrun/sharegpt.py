"""The ShareGPT text convention of the records, read back: what both sides of the process boundary need.

The writer is ``batchrun.prompt.trajectory`` (it renders a prompt's messages); readers of saved records
(resume, merge, the views) take the parts they need from here.
"""

from __future__ import annotations

from typing import Any


def first_human(conversations: list[dict[str, Any]]) -> str | None:
    for c in conversations:
        if isinstance(c, dict) and c.get("from") == "human":
            value = c.get("value")
            return value if isinstance(value, str) else None
    return None
