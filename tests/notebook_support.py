"""Helpers for tests that run notebooks.

Two ways to run a notebook:

* :func:`execute_notebook` runs it top to bottom in a real kernel with nbclient (no browser).
* :class:`JupyterLabServer` + :func:`run_notebook_in_browser` run it the way a person does: a
  local JupyterLab server, headless Chromium driven by Playwright, "Run All Cells", and a
  screenshot of what the page shows (widgets included).

Everything stays on the loopback interface: the server is started with every option that
would make it (or the page) reach out to the network switched off.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nbformat

KERNEL_NAME = "python3"
CHROMIUM_PATH = "/usr/bin/chromium"
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # Nothing but loopback resolves, so the page cannot reach out. The rules apply to IP
    # literals too: 127.0.0.1 must be excluded explicitly.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
)
# Rendered ipywidgets views: the widget manager mounts each view (class "jupyter-widgets") in an
# output area. A notebook whose widget manager failed shows only the text/plain fallback
# ("HTML(value=...)"), which this selector does not match.
WIDGET_OUTPUT_SELECTOR = ".jp-OutputArea-output .jupyter-widgets"

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# argv[0] values that jupyter_client replaces with the launching process's sys.executable.
_PYTHON_ALIASES = {
    "python",
    f"python{sys.version_info[0]}",
    "python{}.{}".format(*sys.version_info[:2]),
}


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


# --------------------------------------------------------------------------------------------
# Kernel resolution
# --------------------------------------------------------------------------------------------


def default_kernel_runs_this_python() -> bool:
    """True when the ``python3`` kernelspec starts a kernel on this interpreter (sys.executable).

    jupyter_client swaps an argv[0] of ``python``/``python3``/``python3.X`` for the launching
    process's ``sys.executable``, so such a spec always runs this interpreter when the kernel is
    started from this process or from a server started with ``sys.executable``. Paths are compared
    without resolving symlinks: a virtualenv's python links to the base interpreter, which is not
    the same environment.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        return False
    if not spec.argv:
        return False
    argv0 = spec.argv[0]
    if argv0 in _PYTHON_ALIASES:
        return True
    found = shutil.which(argv0)
    if found is None:
        return False
    return os.path.normpath(os.path.abspath(found)) == os.path.normpath(sys.executable)


def write_private_kernelspec(jupyter_path: Path) -> Path:
    """Write a ``python3`` kernelspec under ``jupyter_path/kernels`` that runs sys.executable."""
    kernel_dir = jupyter_path / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True},
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return kernel_dir


@contextlib.contextmanager
def _kernel_path_env() -> Iterator[dict[str, str]]:
    """Yield extra environment variables that make ``python3`` resolve to sys.executable.

    Empty when the installed kernelspec already does; otherwise a temporary JUPYTER_PATH with a
    private kernelspec in front of whatever JUPYTER_PATH already held.
    """
    if default_kernel_runs_this_python():
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="enginekit-kernels-") as tmp:
        write_private_kernelspec(Path(tmp))
        parts = [tmp]
        if os.environ.get("JUPYTER_PATH"):
            parts.append(os.environ["JUPYTER_PATH"])
        yield {"JUPYTER_PATH": os.pathsep.join(parts)}


@contextlib.contextmanager
def _patched_environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------------------------
# Headless execution (nbclient)
# --------------------------------------------------------------------------------------------


class NotebookExecutionError(AssertionError):
    """A notebook cell failed (or timed out) while executing."""

    def __init__(self, path: Path, cell_index: int | None, source: str, details: str):
        self.path = path
        self.cell_index = cell_index
        self.source = source
        self.details = details
        where = f"cell {cell_index}" if cell_index is not None else "kernel setup"
        super().__init__(
            f"notebook {path} failed in {where}:\n"
            f"----- cell source -----\n{source}\n"
            f"----- error -----\n{details}"
        )


