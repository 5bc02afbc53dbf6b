"""Remote ranks: engines started by hand (``python -m enginekit.runtime.remote_rank``) that join a front end
over CURVE-protected TCP with the keys file it wrote. Proven here with real processes on loopback: the same
tokens as one engine, a kill of the remote rank, a front end that dies, restart, and refusals."""

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from enginekit import Engine, EngineDeadError, EngineStartupError, SamplingParams
from enginekit.client.remote import RankWatcher, RemoteRank
from enginekit.config import EngineConfig
from enginekit.diagnostics import snapshot, wait_until_clean
from enginekit.runtime.launcher import Launcher
from enginekit.wire.keys import curve_client, read_keys
from enginekit.wire.messages import EngineProcArgs, JoinRefused, LegacyRankJoin, RankExit, RankJoin
from enginekit.wire.version import PROTOCOL, SCHEMA
from hf_checkpoints import build_checkpoint
from process_support import HANG_GUARD_S, in_thread, wait_for, wait_gone, wait_until_generating

PROMPTS = [f"remote rank prompt {i}: " + "y" * i for i in range(8)]
GREEDY = SamplingParams(max_tokens=8, temperature=0)
SEEDED = [SamplingParams(max_tokens=8, temperature=0.9, seed=i) for i in range(8)]
LONG = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
# A bound against hanging: a rank's process imports torch (twice: it re-executes under the engine's OpenMP
# settings) and may be the session's first to compile the native kernels; beside two busy processes on a shared
# 2-core machine that took more than 90 s.
JOIN_TIMEOUT_S = 180.0
POLL_GUARD_MS = int(HANG_GUARD_S * 1000)  # a poll returns as soon as its event is there; this bounds a hang


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def free_port_triple():
    """A base port whose next two are free as well (input, output, watch)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base > 65000:
            continue
        try:
            held = []
            for port in (base, base + 1, base + 2):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no three free ports in a row")


def start_rank(keys, rank=1, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "enginekit.runtime.remote_rank",
            "--keys",
            str(keys),
            "--rank",
            str(rank),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def options(keys, port, **more):
    return {
        "data_parallel_size": 2,
        "data_parallel_size_local": 1,
        "address": f"tcp://127.0.0.1:{port}",
        "data_parallel_keys": str(keys),
        "num_kv_blocks": 128,
        "startup_timeout": JOIN_TIMEOUT_S,
        **more,
    }


def stop_rank(process, wait_s=HANG_GUARD_S, sig=signal.SIGINT):
    """Wait ``wait_s`` for it to exit by itself, else signal it (Ctrl-C stops a rank for good); its output."""
    try:
        output, _ = process.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.send_signal(sig)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    return output


@pytest.fixture(scope="module")
def reference():
    with Engine("builtin", mode="mp") as engine:
        return tokens(engine.generate(PROMPTS, GREEDY)), tokens(engine.generate(PROMPTS, SEEDED))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A front end (mode "mp") with rank 0 here and rank 1 a remote process that serves one engine after another."""
    keys, port = tmp_path_factory.mktemp("remote") / "keys.json", free_port_triple()
    remote = start_rank(keys)  # it waits for the keys file, then joins
    try:
        engine = Engine("builtin", mode="mp", **options(keys, port))
    except BaseException:
        stop_rank(remote, 0)  # the start failed: the rank must not outlive it
        raise
    yield engine, remote, keys
    engine.shutdown()
    stop_rank(remote, 0)


def test_a_remote_rank_gives_the_tokens_of_one_engine(cluster, reference):
    engine, remote, _ = cluster
    greedy, seeded = reference
    assert tokens(engine.generate(PROMPTS, GREEDY)) == greedy
    assert tokens(engine.generate(PROMPTS, SEEDED)) == seeded
    ranks = engine.get_stats()["ranks"]
    assert [rank["data_parallel_rank"] for rank in ranks] == [0, 1]
    assert all(rank["num_generated_tokens"] > 0 for rank in ranks)  # both did work
    assert engine.call_utility("ping", rank=1) == "pong"
    assert engine.client.engine_pids[1] == remote.pid  # rank 1 is the process started by hand


