"""Fixtures of the views' tests: a real headless Chromium for the reports."""

from __future__ import annotations

import os

import pytest
from helpers import skip_or_fail

from batchrun.prompt.tools.config import BROWSER_FLAGS  # the project's one list of headless Chromium flags

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium through Playwright; skips locally (fails in CI) when either is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problem = "the playwright package is not installed"
    else:
        problem = (
            None if os.access(CHROMIUM, os.X_OK) else f"{CHROMIUM} is missing (apt-get install chromium)"
        )
    if problem:
        skip_or_fail(problem)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=list(BROWSER_FLAGS))
        yield b
        b.close()
