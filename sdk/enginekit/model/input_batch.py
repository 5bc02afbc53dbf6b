"""The step's inputs, prepared in persistent host buffers and copied to the device without blocking.

Two kinds of buffer, each a host tensor (pinned on CUDA) with a device twin (on CPU the twin is the host tensor
itself, and nothing is copied):

- **The block tables**, one row per live sequence, kept from step to step: a sequence's row is written once, then
  only its new block ids are appended (``sync_tables``), or its last ones cleared when its list shrank (blocks given
  back after rejected proposals); a freed sequence's row is cleared and reused. Entries past a
  sequence's blocks are 0. The rows that changed are copied up in one copy of the tables' used rows.
- **The step's token rows** (token id, rotary row, cache slot, context length, table row) and the logits rows,
  computed with numpy from a handful of per-chunk numbers (no loop over tokens), packed into one buffer and copied up
  in one copy; with ``kernel_layout`` (the Triton path, ``runner.py``), each chunk's first row and context length
  after the step in the same copy.

NOTE: on CUDA a host buffer is written again only after the copy that read it has run (``_copied``): the next step
is prepared while this one may still be queued behind the previous one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from enginekit.model import transfer
from enginekit.model.batch import SequenceChunk
from enginekit.model.layers.paged_attention import NATIVE_QUERY_ROWS

TOKEN_FIELDS = 5  # token id, rotary row, cache slot, context length, table row


@dataclass
class StepInputs:
    """One step's inputs on the device, and the host numbers the attention metadata is built from."""

    per_token: torch.Tensor  # [TOKEN_FIELDS, T]: the five rows below, one tensor
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] rows of the rotary tables (the position, past the short table for longrope)
    slot_mapping: torch.Tensor  # [T]
    context_lens: torch.Tensor  # [T] tokens each row attends to (0: a row attended by SDPA, or not natively)
    table_rows: torch.Tensor  # [T] each token's row of ``InputBatch.tables``
    logits_indices: torch.Tensor  # the sampling rows first, then every prompt row whose logprobs are wanted
    chunk_rows: torch.Tensor  # [chunks] each chunk's row of ``InputBatch.tables``
    embeds: list[tuple[int, torch.Tensor]]
    prompt_rows: dict[int, slice]  # chunk index -> its prompt rows among the logits
    # on the host, per chunk: its first token's position, its token count, its row of the tables
    starts: np.ndarray
    counts: np.ndarray
    rows: np.ndarray
    # with ``kernel_layout`` (else None), on the device: [chunks + 1] cumulative token counts (0 first) and
    # [chunks] each chunk's context length after the step
    query_start: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


