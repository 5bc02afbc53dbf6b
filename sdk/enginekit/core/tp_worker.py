"""A tensor-parallel worker's ``main``: rank 1..N-1 of one engine core's model (``python -m enginekit.core.tp_worker``).

Started by ``TensorParallelExecutor`` (``core/tp_executor.py``). It reads its ``TensorParallelWorkerArgs`` from
stdin, joins the process group, loads its slice of the model, allocates its share of the KV cache (the block count
comes from rank 0), and then runs the forward pass of every step rank 0 announces on stdin, until a stop header or
EOF (rank 0 is gone). It never samples: the LM head's logits go to rank 0.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys

import msgspec
import torch

from enginekit.core.resources import resolve_device
from enginekit.model.loader import load_model, load_model_spec
from enginekit.model.lora.model import lora_spec
from enginekit.model.parallel import (
    HEADER,
    OP_LORA,
    ProcessGroup,
    ProgressBoard,
    join_store,
    receive_batch,
    receive_lora,
)
from enginekit.model.runner import ModelRunner
from enginekit.wire.messages import TensorParallelWorkerArgs

logger = logging.getLogger("enginekit.engine_process")
LOG_FORMAT = "%(asctime)s tp-worker[%(process)d] %(levelname)s %(name)s: %(message)s"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this worker when its parent (rank 0's process) dies, whatever it is doing (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: EOF on stdin and gloo's closed connections still end the worker


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def run_worker(args: TensorParallelWorkerArgs, stdin_fd: int) -> None:
    config = args.config
    device = torch.device(args.device)
    _, dtype = resolve_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.num_threads)
    spec = load_model_spec(config.model, config.revision)
    progress = ProgressBoard(args.progress_fd, args.size)  # rank 0's watch reads our count there
    os.close(args.progress_fd)
    group = ProcessGroup(
        args.rank,
        args.size,
        device,
        store=join_store(args.rank, args.size, args.store_port),
        progress=progress,
    )
    runner = None
    try:
        model = load_model(
            spec,
            device=device,
            dtype=dtype,
            seed=config.seed,
            quantization=config.quantization,
            comm=group,
            batch_invariant=config.batch_invariant,
        )
        num_blocks, max_blocks_per_seq = group.broadcast(
            torch.zeros(2, dtype=torch.long, device=device)
        ).tolist()
        # Decode graphs as rank 0's: a pure-decode step pads to the same shape on every rank (and on CUDA every
        # rank captures it, its collectives included), or the ranks' collectives would not match.
        runner = ModelRunner(
            model,
            spec.config,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=device,
            dtype=dtype,
            seed=config.seed,
            decode_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_blocks_per_seq=max_blocks_per_seq,
            lora=lora_spec(config),
        )
        del model
        while True:
            header = _read_exactly(stdin_fd, HEADER.size)
            if not header:
                logger.warning("tensor-parallel rank 0 is gone; worker rank %d exiting", args.rank)
                return
            if HEADER.unpack(header)[0] == OP_LORA:
                runner.load_lora(*receive_lora(group, header, spec.config))
                continue
            batch = receive_batch(group, header, spec.config.hidden_size, dtype)
            if batch is None:
                return
            with torch.inference_mode():
                runner.forward(batch)
    finally:
        if runner is not None:
            runner.release()
        group.close()


def main() -> None:
    faulthandler.enable(all_threads=False)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches rank 0's process; it stops us
    stdin_fd = sys.stdin.fileno()  # read unbuffered: the step headers follow the arguments on this pipe
    length = _read_exactly(stdin_fd, 8)
    payload = _read_exactly(stdin_fd, int.from_bytes(length, "little")) if length else b""
    if not payload:
        os._exit(3)  # rank 0 went away before it sent our arguments
    args = msgspec.msgpack.decode(payload, type=TensorParallelWorkerArgs)
    logging.basicConfig(level=args.config.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    code = 0
    try:
        run_worker(args, stdin_fd)
    except Exception:
        logger.exception("tensor-parallel worker rank %d failed", args.rank)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
