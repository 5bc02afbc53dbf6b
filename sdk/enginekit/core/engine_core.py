"""EngineCore: the one dispatch point and the one step loop, whichever process it runs in.

Every front-end message arrives through ``handle``: requests are validated and added or refused, aborts
applied, utilities called (the ``utility_*`` methods, ``core/utilities.py``; a Future result is answered when it
completes) and shutdown started. ``step``
schedules, runs the model once and returns everything produced since the last step: token deltas, refusals
and utility answers (each request's output is built by ``StepOutputs``, ``core/step_outputs.py``). In-process
mode calls both directly; the engine process feeds ``handle`` from its input queue and sends what ``step``
returns. The model it runs (every tensor-parallel rank of it) and the KV cache's size come from ``start_model``
(``core/model_start.py``).
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from enginekit.config import EngineConfig
from enginekit.core.batching import build_batch
from enginekit.core.detokenizer import IncrementalDetokenizer
from enginekit.core.kv_cache import KVCacheManager
from enginekit.core.launched_step import LaunchedStep, fill_sampling
from enginekit.core.lora import LoRAManager, adapter_order
from enginekit.core.model_start import start_model
from enginekit.core.request import Request
from enginekit.core.resources import release_device_memory, resolve_async_scheduling, resolve_device
from enginekit.core.scheduler import Scheduler
from enginekit.core.speculative.plan import ROW_COST, Speculation, make_proposer
from enginekit.core.step_outputs import StepOutputs, status_changes
from enginekit.core.structured.manager import StructuredOutputManager
from enginekit.core.tp_executor import TensorParallelExecutor
from enginekit.core.utilities import EngineUtilities
from enginekit.core.validation import RequestLimits, validate_request
from enginekit.model.loader import ModelSpec
from enginekit.model.runner import ModelRunner
from enginekit.model.sampler import SamplerOutput
from enginekit.model.text.vocabulary import bad_words_token_ids
from enginekit.wire.messages import (
    AbortRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExecutorFailed,
    FinishReason,
    InvalidRequest,
    ShutdownRequest,
    UtilityOutput,
    UtilityRequest,
    WakeupRequest,
)

logger = logging.getLogger("enginekit.core")

GRAMMAR_WAIT_S = 0.01  # how long an idle step waits for a grammar to compile before returning


class ShutdownState(enum.Enum):
    RUNNING = 0
    REQUESTED = 1  # no new work; running requests drain until the deadline, then are aborted
    DONE = 2


class EngineCore(EngineUtilities):
    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None, *, engine_index: int = 0) -> None:
        self.config = config
        self.engine_index = engine_index
        self.device, self.dtype = resolve_device(config)
        if self.device.type == "cuda" and self.device.index is not None:
            # NOTE: before anything is allocated, or a stray context appears on cuda:0.
            torch.cuda.set_device(self.device)
        self._previous_num_threads = torch.get_num_threads()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.executor: TensorParallelExecutor | None = (
            None  # the other model ranks (tensor_parallel_size > 1)
        )
        try:
            self._build(config, spec)
        except BaseException as error:
            # NOTE: free what was built before the failure now, not whenever the traceback dies: a notebook
            # keeps the last traceback, and its frames (the model in start_model's locals) with it.
            traceback.clear_frames(error.__traceback__)
            self.runner = None  # pyright: ignore[reportAttributeAccessIssue]  # frees the model a failed start built
            if self.executor is not None:
                self.executor.shutdown()
                self.executor = None
            torch.set_num_threads(self._previous_num_threads)
            release_device_memory(self.device)
            raise
        self.shutdown_state = ShutdownState.RUNNING
        self.shutdown_deadline = 0.0
        # A signal sent to the engine process, not the front end, asked for this shutdown: its requests are
        # never ended as aborted (nobody aborted them); the process reports its death instead.
        self.shutdown_signal: str | None = None
        self.outputs = StepOutputs(
            self.scheduler,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            max_model_len=self.max_model_len,
            stream_interval=config.stream_interval,
        )
        self._utility_outputs: list[UtilityOutput] = []
        self._compiling: list[Request] = []  # requests whose structured output has not compiled yet
        self._idle_waiters: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._handlers: dict[type, Callable[[Any], None]] = {
            EngineCoreRequest: self._add,
            AbortRequest: lambda message: self.abort_requests(message.request_ids),
            UtilityRequest: self._call_utility,
            ShutdownRequest: lambda message: self.request_shutdown(message.timeout),
            WakeupRequest: lambda message: None,
            ExecutorFailed: self._executor_failed,
            InvalidRequest: self.outputs.refuse_invalid,
        }
        self.num_steps = 0
        self.start_time = time.monotonic()
        # Overlapped steps: schedule and launch step N+1 before step N's tokens are applied (on by default on CUDA,
        # where the device runs step N meanwhile; see docs/architecture.md). Never under tensor parallelism: the
        # other ranks get each step's token ids over their pipes.
        self.async_scheduling = resolve_async_scheduling(config, self.device)
        self._in_flight: LaunchedStep | None = None  # an overlapped step whose samples are on their way

    def _build(self, config: EngineConfig, spec: ModelSpec | None) -> None:
        started = start_model(config, spec, self.device, self.dtype, engine_index=self.engine_index)
        self.executor = started.executor
        self.runner: ModelRunner = started.runner  # None only after a failed start
        self.model_config = model_config = started.config
        self.tokenizer = started.tokenizer
        self.kv_size = started.kv_size
        self.num_kv_blocks, self.max_model_len = self.kv_size.num_blocks, self.kv_size.max_model_len
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.limits = RequestLimits(
            model_config.vocab_size,
            model_config.hidden_size,
            self.max_model_len,
            config.structured_outputs_backend,
            config.enable_lora,
        )
        self.kv_cache = KVCacheManager(
            self.num_kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            long_rope_from=model_config.long_rope_from,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        self.loras: LoRAManager | None = None  # the LoRA adapters (enable_lora)
        if config.enable_lora:
            model = self.executor if self.executor is not None else self.runner
            live = lambda: (request.lora for request in self.scheduler.requests.values())  # noqa: E731
            self.loras = LoRAManager(config, model_config, model.load_lora, live)
        self.structured = StructuredOutputManager(
            config.structured_outputs_backend,
            self.tokenizer,
            model_config.vocab_size,
            list(model_config.eos_token_ids),
        )
        speculative = config.speculative
        self.speculation = Speculation(
            make_proposer(
                config, model_config, self.tokenizer, self.device, self.dtype, num_blocks=self.num_kv_blocks
            ),
            self.structured,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative is not None else 0,
            long_rope_from=model_config.long_rope_from,
            adaptive=speculative.adaptive if speculative is not None else True,
            row_cost=ROW_COST.get(self.device.type, ROW_COST["cpu"]),
            jump_forward=config.jump_forward,
        )

    # ---- the dispatch point -------------------------------------------------------------------------
    def handle(self, message: Any) -> None:
        """Apply one front-end message; what it produces comes out of the next ``step``."""
        self._handlers[type(message)](message)

    def _add(self, request: EngineCoreRequest) -> None:
        request_id = request.request_id
        if self.shutdown_state is not ShutdownState.RUNNING:
            if self.shutdown_signal is None:  # else unanswered: the death the process reports fails it
                self.outputs.shutting_down(request_id)
            return
        if request_id in self.scheduler.requests:
            # NOTE: never answer under the id of a running request: that would end it for its caller.
            logger.warning("rejected request %s: its id is already running", request_id)
            return
        try:
            validate_request(request, self.limits)
        except ValueError as error:
            self.outputs.refuse(request_id, error)
            return
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            params.stop,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        added = Request(request, detokenizer=detokenizer, device=self.device)
        if request.lora_request is not None:
            assert self.loras is not None  # validate_request refuses an adapter without enable_lora
            try:
                added.lora = self.loras.resolve(request.lora_request)
            except ValueError as error:
                self.outputs.refuse(request_id, error)
                return
        limit = (
            added.num_prompt_tokens + params.max_tokens
            if params.max_tokens is not None
            else self.max_model_len
        )
        added.max_num_tokens = min(limit, self.max_model_len)
        if params.bad_words:
            added.bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            added.grammar = self.structured.request_grammar(params.structured_outputs)
            self._compiling.append(added)
        self.scheduler.add_request(added)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests by id; unknown or finished ids are ignored (abort is idempotent)."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.outputs.finish(request, FinishReason.ABORT)

    def abort_all(self) -> None:
        self.abort_requests(list(self.scheduler.requests))

    def _call_utility(self, request: UtilityRequest) -> None:
        def answer(result: Any = None, failure: str | None = None) -> None:
            self._utility_outputs.append(UtilityOutput(request.call_id, result, failure))

        if self.shutdown_state is not ShutdownState.RUNNING:
            answer(failure="Server shutting down")
            return
        method = getattr(self, f"utility_{request.method_name}", None)
        try:
            if method is None:
                raise AttributeError(f"unknown utility method {request.method_name!r}")
            result = method(*request.args)
        except Exception as error:
            answer(failure=f"{type(error).__name__}: {error}")
            return
        if not isinstance(result, concurrent.futures.Future):
            _answer_with(answer, lambda: result)
            return
        # NOTE: futures complete on the loop's thread (in a step), so the answer is sent by the next step.
        result.add_done_callback(lambda future: _answer_with(answer, future.result))

    def _executor_failed(self, message: ExecutorFailed) -> None:
        raise RuntimeError(f"Executor failed. {message.reason}".strip())

    # ---- shutdown -----------------------------------------------------------------------------------
    def request_shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests; abort running ones now (timeout 0) or let them finish up to the timeout."""
        if self.shutdown_state is ShutdownState.RUNNING:
            timeout = self.config.shutdown_timeout if timeout is None else timeout
            self.shutdown_state = ShutdownState.REQUESTED
            self.shutdown_deadline = time.monotonic() + timeout
            logger.info("shutdown requested (timeout %.1fs)", timeout)

    @property
    def is_done(self) -> bool:
        return self.shutdown_state is ShutdownState.DONE

    # ---- the step -----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether ``step`` would produce something: requests to run, or answers to send."""
        return bool(
            self.outputs.pending
            or self._utility_outputs
            or self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or self._idle_waiters
            or self.shutdown_state is ShutdownState.REQUESTED
        )

    def has_requests(self) -> bool:
        """Whether requests are running or waiting: model work (``has_work`` without answers to send alone)."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> tuple[EngineCoreOutputs | None, bool]:
        """Run one forward pass if anything is scheduled; return what was produced and whether it ran."""
        if self.shutdown_state is ShutdownState.REQUESTED and time.monotonic() >= self.shutdown_deadline:
            if self.shutdown_signal is None:
                self.abort_all()
            else:
                self.shutdown_state = ShutdownState.DONE  # what still runs fails with the reported death
        ran_forward = False
        if self.shutdown_state is not ShutdownState.DONE and (
            self.scheduler.has_unfinished_requests() or self._in_flight is not None
        ):
            if self._compiling:
                self._resolve_grammars()
            ran_forward = self._run_scheduled()
            if not ran_forward and self._compiling:
                self.structured.wait([r.grammar for r in self._compiling if r.grammar], GRAMMAR_WAIT_S)
        if not self.scheduler.has_unfinished_requests():
            self._drop_in_flight()
            if self._idle_waiters:
                self._wake_idle_waiters()
            if self.shutdown_state is ShutdownState.REQUESTED:
                self.shutdown_state = ShutdownState.DONE
        if not (self.outputs.pending or self._utility_outputs):
            return None, ran_forward
        outputs = self.outputs.take()
        utility_outputs, self._utility_outputs = self._utility_outputs, []
        return EngineCoreOutputs(outputs, utility_outputs, self.engine_index), ran_forward

    def _run_scheduled(self) -> bool:
        """Schedule and launch a step; apply the step before it (overlapped) or this one (serial)."""
        if not self.async_scheduling:  # overlapped steps do not know a request's last token yet
            self.speculation.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        changes = status_changes(scheduled.started, scheduled.preempted)
        previous, self._in_flight = self._in_flight, None
        step = self._launch(scheduled.scheduled, changes, previous) if not scheduled.is_empty else None
        if previous is not None:  # its tokens, while this step runs on the device
            self._complete(previous)
        if step is None:
            self.outputs.report_status(changes)
            return previous is not None
        if step.forward is not None:  # overlapped: sample once the step before has been applied
            fill_sampling(step, self.structured, self.eos_token_ids)
            step.pending = self.runner.sample_step(step.batch, step.forward)
            step.forward = None
            self._in_flight = step
        else:
            self._complete(step)
        return True

    def _launch(
        self, scheduled: list[tuple[Request, int]], changes: dict, previous: LaunchedStep | None
    ) -> LaunchedStep:
        """Hand the scheduled step to the model: whole (serial), or its forward pass alone (overlapped: its
        decodes read the tokens the step before sampled where they are, on the device)."""
        pending_rows = previous.sampling_rows() if previous is not None else None
        if self.loras is not None:  # each adapter's chunks side by side: its rows a slice, not a gather
            scheduled.sort(key=adapter_order)
        batch, requests, sampling = build_batch(scheduled, self.kv_cache, pending_rows)
        self.speculation.forget(batch.freed_seq_ids)
        if self.loras is not None:
            self.loras.assign_slots(requests, batch.chunks)
        step = LaunchedStep(batch, requests, sampling, changes)
        if self.async_scheduling:
            if previous is not None and previous.pending is not None:
                batch.previous_token_ids = previous.pending.device_token_ids
            step.forward = self.runner.forward_step(batch)
        else:
            fill_sampling(step, self.structured, self.eos_token_ids)
            step.sampled = (
                self.executor.execute(batch) if self.executor is not None else self.runner.execute(batch)
            )
        self.num_steps += 1
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            self.kv_cache.cache_full_blocks(request)
        for request in sampling:
            request.num_pending_tokens += 1
        return step

    def _complete(self, step: LaunchedStep) -> None:
        """Apply a step's samples: prompt logprobs, then each token (stops, text, grammar), then status changes.
        The tokens of requests that ended since the step was scheduled are dropped."""
        sampled = step.result()
        for index, parts in (sampled.prompt_logprobs or {}).items():
            request = step.requests[index]
            if not request.is_finished:
                unsent = request.prompt_logprobs
                assert unsent is not None  # build_batch asks for them only while unsent
                unsent.append(parts)
        changes = step.changes
        row = 0
        for request in step.sampling:
            if request.spec_token_ids:
                row += self._verified(request, sampled, row, changes.pop(request.request_id, None))
                continue
            if request.is_finished:
                request.num_pending_tokens = 0
            else:
                self.outputs.token(request, sampled, row, changes.pop(request.request_id, None))
            row += 1
        self.outputs.report_status(changes)
        self.outputs.end_step()

    def _verified(self, request: Request, sampled: SamplerOutput, row: int, status: Any) -> int:
        """Apply a decode with proposals: its rows from ``row`` on, one per proposal and one more. It keeps the
        proposals its rows sampled too and the token after them; the cache slots of the others are given back.
        Returns its row count."""
        width = 1 + len(request.spec_token_ids)
        if request.is_finished:
            request.num_pending_tokens = 0
        else:
            keep = self.speculation.accepted(request, sampled.token_ids[row : row + width])
            for j in range(keep):
                self.outputs.token(request, sampled, row + j, status if j == 0 else None, more=j < keep - 1)
                if request.is_finished:
                    break
            if not request.is_finished:
                request.num_computed_tokens -= width - keep  # the rejected proposals' keys and values
                self.kv_cache.trim(request, request.num_tokens)
        request.clear_proposals()
        return width

    def _drop_in_flight(self) -> None:
        """Forget the overlapped step on its way (its requests have all ended), once its copy back is done."""
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None

    def _resolve_grammars(self) -> None:
        """Hand each request whose grammar compiled its matcher; refuse those whose grammar does not compile."""
        compiling = []
        for request in self._compiling:
            if request.is_finished:
                continue
            assert request.grammar is not None
            if not self.structured.resolve(request.grammar):
                compiling.append(request)
            elif request.grammar.error is not None:
                self.outputs.fail(request, request.grammar.error)
        self._compiling = compiling

    def _wake_idle_waiters(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        stats = self.utility_get_stats()
        for future in waiters:
            future.set_result(stats)

    # ---- teardown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the model, the KV cache and the scheduler's requests, and return device memory."""
        self.abort_all()
        self._drop_in_flight()
        self.outputs.take()
        for future in self._idle_waiters:
            future.cancel()
        self._idle_waiters.clear()
        self._compiling.clear()
        self.structured.shutdown()
        self.speculation.shutdown()
        if self.runner is not None:
            self.runner.release()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        # In-process, the thread count is the user's process-wide torch setting: give it back.
        torch.set_num_threads(self._previous_num_threads)
        release_device_memory(self.device)


def _answer_with(answer: Callable[..., None], compute: Callable[[], Any]) -> None:
    """Answer with ``compute()``'s result, which must be msgpack-able, or with the failure it raised."""
    try:
        result = compute()
        msgspec.msgpack.encode(result)
    except TypeError as error:
        answer(failure=f"TypeError: utility result cannot be sent: {error}")
    except Exception as error:
        answer(failure=f"{type(error).__name__}: {error}")
    else:
        answer(result)
