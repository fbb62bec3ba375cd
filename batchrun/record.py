"""The trajectory record: its fields, defined once.

The writer (``batchrun.prompt.trajectory.build_record``), the merge and statistics
(``batchrun.run.finish``) and the tests all take the field list from here.
"""

from __future__ import annotations

# The top-level fields of a record, in the order they are written (../shared/SPEC.md).
RECORD_FIELDS = (
    "prompt_index",
    "conversations",
    "metadata",
    "completed",
    "partial",
    "api_calls",
    "toolsets_used",
    "tool_stats",
    "tool_error_counts",
)