def test_the_keys_file_is_private_and_its_keys_survive_a_restart(cluster, reference):
    engine, remote, keys = cluster
    assert os.stat(keys).st_mode & 0o777 == 0o600
    before = read_keys(keys)
    for _ in range(3):  # the rank's engine ends, and the rank joins the new front end on the same ports
        engine.restart()
        assert engine.call_utility("ping", rank=1) == "pong"
    after = read_keys(keys)
    assert after.curve_server_public == before.curve_server_public and after.input_port == before.input_port
    assert engine.client.engine_pids[1] == remote.pid and remote.poll() is None
    assert tokens(engine.generate(PROMPTS, GREEDY)) == reference[0]


def test_a_peer_without_the_keys_gets_no_answer(cluster):
    _, _, keys = cluster
    watch_port = read_keys(keys).watch_port
    context = zmq.Context()
    try:
        stranger = context.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        stranger.curve_serverkey, stranger.curve_publickey, stranger.curve_secretkey = public, public, secret
        stranger.connect(f"tcp://127.0.0.1:{watch_port}")
        stranger.send(msgspec.msgpack.encode(RankJoin(PROTOCOL, SCHEMA, 1, os.getpid(), "stranger")))
        assert not stranger.poll(1000)  # the CURVE handshake never completes: nothing in, nothing out
        plain = context.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://127.0.0.1:{watch_port}")
        plain.send(msgspec.msgpack.encode(RankJoin(PROTOCOL, SCHEMA, 1, os.getpid(), "plain")))
        assert not plain.poll(500)
    finally:
        context.destroy(linger=0)


def test_a_rank_this_front_end_does_not_have_is_refused(cluster):
    _, _, keys = cluster
    wrong = start_rank(keys, 5)
    output = stop_rank(wrong, JOIN_TIMEOUT_S)
    assert wrong.returncode == 2, output
    assert "rank 5 is not a remote rank of this front end (those are [1])" in output


def test_killing_the_remote_rank_is_the_engines_death_and_a_new_one_rejoins(tmp_path, reference):
    keys, port = tmp_path / "keys.json", free_port_triple()
    remote = start_rank(keys)
    engine = Engine("builtin", mode="async", **options(keys, port))
    replacement = None
    try:
        local_pid = engine.client.engine_pids[0]
        worker, outcome = in_thread(lambda: engine.generate(PROMPTS[:4], LONG))
        wait_until_generating(engine)
        os.kill(remote.pid, signal.SIGKILL)
        worker.join(HANG_GUARD_S)
        assert not worker.is_alive(), "generate still waits after the remote rank died"
        with pytest.raises(
            EngineDeadError, match=rf"engine rank 1: .*connection from .* \(pid {remote.pid}\) closed"
        ):
            raise outcome[0]
        with pytest.raises(EngineDeadError, match="engine rank 1"):
            engine.call_utility("ping", rank=0)
        replacement = start_rank(keys)
        engine.restart()
        assert engine.client.engine_pids[1] == replacement.pid
        assert wait_gone([local_pid]) == []
        assert tokens(engine.generate(PROMPTS, GREEDY)) == reference[0]
    finally:
        engine.shutdown()
        stop_rank(remote, 0)
        if replacement is not None:
            stop_rank(replacement, 0)


def test_a_remote_rank_that_never_comes_fails_the_start_and_leaves_nothing(tmp_path):
    keys, port = tmp_path / "keys.json", free_port_triple()
    # The deadline it waited out is the one given (named in the message), not the fixture's 90 s.
    with pytest.raises(
        EngineStartupError,
        match=r"engine rank 1: .*within startup_timeout=3.0s \(stuck in join .*--keys .*keys.json --rank 1",
    ):
        Engine("builtin", mode="mp", **options(keys, port, startup_timeout=3.0))
    with Engine(
        "builtin", mode="mp", address=f"tcp://127.0.0.1:{port}"
    ) as engine:  # the ports are free again
        assert engine.call_utility("ping") == "pong"


class _NewerJoin(msgspec.Struct, tag="hello", array_like=True):
    """The join of a later release: the same first fields, another schema, and a field this one lacks."""

    protocol: int
    schema: str
    rank: int
    pid: int
    hostname: str
    new_option: str = "from a later release"


