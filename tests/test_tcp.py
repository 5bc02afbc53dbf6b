"""TCP mode: the front end's two sockets on loopback ports, guarded by a per-engine CURVE key pair.

A peer that does not hold the engine's keys completes no handshake: it can neither send requests (a SHUTDOWN,
a fake EngineDead) nor read anything, and the engine serves on undisturbed.
"""

import ipaddress

import msgspec
import psutil
import pytest
import zmq

from enginekit import Engine, SamplingParams
from enginekit.wire.messages import (
    AbortRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    ShutdownRequest,
    UtilityRequest,
    engine_identity,
)

PROMPTS = ["over tcp", "a second prompt, a little longer"]
GREEDY = SamplingParams(max_tokens=10, temperature=0)
LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)  # outlives the rogues' attempts
ROGUE_WAIT_MS = 500


@pytest.fixture(scope="module")
def reference():
    with Engine("builtin", mode="mp") as engine:  # private IPC sockets
        long = engine.generate(PROMPTS[1], LONG)[0].outputs[0].token_ids
        return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, GREEDY)], long


@pytest.fixture(scope="module")
def tcp_engine():
    with Engine("builtin", mode="mp", address="tcp://127.0.0.1:0") as engine:
        yield engine


def tokens(engine):
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, GREEDY)]


def port_of(address):
    return int(address.rpartition(":")[2])


def listening_hosts(ports):
    """The local addresses this process listens on for these TCP ports."""
    return {
        conn.laddr.ip
        for conn in psutil.Process().net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports
    }


def test_tcp_mode_serves_like_ipc(tcp_engine, reference):
    assert tcp_engine.client.sockets.input_address.startswith("tcp://")
    short, long = reference
    assert tokens(tcp_engine) == short
    streamed = list(tcp_engine.stream(PROMPTS[1], LONG))[-1]
    assert streamed.outputs[0].token_ids == long
    assert tcp_engine.ping()


def test_an_address_without_host_binds_loopback_only():
    with Engine("builtin", mode="mp", address="tcp://:0") as engine:
        ports = {port_of(engine.client.sockets.input_address), port_of(engine.client.sockets.output_address)}
        hosts = listening_hosts(ports)
        assert hosts and all(ipaddress.ip_address(host).is_loopback for host in hosts), hosts
        assert engine.ping()


def rogue(context, kind, address, *, curve):
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if kind == zmq.DEALER:
        socket.setsockopt(zmq.IDENTITY, engine_identity(0))  # pretend to be the engine
    if curve:  # its own keys, and a guess at the server's
        socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()
        socket.curve_serverkey = zmq.curve_keypair()[0]
    socket.connect(address)
    return socket


def send_if_possible(socket, frames):
    try:
        socket.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass  # no pipe to queue on: the peer refused the connection


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "wrong-key"])
def test_rogue_peer_without_the_secret_gets_nothing_through(tcp_engine, reference, curve):
    client = tcp_engine.client
    context = zmq.Context()
    try:
        requester = rogue(context, zmq.DEALER, client.sockets.input_address, curve=curve)
        injector = rogue(context, zmq.PUSH, client.sockets.output_address, curve=curve)
        short, long = reference
        stream = tcp_engine.stream(PROMPTS[1], LONG)
        first = next(stream)  # a request is running while the rogues act
        for message in (
            [msgspec.msgpack.encode(ShutdownRequest(0.0))],
            [msgspec.msgpack.encode(UtilityRequest(1, "ping", []))],
            [msgspec.msgpack.encode(AbortRequest([first.request_id]))],
        ):
            send_if_possible(requester, message)
        fake = EngineCoreOutputs([EngineCoreOutput(first.request_id, [1], finish_reason="abort")])
        for frames in ([msgspec.msgpack.encode(EngineDead("fake"))], [msgspec.msgpack.encode(fake)]):
            send_if_possible(injector, frames)
        assert requester.poll(ROGUE_WAIT_MS) == 0, "the rogue received something from the front end"
        last = list(stream)[-1]
        assert last.outputs[0].token_ids == long  # neither aborted nor faked
        assert last.outputs[0].finish_reason == "length"
        assert tcp_engine.is_running and tcp_engine.ping()
        assert tokens(tcp_engine) == short
    finally:
        context.destroy(linger=0)
