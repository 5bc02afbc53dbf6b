"""Tensor parallelism's process group, and a step's batch as tensors (how it reaches the other ranks).

``ProcessGroup`` is torch.distributed over a localhost TCP store: gloo on CPU, NCCL on CUDA. Rank 0 (the engine
core's process) hosts the store on a free port (``host_store``) before it starts the other ranks, which connect to
it. Every collective has a deadline (``COLLECTIVE_TIMEOUT_S``), and gloo raises at once when a peer's connection
closes (a rank that died); NCCL does not, and a rank that is alive but stopped holds every other one under either.
So each rank also counts its collectives on a ``ProgressBoard``, memory the group's processes share, which rank 0's
watch reads (``enginekit.core.tp_watch``) to find the rank that holds a step up.

A step's batch travels without pickle: ``pack_batch`` turns the runner's ``ScheduledBatch`` into a header of
eight integers (sent by the executor over each worker's pipe, see ``enginekit.core.tp_executor``) and one int64
tensor (every chunk's numbers, tokens and block table), plus the prompt embeddings if any, which rank 0
broadcasts (``broadcast_batch``); ``receive_batch`` rebuilds the chunks on the other ranks. They need what shapes
the forward pass: the tokens, positions, cache slots and tables, and which rows are sampled or scored; never the
sampling parameters (only rank 0 samples). A chunk's numbers end with its LoRA adapter slot (-1: none). A LoRA
adapter written into a slot travels the same way (``OP_LORA``: ``broadcast_lora`` / ``receive_lora``): its whole
weights as one float32 tensor, of which each rank keeps its slice.
"""

from __future__ import annotations

import datetime
import mmap
import os
import struct

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it, untyped

from enginekit.model import transfer
from enginekit.model.batch import ScheduledBatch, SequenceChunk
from enginekit.model.config import ModelConfig
from enginekit.model.lora.weights import LoRAWeights, pack, unpack
from enginekit.sampling_params import SamplingParams

COLLECTIVE_TIMEOUT_S = 300.0  # the longest a rank waits for the others in one collective (a long prefill)
STORE_HOST = "127.0.0.1"
HEADER = struct.Struct("<8q")  # op, chunks, tokens, table entries, used blocks, embedding rows, payload, 0
OP_STEP, OP_STOP, OP_LORA = 1, 0, 2  # OP_LORA: op, slot, rank, values, then 0s
CHUNK_FIELDS = (
    8  # start, tokens, sampling rows, prompt targets, rope_long, table length, embedding rows, LoRA slot
)
_SAMPLES = SamplingParams(max_tokens=1)  # what marks a worker's chunk as sampled (only its presence counts)