def _crafted_peer(keys_path, join, result):
    """A remote rank of another release, over the real watch socket: sends ``join``, keeps the reply."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not os.path.exists(keys_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    keys = read_keys(keys_path)
    context = zmq.Context()
    try:
        peer = context.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        curve_client(peer, keys)
        peer.connect(f"tcp://127.0.0.1:{keys.watch_port}")
        peer.send(msgspec.msgpack.encode(join))
        if peer.poll(int(JOIN_TIMEOUT_S * 1000)):
            result.append(msgspec.msgpack.decode(peer.recv(), type=JoinRefused))
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize(
    ("join", "theirs"),
    [
        (
            _NewerJoin(PROTOCOL, "0" * 12, 1, 4242, "newer-host"),
            f"wire protocol {PROTOCOL} (schema {'0' * 12})",
        ),
        (
            _NewerJoin(PROTOCOL + 1, SCHEMA, 1, 4242, "newer-host"),
            f"wire protocol {PROTOCOL + 1} (schema {SCHEMA})",
        ),
        (LegacyRankJoin(1, 4242, "older-host"), "wire protocol 1 (schema unversioned)"),
    ],
    ids=["newer-schema", "newer-protocol", "unversioned"],
)
def test_a_remote_rank_of_another_wire_version_fails_the_start_naming_both_versions(tmp_path, join, theirs):
    keys, port = tmp_path / "keys.json", free_port_triple()
    reply: list[JoinRefused] = []
    peer = threading.Thread(target=_crafted_peer, args=(keys, join, reply), daemon=True)
    peer.start()
    ours = f"wire protocol {PROTOCOL} (schema {SCHEMA})"
    with pytest.raises(EngineStartupError, match="engine rank 1: ") as failure:
        Engine("builtin", mode="mp", **options(keys, port))
    peer.join(JOIN_TIMEOUT_S)
    message = str(failure.value)
    assert f"remote rank 1 speaks {theirs}, this front end {ours}" in message, message
    assert failure.value.phase.startswith("join")
    # The peer was told why, in the one reply every release decodes.
    assert len(reply) == 1 and theirs in reply[0].reason and ours in reply[0].reason and not reply[0].retry


def test_shutdown_with_a_remote_rank_leaves_nothing_behind(tmp_path, reference, caplog):
    caplog.set_level(logging.INFO, logger="enginekit")
    keys, port = tmp_path / "keys.json", free_port_triple()
    Launcher.shared()
    before = snapshot()
    remote = start_rank(keys, 1, "--once")
    engine = Engine("builtin", mode="mp", **options(keys, port))
    local_pid = engine.client.engine_pids[0]
    assert tokens(engine.generate(PROMPTS, GREEDY)) == reference[0]
    engine.shutdown()
    output = stop_rank(remote)
    assert remote.returncode == 0 and "shut down by its front end" in output, output
    assert wait_gone([local_pid]) == []
    diff = wait_until_clean(
        before, timeout=HANG_GUARD_S
    )  # the watch thread, its socket, pipes and monitor included
    assert not diff.leaks(), diff.leaks()
    # The remote rank was told to go: its hang-up is news for the log, not a warning, even when it hangs up
    # while the front end still waits for the local rank.
    hang_ups = [r for r in caplog.records if "hung up" in r.getMessage()]
    assert hang_ups and all(r.levelno == logging.INFO for r in hang_ups), [r.levelname for r in hang_ups]


def test_a_remote_rank_that_fails_to_start_sends_its_error_to_the_front_end(tmp_path):
    keys, port = tmp_path / "keys.json", free_port_triple()
    remote = start_rank(keys, 1, "--once", "--device", "cuda")  # this machine has no GPU: its load fails
    try:
        with pytest.raises(EngineStartupError) as failure:
            Engine("builtin", mode="mp", **options(keys, port))
        message = str(failure.value)
        assert "engine rank 1: engine startup failed" in message, message
        assert "exited with code 1" in message and "CUDA" in message.splitlines()[0], message
        assert "Last engine output:" in message and "engine core failed" in failure.value.error_tail
    finally:
        output = stop_rank(remote)
    assert remote.returncode == 1, output


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny checkpoint, a copy of it under another path (as on another host), and a different model."""
    root = tmp_path_factory.mktemp("models")
    original = build_checkpoint(root / "original")
    copy = shutil.copytree(original, root / "copy")
    other = build_checkpoint(root / "other", num_layers=3)
    return original, copy, other


def test_a_remote_rank_loads_the_same_model_from_its_own_path(tmp_path, checkpoints):
    original, copy, _ = checkpoints
    with Engine(str(original), mode="mp") as one:
        expected = tokens(one.generate(PROMPTS, GREEDY))
    keys, port = tmp_path / "keys.json", free_port_triple()
    remote = start_rank(keys, 1, "--once", "--model", str(copy))
    try:
        with Engine(str(original), mode="mp", **options(keys, port)) as engine:
            assert tokens(engine.generate(PROMPTS, GREEDY)) == expected
            assert all(rank["num_generated_tokens"] > 0 for rank in engine.get_stats()["ranks"])
    finally:
        output = stop_rank(remote)
    assert remote.returncode == 0, output


