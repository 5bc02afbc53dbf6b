"""EngineSockets: the front end's two bound sockets, over private IPC or protected TCP, for all its engines.

Every engine of one front end (one per data-parallel rank) connects to the same two sockets: requests go out
through the ROUTER to the rank's identity, and every rank's outputs come back on the one PULL socket. IPC
sockets live in a private run folder (mode 0700, removed when closed), so no two front ends collide and no other
user can connect. TCP binds loopback unless an address names another host; then a per-engine CURVE key pair
protects both sockets, and only the engine processes receive the client keys. With external load balancing
(``data_parallel_rank=r``) a TCP port is offset by ``2 * r``, so the ranks' front ends can share one address.
"""

from __future__ import annotations

import shutil
import tempfile

import zmq

from enginekit.config import EngineConfig
from enginekit.errors import EngineStartupError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class EngineSockets:
    def __init__(self, config: EngineConfig) -> None:
        self.run_dir = tempfile.mkdtemp(prefix="enginekit-")  # mode 0700: private to this user
        self.context = zmq.Context(io_threads=1)
        self.input = self.context.socket(zmq.ROUTER)
        self.output = self.context.socket(zmq.PULL)
        for socket in (self.input, self.output):
            socket.setsockopt(zmq.LINGER, 0)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output.setsockopt(zmq.RCVHWM, config.max_pending_outputs)
        self.curve_client_keys: tuple[bytes, bytes, bytes] = (b"", b"", b"")
        try:
            if config.address is None or config.address.startswith("ipc://"):
                base = f"ipc://{self.run_dir}/" if config.address is None else config.address
                self.input_address, self.output_address = base + "input.sock", base + "output.sock"
                self.input.bind(self.input_address)
                self.output.bind(self.output_address)
            else:
                self._bind_tcp(config.address, 2 * (config.data_parallel_rank or 0))
        except zmq.ZMQError as error:
            self.close()
            raise EngineStartupError(
                f"cannot bind the engine's sockets at {config.address or 'a private IPC folder'}: {error}",
                phase="spawn",
            ) from error
        except BaseException:
            self.close()
            raise

    def _bind_tcp(self, address: str, port_offset: int) -> None:
        host, colon, port = address.removeprefix("tcp://").rpartition(":")
        if colon and not host:
            host = "127.0.0.1"  # no host named: loopback, never every interface
        if not host or not port.isdigit():
            raise ValueError(
                f"address must look like tcp://HOST:PORT or tcp://:PORT (loopback), got {address!r}"
            )
        if zmq.has("curve"):
            # NOTE: a per-engine CURVE key pair is the secret: a peer that does not know the server key
            # never completes the handshake, so it can neither send requests nor read outputs.
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            for socket in (self.input, self.output):
                socket.curve_server = True
                socket.curve_secretkey = server_secret
                socket.curve_publickey = server_public
            self.curve_client_keys = (server_public, client_public, client_secret)
        elif host not in LOOPBACK_HOSTS:
            raise EngineStartupError(
                f"refusing to bind {address}: this libzmq has no CURVE support to protect a non-loopback endpoint",
                phase="spawn",
            )
        addresses = []
        if port != "0":
            port = str(int(port) + port_offset)
        for socket in (self.input, self.output):
            if port == "0":
                bound = socket.bind_to_random_port(f"tcp://{host}")
                addresses.append(f"tcp://{host}:{bound}")
            else:
                socket.bind(f"tcp://{host}:{port}")
                addresses.append(f"tcp://{host}:{port}")
                port = str(int(port) + 1)
        self.input_address, self.output_address = addresses

    def close(self) -> None:
        for socket in (self.input, self.output):
            socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
