"""The Triton path of a CUDA model: what its kernels need from a step, and when it is chosen.

The kernels (``triton_attention.py``: paged attention that reads the cache in place; ``triton_layer_ops.py``:
rotary embedding with the cache write, add + RMS norm, the gated activations) run on CUDA, one launch each, in
place of the layers' torch code. This module imports no Triton, so the layers can name it on every machine:

- :class:`PagedAttentionInputs`: the step's tensors the kernels read (block tables, query starts, sequence
  lengths, slots), on the device. The runner builds one per step and sets it on the step's
  ``AttentionMetadata.kernel_inputs``; while that is ``None`` (always, on CPU) the layers run their torch code.
- :func:`triton_ops`: the kernels (``TritonOps``) on CUDA when Triton imports, else ``None``. The CPU keeps its
  native C kernels (``native.py``) and everything else the torch code.

Every kernel computes in float32 from bfloat16, float16 or float32 tensors, and is tested on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``) against the torch code it replaces (``tests/test_triton_kernels.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger("enginekit.model")


@dataclass
class PagedAttentionInputs:
    """One step's attention layout for the Triton kernels, as device tensors (built without a host sync).

    The step's tokens are grouped by sequence, in the order of ``block_tables``' rows: sequence ``s``'s new
    tokens are rows ``query_start[s]:query_start[s + 1]`` of the flat batch (a decode has one, a prefill chunk
    many, in any order), and its token ``i`` of ``n`` sits at position ``seq_lens[s] - n + i``: it attends to
    the sequence's tokens up to its own (the last ``window`` of them on a sliding-window layer), all in the cache
    once the step's keys and values are written.

    ``max_query_len`` and ``max_seq_len`` (host numbers the scheduler knows) pick the launch's shape only (rows
    per program, split of long contexts), never its result: a CUDA graph may replay the kernels with other
    lengths in the same tensors.
    """

    # [num_tokens] int64: the cache slot of each new token's key and value (<0: none)
    slot_mapping: torch.Tensor
    # the three below: int32 (``build``) or int64 (the runner's, views of the step's staged inputs)
    block_tables: torch.Tensor  # [num_seqs, max_blocks]: each sequence's blocks (past its length: unread)
    query_start: torch.Tensor  # [num_seqs + 1]: cumulative new tokens, 0 first
    seq_lens: torch.Tensor  # [num_seqs]: each sequence's context length after this step
    block_size: int
    max_query_len: int
    max_seq_len: int
    # a padded step (``mixed_graph.py``): rows past ``query_start[-1]`` belong to no sequence; their output is zeros
    padded: bool = False

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
    ) -> PagedAttentionInputs:
        """The inputs of a step whose sequence ``s`` has ``query_lens[s]`` new tokens, ``seq_lens[s]`` tokens in
        all once they are written, and its blocks in ``block_tables[s]``, from host lists (one copy each)."""
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError(
                f"one query length, sequence length and block table per sequence, got {len(query_lens)}, "
                f"{len(seq_lens)} and {len(block_tables)}"
            )
        starts, slots = [0], []
        for new, length, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < new <= length or len(table) * block_size < length:
                raise ValueError(
                    f"a sequence of {length} tokens with {new} new ones and {len(table)} blocks of {block_size}: "
                    "every sequence needs at least one new token and a block for each of its tokens"
                )
            starts.append(starts[-1] + new)
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(length - new, length)
            )
        width = max(map(len, block_tables), default=0)
        padded = [list(table) + [0] * (width - len(table)) for table in block_tables]
        int32 = {"dtype": torch.int32, "device": device}
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, **int32).view(len(padded), width),
            query_start=torch.tensor(starts, **int32),
            seq_lens=torch.tensor(list(seq_lens), **int32),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


class TritonOps:
    """The Triton kernels, bound once (importing Triton): see ``triton_attention`` and ``triton_layer_ops`` for
    what each computes."""

    def __init__(self) -> None:
        from enginekit.model.kernels import triton_attention, triton_layer_ops

        self.paged_attention = triton_attention.paged_attention
        self.rope_write_cache = triton_layer_ops.rope_write_cache
        self.rms_norm = triton_layer_ops.rms_norm
        self.residual_norm = triton_layer_ops.residual_norm
        self.gated_activation = triton_layer_ops.gated_activation


def triton_ops(device: torch.device) -> TritonOps | None:
    """The Triton kernels for a model on ``device``: on CUDA when Triton is installed (the GPU images ship it
    with torch) and ``ENGINEKIT_TRITON_KERNELS`` is not ``0``; else ``None``, and the layers keep their torch
    code (on CPU, the native C kernels)."""
    if device.type != "cuda":
        return None
    if os.environ.get("ENGINEKIT_TRITON_KERNELS") == "0":
        logger.info("Triton kernels not used: ENGINEKIT_TRITON_KERNELS=0")
        return None
    if importlib.util.find_spec("triton") is None:
        logger.info("Triton kernels not used: triton is not installed (pip install triton)")
        return None
    try:
        return TritonOps()
    except ImportError as error:  # an installed triton that does not import (a broken or mismatched wheel)
        logger.warning("Triton kernels not used: %s", error)
        return None