def test_a_remote_rank_with_another_model_fails_the_start_naming_the_difference(tmp_path, checkpoints):
    original, _, other = checkpoints
    keys, port = tmp_path / "keys.json", free_port_triple()
    remote = start_rank(keys, 1, "--once", "--model", str(other))
    try:
        with pytest.raises(EngineStartupError) as failure:
            Engine(str(original), mode="mp", **options(keys, port))
        message = str(failure.value)
        assert message.startswith("engine rank 1: the engine loaded another model than the front end's"), (
            message
        )
        assert "--model must be the same model" in message and "num_layers 3 (front end: 2)" in message, (
            message
        )
        assert failure.value.phase == "model check"
    finally:
        output = stop_rank(remote)
    assert remote.returncode == 0, output  # its front end went away: with --once it exits


FRONT_END = """
import sys, time
from enginekit import Engine
engine = Engine("builtin", mode="mp", data_parallel_size=2, data_parallel_size_local=1,
                address=sys.argv[1], data_parallel_keys=sys.argv[2], startup_timeout=180)
print("ready", engine.client.engine_pids[0], flush=True)
time.sleep(600)
"""


def test_a_front_end_that_dies_stops_the_remote_engine(tmp_path):
    keys, port = tmp_path / "keys.json", free_port_triple()
    remote = start_rank(keys, 1, "--once")
    front_end = subprocess.Popen(
        [sys.executable, "-c", FRONT_END, f"tcp://127.0.0.1:{port}", str(keys)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = front_end.stdout.readline().split()
        assert line and line[0] == "ready", "the front end did not start"
        local_pid = int(line[1])
        os.kill(front_end.pid, signal.SIGKILL)
        output = stop_rank(remote, HANG_GUARD_S, signal.SIGKILL)
        assert remote.returncode == 0, output  # its engine shut down when the front end's connection dropped
        assert "lost the front end" in output
        assert wait_gone([local_pid]) == []
    finally:
        stop_rank(front_end, 0, signal.SIGKILL)
        stop_rank(remote, 0, signal.SIGKILL)


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ({"address": None}, r"connect over TCP to a fixed port: give address='tcp://HOST:PORT', got None"),
        ({"address": "tcp://127.0.0.1:0"}, r"to a fixed port"),
        ({"data_parallel_keys": None}, r"remote ranks need data_parallel_keys"),
        (
            {"data_parallel_size_local": 3},
            r"data_parallel_size_local must be in \[0, data_parallel_size=2\], got 3",
        ),
        ({"data_parallel_rank": 1}, r"cannot be combined with data_parallel_rank"),
        ({"data_parallel_size_local": None}, r"data_parallel_keys is for remote ranks"),
    ],
)
def test_bad_remote_rank_options_fail_before_anything_starts(tmp_path, more, message):
    with pytest.raises(ValueError, match=message):
        Engine("builtin", mode="mp", **options(tmp_path / "keys.json", 40000, **more))
    assert not (tmp_path / "keys.json").exists()


class _StepByStep(RankWatcher):
    """The watcher without its thread: the test reads the socket and the monitor in the order a busy watcher
    thread may."""

    def _run(self):
        pass


class _WatchSocket:
    """A watch ROUTER on loopback TCP, two remote ranks (0 and 1) and a ``_StepByStep`` watcher over them."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.ranks = [RemoteRank(rank, "keys.json") for rank in (0, 1)]
        for rank in self.ranks:
            rank.start(
                EngineProcArgs(EngineConfig(), "tcp://front:1", "tcp://front:2", engine_index=rank.rank)
            )
        self.watcher = _StepByStep(self.router, self.ranks)
        self._peers: list[zmq.Socket] = []

    def join(self, rank: int) -> zmq.Socket:
        """A rank's connection, which has sent its RankJoin."""
        peer = self.context.socket(zmq.DEALER)
        self._peers.append(peer)
        peer.connect(f"tcp://127.0.0.1:{self.port}")
        peer.send(
            msgspec.msgpack.encode(
                RankJoin(PROTOCOL, SCHEMA, rank=rank, pid=os.getpid(), hostname=f"host-{rank}")
            )
        )
        return peer

    def close(self) -> None:
        self.watcher.close()
        for rank in self.ranks:
            rank.stop(0)
        for peer in (*self._peers, self.router):
            peer.close(linger=0)
        self.context.term()