class ProgressBoard:
    """One int64 per rank, in a memfd every rank of the group maps: a rank adds 1 as it enters a collective, so a
    rank whose count is below another's has not reached the collective that one waits in. Rank 0 creates it
    (``create``) and hands each worker the fd; reading another process's aligned int64 is atomic."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size * 8)
        self.counts = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, size: int) -> tuple[ProgressBoard, int]:
        """A zeroed board for ``size`` ranks, and its fd (close it once every worker has it)."""
        fd = os.memfd_create("enginekit-tp-progress")
        os.ftruncate(fd, size * 8)
        return cls(fd, size), fd

    def snapshot(self) -> list[int]:
        return self.counts.tolist()

    def close(self) -> None:
        self.counts.release()
        self._map.close()


def host_store(world_size: int) -> TCPStore:
    """Rank 0's store on a free localhost port (``store.port``); the other ranks connect to it."""
    return TCPStore(
        STORE_HOST,
        0,
        world_size,
        True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def worker_key(rank: int) -> str:
    """The store key a worker sets once it is up, before it joins the group (rank 0 waits for it, watching the
    worker)."""
    return f"enginekit-worker-{rank}"


def join_store(rank: int, size: int, port: int) -> TCPStore:
    """A worker's connection to rank 0's store, announced under ``worker_key``."""
    store = TCPStore(STORE_HOST, port, size, False, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    store.set(worker_key(rank), "up")
    return store


class ProcessGroup:
    """This process's rank in the tensor-parallel group: the collectives the parallel layers call."""

    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        *,
        store: TCPStore | None = None,
        port: int = 0,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        progress: ProgressBoard | None = None,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        # NOTE: the board's counts themselves, not the board: one attribute read and an add per collective.
        self._progress = progress.counts if progress is not None else None
        if store is None:
            store = TCPStore(STORE_HOST, port, size, False, timeout=datetime.timedelta(seconds=timeout_s))
        self.store = store
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.closed = False

    def _enter(self) -> None:
        """Count a collective this rank enters on the progress board."""
        if self._progress is not None:
            self._progress[self.rank] += 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._enter()
        dist.all_reduce(tensor)

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        self._enter()
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            dist.gather(tensor, parts, dst=0)
            return parts
        dist.gather(tensor, None, dst=0)
        return None

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self._enter()
        dist.broadcast(tensor, 0)
        return tensor

    def abort(self) -> None:
        """Abort the group's communicators from any thread, so that a collective blocked on a dead or stopped peer
        returns (NCCL: it never raises on its own; gloo raises once the peer's connection closes, and has no abort).
        """
        if self.closed or self.device.type != "cuda":
            return
        self.closed = True  # destroy_process_group has nothing left to destroy
        dist.distributed_c10d._abort_process_group()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            dist.destroy_process_group()


def pack_batch(batch: ScheduledBatch) -> tuple[bytes, torch.Tensor, torch.Tensor | None]:
    """The header (``HEADER``), the int64 payload and the prompt embeddings (or ``None``) of ``batch``."""
    fields: list[int] = []
    tokens: list[int] = []
    tables: list[int] = []
    embeds = []
    for chunk in batch.chunks:
        rows = chunk.prompt_embeds.shape[0] if chunk.prompt_embeds is not None else 0
        fields += [
            chunk.start,
            chunk.num_tokens,
            chunk.num_sample_rows,
            len(chunk.prompt_targets or ()),
            int(chunk.rope_long),
            len(chunk.block_table),
            rows,
            chunk.lora_slot,
        ]
        tokens += chunk.token_ids
        tables += chunk.block_table
        if chunk.prompt_embeds is not None:
            embeds.append(chunk.prompt_embeds)
    payload = torch.tensor(fields + tokens + tables, dtype=torch.long)
    embeddings = torch.cat(embeds) if embeds else None
    header = HEADER.pack(
        OP_STEP,
        len(batch.chunks),
        len(tokens),
        len(tables),
        batch.num_used_blocks,
        embeddings.shape[0] if embeddings is not None else 0,
        payload.numel(),
        0,
    )
    return header, payload, embeddings


def stop_header() -> bytes:
    return HEADER.pack(OP_STOP, 0, 0, 0, 0, 0, 0, 0)


def broadcast_batch(group: ProcessGroup, payload: torch.Tensor, embeddings: torch.Tensor | None) -> None:
    """Rank 0's side: the payload, then the embeddings (after each worker has read the header). On CUDA they go up
    through pinned memory without blocking: from pageable memory the host would wait for the work queued before."""
    group.broadcast(transfer.upload_tensor(payload, group.device))
    if embeddings is not None:
        group.broadcast(transfer.upload_tensor(embeddings.contiguous(), group.device))


def receive_batch(
    group: ProcessGroup, header: bytes, hidden_size: int, dtype: torch.dtype
) -> ScheduledBatch | None:
    """A worker's side: the batch ``header`` announces (``None`` for a stop)."""
    op, num_chunks, _, _, used_blocks, embed_rows, payload_len, _ = HEADER.unpack(header)
    if op == OP_STOP:
        return None
    payload = group.broadcast(torch.empty(payload_len, dtype=torch.long, device=group.device)).tolist()
    embeddings = None
    if embed_rows:
        embeddings = group.broadcast(torch.empty((embed_rows, hidden_size), dtype=dtype, device=group.device))
    fields = payload[: num_chunks * CHUNK_FIELDS]
    position = num_chunks * CHUNK_FIELDS
    token_at = position
    table_at = position + sum(fields[i * CHUNK_FIELDS + 1] for i in range(num_chunks))
    embed_at = 0
    chunks = []
    for i in range(num_chunks):
        start, count, samples, targets, rope_long, table_len, rows, lora_slot = fields[
            i * CHUNK_FIELDS : (i + 1) * CHUNK_FIELDS
        ]
        chunk = SequenceChunk(
            payload[token_at : token_at + count],
            start,
            payload[table_at : table_at + table_len],
            sampling_params=_SAMPLES if samples else None,
            draft_token_ids=[0] * (samples - 1) if samples > 1 else [],
            prompt_targets=[0] * targets if targets else None,
            prompt_logprobs=1 if targets else None,
            rope_long=bool(rope_long),
            lora_slot=lora_slot,
        )
        if rows:
            assert embeddings is not None
            chunk.prompt_embeds = embeddings[embed_at : embed_at + rows]
            embed_at += rows
        token_at += count
        table_at += table_len
        chunks.append(chunk)
    return ScheduledBatch(chunks, used_blocks)


def broadcast_lora(group: ProcessGroup, pipes: list[int], slot: int, weights: LoRAWeights) -> None:
    """Rank 0's side of writing a LoRA adapter into ``slot``: the header on each worker's pipe, then the weights."""
    flat = pack(weights)
    header = HEADER.pack(OP_LORA, slot, weights.rank, flat.numel(), 0, 0, 0, 0)
    for fd in pipes:
        os.write(fd, header)
    group.broadcast(flat.to(group.device))


def receive_lora(group: ProcessGroup, header: bytes, config: ModelConfig) -> tuple[int, LoRAWeights]:
    """A worker's side: the slot and the weights ``header`` announces."""
    _, slot, rank, size, *_ = HEADER.unpack(header)
    flat = group.broadcast(torch.empty(size, dtype=torch.float32, device=group.device)).cpu()
    return slot, unpack(flat, f"slot {slot}", rank, config)
