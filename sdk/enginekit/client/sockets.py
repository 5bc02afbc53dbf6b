"""EngineSockets: the front end's two bound sockets, over private IPC or protected TCP, for all its engines.

Every engine of one front end (one per data-parallel rank) connects to the same two sockets: requests go out
through the ROUTER to the rank's identity, and every rank's outputs come back on the one PULL socket. IPC
sockets live in a private run folder (mode 0700, removed when closed), so no two front ends collide and no other
user can connect. TCP binds loopback unless an address names another host; then a per-engine CURVE key pair
protects both sockets, and only the engine processes receive the client keys. With external load balancing
(``data_parallel_rank=r``) a TCP port is offset by ``2 * r``, so the ranks' front ends can share one address.
With remote ranks (``data_parallel_size_local``) a third socket, the watch ROUTER, binds the port after the
output's, and the keys come from the ``data_parallel_keys`` file (created on first use, kept afterwards, so a
copy on another host stays valid across restarts); the file is rewritten with the ports bound. A monitor of the
output socket (``output_hang_ups``) reports each connection's end, after what it carried is queued: the
receivers read an engine's last message before they report its exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket as socket_module
import tempfile

import msgspec
import zmq

from enginekit.config import EngineConfig
from enginekit.errors import EngineStartupError
from enginekit.wire.keys import new_keys, read_keys, set_heartbeats, write_keys
from enginekit.wire.messages import RemoteRankKeys

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class EngineSockets:
    def __init__(self, config: EngineConfig, *, ray_host: str | None = None) -> None:
        self.run_dir = tempfile.mkdtemp(prefix="enginekit-")  # mode 0700: private to this user
        self.context = zmq.Context(io_threads=1)
        self.input = self.context.socket(zmq.ROUTER)
        self.output = self.context.socket(zmq.PULL)
        for socket in (self.input, self.output):
            socket.setsockopt(zmq.LINGER, 0)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output.setsockopt(zmq.RCVHWM, config.max_pending_outputs)
        self.output_hang_ups = self.output.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.curve_client_keys: tuple[bytes, bytes, bytes] = (b"", b"", b"")
        self.watch: zmq.Socket | None = None  # remote ranks join and are watched here
        self.remote_keys: RemoteRankKeys | None = None  # what a rank placed by Ray is handed
        try:
            if ray_host is not None:
                self._bind_for_ray(ray_host, config.address)
            elif config.address is None or config.address.startswith("ipc://"):
                base = f"ipc://{self.run_dir}/" if config.address is None else config.address
                self.input_address, self.output_address = base + "input.sock", base + "output.sock"
                self.input.bind(self.input_address)
                self.output.bind(self.output_address)
            elif config.data_parallel_remote_ranks:
                assert config.data_parallel_keys is not None  # the config checked it
                self._bind_for_remote_ranks(config.address, config.data_parallel_keys)
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
            _curve_server((self.input, self.output), server_public, server_secret)
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

    def _bind_for_remote_ranks(self, address: str, keys_path: str) -> None:
        """Fixed ports (input, output, watch), and the keys of the keys file (new ones if there is none)."""
        if not zmq.has("curve"):
            raise EngineStartupError(
                "remote ranks need CURVE to protect their TCP sockets, and this libzmq has none",
                phase="spawn",
            )
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        host = host or "127.0.0.1"
        try:
            keys = read_keys(keys_path) if os.path.exists(keys_path) else None
        except (OSError, ValueError) as error:
            raise EngineStartupError(f"cannot read data_parallel_keys: {error}", phase="spawn") from error
        announced = socket_module.gethostname() if host in ("0.0.0.0", "*", "[::]") else host
        fresh = new_keys(announced, int(port))
        if keys is not None:  # the same keys, at this front end's host and ports
            ports = {name: getattr(fresh, name) for name in ("input_port", "output_port", "watch_port")}
            fresh = msgspec.structs.replace(keys, host=announced, **ports)
        keys = fresh
        self._bind_watched(host, keys)
        try:
            write_keys(keys_path, keys)
        except OSError as error:
            raise EngineStartupError(f"cannot write data_parallel_keys: {error}", phase="spawn") from error

    def _bind_watched(self, host: str, keys: RemoteRankKeys) -> None:
        """The input, output and watch sockets at the keys' ports, protected by their CURVE keys."""
        self.watch = self.context.socket(zmq.ROUTER)
        self.watch.setsockopt(zmq.LINGER, 0)
        set_heartbeats(self.watch)
        _curve_server(
            (self.input, self.output, self.watch),
            keys.curve_server_public.encode(),
            keys.curve_server_secret.encode(),
        )
        self.curve_client_keys = (
            keys.curve_server_public.encode(),
            keys.curve_client_public.encode(),
            keys.curve_client_secret.encode(),
        )
        self.input_address = f"tcp://{host}:{keys.input_port}"
        self.output_address = f"tcp://{host}:{keys.output_port}"
        self.input.bind(self.input_address)
        self.output.bind(self.output_address)
        self.watch.bind(f"tcp://{host}:{keys.watch_port}")

    def _bind_for_ray(self, host: str, address: str | None) -> None:
        """Ranks placed by Ray join like remote ranks, with keys handed to them (no file): fresh keys, and
        the ports of ``address`` (input, output, watch) or free ones."""
        if not zmq.has("curve"):
            raise EngineStartupError(
                "Ray ranks need CURVE to protect their TCP sockets, and this libzmq has none", phase="spawn"
            )
        port = int((address or "").rpartition(":")[2] or 0)
        if not port:
            port = _free_port_triple(host)
        keys = new_keys(host, port)
        self._bind_watched(host, keys)
        self.remote_keys = keys

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.output.disable_monitor()
        self.output_hang_ups.close(linger=0)
        for socket in (self.input, self.output, self.watch):
            if socket is not None:
                socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _free_port_triple(host: str) -> int:
    """A port whose next two are free as well, on ``host`` (a race with other binders fails the bind)."""
    for _ in range(100):
        with socket_module.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base > 65000:
            continue
        held: list[socket_module.socket] = []
        try:
            for port in (base, base + 1, base + 2):
                held.append(socket_module.socket())
                held[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for probe in held:
                probe.close()
    raise EngineStartupError(f"no three free ports in a row on {host}", phase="spawn")


def _curve_server(sockets: tuple[zmq.Socket, ...], public: bytes, secret: bytes) -> None:
    for socket in sockets:
        socket.curve_server = True
        socket.curve_secretkey = secret
        socket.curve_publickey = public