@pytest.fixture
def watch():
    watch = _WatchSocket()
    try:
        yield watch
    finally:
        watch.close()


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("read_first", ["join", "hang-up"])
def test_a_hang_up_and_a_join_on_its_reused_fd_are_told_apart_in_either_order(watch, read_first):
    # Rank 0 hangs up; rank 1's connection gets the fd rank 0's had. The watcher reads two queues, so it may
    # read rank 1's join before rank 0's hang-up, or the hang-up first and the join while it drains the socket.
    # Either way rank 0's hang-up must not mark rank 1 gone.
    router, ranks, watcher = watch.router, watch.ranks, watch.watcher
    before = _open_fds()
    first = watch.join(0)
    assert router.poll(POLL_GUARD_MS)
    watcher._on_message(router.recv_multipart(copy=False))
    [reused_fd] = watcher._by_fd
    first.close(linger=0)
    assert watcher._monitor.poll(POLL_GUARD_MS)  # the hang-up is reported, and not read yet
    # Both ends of the first connection close in zmq's IO thread.
    wait_for(lambda: _open_fds() <= before, what="the first connection's fds closing")
    second = watch.join(1)  # the lowest free fds again: its own end, then the accepted one
    assert router.poll(POLL_GUARD_MS)
    if read_first == "join":
        frames = router.recv_multipart(copy=False)
        assert frames[-1].get(zmq.SRCFD) == reused_fd  # the case under test: the fd was reused
        watcher._on_message(frames)
    else:
        assert router.getsockopt(zmq.EVENTS) & zmq.POLLIN  # the join waits in the socket
    while watcher._monitor.poll(200):
        watcher._on_event(recv_monitor_message(watcher._monitor))
    assert not ranks[0].is_alive()
    assert ranks[1].is_alive() and ranks[1].joined
    assert watcher._by_fd == {reused_fd: ranks[1]}  # the case under test: the fd was reused
    second.close(linger=0)
    assert watcher._monitor.poll(POLL_GUARD_MS)
    watcher._on_event(recv_monitor_message(watcher._monitor))
    assert not ranks[1].is_alive()  # and its own hang-up is still seen


def test_a_ranks_exit_code_reaches_its_death_message_when_another_ranks_join_is_read_first(watch):
    # Rank 0's engine fails: it sends its exit code, then hangs up. The ROUTER fair-queues its connections, so
    # rank 1's join may be read first; handling it applies rank 0's hang-up, which must not outrun rank 0's
    # RankExit, still unread in the socket: the death message names the exit code.
    router, ranks, watcher = watch.router, watch.ranks, watch.watcher
    first = watch.join(0)
    assert router.poll(POLL_GUARD_MS)
    watcher._on_message(router.recv_multipart(copy=False))
    watch.join(1)
    assert router.poll(POLL_GUARD_MS)
    join = router.recv_multipart(copy=False)  # read, not yet handled: the watcher is busy
    first.send(msgspec.msgpack.encode(RankExit(code=3, error_tail="Traceback: boom")))
    first.close(linger=0)
    assert watcher._monitor.poll(POLL_GUARD_MS)  # the hang-up is reported, and not read yet
    assert router.poll(POLL_GUARD_MS)  # so is the exit, sent before it
    watcher._on_message(join)
    assert ranks[1].is_alive() and ranks[1].joined
    assert not ranks[0].is_alive()
    assert "exited with code 3" in ranks[0].describe_exit()


def test_a_new_config_option_changes_the_wire_schema():
    # EngineConfig travels whole to a remote rank, so an option one release has and the other lacks must make
    # their versions differ (and the join refused), while a changed default or docstring must not.
    import msgspec.inspect

    from enginekit.wire.version import _shape, wire_schema

    class WithOption(EngineConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
        new_option: int = 0

    def shape(cls):
        return _shape(msgspec.inspect.type_info(cls), set())[4]

    class OtherDefault(EngineConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
        startup_timeout: float = 1.0

    assert shape(WithOption) != shape(EngineConfig)
    assert shape(OtherDefault) == shape(EngineConfig)
    assert [field[0] for field in shape(EngineConfig)] == list(EngineConfig.__struct_fields__)
    assert msgspec.json.encode(wire_schema()) == msgspec.json.encode(wire_schema())  # stable within a release
    assert len(SCHEMA) == 12
