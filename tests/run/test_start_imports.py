"""What a run loads before its first request: modules only some runs use stay out of the parent's
and the forkserver's start (each costs every run its import; asyncio ~40 ms of CPU per process here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = "import batchrun.cli, batchrun.api; from batchrun.prompt.tools.catalog import all_tools; all_tools()"
FORKSERVER = "import batchrun.run.worker_preload"


@pytest.mark.parametrize("code", [PARENT, FORKSERVER], ids=["parent", "forkserver"])
def test_a_run_without_mcp_or_browser_use_loads_no_asyncio_at_start(code):
    probe = f"{code}; import sys; print(sorted(m for m in ('asyncio', 'openai', 'playwright') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
