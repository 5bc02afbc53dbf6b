"""GPU placement of data-parallel ranks: the rules, checked on CPU with the visible-device count given.

``rank_device`` is pure (the count is its argument); ``check_placement`` and ``rank_config`` read the count from
torch, which a CPU machine cannot vary, so those tests set it through the module's own reader. The CUDA run
itself is left to the GPU check script."""

from __future__ import annotations

import pytest

from enginekit import EngineConfig
from enginekit.client import startup
from enginekit.client.startup import check_placement, rank_config, rank_device


def external(rank: int, size: int = 2) -> EngineConfig:
    return EngineConfig(device="cuda", data_parallel_size=size, data_parallel_rank=rank)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_external_rank_with_one_visible_gpu_runs_on_it(rank):
    """CUDA_VISIBLE_DEVICES=r per process, as vLLM's external load balancing is launched: cuda:0 is rank r's GPU."""
    assert rank_device(external(rank, size=4), rank, visible=1) == "cuda:0"


def test_external_rank_that_sees_every_gpu_takes_its_own():
    assert rank_device(external(1), 1, visible=2) == "cuda:1"
    assert rank_device(external(1), 1, visible=8) == "cuda:1"


def test_external_rank_with_an_ambiguous_device_count_is_refused():
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=2\), or let it see all 4"):
        rank_device(external(2, size=4), 2, visible=2)
    with pytest.raises(ValueError, match="0 visible CUDA devices"):
        rank_device(external(0), 0, visible=0)


def test_internal_ranks_take_cuda_r_and_need_a_device_each():
    config = EngineConfig(device="cuda", data_parallel_size=2)
    assert [rank_device(config, rank, visible=2) for rank in (0, 1)] == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match=r"data_parallel_size=2 needs 2 CUDA devices .* 1 visible"):
        rank_device(config, 1, visible=1)


def test_remote_ranks_do_not_count_against_this_hosts_devices():
    config = EngineConfig(
        device="cuda",
        data_parallel_size=3,
        data_parallel_size_local=1,
        address="tcp://127.0.0.1:5555",
        data_parallel_keys="/tmp/keys",
    )
    assert rank_device(config, 0, visible=1) == "cuda:0"
    assert rank_config(config, 2) is config  # a remote rank's host places it


@pytest.fixture
def visible_gpus(monkeypatch):
    def set_count(count: int) -> None:
        monkeypatch.setattr(startup, "_visible_cuda_devices", lambda: count)
        monkeypatch.setattr(startup, "_cuda_available", lambda: count > 0)

    return set_count


def test_check_placement_accepts_one_gpu_per_external_rank(visible_gpus):
    visible_gpus(1)
    check_placement(external(1))  # used to be refused: "needs 2 CUDA devices, 1 visible"
    assert rank_config(external(1), 1).device == "cuda:0"
    with pytest.raises(ValueError, match="needs 2 CUDA devices"):
        check_placement(EngineConfig(device="cuda", data_parallel_size=2))


def test_rank_config_places_internal_ranks(visible_gpus):
    visible_gpus(4)
    config = EngineConfig(data_parallel_size=2)  # device None: CUDA when available
    assert [rank_config(config, rank).device for rank in (0, 1)] == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="give device='cuda', not 'cuda:1'"):
        check_placement(EngineConfig(device="cuda:1", data_parallel_size=2))
