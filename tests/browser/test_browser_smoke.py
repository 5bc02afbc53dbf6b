"""End to end: a notebook streams text into an ipywidgets HTML widget in a real JupyterLab."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
import pytest

from notebook_support import JupyterLabServer, run_notebook_in_browser
from process_support import HANG_GUARD_S

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "artifacts"

STREAM_CELL = """\
import time

import ipywidgets as widgets
from IPython.display import display

view = widgets.HTML(value="<i>waiting…</i>")
display(view)
for i in range(43):
    view.value = f"<b>streamed text {i}</b>"
    time.sleep(0.02)
"""

INFO_CELL = """\
import os
import sys

print("kernel python:", sys.executable)
print("kernel pid:", os.getpid())
"""


def _write_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Browser smoke test"),
        nbformat.v4.new_code_cell(STREAM_CELL),
        nbformat.v4.new_code_cell(INFO_CELL),
    ]
    nbformat.write(nb, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.browser
def test_widget_streams_text_in_jupyterlab(tmp_path: Path) -> None:
    _write_notebook(tmp_path / "smoke.ipynb")
    screenshot = ARTIFACTS / "browser_smoke.png"

    started = time.monotonic()
    with JupyterLabServer(tmp_path) as server:
        assert server.base_url.startswith("http://127.0.0.1:")
        text = run_notebook_in_browser(
            server,
            "smoke.ipynb",
            screenshot,
            wait_for_text="streamed text 42",
            timeout=180,
        )
        server_log = server.log_text()
    elapsed = time.monotonic() - started

    assert "streamed text 42" in text
    assert "streamed text 41" not in text
    assert f"kernel python: {sys.executable}" in text, text
    assert screenshot.stat().st_size > 0
    assert "Traceback" not in server_log

    kernel_pid = int(text.split("kernel pid:", 1)[1].split()[0])
    deadline = time.monotonic() + HANG_GUARD_S
    while _pid_alive(kernel_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(kernel_pid), "kernel outlived the JupyterLab server"
    print(f"browser smoke run took {elapsed:.1f}s; screenshot: {screenshot}")
