"""InprocClient: the engine core in this process and thread; waiting for an output runs a step.

Every message goes through ``EngineCore.handle``, exactly as in the engine process. The core is not
thread-safe: every call into it holds one lock.

On CPU a ``ThreadGovernor`` chooses the step's torch threads, as in the engine process: this process's OpenMP
workers spin at every barrier (libgomp's default, fixed once torch has loaded), so beside a busy process a step
on every core waits at each op for the worker that was descheduled. The count it chooses applies during a step
only; between steps torch runs with the user's setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from enginekit.client.base import EngineCoreClient
from enginekit.client.fair_lock import FairLock
from enginekit.config import EngineConfig
from enginekit.core.engine_core import EngineCore
from enginekit.core.threads import ThreadGovernor
from enginekit.errors import EngineDeadError, EngineShutdownError, EngineStartupError, UtilityCallError
from enginekit.interrupts import deferred_interrupts
from enginekit.model.loader import ModelSpec
from enginekit.wire.messages import (
    AbortRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityOutput,
    UtilityRequest,
)


class InprocClient(EngineCoreClient):
    mode = "inproc"

    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None) -> None:
        if config.tensor_parallel_size > 1:
            raise EngineStartupError(
                f"tensor_parallel_size={config.tensor_parallel_size} runs its model ranks beside an engine process: "
                "use mode='mp' or 'async' (in-process mode runs one rank in this thread)",
                phase="startup",
            )
        governor = (
            ThreadGovernor.for_this_process(
                config.num_threads or torch.get_num_threads(), set_threads=_applied_per_step
            )
            if config.adaptive_threads
            else None
        )
        if governor is not None:
            governor.poll()  # loading the model is work: the first step may run on what this window saw
        self._core: EngineCore | None = EngineCore(config, spec)
        self.thread_governor = governor if self._core.device.type == "cpu" else None
        if self.thread_governor is not None:
            self.thread_governor.pause()  # until the first step
        self._failure: str | None = None
        self._undelivered: list[EngineCoreOutputs] = []  # outputs of steps run while a utility call waited
        self._answers: dict[int, UtilityOutput] = {}
        self._abandoned: set[int] = set()  # calls that timed out: their answers are dropped
        self._call_ids = itertools.count(1)
        self._lock = FairLock()  # taken one step at a time: another thread's call waits a step, not hundreds
        self.max_model_len = self._core.max_model_len
        self.num_kv_blocks = self._core.num_kv_blocks
        self.kv_cache_bytes = self._core.kv_size.num_bytes
        self.kv_cache_tokens = self._core.kv_size.num_tokens
        self.engine_pid = os.getpid()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The client's lock, taken with Ctrl-C deferred: a ``KeyboardInterrupt`` raised inside the lock's own
        (Python) acquire, after it was granted, would leave it held for good and every later call waiting. The
        interrupt is raised once the lock is released."""
        with deferred_interrupts(), self._lock:
            yield

    @property
    def core(self) -> EngineCore:
        if self._failure is not None:
            raise EngineDeadError(f"the in-process engine failed: {self._failure}")
        if self._core is None:
            raise EngineShutdownError("the engine has been shut down; call engine.restart()")
        return self._core

    @property
    def is_alive(self) -> bool:
        return self._core is not None and self._failure is None

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._locked():
            self.core.handle(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._locked():
            self.core.handle(AbortRequest(list(request_ids)))

    def get_output(self, timeout: float | None = 0) -> EngineCoreOutputs | None:
        """Run one step and return what it (and any step run for a utility call meanwhile) produced."""
        with self._locked():
            self._step()
            if not self._undelivered:
                return None
            batches, self._undelivered = self._undelivered, []
        if len(batches) == 1:
            return batches[0]
        return EngineCoreOutputs([output for batch in batches for output in batch.outputs])

    def wait_for_output(self, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
        """Nothing to wait for: ``get_output`` computes the next batch."""
        self.core  # noqa: B018  (raises once the engine is gone)

    def wake_waiters(self) -> None:
        """Nobody blocks in ``wait_for_output`` here."""

    async def wait_for_output_async(self) -> None:
        self.core  # noqa: B018
        await asyncio.sleep(0)  # let other tasks of this loop run between steps

    def _step(self) -> None:
        core = self.core  # raises once the engine is shut down or dead: neither is a failure of this step
        # NOTE: a step cut short, or its outputs dropped, would leave other requests half updated: a Ctrl-C
        # is raised once the step's outputs are kept.
        with deferred_interrupts():
            try:
                outputs = self._governed_step(core)
            except KeyboardInterrupt:
                # A second Ctrl-C raised at once, mid-step: the step's requests are half updated.
                del core
                self._discard("interrupted in the middle of a step (a second Ctrl-C); call engine.restart()")
                raise
            except Exception as error:
                del core
                self._fail(error)
                raise  # _fail raised already
            if outputs is None:
                return
            for answer in outputs.utility_outputs:
                if answer.call_id in self._abandoned:
                    self._abandoned.discard(answer.call_id)
                else:
                    self._answers[answer.call_id] = answer
            if outputs.outputs:
                outputs.utility_outputs = []
                self._undelivered.append(outputs)

    def _governed_step(self, core: EngineCore) -> EngineCoreOutputs | None:
        """``core.step()`` on the governor's thread count, the user's count back after it."""
        governor = self.thread_governor
        if governor is None or not core.has_requests():  # answers and outputs alone are no model work
            return core.step()[0]
        governor.poll()
        if governor.threads == governor.max_threads:
            outputs = core.step()[0]
        else:
            users = torch.get_num_threads()
            torch.set_num_threads(governor.threads)
            try:
                outputs = core.step()[0]
            finally:
                torch.set_num_threads(users)
        if not core.has_requests():
            governor.pause()  # until the next step: what others do meanwhile says nothing of sharing the cores
        return outputs

    def _fail(self, error: Exception) -> None:
        """The step failed: the engine is dead. Free the model and the KV cache now, not with the traceback."""
        # NOTE: the traceback's frames hold the model and the cache (the runner's locals); IPython keeps the
        # last traceback alive, so a restart would allocate a second copy. Clear them.
        traceback.clear_frames(error.__traceback__)
        self._discard(f"{type(error).__name__}: {error}")
        raise EngineDeadError(f"the in-process engine failed in a step: {self._failure}") from None

    def _discard(self, failure: str) -> None:
        """Mark the engine dead for ``failure`` and release the model and the KV cache now."""
        self._failure = failure
        core, self._core = self._core, None
        if core is not None:
            core.shutdown()
        del core
        gc.collect()

    def call_utility(
        self, method_name: str, *args: Any, timeout: float | None = None, rank: int | None = None
    ) -> Any:
        if rank not in (None, 0):
            raise ValueError(f"rank must be 0 (an in-process engine has one), got {rank!r}")
        call_id = next(self._call_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        request = UtilityRequest(call_id, method_name, list(args))
        try:
            if deadline is None:
                with self._locked():
                    self.core.handle(request)
            else:
                self._handle_within(request, deadline)
            answer = self._wait_for_answer(call_id, deadline)
        except TimeoutError:
            self._abandoned.add(call_id)  # its answer, if it ever comes, is dropped
            raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s") from None
        if answer.failure_message is not None:
            raise UtilityCallError(answer.failure_message)
        return answer.result

    def _wait_for_answer(self, call_id: int, deadline: float | None) -> UtilityOutput:
        """The engine process answers a Future when it completes; here, steps run until it does. The lock is
        taken one step at a time, so other threads' calls (an abort that lets ``wait_idle`` answer) get in."""
        while True:
            with self._locked():
                if call_id in self._answers:
                    return self._answers.pop(call_id)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError
                self._step()

    def _handle_within(self, request: UtilityRequest, deadline: float) -> None:
        """Run the utility on a thread of its own, so that the caller's timeout holds as it does for an engine
        process: a utility that blocks (``sleep``) keeps the engine busy, not the caller past its deadline."""
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with self._locked():
                    self.core.handle(request)
            except BaseException as error:
                failure.append(error)

        worker = threading.Thread(target=run, name="enginekit-utility", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            raise TimeoutError
        if failure:
            raise failure[0]

    async def call_utility_async(
        self, method_name: str, *args: Any, timeout: float | None = None, rank: int | None = None
    ) -> Any:
        return self.call_utility(method_name, *args, timeout=timeout, rank=rank)

    def shutdown(self, timeout: float | None = None) -> None:
        with self._locked():
            core, self._core = self._core, None
        if core is not None:
            core.shutdown()
            del core
            gc.collect()


def _applied_per_step(threads: int) -> None:
    """The governor's count is not set process-wide: ``_governed_step`` applies it around each step."""
