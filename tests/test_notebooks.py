"""Every notebook in notebooks/ runs top to bottom in a real kernel; engines behave in a kernel as promised.

The notebooks check what they show with ``assert``s in their cells, so running them is the test.
"""

from __future__ import annotations

import asyncio
import contextvars
from pathlib import Path

import nbformat
import pytest

from notebook_support import execute_notebook

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _code_cells(path: Path) -> list[nbformat.NotebookNode]:
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def test_the_notebooks_are_there() -> None:
    names = {path.name for path in NOTEBOOKS}
    assert {"quickstart.ipynb", "live_viewer.ipynb", "structured_outputs.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_committed_notebook_has_no_outputs(path: Path) -> None:
    dirty = [i for i, cell in enumerate(_code_cells(path)) if cell.outputs or cell.execution_count]
    assert dirty == [], f"{path.name}: clear the outputs of code cells {dirty}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_asserts_what_it_shows(path: Path) -> None:
    assert any("assert " in cell.source for cell in _code_cells(path))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_top_to_bottom_in_a_kernel(path: Path) -> None:
    executed = execute_notebook(path, timeout=300)
    errors = [o for cell in executed.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert errors == []


def test_a_sync_call_on_the_kernel_loop_keeps_the_cells_queued_behind_it_in_order() -> None:
    # ipykernel runs every shell message in one persistent context and one cell at a time (a lock); a nested
    # run must neither drop the cells queued meanwhile ("Run All") nor let a later one overtake them.
    from enginekit.notebook.loop import make_reentrant, run_sync

    async def kernel() -> list[str]:
        loop = asyncio.get_running_loop()
        make_reentrant(loop)  # as an earlier sync call did
        await asyncio.sleep(0)
        shell_context = contextvars.copy_context()
        one_cell_at_a_time = asyncio.Lock()
        ran: list[str] = []
        cells: list[asyncio.Task[None]] = []

        def queue_cell(name: str) -> None:
            async def cell() -> None:
                async with one_cell_at_a_time:
                    ran.append(name)

            cells.append(loop.create_task(cell(), context=shell_context))

        async def sync_engine_call() -> None:
            queue_cell("second")
            await asyncio.sleep(0.01)
            queue_cell("third")
            await asyncio.sleep(0.01)
            queue_cell("fourth")  # still waiting to start when the call returns

        async def blocking_cell() -> None:
            async with one_cell_at_a_time:
                run_sync(sync_engine_call())  # what a sync engine call in "async" mode does
                ran.append("first")

        cells.append(loop.create_task(blocking_cell(), context=shell_context))
        for _ in range(3):  # more callbacks in the same pass of the loop, as a busy kernel has
            loop.call_soon(lambda: None)
        await cells[0]
        for _ in range(100):
            if len(ran) == 4:
                break
            await asyncio.sleep(0.01)
        return ran

    assert asyncio.run(kernel()) == ["first", "second", "third", "fourth"]


def test_making_a_loop_reentrant_leaves_asyncio_run_closing_its_loops() -> None:
    # nest-asyncio's own asyncio.run runs on the thread's policy loop and never closes it.
    from enginekit.notebook.loop import make_reentrant

    async def reentrant() -> None:
        make_reentrant(asyncio.get_running_loop())

    asyncio.run(reentrant())
    loops: list[asyncio.AbstractEventLoop] = []

    async def running() -> None:
        loops.append(asyncio.get_running_loop())

    asyncio.run(running())
    asyncio.run(running())
    assert loops[0] is not loops[1] and loops[0].is_closed() and loops[1].is_closed()
    assert not hasattr(asyncio, "_nest_patched")  # a user's own nest_asyncio.apply() patches it again


# ---- how an engine behaves in a kernel ----------------------------------------------------------------

KERNEL_CELLS = {
    "setup": """\
import os, sys
from enginekit import Engine, EngineDeadError, SamplingParams
from enginekit.notebook import Viewer, in_jupyter
params = SamplingParams(max_tokens=4, temperature=0.0)
prompts = [f"p{i}" for i in range(16)]
print(in_jupyter())""",
    "quiet_engine": """\
engine = Engine("builtin", num_kv_blocks=64)
engine.generate(prompts, params, progress=False)
engine.shutdown()""",
    "dying_engine": """\
engine = Engine("builtin", num_kv_blocks=64, fail_at_step=2)
try:
    engine.generate("hi", SamplingParams(max_tokens=8))
except EngineDeadError:
    pass
engine.shutdown()""",
    "progress_bar": """\
engine = Engine("builtin", mode="inproc", num_kv_blocks=64)
_ = engine.generate(prompts, params)""",
    "no_progress_bar": """\
_ = engine.generate(prompts, params, progress=False)""",
    "viewer": """\
_ = engine.generate(prompts[:2], params, viewer=True)""",
    "viewer_without_ipywidgets": """\
sys.modules["ipywidgets"] = None
viewer = Viewer()
del sys.modules["ipywidgets"]
_ = engine.generate(prompts[:2], params, viewer=viewer)
engine.shutdown()
print(viewer.kind)""",
    "verbose_engine": """\
loud = Engine("builtin", num_kv_blocks=64, log_level="info")
loud.generate("hi", params)
loud.shutdown()""",
}


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[nbformat.NotebookNode]]:
    """Run KERNEL_CELLS as one notebook; the outputs of each cell, by name."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in KERNEL_CELLS.values()]
    path = tmp_path_factory.mktemp("kernel") / "kernel_behaviour.ipynb"
    nbformat.write(nb, path)
    executed = execute_notebook(path, timeout=300)
    return {name: cell.outputs for name, cell in zip(KERNEL_CELLS, executed.cells)}


def _stream(outputs: list[nbformat.NotebookNode], name: str) -> str:
    return "".join(o.text for o in outputs if o.output_type == "stream" and o.name == name)


@pytest.mark.slow
def test_in_jupyter_is_true_in_a_kernel(kernel_run) -> None:
    assert _stream(kernel_run["setup"], "stdout") == "True\n"


@pytest.mark.slow
def test_engine_output_stays_out_of_cells_by_default(kernel_run) -> None:
    assert kernel_run["quiet_engine"] == []


@pytest.mark.slow
def test_a_dying_engine_prints_nothing_into_the_cell(kernel_run) -> None:
    assert kernel_run["dying_engine"] == []


@pytest.mark.slow
def test_a_batch_of_16_shows_a_progress_bar_widget(kernel_run) -> None:
    (output,) = kernel_run["progress_bar"]
    assert WIDGET_MIME in output.data and "generate" in output.data["text/plain"]


@pytest.mark.slow
def test_progress_false_shows_nothing(kernel_run) -> None:
    assert kernel_run["no_progress_bar"] == []


@pytest.mark.slow
def test_viewer_true_shows_a_widget_in_a_kernel(kernel_run) -> None:
    (output,) = kernel_run["viewer"]
    assert WIDGET_MIME in output.data


@pytest.mark.slow
def test_without_ipywidgets_the_viewer_falls_back_to_text_in_a_kernel(kernel_run) -> None:
    outputs = kernel_run["viewer_without_ipywidgets"]
    assert "ipywidgets is not installed" in _stream(outputs, "stderr")
    assert "2/2 finished" in _stream(outputs, "stderr")
    assert _stream(outputs, "stdout") == "text\n"


@pytest.mark.slow
def test_log_level_info_shows_front_end_and_engine_records(kernel_run) -> None:
    logs = _stream(kernel_run["verbose_engine"], "stderr")
    assert "INFO enginekit: engine started: mode=mp" in logs
    assert "INFO enginekit.engine_process: engine[" in logs
