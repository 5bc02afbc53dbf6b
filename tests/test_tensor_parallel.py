"""Tensor parallelism: N model ranks behind one engine core give the tokens of one; a worker's death is the
engine's death; restarts leak nothing; it composes with data parallelism."""

import contextlib
import itertools
import os
import re
import signal
import threading

import pytest
import torch

import gguf_files
from enginekit import Engine, EngineDeadError, EngineStartupError, SamplingParams
from enginekit.diagnostics import snapshot, wait_until_clean
from enginekit.model.layers.vocab_parallel import vocab_slice
from enginekit.runtime.launcher import Launcher
from hf_checkpoints import build_checkpoint
from process_support import HANG_GUARD_S, in_thread, wait_for, wait_gone, wait_until_generating

PROMPTS = [f"tensor parallel prompt {i}: " + "the quick brown fox " * i for i in range(6)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = [SamplingParams(max_tokens=8, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
LONG = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
STALL_S = 2.0  # tensor_parallel_stall_timeout where a test stops a worker
# A worker's death reaches the caller through the executor's pidfd watch, at once; the messages asserted name the
# worker, which only that path knows. HANG_GUARD_S only bounds a hang.


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def first_logprobs(outputs):
    return [
        [step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A llama with a vocabulary that does not split evenly (387 rows over 2 ranks: 194 + 193), and a qwen2 with
    q/k/v biases and a tied LM head."""
    root = tmp_path_factory.mktemp("tp")
    return {
        "llama": build_checkpoint(root / "llama", "llama", vocab_size=387),
        "qwen2": build_checkpoint(root / "qwen2", "qwen2", tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def references(checkpoints):
    found = {}
    for name, path in checkpoints.items():
        with Engine(str(path), mode="mp", num_kv_blocks=128) as engine:
            greedy = engine.generate(PROMPTS, GREEDY)
            found[name] = tokens(greedy), first_logprobs(greedy), tokens(engine.generate(PROMPTS, SEEDED))
    return found


@pytest.mark.parametrize("mode", ["mp", "async"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_two_ranks_give_the_tokens_of_one(checkpoints, references, name, mode):
    greedy, logprobs, seeded = references[name]
    with Engine(str(checkpoints[name]), mode=mode, num_kv_blocks=128, tensor_parallel_size=2) as engine:
        outputs = engine.generate(PROMPTS, GREEDY)
        assert tokens(outputs) == greedy
        # the row-parallel sums add two partial products: the last bits may differ, never more
        assert torch.allclose(torch.tensor(first_logprobs(outputs)), torch.tensor(logprobs), atol=1e-4)
        assert tokens(engine.generate(PROMPTS, SEEDED)) == seeded
        workers = engine.call_utility("debug_process")["tensor_parallel_workers"]
        assert len(workers) == 1


def test_decode_graphs_pad_every_rank_alike(checkpoints, references):
    """``cuda_graphs=True`` under tensor parallelism: every rank pads a pure-decode step to the same shape (on CPU
    the padded path runs without capture), so their collectives match and the tokens are one rank's. On CUDA
    every rank also captures the step, its all-reduces included: the GPU check's ``tp`` phase runs that."""
    greedy, logprobs, _ = references["llama"]
    options = dict(mode="mp", num_kv_blocks=128, tensor_parallel_size=2, cuda_graphs=True, max_num_seqs=8)
    with Engine(str(checkpoints["llama"]), **options) as engine:
        outputs = engine.generate(PROMPTS, GREEDY)  # 6 decodes padded to 8 rows
        assert tokens(outputs) == greedy
        assert torch.allclose(torch.tensor(first_logprobs(outputs)), torch.tensor(logprobs), atol=1e-4)
        assert tokens(engine.generate(PROMPTS[:1], GREEDY)) == greedy[:1]


def test_vocab_slices_cover_the_vocabulary_once():
    for vocab, size in [(387, 2), (384, 2), (10, 4), (7, 3)]:
        slices = [vocab_slice(vocab, rank, size) for rank in range(size)]
        assert slices[0][0] == 0 and slices[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
        assert all(end - start <= per for start, end, per in slices)


def test_prompt_embeddings_and_prompt_logprobs_reach_every_rank(checkpoints):
    path = str(checkpoints["llama"])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    embeds = {"prompt_embeds": torch.randn(5, 64, generator=torch.Generator().manual_seed(0))}
    with Engine(path, mode="mp", num_kv_blocks=64) as engine:
        one, one_embedded = engine.generate([PROMPTS[2], embeds], params)
    with Engine(path, mode="mp", num_kv_blocks=64, tensor_parallel_size=2) as engine:
        two, two_embedded = engine.generate([PROMPTS[2], embeds], params)
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    assert two_embedded.outputs[0].token_ids == one_embedded.outputs[0].token_ids
    ours = [next(iter(p.values())).logprob for p in two.prompt_logprobs[1:]]
    theirs = [next(iter(p.values())).logprob for p in one.prompt_logprobs[1:]]
    assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=1e-4)


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_a_killed_worker_is_the_engines_death_and_restart_works(checkpoints, mode):
    Launcher.shared()
    before = snapshot()
    engine = Engine(str(checkpoints["llama"]), mode=mode, num_kv_blocks=256, tensor_parallel_size=2)
    try:
        engine_pid = engine.client.engine_pids[0]
        (worker_pid,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        caller, outcome = in_thread(lambda: engine.generate(PROMPTS[:2], LONG))
        wait_until_generating(engine)
        os.kill(worker_pid, signal.SIGKILL)
        caller.join(HANG_GUARD_S)
        assert not caller.is_alive(), "generate still waits after a worker died"
        with pytest.raises(EngineDeadError, match=rf"tensor-parallel worker rank 1 \(pid {worker_pid}\)"):
            raise outcome[0]
        assert wait_gone([engine_pid, worker_pid]) == []
        engine.restart()
        (new_worker,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        assert new_worker != worker_pid
        assert len(tokens(engine.generate(PROMPTS[:2], GREEDY))) == 2
    finally:
        engine.shutdown()
    diff = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert not diff.leaks(), diff.leaks()


@contextlib.contextmanager
def stopped(pid):
    """SIGSTOP ``pid``; on the way out it is resumed (if the engine has not killed it meanwhile)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_a_stopped_worker_fails_the_step_naming_its_rank_and_restart_works(checkpoints, mode):
    """A worker that is alive but stopped holds every collective: the watch finds it making no progress for
    ``tensor_parallel_stall_timeout`` and kills it, and the call fails naming it instead of hanging."""
    Launcher.shared()
    before = snapshot()
    engine = Engine(
        str(checkpoints["llama"]),
        mode=mode,
        num_kv_blocks=256,
        tensor_parallel_size=2,
        tensor_parallel_stall_timeout=STALL_S,
    )
    try:
        engine_pid = engine.client.engine_pids[0]
        (worker_pid,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        caller, outcome = in_thread(lambda: engine.generate(PROMPTS[:2], LONG))
        wait_until_generating(engine)
        with stopped(worker_pid):
            caller.join(HANG_GUARD_S)
        assert not caller.is_alive(), "generate still waits on a stopped worker"
        with pytest.raises(
            EngineDeadError,
            match=rf"tensor-parallel worker rank 1 \(pid {worker_pid}\) made no progress for 2 s in a step.*"
            r"it is stopped \(SIGSTOP",
        ):
            raise outcome[0]
        assert wait_gone([engine_pid, worker_pid], HANG_GUARD_S) == []
        engine.restart()
        assert len(tokens(engine.generate(PROMPTS[:2], GREEDY))) == 2
    finally:
        engine.shutdown()
    diff = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert not diff.leaks(), diff.leaks()


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_while_a_worker_is_stopped_calls_keep_their_timeouts_and_resumed_the_step_goes_on(checkpoints, mode):
    """With a stall timeout longer than the test, the engine waits for its stopped worker: meanwhile each call
    answers within its own timeout (``ping`` with ``False``, a utility with ``TimeoutError``), and once the worker
    resumes the generation finishes."""
    with Engine(
        str(checkpoints["llama"]),
        mode=mode,
        num_kv_blocks=256,
        tensor_parallel_size=2,
        tensor_parallel_stall_timeout=3600,
    ) as engine:
        (worker_pid,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        caller, outcome = in_thread(
            lambda: engine.generate(PROMPTS[:2], SamplingParams(max_tokens=200, ignore_eos=True))
        )
        wait_until_generating(engine)

        def while_stopped():
            while engine.ping(timeout=0.5):  # answered between two steps: the engine is not held yet
                pass
            with pytest.raises(TimeoutError, match=r"utility 'ping' did not answer within 0\.5s"):
                engine.call_utility("ping", timeout=0.5)
            return "held"

        checker, checked = in_thread(while_stopped)
        with stopped(worker_pid):
            checker.join(HANG_GUARD_S)
        assert not checker.is_alive(), "a call waited past its timeout while a worker was stopped"
        assert checked == ["held"], checked
        caller.join(HANG_GUARD_S)
        assert [len(output.outputs[0].token_ids) for output in outcome[0]] == [200, 200]
        assert engine.ping()


def test_a_step_that_does_not_end_once_its_stalled_worker_is_killed_hands_on_the_reason(checkpoints):
    """NCCL's case, which gloo cannot show (it raises once the killed worker's connection closes): a step that
    does not end when a peer is gone. A step that waits for an event stands in for it; the watch kills the stopped
    worker, and when the step has still not ended ``ABORT_GRACE_S`` later, it hands ``on_stuck`` the reason (the
    engine process then reports its death and exits)."""
    from enginekit.config import EngineConfig
    from enginekit.core.tp_executor import TensorParallelExecutor

    config = EngineConfig.from_options(
        str(checkpoints["llama"]), tensor_parallel_size=2, tensor_parallel_stall_timeout=0.5
    )
    threads = torch.get_num_threads()  # the executor sets this process's share
    executor = TensorParallelExecutor(config, torch.device("cpu"))
    heard, reasons = threading.Event(), []
    executor.on_stuck = lambda reason: (reasons.append(reason), heard.set())
    try:
        (worker_pid,) = executor.worker_pids
        with stopped(worker_pid):
            executor._collective(lambda: heard.wait(HANG_GUARD_S))
        assert wait_gone([worker_pid], HANG_GUARD_S) == []
    finally:
        executor.shutdown()
        torch.set_num_threads(threads)
    assert len(reasons) == 1
    assert re.fullmatch(
        rf"tensor-parallel worker rank 1 \(pid {worker_pid}\) made no progress for 0\.5 s in a step, holding "
        r"the other ranks up \(tensor_parallel_stall_timeout=0\.5\): it is stopped \(SIGSTOP or a job-control "
        r"stop\); the engine killed it",
        reasons[0],
    )


def test_an_idle_worker_death_fails_the_next_call(checkpoints):
    with Engine(str(checkpoints["llama"]), mode="async", num_kv_blocks=64, tensor_parallel_size=2) as engine:
        (worker_pid,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        os.kill(worker_pid, signal.SIGKILL)
        wait_for(lambda: not engine.client.is_alive, what="the engine hearing of its worker's death")
        with pytest.raises(EngineDeadError, match="tensor-parallel worker rank 1"):
            engine.generate(PROMPTS[0], GREEDY)


def test_restarts_leave_no_process_thread_or_file_behind(checkpoints):
    Launcher.shared()
    before = snapshot()
    engine = Engine(str(checkpoints["llama"]), mode="mp", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        seen = []
        for _ in range(2):
            seen += [
                *engine.client.engine_pids,
                *engine.call_utility("debug_process")["tensor_parallel_workers"],
            ]
            engine.generate(PROMPTS[:2], GREEDY)
            engine.restart()
        seen += [*engine.client.engine_pids, *engine.call_utility("debug_process")["tensor_parallel_workers"]]
    finally:
        engine.shutdown()
    assert wait_gone(seen) == []
    diff = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert not diff.leaks(), diff.leaks()


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_data_parallel_ranks_each_run_their_own_tensor_parallel_group(checkpoints, references, mode):
    greedy, _, seeded = references["llama"]
    with Engine(
        str(checkpoints["llama"]),
        mode=mode,
        num_kv_blocks=128,
        data_parallel_size=2,
        tensor_parallel_size=2,
    ) as engine:
        assert tokens(engine.generate(PROMPTS, GREEDY)) == greedy
        assert tokens(engine.generate(PROMPTS, SEEDED)) == seeded
        per_rank = engine.call_utility("debug_process")
        workers = [pid for rank in per_rank for pid in rank["tensor_parallel_workers"]]
        assert len(set(workers)) == 2


def test_heads_that_do_not_split_are_refused_naming_them(tmp_path):
    path = build_checkpoint(tmp_path / "odd", "llama", num_heads=4, num_kv_heads=2)
    with pytest.raises(EngineStartupError, match=r"2 KV heads.*sizes that work: 1, 2\b"):
        Engine(str(path), mode="mp", num_kv_blocks=16, tensor_parallel_size=4)
    with pytest.raises(EngineStartupError, match=r"4 attention heads, 2 KV heads.*sizes that work: 1, 2\b"):
        Engine(str(path), mode="mp", num_kv_blocks=16, tensor_parallel_size=3)


def test_spawned_engine_process_runs_its_workers_too(checkpoints, references):
    greedy, _, _ = references["llama"]
    with Engine(
        str(checkpoints["llama"]), mode="mp", num_kv_blocks=128, tensor_parallel_size=2, start_method="spawn"
    ) as engine:
        assert tokens(engine.generate(PROMPTS, GREEDY)) == greedy


def test_in_process_mode_is_refused():
    with pytest.raises(EngineStartupError, match="mode='mp' or 'async'"):
        Engine("builtin", mode="inproc", tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
        (
            {"tensor_parallel_size": 2, "tensor_parallel_stall_timeout": 0},
            r"tensor_parallel_stall_timeout must be a positive number of seconds, got 0",
        ),
        (
            {
                "tensor_parallel_size": 2,
                "data_parallel_size": 2,
                "data_parallel_size_local": 1,
                "address": "tcp://127.0.0.1:5555",
                "data_parallel_keys": "/nonexistent/keys.json",
            },
            "does not combine with remote ranks",
        ),
    ],
)
def test_bad_tensor_parallel_options_fail_before_anything_starts(options, message):
    with pytest.raises(ValueError, match=message):
        Engine("builtin", mode="mp", **options)


def test_a_gguf_file_is_split_as_float_weights(tmp_path):
    path = tmp_path / "tiny.gguf"
    gguf_files.write_tiny_gguf(path, weight_type=gguf_files.Q.Q8_0)
    with Engine(str(path), mode="mp", num_kv_blocks=64, quantization="none") as engine:
        reference = tokens(engine.generate(PROMPTS[:3], GREEDY))
    with Engine(str(path), mode="mp", num_kv_blocks=64, tensor_parallel_size=2) as engine:  # "auto"
        assert tokens(engine.generate(PROMPTS[:3], GREEDY)) == reference
    with pytest.raises(EngineStartupError, match=r"quantization='gguf'.*tensor_parallel_size=2"):
        Engine(str(path), mode="mp", num_kv_blocks=64, tensor_parallel_size=2, quantization="gguf")


def test_a_killed_engine_process_takes_its_workers_with_it(checkpoints):
    engine = Engine(str(checkpoints["llama"]), mode="mp", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        (worker_pid,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        os.kill(engine.client.engine_pids[0], signal.SIGKILL)
        assert wait_gone([worker_pid]) == []
    finally:
        engine.shutdown()


def test_a_worker_that_dies_before_joining_fails_the_start_at_once(tmp_path):
    """Rank 0 waits for each worker's store key while watching the worker: a worker that cannot even read the
    model (here: a folder that is not there) fails the start as it exits (the message names its exit code), not
    at the group's deadline."""
    from enginekit.config import EngineConfig
    from enginekit.core.tp_executor import TensorParallelExecutor

    config = EngineConfig.from_options(str(tmp_path / "missing"), tensor_parallel_size=2)
    threads = torch.get_num_threads()  # the executor sets this process's share
    try:
        with pytest.raises(
            EngineStartupError, match=r"tensor-parallel worker rank 1 \(pid \d+\) exited with code 1"
        ):
            TensorParallelExecutor(config, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
