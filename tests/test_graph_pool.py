"""``GraphPool.prepare``'s capture on the CPU, with torch.cuda's stream and graph calls played by stand-ins that
run the captured code once (as a capture does) and replay nothing: what is left to check without a GPU is what
the pool does around them. Every graph writes into one logits buffer; a tensor-parallel worker's step, which
computes no logits, is captured without one; every capture after the first goes into the first one's pool."""

import contextlib

import pytest
import torch

from enginekit.model.graph_pool import GraphPool


class _Graph:
    captured: list["_Graph"] = []

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1

    def pool(self) -> tuple[str, int]:
        return ("pool", id(_Graph.captured[0]))


@pytest.fixture
def fake_cuda(monkeypatch):
    pools = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        pools.append(pool)
        _Graph.captured.append(g)
        yield

    class _Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    monkeypatch.setattr(_Graph, "captured", [])
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    return pools


def test_every_graph_writes_its_logits_into_one_buffer_and_one_pool(fake_cuda):
    pool = GraphPool(torch.device("cpu"), max_rows=8, capture=True)
    runs = []

    def forward(rows: int, value: float):
        def run() -> torch.Tensor:
            runs.append(rows)
            return torch.full((rows, 5), value)

        return run

    small = pool.prepare(forward(2, 1.0), 2)
    large = pool.prepare(forward(8, 2.0), 8)
    assert runs == [2, 2, 8, 8]  # a warm-up, then the capture
    assert pool.logits is not None and pool.logits.shape == (8, 5)
    assert small().data_ptr() == large().data_ptr() == pool.logits.data_ptr()  # one buffer, each its rows
    assert small().shape == (2, 5) and large().shape == (8, 5)
    assert torch.equal(large(), torch.full((8, 5), 2.0))  # what the capture copied in
    assert fake_cuda == [None, ("pool", id(_Graph.captured[0]))]  # the second capture shares the first's pool
    assert [g.replays for g in _Graph.captured] == [2, 3]
    pool.release()
    assert pool.logits is None


def test_a_step_without_logits_is_captured_without_a_buffer(fake_cuda):
    """A tensor-parallel worker's forward returns an empty tensor (rank 0 computes the logits)."""
    pool = GraphPool(torch.device("cpu"), max_rows=4, capture=True)
    step = pool.prepare(lambda: torch.empty(0), 4)
    assert step().numel() == 0 and pool.logits is None