class InputBatch:
    def __init__(
        self, *, block_size: int, device: torch.device, rope_offset: int, min_table_width: int = 1
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.rope_offset = rope_offset  # longrope: where the long factors' rotary rows start (0: no longrope)
        self._pinned = device.type == "cuda"
        self._rows: dict[str, int] = {}  # live sequence -> its row of the tables
        self._row_tables: list[list[int] | None] = []  # the block list each row was written from
        self._row_lengths: list[int] = []  # block ids written in each row
        self._free_rows: list[int] = []
        self._scratch_rows: list[int] = []  # rows of sequences without an id (this step only)
        self._used_rows = 0  # rows [0, used) have ever held a sequence
        self._dirty = False  # the host tables changed since the last copy up
        self.host_tables, self.tables = self._pair((0, max(min_table_width, 1)))
        self._staging, self._device_staging = self._pair((0,))
        self._copied: torch.cuda.Event | None = None

    def _pair(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.zeros(shape, dtype=torch.long, pin_memory=self._pinned)
        return host, (torch.zeros(shape, dtype=torch.long, device=self.device) if self._pinned else host)

    # ---- the block tables ---------------------------------------------------------------------------------
    def release(self, seq_ids: list[str]) -> None:
        """Free the rows of sequences whose blocks were freed (finished, aborted, preempted)."""
        for seq_id in seq_ids:
            row = self._rows.pop(seq_id, None)
            if row is not None:
                self._clear(row)

    def _clear(self, row: int) -> None:
        self._empty(row)
        self._free_rows.append(row)

    def _empty(self, row: int) -> None:
        if self._row_lengths[row]:
            self._wait_for_copy()
            self.host_tables[row, : self._row_lengths[row]] = 0
            self._dirty = True
        self._row_tables[row], self._row_lengths[row] = None, 0

    def _row_of(self, chunk: SequenceChunk) -> int:
        row = self._rows.get(chunk.seq_id) if chunk.seq_id is not None else None
        if row is None:
            row = self._free_rows.pop() if self._free_rows else self._new_row()
            if chunk.seq_id is None:
                self._scratch_rows.append(row)
            else:
                self._rows[chunk.seq_id] = row
        return row

    def _new_row(self) -> int:
        row = self._used_rows
        if row == self.host_tables.shape[0]:
            self._grow(max(8, row * 2), self.host_tables.shape[1])
        self._used_rows += 1
        self._row_tables.append(None)
        self._row_lengths.append(0)
        return row

    def _grow(self, rows: int, width: int) -> None:
        self._wait_for_copy()
        host, device = self._pair((rows, width))
        old = self.host_tables
        host[: old.shape[0], : old.shape[1]] = old
        self.host_tables, self.tables = host, device
        self._dirty = True

    def sync_tables(self, chunks: list[SequenceChunk]) -> np.ndarray:
        """Each chunk's row of the tables, with its new block ids written in (the whole row if its sequence got a
        new block list: first scheduled, or again after preemption)."""
        for row in self._scratch_rows:
            self._clear(row)
        self._scratch_rows.clear()
        rows = np.empty(len(chunks), dtype=np.int64)
        for index, chunk in enumerate(chunks):
            row = rows[index] = self._row_of(chunk)
            table = chunk.block_table
            written = self._row_lengths[row]
            if self._row_tables[row] is not table:  # a new list: write it whole
                self._empty(row)
                self._row_tables[row], written = table, 0
            elif len(table) < written:  # blocks given back (rejected proposals' slots): clear their entries
                self._wait_for_copy()
                self.host_tables[row, len(table) : written] = 0
                self._row_lengths[row] = written = len(table)
                self._dirty = True
            if len(table) > written:
                if len(table) > self.host_tables.shape[1]:
                    self._grow(self.host_tables.shape[0], max(len(table), self.host_tables.shape[1] * 2))
                self._wait_for_copy()
                self.host_tables.numpy()[row, written : len(table)] = table[written:]
                self._row_lengths[row] = len(table)
                self._dirty = True
        return rows

    # ---- the step's rows ----------------------------------------------------------------------------------
    def prepare(
        self,
        chunks: list[SequenceChunk],
        native_until: int,
        previous: torch.Tensor | None = None,
        *,
        kernel_layout: bool = False,
    ) -> StepInputs:
        """The inputs of ``chunks``. Every decode's row gets its context length, and so does every row of a prefill
        chunk that ends within ``native_until`` tokens of its sequence's start (0: none; the others get 0);
        ``previous``: the ids the step before sampled, on the device, where chunks with a ``sampled_row`` find
        their token; ``kernel_layout``: stage each chunk's token start and length after the step too
        (``StepInputs.query_start``, ``seq_lens``)."""
        rows = self.sync_tables(chunks)
        count = len(chunks)
        starts = np.fromiter((chunk.start for chunk in chunks), np.int64, count)
        if all(len(chunk.token_ids) == 1 for chunk in chunks):  # decodes only (most steps): a row each
            total, counts, firsts = count, np.ones(count, np.int64), np.arange(count)
            positions, table_rows, lens = starts, rows, starts + 1
            tokens = np.fromiter((chunk.token_ids[0] for chunk in chunks), np.int64, count)
        else:
            counts = np.fromiter((chunk.num_tokens for chunk in chunks), np.int64, count)
            ends = np.cumsum(counts)
            total = int(ends[-1])
            firsts = ends - counts
            positions = np.arange(total) - np.repeat(firsts - starts, counts)
            table_rows = np.repeat(rows, counts)
            native = (counts == 1) | (starts + counts <= native_until)
            if native_until:
                native |= counts <= NATIVE_QUERY_ROWS
            lens = np.where(np.repeat(native, counts), positions + 1, 0)
            tokens = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, total)
        size = self.block_size
        slots = self.host_tables.numpy()[table_rows, positions // size] * size + positions % size
        rope = positions
        if self.rope_offset:
            long = np.fromiter((chunk.rope_long for chunk in chunks), np.int64, count)
            rope = positions + np.repeat(long * self.rope_offset, counts)
        logits_rows, prompt_rows = _logits_rows(chunks, firsts, counts)
        pending = [
            (int(firsts[i]), chunk.sampled_row)
            for i, chunk in enumerate(chunks)
            if chunk.sampled_row is not None
        ]
        layout = None
        if kernel_layout:  # query starts (the firsts, then the total) and lengths after the step
            layout = np.concatenate((firsts, (total,), starts + counts))
        staged = self._stage(
            total, (tokens, rope, slots, lens, table_rows), logits_rows, rows, layout, pending
        )
        if pending:
            assert previous is not None  # a chunk takes its token from the step before only when it is given
            end = staged.shape[0]
            moves = staged[end - 2 * len(pending) :].view(len(pending), 2)
            staged[:total].index_copy_(0, moves[:, 0], previous.index_select(0, moves[:, 1]))
        embeds = [
            (int(firsts[i]), transfer.upload_tensor(chunk.prompt_embeds, self.device))
            for i, chunk in enumerate(chunks)
            if chunk.prompt_embeds is not None
        ]
        per_token = staged[: TOKEN_FIELDS * total].view(TOKEN_FIELDS, total)
        end = TOKEN_FIELDS * total + len(logits_rows)
        query_start = seq_lens = None
        if layout is not None:
            at = end + count
            query_start, seq_lens = staged[at : at + count + 1], staged[at + count + 1 : at + 2 * count + 1]
        return StepInputs(
            per_token,
            per_token[0],
            per_token[1],
            per_token[2],
            per_token[3],
            per_token[4],
            staged[TOKEN_FIELDS * total : end],
            staged[end : end + len(chunks)],
            embeds,
            prompt_rows,
            starts,
            counts,
            rows,
            query_start,
            seq_lens,
        )

    def _stage(
        self,
        total: int,
        fields: tuple[np.ndarray, ...],
        logits_rows: np.ndarray,
        rows: np.ndarray,
        layout: np.ndarray | None,
        pending: list[tuple[int, int]],
    ) -> torch.Tensor:
        """Pack the step's rows into the staging buffer and copy them (and the changed tables) to the device;
        ``layout`` (or None) after the chunks' rows; ``pending``: (token row, row of the previous step's ids)
        pairs, packed last."""
        extra = len(layout) if layout is not None else 0
        size = TOKEN_FIELDS * total + len(logits_rows) + len(rows) + extra + 2 * len(pending)
        self._wait_for_copy()
        if self._staging.shape[0] < size:
            self._staging, self._device_staging = self._pair((max(size, self._staging.shape[0] * 3 // 2),))
        staging = self._staging.numpy()
        for i, values in enumerate(fields):
            staging[i * total : (i + 1) * total] = values
        at = TOKEN_FIELDS * total
        staging[at : at + len(logits_rows)] = logits_rows
        at += len(logits_rows)
        staging[at : at + len(rows)] = rows
        at += len(rows)
        if layout is not None:
            staging[at : at + extra] = layout
            at += extra
        if pending:
            staging[at:size] = np.array(pending, dtype=np.int64).ravel()
        if not self._pinned:
            self._dirty = False
            return self._staging[:size]
        device = self._device_staging[:size]
        device.copy_(self._staging[:size], non_blocking=True)
        if self._dirty:
            used = self._used_rows
            self.tables[:used].copy_(self.host_tables[:used], non_blocking=True)
            self._dirty = False
        self._copied = torch.cuda.Event()
        self._copied.record()
        return device

    def clear(self) -> None:
        """Drop every buffer (the runner is released): device memory goes back with the KV cache."""
        self._wait_for_copy()
        self._rows.clear()
        self._row_tables, self._row_lengths, self._free_rows, self._scratch_rows = [], [], [], []
        self._used_rows = 0
        self.host_tables = self.tables = self._staging = self._device_staging = torch.zeros(
            0, dtype=torch.long
        )

    def _wait_for_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None


def _logits_rows(
    chunks: list[SequenceChunk], firsts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, dict]:
    """The rows whose logits are computed: every sampling chunk's last (and, with proposals, the rows before it
    that sample too, in order), then the prompt rows whose logprobs are wanted (chunk index -> their slice among
    the logits)."""
    sampling = [index for index, chunk in enumerate(chunks) if chunk.samples]
    lasts = firsts + counts - 1
    rows = lasts if len(sampling) == len(chunks) else lasts[sampling]
    widths = [chunks[index].num_sample_rows for index in sampling]
    if any(width > 1 for width in widths):  # proposals: each chunk's last rows, one per proposal and one more
        rows = np.concatenate([np.arange(last - width + 1, last + 1) for last, width in zip(rows, widths)])
    prompt = [
        (index, len(chunk.prompt_targets)) for index, chunk in enumerate(chunks) if chunk.prompt_targets
    ]
    if not prompt:
        return rows, {}
    parts, prompt_rows, at = [rows], {}, len(rows)
    for index, targets in prompt:
        prompt_rows[index] = slice(at, at + targets)
        parts.append(np.arange(firsts[index], firsts[index] + targets))
        at += targets
    return np.concatenate(parts), prompt_rows
