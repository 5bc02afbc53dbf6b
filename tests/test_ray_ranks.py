"""Data-parallel ranks placed by Ray (``data_parallel_backend="ray"``), on a local Ray cluster this module starts
(``ray.init(num_cpus=4)``: room for two ranks of two model ranks each): the tokens of ``"mp"`` ranks, with and without
tensor parallelism, a killed actor or tensor-parallel worker is the engine's death, restart, and nothing left on the
cluster after a shutdown. Slow (a cluster, and a torch import per actor); skipped without
Ray (``pip install 'enginekit[ray]'``)."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from enginekit import Engine, EngineDeadError, SamplingParams
from enginekit.config import EngineConfig
from process_support import HANG_GUARD_S, in_thread, wait_gone, wait_until_generating

PROMPTS = [f"ray rank prompt {i}: " + "z" * i for i in range(8)]
GREEDY = SamplingParams(max_tokens=8, temperature=0)
LONG = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
JOIN_TIMEOUT_S = 180.0  # a bound against hanging: each actor imports torch in a fresh Ray worker
OPTIONS = {"data_parallel_size": 2, "num_kv_blocks": 128, "startup_timeout": JOIN_TIMEOUT_S}


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_the_ray_backend_refuses_what_it_cannot_place():
    for wrong in (
        {"data_parallel_size_local": 1, "address": "tcp://127.0.0.1:5000", "data_parallel_keys": "k"},
        {"data_parallel_rank": 0},
        {"address": "ipc:///tmp/x"},
        {"device": "cuda:1"},
    ):
        with pytest.raises(ValueError):
            EngineConfig(data_parallel_size=2, data_parallel_backend="ray", **wrong)


def test_without_ray_the_error_says_how_to_install_it():
    code = (
        "import sys; sys.modules['ray'] = None\n"  # an import of ray now fails, as if it were not installed
        "from enginekit.config import EngineConfig\n"
        "try:\n"
        "    EngineConfig(data_parallel_size=2, data_parallel_backend='ray')\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'enginekit[ray]'" in result.stdout, result.stdout + result.stderr


ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'enginekit[ray]'")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of four CPUs, started here: the engine joins it instead of starting its own. Four: two
    ranks of ``tensor_parallel_size=2`` reserve a CPU per model rank (Ray's CPUs are a count it schedules by, not
    cores)."""
    for attempt in range(3):  # a loaded machine can still make one start miss Ray's deadlines
        try:
            with daemons_first():
                ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
            break
        except Exception as error:  # Ray's own start, before any enginekit code runs
            ray.shutdown()
            if attempt == 2:
                pytest.skip(f"a local Ray cluster did not start on this machine (3 tries): {error}")
    yield
    ray.shutdown()


