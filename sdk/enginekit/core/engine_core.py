"""EngineCore: the one step loop. In-process mode calls it directly; the engine process feeds it from queues.

Every front-end operation arrives through ``handle_request`` (ADD, ABORT, UTILITY), so both transports share
one dispatch point; ``step`` schedules, runs the model once, and returns the outputs of that step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import torch

from enginekit.config import EngineConfig
from enginekit.core.detokenizer import IncrementalDetokenizer
from enginekit.core.kv_cache import KVCacheManager
from enginekit.core.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    RequestType,
)
from enginekit.core.request import Request
from enginekit.core.scheduler import Scheduler
from enginekit.errors import EngineStartupError
from enginekit.model.loader import load_model, load_model_config
from enginekit.model.runner import ModelRunner
from enginekit.model.tokenizer import load_tokenizer

logger = logging.getLogger("enginekit.core")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device, self.dtype = resolve_device(config)
        self._previous_num_threads = torch.get_num_threads()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.debug_load_delay_s:
            time.sleep(config.debug_load_delay_s)
        self.model_config = load_model_config(config.model)
        self.tokenizer = load_tokenizer(
            _folder(config.model),
            bos_token_id=self.model_config.bos_token_id,
            eos_token_id=(self.model_config.eos_token_ids or (None,))[0],
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.num_kv_blocks, self.max_model_len = size_kv_cache(config, self.model_config, self.dtype)
        model = load_model(
            config.model, self.model_config, device=self.device, dtype=self.dtype, seed=config.seed
        )
        self.runner = ModelRunner(
            model,
            self.model_config,
            num_blocks=self.num_kv_blocks,
            block_size=config.block_size,
            device=self.device,
            dtype=self.dtype,
            seed=config.seed,
            fail_at_step=config.fail_at_step,
        )
        self.kv_cache = KVCacheManager(
            self.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self._pending_outputs: list[EngineCoreOutput] = []
        self._idle_waiters: list[concurrent.futures.Future[dict[str, Any]]] = []
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.start_time = time.monotonic()

    # ---- the dispatch point -------------------------------------------------------------------------
    def handle_request(self, request_type: RequestType, payload: Any) -> Any:
        if request_type is RequestType.ADD:
            return self.add_request(payload)
        if request_type is RequestType.ABORT:
            return self.abort_requests(payload)
        if request_type is RequestType.UTILITY:
            return self.call_utility(payload.method_name, payload.args)
        raise ValueError(f"unexpected request type {request_type!r}")

    def add_request(self, message: EngineCoreRequest) -> None:
        if message.request_id in self.scheduler.requests:
            raise ValueError(f"request id {message.request_id!r} is already running")
        num_prompt = len(message.prompt_token_ids)
        if not 0 < num_prompt < self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens; it must have 1 to {self.max_model_len - 1} "
                f"(max_model_len={self.max_model_len})"
            )
        params = message.sampling_params
        detokenizer = IncrementalDetokenizer(self.tokenizer, message.prompt_token_ids, params.stop)
        self.scheduler.add_request(Request(message, detokenizer=detokenizer))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests by id; unknown or finished ids are ignored (abort is idempotent)."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self._finish(request, FinishReason.ABORT, None, self._pending_outputs)

    def abort_all(self) -> None:
        self.abort_requests(list(self.scheduler.requests))

    def call_utility(self, method_name: str, args: list[Any]) -> Any:
        method = getattr(self, f"utility_{method_name}", None)
        if method is None:
            raise AttributeError(f"unknown utility method {method_name!r}")
        return method(*args)

    # ---- the step -----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._pending_outputs) or self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """Schedule and run one forward pass; return this step's outputs and whether a forward ran."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self.scheduler.has_unfinished_requests():
            return outputs, False
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return outputs, False
        sampled_requests, sampled = self.runner.execute(
            scheduled.scheduled, self.kv_cache.block_ids, self.kv_cache.pool.num_used_blocks
        )
        self.num_steps += 1
        for request, num_new in scheduled.scheduled:
            request.num_computed_tokens += num_new
            self.kv_cache.cache_full_blocks(request)
        for row, request in enumerate(sampled_requests):
            self._append_token(request, sampled.token_ids[row], row, sampled, outputs)
        if self._idle_waiters and not self.scheduler.has_unfinished_requests():
            self._wake_idle_waiters()
        return outputs, True

    def _wake_idle_waiters(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        stats = self.utility_get_stats()
        for future in waiters:
            future.set_result(stats)

    def _append_token(self, request: Request, token_id: int, row: int, sampled, outputs) -> None:
        request.all_token_ids.append(token_id)
        self.num_generated_tokens += 1
        params = request.sampling_params
        num_output = request.num_output_tokens
        stop_string = request.detokenizer.update(token_id)
        finish_reason, stop_reason = None, None
        if stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        elif num_output >= params.min_tokens and not params.ignore_eos and token_id in self.eos_token_ids:
            finish_reason = FinishReason.STOP
        elif num_output >= params.min_tokens and token_id in params.stop_token_ids:
            finish_reason, stop_reason = FinishReason.STOP, token_id
        elif num_output >= params.max_tokens or request.num_tokens >= self.max_model_len:
            finish_reason = FinishReason.LENGTH
        output = EngineCoreOutput(
            request.request_id, [token_id], num_cached_tokens=max(request.num_cached_tokens, 0)
        )
        if params.logprobs is not None:
            width = params.logprobs + 1
            output.logprob_values = sampled.logprob_values[row : row + 1, :width].clone()
            output.logprob_token_ids = sampled.logprob_token_ids[row : row + 1, :width].clone()
        if finish_reason is None:
            output.new_text = request.detokenizer.flush()
            outputs.append(output)
        else:
            self._finish(request, finish_reason, stop_reason, outputs, output)

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        stop_reason: str | int | None,
        outputs: list[EngineCoreOutput],
        output: EngineCoreOutput | None = None,
    ) -> None:
        self.scheduler.finish_request(request, reason)
        if output is None:
            output = EngineCoreOutput(
                request.request_id, [], num_cached_tokens=max(request.num_cached_tokens, 0)
            )
        output.new_text = request.detokenizer.flush_final()
        output.finish_reason = reason
        output.stop_reason = stop_reason
        outputs.append(output)

    # ---- utilities: call_utility("name", ...) runs utility_name(...) -------------------------------
    def utility_ping(self) -> str:
        return "pong"

    def utility_get_stats(self) -> dict[str, Any]:
        kv = self.kv_cache
        return {
            "num_running_requests": len(self.scheduler.running),
            "num_waiting_requests": len(self.scheduler.waiting),
            "kv_cache_usage": kv.usage,
            "num_kv_blocks": kv.pool.num_blocks,
            "num_free_kv_blocks": kv.pool.num_free_blocks,
            "prefix_cache_queries": kv.num_prefix_queries,
            "prefix_cache_hits": kv.num_prefix_hits,
            "prefix_cache_hit_rate": kv.num_prefix_hits / kv.num_prefix_queries
            if kv.num_prefix_queries
            else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "uptime_s": time.monotonic() - self.start_time,
        }

    def utility_wait_idle(self) -> concurrent.futures.Future[dict[str, Any]]:
        """A Future that completes (with the stats) once no request is running or waiting."""
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._idle_waiters.append(future)
        if not self.scheduler.has_unfinished_requests():
            self._wake_idle_waiters()
        return future

    def utility_reset_prefix_cache(self) -> bool:
        return self.kv_cache.pool.reset_prefix_cache()

    def utility_get_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def utility_sleep(self, seconds: float) -> float:
        """Block the engine loop for a while (tests use it to hold a step open)."""
        time.sleep(seconds)
        return seconds

    # ---- teardown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the model, the KV cache and the scheduler's requests, and return device memory."""
        self.abort_all()
        self._pending_outputs.clear()
        for future in self._idle_waiters:
            future.cancel()
        self._idle_waiters.clear()
        self.runner.release()
        # In-process, the thread count is the user's process-wide torch setting: give it back.
        torch.set_num_threads(self._previous_num_threads)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def resolve_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    name = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineStartupError("device='cuda' was asked for but CUDA is not available", phase="model load")
    default = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, config.dtype or default)


def size_kv_cache(config: EngineConfig, model_config, dtype: torch.dtype) -> tuple[int, int]:
    """Number of KV blocks and the resulting max_model_len (a single request must always fit)."""
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
    block_bytes = per_token * config.block_size * torch.empty((), dtype=dtype).element_size()
    num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory_bytes // block_bytes)
    capacity = num_blocks * config.block_size
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise EngineStartupError(
                f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} positions",
                phase="model load",
            )
        if config.max_model_len > capacity:
            raise EngineStartupError(
                f"max_model_len={config.max_model_len} does not fit the KV cache ({capacity} tokens); "
                "raise num_kv_blocks or kv_cache_memory_bytes",
                phase="kv cache",
            )
        return num_blocks, config.max_model_len
    return num_blocks, min(limit, capacity)


def _folder(model: str | None):
    from pathlib import Path

    return Path(model) if model is not None else None
