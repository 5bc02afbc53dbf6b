"""Engine: the one facade over every mode (in-process, background process, asyncio)."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any

from enginekit.client import EngineCoreClient, make_client
from enginekit.config import EngineConfig, EngineMode, resolve_mode
from enginekit.core.validation import RequestLimits
from enginekit.errors import EngineShutdownError
from enginekit.logs import show_logs
from enginekit.model.loader import ModelSpec, load_model_spec
from enginekit.model.tokenizer import Tokenizer
from enginekit.notebook import GenerationHandle, start_background, watcher_for
from enginekit.output_processor import RequestState
from enginekit.output_router import OutputRouter
from enginekit.outputs import RequestOutput
from enginekit.prompts import normalize_params, normalize_prompts, prepare_request
from enginekit.runtime import exit_hooks
from enginekit.sampling_params import SamplingParams

__all__ = ["Engine"]

logger = logging.getLogger("enginekit")


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
        self._spec: ModelSpec | None = None
        self._client: EngineCoreClient | None = None
        self._request_counter = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:6]
        self._start()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._spec is None or self._spec.name != self.config.model:
            self._spec = load_model_spec(self.config.model)  # the tokenizer is read once, not per restart
        show_logs(self.config.log_level)
        self._client = make_client(self.mode, self.config, self._spec)
        self._router = OutputRouter(self._client)
        self.max_model_len = self._client.max_model_len
        config = self._spec.config
        self._limits = RequestLimits(config.vocab_size, config.hidden_size, self.max_model_len)
        exit_hooks.register(self)
        logger.info("engine started: mode=%s pid=%s", self.mode, self._client.engine_pid)

    @property
    def is_running(self) -> bool:
        """Whether the engine is up (not shut down and not dead)."""
        return self._client is not None and self._client.is_alive

    @property
    def engine_pid(self) -> int | None:
        """Process id of the engine core (this process in ``"inproc"`` mode)."""
        return self._client.engine_pid if self._client is not None else None

    @property
    def client(self) -> EngineCoreClient:
        """The client driving the engine core (for diagnostics); raises once the engine is shut down."""
        if self._client is None:
            raise EngineShutdownError("the engine is shut down; call engine.restart() to start it again")
        return self._client

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer the engine encodes prompts with (``encode(text)``, ``decode(ids)``)."""
        assert self._spec is not None
        return self._spec.tokenizer

    tokenizer = property(get_tokenizer)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and release everything it holds; safe to call twice, and from another thread."""
        client, self._client = self._client, None
        if client is None:
            return
        exit_hooks.unregister(self)
        self._router.fail_all(
            EngineShutdownError("the engine was shut down; call engine.restart() to start it again")
        )
        client.shutdown(timeout)

    def restart(self, *, mode: EngineMode | None = None, **options: Any) -> None:
        """Shut down (also after the engine died) and start again, optionally in another mode or config.

        The new mode and options are checked first: a bad one raises and leaves the running engine alone.
        """
        new_mode = resolve_mode(mode) if mode is not None else self.mode
        new_config = self.config.replace(**options) if options else self.config
        self.shutdown()
        self.config, self.mode = new_config, new_mode
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
        return f"Engine(mode={self.mode!r}, model={self.config.model or 'builtin'!r}, {state}, pid={self.engine_pid})"

    # ---- requests -----------------------------------------------------------------------------------
    def _submit(self, prompts: Any, params: Any, *, single: str = "") -> list[RequestState]:
        """Validate every prompt, then send them all; nothing is sent if one is bad."""
        items = normalize_prompts(prompts)
        if single and len(items) != 1:
            raise ValueError(f"{single} takes one prompt; use generate for a batch")
        all_params = normalize_params(params, len(items))
        client, tokenizer, now = self.client, self.get_tokenizer(), time.time()
        requests = []
        for item, item_params in zip(items, all_params):
            request_id = f"{self._id_prefix}-{next(self._request_counter)}"
            requests.append(prepare_request(item, item_params, request_id, tokenizer, self._limits, now))
        states = []
        try:
            for request, text in requests:
                state = RequestState(
                    request.request_id,
                    text,
                    request.prompt_token_ids,
                    request.sampling_params.logprobs is not None,
                )
                self._router.track(state)
                states.append(state)
                client.add_request(request)
        except BaseException:
            self._abort(states)
            raise
        return states

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests by id; their outputs finish with ``finish_reason="abort"``. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_id must be a string or a list of strings, got {request_id!r}")
        self.client.abort_requests(ids)

    def _abort(self, states: list[RequestState]) -> None:
        """Forget and abort this call's unfinished requests (it was interrupted, cancelled or left early)."""
        ids = self._router.forget(states)
        if ids and self._client is not None and self._client.is_alive:
            try:
                self._client.abort_requests(ids)
            except Exception:
                logger.debug("abort after interrupt failed", exc_info=True)

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
        attach_watcher = watcher_for(progress, viewer)
        states = self._submit(prompts, params)
        watcher = attach_watcher(self, [s.output for s in states])
        try:
            self._router.wait(states, watcher)
        except BaseException:
            self._abort(states)
            raise
        finally:
            watcher.close()
        return [state.output for state in states]

    def stream(self, prompt: Any, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative ``RequestOutput`` each time new text arrives; the last is finished.

        Leaving the loop early (``break``, an exception, ``KeyboardInterrupt``) aborts the request.
        """
        (state,) = self._submit(prompt, params, single="stream")
        seen = 0
        try:
            while True:
                self._router.wait_update(state, seen)
                seen = state.version
                snapshot = state.snapshot()
                yield snapshot
                if snapshot.finished:  # NOTE: not state.finished, which may have changed while we yielded
                    return
        finally:
            if not state.finished:
                self._abort([state])

    def agenerate(
        self,
        prompts: Any,
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
        viewer: Any = None,
    ) -> Coroutine[Any, Any, list[RequestOutput]]:
        """Async ``generate``: submits now, and returns a coroutine to await for the outputs (any mode).

        Bad prompts raise here, before anything is sent. Cancelling the awaiting task aborts the requests.
        """
        attach_watcher = watcher_for(progress, viewer)
        states = self._submit(prompts, params)
        return self._collect(states, attach_watcher(self, [s.output for s in states]))

    async def _collect(self, states: list[RequestState], watcher: Any) -> list[RequestOutput]:
        try:
            await self._router.wait_async(states, watcher)
        except BaseException:
            self._abort(states)
            raise
        finally:
            watcher.close()
        return [state.output for state in states]

    async def astream(
        self, prompt: Any, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Async ``stream``: yields cumulative outputs as tokens arrive; cancelling aborts the request."""
        (state,) = self._submit(prompt, params, single="astream")
        seen = 0
        try:
            while True:
                await self._router.wait_update_async(state, seen)
                seen = state.version
                snapshot = state.snapshot()
                yield snapshot
                if snapshot.finished:
                    return
        finally:
            if not state.finished:
                self._abort([state])

    def generate_background(
        self,
        prompts: Any,
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
        viewer: Any = None,
    ) -> GenerationHandle:
        """Start generating on this thread's running asyncio loop and return a handle at once.

        In a notebook the cell returns immediately; the kernel's loop runs the generation between and during
        later cells, and a viewer keeps updating. ``await handle`` (or ``handle.result()``) gives one finished
        ``RequestOutput`` per prompt; ``handle.cancel()`` aborts. See ``enginekit.notebook.GenerationHandle``.
        """
        return start_background(self, prompts, params, progress=progress, viewer=viewer)

    # ---- utilities ----------------------------------------------------------------------------------
    def call_utility(self, method_name: str, *args: Any, timeout: float | None = 30.0) -> Any:
        """Call ``EngineCore.utility_<method_name>(*args)`` in the engine and return its result.

        Raises ``UtilityCallError`` if the method is unknown or fails there (the engine keeps running),
        ``TimeoutError`` past ``timeout`` seconds and ``EngineDeadError`` if the engine dies meanwhile.
        """
        _check_method_name(method_name)
        return self.client.call_utility(method_name, *args, timeout=timeout)

    async def acall_utility(self, method_name: str, *args: Any, timeout: float | None = 30.0) -> Any:
        """Async ``call_utility``."""
        _check_method_name(method_name)
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


def _check_method_name(method_name: Any) -> None:
    if not isinstance(method_name, str) or not method_name.isidentifier():
        raise ValueError(f"method_name must be an identifier, got {method_name!r}")
