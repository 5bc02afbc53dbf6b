"""End to end: notebooks/live_viewer.ipynb in JupyterLab in headless Chromium, with the real default model.

The run is caught mid-way (8 chats running, 8 waiting) and at the end; both screenshots are saved under
``artifacts/`` (``live_viewer_midrun.png``, ``live_viewer.png``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from notebook_support import JupyterLabServer, run_notebook_in_browser

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO_ROOT / "notebooks" / "live_viewer.ipynb"
ARTIFACTS = REPO_ROOT / "artifacts"
# Mid-run: max_num_seqs=8 runs 8 of the 16 chats; the others wait with no tokens yet. The viewer's counts of its
# requests ("8 running") and the engine's own ("running 8") are both shown.
MIDRUN = ["8 running", "8 waiting", "running 8", "waiting 8", "waiting · 0/48 tokens", "running · "]


@pytest.mark.browser
@pytest.mark.timeout(600)  # JupyterLab start plus the run's own 420 s bound: above the suite's 300 s default
def test_live_viewer_notebook_shows_states_mid_run_and_the_outcome_at_the_end(tmp_path: Path) -> None:
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    final_shot, midrun_shot = ARTIFACTS / "live_viewer.png", ARTIFACTS / "live_viewer_midrun.png"
    captured: list[str] = []

    with JupyterLabServer(tmp_path) as server:
        text = run_notebook_in_browser(
            server,
            NOTEBOOK.name,
            final_shot,
            checkpoints=[(MIDRUN, midrun_shot)],
            captured=captured,
            wait_for_text="16/16 finished",
            timeout=420,
            viewport=(1400, 3200),
        )
        server_log = server.log_text()

    (midrun,) = captured
    assert "0/16 finished" in midrun  # the first wave is still running
    assert re.search(r"running · [1-9]\d*/48 tokens", midrun)  # rows count tokens out of max_tokens
    assert "greedy" in midrun and "user: Tell me one fact about" in midrun  # settings; chat turns
    assert "assistant:" in midrun
    # The end: the first viewer finished everything; the stopped one ends with its breakdown.
    assert "16/16 finished" in text and "done" in text
    assert "16 abort" in text and "stopped" in text
    assert re.search(r"first token \d+\.\d\d s", text) and re.search(r"latency \d+\.\d\d s", text)
    assert midrun_shot.stat().st_size > 0 and final_shot.stat().st_size > 0
    assert "Traceback" not in server_log
