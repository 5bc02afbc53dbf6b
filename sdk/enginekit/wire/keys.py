"""The keys file of remote ranks, and the CURVE and heartbeat settings of the sockets they use.

The front end writes the file (``RemoteRankKeys`` as JSON, mode 0600) and the user copies it to each remote
rank's host: it holds the front end's ports and CURVE key pairs, so treat it like a password.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import zmq

from enginekit.wire.messages import RemoteRankKeys

HEARTBEAT_MS = (1000, 3000)  # interval and timeout: a peer silent this long is gone


def write_keys(path: str | os.PathLike[str], keys: RemoteRankKeys) -> None:
    """Write the keys file readable by this user only, atomically (a rank may be reading the old one)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(msgspec.json.format(msgspec.json.encode(keys)))
    os.replace(partial, path)


def read_keys(path: str | os.PathLike[str]) -> RemoteRankKeys:
    """The keys file; ``ValueError`` names the file when it is not one."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=RemoteRankKeys)
    except msgspec.DecodeError as error:
        raise ValueError(f"{path} is not an enginekit keys file: {error}") from None


def new_keys(host: str, input_port: int) -> RemoteRankKeys:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return RemoteRankKeys(
        host,
        input_port,
        input_port + 1,
        input_port + 2,
        server_public.decode(),
        server_secret.decode(),
        client_public.decode(),
        client_secret.decode(),
    )


def curve_client(socket: zmq.Socket, keys: RemoteRankKeys) -> None:
    socket.curve_serverkey = keys.curve_server_public.encode()
    socket.curve_publickey = keys.curve_client_public.encode()
    socket.curve_secretkey = keys.curve_client_secret.encode()


def set_heartbeats(socket: zmq.Socket) -> None:
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS[0])
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_MS[1])
