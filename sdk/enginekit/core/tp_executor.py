"""The tensor-parallel executor of one engine core: rank 0 here, ranks 1..N-1 in worker processes.

Like vLLM's multiprocess executor: the engine core (scheduler, KV bookkeeping, sampling) runs rank 0 of the model in
its own process, and starts the other ranks as fresh interpreters (``python -m enginekit.core.tp_worker``, never a
fork: the engine process may hold threads and a CUDA context). Rank 0 hosts the process group's TCP store on a
free localhost port; each worker gets its ``TensorParallelWorkerArgs`` on its stdin and keeps reading it: every
step rank 0 writes a 64-byte header there (``enginekit.model.parallel.HEADER``) and then broadcasts the step's
tensors; EOF means rank 0 died, and the worker exits (so does a worker whose parent dies: ``PR_SET_PDEATHSIG``).

A worker's death is the engine's death, and so is a worker that holds a step up without progress (stopped, hung):
``WorkerWatch`` (``core/tp_watch.py``) watches the workers' processes, kills a stalled one, and reports the first
failure (``on_death``; the engine process queues ``ExecutorFailed``, which fails the engine with
``EngineDeadError`` within a loop iteration); a step that was running fails at once, since gloo raises when a
peer's connection closes, and the executor names the worker. On NCCL, whose collectives never raise on a dead peer,
the watch aborts the group, and past ``ABORT_GRACE_S`` hands the engine process ``on_stuck`` to end itself.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from enginekit.config import EngineConfig
from enginekit.core.tp_watch import WorkerWatch
from enginekit.errors import EngineStartupError
from enginekit.model.batch import ScheduledBatch
from enginekit.model.lora.weights import LoRAWeights
from enginekit.model.parallel import (
    ProcessGroup,
    ProgressBoard,
    broadcast_batch,
    broadcast_lora,
    host_store,
    pack_batch,
    stop_header,
    worker_key,
)
from enginekit.model.runner import ExecutorError, ModelRunner
from enginekit.model.sampler import SamplerOutput
from enginekit.wire.messages import TensorParallelWorkerArgs
from enginekit.wire.serial import write_frame

logger = logging.getLogger("enginekit.engine_process")

_T = TypeVar("_T")
STOP_TIMEOUT_S = 5.0  # how long a worker may take to exit after its stop header before it is killed


class TensorParallelExecutor:
    """Start the workers (``start``), join the group, run steps on every rank (``execute``), stop them."""

    def __init__(self, config: EngineConfig, device: torch.device, *, engine_index: int = 0) -> None:
        self.size = config.tensor_parallel_size
        self.device = device
        self.on_death: Callable[[str], None] | None = None
        # a step that cannot be ended from here (NCCL, after a worker's failure): the process must end itself
        self.on_stuck: Callable[[str], None] | None = None
        self.runner: ModelRunner | None = None
        self.group: ProcessGroup | None = None
        self._workers: list[subprocess.Popen[bytes]] = []
        self._pipes: list[int] = []  # write ends of the workers' stdin
        self._stopping = False
        self.watch: WorkerWatch | None = None
        store = host_store(self.size)
        self._store: object = store
        self.progress, progress_fd = ProgressBoard.create(self.size)
        threads = max(1, torch.get_num_threads() // self.size)
        torch.set_num_threads(threads)  # this rank's share; each worker gets as many
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            try:
                for rank in range(1, self.size):
                    worker_device = device
                    if device.type == "cuda":
                        worker_device = torch.device("cuda", (device.index or 0) + rank)
                    args = TensorParallelWorkerArgs(
                        config,
                        rank,
                        self.size,
                        store.port,
                        str(worker_device),
                        threads,
                        engine_index,
                        progress_fd,
                    )
                    self._spawn(args, env)
            finally:
                os.close(progress_fd)  # every worker has its own copy
            self.watch = WorkerWatch(
                self._workers,
                self.progress,
                config.tensor_parallel_stall_timeout,
                on_failure=self._on_failure,
                on_stuck=self._on_stuck,
            )
            self._wait_for_workers(store)
            self.group = ProcessGroup(0, self.size, device, store=store, progress=self.progress)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, args: TensorParallelWorkerArgs, env: dict[str, str]) -> None:
        try:
            worker = subprocess.Popen(
                [sys.executable, "-m", "enginekit.core.tp_worker"],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=[args.progress_fd],
            )
        except OSError as error:
            raise EngineStartupError(
                f"cannot start tensor-parallel worker rank {args.rank}: {error}", phase="model load"
            ) from error
        assert worker.stdin is not None
        self._workers.append(worker)
        fd = worker.stdin.fileno()
        self._pipes.append(fd)
        write_frame(fd, args)

    def _wait_for_workers(self, store: Any) -> None:
        """Wait until every worker has reached the store (it then joins the group at once), failing the start as
        soon as one dies (an import error, a bad device): the group's own rendezvous would wait its full deadline."""
        for rank in range(1, self.size):
            while True:
                try:
                    store.wait([worker_key(rank)], datetime.timedelta(seconds=0.2))
                    break
                except RuntimeError:  # DistStoreError: not there yet
                    reason = self.death_reason()
                    if reason is not None:
                        raise EngineStartupError(f"{reason} while starting", phase="model load") from None

    # ---- liveness -----------------------------------------------------------------------------------
    def _on_failure(self, reason: str) -> None:
        """The watch found a worker dead or stalled (on its thread): fail the engine; unblock a running step."""
        if self.watch is not None and self.watch.step_started is not None and self.group is not None:
            self.group.abort()  # NOTE: NCCL only; gloo raises by itself once the dead peer's connection closes
        if self.on_death is not None:
            self.on_death(reason)

    def _on_stuck(self, reason: str) -> None:
        if self.on_stuck is not None:
            self.on_stuck(reason)

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    def death_reason(self) -> str | None:
        """The first worker found dead or stalled, as a sentence; ``None`` while all live."""
        return self.watch.death_reason() if self.watch is not None else None

    def kill_workers(self) -> None:
        """SIGKILL every worker now (the engine process is about to end without a shutdown)."""
        for worker in self._workers:
            with contextlib.suppress(OSError):
                worker.kill()

    # ---- the step -----------------------------------------------------------------------------------
    def attach(self, runner: ModelRunner, num_blocks: int, max_blocks_per_seq: int) -> None:
        """Hand the workers the KV cache's size and the longest request's blocks (rank 0 sized them: the workers'
        decode graphs pad to the same shapes) and keep the runner for ``execute``."""
        group = self.group
        assert group is not None
        sizes = torch.tensor([num_blocks, max_blocks_per_seq], dtype=torch.long, device=self.device)
        self._collective(lambda: group.broadcast(sizes))
        self.runner = runner

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Run one step on every rank; rank 0's sampled tokens."""
        assert self.runner is not None and self.group is not None
        header, payload, embeddings = pack_batch(batch)
        group, runner = self.group, self.runner

        def run() -> SamplerOutput:
            for fd in self._pipes:
                os.write(fd, header)
            broadcast_batch(group, payload, embeddings)
            return runner.execute(batch)

        return self._collective(run)

    def load_lora(self, slot: int, weights: LoRAWeights) -> None:
        """Write a LoRA adapter into ``slot`` on every rank (each keeps its slice, as of the base layers)."""
        assert self.runner is not None and self.group is not None
        group, runner = self.group, self.runner

        def run() -> None:
            broadcast_lora(group, self._pipes, slot, weights)
            runner.load_lora(slot, weights)

        self._collective(run)

    def _collective(self, run: Callable[[], _T]) -> _T:
        """``run`` with a worker's death (a closed pipe, gloo's closed connection) named as an ``ExecutorError``;
        the watch looks for a stalled worker meanwhile."""
        watch = self.watch
        assert watch is not None
        watch.step_started = time.monotonic()
        try:
            return run()
        except (OSError, RuntimeError) as error:
            if isinstance(error, ExecutorError):
                raise
            time.sleep(0.05)  # NOTE: a worker that just died may not have been reaped yet
            reason = self.death_reason()
            raise ExecutorError(reason or f"tensor-parallel collective failed: {error}") from error
        finally:
            watch.step_started = None

    # ---- teardown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (a stop header, EOF, then SIGKILL past ``STOP_TIMEOUT_S``), the watch and the group."""
        if self._stopping:
            return
        self._stopping = True
        if self.watch is not None:
            self.watch.close()
        for fd in self._pipes:
            with contextlib.suppress(OSError):
                os.write(fd, stop_header())
        for worker in self._workers:
            if worker.stdin is not None:
                with contextlib.suppress(OSError):
                    worker.stdin.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self._workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker %d did not stop; killing it", worker.pid)
                worker.kill()
                worker.wait()
        self._workers, self._pipes = [], []
        if self.group is not None:
            self.group.close()
            self.group = None
        self.runner = None
        self._store = None  # closes the store's socket
        self.progress.close()
