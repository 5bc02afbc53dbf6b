"""Engine: the one facade over every mode (in-process, background process, asyncio)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from enginekit.client import EngineCoreClient, check_client, make_client
from enginekit.config import EngineConfig, EngineMode, resolve_mode
from enginekit.core.resources import check_startup
from enginekit.errors import EngineShutdownError, add_note
from enginekit.frontend.call_options import (
    ChatGenerateOptions,
    ChatOptions,
    ChatStreamOptions,
    GenerateOptions,
    StreamOptions,
    takes,
)
from enginekit.frontend.chat import render_chat
from enginekit.frontend.lora import LoRAMethods
from enginekit.frontend.output_processor import RequestState, watched
from enginekit.frontend.output_router import OutputRouter, Watcher, submit
from enginekit.frontend.prompts import RequestBuilder
from enginekit.frontend.resources import EngineResources
from enginekit.logs import show_logs
from enginekit.model.loader import ModelSpec, load_model_spec
from enginekit.model.text.tokenizer import Tokenizer
from enginekit.notebook import GenerationHandle, start_background, watcher_for, watches_live
from enginekit.outputs import RequestOutput
from enginekit.runtime import exit_hooks
from enginekit.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Engine"]

logger = logging.getLogger("enginekit")
_T = TypeVar("_T")
Params = SamplingParams | list[SamplingParams] | None
OneParams = SamplingParams | None


class Engine(LoRAMethods):
    """Run an LLM engine in this process or a background process, with one API.

    Parameters
    ----------
    model
        ``None`` for the default model (SmolLM2-135M-Instruct), a local Hugging Face folder, a ``.gguf`` file,
        or a model name: ``"smollm2-135m-instruct"``, ``"builtin"`` (a tiny random model for fast tests).
    mode
        ``"inproc"`` (this process), ``"mp"`` (a background process; the default) or ``"async"`` (a
        background process driven from the caller's asyncio loop). ``None`` reads ``ENGINEKIT_MODE``.
    **options
        Engine options, see :class:`enginekit.EngineConfig` (e.g. ``max_model_len``, ``num_kv_blocks``,
        ``dtype``). An unknown option raises ``TypeError`` naming the closest valid one.

    Examples
    --------
    >>> with Engine() as engine:
    ...     print(engine.chat([{"role": "user", "content": "Hi!"}])[0].text)
    """

    def __init__(self, model: str | None = None, *, mode: EngineMode | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_options(model, **options)
        self.mode: EngineMode = resolve_mode(mode)
        self._spec: ModelSpec | None = None
        # What shutdown releases, apart from the engine: collecting the engine, or the exit, releases it too.
        self._resources = EngineResources()
        self._finalizer = exit_hooks.register(self, self._resources.close, 0.0)
        self._start()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def _start(self) -> None:
        check_client(self.mode, self.config)
        self._spec = self._spec_for(self.config)
        check_startup(self.config, self._spec.config)
        show_logs(self.config.log_level)
        self._resources.client = self._client = make_client(self.mode, self.config, self._spec)
        self._router = self._resources.router = OutputRouter(self._client)
        tokenizer = self._spec.tokenizer  # NOTE: not self: a cycle would keep `del engine` from shutting down
        self._decode = functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))
        self.max_model_len = self._client.max_model_len
        self._requests = RequestBuilder.for_engine(self._spec, self.config, self.max_model_len)
        logger.info("engine started: mode=%s pid=%s", self.mode, self._client.engine_pid)

    def _spec_for(self, config: EngineConfig) -> ModelSpec:
        if self._spec is not None and self._spec.source_key == (config.model, config.revision):
            return self._spec  # the tokenizer is read once, not per restart
        return load_model_spec(config.model, config.revision)

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
        """The tokenizer prompts are encoded with: ``encode(text)`` and ``decode(token_ids)``."""
        assert self._spec is not None
        return self._spec.tokenizer

    tokenizer = property(get_tokenizer)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and release everything it holds; safe to call twice, and from another thread."""
        self._client = None
        self._resources.close(timeout)

    def restart(self, *, mode: EngineMode | None = None, **options: Any) -> None:
        """Shut down (also after the engine died) and start again, optionally in another mode or config.

        The mode, the options, the model, the device and whether ``max_model_len`` fits are checked before the
        running engine stops. If the new engine still fails to start, the previous mode and config are kept
        and the previous engine is started again (the error's notes say whether it did).
        """
        new_mode = resolve_mode(mode) if mode is not None else self.mode
        new_config = self.config.replace(**options) if options else self.config
        check_client(new_mode, new_config)
        check_startup(new_config, self._spec_for(new_config).config)
        previous = self.config, self.mode
        self.shutdown()
        self.config, self.mode = new_config, new_mode
        try:
            self._start()
        except BaseException as error:
            if (new_config, new_mode) != previous:
                self.config, self.mode = previous
                add_note(error, self._start_previous())
            raise

    def _start_previous(self) -> str:
        try:
            self._start()
        except Exception as error:
            return f"the previous engine could not be started again either: {error}"
        return "the previous mode and config are kept, and the previous engine runs again"

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"Engine(mode={self.mode!r}, model={self.config.model!r}, {state}, pid={self.engine_pid})"

    # ---- requests -----------------------------------------------------------------------------------
    def _submit(
        self, prompts: Any, params: Any, single: str = "", request_id: Any = None, **how: Any
    ) -> list[RequestState]:
        """Build, check and send the requests of one call (``how``: ``final_only``, see ``RequestBuilder``)."""
        built = self._requests.build(prompts, params, single=single, request_id=request_id, **how)
        return submit(built, self._router, self._decode)

    def _begin(
        self, prompts: Any, params: Any, options: GenerateOptions, *, blocking: bool = False
    ) -> tuple[list[RequestState], Watcher]:
        """Submit a generate-like call's requests; they and what watches them (a viewer, a progress bar)."""
        viewer = options.get("viewer")
        attach_watcher = watcher_for(options.get("use_tqdm"), viewer, blocking=blocking)
        lora, only_end = options.get("lora_request"), not watches_live(viewer)
        states = self._submit(
            prompts, params, "", options.get("request_id"), final_only=only_end, lora_request=lora
        )
        return states, attach_watcher(self, *watched(states))

    def _chat(self, call: Callable[..., _T], messages: Any, params: Any, options: Mapping[str, Any]) -> _T:
        """A chat call: its conversations rendered as prompts, then ``call`` with the other options."""
        assert self._spec is not None
        keys = ChatOptions.__optional_keys__
        chat_options = {name: value for name, value in options.items() if name in keys}
        rest = {name: value for name, value in options.items() if name not in keys}
        return call(*render_chat(self._spec, messages, params, **chat_options), **rest)

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests by id; their outputs finish with ``finish_reason="abort"``. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_id must be a string or a list of strings, got {request_id!r}")
        self.client.abort_requests(self._router.processor.engine_ids(ids))

    @takes(GenerateOptions)
    def generate(
        self, prompts: Any, sampling_params: Params = None, **options: Unpack[GenerateOptions]
    ) -> list[RequestOutput]:
        """Generate for one prompt or a batch; returns one finished ``RequestOutput`` per prompt, in order.

        ``prompts``: a string, token ids, or a dict with one of ``"prompt"``, ``"prompt_token_ids"``,
        ``"prompt_embeds"`` (a ``[num_tokens, hidden]`` tensor); or a list of these. ``sampling_params`` (alias
        ``params``): one ``SamplingParams`` for all, or one per prompt. Options (``GenerateOptions``):
        ``use_tqdm`` (alias ``progress``): a progress bar (``None``: for 16 prompts or more); ``viewer``: ``True``
        or a ``Viewer`` to watch live; ``request_id``: your id (a list for a batch); ``lora_request``: a
        ``LoRARequest`` for every prompt, or one (or ``None``) per prompt. Interrupted, it aborts its requests.
        """
        return self._router.collect(*self._begin(prompts, sampling_params, options, blocking=True))

    @takes(StreamOptions)
    def stream(
        self, prompt: Any, sampling_params: OneParams = None, **options: Unpack[StreamOptions]
    ) -> Iterator[RequestOutput]:
        """Yield the request's ``RequestOutput`` each time new text arrives (the output so far; only what is new with
        ``output_kind=DELTA``; only the end with ``FINAL_ONLY``); the last is finished. Leaving early aborts it."""
        lora = options.get("lora_request")
        states = self._submit(prompt, sampling_params, "stream", options.get("request_id"), lora_request=lora)
        return self._router.stream(*states)

    @takes(GenerateOptions)
    def agenerate(
        self, prompts: Any, sampling_params: Params = None, **options: Unpack[GenerateOptions]
    ) -> Coroutine[Any, Any, list[RequestOutput]]:
        """Async ``generate``: submits now (bad prompts raise here) and returns a coroutine to await (any mode).

        Cancelling the task that awaits it aborts the requests.
        """
        return self._router.collect_async(*self._begin(prompts, sampling_params, options))

    @takes(StreamOptions)
    def astream(
        self, prompt: Any, sampling_params: OneParams = None, **options: Unpack[StreamOptions]
    ) -> AsyncIterator[RequestOutput]:
        """Async ``stream``: yields outputs as tokens arrive; cancelling aborts the request."""
        lora = options.get("lora_request")
        states = self._submit(
            prompt, sampling_params, "astream", options.get("request_id"), lora_request=lora
        )
        return self._router.stream_async(*states)

    @takes(GenerateOptions)
    def generate_background(
        self, prompts: Any, sampling_params: Params = None, **options: Unpack[GenerateOptions]
    ) -> GenerationHandle:
        """Start generating on this thread's running asyncio loop (mode ``"async"``); returns a
        ``GenerationHandle`` at once: ``await handle`` for the outputs, ``handle.cancel()`` to abort."""
        return start_background(self, prompts, sampling_params, **options)

    @takes(ChatGenerateOptions)
    def chat(
        self, messages: Any, sampling_params: Params = None, **options: Unpack[ChatGenerateOptions]
    ) -> list[RequestOutput]:
        """Answer a conversation (``[{"role": ..., "content": ...}, ...]``) or a list of them, like vLLM's ``LLM.chat``.

        The model's chat template renders each (or ``chat_template``, Jinja source); generation stops at the
        template's end-of-turn token. Raises ``ValueError`` if the model has no template and none is given.
        Other options as for ``generate``.
        """
        return self._chat(self.generate, messages, sampling_params, options)

    @takes(ChatGenerateOptions)
    def achat(
        self, messages: Any, sampling_params: Params = None, **options: Unpack[ChatGenerateOptions]
    ) -> Coroutine[Any, Any, list[RequestOutput]]:
        """``chat`` for asyncio, as ``agenerate`` is to ``generate``: submits now, returns a coroutine to await."""
        return self._chat(self.agenerate, messages, sampling_params, options)

    @takes(ChatStreamOptions)
    def stream_chat(
        self,
        messages: Any,
        sampling_params: OneParams = None,
        **options: Unpack[ChatStreamOptions],
    ) -> Iterator[RequestOutput]:
        """Stream the answer to one conversation, as ``stream`` does for a prompt."""
        return self._chat(self.stream, messages, sampling_params, options)

    @takes(ChatStreamOptions)
    def astream_chat(
        self,
        messages: Any,
        sampling_params: OneParams = None,
        **options: Unpack[ChatStreamOptions],
    ) -> AsyncIterator[RequestOutput]:
        """Async ``stream_chat``, as ``astream`` is to ``stream``."""
        return self._chat(self.astream, messages, sampling_params, options)

    # ---- utilities ----------------------------------------------------------------------------------
    def call_utility(
        self, method_name: str, *args: Any, timeout: float | None = 30.0, rank: int | None = None
    ) -> Any:
        """Call ``EngineCore.utility_<method_name>(*args)`` in the engine and return its result.

        With several data-parallel ranks it runs on each and returns a list, or on ``rank`` alone. Raises
        ``UtilityCallError`` if the method is unknown or fails there (the engine keeps running), ``TimeoutError``
        past ``timeout`` seconds and ``EngineDeadError`` if the engine dies meanwhile.
        """
        _check_method_name(method_name)
        return self.client.call_utility(method_name, *args, timeout=timeout, rank=rank)

    async def acall_utility(
        self, method_name: str, *args: Any, timeout: float | None = 30.0, rank: int | None = None
    ) -> Any:
        """Async ``call_utility``."""
        _check_method_name(method_name)
        return await self.client.call_utility_async(method_name, *args, timeout=timeout, rank=rank)

    def get_stats(self) -> dict[str, Any]:
        """Engine statistics: running and waiting requests, KV-cache usage, prefix-cache hit rate, ...; with
        several data-parallel ranks, their sums and a per-rank breakdown (``ranks``)."""
        return {**self.client.get_stats(), "mode": self.mode, "engine_pid": self.engine_pid}

    async def aget_stats(self) -> dict[str, Any]:
        """Async ``get_stats``."""
        return {**await self.client.get_stats_async(), "mode": self.mode, "engine_pid": self.engine_pid}

    def ping(self, *, timeout: float = 10.0) -> bool:
        """A cheap liveness check through the whole request path (of every data-parallel rank): ``True`` when each
        answers within ``timeout`` seconds, ``False`` when one does not (the engine is busy between two steps, or
        stuck). Raises ``EngineDeadError`` once the engine is dead."""
        try:
            answers = self.client.call_utility_on_each_rank("ping", timeout=timeout)
        except TimeoutError:
            return False
        return all(answer == "pong" for answer in answers)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (only possible while no request runs); returns whether it did (on every
        data-parallel rank)."""
        return all(self.client.call_utility_on_each_rank("reset_prefix_cache", timeout=30.0))


def _check_method_name(method_name: Any) -> None:
    if not isinstance(method_name, str) or not method_name.isidentifier():
        raise ValueError(f"method_name must be an identifier, got {method_name!r}")