@contextlib.contextmanager
def daemons_first():
    """Start Ray's daemons ahead of other work on a loaded machine, then put them back at this process's priority.

    Ray's raylet gives its agents about 15 s to write their ports, and on a busy two-core machine importing them
    takes longer (the start then fails with "The current node timed out during startup"). Root may raise the
    priority of what it starts; others start at their own and rely on the machine being less busy."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, own - 15)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, own)
        for child in psutil.Process().children(recursive=True):  # the daemons, and workers they prestarted
            with contextlib.suppress(psutil.Error):
                child.nice(own)


@pytest.fixture(scope="module")
def tp_reference():
    """The tokens of two local ranks of two model ranks each (the same reduction order as on Ray)."""
    with Engine(
        "builtin", mode="mp", data_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=128
    ) as engine:
        return tokens(engine.generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def reference():
    with Engine("builtin", mode="mp", data_parallel_size=2, num_kv_blocks=128) as engine:
        return tokens(engine.generate(PROMPTS, GREEDY))


def leftovers():
    """Live actors and placement groups on the cluster (the GCS's tables)."""
    from ray._private.state import actors
    from ray.util.placement_group import placement_group_table

    live = [a for a in actors().values() if a["State"] != "DEAD"]
    groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    return live, groups


def test_ranks_the_cluster_cannot_hold_are_refused_before_any_is_placed(cluster):
    """Two ranks of two model ranks on a cluster too small for both bundles (the 4-CPU cluster here, as 2 threads per
    model rank make each bundle 4 CPUs): refused at once, not after ``startup_timeout`` (here the default, 120 s)
    spent waiting for a placement group that cannot fit."""
    with pytest.raises(
        ValueError,
        match=r"2 ranks of tensor_parallel_size=2 \(a bundle of 4 CPU per rank: 2 model ranks x 2 CPU each\) "
        r"need 8 CPUs, the cluster has 4; give Ray more",
    ):
        Engine(
            "builtin",
            mode="mp",
            data_parallel_backend="ray",
            data_parallel_size=2,
            tensor_parallel_size=2,
            num_threads=4,
            num_kv_blocks=64,
        )
    assert leftovers() == ([], [])


@pytest.mark.slow
def test_ray_ranks_give_the_tokens_of_local_ranks_and_leave_nothing(cluster, reference):
    with Engine("builtin", mode="mp", data_parallel_backend="ray", **OPTIONS) as engine:
        assert tokens(engine.generate(PROMPTS, GREEDY)) == reference
        ranks = engine.get_stats()["ranks"]
        assert all(rank["num_generated_tokens"] > 0 for rank in ranks)  # both did work
        assert all(pid != os.getpid() for pid in engine.client.engine_pids)
        live, groups = leftovers()
        assert len(live) == 2 and len(groups) == 2
        engine.restart()
        assert tokens(engine.generate(PROMPTS, GREEDY)) == reference
        pids = list(engine.client.engine_pids)
    deadline = time.monotonic() + HANG_GUARD_S
    while leftovers() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == ([], [])
    assert wait_gone(pids, 30) == []


@pytest.mark.slow
def test_killing_a_ray_rank_is_the_engines_death_and_restart_places_new_ones(cluster, reference):
    with Engine("builtin", mode="async", data_parallel_backend="ray", **OPTIONS) as engine:
        victim = engine.client.engine_pids[1]  # the Ray worker process that hosts rank 1's actor
        worker, outcome = in_thread(lambda: engine.generate(PROMPTS[:4], LONG))
        wait_until_generating(engine)
        os.kill(victim, signal.SIGKILL)
        worker.join(HANG_GUARD_S)
        assert not worker.is_alive(), "generate still waits after the Ray rank died"
        with pytest.raises(EngineDeadError, match=rf"engine rank 1: .*\(pid {victim}\) closed"):
            raise outcome[0]
        engine.restart()
        assert victim not in engine.client.engine_pids
        assert tokens(engine.generate(PROMPTS, GREEDY)) == reference
    deadline = time.monotonic() + HANG_GUARD_S
    while leftovers() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == ([], [])


@pytest.mark.slow
def test_ray_ranks_run_their_tensor_parallel_workers_beside_them(cluster, tp_reference):
    """Each rank's bundle holds its two model ranks; the actor's engine runs its worker as its child, on its node; a
    killed worker is the engine's death; restart places new actors and workers; shutdown leaves nothing."""
    options = {**OPTIONS, "tensor_parallel_size": 2}
    with Engine("builtin", mode="async", data_parallel_backend="ray", **options) as engine:
        assert tokens(engine.generate(PROMPTS, GREEDY)) == tp_reference
        actors = list(engine.client.engine_pids)
        workers = [rank["tensor_parallel_workers"] for rank in engine.call_utility("debug_process")]
        assert [len(pids) for pids in workers] == [1, 1]
        # each the child of its rank's actor, which runs model rank 0 in its engine
        assert [psutil.Process(pid).ppid() for (pid,) in workers] == actors
        live, groups = leftovers()
        assert len(live) == 2 and [g["bundles"] for g in groups] == [{0: {"CPU": 2.0}}] * 2
        victim = workers[1][0]
        caller, outcome = in_thread(lambda: engine.generate(PROMPTS[:4], LONG))
        wait_until_generating(engine)
        os.kill(victim, signal.SIGKILL)
        caller.join(HANG_GUARD_S)
        assert not caller.is_alive(), "generate still waits after a tensor-parallel worker died"
        with pytest.raises(EngineDeadError, match=rf"tensor-parallel worker rank 1 \(pid {victim}\)"):
            raise outcome[0]
        engine.restart()
        assert tokens(engine.generate(PROMPTS, GREEDY)) == tp_reference
        pids = [*engine.client.engine_pids]
        pids += [
            pid for rank in engine.call_utility("debug_process") for pid in rank["tensor_parallel_workers"]
        ]
        assert not set(pids) & {*actors, victim}
    deadline = time.monotonic() + HANG_GUARD_S
    while leftovers() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == ([], [])
    assert wait_gone([*actors, *(pid for (pid,) in workers), *pids], 30) == []
