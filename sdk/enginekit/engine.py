"""Engine: the one facade over every mode (in-process, background process, asyncio)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from enginekit import _exit
from enginekit.client.base import EngineCoreClient
from enginekit.config import EngineConfig, EngineMode, resolve_mode
from enginekit.core.messages import EngineCoreRequest
from enginekit.errors import EngineDeadError, EngineShutdownError
from enginekit.model.loader import load_model_config
from enginekit.model.tokenizer import load_tokenizer
from enginekit.notebook.background import GenerationHandle
from enginekit.notebook.loop import run_sync
from enginekit.notebook.viewer import Viewer, check_viewer_argument
from enginekit.output_processor import OutputProcessor, RequestState
from enginekit.outputs import RequestOutput
from enginekit.prompts import Prompt, normalize_params, normalize_prompts, prepare_prompt
from enginekit.sampling_params import SamplingParams

__all__ = ["Engine"]

logger = logging.getLogger("enginekit")

_POLL_S = 0.05  # how often a blocked sync wait re-checks engine liveness and its own requests


class Engine:
    """Run an LLM engine in this process or a background process, with one API.

    Parameters
    ----------
    model
        A local Hugging Face checkpoint folder, or ``None`` for the built-in tiny model.
    mode
        ``"inproc"`` (this process), ``"mp"`` (a background process; the default) or ``"async"`` (a
        background process driven from the caller's asyncio loop). ``None`` reads ``ENGINEKIT_MODE``.
    **options
        Engine options, see :class:`enginekit.EngineConfig` (e.g. ``max_model_len``, ``num_kv_blocks``,
        ``max_num_seqs``). An unknown option raises ``TypeError`` naming the closest valid one.

    Examples
    --------
    >>> with Engine(mode="inproc") as engine:
    ...     out = engine.generate("Hello", SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str | None = None, *, mode: EngineMode | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_options(model, **options)
        self.mode: EngineMode = resolve_mode(mode)
        self._client: EngineCoreClient | None = None
        self._request_counter = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:6]
        # Serialises pulling and routing outputs, so deltas are applied in the order they were produced.
        # Submissions do not take it: the clients are safe to call from several threads.
        self._lock = threading.RLock()
        self._start()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def _start(self) -> None:
        model_config = load_model_config(self.config.model)
        self._model_config = model_config
        self.tokenizer = load_tokenizer(
            None if self.config.model is None else _path(self.config.model),
            bos_token_id=model_config.bos_token_id,
            eos_token_id=(model_config.eos_token_ids or (None,))[0],
        )
        self._processor = OutputProcessor()
        self._output_handlers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        _show_logs(self.config.log_level)
        self._client = EngineCoreClient.make_client(self.mode, self.config)
        self.max_model_len = self._client.max_model_len
        _exit.register(self)
        logger.info("engine started: mode=%s pid=%s", self.mode, self._client.engine_pid)

    @property
    def is_running(self) -> bool:
        """Whether the engine is up (not shut down and not dead)."""
        return self._client is not None and self._client.is_alive

    @property
    def engine_pid(self) -> int | None:
        """Process id of the engine core (this process in ``"inproc"`` mode)."""
        return self._client.engine_pid if self._client is not None else None

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and release everything it holds; safe to call twice."""
        client, self._client = self._client, None
        for state in self._processor.fail_all():
            del state
        if client is not None:
            _exit.unregister(self)
            client.shutdown(timeout)

    def restart(self, *, mode: EngineMode | None = None, **options: Any) -> None:
        """Shut down (also after the engine died) and start again, optionally in another mode or config."""
        self.shutdown()
        if options:
            self.config = self.config.replace(**options)
        if mode is not None:
            self.mode = resolve_mode(mode)
        self._start()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            if getattr(self, "_client", None) is not None:
                self.shutdown()
        except Exception:  # NOTE: never raise from a finalizer
            pass

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        model = self.config.model or "built-in tiny model"
        return f"Engine(mode={self.mode!r}, model={model!r}, {state}, pid={self.engine_pid})"

    @property
    def client(self) -> EngineCoreClient:
        client = self._client
        if client is None:
            raise EngineShutdownError("the engine is shut down; call engine.restart() to start it again")
        return client

    # ---- requests -----------------------------------------------------------------------------------
    def _prepare(self, prompts: Any, params: Any) -> list[tuple[Prompt, SamplingParams]]:
        items = normalize_prompts(prompts)
        all_params = normalize_params(params, len(items))
        vocab, hidden = self._model_config.vocab_size, self._model_config.hidden_size
        prepared = [prepare_prompt(p, self.tokenizer, self.max_model_len, vocab, hidden) for p in items]
        return list(zip(prepared, all_params))

    def _new_request(self, prompt: Prompt, params: SamplingParams) -> tuple[RequestState, EngineCoreRequest]:
        request_id = f"{self._id_prefix}-{next(self._request_counter)}"
        state = RequestState(request_id, prompt.text, prompt.token_ids, params.logprobs is not None)
        message = EngineCoreRequest(request_id, prompt.token_ids, params, time.time(), prompt.embeds)
        return state, message

    def _submit(self, prepared: list[tuple[Prompt, SamplingParams]]) -> list[RequestState]:
        client = self.client
        states = []
        for prompt, params in prepared:
            state, message = self._new_request(prompt, params)
            self._processor.add(state)
            states.append(state)
            client.add_request(message)
        return states

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests by id; their outputs finish with ``finish_reason="abort"``. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.client.abort_requests(ids)

    # ---- sync API -----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
        viewer: Any = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a batch; returns one finished ``RequestOutput`` per prompt, in order.

        Parameters
        ----------
        prompts
            A string, a list of strings, a list of token ids, a list of token-id lists, or dicts with one
            of ``"prompt"``, ``"prompt_token_ids"``, ``"prompt_embeds"`` (a ``[num_tokens, hidden]`` tensor).
        params
            One ``SamplingParams`` for all prompts, or one per prompt.
        progress
            Show a progress bar; ``None`` shows one for batches of 16 or more prompts.
        viewer
            ``True`` or a ``Viewer`` to watch the requests live (a widget in Jupyter, text elsewhere).

        Raises ``KeyboardInterrupt`` after aborting this call's requests when interrupted.
        """
        check_viewer_argument(viewer)
        prepared = self._prepare(prompts, params)
        if self.mode == "async":
            return run_sync(
                self.agenerate(prompts, params, progress=progress, viewer=viewer, _prepared=prepared)
            )
        states = self._submit(prepared)
        watcher = _make_watcher(self, states, progress, viewer)
        try:
            self._wait(states, watcher)
        except BaseException:
            self._abort_unfinished(states)
            raise
        finally:
            if watcher is not None:
                watcher.close()
        return [state.output for state in states]

    def stream(self, prompt: Any, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative ``RequestOutput`` each time new text arrives; the last is finished.

        Leaving the loop early (``break``, an exception, ``KeyboardInterrupt``) aborts the request.
        """
        prepared = self._prepare(prompt, params)
        if len(prepared) != 1:
            raise ValueError("stream takes one prompt; use generate for a batch")
        if self.mode == "async":
            yield from _sync_iter(self.astream(prompt, params))
            return
        (state,) = self._submit(prepared)
        seen = 0
        try:
            while True:
                while state.version == seen:
                    self._pump(state)
                seen = state.version
                snapshot = state.snapshot()
                yield snapshot
                # NOTE: not state.finished: the request may have finished while the caller held the
                # snapshot, and its final output must still be yielded.
                if snapshot.finished:
                    return
        finally:
            if not state.finished:
                self._abort_unfinished([state])

    def _wait(self, states: list[RequestState], watcher: Any = None) -> None:
        for state in states:
            while not state.finished:
                self._pump(state)
                if watcher is not None:
                    watcher.update()

    def _pump(self, state: RequestState) -> None:
        """Pull one batch of outputs from the engine and route it to every request it concerns."""
        client = self.client
        with self._lock:
            if state.finished:
                return
            try:
                batch = client.get_output(timeout=_POLL_S)
            except EngineDeadError:
                self._processor.fail_all()
                raise
            if batch is not None:
                self._processor.process(batch)
        if not state.finished and state.output.request_id not in self._processor.states:
            raise EngineDeadError("the engine lost this request")

    def _abort_unfinished(self, states: list[RequestState]) -> None:
        ids = [s.output.request_id for s in states if not s.finished]
        for request_id in ids:
            self._processor.states.pop(request_id, None)
        if ids and self._client is not None and self._client.is_alive:
            try:
                self.abort(ids)
            except Exception:
                logger.debug("abort after interrupt failed", exc_info=True)

    # ---- async API ----------------------------------------------------------------------------------
    async def agenerate(
        self,
        prompts: Any,
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
        viewer: Any = None,
        _prepared: list | None = None,
    ) -> list[RequestOutput]:
        """Async ``generate``: awaits all outputs without blocking the loop (any mode)."""
        check_viewer_argument(viewer)
        prepared = _prepared if _prepared is not None else self._prepare(prompts, params)
        states = await self._asubmit(prepared)
        return await self._acollect(states, _make_watcher(self, states, progress, viewer))

    async def _acollect(self, states: list[RequestState], watcher: Any) -> list[RequestOutput]:
        try:
            for state in states:
                while not state.finished:
                    await self._await_update(state, state.version)
                    if watcher is not None:
                        watcher.update()
        except BaseException:
            await self._aabort_unfinished(states)
            raise
        finally:
            if watcher is not None:
                watcher.close()
        return [state.output for state in states]

    async def astream(
        self, prompt: Any, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Async ``stream``: yields cumulative outputs as tokens arrive; cancelling aborts the request."""
        prepared = self._prepare(prompt, params)
        if len(prepared) != 1:
            raise ValueError("astream takes one prompt; use agenerate for a batch")
        (state,) = await self._asubmit(prepared)
        seen = 0
        try:
            while True:
                while state.version == seen:
                    await self._await_update(state, seen)
                seen = state.version
                snapshot = state.snapshot()
                yield snapshot
                # NOTE: not state.finished: the request may have finished while the caller held the
                # snapshot, and its final output must still be yielded.
                if snapshot.finished:
                    return
        finally:
            if not state.finished:
                await self._aabort_unfinished([state])

    def generate_background(
        self,
        prompts: Any,
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
        viewer: Any = None,
    ) -> GenerationHandle:
        """Start generating on this thread's running asyncio loop and return a handle at once.

        Only in ``"async"`` mode. In a notebook the cell returns immediately; the kernel's loop runs the
        generation between and during later cells, and a viewer keeps updating. ``await handle`` (or
        ``handle.result()``) gives one finished ``RequestOutput`` per prompt; ``handle.cancel()`` aborts.

        Parameters
        ----------
        prompts, params, progress, viewer
            As for ``generate``. A viewer is displayed in the calling cell before this returns.

        Raises
        ------
        RuntimeError
            In another mode, or with no asyncio loop running in this thread (a plain script).
        """
        if self.mode != "async":
            raise RuntimeError(
                f"generate_background needs mode='async', this engine runs in mode={self.mode!r}: "
                "call engine.restart(mode='async') first, or use engine.generate"
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "generate_background needs a running asyncio loop in this thread: call it from a notebook "
                "cell or a coroutine (in a script, inside asyncio.run(...)), or use engine.generate"
            ) from None
        check_viewer_argument(viewer)
        if viewer is True:
            viewer = Viewer()
        # Submitted and watched now, in the calling cell: the viewer or progress bar is displayed there.
        states = self._submit(self._prepare(prompts, params))
        watcher = _make_watcher(self, states, progress, viewer)

        def clean_up() -> None:  # also when the task is cancelled before it ever ran
            self._abort_unfinished(states)
            if watcher is not None:
                watcher.close()

        return GenerationHandle(
            self._acollect(states, watcher),
            states=states,
            viewer=viewer if isinstance(viewer, Viewer) else None,
            on_done=clean_up,
        )

    async def _asubmit(self, prepared: list[tuple[Prompt, SamplingParams]]) -> list[RequestState]:
        client = self.client
        states = []
        for prompt, params in prepared:
            state, message = self._new_request(prompt, params)
            self._processor.add(state)
            states.append(state)
            await client.add_request_async(message)
        return states

    async def _await_update(self, state: RequestState, seen: int) -> None:
        client = self.client
        if self.mode != "async":
            # No output task: this coroutine steps (inproc) or polls (mp) once, routes what came, and
            # yields to the loop; the caller re-checks its own request, which another task may have served.
            batch = client.get_output(0)
            if batch is not None:
                self._processor.process(batch)
            await asyncio.sleep(0 if self.mode == "inproc" else 0.001 * (batch is None))
            return
        handler = self._ensure_output_handler()
        tracked = self._processor.states  # a shutdown (or restart) forgets every request it tracks
        request_id = state.output.request_id
        event = asyncio.Event()
        state.listener = event.set
        try:
            while state.version == seen and not handler.done() and request_id in tracked:
                await event.wait()
                event.clear()
        finally:
            state.listener = None
        if state.version == seen and handler.done():
            error = handler.exception() if not handler.cancelled() else None
            raise error or EngineDeadError("the engine's output handler stopped")
        if state.version == seen:
            raise EngineShutdownError(
                f"the engine was shut down while request {request_id} ran; call engine.restart() to start it again"
            )

    def _ensure_output_handler(self) -> asyncio.Task:
        """One task per event loop routes the async client's outputs to the waiting requests."""
        loop = asyncio.get_running_loop()
        # NOTE: a task holds its loop, so the weak key never dies by itself: drop the entries of closed loops
        # (each sync call outside a loop runs on a new one), or every call would leak a loop.
        for closed in [other for other in self._output_handlers if other.is_closed()]:
            del self._output_handlers[closed]
        task = self._output_handlers.get(loop)
        if task is None or (task.done() and self.is_running):
            task = loop.create_task(
                _output_handler(weakref.ref(self), self.client), name="enginekit-output-handler"
            )
            task.add_done_callback(_retrieve_exception)
            self._output_handlers[loop] = task
        return task

    async def _aabort_unfinished(self, states: list[RequestState]) -> None:
        ids = [s.output.request_id for s in states if not s.finished]
        for request_id in ids:
            self._processor.states.pop(request_id, None)
        if ids and self._client is not None and self._client.is_alive:
            try:
                await self._client.abort_requests_async(ids)
            except Exception:
                logger.debug("abort after cancellation failed", exc_info=True)

    # ---- utilities ----------------------------------------------------------------------------------
    def call_utility(self, method_name: str, *args: Any, timeout: float | None = 30.0) -> Any:
        """Call ``EngineCore.utility_<method_name>(*args)`` in the engine and return its result.

        Raises ``UtilityCallError`` if the method is unknown or fails there (the engine keeps running),
        ``TimeoutError`` past ``timeout`` seconds and ``EngineDeadError`` if the engine dies meanwhile.
        """
        if not isinstance(method_name, str) or not method_name.isidentifier():
            raise ValueError(f"method_name must be an identifier, got {method_name!r}")
        if self.mode == "async":
            return run_sync(self.acall_utility(method_name, *args, timeout=timeout))
        return self.client.call_utility(method_name, *args, timeout=timeout)

    async def acall_utility(self, method_name: str, *args: Any, timeout: float | None = 30.0) -> Any:
        """Async ``call_utility``."""
        if self.mode == "async":
            self._ensure_output_handler()
        return await self.client.call_utility_async(method_name, *args, timeout=timeout)

    def get_stats(self) -> dict[str, Any]:
        """Engine statistics: running and waiting requests, KV-cache usage, prefix-cache hit rate, ..."""
        stats = self.call_utility("get_stats")
        stats.update(mode=self.mode, engine_pid=self.engine_pid)
        return stats

    def ping(self) -> bool:
        """A cheap liveness check through the whole request path."""
        return self.call_utility("ping") == "pong"

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (only possible while no request runs); returns whether it did."""
        return self.call_utility("reset_prefix_cache")


async def _output_handler(engine_ref: weakref.ref, client: EngineCoreClient) -> None:
    # NOTE: holds the engine only weakly, so a dropped engine is collected and its handler ends.
    while True:
        try:
            batch = await client.get_output_async()
        except EngineDeadError:
            engine = engine_ref()
            if engine is not None:
                engine._processor.fail_all()  # wakes every waiter, which then sees this task's error
            raise
        engine = engine_ref()
        if engine is None:
            return
        try:
            engine._processor.process(batch)
        finally:
            del engine


def _retrieve_exception(task: asyncio.Task) -> None:
    # The engine's death reaches every waiter through the client; a handler that nobody awaited (only utility
    # calls were pending) must not also log "Task exception was never retrieved" when it is collected.
    if not task.cancelled():
        task.exception()


def _sync_iter(agen: AsyncIterator[RequestOutput]) -> Iterator[RequestOutput]:
    try:
        while True:
            try:
                yield run_sync(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        run_sync(agen.aclose())


def _make_watcher(engine: Engine, states: list[RequestState], progress: bool | None, viewer: Any):
    if viewer is not None and viewer is not False:
        from enginekit.notebook.viewer import attach_viewer

        return attach_viewer(viewer, engine, states)
    if progress or (progress is None and len(states) >= 16):
        from enginekit.notebook.progress import ProgressWatcher

        return ProgressWatcher(states)
    return None


def _show_logs(log_level: str) -> None:
    """``log_level="info"``/``"debug"``: let enginekit's records through and show them if logging is unset."""
    if log_level == "warning":
        return
    level = logging.INFO if log_level == "info" else logging.DEBUG
    package_logger = logging.getLogger("enginekit")
    if package_logger.getEffectiveLevel() > level:
        package_logger.setLevel(level)
    if not package_logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)


def _path(model: str):
    from pathlib import Path

    return Path(model)
