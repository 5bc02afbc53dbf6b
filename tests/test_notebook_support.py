"""execute_notebook: runs a notebook in a real kernel on this interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest

import notebook_support
from notebook_support import NotebookExecutionError, execute_notebook


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nb, path)
    return path


def _stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_execute_notebook_runs_cells_in_this_python(tmp_path: Path) -> None:
    path = _notebook(
        tmp_path / "ok.ipynb",
        "answer = 6 * 7",
        "import os, sys\nprint(answer)\nprint(sys.executable)\nprint(os.getcwd())",
    )
    nb = execute_notebook(path, timeout=120)
    lines = _stdout(nb.cells[1]).splitlines()
    assert lines[0] == "42"
    assert lines[1] == sys.executable
    assert os.path.samefile(lines[2], tmp_path)


def test_execute_notebook_reports_the_failing_cell(tmp_path: Path) -> None:
    path = _notebook(tmp_path / "bad.ipynb", "x = 1", "y = x / 0  # boom", "print('unreached')")
    with pytest.raises(NotebookExecutionError) as info:
        execute_notebook(path, timeout=120)
    err = info.value
    assert err.cell_index == 1
    assert "y = x / 0  # boom" in str(err)
    assert "ZeroDivisionError" in str(err)
    assert "\x1b[" not in str(err)


def test_execute_notebook_uses_a_private_kernelspec_when_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notebook_support, "default_kernel_runs_this_python", lambda: False)
    before = os.environ.get("JUPYTER_PATH")
    path = _notebook(
        tmp_path / "k.ipynb",
        "import os, sys\nprint(sys.executable)\nprint(os.environ.get('JUPYTER_PATH', ''))",
    )
    nb = execute_notebook(path, timeout=120, cwd=tmp_path)
    kernel_python, kernel_jupyter_path = _stdout(nb.cells[0]).splitlines()
    assert kernel_python == sys.executable
    assert "enginekit-kernels-" in kernel_jupyter_path  # the private spec was the one used
    assert os.environ.get("JUPYTER_PATH") == before


def test_default_kernelspec_runs_this_python() -> None:
    assert notebook_support.default_kernel_runs_this_python()
