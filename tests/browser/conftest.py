"""Browser tests: JupyterLab in headless Chromium, driven by Playwright.

They need Debian's chromium at /usr/bin/chromium (``.ci/install-browser.sh``) and the
``playwright`` Python package; without either, they are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    # notebook_support lives in tests/, which is not a package.
    sys.path.insert(0, str(TESTS_DIR))

from notebook_support import CHROMIUM_PATH  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: runs JupyterLab in headless Chromium (needs chromium + playwright)"
    )


def _missing_browser_requirement() -> str | None:
    if not os.access(CHROMIUM_PATH, os.X_OK):
        return f"{CHROMIUM_PATH} not found: run .ci/install-browser.sh"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright Python package is not installed (dependency group 'notebook')"
    if importlib.util.find_spec("jupyterlab") is None:
        return "jupyterlab is not installed (dependency group 'notebook')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _missing_browser_requirement()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("browser") is not None:
            item.add_marker(skip)
