"""The vocabulary split over tensor-parallel ranks: the token embedding and the LM head.

Rank r holds rows ``[r * per, (r + 1) * per)`` of the vocabulary (``per = ceil(vocab / ranks)``; the last rank's
rows past the vocabulary are zeros, so every rank's slice has the same shape).

- ``VocabParallelEmbedding``: each rank looks up the tokens in its rows and writes zeros for the others; the sum
  over the ranks (``all_reduce``) is the embedding, exactly (one term is non-zero).
- ``ParallelLMHead``: each rank computes the logits of its rows; rank 0 gathers them side by side and samples.
  The other ranks return an empty tensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from enginekit.model.layers.linear import Linear
from enginekit.model.layers.parallel_linear import Collectives


def vocab_slice(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first row, end row, rows per rank) of ``rank``'s slice of the vocabulary."""
    per = -(-vocab_size // size)
    start = min(vocab_size, rank * per)
    return start, min(vocab_size, start + per), per


def shard_vocab_rows(full: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """This rank's rows of a ``[vocab, hidden]`` table, padded with zero rows to ``per`` (a copy)."""
    start, end, per = vocab_slice(full.shape[0], comm.rank, comm.size)
    rows = full.new_zeros((per, full.shape[1]))
    rows[: end - start] = full[start:end]
    return rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, comm: Collectives) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.comm = num_embeddings, embedding_dim, comm
        self.start, self.end, per = vocab_slice(num_embeddings, comm.rank, comm.size)
        self.weight = nn.Parameter(torch.empty(per, embedding_dim))

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_vocab_rows(full, self.comm)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        local = input - self.start
        outside = (input < self.start) | (input >= self.end)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.comm.all_reduce(out)
        return out

    __call__ = forward


class ParallelLMHead(Linear):
    """The LM head over this rank's rows of the vocabulary; rank 0 gets every rank's logits, the others ``[]``."""

    def __init__(self, in_features: int, vocab_size: int, *, comm: Collectives) -> None:
        super().__init__(in_features, vocab_slice(vocab_size, comm.rank, comm.size)[2], bias=False)
        self.vocab_size, self.comm = vocab_size, comm

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_vocab_rows(full, self.comm)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # named as nn.Linear names it
        local = self.kernel(input, self.weight, None).contiguous()
        parts = self.comm.gather_to_first(local)
        if parts is None:
            return local.new_empty((0,))
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    __call__ = forward