def _error_details(cell: Any, exc: BaseException) -> str:
    for output in cell.get("outputs", []) if cell is not None else []:
        if output.get("output_type") == "error":
            traceback = "\n".join(output.get("traceback", []))
            return strip_ansi(traceback or f"{output.get('ename')}: {output.get('evalue')}")
    return strip_ansi(f"{type(exc).__name__}: {exc}")


def execute_notebook(
    path: str | os.PathLike[str],
    timeout: int = 600,
    cwd: str | os.PathLike[str] | None = None,
) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` top to bottom in a real ``python3`` kernel.

    The kernel runs this interpreter (sys.executable) with ``cwd`` (default: the notebook's
    folder) as its working directory. ``timeout`` is per cell, in seconds. Returns the executed
    notebook (not written back to disk). Raises :class:`NotebookExecutionError` with the failing
    cell's source and traceback when a cell raises or times out.
    """
    from nbclient import NotebookClient

    nb_path = Path(path)
    nb = nbformat.read(nb_path, as_version=4)
    workdir = Path(cwd) if cwd is not None else nb_path.parent
    current: dict[str, Any] = {"index": None, "cell": None}

    def on_cell_start(cell: Any, cell_index: int) -> None:
        current["index"] = cell_index
        current["cell"] = cell

    with _kernel_path_env() as extra_env, _patched_environ(extra_env):
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name=KERNEL_NAME,
            allow_errors=False,
            resources={"metadata": {"path": str(workdir)}},
            on_cell_start=on_cell_start,
        )
        try:
            client.execute()
        except Exception as exc:
            cell = current["cell"]
            source = cell.source if cell is not None else ""
            raise NotebookExecutionError(
                nb_path, current["index"], source, _error_details(cell, exc)
            ) from exc
    return nb


# --------------------------------------------------------------------------------------------
# JupyterLab server
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Lab settings that keep the page from asking about (or fetching) news and updates.
_LAB_USER_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


class JupyterLabServer:
    """A local JupyterLab server for browser tests.

    Usage::

        with JupyterLabServer(root_dir) as server:
            server.base_url  # "http://127.0.0.1:PORT/"
            server.token

    The server listens on 127.0.0.1 only, with a random token, isolated config/runtime/settings
    folders, and news, update checks and the PyPI extension manager switched off. On exit it is
    asked to shut down over its API (which stops its kernels), then terminated, then killed; any
    kernel process left behind is killed too.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        startup_timeout: float = 120.0,
        extra_args: tuple[str, ...] = (),
    ):
        self.root_dir = Path(root_dir).resolve()
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self.token = secrets.token_hex(24)
        self.port = 0
        self.base_url = ""
        self.log_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stack = contextlib.ExitStack()
        self._log_file: Any = None

    # -- public helpers ----------------------------------------------------------------------

    def url(self, path: str = "", **query: str) -> str:
        """Absolute URL for ``path`` on this server, with the token in the query string."""
        params = urllib.parse.urlencode({**query, "token": self.token})
        return f"{self.base_url}{path.lstrip('/')}?{params}"

    def api(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        """Call the server's REST API; returns the decoded JSON body (or None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}{path.lstrip('/')}",
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> JupyterLabServer:
        try:
            self._start()
        except BaseException:
            self._stop()
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._stop()
        finally:
            self._stack.close()

    def _command(self, state_dir: Path) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            # The non-deprecated spelling of --ServerApp.token.
            f"--IdentityProvider.token={self.token}",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={self.root_dir}",
            "--ServerApp.terminals_enabled=False",
            # No announcements, news feed, update checks or PyPI-backed extension manager.
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            # Fresh settings and workspaces: no state leaks between runs.
            f"--LabApp.user_settings_dir={state_dir / 'lab-settings'}",
            f"--LabApp.workspaces_dir={state_dir / 'lab-workspaces'}",
            # window.jupyterapp lets the browser helper await kernel state precisely.
            "--LabApp.expose_app_in_browser=True",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--allow-root")
        args.extend(self.extra_args)
        return args

    def _start(self) -> None:
        state_dir = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="jlab-")))
        for rel, values in _LAB_USER_SETTINGS.items():
            target = state_dir / "lab-settings" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values), encoding="utf-8")
        for sub in ("config", "data", "runtime", "ipython"):
            (state_dir / sub).mkdir()

        extra_env = self._stack.enter_context(_kernel_path_env())
        env = dict(os.environ)
        env.update(extra_env)
        env.update(
            {
                # Isolated from the user's Jupyter/IPython config and runtime files.
                "JUPYTER_CONFIG_DIR": str(state_dir / "config"),
                "JUPYTER_DATA_DIR": str(state_dir / "data"),
                "JUPYTER_RUNTIME_DIR": str(state_dir / "runtime"),
                "IPYTHONDIR": str(state_dir / "ipython"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.log_path = state_dir / "jupyterlab.log"

        last_error = ""
        for _attempt in range(3):
            self.port = free_port()
            self.base_url = f"http://127.0.0.1:{self.port}/"
            self._log_file = self.log_path.open("ab")
            self._proc = subprocess.Popen(
                self._command(state_dir),
                cwd=self.root_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            if self._wait_ready():
                return
            last_error = self.log_tail()
            self._stop()
            if "address already in use" not in last_error.lower():
                break
        raise RuntimeError(f"JupyterLab did not start; server log:\n{last_error}")

    def _wait_ready(self) -> bool:
        """Poll the HTTP API until the server answers (True) or the process dies (False)."""
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                self.api("GET", "api/status", timeout=2)
                # The lab extension answers too (its page handler is mounted).
                self.api("GET", "lab/api/settings/@jupyterlab/apputils-extension:notification")
                return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.2)
        waited = self.startup_timeout
        raise TimeoutError(f"JupyterLab not ready after {waited}s; log:\n{self.log_tail()}")

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            descendants = _descendants(proc.pid)
            if proc.poll() is None:
                # Graceful: the server shuts its kernels down and exits.
                with contextlib.suppress(Exception):
                    self.api("POST", "api/shutdown", timeout=5)
                _wait(proc, 15)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                _wait(proc, 10)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                _wait(proc, 10)
            _kill_survivors(descendants)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


def _descendants(pid: int) -> list[Any]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dev dependency
        return []
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_survivors(processes: list[Any]) -> None:
    """Kill processes (kernels run in their own sessions) that outlived the server."""
    if not processes:
        return
    import psutil

    _gone, alive = psutil.wait_procs(processes, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


# --------------------------------------------------------------------------------------------
# Browser run (Playwright + headless Chromium)
# --------------------------------------------------------------------------------------------

# Finds the open notebook panel for a path; used by the JS predicates below.
_FIND_PANEL_JS = """
(path) => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return null;
  for (const w of Array.from(app.shell.widgets('main'))) {
    if (w && w.context && w.context.path === path && w.content && w.sessionContext) return w;
  }
  return null;
}
"""

# "ename: evalue" for every error output in the panel's code cells.
_CELL_ERRORS_JS = """
(panel) => {
  const errors = [];
  for (const cell of panel.content.widgets) {
    if (cell.model.type !== 'code') continue;
    const outputs = cell.model.outputs;
    for (let i = 0; i < outputs.length; i++) {
      const out = outputs.get(i);
      if (out.type === 'error') {
        const raw = out.toJSON();
        errors.push(`${raw.ename}: ${raw.evalue}`);
      }
    }
  }
  return errors;
}
"""

_KERNEL_IDLE_JS = f"""
(path) => {{
  const panel = ({_FIND_PANEL_JS})(path);
  if (!panel || !panel.isVisible) return false;
  const sc = panel.sessionContext;
  const kernel = sc.session && sc.session.kernel;
  if (!sc.isReady || !kernel) return false;
  if (kernel.status !== 'idle' || kernel.connectionStatus !== 'connected') return false;
  const indicator = panel.node.querySelector('.jp-Notebook-ExecutionIndicator');
  return !indicator || indicator.getAttribute('data-status') === 'idle';
}}
"""

_IS_CURRENT_JS = f"""
(path) => {{
  const panel = ({_FIND_PANEL_JS})(path);
  return !!panel && window.jupyterapp.shell.currentWidget === panel;
}}
"""

# True once no code cell is queued or running, every non-empty code cell has an execution
# count, and the kernel is idle. A cell with an error output also ends the wait (Run All stops
# there); the caller reports it.
_ALL_CELLS_DONE_JS = f"""
(path) => {{
  const panel = ({_FIND_PANEL_JS})(path);
  if (!panel) return false;
  if (({_CELL_ERRORS_JS})(panel).length) return true;
  if (!({_KERNEL_IDLE_JS})(path)) return false;
  for (const cell of panel.content.widgets) {{
    if (cell.model.type !== 'code') continue;
    if (cell.model.executionState === 'running') return false;
    if (!cell.model.sharedModel.getSource().trim()) continue;
    if (cell.model.executionCount === null) return false;
  }}
  return true;
}}
"""

# Resolves to {found: true} once `text` is shown inside a rendered widget view, or to
# {errors: [...]} as soon as a cell has an error output.
_WIDGET_TEXT_JS = f"""
([path, text]) => {{
  const panel = ({_FIND_PANEL_JS})(path);
  if (!panel) return false;
  const errors = ({_CELL_ERRORS_JS})(panel);
  if (errors.length) return {{errors}};
  const found = Array.from(panel.node.querySelectorAll('{WIDGET_OUTPUT_SELECTOR}')).some(
    (el) => (el.innerText || '').includes(text));
  return found ? {{found: true}} : false;
}}
"""


# Every text of the list shown at once, in the widget outputs (a moment mid-run).
_WIDGET_TEXTS_JS = f"""
([path, texts]) => {{
  const panel = ({_FIND_PANEL_JS})(path);
  if (!panel) return false;
  const errors = ({_CELL_ERRORS_JS})(panel);
  if (errors.length) return {{errors}};
  const shown = Array.from(panel.node.querySelectorAll('{WIDGET_OUTPUT_SELECTOR}'))
    .map((el) => el.innerText || '').join('\\n');
  return texts.every((text) => shown.includes(text)) ? {{found: true}} : false;
}}
"""


class BrowserRunError(AssertionError):
    """The notebook did not reach the expected state in the browser."""


def run_notebook_in_browser(
    server: JupyterLabServer,
    notebook_name: str,
    screenshot_path: str | os.PathLike[str],
    *,
    wait_for_text: str,
    timeout: float = 180.0,
    wait_for_completion: bool = True,
    viewport: tuple[int, int] = (1400, 1000),
    checkpoints: Sequence[tuple[Sequence[str], str | os.PathLike[str]]] = (),
    captured: list[str] | None = None,
) -> str:
    """Open ``notebook_name`` in JupyterLab, run all cells, and wait for widget output.

    Steps: headless Chromium (``/usr/bin/chromium``) opens ``<base>/lab/tree/<notebook>``, waits
    until the notebook is the current document and its kernel is idle, clicks Run > Run All
    Cells, waits until ``wait_for_text`` is shown inside a rendered ipywidgets output area
    (optionally also until every code cell has finished and the kernel is idle again), and
    saves a full-page screenshot to ``screenshot_path``. Returns the visible text of the
    notebook's output areas.

    ``checkpoints``: moments to catch on the way, each ``(texts, screenshot path)``: when every one of
    ``texts`` is shown in the widget outputs at once, a screenshot is saved there and the output text is
    appended to ``captured``.

    ``timeout`` (seconds) bounds the whole run. On failure a screenshot is still written and
    :class:`BrowserRunError` carries the output text, browser console errors and the server log.
    """
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    shot = Path(screenshot_path)
    shot.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout

    def remaining_ms() -> float:
        return max(1000.0, (deadline - time.monotonic()) * 1000.0)

    console_errors: list[str] = []
    with sync_playwright() as pw:
        args = list(CHROMIUM_ARGS)
        browser = pw.chromium.launch(executable_path=CHROMIUM_PATH, headless=True, args=args)
        try:
            context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
            page = context.new_page()
            page.on("console", lambda msg: _record_console(console_errors, msg))
            page.on("pageerror", lambda err: console_errors.append(f"pageerror: {err}"))
            step = "open"
            problem = ""
            try:
                quoted = urllib.parse.quote(notebook_name)
                page.goto(server.url(f"lab/tree/{quoted}"), timeout=remaining_ms())

                step = "notebook is the current document"
                page.wait_for_function(_IS_CURRENT_JS, arg=notebook_name, timeout=remaining_ms())

                step = "kernel idle"
                page.wait_for_function(_KERNEL_IDLE_JS, arg=notebook_name, timeout=remaining_ms())

                step = "Run > Run All Cells"
                _click_run_all(page, remaining_ms())

                for texts, checkpoint_shot in checkpoints:
                    step = f"texts {list(texts)!r} at once in the widget outputs"
                    result = page.wait_for_function(
                        _WIDGET_TEXTS_JS, arg=[notebook_name, list(texts)], timeout=remaining_ms(), polling=50
                    ).json_value()
                    if result.get("errors"):
                        raise PlaywrightError("cell error: " + "; ".join(result["errors"]))
                    if captured is not None:
                        captured.append(_output_text(page))
                    shot_path = Path(checkpoint_shot)
                    shot_path.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(shot_path), full_page=True)
                    viewers = page.locator(".enginekit-viewer")
                    if viewers.count():  # and the first viewer alone, at that moment
                        viewer_shot = shot_path.with_name(f"{shot_path.stem}_viewer{shot_path.suffix}")
                        viewers.first.screenshot(path=str(viewer_shot))

                step = f"text {wait_for_text!r} in a widget output"
                result = page.wait_for_function(
                    _WIDGET_TEXT_JS, arg=[notebook_name, wait_for_text], timeout=remaining_ms()
                ).json_value()
                if result.get("errors"):
                    problem = "cell error: " + "; ".join(result["errors"])
                elif wait_for_completion:
                    step = "all cells finished"
                    done_js = _ALL_CELLS_DONE_JS
                    page.wait_for_function(done_js, arg=notebook_name, timeout=remaining_ms())
                    errors = page.evaluate(
                        f"(path) => ({_CELL_ERRORS_JS})(({_FIND_PANEL_JS})(path))", notebook_name
                    )
                    if errors:
                        problem = "cell error: " + "; ".join(errors)
            except PlaywrightError as exc:
                problem = str(exc)
            with contextlib.suppress(PlaywrightError):
                page.screenshot(path=str(shot), full_page=True)
            outputs = ""
            with contextlib.suppress(PlaywrightError):
                outputs = _output_text(page)
            if problem:
                raise BrowserRunError(
                    f"browser run of {notebook_name} failed at step: {step}\n{problem}\n"
                    f"----- output areas -----\n{outputs}\n"
                    "----- browser console errors -----\n"
                    + "\n".join(console_errors[-30:])
                    + f"\n----- server log -----\n{server.log_tail()}\n(screenshot: {shot})"
                )
            return outputs
        finally:
            browser.close()


def _record_console(sink: list[str], message: Any) -> None:
    if message.type == "error":
        sink.append(message.text)


def _click_run_all(page: Any, timeout_ms: float) -> None:
    menu = page.locator(
        ".lm-MenuBar-item", has=page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$"))
    )
    menu.first.click(timeout=timeout_ms)
    item = page.locator(
        ".lm-Menu-item:not(.lm-mod-disabled)",
        has=page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")),
    )
    item.first.click(timeout=timeout_ms)


def _output_text(page: Any) -> str:
    texts = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output")
    return "\n".join(text.strip() for text in texts.all_inner_texts() if text.strip())
