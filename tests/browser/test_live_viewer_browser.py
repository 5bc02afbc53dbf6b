"""End to end: notebooks/live_viewer.ipynb in JupyterLab in headless Chromium shows the streamed text."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from notebook_support import JupyterLabServer, run_notebook_in_browser

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO_ROOT / "notebooks" / "live_viewer.ipynb"
ARTIFACTS = REPO_ROOT / "artifacts"


def _notebook_prompts() -> tuple[list[str], object]:
    """``prompts`` and ``params`` as the notebook's cell tagged "prompts" defines them."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c for c in nb.cells if "prompts" in c.metadata.get("tags", [])]
    namespace: dict[str, object] = {}
    exec(cell.source, namespace)
    return namespace["prompts"], namespace["params"]  # type: ignore[return-value]


def _expected_first_text() -> str:
    """What the first request of the notebook's first viewer generates (greedy: the same in every mode)."""
    from enginekit import Engine

    prompts, params = _notebook_prompts()
    with Engine("builtin", mode="inproc", num_kv_blocks=256, max_num_seqs=8) as engine:
        (output,) = engine.generate(prompts[0], params)
    # innerText of the row: the longest line of the text, without surrounding spaces.
    return max(output.text.split("\n"), key=len).strip()


@pytest.mark.browser
def test_live_viewer_notebook_streams_text_into_the_widget(tmp_path: Path) -> None:
    expected = _expected_first_text()
    assert len(expected) >= 8
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    screenshot = ARTIFACTS / "live_viewer.png"

    with JupyterLabServer(tmp_path) as server:
        text = run_notebook_in_browser(
            server, NOTEBOOK.name, screenshot, wait_for_text=expected, timeout=300, viewport=(1400, 3200)
        )
        server_log = server.log_text()

    assert "16/16 finished" in text  # the first viewer's panel, once its generate returned
    assert "abort" in text  # the stopped requests' rows
    assert screenshot.stat().st_size > 0
    assert "Traceback" not in server_log
